"""Every error the server sends has OpenAI's body and a 4xx/5xx status:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

FastAPI's own 422 (schema failure) and Starlette's plain 404/405 are replaced by this shape, so a
client sees the same body whatever layer refused the request.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


def error_type_for(status: int) -> str:
    """OpenAI's `type` for a status: every client error is invalid_request_error (401 and 404 too,
    told apart by `code`: invalid_api_key, model_not_found), every 5xx server_error."""
    return "server_error" if status >= 500 else "invalid_request_error"


class APIError(Exception):
    """Raised anywhere in request handling; the handler turns it into OpenAI's error body."""

    def __init__(
        self,
        message: str,
        status_code: int = HTTPStatus.BAD_REQUEST,
        *,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.param = param
        self.code = code
        self.err_type = err_type or error_type_for(self.status_code)
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.err_type, param=self.param, code=self.code))

    def to_json_response(self) -> JSONResponse:
        return JSONResponse(self.to_response().model_dump(), status_code=self.status_code, headers=self.headers)


# The tags pydantic gives a union's plain members in an error's loc: ("prompt", "str") for `prompt: str | list[str]`.
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none", "dict", "list"})


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    # ("body", "messages", 0, "content") -> "messages[0].content"
    parts: list[str] = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif "[" in str(p) or "-" in str(p) or "," in str(p) or (parts and p in _UNION_MEMBER_TAGS):
            # pydantic names union members ("list[int]", "function-after[...]", a bare "str"): not a field name.
            continue
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts) or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 from pydantic's error list, naming the first bad field and its problem.

    A union field (e.g. `stop: str | list[str]`) fails once per member; the first member's message
    stands for all of them, and the param is the field itself.
    """
    if not errors:
        return APIError("Invalid request body.")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(f"The request body is not valid JSON: {ctx.get('error', first.get('msg'))}.", code="invalid_json")
    param = _loc_to_param(first.get("loc", ()))
    if kind == "model_type" and param is None:
        got = type(first.get("input")).__name__ if "input" in first else "something else"
        return APIError(f"The request body must be a JSON object, got {_json_kind(got)}.")
    if kind == "missing":
        return APIError(f"Missing required field '{param}'.", param=param)
    if kind == "extra_forbidden":
        # Named as sent, even "" (whose loc names nothing: the message read "Invalid value for 'None'").
        loc = first.get("loc", ())
        name = str(loc[-1]) if loc else ""
        where = param.rsplit(".", 1)[0] if param and "." in param else None
        return APIError(f"Unknown field {name!r}{f' in {where}' if where else ''}: this endpoint does not take it.",
                        param=param)
    input_repr = repr(first.get("input"))
    if len(input_repr) > 80:
        input_repr = input_repr[:77] + "..."
    msg = f"Invalid value for '{param}': {first.get('msg', 'invalid')} (got {input_repr})."
    return APIError(msg, param=param)


def _json_kind(py_type: str) -> str:
    return {"list": "an array", "str": "a string", "NoneType": "null", "int": "a number", "float": "a number",
            "bool": "a boolean", "bytes": "a non-JSON body"}.get(py_type, py_type)


def from_validation_error(exc: ValidationError) -> APIError:
    return validation_error(list(exc.errors(include_url=False)))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.to_json_response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).to_json_response()

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).to_json_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == HTTPStatus.NOT_FOUND and exc.detail in (None, "Not Found"):
            message = f"Unknown path {request.url.path!r}."
        elif status == HTTPStatus.METHOD_NOT_ALLOWED:
            message = f"Method {request.method} is not allowed on {request.url.path!r}."
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(status).phrase
        headers = dict(exc.headers) if exc.headers else None
        return APIError(message, status, headers=headers).to_json_response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        # Starlette's ServerErrorMiddleware sends this answer and then raises the error again, and
        # uvicorn closes the connection under it: said in the answer, the client opens a new one for
        # its next request (a kept-alive one was reset by that close: h61's fuzzer, the request after
        # each 500 failed with "connection reset by peer").
        return APIError(f"Internal server error: {type(exc).__name__}: {exc}", 500,
                        headers={"Connection": "close"}).to_json_response()
