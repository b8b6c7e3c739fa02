"""One drafter as the verifier sees it: a channel, its Info, and one persistent bidi
Propose stream carrying a batch per engine step, with a deadline per round trip.

A drafter that breaks the stream, misses deadlines in a row or dies goes "unhealthy"
and a background task reconnects with backoff; meanwhile it is simply not asked (its
sequences get no drafts, never an error).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import grpc

from specd.rpc.auth import DRAFTER, TOKEN_ENV, Security, aio_channel, check_proof
from specd.rpc.grpc_server import CHANNEL_OPTIONS
from specd.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("specd.verifier.pool")

MAX_MISSES = 2  # deadlines missed in a row before a drafter is taken out of rotation
# A round trip no step waits for (a catch-up on new histories, DrafterPool._ask) gets this many
# propose deadlines; missing it takes the drafter out of rotation at once.
BACKGROUND_DEADLINES = 4
RECONNECT_MIN_S, RECONNECT_MAX_S = 0.2, 5.0


# A drafter's reply is ids and a few numbers per draft: 16 MiB holds 256 sequences x 32 drafts
# with a q of 256 entries each. Larger is a broken or hostile drafter (a 7M-id proposal made
# requests 31x slower before this bound); the stream breaks and the drafter leaves rotation.
MAX_REPLY_BYTES = 16 << 20
DRAFTER_CHANNEL_OPTIONS = [opt for opt in CHANNEL_OPTIONS if opt[0] != "grpc.max_receive_message_length"] + [
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES)]


class VocabularyMismatch(ValueError):
    pass


class TrustRefused(PermissionError):
    """A drafter registered as trusted could not prove it holds the stack's secret."""


class TrustUnavailable(ValueError):
    """Trust was asked of a verifier that has no shared secret to authenticate drafters with."""


class ProtocolViolation(ConnectionError):
    """The drafter sent something the protocol does not allow (an unsolicited reply)."""


def check_vocabulary(info: drafter_pb2.DrafterInfoResponse, vocab_size: int, vocab_hash: str) -> None:
    """A drafter must use the target's token ids; vocabulary-agnostic drafters report size 0."""
    if info.vocab_size == 0 and not info.vocab_hash:
        return
    if info.vocab_size != vocab_size:
        raise VocabularyMismatch(f"drafter {info.name!r} has a vocabulary of {info.vocab_size} tokens but the "
                                 f"target has {vocab_size}; a drafter must share the target's tokenizer")
    if vocab_hash and info.vocab_hash and info.vocab_hash != vocab_hash:
        raise VocabularyMismatch(f"drafter {info.name!r} uses a different tokenizer (vocabulary hash "
                                 f"{info.vocab_hash[:12]} != target's {vocab_hash[:12]}); its drafts would "
                                 f"be meaningless token ids")


@dataclass(frozen=True)
class FeatureTarget:
    """What a hidden-state drafter's head must have been built for: this verifier's target."""

    hidden_size: int
    num_layers: int
    fingerprint: str  # specd.engine.model.fingerprint of the loaded weights


class FeatureMismatch(ValueError):
    pass


def check_features(info: drafter_pb2.DrafterInfoResponse, target: FeatureTarget | None) -> None:
    """A hidden-state drafter must be built for this target: the same hidden size and layer
    count (its feature_layers index our layers), and, where both know it, the same weights."""
    if not info.feature_layers:
        return
    name = repr(info.name)
    if target is None:
        raise FeatureMismatch(f"drafter {name} needs the target's hidden states, which this verifier does not send")
    if info.hidden_size != target.hidden_size or info.target_layers != target.num_layers:
        raise FeatureMismatch(f"drafter {name} was built for a target with hidden size {info.hidden_size} and "
                              f"{info.target_layers} layers; this target has {target.hidden_size} and "
                              f"{target.num_layers}")
    bad = [j for j in info.feature_layers if j > target.num_layers]
    if bad:
        raise FeatureMismatch(f"drafter {name} asks for hidden states {bad}; this target has 0..{target.num_layers}")
    if info.target_fingerprint and target.fingerprint and info.target_fingerprint != target.fingerprint:
        raise FeatureMismatch(f"drafter {name} was trained for other target weights (fingerprint "
                              f"{info.target_fingerprint[:12]} != this target's {target.fingerprint[:12]}); "
                              f"its head would read hidden states it never saw")


