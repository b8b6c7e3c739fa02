"""The verifier's drafter pool (docs/architecture.md, "Services"): named drafters, routing, one batched message per
drafter per step (the engine's speculator calls it through pool_proposer.PoolProposer).

Routing: a request may name its drafter; otherwise a sequence stays with the drafter that
holds its state while that one is healthy, else goes to the first healthy drafter in
registration order. Moving to another drafter costs one step's drafts (the new one
answers "resync" and gets the full history next step). A drafter that is slow, dead or
talks nonsense costs drafts, never requests: its answers are bounded (propose_bounds.py),
validated by the speculator, and a missed deadline simply means no drafts this step. Only
trusted drafters' sparse q reach the speculator; everyone else's drafts are verified as one-hot
(docs/architecture.md, "Services": trust and bounds).

Local drafters: an index drafter (suffix, ngram) may also run inside the verifier process
(--local-drafter). It is asked by the engine's speculator itself, before each plan, for every
sequence (a lookup of tens of microseconds against a ~1.8 ms round trip to a service), never
through this pool's streams; the pool only names it among the drafters a request may choose, lists
it, and refuses to register or remove a service under its name.
"""
from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
import uuid
from dataclasses import replace

from specd.rpc.auth import Security
from specd.proposers.base import Proposal, ProposeRequest
from specd.rpc.telemetry import current_traceparent
from specd.v1 import drafter_pb2, verifier_pb2
from specd.verifier.drafter_client import DrafterClient, FeatureTarget
from specd.rpc.wire import MAX_FEATURE_BYTES, propose_entry_to_proto
from specd.verifier.propose_bounds import checked_reply, wire_pieces

log = logging.getLogger("specd.verifier.pool")

DEFAULT_PROPOSE_TIMEOUT_S = 0.25


LOOPBACK = ["127.*:*", "localhost:*", "::1:*"]


