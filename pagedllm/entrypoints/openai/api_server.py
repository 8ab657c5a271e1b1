"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), drop-in for vLLM's.

    python -m pagedllm.entrypoints.openai.api_server --model M --port 8000
    pagedllm serve M --port 8000           (pagedllm/entrypoints/cli.py)

Endpoints: POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize; with runner="pooling"
/v1/embeddings, /pooling, /classify, /v1/score, /rerank (pooling_routes.py); GET /v1/models,
/health, /version, /metrics. Request bodies are read and validated by us (http_io.py), not by
FastAPI, so every refusal is a 400 with OpenAI's error body, never FastAPI's 422.

Hardening lives beside this file: limits.py (per-request limits), admission.py (503 when full),
middleware.py (headers, framing, draining, API keys), http_io.py (bodies, disconnects, stalled streams),
json_body.py (bounded decoding), prompt_budget.py (CPU budget of templates), request_log.py (safe
logs), connections.py (read timeout, connection cap), shutdown.py (SIGTERM drain, SIGHUP).
docs/LIMITS.md lists every limit with its flag.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter
from pydantic import BaseModel

import pagedllm
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.core_proc import discard_prestarted_engine_process, prestart_for_server
from pagedllm.entrypoints.openai.admission import SHUTTING_DOWN_CODE, AdmissionController
from pagedllm.entrypoints.openai.cli_args import (
    api_keys,
    expand_config_args,
    load_chat_template,
    log_requests_enabled,
    make_arg_parser,
    validate_parsed_serve_args,
)
from pagedllm.entrypoints.openai.connections import make_protocol_class
from pagedllm.entrypoints.openai.errors import APIError, install_error_handlers
from pagedllm.entrypoints.openai.http_io import (
    ResetStalledConnections,
    SSEResponse,
    cancel_on_disconnect,
    read_request,
)
from pagedllm.entrypoints.openai.limits import MAX_REQUEST_ID_LEN, ServerLimits
from pagedllm.entrypoints.openai.middleware import (
    AmbiguousFramingMiddleware,
    APIKeyMiddleware,
    DrainMiddleware,
    HeaderLimitMiddleware,
)
from pagedllm.entrypoints.openai.pooling_routes import add_pooling_routes
from pagedllm.entrypoints.openai.process_setup import check_port_free, event_loop_factory, raise_open_file_limit
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedllm.entrypoints.openai.request_id import RequestIdMiddleware
from pagedllm.entrypoints.openai.request_log import UnknownFieldReporter
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import check_generate_runner
from pagedllm.entrypoints.openai.serving_engine import EventStream
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.shutdown import DrainingServer, drain, stop_now
from pagedllm.entrypoints.openai.web_ui import KV_SNAPSHOT_INTERVAL_S, LOGIN_PAGE, UI_PATH, install_web_ui
from pagedllm.entrypoints.openai.web_ui_args import web_ui_enabled
from pagedllm.metrics.console_feed import ConsoleFeed
from pagedllm.metrics.loggers import LOG_STATS_INTERVAL_S, LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.vllm_flags import check_table_flags

__all__ = ["build_app", "main", "make_arg_parser", "run_server"]

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")

# When the engine dies: /health says 503 and in-flight requests get their error for this long, then
# the process exits with status 1 (so a supervisor restarts it instead of it hanging).
ENGINE_DEAD_EXIT_DELAY_S = 2.0


