"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause becomes an `APIError` with an HTTP status; a client that
closes the connection before its body is read is no error (nobody is left to answer); anything
else is a bug, logged on the server with its traceback and answered with a bare 500 (no trace
leaks).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("quillgpt.serve")

# status → OpenAI's error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_unavailable",
}


BODY_UNREAD = (408, 413)  # answered before the request's body was read whole


class APIError(Exception):
    """A request the server refuses: status, one-line message, the offending field, a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        if self.status in BODY_UNREAD:  # the rest of the body never comes, or is not read: no next request
            headers = {**(headers or {}), "Connection": "close"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI-shaped JSON body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return APIError(
                404,
                f"no route {request.url.path}; see GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/attention",
                code="not_found",
            ).response()
        if exc.status_code == 405:
            return APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed").response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, _: ClientDisconnect) -> Response:
        log.info("%s %s: the client closed the connection before sending its whole body", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error (logged on the server)", code="internal_error").response()
