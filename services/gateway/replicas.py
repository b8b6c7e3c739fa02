"""Verifier replicas behind one gateway: their health and load, and which one a request goes to.

Load is read by polling each replica's Info every POLL_S (its Load: requests in, queue depth,
KV blocks in use), added to what this gateway has in flight there. Why polling Info and not
scraping /metrics or a load report on every chunk: Info rides the gateway's own authenticated
gRPC channel (a verifier's metrics port may be off or unreachable), one poll also says whether
the replica is alive, and the proto change is one message. A poll is up to POLL_S stale, so the
gateway's own in-flight count, which moves the moment it routes, is what spreads a burst; the
polled numbers add what other gateways (or an earlier burst still queued) put there.

A single replica is the old single-verifier gateway: every request goes to it, whatever the polls say.

Prefix routing (the default; `--routing least-loaded` turns it off): a request without a session
key goes to the replica most likely to hold its prompt's KV, ranked by rendezvous hashing on a hash
of its leading blocks (prefix_key), unless that replica is busier than the least loaded by more
than PREFIX_LOAD_SLACK or its cache is nearly full. Each decision is counted by reason.

Discovery: an address `dns:HOST:PORT` stands for every address HOST resolves to, resolved again
every DISCOVERY_S (Compose's `--scale verifier=N` and a Kubernetes headless Service answer one
record per replica). A replica that appears gets requests from its first healthy poll; one that
disappears gets no new ones, and its channel closes when its last call ends. A failed lookup
changes nothing (a resolver hiccup must not drop every replica).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import socket
import time
from array import array

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.rpc.auth import VERIFIER, Security, aio_channel
from specd.rpc.grpc_server import CHANNEL_OPTIONS
from specd.v1 import verifier_pb2, verifier_pb2_grpc

from .errors import APIError
from .metrics import GatewayMetrics

POLL_S = 0.5
DISCOVERY_S = 2.0
POLL_TIMEOUT_S = 2.0
KV_FULL = 0.95  # a replica with more of its KV cache in use than this gets new requests last
PREFIX_BLOCK = 16  # tokens per block of a prefix key (the verifiers' default KV block; it need not match)
PREFIX_BLOCKS = 32  # a prefix key covers the first 512 tokens; shorter prompts have none
PREFIX_LOAD_SLACK = 4  # requests a prefix's replica may have pending beyond the least loaded one
VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
log = logging.getLogger("specd.gateway")


class Replica:
    """One verifier: its channel, what the last poll said, and this gateway's calls on it."""

    def __init__(self, index: int, address: str, security: Security, name: str | None = None):
        self.index, self.address = index, address
        self.name = name  # the dns: name it was discovered under; None when given as an address
        # grpc.aio channels belong to the event loop that creates them: made in ReplicaSet.start().
        # CHANNEL_OPTIONS: reconnect within 2 s of a restart, so a waiting retry finds it soon.
        self.channel = aio_channel(address, security, VERIFIER, options=CHANNEL_OPTIONS)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = True  # optimistic until the first poll: startup waited for one replica's Info
        self.why = ""  # why not healthy
        self.down_since: float | None = None  # time.monotonic() when it was found not healthy
        self.load = verifier_pb2.Load()
        self.in_flight = 0  # this gateway's Generate calls on it
        self.mismatch = ""  # why its last Info rules it out whatever its health (another vocabulary)
        self.routed = 0

    def pending(self) -> int:
        """Requests ahead of a new one here; waiting ones count twice (the replica's batch is full)."""
        return max(self.in_flight, self.load.num_requests) + self.load.num_waiting

    def kv_use(self) -> float:
        return self.load.kv_blocks_used / self.load.kv_blocks_total if self.load.kv_blocks_total else 0.0

    def sort_key(self) -> tuple:
        # KV use in quarters: a cached block or two must not outweigh the turn-taking of equal replicas
        # (routed last); a nearly full cache (preemptions ahead) goes last whatever its queue.
        kv = self.kv_use()
        return kv > KV_FULL, self.pending(), int(kv * 4), self.routed

    async def check(self) -> str:
        """"" when the replica serves, else why not (its health says SERVING for the Verifier service)."""
        try:
            reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                                                 timeout=POLL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        if reply.status != _SERVING:
            return (f"{health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)} "
                    "(starting, stopping, or its engine is stalled)")
        return ""


