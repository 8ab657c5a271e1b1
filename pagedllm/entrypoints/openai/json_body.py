"""Request bodies -> JSON objects in bounded time, whatever the body holds.

Decoding JSON is one C call that holds the GIL: a thread does not keep the event loop running
while it decodes (a 16 MB body of 4 million `[1]` lists takes over a second in msgspec, json or orjson
alike; BENCHMARKS.md). So the work is bounded *before* decoding, from bytes counted in 1 MiB slices
(one slice is well under a millisecond):

    estimate = count(",") + count('"') + count("\\") + 32 * count(":") + 16 * (count("[") + count("{"))

Every value past the first in a container needs a `,`, every string two `"`, every object key a
`:`, every container a bracket, every escape in a string a backslash; a container costs ~16x a number
to build, a new object key ~32x. The estimate is an upper bound of the decoding work (bytes inside
strings count too), refused past --max-json-values with 413 before anything is decoded:

    {"prompt": [[1],[1],...]}  4M lists  ->  estimate 68M  ->  413 before decoding

Bodies within the bound decode with msgspec (the fast path). A body msgspec refuses, or one with a
run of 400 or more digits (CPython converts a long integer in time quadratic in its digits), is
decoded again by the stdlib, whose integer hook runs as Python code (so the loop keeps its turns)
and refuses integers over 4,300 digits as invalid JSON. The stdlib accepts what JSON allows and
msgspec refuses (NaN, which the field checks then refuse by name; lone UTF-16 surrogates, found
here and refused naming the field).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec

from pagedllm.entrypoints.openai.errors import APIError

SLICE = 1 << 20
# A container, and an object key, cost this many times a number to build (msgspec and json alike).
CONTAINER_WEIGHT = 16
KEY_WEIGHT = 32
# Digit runs this long send the body to the stdlib decoder; past INT_MAX_DIGITS an integer is refused
# (CPython's own default limit for int(str)).
LONG_DIGITS = 400
INT_MAX_DIGITS = 4300
_DIGITS = bytes(ord("0") if 48 <= i <= 57 else ord(" ") for i in range(256))
_DIGIT_RUN = b"0" * LONG_DIGITS


def estimate_json_values(body: bytes) -> int:
    """The upper bound of decoding work described above (in 1 MiB slices)."""
    total = 0
    for start in range(0, len(body), SLICE):
        s = body[start:start + SLICE]
        total += s.count(b",") + s.count(b'"') + s.count(b"\\") + KEY_WEIGHT * s.count(b":")
        total += CONTAINER_WEIGHT * (s.count(b"[") + s.count(b"{"))
    return total


def has_long_digit_run(body: bytes) -> bool:
    # Slices overlap by LONG_DIGITS so a run across a boundary is seen.
    for start in range(0, len(body), SLICE):
        if body[start:start + SLICE + LONG_DIGITS].translate(_DIGITS).find(_DIGIT_RUN) >= 0:
            return True
    return False


def check_json_size(body: bytes, max_values: int) -> None:
    estimate = estimate_json_values(body)
    if estimate > max_values:
        raise APIError(
            f"The request body holds too many JSON values to parse: about {estimate} (its `,` `\"` `\\` count 1, "
            f"`[` and `{{` {CONTAINER_WEIGHT}, `:` {KEY_WEIGHT}); the limit is {max_values} (--max-json-values). "
            "Send fewer list items or messages.",
            413,
            code="request_too_large",
        )


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > INT_MAX_DIGITS:
        raise ValueError(f"an integer has {len(text.lstrip('-'))} digits; at most {INT_MAX_DIGITS} are allowed")
    return int(text)


def decode_json(body: bytes) -> Any:
    """The decoded body, or APIError 400 (code invalid_json, or naming a field with a lone surrogate)."""
    if not has_long_digit_run(body):
        try:
            return msgspec.json.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass  # the stdlib decides, and says why
    try:
        obj = json.loads(body, parse_int=_bounded_int)
    except RecursionError:
        raise APIError("The request body is not valid JSON: it is nested too deeply.", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer too long
        raise APIError(f"The request body is not valid JSON: {e}.", code="invalid_json") from None
    try:
        path = find_unencodable(obj)
    except RecursionError:
        path = None
    if path is not None:
        raise APIError(
            f"{path or 'The request body'} is not valid UTF-8 text: it contains a lone UTF-16 surrogate "
            "(a \\ud800-\\udfff escape without its pair, or its raw bytes).",
            param=path or None,
        )
    return obj


def _walk(obj: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, string) for every string in obj, keys included: `messages[0].content`."""
    if isinstance(obj, str):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            yield sub, k
            yield from _walk(v, sub)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")


def find_unencodable(obj: Any) -> str | None:
    """The path of the first string UTF-8 cannot encode (a lone surrogate), or None."""
    for path, s in _walk(obj, ""):
        if not s.isascii():
            try:
                s.encode()
            except UnicodeEncodeError:
                # A key's own text may be the culprit; name it escaped, never raw.
                return path.encode("utf-8", "backslashreplace").decode()
    return None


def json_kind(obj: Any) -> str:
    return {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(obj), "a number")