# -- the app -------------------------------------------------------------------------------------------
def build_app(args: argparse.Namespace, engine: AsyncLLM) -> FastAPI:
    mc = engine.model_config
    chat_template = load_chat_template(args.chat_template)
    log_requests = log_requests_enabled(args)
    models = OpenAIServingModels(list(mc.served_model_name), mc.model, mc.max_model_len)
    max_num_seqs = engine.config.scheduler_config.max_num_seqs
    limits = ServerLimits.from_args(
        args, mc.max_model_len, engine.config.max_logprobs, max_prompts=max_num_seqs + args.max_num_queued_reqs
    )
    cc = engine.config.cache_config
    stat_logger = PrometheusStatLogger(
        models.served_model_names[0],
        cache_info={
            "block_size": str(cc.block_size),
            "num_gpu_blocks": str(engine.engine_core.num_gpu_blocks),
            "enable_prefix_caching": str(cc.enable_prefix_caching),
        },
        max_model_len=mc.max_model_len,
    )
    engine.stat_loggers.append(stat_logger.record)
    log_stat_logger = None if args.disable_log_stats else LoggingStatLogger()
    if log_stat_logger is not None:
        engine.stat_loggers.append(log_stat_logger.record)
    admission = AdmissionController(
        engine.config.scheduler_config.max_num_seqs, args.max_num_queued_reqs,
        on_reject=stat_logger.record_rejection, on_change=stat_logger.set_admitted,
    )
    chat = OpenAIServingChat(
        engine, models, chat_template=chat_template,
        trust_request_chat_template=args.trust_request_chat_template, log_requests=log_requests,
        limits=limits, admission=admission, enable_auto_tools=args.enable_auto_tool_choice,
        tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
    )
    completion = OpenAIServingCompletion(
        engine, models, log_requests=log_requests, limits=limits, admission=admission
    )
    tokenization = OpenAIServingTokenization(
        engine, models, chat_template=chat_template, trust_request_chat_template=args.trust_request_chat_template,
        limits=limits,
    )
    # One reporter for every endpoint: unknown fields counted in /metrics, logged rate-limited.
    unknown_fields_total = Counter(
        "pagedllm:request_unknown_fields",
        "Requests that carried unknown or unsupported fields (ignored; logged rate-limited).",
        ["model_name"], registry=stat_logger.registry,
    ).labels(models.served_model_names[0])
    # Logged (rate-limited, escaped) as vLLM warns of ignored fields, whether or not each request is
    # logged (--enable-log-requests); --disable-log-requests silences it.
    unknown_fields = UnknownFieldReporter(
        log_enabled=not args.disable_log_requests, max_log_len=args.max_log_len, on_count=unknown_fields_total.inc
    )
    for serving in (chat, completion, tokenization):
        serving.unknown_fields = unknown_fields
        serving.response_role = args.response_role
        serving.return_tokens_as_token_ids = args.return_tokens_as_token_ids
        serving.force_include_usage = args.enable_force_include_usage
        serving.max_log_len = args.max_log_len
    max_body = args.max_request_body_bytes
    write_timeout = args.stream_write_timeout or None

    async def log_stats_forever(stats: LoggingStatLogger) -> None:
        while True:
            await asyncio.sleep(LOG_STATS_INTERVAL_S)
            stats.log()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # The objects made since collect_startup_heap (the app's), frozen with the rest.
        collect_startup_heap()
        task = asyncio.create_task(log_stats_forever(log_stat_logger)) if log_stat_logger is not None else None
        yield
        if task is not None:
            task.cancel()
        engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible API", version=pagedllm.__version__, lifespan=lifespan,
                  root_path=args.root_path or "")
    app.state.engine = engine
    app.state.stat_logger = stat_logger
    app.state.log_stat_logger = log_stat_logger
    app.state.admission = admission
    install_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR, code="engine_dead").to_json_response()

    def respond(result: BaseModel | EventStream | None) -> Response:
        if result is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if isinstance(result, EventStream):
            return SSEResponse(result, write_timeout)
        return JSONResponse(result.model_dump())

    add_pooling_routes(app, engine, models, max_body, log_requests=log_requests, limits=limits, admission=admission)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        arrival = time.time()
        check_generate_runner(engine)
        request = await read_request(raw, ChatCompletionRequest, max_body, limits)
        take_header_request_id(raw, request)
        return respond(await cancel_on_disconnect(raw, chat.create_chat_completion(request, arrival)))

    @app.post("/v1/completions")
    async def create_completion(raw: Request) -> Response:
        arrival = time.time()
        check_generate_runner(engine)
        request = await read_request(raw, CompletionRequest, max_body, limits)
        take_header_request_id(raw, request)
        return respond(await cancel_on_disconnect(raw, completion.create_completion(request, arrival)))

    @app.get("/v1/models")
    async def show_available_models() -> Response:
        return JSONResponse(models.show_available_models().model_dump())

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        request = await read_request(
            raw, lambda obj: TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest, max_body, limits
        )
        return JSONResponse((await tokenization.create_tokenize(request)).model_dump())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        request = await read_request(raw, DetokenizeRequest, max_body, limits)
        return JSONResponse((await tokenization.create_detokenize(request)).model_dump())

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as e:
            return APIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE, code="engine_dead").to_json_response()
        if admission.draining:
            return APIError(
                "The server is shutting down.", HTTPStatus.SERVICE_UNAVAILABLE, code=SHUTTING_DOWN_CODE
            ).to_json_response()
        return Response(status_code=200)

    # GET and POST, as vLLM's (SageMaker's health check posts).
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": pagedllm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=stat_logger.content_type)

    with_ui = web_ui_enabled(args.enable_web_ui, args.host)
    if with_ui:
        feed = ConsoleFeed(
            models.served_model_names[0], mc.max_model_len, cc.block_size, engine.engine_core.num_gpu_blocks,
            live_requests=engine.request_overview,
        )
        engine.stat_loggers.append(feed.record)
        install_web_ui(app, feed, args.web_ui_max_streams, write_timeout)
    keys = api_keys(args)
    if keys:
        app.add_middleware(APIKeyMiddleware, keys=keys, login_pages={UI_PATH: LOGIN_PAGE} if with_ui else None)
    app.add_middleware(DrainMiddleware, admission=admission)
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    app.add_middleware(
        HeaderLimitMiddleware, max_count=args.h11_max_header_count, max_bytes=args.h11_max_incomplete_event_size
    )
    app.add_middleware(AmbiguousFramingMiddleware)
    # Added last = outermost: CORS answers preflights before auth sees them.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    return app


