"""Errors a generation backend (the worker's AsyncEngine or the router's RemoteBackend) raises to the API."""

from __future__ import annotations


class InvalidParam(ValueError):
    """A request no engine of this model could run; `param` names the offending field (a 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    pass


class DuplicateRequestId(ValueError):
    """A request id this worker is already running (a 409): the second caller must never read the
    first one's tokens."""


class RequestFailed(RuntimeError):
    """The engine ended one request with an error its client should read (RequestOutput.error)."""


class RequestMoved(RuntimeError):
    """The worker gave the request up so that it goes on elsewhere (the worker is changing role or
    leaving): not a failure of the request, the router continues it on another worker."""


class APIError(Exception):
    """An HTTP error with an OpenAI-style body (server/errors.py renders it)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
