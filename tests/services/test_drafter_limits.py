"""A drafter keeps bounded state whatever its callers send (issue 14): k is clamped to its max,
a history over --max-history-tokens gets no drafts and no state, and past --max-sequences or
--max-total-tokens the least recently used sequences are forgotten. A real `specd drafter`
process (ngram) driven over its Propose stream, with the drafter token of a shared secret."""
from __future__ import annotations

import queue
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.rpc import auth
from specd.v1 import drafter_pb2 as dpb
from specd.v1 import drafter_pb2_grpc as dpbg

SECRET = "drafter-limits-secret"
SECURITY = auth.Security(secret=SECRET)
# A repeating history: ngram always has a match, so every in-bounds entry gets drafts.
HISTORY = [7, 8, 9, 10, 11] * 20


@pytest.fixture(scope="module")
def drafter(launcher):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(auth.TOKEN_ENV, SECRET)
        port = launcher.free_port()
        service = launcher.start("drafter", "drafter", [
            "--method", "ngram", "--num-speculative-tokens", "4", "--max-history-tokens", "1000",
            "--max-sequences", "4", "--max-total-tokens", "2000", "--metrics-port", str(port)])
    service.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return service


def kept(drafter) -> tuple[int, int]:
    """(sequences, history tokens) the drafter keeps, from its /metrics."""
    text = urllib.request.urlopen(drafter.metrics_url, timeout=10).read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return int(values["specd_drafter_sequences"]), int(values["specd_drafter_history_tokens"])


class Stream:
    """One Propose stream: send a batch, get its reply."""

    def __init__(self, address: str):
        self.channel = auth.sync_channel(address, SECURITY, auth.DRAFTER, options=[
            ("grpc.max_send_message_length", 64 << 20)])
        self.outbox: queue.Queue = queue.Queue()
        self.replies = dpbg.DrafterStub(self.channel).Propose(iter(self.outbox.get, None), timeout=120)
        self.batch_id = 0

    def ask(self, *entries: dpb.ProposeEntry) -> dict[int, dpb.Proposal]:
        self.batch_id += 1
        self.outbox.put(dpb.ProposeBatch(client_id="test", batch_id=self.batch_id, entries=entries))
        reply = next(self.replies)
        assert reply.batch_id == self.batch_id
        return {p.seq_id: p for p in reply.proposals}

    def close(self):
        self.outbox.put(None)
        self.channel.close()


def full(seq_id: int, history: list[int], k: int = 4) -> dpb.ProposeEntry:
    return dpb.ProposeEntry(seq_id=seq_id, new_tokens=history, num_tokens=len(history), k=k, full_history=True)


def delta(seq_id: int, new: list[int], num_tokens: int, k: int = 4) -> dpb.ProposeEntry:
    return dpb.ProposeEntry(seq_id=seq_id, new_tokens=new, num_tokens=num_tokens, k=k)


def test_info_states_the_limits_and_needs_the_drafter_token(drafter):
    stub = dpbg.DrafterStub(auth.sync_channel(drafter.address, SECURITY, auth.DRAFTER))
    info = stub.Info(dpb.DrafterInfoRequest(), timeout=30)
    assert info.max_k == 4 and info.max_history_tokens == 1000 and not info.proof
    # The verifier's token does not open a drafter (and no token, or a wrong one, opens nothing).
    for security in (auth.Security(), auth.Security(secret="wrong")):
        with pytest.raises(grpc.RpcError) as e:
            dpbg.DrafterStub(auth.sync_channel(drafter.address, security, auth.DRAFTER)).Info(
                dpb.DrafterInfoRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel = grpc.insecure_channel(drafter.address)
    with pytest.raises(grpc.RpcError) as e:
        dpbg.DrafterStub(channel).Info(dpb.DrafterInfoRequest(), timeout=30,
                                       metadata=[("authorization", f"Bearer {auth.token(SECRET, auth.VERIFIER)}")])
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_k_is_clamped_to_the_drafters_max(drafter):
    s = Stream(drafter.address)
    try:
        p = s.ask(full(1, HISTORY, k=1000))[1]
        assert 0 < len(p.token_ids) <= 4
    finally:
        s.close()


def test_an_overlong_history_gets_no_drafts_and_no_state(drafter):
    s = Stream(drafter.address)
    try:
        s.ask(full(2, HISTORY))
        before = kept(drafter)
        assert before[1] >= len(HISTORY)
        long = HISTORY * 11  # 1100 tokens > 1000
        p = s.ask(full(3, long))[3]
        assert list(p.token_ids) == [] and not p.resync
        assert kept(drafter) == before  # nothing kept
        p = s.ask(delta(2, HISTORY * 10, len(HISTORY) * 11))[2]  # growing past the bound by deltas
        assert list(p.token_ids) == [] and kept(drafter) == (before[0] - 1, before[1] - len(HISTORY))
        assert s.ask(delta(2, [7], len(HISTORY) + 1))[2].resync  # it was forgotten
    finally:
        s.close()


def test_least_recently_used_sequences_go_past_the_bounds(drafter):
    s = Stream(drafter.address)
    try:
        for sid in range(10, 16):  # six sequences, the drafter keeps four
            assert len(s.ask(full(sid, HISTORY))[sid].token_ids) > 0
        n = len(HISTORY)
        assert s.ask(delta(10, [7], n + 1))[10].resync  # the oldest are gone
        assert s.ask(delta(11, [7], n + 1))[11].resync
        assert not s.ask(delta(15, [7], n + 1))[15].resync  # the newest stay
        # Token budget (2000): 950 + 990 tokens push out every other sequence, not just two.
        s.ask(full(20, (HISTORY * 10)[:950]), full(21, (HISTORY * 10)[:990]))
        assert s.ask(delta(15, [8], n + 2))[15].resync
        assert not s.ask(delta(21, [7], 991))[21].resync
        # A batch of more sequences than it keeps: the ones past the bound get no drafts.
        reply = s.ask(*[full(sid, HISTORY) for sid in range(30, 36)])
        assert sum(len(p.token_ids) > 0 for p in reply.values()) == 4
    finally:
        s.close()
