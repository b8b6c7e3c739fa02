"""/admin/drafters: HTTP in front of the verifier's drafter-pool RPCs (docs/architecture.md, "Services": the drafter pool).

With several verifier replicas, a drafter is registered on (and removed from) every one of
them, so the replicas share it; the list is the first serving replica's.
"""
from __future__ import annotations

import asyncio

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specd.v1 import verifier_pb2

from .errors import APIError, from_grpc
from .replicas import ReplicaSet
from .schemas import RegisterDrafterBody, read_json


def drafter_dict(status: verifier_pb2.DrafterStatus) -> dict:
    # Field by field rather than json_format, which would turn the uint64 counters into strings.
    return {f.name: getattr(status, f.name) for f in status.DESCRIPTOR.fields}


class DrafterAdmin:
    def __init__(self, replicas: ReplicaSet, max_body_bytes: int):
        self._replicas = replicas  # its stubs exist only once the app has started
        self._max_body_bytes = max_body_bytes

    async def list(self, request: Request) -> Response:
        try:
            reply = await self._replicas.pick().stub.ListDrafters(verifier_pb2.ListDraftersRequest())
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return JSONResponse([drafter_dict(d) for d in reply.drafters])

    async def register(self, request: Request) -> Response:
        body = await read_json(request, RegisterDrafterBody, self._max_body_bytes)
        replies = await self._on_every_replica(
            "RegisterDrafter", verifier_pb2.RegisterDrafterRequest(name=body.name, address=body.address))
        return JSONResponse(drafter_dict(replies[0].drafter), status_code=201)

    async def remove(self, request: Request) -> Response:
        name = request.path_params["name"]
        await self._on_every_replica("RemoveDrafter", verifier_pb2.RemoveDrafterRequest(name=name, drain=True))
        return JSONResponse({"id": name, "object": "drafter", "deleted": True})

    async def _on_every_replica(self, method: str, message) -> list:
        replicas = self._replicas.replicas
        results = await asyncio.gather(*(getattr(r.stub, method)(message) for r in replicas), return_exceptions=True)
        errors = [(r, e) for r, e in zip(replicas, results) if isinstance(e, BaseException)]
        if not errors:
            return results
        for _, e in errors:
            if not isinstance(e, grpc.aio.AioRpcError):
                raise e
        error = from_grpc(errors[0][1])
        if len(replicas) > 1:  # say where it failed, and where it did not (the operator may have to undo it)
            done = [r.address for r, e in zip(replicas, results) if not isinstance(e, BaseException)]
            error = APIError(error.status, f"{error.message} (at {', '.join(r.address for r, _ in errors)}; "
                                           f"done at: {', '.join(done) or 'none'})", error.param, error.code,
                             error.headers)
        raise error
