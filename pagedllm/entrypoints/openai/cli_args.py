"""Flags of the OpenAI-compatible server: vLLM's server flags plus every engine flag.

    pagedllm serve [MODEL] --host 127.0.0.1 --port 8000 --served-model-name a b --api-key K ...
    python -m pagedllm.entrypoints.openai.api_server --model M ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pagedllm.envs as envs
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.web_ui_args import add_web_ui_args
from pagedllm.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from pagedllm.vllm_flags import add_table_flags

API_KEY_ENV = "PAGEDLLM_API_KEY"
# Every limit below is listed, with its reason, in docs/LIMITS.md.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_NUM_QUEUED_REQS = 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_STREAM_WRITE_TIMEOUT_S = 30.0
# h11's own default is 16 KiB; vLLM's is 4 MiB. 64 KiB holds any real header block (big cookies,
# long bearer tokens) while one connection cannot park megabytes of headers.
DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE = 64 * 1024
DEFAULT_H11_MAX_HEADER_COUNT = 256  # as vLLM
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _json_or_csv_list(value: str) -> list[str]:
    """'["a","b"]' (vLLM's form) or 'a,b'."""
    value = value.strip()
    if value.startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return parsed
    return [v.strip() for v in value.split(",") if v.strip()]


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=None, help="host to bind (default: all interfaces, as vLLM)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--uvicorn-log-level", default="info", choices=list(UVICORN_LOG_LEVELS))
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--allowed-origins", type=_json_or_csv_list, default=["*"], help='CORS origins, e.g. \'["*"]\'')
    g.add_argument("--allowed-methods", type=_json_or_csv_list, default=["*"], help="CORS methods")
    g.add_argument("--allowed-headers", type=_json_or_csv_list, default=["*"], help="CORS headers")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"accept only requests with `Authorization: Bearer KEY` on every path but /health, /ping, /version "
        f"and /metrics (/docs and /openapi.json need the key too); repeat for several keys (also from ${API_KEY_ENV})",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) the API answers to; the first is used in responses (default: --model)",
    )
    g.add_argument("--chat-template", default=None, help="a Jinja chat template: a file path or the template itself")
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests carry their own chat_template (refused by default)",
    )
    g.add_argument("--enable-log-requests", action="store_true", help="log each request (off by default, as vLLM)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="deprecated (vLLM's older spelling): requests are not logged unless --enable-log-requests")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="characters of prompt text (and prompt token ids) shown in a logged request (default: all)")
    # Tool calling and reasoning output (serving_chat.py, tool_parsers/, pagedllm/reasoning/).
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="how tool calls are read from the model's output")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="put <think>...</think> text into reasoning_content")
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (clients' certificates are checked)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="whether a client certificate is required (Python's ssl.CERT_*: 0 none, 1 optional, 2 required)")
    g.add_argument("--root-path", default=None, help="the path prefix of a proxy in front of the server (ASGI root_path)")
    g.add_argument("--response-role", default="assistant", help="the role of the generated message in chat responses")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens as 'token_id:{id}' (for tokens that do not decode to text)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer with an X-Request-Id header (the client's, or a new id)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="streams end with a usage chunk even without stream_options.include_usage")
    g.add_argument("--config", default=None,
                   help="a YAML file of flags (keys as flag names without dashes); flags on the command line win")
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413 before they are read",
    )
    add_limit_args(parser)
    add_reliability_args(parser)
    EngineArgs.add_cli_args(parser, model_positional=True)
    add_table_flags(parser)
    return parser


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    add_web_ui_args(parser)
    g = parser.add_argument_group("limits (docs/LIMITS.md)")
    g.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=DEFAULT_MAX_NUM_QUEUED_REQS,
        help="sequences that may wait beyond the --max-num-seqs running ones; past that, 503 with Retry-After "
        "(counted before tokenization; a request counts prompts x n)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds in-flight requests may run on (new ones get 503) before they are ended",
    )
    g.add_argument(
        "--stream-write-timeout",
        type=float,
        default=DEFAULT_STREAM_WRITE_TIMEOUT_S,
        help="a streaming client that reads nothing for this many seconds is dropped and its request aborted "
        "(0: never)",
    )
    g.add_argument("--max-n", type=int, default=MAX_N, help=f"largest n per request (at most {MAX_N})")
    g.add_argument(
        "--max-stop-strings", type=int, default=MAX_STOP_STRINGS, help=f"stop strings per request (at most {MAX_STOP_STRINGS})"
    )
    g.add_argument(
        "--max-stop-string-len",
        type=int,
        default=MAX_STOP_STRING_LEN,
        help=f"characters per stop string (at most {MAX_STOP_STRING_LEN})",
    )
    g.add_argument(
        "--max-logit-bias-entries",
        type=int,
        default=MAX_LOGIT_BIAS_ENTRIES,
        help=f"logit_bias entries per request (at most {MAX_LOGIT_BIAS_ENTRIES})",
    )
    g.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=None,
        help="bytes of prompt text per request, checked before tokenization (default: 32 per token of "
        "--max-model-len, at least 64 KiB)",
    )
    g.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
        help="bytes of request line + headers h11 buffers; a larger header block is refused with 400",
    )
    g.add_argument(
        "--h11-max-header-count",
        type=int,
        default=DEFAULT_H11_MAX_HEADER_COUNT,
        help="headers per request; more get 431",
    )


# -- reliability limits (issue 18; docs/LIMITS.md) -------------------------------------------------------
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # uvicorn's and vLLM's
DEFAULT_TIMEOUT_REQUEST_READ_S = 30.0
DEFAULT_LIMIT_CONCURRENCY = 8192


