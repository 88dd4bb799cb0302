"""One error shape for every failure: OpenAI's `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, as every arenaflow endpoint answers errors."""

    error: ErrorDetail


def errors(*statuses: int) -> dict:
    """OpenAPI `responses` for these error statuses, each with the error schema."""
    return {s: {"model": ErrorBody, "description": STATUS_TEXT.get(s, "Error")} for s in statuses}


STATUS_TEXT = {
    400: "Invalid request (the field is named in `param`)",
    401: "Missing or invalid API key",
    404: "Not found (or not yours)",
    405: "Method not allowed (see `Allow`)",
    408: "The request body did not arrive in time",
    409: "Idempotency conflict, or the resource is not in a state for this",
    413: "Request body too large",
    429: "Refused now: rate limit, or the model cannot answer within the deadline (see `Retry-After`)",
    499: "Cancelled",
    500: "Internal error",
    503: "A backing service is unavailable; retry shortly",
    504: "No answer before the deadline",
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


def loc(loc) -> str:
    # Union members show up in the location as type tags ("str", "list[TextPart]"): not fields.
    parts = [str(p) for p in loc if p != "body" and not _type_tag(p)]
    return ".".join(parts) or "body"


def _type_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid request"}
        param = loc(first.get("loc", ()))
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
        # Keeps the exception's headers: a 405 names what is allowed (`Allow`).
        return APIError(exc.status_code, str(exc.detail), None, None, dict(exc.headers or {})).response()