class DrafterClient:
    def __init__(self, name: str, address: str, client_id: str, timeout_s: float,
                 vocab_size: int, vocab_hash: str, security: Security | None = None, trusted: bool = False,
                 target: FeatureTarget | None = None):
        self.name, self.address, self.client_id, self.timeout_s = name, address, client_id, timeout_s
        self.vocab_size, self.vocab_hash, self.target = vocab_size, vocab_hash, target
        self.security = security or Security()
        if trusted and not self.security.secret:
            raise TrustUnavailable(f"drafter {name!r} cannot be trusted: trust needs authentication, and this verifier "
                             f"has no shared secret (--auth-token-file or ${TOKEN_ENV})")
        self.trusted = trusted  # its sparse q is used (it proved it holds the secret at every connect)
        self.channel = aio_channel(address, self.security, DRAFTER, options=DRAFTER_CHANNEL_OPTIONS)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.info: drafter_pb2.DrafterInfoResponse | None = None
        self.state = "connecting"
        self.last_error = ""
        self._call = None
        self._reader: asyncio.Task | None = None
        self._reconnect: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._batch_ids = itertools.count(1)
        self._misses = 0
        self._breaks = 0  # breaks since the last real proposal: the reconnect backoff grows with it
        self.releases: list[int] = []  # sent with the next batch
        self.rtt_s: deque[float] = deque(maxlen=512)
        self.proposals = self.timeouts = self.violations = 0
        self._late: deque[int] = deque(maxlen=64)  # batch ids whose deadline passed: a reply may still come
        self.background: asyncio.Task | None = None  # the newest round trip reading new histories in the background
        self.read_s_per_token: float | None = None  # how fast it last read new histories (DrafterPool._ask)
        self._write_lock = asyncio.Lock()
        self.on_rtt = None  # metrics hook: fn(seconds)
        self.rank = 0  # the pool's default choice goes to the lowest rank among healthy drafters

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.info.feature_layers) if self.info else ()

    @property
    def max_k(self) -> int:
        return self.info.max_k if self.info and self.info.max_k else 1 << 30

    @property
    def max_history_tokens(self) -> int:
        return self.info.max_history_tokens if self.info and self.info.max_history_tokens else 1 << 62

    async def _info(self, timeout: float, wait_for_ready: bool = False) -> drafter_pb2.DrafterInfoResponse:
        """Info with the vocabulary check and, for a trusted drafter, its proof of the secret."""
        challenge = os.urandom(32) if self.trusted else b""
        info = await self.stub.Info(drafter_pb2.DrafterInfoRequest(challenge=challenge), timeout=timeout,
                                    wait_for_ready=wait_for_ready)
        check_vocabulary(info, self.vocab_size, self.vocab_hash)
        check_features(info, self.target)
        if self.trusted and not check_proof(self.security.secret, challenge, info.proof):
            raise TrustRefused(f"drafter {self.name!r} at {self.address} did not prove it holds the shared secret; "
                               "start it with the stack's --auth-token-file, or register it untrusted")
        return info

    async def connect(self) -> None:
        """Info, vocabulary and trust checks, open the stream and one warm-up round trip; raises on failure."""
        self.info = await self._info(max(self.timeout_s, 5.0), wait_for_ready=True)
        await self._open_stream()

    async def _open_stream(self) -> None:
        self._call = self.stub.Propose()
        self._reader = asyncio.create_task(self._read(self._call))
        await self.round_trip(drafter_pb2.ProposeBatch(client_id=self.client_id), warmup=True)
        self.state, self._misses = "healthy", 0  # last_error stays: what went wrong last time

    async def _read(self, call) -> None:
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise ConnectionError("drafter closed the Propose stream")
                future = self._pending.pop(msg.batch_id, None)
                if future is not None and not future.done():
                    future.set_result(msg)
                elif msg.batch_id in self._late:  # the reply to a batch whose deadline passed
                    self._late.remove(msg.batch_id)
                else:  # never asked for, or answered twice: a flood, not a drafter
                    self.violations += 1
                    raise ProtocolViolation(f"unsolicited reply (batch id {msg.batch_id})")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — any stream failure: out of rotation, reconnect
            self.mark_broken(e)

    def slow_to_read(self, tokens: int) -> bool:
        """Whether reading `tokens` of new histories would take this drafter past half the propose
        deadline, at the speed it last read one (not known yet: it would)."""
        return self.read_s_per_token is None or self.read_s_per_token * tokens > self.timeout_s / 2

    def observe_read(self, seconds: float, tokens: int) -> None:
        """A round trip that read `tokens` of new histories took `seconds` (drafting included)."""
        if tokens:
            self.read_s_per_token = seconds / tokens

    @property
    def catching_up(self) -> bool:
        """Whether a background round trip is still unanswered (replies come in order: the newest)."""
        return self.background is not None and not self.background.done()

    async def round_trip(self, batch: drafter_pb2.ProposeBatch, warmup: bool = False,
                         background: bool = False) -> drafter_pb2.ProposalBatch:
        """warmup: the first round trip of a stream; background: one no step waits for. Both get a
        longer deadline, and missing it takes the drafter out of rotation at once; neither is timed."""
        if self._call is None:
            raise ConnectionError("no open Propose stream")
        batch.batch_id = next(self._batch_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[batch.batch_id] = future
        t0 = time.perf_counter()
        # The write runs as its own task and the deadline only waits on the reply: a write
        # stuck on a dead peer must not hold the step (wait_for would wait for its cancel).
        writer = asyncio.ensure_future(self._write(self._call, batch))
        writer.add_done_callback(_consume_exception)
        timeout = (max(self.timeout_s, 5.0) if warmup else self.timeout_s * BACKGROUND_DEADLINES if background
                   else self.timeout_s)
        done, _ = await asyncio.wait({future}, timeout=timeout)
        if not done:
            self._pending.pop(batch.batch_id, None)
            self._late.append(batch.batch_id)
            self.timeouts += 1
            self._misses += 1
            if warmup or background or self._misses >= MAX_MISSES or not writer.done():
                self.mark_broken(TimeoutError(f"missed {self._misses} propose deadline(s) of "
                                              f"{timeout * 1e3:.0f} ms in a row"))
            raise TimeoutError("propose deadline missed")
        reply = future.result()  # raises when the stream broke meanwhile
        self._misses = 0
        if background:
            return reply
        self.rtt_s.append(time.perf_counter() - t0)
        if not warmup:
            self._breaks = 0
            self.proposals += 1
            if self.on_rtt is not None:
                self.on_rtt(self.rtt_s[-1])
        return reply

    async def _write(self, call, batch: drafter_pb2.ProposeBatch) -> None:
        # One write at a time, in the order asked: a step's batch may follow background ones.
        async with self._write_lock:
            await call.write(batch)

    def mark_broken(self, error: BaseException) -> None:
        if self.state in ("removed", "unhealthy"):
            return
        self.last_error = describe(error)
        log.warning("drafter %s (%s) unhealthy: %s", self.name, self.address, self.last_error)
        self.state = "unhealthy"
        self._breaks += 1
        self._close_stream()
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = asyncio.get_running_loop().create_task(self._reconnect_loop())

    def _close_stream(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError(self.last_error or "stream closed"))
        self._pending.clear()
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._call = self._reader = None

    async def _reconnect_loop(self) -> None:
        # A drafter that answers probes but fails real work would flap: back off longer each time.
        delay = min(RECONNECT_MIN_S * 2 ** (self._breaks - 1), RECONNECT_MAX_S)
        while self.state == "unhealthy":
            await asyncio.sleep(delay)
            try:
                self.info = await self._info(1.0)
                self.releases.clear()  # a restarted drafter has no state to release
                await self._open_stream()
                log.info("drafter %s (%s) healthy again", self.name, self.address)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                if self.state == "unhealthy":
                    self.last_error = describe(e)
                self._close_stream()
                self.state = "unhealthy" if self.state != "removed" else self.state
                delay = min(delay * 2, RECONNECT_MAX_S)

    async def drain(self, timeout_s: float) -> None:
        """No new proposals; wait (bounded) for the in-flight round trip."""
        self.state = "draining"
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self.state = "removed"
        if self._reconnect is not None:
            self._reconnect.cancel()
        self._close_stream()
        await self.channel.close()

    def rtt_quantile(self, q: float) -> float:
        if not self.rtt_s:
            return 0.0
        values = sorted(self.rtt_s)
        return values[min(len(values) - 1, int(q * len(values)))]


def describe(error: BaseException) -> str:
    """One line for last_error: a gRPC status with its details, else the exception's first line."""
    if isinstance(error, grpc.aio.AioRpcError):
        text = f"{error.code().name}: {error.details()}"
    else:
        text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return text[:300]


def _consume_exception(task: asyncio.Future) -> None:
    """A failed write surfaces through the reader or the deadline; do not log it twice."""
    if not task.cancelled():
        task.exception()