def take_header_request_id(raw: Request, request: ChatCompletionRequest | CompletionRequest) -> None:
    """vLLM's: an X-Request-Id header names the request, over the body's request_id, so a gateway's id is
    the answer's id ("cmpl-<id>") and the logs'. Bounded as the body's field is (it is in every chunk)."""
    given = raw.headers.get("x-request-id")
    if given is None:
        return
    if len(given) > MAX_REQUEST_ID_LEN:
        raise APIError(f"The X-Request-Id header may be at most {MAX_REQUEST_ID_LEN} characters, got {len(given)}.",
                       param="X-Request-Id")
    request.request_id = given


# -- running -------------------------------------------------------------------------------------------
def collect_startup_heap() -> None:
    """As vLLM does: the startup heap (torch, transformers, the tokenizer, the server's modules) is
    marked static so the collector never walks it again. Otherwise the first request that allocates
    many objects (a large body) sets off a full collection that holds the GIL, and every stream, for
    a second. Run first while the engine process starts (the full pass over that heap: ~0.2 s on a
    2-core CPU, off the path to ready), then again once the app is built (a pass over what was made
    since, which is all the collector still sees)."""
    gc.collect()
    gc.freeze()


async def serve(args: argparse.Namespace, engine: AsyncLLM) -> int:
    """Serve until stopped; returns the exit code (0 after a SIGTERM drain, 1 when the engine died)."""
    t0 = time.monotonic()
    app = build_app(args, engine)
    logger.info("start-up: app took %.2f s", time.monotonic() - t0)
    config = uvicorn.Config(
        ResetStalledConnections(app),
        host=args.host if args.host is not None else "0.0.0.0",
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        root_path=args.root_path or "",
        # h11 explicitly (not "auto", which prefers httptools when installed): its header-size
        # limit is the one --h11-max-incomplete-event-size sets; our subclass adds the read timeout
        # and the connection cap (connections.py).
        http=make_protocol_class(args.timeout_request_read or None, args.limit_concurrency),
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=5,
    )
    server: DrainingServer
    admission = app.state.admission
    server = DrainingServer(
        config,
        lambda: drain(server, engine, admission, args.shutdown_timeout),
        lambda signal_name: stop_now(server, engine, admission, signal_name),
    )
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
    raise_open_file_limit()
    try:
        check_table_flags(args)
        validate_parsed_serve_args(args)
        load_chat_template(args.chat_template)
        engine_args = EngineArgs.from_cli_args(args)
        if web_ui_enabled(args.enable_web_ui, args.host):
            engine_args.kv_snapshot_interval_s = KV_SNAPSHOT_INTERVAL_S  # the console's block map
        if args.served_model_name:
            engine_args.served_model_name = list(args.served_model_name)
        prestart_for_server(engine_args)
        t0 = time.monotonic()
        config = engine_args.create_engine_config()  # every config error before the port check and the load
        logger.info("start-up: engine config took %.2f s", time.monotonic() - t0)
        check_port_free(args.host, args.port)
        engine = AsyncLLM(config, while_waiting=collect_startup_heap)
    except ValueError as e:
        discard_prestarted_engine_process()
        print(f"pagedllm: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except BaseException:  # Ctrl-C or any other failure while starting: no engine process is left behind
        discard_prestarted_engine_process()
        raise
    discard_prestarted_engine_process()  # unless AsyncLLM took it (a thread-run or unfitting engine)
    if not engine.engine_core.in_process:
        # With PAGEDLLM_PARALLEL_COMPILE=1 create_engine_config started Triton compile processes here
        # too; the engine process compiles with its own, so these would only take CPU from it.
        from pagedllm.worker.compile_pool import close_compile_pool

        close_compile_pool()
    mc = engine.model_config
    scheme = "https" if args.ssl_certfile else "http"
    logger.info(
        "pagedllm %s serving %s (max_model_len %d) at %s://%s:%d%s/v1", pagedllm.__version__,
        ", ".join(mc.served_model_name), mc.max_model_len, scheme, args.host or "0.0.0.0", args.port,
        args.root_path or "",
    )
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        exit_code = runner.run(serve(args, engine))
    if exit_code:
        raise SystemExit(exit_code)


def parse_server_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`python -m pagedllm.entrypoints.openai.api_server` flags: --config's YAML first, then argv."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedllm.entrypoints.openai.api_server",
        description="pagedllm's OpenAI-compatible server.",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = make_arg_parser(parser).parse_args(expand_config_args(argv))
    check_table_flags(args)
    return args


def main(argv: list[str] | None = None) -> None:
    run_server(parse_server_args(argv))


if __name__ == "__main__":
    main()