def affinity_rank(key: str, address: str) -> bytes:
    """Rendezvous hashing: a session goes to the healthy replica ranking highest for its key, so
    it stays there while that one lives, and only the sessions of a lost replica move."""
    return hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest()


def prefix_key(prompt_ids: list[int]) -> str | None:
    """The routing key of a prompt of at least PREFIX_BLOCKS blocks: a hash of those first blocks;
    None for a shorter one (routed by load). A fixed length, because a conversation's next turn
    resends the history plus more and must map to the key of its first turn; long prompts only,
    because a shorter one's key would cover its question too and differ from its later turns' (it
    would pin requests without bringing them to their KV). The cost: prompts that differ only past
    512 tokens share a replica (up to the load slack)."""
    if len(prompt_ids) < PREFIX_BLOCKS * PREFIX_BLOCK:
        return None
    return "prefix:" + hashlib.blake2b(array("q", prompt_ids[:PREFIX_BLOCKS * PREFIX_BLOCK]).tobytes(),
                                       digest_size=8).hexdigest()


def split_dns(address: str) -> tuple[str, int] | None:
    """("HOST", PORT) of a `dns:HOST:PORT` address, else None."""
    if not address.startswith("dns:"):
        return None
    host, _, port = address[4:].rpartition(":")
    return host.strip("[]"), int(port)


