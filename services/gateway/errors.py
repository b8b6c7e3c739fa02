"""OpenAI-shaped errors: one exception type, one JSON shape, one gRPC→HTTP table."""
from __future__ import annotations

from starlette.responses import JSONResponse

# The OpenAI error "type" per HTTP status; clients branch on the status, humans read the type.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          403: "permission_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error"}


# Statuses that shed load, each counted (specd_gateway_rejected_total) by reason; the reason of an
# error without one of its own, by status. 429 and 503 always carry Retry-After.
SHED = {408: "timeout", 413: "body_too_large", 429: "overloaded", 503: "unavailable"}
RETRY_AFTER = (429, 503)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status in RETRY_AFTER and not any(k.lower() == "retry-after" for k in self.headers):
            self.headers["Retry-After"] = "1"
        self.reason = reason or code or SHED.get(status)  # the metric's label when the status sheds load

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def overloaded(message: str, retry_after_s: int = 1, reason: str = "overloaded") -> APIError:
    """429 with Retry-After, as OpenAI's rate limits answer."""
    return APIError(429, message, code="overloaded", headers={"Retry-After": str(max(1, retry_after_s))},
                    reason=reason)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# gRPC status (by name) -> HTTP status, for Generate and the admin RPCs alike; anything else is a 500.
# UNAUTHENTICATED means the gateway's own credentials are wrong (a deployment error, not the client's).
_GRPC_TO_HTTP = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "PERMISSION_DENIED": 403,
                 "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429, "UNAUTHENTICATED": 502,
                 "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}


def from_grpc(err) -> APIError:
    """An APIError for a grpc.aio.AioRpcError.

    Client errors carry the verifier's message unchanged (it names the field); server
    errors say where they came from, since grpc's own text ("failed to connect to all
    addresses") does not.
    """
    name = err.code().name
    status = _GRPC_TO_HTTP.get(name, 500)
    details = err.details() or name
    if status == 429:
        retry = next((v for k, v in (err.trailing_metadata() or ()) if k == "retry-after"), "1")
        return overloaded(details, int(retry) if str(retry).isdigit() else 1, reason="verifier_overloaded")
    return APIError(status, details if status < 500 else f"verifier: {name}: {details}",
                    reason="verifier_unavailable" if status == 503 else None)
