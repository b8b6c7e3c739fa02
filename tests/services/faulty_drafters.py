"""Misbehaving drafters, as real gRPC servers on loopback, for the pool's robustness tests.

They speak the real protocol (Info with the target's vocabulary, the bidi Propose stream)
but answer with garbage, lies or floods, or never answer, or take too long to read a history.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from specd.rpc.auth import drafter_proof
from specd.v1 import drafter_pb2, drafter_pb2_grpc

GARBAGE_MODES = ("out_of_vocab", "negative", "too_many", "wrong_seq_ids", "bad_q", "q_length", "random_ids")
# Hostile rather than broken: a q that lies to get its drafts accepted, a proposal of millions of
# ids, a reply larger than any real one, a flood of replies nobody asked for.
HOSTILE_MODES = ("lying_q", "huge", "oversized", "flood")
LIE = 1e-6  # the q a lying drafter claims for its own draft
CATCH_UP_S = 0.4  # slow_catch_up: the time it takes to read a new history (the deadline is 0.25 s)


class FaultyDrafter(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, mode: str, vocab_size: int, vocab_hash: str, secret: str | None = None):
        self.mode, self.vocab_size, self.vocab_hash, self.secret = mode, vocab_size, vocab_hash, secret
        self.batches = self.catch_ups = 0
        self.stop = threading.Event()
        self.history: dict[tuple[str, int], list[int]] = {}
        if mode == "oversized":  # ~24 MB, built before the first call so every reply comes fast
            self._oversized = drafter_pb2.Proposal(token_ids=[3000] * 12_000_000)

    def Info(self, request, context):
        # With the stack's secret it can prove it holds it (and be trusted): the lying drafter
        # shows what trust without that check would cost.
        proof = drafter_proof(self.secret, request.challenge) if self.secret and request.challenge else b""
        return drafter_pb2.DrafterInfoResponse(name=self.mode, method="ngram", vocab_size=self.vocab_size,
                                               vocab_hash=self.vocab_hash, max_k=8, proof=proof)

    def Release(self, request, context):
        return drafter_pb2.ReleaseResponse()

    def Propose(self, request_iterator, context):
        for batch in request_iterator:
            self.batches += 1
            if self.mode == "hang" and batch.entries:
                self.stop.wait(3600)  # never answers a real batch (answers the empty warm-up)
                return
            if self.mode == "hang_after_catch_up" and any(e.k > 0 and not e.full_history for e in batch.entries):
                self.stop.wait(3600)  # reads histories, then never answers a request for drafts
                return
            if self.mode in ("slow_catch_up", "hang_after_catch_up"):
                yield self._honest(batch, CATCH_UP_S if self.mode == "slow_catch_up" else 0.0)
                continue
            if self.mode in HOSTILE_MODES:
                yield from self._hostile(batch)
            else:
                yield self._answer(batch)

    def _hostile(self, batch):
        out = drafter_pb2.ProposalBatch(batch_id=batch.batch_id)
        if self.mode == "flood" and batch.entries:
            for i in range(1000):  # replies to batches never sent
                yield drafter_pb2.ProposalBatch(batch_id=batch.batch_id + 1000 + i)
        for i, e in enumerate(batch.entries):
            if self.mode == "huge" and i == 0:
                out.proposals.add(seq_id=e.seq_id, token_ids=[3000] * 3_000_000)  # ~6 MB, under the size bound
            elif self.mode == "oversized" and i == 0:
                out.proposals.add().CopyFrom(self._oversized)
                out.proposals[-1].seq_id = e.seq_id
            elif self.mode == "lying_q":
                drafts = self._copy(batch.client_id, e)
                p = out.proposals.add(seq_id=e.seq_id, token_ids=drafts, resync=drafts is None)
                for x in drafts or []:  # "I drew x with probability 1e-6": accepted whenever p(x) > 1e-6
                    p.q.add(ids=[x, (x + 1) % self.vocab_size], probs=[LIE, 1.0 - LIE])
            else:
                out.proposals.add(seq_id=e.seq_id, token_ids=[5] * e.k)
        yield out

    def _copy(self, client: str, e) -> list[int] | None:
        """Drafts that are sometimes right: what followed the last occurrence of the last token."""
        key = (client, e.seq_id)
        if e.full_history:
            self.history[key] = list(e.new_tokens)
        elif key in self.history:
            self.history[key].extend(e.new_tokens)
        else:
            return None  # resync
        h = self.history[key]
        last = h[-1]
        for j in range(len(h) - 2, -1, -1):
            if h[j] == last:
                return (h[j + 1:j + 1 + e.k] + [last] * e.k)[:e.k]
        return [last] * e.k

    def _honest(self, batch, read_s: float):
        """Drafts that are sometimes right; a batch with a new history takes read_s to read (slow_catch_up:
        a model drafter computing a long prompt on a busy core, longer than the propose deadline)."""
        if any(e.full_history for e in batch.entries):
            self.catch_ups += 1
            time.sleep(read_s)
        out = drafter_pb2.ProposalBatch(batch_id=batch.batch_id)
        for e in batch.entries:
            drafts = self._copy(batch.client_id, e)
            out.proposals.add(seq_id=e.seq_id, token_ids=drafts or [], resync=drafts is None)
        return out

    def _answer(self, batch):
        out = drafter_pb2.ProposalBatch(batch_id=batch.batch_id)
        for i, e in enumerate(batch.entries):
            k, v = e.k, self.vocab_size
            tokens = {"out_of_vocab": [v + 7] * k, "negative": [-3] * k, "too_many": [5] * (k + 20),
                      "wrong_seq_ids": [5] * k, "bad_q": [5] * k, "q_length": [5] * k,
                      "random_ids": [(e.seq_id * 31 + j * 17 + self.batches) % v for j in range(k)]}[self.mode]
            seq_id = e.seq_id + 1000 if self.mode == "wrong_seq_ids" else e.seq_id
            p = out.proposals.add(seq_id=seq_id, token_ids=tokens)
            if self.mode == "bad_q":  # not a distribution, and the draft is not in its support
                for _ in tokens:
                    p.q.add(ids=[1, 2], probs=[0.9, 0.9])
            if self.mode == "q_length":  # ids and probs of different lengths
                for _ in tokens:
                    p.q.add(ids=[5, 6], probs=[1.0])
        return out


def start_faulty(mode: str, vocab_size: int, vocab_hash: str, secret: str | None = None):
    """(server, servicer, address); stop with server.stop(0) after servicer.stop.set()."""
    servicer = FaultyDrafter(mode, vocab_size, vocab_hash, secret)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_send_message_length", 64 << 20)])
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    time.sleep(0.05)
    return server, servicer, f"127.0.0.1:{port}"
