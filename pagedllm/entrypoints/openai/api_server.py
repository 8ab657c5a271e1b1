"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), drop-in for vLLM's.

    python -m pagedllm.entrypoints.openai.api_server --model M --port 8000
    pagedllm serve M --port 8000           (pagedllm/entrypoints/cli.py)

Endpoints: POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize; GET /v1/models,
/health, /version, /metrics. Request bodies are read and validated here (not by FastAPI), so every
refusal is a 400 with OpenAI's error body, never FastAPI's 422.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any, TypeVar

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

import pagedllm
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.cli_args import (
    api_keys,
    load_chat_template,
    make_arg_parser,
    validate_parsed_serve_args,
)
from pagedllm.entrypoints.openai.errors import APIError, from_validation_error, install_error_handlers
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import EventStream
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.metrics.prometheus import PrometheusStatLogger

__all__ = ["build_app", "main", "make_arg_parser", "run_server"]

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")

M = TypeVar("M", bound=BaseModel)

# Paths that answer without an API key (probes and monitoring), as the issue and vLLM specify.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
# When the engine dies: /health says 503 and in-flight requests get their error for this long, then
# the process exits with status 1 (so a supervisor restarts it instead of it hanging).
ENGINE_DEAD_EXIT_DELAY_S = 2.0


# -- request bodies -----------------------------------------------------------------------------------
async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object, or APIError: 413 past max_bytes (checked before buffering when
    Content-Length says so), 400 for a non-JSON content type, an empty body, invalid JSON or
    anything but an object."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        main = ctype.split(";", 1)[0].strip().lower()
        if main != "application/json" and not main.endswith("+json"):
            raise APIError(f"Content-Type must be application/json, got {main!r}.")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(
            f"The request body is {int(length)} bytes; the limit is {max_bytes} bytes.", HTTPStatus.REQUEST_ENTITY_TOO_LARGE
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(
                f"The request body is larger than the limit of {max_bytes} bytes.", HTTPStatus.REQUEST_ENTITY_TOO_LARGE
            )
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise APIError("The request body is empty; send a JSON object.")
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    if not isinstance(obj, dict):
        kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(obj), "a number")
        raise APIError(f"The request body must be a JSON object, got {kind}.")
    return obj


def parse_as(model_cls: type[M], obj: dict[str, Any]) -> M:
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


# -- disconnects ----------------------------------------------------------------------------------------
async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


T = TypeVar("T")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (its requests are aborted) and
    return None. The body must already have been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return None
    finally:
        watcher.cancel()
        task.cancel()


class SSEResponse(StreamingResponse):
    """text/event-stream that always watches for the client leaving (Starlette only does on ASGI
    spec < 2.4) and aborts the engine requests behind the stream however it ends."""

    def __init__(self, stream: EventStream) -> None:
        super().__init__(
            stream.events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.event_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-write
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.event_stream.close()


# -- auth ----------------------------------------------------------------------------------------------
class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches one of the keys (constant-time compare;
    every key is compared so timing does not tell which one was close)."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(given, key)
        if ok:
            await self.app(scope, receive, send)
            return
        message = "Missing API key: send `Authorization: Bearer <key>`." if not auth else "Incorrect API key provided."
        err = APIError(message, HTTPStatus.UNAUTHORIZED, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.to_json_response()(scope, receive, send)


# -- the app -------------------------------------------------------------------------------------------
def build_app(args: argparse.Namespace, engine: AsyncLLM) -> FastAPI:
    mc = engine.model_config
    chat_template = load_chat_template(args.chat_template)
    log_requests = not args.disable_log_requests
    models = OpenAIServingModels(list(mc.served_model_name), mc.model, mc.max_model_len)
    chat = OpenAIServingChat(
        engine, models, chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template, log_requests=log_requests,
    )
    completion = OpenAIServingCompletion(engine, models, log_requests=log_requests)
    tokenization = OpenAIServingTokenization(
        engine, models, chat_template=chat_template, trust_request_chat_template=args.trust_request_chat_template
    )
    cc = engine.config.cache_config
    stat_logger = PrometheusStatLogger(
        models.served_model_names[0],
        cache_info={
            "block_size": str(cc.block_size),
            "num_gpu_blocks": str(engine.engine_core.num_gpu_blocks),
            "enable_prefix_caching": str(cc.enable_prefix_caching),
        },
    )
    engine.stat_loggers.append(stat_logger.record)
    max_body = args.max_request_body_bytes

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible API", version=pagedllm.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.stat_logger = stat_logger
    install_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR, code="engine_dead").to_json_response()

    def respond(result: BaseModel | EventStream | None) -> Response:
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if isinstance(result, EventStream):
            return SSEResponse(result)
        return JSONResponse(result.model_dump())

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        arrival = time.time()
        request = parse_as(ChatCompletionRequest, await read_json_object(raw, max_body))
        return respond(await cancel_on_disconnect(raw, chat.create_chat_completion(request, arrival)))

    @app.post("/v1/completions")
    async def create_completion(raw: Request) -> Response:
        arrival = time.time()
        request = parse_as(CompletionRequest, await read_json_object(raw, max_body))
        return respond(await cancel_on_disconnect(raw, completion.create_completion(request, arrival)))

    @app.get("/v1/models")
    async def show_available_models() -> Response:
        return JSONResponse(models.show_available_models().model_dump())

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        obj = await read_json_object(raw, max_body)
        request = parse_as(TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest, obj)
        return JSONResponse((await tokenization.create_tokenize(request)).model_dump())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        request = parse_as(DetokenizeRequest, await read_json_object(raw, max_body))
        return JSONResponse((await tokenization.create_detokenize(request)).model_dump())

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as e:
            return APIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE, code="engine_dead").to_json_response()
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": pagedllm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=stat_logger.content_type)

    keys = api_keys(args)
    if keys:
        app.add_middleware(APIKeyMiddleware, keys=keys)
    # Added last = outermost: CORS answers preflights before auth sees them.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    return app


# -- running -------------------------------------------------------------------------------------------
async def serve(args: argparse.Namespace, engine: AsyncLLM) -> int:
    """Serve until stopped; returns the exit code (1 when the engine died)."""
    app = build_app(args, engine)
    config = uvicorn.Config(
        app,
        host=args.host if args.host is not None else "0.0.0.0",
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    exit_code = 0

    def on_engine_dead(err: Exception) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.error("%s; shutting the server down", err)
        # A moment for in-flight requests to receive their error, then stop.
        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, setattr, server, "should_exit", True)

    engine.add_dead_callback(on_engine_dead)
    await server.serve()
    return exit_code


def run_server(args: argparse.Namespace) -> None:
    """Load the model, then serve; exits non-zero with a clear message on a bad flag."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        validate_parsed_serve_args(args)
        load_chat_template(args.chat_template)
        engine_args = EngineArgs.from_cli_args(args)
        if args.served_model_name:
            engine_args.served_model_name = list(args.served_model_name)
        engine = AsyncLLM.from_engine_args(engine_args)
    except ValueError as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    exit_code = asyncio.run(serve(args, engine))
    if exit_code:
        raise SystemExit(exit_code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pagedllm.entrypoints.openai.api_server",
        description="pagedllm's OpenAI-compatible server.",
    )
    args = make_arg_parser(parser).parse_args(argv)
    run_server(args)


if __name__ == "__main__":
    main()
