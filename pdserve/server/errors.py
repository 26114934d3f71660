"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.common import tracing
from pdserve.common.errors import APIError
from pdserve.protocol.unsupported import UNSUPPORTED_TYPE

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_error",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    err = {
        "message": message,
        "type": _TYPES.get(status, "invalid_request_error"),
        "param": param,
        "code": code,
    }
    trace_id = tracing.trace_id()  # tracing on: the operator follows this request across hosts by it
    if trace_id:
        err["trace_id"] = trace_id
    return {"error": err}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _describe(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None, "invalid_value"
    first = errs[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None, "invalid_value"
    if first.get("type") == UNSUPPORTED_TYPE:  # a known field this server does not implement
        return str(first.get("msg")), str((first.get("ctx") or {}).get("param")), UNSUPPORTED_TYPE
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg', 'invalid value')}", param, "invalid_value"


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    def _count(status: int) -> None:
        if on_error is not None:
            on_error(status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe(exc)
        _count(400)
        return error_response(400, message, param, code)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        _count(exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        _count(exc.status_code)
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        _count(500)
        return error_response(500, f"internal error: {type(exc).__name__}")
