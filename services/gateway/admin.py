"""/admin/drafters: HTTP in front of the verifier's drafter-pool RPCs (DESIGN §6)."""
from __future__ import annotations

from typing import Callable

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specd.v1 import verifier_pb2

from .errors import from_grpc
from .schemas import RegisterDrafterBody, read_json


def drafter_dict(status: verifier_pb2.DrafterStatus) -> dict:
    # Field by field rather than json_format, which would turn the uint64 counters into strings.
    return {f.name: getattr(status, f.name) for f in status.DESCRIPTOR.fields}


class DrafterAdmin:
    def __init__(self, stub: Callable[[], object], max_body_bytes: int):
        self._stub = stub  # the stub exists only once the app has started
        self._max_body_bytes = max_body_bytes

    async def list(self, request: Request) -> Response:
        try:
            reply = await self._stub().ListDrafters(verifier_pb2.ListDraftersRequest())
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return JSONResponse([drafter_dict(d) for d in reply.drafters])

    async def register(self, request: Request) -> Response:
        body = await read_json(request, RegisterDrafterBody, self._max_body_bytes)
        try:
            reply = await self._stub().RegisterDrafter(
                verifier_pb2.RegisterDrafterRequest(name=body.name, address=body.address))
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return JSONResponse(drafter_dict(reply.drafter), status_code=201)

    async def remove(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            await self._stub().RemoveDrafter(verifier_pb2.RemoveDrafterRequest(name=name, drain=True))
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return JSONResponse({"id": name, "object": "drafter", "deleted": True})
