"""The web console's flags and its on/off rule (kept apart from web_ui.py so that the argument
parser does not import the server's web stack)."""

from __future__ import annotations

import argparse
import ipaddress

DEFAULT_MAX_STREAMS = 8


def is_loopback(host: str | None) -> bool:
    """True for a bind address only this machine can reach. None (uvicorn's default here: all
    interfaces) is not loopback."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def web_ui_enabled(enable_web_ui: bool | None, host: str | None) -> bool:
    return is_loopback(host) if enable_web_ui is None else enable_web_ui


def add_web_ui_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("web console (GET /ui)")
    g.add_argument(
        "--enable-web-ui", action=argparse.BooleanOptionalAction, default=None,
        help="serve the web console at /ui and its event stream at /v1/engine/events (default: on when "
             "--host is a loopback address, off otherwise)",
    )
    g.add_argument(
        "--web-ui-max-streams", type=int, default=DEFAULT_MAX_STREAMS,
        help=f"most console event streams open at once (default {DEFAULT_MAX_STREAMS}; more get 429)",
    )