class DrafterPool:
    def __init__(self, vocab_size: int, vocab_hash: str, timeout_s: float = DEFAULT_PROPOSE_TIMEOUT_S,
                 metrics=None, security: Security | None = None, allowed_addresses: list[str] | None = None):
        self.vocab_size, self.vocab_hash, self.timeout_s = vocab_size, vocab_hash, timeout_s
        self.security = security or Security()
        # RegisterDrafter makes us connect (and send our drafter token) to an address: only to these.
        self.allowed_addresses = list(allowed_addresses if allowed_addresses is not None else LOOPBACK)
        self.registry = None  # a DrafterRegistry: runtime registrations outlive a restart
        self.client_id = uuid.uuid4().hex  # scopes our sequence ids at drafters shared by several verifiers
        self.drafters: dict[str, DrafterClient] = {}
        self.local: dict[str, object] = {}  # in-process index drafters by name (module docstring)
        self.seq_drafter: dict[int, str] = {}  # where each sequence's drafter-side state lives
        self.seq_choice: dict[int, str] = {}  # a request's own drafter choice
        self.metrics = metrics
        if metrics is not None:
            metrics.watch_drafters(lambda: {**dict.fromkeys(self.local, True),
                                            **{n: c.healthy for n, c in list(self.drafters.items())}})
        self._background: set[asyncio.Task] = set()
        # This verifier's target, for hidden-state drafters (set once the engine has loaded it).
        self.target: FeatureTarget | None = None

    # -- administration --------------------------------------------------------
    async def register(self, name: str, address: str, rank: int | None = None, trusted: bool = False,
                       persist: bool = False) -> DrafterClient:
        """rank orders the default choice (lower first); runtime additions go last. A trusted
        drafter's sparse q is used; it must prove it holds the shared secret (DrafterClient).
        persist: kept in the registry file, registered again when the verifier restarts."""
        if not name or not address:
            raise ValueError("a drafter needs a name and an address (host:port)")
        if name in self.local:
            raise KeyError(f"a drafter named {name!r} runs inside this verifier (--local-drafter); pick another name")
        if name in self.drafters:
            raise KeyError(f"a drafter named {name!r} is already registered (at {self.drafters[name].address})")
        client = self._client(name, address, trusted)
        try:
            await client.connect()
        except BaseException:
            await client.close()
            raise
        if name in self.drafters:  # registered concurrently while we connected
            await client.close()
            raise KeyError(f"a drafter named {name!r} is already registered")
        self._add(client, rank)
        if persist and self.registry is not None:
            self.registry.add(name, address, trusted)
        log.info("drafter %s registered: %s at %s (max k %d, %s)", name, client.info.method, address,
                 client.info.max_k, "trusted" if trusted else "untrusted: drafts verified as one-hot")
        return client

    def add_local(self, name: str, proposer) -> None:
        """An index drafter in this process (its proposer answers inline: answers_inline)."""
        from specd.engine.spec.offers import offers_chains_inline

        if not offers_chains_inline(proposer):
            raise ValueError(f"local drafter {name!r}: only index drafters (suffix, ngram) drafting chains, not "
                             "trees, run inside the verifier")
        if name in self.local or name in self.drafters:
            raise KeyError(f"a drafter named {name!r} is already registered")
        self.local[name] = proposer
        log.info("drafter %s runs inside the verifier", name)

    def _client(self, name: str, address: str, trusted: bool) -> DrafterClient:
        client = DrafterClient(name, address, self.client_id, self.timeout_s, self.vocab_size, self.vocab_hash,
                               self.security, trusted, self.target)
        if self.metrics is not None:
            client.on_rtt = self.metrics.propose_rtt.labels(name).observe
        return client

    def _add(self, client: DrafterClient, rank: int | None) -> None:
        client.rank = rank if rank is not None else max((c.rank for c in self.drafters.values()), default=0) + 1000
        self.drafters = dict(sorted({**self.drafters, client.name: client}.items(), key=lambda kv: kv[1].rank))

    async def restore(self, name: str, address: str, trusted: bool) -> None:
        """A drafter from the registry file: in the pool at once, healthy once it answers (it may
        start after us, or be gone: then it shows unhealthy, and RemoveDrafter forgets it)."""
        if name in self.drafters:
            return
        client = self._client(name, address, trusted)
        self._add(client, None)
        try:
            await client.connect()
            log.info("drafter %s restored from the registry: %s at %s", name, client.info.method, address)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — unreachable, wrong vocabulary, no proof: keep trying
            client.mark_broken(e)

    def check_address(self, address: str) -> None:
        """PermissionError unless address (host:port) matches an allowed pattern (fnmatch per part)."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        for pattern in self.allowed_addresses:
            if pattern == "*":
                return
            phost, _, pport = pattern.rpartition(":")
            if fnmatch.fnmatchcase(host, phost.strip("[]") or "*") and fnmatch.fnmatchcase(port, pport or "*"):
                return
        raise PermissionError(f"drafter address {address!r} is not allowed; the verifier registers drafters only at "
                              f"{', '.join(self.allowed_addresses)} (--allow-drafter-address)")

    async def remove(self, name: str, drain: bool = True) -> None:
        client = self.drafters.get(name)
        if name in self.local:
            raise PermissionError(f"drafter {name!r} runs inside the verifier (--local-drafter): it goes with a "
                                  "restart without it")
        if client is None:
            raise LookupError(f"no drafter named {name!r}; registered: {', '.join(self.drafters) or 'none'}")
        if drain:
            await client.drain(self.timeout_s * 2)
        self.drafters.pop(name, None)
        await client.close()
        if self.registry is not None:
            self.registry.remove(name)
        log.info("drafter %s removed", name)

    async def close(self) -> None:
        self.registry = None  # shutting down is not removing: the registry keeps them
        for name in list(self.drafters):
            await self.remove(name, drain=False)

    def status(self, stats_by_drafter=None) -> list[verifier_pb2.DrafterStatus]:
        out = []
        for name, proposer in self.local.items():
            s = (stats_by_drafter or {}).get(name)
            out.append(verifier_pb2.DrafterStatus(
                name=name, address="in-process", method=type(proposer).__name__.removesuffix("Proposer").lower(),
                state="healthy", healthy=True, draft_tokens=s.draft_tokens if s else 0,
                accepted_tokens=s.accepted_tokens if s else 0, acceptance_rate=s.acceptance_rate if s else 0.0,
                trusted=True))
        for name, c in self.drafters.items():
            s = (stats_by_drafter or {}).get(name)
            info = c.info
            out.append(verifier_pb2.DrafterStatus(
                name=name, address=c.address, method=info.method if info else "", model=info.model if info else "",
                state=c.state, healthy=c.healthy, proposals=c.proposals,
                draft_tokens=s.draft_tokens if s else 0, accepted_tokens=s.accepted_tokens if s else 0,
                acceptance_rate=s.acceptance_rate if s else 0.0,
                propose_p50_ms=c.rtt_quantile(0.5) * 1e3, propose_p99_ms=c.rtt_quantile(0.99) * 1e3,
                timeouts=c.timeouts, last_error=c.last_error, trusted=c.trusted, violations=c.violations))
        return out

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states the engine captures: every registered drafter's, merged."""
        return tuple(sorted({j for c in list(self.drafters.values()) for j in c.feature_layers}))

    def one_forward_of(self, name: str) -> bool:
        """Whether drafter `name` drafts all k in one forward (its Info says so)."""
        client = self.drafters.get(name)
        return bool(client is not None and client.info is not None and client.info.one_forward)

    # -- requests ----------------------------------------------------------------
    def check_choice(self, name: str | None) -> None:
        if name and name not in self.drafters and name not in self.local:
            raise ValueError(f"unknown drafter {name!r}; registered: {', '.join([*self.local, *self.drafters]) or 'none'}")

    def assign(self, seq_id: int, name: str | None) -> None:
        if name:
            self.seq_choice[seq_id] = name

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.seq_choice.pop(sid, None)
            name = self.seq_drafter.pop(sid, None)
            client = self.drafters.get(name) if name else None
            if client is not None and client.healthy:
                client.releases.append(sid)

    def flush_releases(self) -> None:
        """Tell drafters about finished sequences when no step is coming to carry them
        (in the background: the engine loop never waits on a drafter)."""
        for client in list(self.drafters.values()):
            if client.releases and client.healthy:
                ids, client.releases = client.releases, []
                task = asyncio.get_running_loop().create_task(self._release(client, ids))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _release(self, client: DrafterClient, ids: list[int]) -> None:
        try:
            await client.stub.Release(drafter_pb2.ReleaseRequest(client_id=self.client_id, seq_ids=ids),
                                      timeout=self.timeout_s)
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 — closed channel, dead drafter:
            log.debug("release at %s failed: %s", client.name, e)  # the drafter's TTL cleans up instead

    def healthy_names(self) -> list[str]:
        """Local drafters first (a tie goes to the one that costs nothing to ask), then services in rank order."""
        return [*self.local, *(c.name for c in list(self.drafters.values()) if c.healthy)]

    def _route(self, seq_id: int, chosen: str | None = None) -> DrafterClient | None:
        """The request's own choice, else the controller's, else the one it drafted with, else the first."""
        for name in (self.seq_choice.get(seq_id), chosen, self.seq_drafter.get(seq_id)):
            client = self.drafters.get(name) if name else None
            if client is not None and client.healthy:
                return client
        return next((c for c in self.drafters.values() if c.healthy), None)

    async def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        groups: dict[str, list[ProposeRequest]] = {}
        out: list[Proposal] = []
        for req in requests:
            client = self._route(req.seq_id, req.drafter)
            if client is None or req.num_tokens > client.max_history_tokens:
                continue  # no drafter (or none that keeps this much): no drafts, the history goes again later
            if client.feature_layers and not set(client.feature_layers) <= set(req.feature_layers):
                continue  # its hidden states were not captured for this sequence: no drafts
            previous = self.seq_drafter.get(req.seq_id)
            if previous != client.name:
                self.seq_drafter[req.seq_id] = client.name
                if previous is not None and previous in self.drafters:
                    self.drafters[previous].releases.append(req.seq_id)
                if not req.full_history:  # the new drafter has no state: send everything next step
                    out.append(Proposal(seq_id=req.seq_id, token_ids=[], resync=True))
                    continue
            groups.setdefault(client.name, []).append(req)
        results = await asyncio.gather(*(self._ask(self.drafters[n], reqs) for n, reqs in groups.items()))
        for proposals in results:
            out.extend(proposals)
        return out

    async def _ask(self, client: DrafterClient, requests: list[ProposeRequest]) -> list[Proposal]:
        """The drafter's proposals for these sequences, within the propose deadline; except where it
        reads a new history (first contact, resync: a model drafter computes the whole prompt, ~40 ms
        a sequence on one core here, past the deadline when several arrive together) that it would
        not read within half the deadline at the speed it last read one (unknown: it would not), or
        is still reading one: then the batch goes in the background, the step does not wait, and the
        sequences draft from the next step after the drafter has caught up (deferred proposals).
        Token-only drafters: a hidden-state drafter's features are read from the sequences as
        the message is built, which the engine thread may meanwhile extend."""
        reading = sum(len(r.new_tokens) for r in requests if r.full_history)
        slow = reading and client.slow_to_read(reading)
        if client.feature_layers or not (slow or client.catching_up):
            return await self._round_trips(client, requests, reading)
        # A new history at k 1 (its catch-up forward, whose draft is dropped), the others' new
        # tokens at k 0 (no forward): the stream keeps them in order behind what it is reading.
        quiet = [replace(r, k=min(r.k, 1) if r.full_history else 0) for r in requests]
        task = asyncio.get_running_loop().create_task(self._round_trips(client, quiet, reading, background=True))
        if reading:  # (new tokens alone do not prolong the catching up: steps may come faster than replies)
            client.background = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return [Proposal(seq_id=r.seq_id, token_ids=[], drafter=client.name, deferred=True) for r in requests]

    async def _round_trips(self, client: DrafterClient, requests: list[ProposeRequest], reading: int,
                           background: bool = False) -> list[Proposal]:
        """reading: the tokens of full histories among the requests (timed: DrafterClient.observe_read)."""
        # traceparent: the engine step's span (the step runs in a copy of the loop's context)
        batch = drafter_pb2.ProposeBatch(client_id=self.client_id, release=client.releases,
                                         traceparent=current_traceparent())
        client.releases = []
        # Every message stays under MAX_FEATURE_BYTES of features: each sequence gets its share.
        budget = MAX_FEATURE_BYTES // max(1, len(requests))
        pieces = [wire_pieces(r, client.feature_layers, budget) for r in requests]
        feature_bytes = 0
        held: dict[int, int] = {}  # a lead piece answered resync: the pairs the drafter holds
        try:
            # A long history whose features exceed its share goes first, in k = 0 pieces.
            for depth in range(max(len(p) for p in pieces) - 1):
                lead = drafter_pb2.ProposeBatch(client_id=self.client_id)
                for p in pieces:
                    if depth < len(p) - 1:
                        feature_bytes += propose_entry_to_proto(lead, p[depth], 0)
                for p in (await client.round_trip(lead, background=background)).proposals:
                    if p.resync and p.history_held:
                        held.setdefault(p.seq_id, p.history_held)
            for p in pieces:
                feature_bytes += propose_entry_to_proto(batch, p[-1], min(p[-1].k, client.max_k))
            if self.metrics is not None and feature_bytes:
                self.metrics.propose_feature_bytes.labels(client.name).inc(feature_bytes)
            t0 = time.perf_counter()
            reply = await client.round_trip(batch, background=background)
            client.observe_read(time.perf_counter() - t0, reading)
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 — timeout, dead drafter, broken stream
            if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise
            if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
                client.observe_read(client.timeout_s, reading)  # at least that long: read in the background next time
            else:
                client.mark_broken(e)
            # The drafter may or may not have applied these deltas: resend the full history.
            return [Proposal(seq_id=r.seq_id, token_ids=[], resync=True) for r in requests]
        out = checked_reply(client, requests, reply)
        for p in out:
            if p.resync and not p.history_held:
                p.history_held = held.get(p.seq_id, 0)
        return out
