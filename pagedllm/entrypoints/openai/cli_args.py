"""Flags of the OpenAI-compatible server: vLLM's server flags plus every engine flag.

    pagedllm serve [MODEL] --host 127.0.0.1 --port 8000 --served-model-name a b --api-key K ...
    python -m pagedllm.entrypoints.openai.api_server --model M ...
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pagedllm.engine.arg_utils import EngineArgs

API_KEY_ENV = "PAGEDLLM_API_KEY"
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
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
        help=f"accept only requests with `Authorization: Bearer KEY` on /v1/* and the tokenizer endpoints; "
        f"repeat for several keys (also from ${API_KEY_ENV})",
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
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413 before they are read",
    )
    EngineArgs.add_cli_args(parser, model_positional=True)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """Server-flag checks that argparse cannot express; ValueError naming the flag."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}.")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together.")
    for key in api_keys(args):
        if not key:
            raise ValueError("--api-key must not be empty.")


def api_keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key or [])
    env = os.environ.get(API_KEY_ENV)
    if env:
        keys.append(env)
    return keys


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