def add_reliability_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai import limits
    from pagedllm.entrypoints.openai.request_log import DEFAULT_MAX_LOG_LEN

    g = parser.add_argument_group("request and connection limits (docs/LIMITS.md)")
    g.add_argument("--max-json-values", type=int, default=limits.DEFAULT_MAX_JSON_VALUES,
                   help="bound on a body's JSON values, estimated from its bytes before parsing; past it, 413")
    g.add_argument("--max-messages", type=int, default=limits.DEFAULT_MAX_MESSAGES, help="chat messages per request")
    g.add_argument("--max-content-parts", type=int, default=limits.DEFAULT_MAX_CONTENT_PARTS,
                   help="content parts per chat message")
    g.add_argument("--max-stop-token-ids", type=int, default=limits.DEFAULT_MAX_STOP_TOKEN_IDS,
                   help="stop_token_ids per request")
    g.add_argument("--max-tools", type=int, default=limits.DEFAULT_MAX_TOOLS, help="tools per chat request")
    g.add_argument("--max-prompt-cpu-seconds", type=float, default=limits.DEFAULT_MAX_PROMPT_CPU_SECONDS,
                   help="CPU seconds one request may spend in chat-template rendering and tokenization; past it, 400")
    if "--max-log-len" not in parser._option_string_actions:  # vLLM's flag; the drop-in flags may define it
        g.add_argument("--max-log-len", type=int, default=DEFAULT_MAX_LOG_LEN,
                       help="characters of any client-supplied text (request ids, field names) printed in a log line")
    g.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open between requests")
    g.add_argument("--timeout-request-read", type=float, default=DEFAULT_TIMEOUT_REQUEST_READ_S,
                   help="seconds a client may take to send a request's headers and body (0: no limit); past it, "
                   "408 and the connection is closed")
    g.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                   help="open connections; one more gets 503 and is closed")


def validate_reliability_args(args: argparse.Namespace) -> None:
    at_least = {"max_json_values": 1, "max_messages": 1, "max_content_parts": 1, "max_stop_token_ids": 0,
                "max_tools": 0, "max_log_len": 0, "limit_concurrency": 1, "timeout_request_read": 0}
    for name, low in at_least.items():
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}.")
    for name in ("max_prompt_cpu_seconds", "timeout_keep_alive"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}.")


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """Server-flag checks that argparse cannot express; ValueError naming the flag."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}.")
    at_least = {
        "max_num_queued_reqs": 0, "shutdown_timeout": 0, "stream_write_timeout": 0, "max_n": 1,
        "max_stop_strings": 0, "max_stop_string_len": 1, "max_logit_bias_entries": 0,
        "h11_max_incomplete_event_size": 1024, "h11_max_header_count": 1,
    }
    for name, low in at_least.items():
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}.")
    for name, ceiling in (
        ("max_n", MAX_N), ("max_stop_strings", MAX_STOP_STRINGS), ("max_stop_string_len", MAX_STOP_STRING_LEN),
        ("max_logit_bias_entries", MAX_LOGIT_BIAS_ENTRIES),
    ):
        if getattr(args, name) > ceiling:
            raise ValueError(
                f"--{name.replace('_', '-')} may be at most {ceiling} (SamplingParams' own limit), got {getattr(args, name)}."
            )
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}.")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2 (ssl.CERT_NONE / OPTIONAL / REQUIRED), got {args.ssl_cert_reqs}.")
    if args.max_prompt_bytes is not None and args.max_prompt_bytes < 1:
        raise ValueError(f"--max-prompt-bytes must be >= 1, got {args.max_prompt_bytes}.")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together.")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral, pythonic).")
    for key in api_keys(args):
        if not key:
            raise ValueError("--api-key must not be empty.")
    validate_reliability_args(args)


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key values, plus $PAGEDLLM_API_KEY and vLLM's $VLLM_API_KEY when set."""
    keys = list(args.api_key or [])
    for env in (envs.PAGEDLLM_API_KEY, envs.VLLM_API_KEY):
        if env and env not in keys:
            keys.append(env)
    return keys


def log_requests_enabled(args: argparse.Namespace) -> bool:
    """vLLM 0.21: requests are logged only with --enable-log-requests (--disable-log-requests is
    the older spelling of the default, accepted)."""
    return bool(args.enable_log_requests) and not args.disable_log_requests


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a path to a Jinja file, or the template text itself (vLLM accepts both)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value  # looks like a template, not a path
    raise ValueError(f"--chat-template {value!r} is neither an existing file nor a Jinja template.")


def _config_file_args(path: str) -> list[str]:
    """vLLM's --config YAML -> flags: `max-num-seqs: 64` / `max_num_seqs: 64` -> --max-num-seqs 64;
    `true` -> the bare switch, `false` -> nothing; a list -> one flag with several values; a
    mapping -> its JSON (for --hf-overrides, --compilation-config)."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--config {path!r} is not a file.")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of flag names to values.")
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            raise ValueError(f"--config {path!r} cannot name another --config.")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def expand_config_args(argv: list[str]) -> list[str]:
    """Put the flags of `--config FILE` before the command line's own, so the command line wins
    (argparse keeps the last value), as vLLM does. `--config` itself stays for the parser."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            continue
        start = argv.index("serve") + 1 if "serve" in argv[:i] else 0
        # A positional model right after `serve` stays first: `serve MODEL --config f.yaml`.
        if start < len(argv) and start < i and not argv[start].startswith("-"):
            start += 1
        return argv[:start] + _config_file_args(path) + argv[start:]
    return argv
