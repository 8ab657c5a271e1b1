"""json_body.py on its own: the pre-decoding estimate, the long-digit check across slice boundaries,
the decoder's fallback (NaN accepted, >4,300-digit integers and lone surrogates refused by name)."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.json_body import (
    INT_MAX_DIGITS,
    LONG_DIGITS,
    SLICE,
    check_json_size,
    decode_json,
    estimate_json_values,
    find_unencodable,
    has_long_digit_run,
)


def test_estimate_bounds_every_value():
    # [1,2,3]: 2 commas + 1 bracket * 16; {"a": [1]}: 2 quotes + 1 colon * 32 + 2 containers * 16
    assert estimate_json_values(b"[1,2,3]") == 2 + 16
    assert estimate_json_values(b'{"a": [1]}') == 2 + 32 + 2 * 16
    assert estimate_json_values(b'["a\\nb"]') == 2 + 1 + 16  # an escape costs like a value
    body = b"[" + b",".join([b"[1]"] * 100_000) + b"]"
    assert estimate_json_values(body) >= len(json.loads(body))  # an upper bound of the values
    # slices do not lose or double count
    big = b"," * (SLICE + 7)
    assert estimate_json_values(big) == SLICE + 7


def test_check_json_size_is_413_naming_the_flag():
    check_json_size(b"[" + b"1," * 100 + b"1]", 200)
    with pytest.raises(APIError) as e:
        check_json_size(b"[" + b"1," * 300 + b"1]", 200)
    assert e.value.status_code == 413 and "--max-json-values" in e.value.message


def test_long_digit_runs_are_found_across_slice_boundaries():
    assert not has_long_digit_run(b"1" * (LONG_DIGITS - 1))
    assert has_long_digit_run(b"x" * (SLICE - 10) + b"7" * LONG_DIGITS)
    assert not has_long_digit_run(b"9" * 300 + b"," + b"9" * 300)


def test_decode_fast_and_fallback_paths():
    assert decode_json(b'{"a": [1, "x"]}') == {"a": [1, "x"]}
    nan = decode_json(b'{"t": NaN}')["t"]  # msgspec refuses NaN; the stdlib accepts it for the field check
    assert nan != nan
    assert decode_json(b'{"a": ' + b"9" * 500 + b"}")["a"] == int("9" * 500)
    with pytest.raises(APIError) as e:
        decode_json(b'{"a": ' + b"1" * (INT_MAX_DIGITS + 1) + b"}")
    assert e.value.code == "invalid_json" and "4300" in e.value.message
    with pytest.raises(APIError) as e:
        decode_json(b'{"a": [1,')
    assert e.value.code == "invalid_json"


@pytest.mark.parametrize(
    "body, path",
    [
        (b'{"prompt": "\\ud800"}', "prompt"),
        (b'{"prompt": "\xed\xa0\x80"}', "prompt"),
        (b'{"messages": [{"role": "user", "content": [{"text": "ok"}, {"text": "\\udfff"}]}]}',
         "messages[0].content[1].text"),
        (b'{"k\\ud800": 1}', "k\\ud800"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(body, path):
    with pytest.raises(APIError) as e:
        decode_json(body)
    assert e.value.param == path and "surrogate" in e.value.message


def test_valid_surrogate_pairs_pass():
    assert decode_json(b'{"e": "\\ud83d\\ude00"}') == {"e": "\U0001f600"}
    assert find_unencodable({"a": ["ok", {"b": "\U0001f600"}]}) is None
