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
import time
from collections import deque

import grpc

from specd.grpc_server import CHANNEL_OPTIONS
from specd.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("specd.verifier.pool")

MAX_MISSES = 2  # deadlines missed in a row before a drafter is taken out of rotation
RECONNECT_MIN_S, RECONNECT_MAX_S = 0.2, 5.0


class VocabularyMismatch(ValueError):
    pass


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


class DrafterClient:
    def __init__(self, name: str, address: str, client_id: str, timeout_s: float,
                 vocab_size: int, vocab_hash: str):
        self.name, self.address, self.client_id, self.timeout_s = name, address, client_id, timeout_s
        self.vocab_size, self.vocab_hash = vocab_size, vocab_hash
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
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
        self.proposals = self.timeouts = 0
        self.on_rtt = None  # metrics hook: fn(seconds)
        self.rank = 0  # the pool's default choice goes to the lowest rank among healthy drafters

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"

    @property
    def max_k(self) -> int:
        return self.info.max_k if self.info and self.info.max_k else 1 << 30

    async def connect(self) -> None:
        """Info, vocabulary check, open the stream and one warm-up round trip; raises on failure."""
        info = await self.stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=max(self.timeout_s, 5.0),
                                    wait_for_ready=True)
        check_vocabulary(info, self.vocab_size, self.vocab_hash)
        self.info = info
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
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — any stream failure: out of rotation, reconnect
            self.mark_broken(e)

    async def round_trip(self, batch: drafter_pb2.ProposeBatch, warmup: bool = False) -> drafter_pb2.ProposalBatch:
        if self._call is None:
            raise ConnectionError("no open Propose stream")
        batch.batch_id = next(self._batch_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[batch.batch_id] = future
        t0 = time.perf_counter()
        # The write runs as its own task and the deadline only waits on the reply: a write
        # stuck on a dead peer must not hold the step (wait_for would wait for its cancel).
        writer = asyncio.ensure_future(self._call.write(batch))
        writer.add_done_callback(_consume_exception)
        done, _ = await asyncio.wait({future}, timeout=max(self.timeout_s, 5.0) if warmup else self.timeout_s)
        if not done:
            self._pending.pop(batch.batch_id, None)
            self.timeouts += 1
            self._misses += 1
            if warmup or self._misses >= MAX_MISSES or not writer.done():
                self.mark_broken(TimeoutError(f"missed {self._misses} propose deadline(s) of "
                                              f"{self.timeout_s * 1e3:.0f} ms in a row"))
            raise TimeoutError("propose deadline missed")
        reply = future.result()  # raises when the stream broke meanwhile
        self._misses = 0
        self.rtt_s.append(time.perf_counter() - t0)
        if not warmup:
            self._breaks = 0
            self.proposals += 1
            if self.on_rtt is not None:
                self.on_rtt(self.rtt_s[-1])
        return reply

    def mark_broken(self, error: BaseException) -> None:
        if self.state in ("removed", "unhealthy"):
            return
        self.last_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
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
                info = await self.stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=1.0)
                check_vocabulary(info, self.vocab_size, self.vocab_hash)
                self.info = info
                self.releases.clear()  # a restarted drafter has no state to release
                await self._open_stream()
                log.info("drafter %s (%s) healthy again", self.name, self.address)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                if self.state == "unhealthy":
                    self.last_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
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


def _consume_exception(task: asyncio.Future) -> None:
    """A failed write surfaces through the reader or the deadline; do not log it twice."""
    if not task.cancelled():
        task.exception()