async def resolve(host: str, port: int) -> list[str]:
    """host:port for every address `host` resolves to (sorted, so replicas keep their order)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


class ReplicaSet:
    def __init__(self, addresses: list[str], security: Security, metrics: GatewayMetrics, vocab_hash: str = "",
                 routing: str = "prefix"):
        self.addresses, self.security, self.metrics, self.vocab_hash = addresses, security, metrics, vocab_hash
        self.routing = routing
        self.names = [split_dns(a) for a in addresses if split_dns(a)]
        self.replicas: list[Replica] = []
        self._retired: list[Replica] = []  # gone from discovery; closed when their last call ends
        self._next_index = 0
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        for address in self.addresses:
            if split_dns(address) is None:
                self._add(address)
        await self._discover()
        if len(self.replicas) > 1 or self.names:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for r in self.replicas + self._retired:
            await r.channel.close()

    def _add(self, address: str, name: str | None = None) -> None:
        security = self.security
        if name is not None and security.tls_ca and not security.tls_server_name:
            security = dataclasses.replace(security, tls_server_name=name)  # its certificate names the name, not the IP
        replica = Replica(self._next_index, address, security, name)
        self._next_index += 1
        self.replicas.append(replica)
        if name is not None:  # it may still be loading: requests once a poll finds it serving
            replica.healthy, replica.why = False, "not polled yet"
            log.warning("verifier replica %d discovered at %s (%s)", replica.index, address, name)
        self.metrics.replica_healthy.labels(address).set(1 if replica.healthy else 0)

    async def _discover(self) -> None:
        for host, port in self.names:
            try:
                found = await resolve(host, port)
            except (socket.gaierror, OSError) as e:
                log.debug("dns:%s:%d did not resolve: %s", host, port, e)
                continue
            mine = {r.address: r for r in self.replicas if r.name == host}
            for address in found:
                if address not in mine and all(r.address != address for r in self.replicas):
                    self._add(address, host)
            for address, r in mine.items():
                if address not in found:
                    log.warning("verifier replica %d (%s) gone from dns:%s", r.index, address, host)
                    self.replicas.remove(r)
                    self._retired.append(r)
                    self.metrics.replica_healthy.remove(address)
        for r in [r for r in self._retired if r.in_flight == 0]:
            self._retired.remove(r)
            await r.channel.close()

    def pick(self, affinity: str | None = None, exclude: set[int] = frozenset(),
             prefix: str | None = None) -> Replica:
        """The replica for a new Generate call: not one in `exclude` (already failed this request)
        while another is left; a healthy one while there is one; by affinity key if given, else by
        prefix key (prefix_key) weighed against load, else the least loaded."""
        if not self.replicas:
            raise APIError(503, f"verifier: no replica found at {', '.join(self.addresses)} yet; retry later",
                           code="verifier_unavailable")
        candidates = [r for r in self.replicas if r.index not in exclude] or self.replicas
        live = [r for r in candidates if r.healthy] or candidates
        reason, replica = self._choose(live, affinity, prefix)
        self.metrics.routed.labels(reason).inc()
        return replica

    def _choose(self, live: list[Replica], affinity: str | None, prefix: str | None) -> tuple[str, Replica]:
        if affinity:  # a session stays put whatever the load: its client asked for that
            return "session", max(live, key=lambda r: affinity_rank(affinity, r.address))
        if prefix and self.routing == "prefix":
            # The prefix's replicas in rendezvous order, the first not too busy: cached KV saves
            # prefill, but not the wait behind a queue longer than the slack.
            floor = min(r.pending() for r in live)
            ranked = sorted(live, key=lambda r: affinity_rank(prefix, r.address), reverse=True)
            ok = next((r for r in ranked if r.pending() <= floor + PREFIX_LOAD_SLACK and r.kv_use() <= KV_FULL), None)
            if ok is ranked[0]:
                return "prefix", ok
            return "prefix_overloaded", ok or min(live, key=Replica.sort_key)
        return "least_loaded", min(live, key=Replica.sort_key)

    def lost(self, replica: Replica, why: str) -> None:
        """A call found the replica gone: route around it until a poll finds it back."""
        if len(self.replicas) > 1 and replica.healthy:
            log.warning("verifier replica %d (%s) lost: %s", replica.index, replica.address, why)
            self._set_health(replica, why)

    def _set_health(self, replica: Replica, why: str) -> None:
        if replica not in self.replicas:
            return  # gone from discovery while it was polled
        if why and replica.down_since is None:
            replica.down_since = time.monotonic()
        elif not why:
            replica.down_since = None
        replica.healthy, replica.why = not why, why
        self.metrics.replica_healthy.labels(replica.address).set(0 if why else 1)

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_discovery = loop.time() + DISCOVERY_S
        while True:
            if self.names and loop.time() >= next_discovery:
                await self._discover()
                next_discovery = loop.time() + DISCOVERY_S
            await asyncio.gather(*(self._poll(r) for r in list(self.replicas)))
            await asyncio.sleep(POLL_S)

    async def _poll(self, r: Replica) -> None:
        why = await r.check()
        if not why:
            try:
                info = await r.stub.Info(verifier_pb2.InfoRequest(), timeout=POLL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                why = f"{e.code().name}: {e.details()}"
            else:
                r.load = info.load
                if self.vocab_hash and info.vocab_hash != self.vocab_hash:
                    # Another model's token ids would make every output silently wrong: never route there.
                    why = f"serves {info.model_name}, whose vocabulary is not the gateway's"
                r.mismatch = why
        self.checked(r, why)

    def checked(self, r: Replica, why: str) -> None:
        """What a poll or a /health call just found ("" healthy): routing follows it at once (a
        replica that came up after a failed poll must not wait for the next one: `specd up`
        reports the stack up when /health finds every replica serving, and requests follow)."""
        if why and r.healthy:
            log.warning("verifier replica %d (%s) not healthy: %s", r.index, r.address, why)
        elif not why and not r.healthy:
            log.warning("verifier replica %d (%s) healthy again", r.index, r.address)
        self._set_health(r, why)
