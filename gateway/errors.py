"""One error shape for every failure: OpenAI's `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _loc(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid request"}
        param = _loc(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return APIError(400, "request body is not valid JSON", "invalid_json", None).response()
        msg = f"{param}: {first.get('msg')}"
        return APIError(400, msg, "invalid_value", param).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # Never a bare text/plain 500: the API's error shape, and the cause in the log.
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal error ({type(exc).__name__})", "internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), None, None).response()
