"""A seeded random request generator for the HTTP server, and the checks every answer must pass.

Each case is a valid body of one endpoint with one to three mutations: a field set to a value of
the wrong JSON type, out of its range, a structure that is malformed (messages, tools,
response_format, ...), or the raw bytes changed (duplicate keys, lone surrogates, deep nesting,
truncation, a wrong content type, a chunked body). Plain `random`, so a seed names a run:

    fuzz = RequestFuzzer(seed=0, vocab_size=49152, max_model_len=512)
    for case in fuzz.cases(300):
        problems = check_response(case, send_case(client, server_url, case))

`check_response` holds every answer to the server's rule (README, docs/LIMITS.md): 200 or 4xx,
never 5xx nor a dropped connection; a 4xx has OpenAI's error body whose `param` or message names a
field the case changed; a 200 has the endpoint's shape (a stream ends with `data: [DONE]` and has
no in-band error); a mutation that must be refused (a wrong type, a value out of range) is not
answered 200.

Run it longer by hand against a running server:

    python -m tests.reliability.fuzz_requests --url http://127.0.0.1:8000 --cases 3000 --seed 1
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

# -- cases ------------------------------------------------------------------------------------------
REJECT = "reject"  # a mutation the server must refuse (4xx)
ANY = "any"  # 200 or 4xx are both fine, as long as each is well formed


@dataclass
class Case:
    name: str  # what was mutated: "completions: temperature=wrong-type(str)"
    path: str
    body: bytes
    expect: str = ANY
    fields: tuple[str, ...] = ()  # the fields the mutations touched (one must be named by a 4xx)
    stream: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False

    def __str__(self) -> str:
        shown = self.body[:300].decode("utf-8", "backslashreplace")
        return f"{self.name} -> POST {self.path} {shown}{'...' if len(self.body) > 300 else ''}"


# JSON kinds of each field: what a valid value looks like, so a wrong-typed one can be chosen.
INT, NUM, BOOL, STR = "int", "num", "bool", "str"
SAMPLING_FIELDS: dict[str, str] = {
    "n": INT, "best_of": INT, "seed": INT, "temperature": NUM, "top_p": NUM, "top_k": INT, "min_p": NUM,
    "frequency_penalty": NUM, "presence_penalty": NUM, "repetition_penalty": NUM, "max_tokens": INT,
    "min_tokens": INT, "ignore_eos": BOOL, "skip_special_tokens": BOOL, "spaces_between_special_tokens": BOOL,
    "include_stop_str_in_output": BOOL, "prompt_logprobs": INT, "stream": BOOL, "user": STR, "request_id": STR,
    "cache_salt": STR, "return_token_ids": BOOL, "use_beam_search": BOOL, "truncate_prompt_tokens": INT,
    "stop": "stop", "stop_token_ids": "ids", "logit_bias": "bias", "allowed_token_ids": "ids",
    "bad_words": "strs", "stream_options": "obj", "structured_outputs": "obj", "guided_json": "json",
    "guided_regex": STR, "guided_choice": "strs", "guided_grammar": STR, "guided_decoding_backend": STR,
    "response_format": "obj", "model": STR,
}
CHAT_FIELDS = {**SAMPLING_FIELDS, "messages": "messages", "logprobs": BOOL, "top_logprobs": INT,
               "max_completion_tokens": INT, "echo": BOOL, "add_generation_prompt": BOOL,
               "continue_final_message": BOOL, "add_special_tokens": BOOL, "chat_template_kwargs": "obj",
               "tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": BOOL, "chat_template": STR}
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "prompt": "prompt", "logprobs": INT, "echo": BOOL, "suffix": STR,
                     "add_special_tokens": BOOL}
TOKENIZE_FIELDS = {"model": STR, "prompt": STR, "add_special_tokens": BOOL, "return_token_strs": BOOL}
TOKENIZE_CHAT_FIELDS = {"model": STR, "messages": "messages", "add_generation_prompt": BOOL,
                        "continue_final_message": BOOL, "add_special_tokens": BOOL, "return_token_strs": BOOL,
                        "chat_template_kwargs": "obj", "chat_template": STR, "tools": "tools"}
DETOKENIZE_FIELDS = {"model": STR, "tokens": "ids"}
EMBEDDING_FIELDS = {"model": STR, "input": "input", "encoding_format": STR, "dimensions": INT, "normalize": BOOL,
                    "user": STR, "truncate_prompt_tokens": INT}

# Values of every JSON kind, and the odd ones (huge, negative, NaN-like strings, nesting).
ODD_STRINGS = ["", " ", "1", "1.5", "NaN", "Infinity", "-inf", "null", "true", "\u0000", "\u202eRTL\u202c",
               "\U0001f600", "a" * 5000, "\ud7ff", "é", "{\"a\": 1}"]
ODD_INTS = [0, -1, 1, 2, -(2**31), 2**31, 2**63, -(2**63) - 1, 2**64, 10**30, 49151, 49152, 10**6]
ODD_FLOATS = [0.0, -0.0, 0.5, 1.5, -1.5, 1e-300, 1e300, -1e300, 2.0000001, 100.0, 1e308 * 10]  # the last is inf


def _wrong_type_values(kind: str) -> list[Any]:
    """Values of the wrong JSON type for a field of `kind` (each must be refused)."""
    pool: list[Any] = {
        INT: ["1", 1.5, 2.0, True, [1], {"a": 1}],
        NUM: ["0.5", "NaN", True, [0.5], {"v": 1}],
        BOOL: ["true", 1, 0, 1.0, [True], {}],
        STR: [1, 1.5, True, ["a"], {"a": "b"}],
        "stop": [1, [1], [["a"]], {"a": 1}, True, [None]],
        "ids": ["1", [1.5], [[1]], ["1"], {"1": 1}, [True], 7],
        "strs": ["a", [1], [["a"]], {"a": 1}, 3, [None]],
        "bias": [[1, 2], "1", {"1": "5"}, {"1": [1]}, {"1": True}, 5],
        "obj": ["x", 1, [1], True],
        "json": [1, [1], True],
        "messages": ["hi", {"role": "user", "content": "hi"}, 1, [1], [[]], [None]],
        "tools": ["x", {"type": "function"}, 1, [1], [None]],
        "tool_choice": [1, [1], True],
        "prompt": [1, 1.5, True, {"a": 1}, [1.5], [[1.5]], [["a"]], [None], [[1], "a"], [1, "a"]],
        "input": [1, 1.5, True, {"a": 1}, [1.5], [None], [[1.5]]],
    }[kind]
    return pool


def _malformed_values(fld: str, vocab: int, max_len: int) -> list[tuple[Any, str]]:
    """(value, expectation) of a field's own malformations: out of range, empty, huge, invalid schemas."""
    big = max_len + 10
    table: dict[str, list[tuple[Any, str]]] = {
        "temperature": [(-0.1, REJECT), (2.5, REJECT), (1e300, REJECT), (0.0, ANY), (2.0, ANY), (1e-9, ANY)],
        "top_p": [(0.0, REJECT), (-1.0, REJECT), (1.1, REJECT), (1e-9, ANY), (1.0, ANY)],
        "top_k": [(-2, REJECT), (0, ANY), (-1, ANY), (1, ANY), (10**9, ANY), (2**63, REJECT), (10**30, REJECT)],
        "min_p": [(-0.1, REJECT), (1.1, REJECT), (1.0, ANY), (0.0, ANY)],
        "frequency_penalty": [(-2.1, REJECT), (2.1, REJECT), (2.0, ANY), (-2.0, ANY)],
        "presence_penalty": [(-2.1, REJECT), (2.1, REJECT), (2.0, ANY)],
        "repetition_penalty": [(0.0, REJECT), (-1.0, REJECT), (1e300, ANY), (2.0, ANY), (0.01, ANY)],
        "n": [(0, REJECT), (-1, REJECT), (10**6, REJECT), (2, ANY), (3, ANY)],
        "best_of": [(0, REJECT), (-1, REJECT), (5, ANY), (1, ANY)],
        "seed": [(-1, ANY), (0, ANY), (2**63 - 1, ANY), (2**63, REJECT), (2**64, REJECT), (-(2**63) - 1, REJECT),
                 (10**30, REJECT)],
        "max_tokens": [(0, REJECT), (-1, REJECT), (max_len, REJECT), (10**12, REJECT), (1, ANY), (None, ANY)],
        "max_completion_tokens": [(0, REJECT), (-5, REJECT), (max_len * 4, REJECT), (1, ANY)],
        "min_tokens": [(-1, REJECT), (3, ANY), (10**9, REJECT), (2, ANY)],
        "logprobs": [(-1, REJECT), (0, ANY), (2, ANY), (10**6, REJECT), (True, ANY), (False, ANY)],
        "top_logprobs": [(-1, REJECT), (0, ANY), (3, ANY), (10**6, REJECT)],
        "prompt_logprobs": [(-1, REJECT), (0, ANY), (2, ANY), (10**6, REJECT), (10**30, REJECT)],
        "stop": [([], ANY), ([""], REJECT), ("", ANY), (["a"] * 200, REJECT), ("x" * 5000, REJECT),
                 (["\u0000"], ANY), (["\U0001f600", "é"], ANY), ([" ", "\n"], ANY)],
        "stop_token_ids": [([], ANY), ([-1], REJECT), ([vocab], REJECT), ([10**9], REJECT), ([0, 1, 2], ANY),
                           (list(range(5000)), REJECT), ([2**64], REJECT)],
        "allowed_token_ids": [([], REJECT), ([-1], REJECT), ([vocab], REJECT), ([2**63], REJECT), ([1, 2], ANY)],
        "bad_words": [([], ANY), ([""], REJECT), (["hello", "world"], ANY), (["\u0000"], ANY), (["a" * 3000], ANY)],
        "logit_bias": [({}, ANY), ({"a": 1}, REJECT), ({"-1": 1}, REJECT), ({str(vocab): 1}, REJECT),
                       ({"1": 101}, REJECT), ({"1": -101}, REJECT), ({"1.5": 1}, REJECT), ({"1": 50}, ANY),
                       ({"99999999999999999999999": 1}, REJECT), ({"": 1}, REJECT), ({" 1": 1}, ANY),
                       ({str(i): 1 for i in range(3000)}, REJECT)],
        "truncate_prompt_tokens": [(0, REJECT), (-2, REJECT), (-1, ANY), (1, ANY), (10**9, ANY), (10**30, REJECT)],
        "response_format": [({}, ANY), ({"type": "nope"}, REJECT), ({"type": "json_schema"}, REJECT),
                            ({"type": "json_schema", "json_schema": {"name": "x"}}, REJECT),
                            ({"type": "json_schema", "json_schema": {"name": "x", "schema": "str"}}, REJECT),
                            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
                             REJECT),
                            ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, ANY),
                            ({"type": "json_object"}, ANY), ({"type": "text"}, ANY), ({"type": 5}, REJECT),
                            ({"type": "structural_tag"}, REJECT),
                            ({"type": "structural_tag", "structures": "x", "triggers": 1}, REJECT)],
        "structured_outputs": [({}, ANY), ({"regex": "("}, REJECT), ({"choice": []}, REJECT),
                               ({"json": {"type": "nope"}}, REJECT), ({"json": "{"}, REJECT),
                               ({"regex": "a", "choice": ["a"]}, REJECT), ({"nope": 1}, REJECT),
                               ({"grammar": "root ::= "}, REJECT), ({"choice": ["a", "b"]}, ANY),
                               ({"regex": "[ab]{1,3}"}, ANY), ({"json": {"type": "integer"}}, ANY),
                               ({"choice": [1, 2]}, REJECT), ({"regex": 5}, REJECT),
                               ({"json_object": True}, ANY), ({"json_object": "yes"}, REJECT),
                               ({"choice": [""]}, ANY), ({"grammar": 7}, REJECT),
                               ({"regex": "a", "backend": 5}, REJECT), ({"regex": "a", "backend": "nope"}, REJECT),
                               ({"regex": "a", "disable_any_whitespace": "x"}, REJECT),
                               ({"json": {"type": "object"}, "disable_additional_properties": [1]}, REJECT),
                               ({"regex": "a", "disable_fallback": 1}, REJECT), ({"regex": "a", "backend": None}, ANY),
                               ({"json": True}, REJECT), ({"json": {}}, ANY), ({"structural_tag": "{"}, REJECT)],
        "guided_json": [("{", REJECT), ({"type": "nope"}, REJECT), ("{\"type\": \"string\"}", ANY),
                        ({"type": "object", "properties": {"a": {"type": "integer"}}}, ANY),
                        ({"$ref": "#/nope"}, REJECT)],
        "guided_regex": [("(", REJECT), ("[", REJECT), ("a{5,1}", REJECT), ("a+", ANY), ("", REJECT)],
        "guided_choice": [([], REJECT), (["x"], ANY), ([""], ANY), (["a"] * 3, ANY)],
        "guided_grammar": [("", REJECT), ("root ::= ", REJECT), ("nonsense", REJECT), ('root ::= "a"', ANY)],
        "guided_decoding_backend": [("nope", REJECT), ("xgrammar", ANY), ("", REJECT)],
        "stream_options": [({"include_usage": True}, ANY), ({"include_usage": "yes"}, REJECT),
                           ({"continuous_usage_stats": True, "include_usage": True}, ANY), ({"nope": 1}, ANY)],
        "chat_template_kwargs": [({"tokenize": True}, REJECT), ({"enable_thinking": False}, ANY),
                                 ({"add_generation_prompt": 1}, REJECT), ({"x": [1, {"y": None}]}, ANY),
                                 ({"return_dict": True}, REJECT)],
        # the fuzz server trusts request templates (--trust-request-chat-template)
        "chat_template": [("{{ 1/0 }}", REJECT), ("{% for %}", REJECT), ("{{ messages[99].content }}", REJECT),
                          ("{{ raise_exception('no') }}", REJECT), ("{% for i in range(10**9) %}x{% endfor %}", REJECT),
                          ("{{ 'x' * 10**9 }}", REJECT), ("{{ cycler.__init__.__globals__ }}", REJECT),
                          ("{{ messages[0].content.x.y }}", REJECT), ("{{ {}[1] }}", ANY), ("", ANY),
                          ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", ANY),
                          ("{{ tools | tojson }}{{ messages | tojson }}", ANY)],
        "model": [("nope", REJECT), ("", REJECT), ("tiny", ANY), ("TINY", REJECT)],
        "request_id": [("", ANY), ("x" * 600, REJECT), ("\u0000\n\r", ANY), ("a/b c", ANY)],
        "user": [("", ANY), ("\u0000", ANY)],
        "cache_salt": [("", ANY), ("salt", ANY)],
        "suffix": [("", ANY), ("x", REJECT)],
        "echo": [(True, ANY)],
        "use_beam_search": [(True, REJECT), (False, ANY)],
        "tools": [([], ANY), ([{}], REJECT), ([{"type": "function"}], REJECT),
                  ([{"type": "function", "function": {}}], REJECT),
                  ([{"type": "function", "function": {"name": ""}}], REJECT),
                  ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], REJECT),
                  ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], ANY),
                  ([{"type": "retrieval"}], REJECT),
                  ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], ANY),
                  ([{"type": "function", "function": {"name": 5}}], REJECT)],
        "tool_choice": [("none", ANY), ("auto", ANY), ("required", ANY), ("sometimes", REJECT), ({}, REJECT),
                        ({"type": "function"}, REJECT), ({"type": "function", "function": {"name": "f"}}, ANY),
                        ({"type": "function", "function": {"name": 1}}, REJECT)],
        "parallel_tool_calls": [(False, ANY), (True, ANY)],
        "messages": [([], REJECT), ([{}], REJECT), ([{"role": "user"}], REJECT),
                     ([{"role": "wizard", "content": "hi"}], REJECT), ([{"role": 5, "content": "hi"}], REJECT),
                     ([{"role": "user", "content": 5}], REJECT), ([{"role": "user", "content": []}], REJECT),
                     ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], REJECT),
                     ([{"role": "user", "content": [{"type": "text"}]}], REJECT),
                     ([{"role": "user", "content": [{"type": "text", "text": 5}]}], REJECT),
                     ([{"role": "user", "content": [{"text": "hi"}]}], REJECT),
                     ([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], REJECT),
                     ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], ANY),
                     ([{"role": "assistant", "content": None}, {"role": "user", "content": "x"}], ANY),
                     ([{"role": "assistant"}], ANY),
                     ([{"role": "system", "content": "s"}, {"role": "user", "content": "\u0000"}], ANY),
                     ([{"role": "user", "content": "hi", "name": 5}], ANY),
                     ([{"role": "user", "content": "hi", "name": {"a": 1}}], ANY),
                     ([{"role": "assistant", "content": "", "tool_calls": "x"}], REJECT),
                     ([{"role": "assistant", "content": "", "tool_calls": [{}]}], REJECT),
                     ([{"role": "assistant", "content": "", "tool_calls": [5]}], REJECT),
                     ([{"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}], REJECT),
                     ([{"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}], ANY),
                     ([{"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                       {"role": "tool", "content": "r", "tool_call_id": "c"}], ANY),
                     ([{"role": "tool", "content": "r", "tool_call_id": 5}], ANY),
                     ([{"role": "user", "content": "hi", "extra": [1, 2]}], ANY),
                     ([{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}], ANY),
                     ([{"role": "user", "content": "x" * 3000}] * 3, ANY),
                     ([{"role": "user", "content": "\u202eמימין\u202c \U0001f600"}], ANY)],
        "prompt": [("", ANY), ([], REJECT), ([[]], REJECT), ([""], ANY), ([-1], REJECT), ([vocab], REJECT),
                   ([2**63], REJECT), ([[1, 2], [vocab + 5]], REJECT), ([1] * big, REJECT), ("word " * 2000, REJECT),
                   (["a", "b"], ANY), ([[1, 2], [3]], ANY), ([0], ANY), ("\u0000", ANY),
                   ("\u202eRTL\u202c \U0001f600", ANY), (["a"] * 5000, REJECT)],
        "input": [("", ANY), ([], REJECT), ([""], ANY), ([-1], REJECT), ([10**9], REJECT), (["a", "b"], ANY),
                  ([[1, 2], [3]], ANY), ("word " * 2000, ANY), ([[]], REJECT)],
        "encoding_format": [("base64", ANY), ("float", ANY), ("hex", REJECT), ("", REJECT)],
        "dimensions": [(0, REJECT), (-1, REJECT), (10**6, REJECT), (8, ANY)],
        "tokens": [([], ANY), ([-1], REJECT), ([vocab], REJECT), ([2**63], REJECT), ([0, 1, 2], ANY),
                   (list(range(5000)), REJECT)],
    }
    return table.get(fld, [])


# -- the generator ---------------------------------------------------------------------------------
class RequestFuzzer:
    """Seeded cases over /v1/completions, /v1/chat/completions (stream and not), /tokenize,
    /detokenize, and /v1/embeddings when `embeddings` (a pooling model is served)."""

    def __init__(self, seed: int, *, model: str, vocab_size: int, max_model_len: int,
                 generate: bool = True, embeddings: bool = False) -> None:
        self.rng = random.Random(seed)
        self.model = model
        self.vocab = vocab_size
        self.max_len = max_model_len
        self.endpoints: list[tuple[str, Callable[[], dict[str, Any]], dict[str, str], int]] = []
        if generate:
            self.endpoints += [
                ("/v1/completions", self._completion, COMPLETION_FIELDS, 4),
                ("/v1/chat/completions", self._chat, CHAT_FIELDS, 4),
                ("/tokenize", self._tokenize, TOKENIZE_FIELDS, 1),
                ("/tokenize", self._tokenize_chat, TOKENIZE_CHAT_FIELDS, 1),
                ("/detokenize", self._detokenize, DETOKENIZE_FIELDS, 1),
            ]
        if embeddings:
            self.endpoints.append(("/v1/embeddings", self._embedding, EMBEDDING_FIELDS, 4))

    # valid bodies, small and fast (a few tokens each)
    def _completion(self) -> dict[str, Any]:
        return {"model": self.model, "prompt": self.rng.choice(["hi", "The quick brown fox", [1, 2, 3]]),
                "max_tokens": self.rng.randint(1, 4), "stream": self.rng.random() < 0.4}

    def _chat(self) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": self.rng.choice(["hi", "Tell me"])}],
                "max_tokens": self.rng.randint(1, 4), "stream": self.rng.random() < 0.4}

    def _tokenize(self) -> dict[str, Any]:
        return {"model": self.model, "prompt": "hello world"}

    def _tokenize_chat(self) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": "hi"}]}

    def _detokenize(self) -> dict[str, Any]:
        return {"model": self.model, "tokens": [1, 2, 3]}

    def _embedding(self) -> dict[str, Any]:
        return {"model": self.model, "input": self.rng.choice(["hello", ["a", "b"], [1, 2, 3]])}

    def _mutate_field(self, body: dict[str, Any], fields: dict[str, str]) -> tuple[str, str, str]:
        """One field changed in place -> (field, description, expectation)."""
        rng = self.rng
        fld = rng.choice(sorted(fields))
        kind = fields[fld]
        roll = rng.random()
        own = _malformed_values(fld, self.vocab, self.max_len)
        if own and roll < 0.55:
            value, expect = rng.choice(own)
            body[fld] = copy.deepcopy(value)
            return fld, f"{fld}=malformed", expect
        if roll < 0.85:
            body[fld] = copy.deepcopy(rng.choice(_wrong_type_values(kind)))
            return fld, f"{fld}=wrong-type({type(body[fld]).__name__})", REJECT
        if roll < 0.92:
            body[fld] = None
            return fld, f"{fld}=null", ANY
        if roll < 0.96:
            body.pop(fld, None)
            return fld, f"{fld} dropped", ANY
        body[fld] = copy.deepcopy(rng.choice(ODD_STRINGS + ODD_INTS + ODD_FLOATS + [[], {}, [[[]]]]))
        return fld, f"{fld}=odd", ANY

    def _fix_expectation(self, path: str, body: dict[str, Any], fld: str, expect: str) -> str:
        """Wrong types the schema lawfully takes: an int where a number goes, a number for a bool
        nowhere; a string `stop` is a list's shorthand; a bool is not an int (strict)."""
        if expect != REJECT:
            return expect
        if path == "/tokenize" and fld == "prompt" and isinstance(body.get(fld), str):
            return ANY  # /tokenize counts a prompt of any length (vLLM's too)
        v = body.get(fld)
        kind = {**COMPLETION_FIELDS, **CHAT_FIELDS, **EMBEDDING_FIELDS, **DETOKENIZE_FIELDS}.get(fld)
        if kind == NUM and isinstance(v, int) and not isinstance(v, bool):
            return ANY
        return expect

    def _encode(self, body: dict[str, Any]) -> tuple[bytes, str, str, dict[str, str], bool]:
        """(bytes, description, expectation, headers, chunked): mostly plain JSON; sometimes raw changes."""
        rng = self.rng
        text = json.dumps(body, ensure_ascii=rng.random() < 0.5, allow_nan=True)
        roll = rng.random()
        if roll < 0.80:
            return text.encode("utf-8", "surrogatepass"), "", ANY, {}, False
        if roll < 0.83:  # duplicate key: the last wins (vLLM's json.loads too), never a 500
            key = rng.choice(sorted(body))
            dup = json.dumps({key: rng.choice([None, 1, "x", [1], True])})[1:-1]
            return (text[:-1] + ", " + dup + "}").encode(), f"dup-key({key})", ANY, {}, False
        if roll < 0.86:  # a lone surrogate escape in a string value
            s = text.replace('"hi"', '"hi\\ud800"', 1).replace('"hello', '"\\udfffhello', 1)
            return s.encode(), "lone-surrogate", REJECT if s != text else ANY, {}, False
        if roll < 0.88:  # raw invalid UTF-8
            return text.encode()[:-1] + b'\xff\xfe}', "invalid-utf8", REJECT, {}, False
        if roll < 0.90:
            cut = rng.randint(0, max(0, len(text) - 1))
            return text[:cut].encode(), "truncated", REJECT, {}, False
        if roll < 0.92:
            depth = rng.choice([64, 1000, 20_000])
            nested = "[" * depth + "]" * depth
            fld = rng.choice(sorted(body))
            s = text[:-1] + f', "{fld}": {nested}}}'
            return s.encode(), f"deep({fld},{depth})", REJECT, {}, False
        if roll < 0.94:
            ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                "application/xml", "application/json; charset=latin-1", "APPLICATION/JSON"])
            expect = ANY if ctype.lower().startswith("application/json") else REJECT
            return text.encode(), f"content-type({ctype})", expect, {"content-type": ctype}, False
        if roll < 0.955:
            return text.encode(), "chunked", ANY, {}, True
        if roll < 0.96:  # past --max-request-body-bytes (the fuzz servers' 200 kB): 413, or the connection closed
            pad = json.dumps({"padding": "x" * 250_000})[1:-1]
            return (text[:-1] + ", " + pad + "}").encode(), "oversize", REJECT, {}, rng.random() < 0.5
        if roll < 0.98:
            junk = rng.choice([b"", b"   ", b"null", b"[]", b"42", b'"x"', b"{", b"\x00\x01", b"NaN",
                               b"{'a': 1}", b"\xef\xbb\xbf" + text.encode()])
            expect = ANY if junk.startswith(b"\xef\xbb\xbf") else REJECT  # a BOM may be ignored (RFC 8259)
            return junk, "not-json", expect, {}, False
        # numbers JSON has no spelling for (Python's json writes them): NaN / Infinity in a field
        fld = rng.choice(sorted(body))
        return (text[:-1] + f', "{fld}": {rng.choice(["NaN", "Infinity", "-Infinity", "1e999"])}}}').encode(), \
            f"nan-like({fld})", REJECT, {}, False

    def cases(self, count: int) -> Iterator[Case]:
        rng = self.rng
        weights = [w for *_, w in self.endpoints]
        for _ in range(count):
            path, make, fields, _w = rng.choices(self.endpoints, weights)[0]
            body = make()
            expects: dict[str, str] = {}  # field -> the expectation of its last mutation
            names: list[str] = []
            if rng.random() < 0.25:
                # A combination of values each fine alone (echo + logprobs + n + stop + a token prompt ...).
                for fld in rng.sample(sorted(fields), min(len(fields), rng.randint(3, 8))):
                    good = [v for v, e in _malformed_values(fld, self.vocab, self.max_len) if e == ANY]
                    if good:
                        body[fld] = copy.deepcopy(rng.choice(good))
                        names.append(f"{fld}={body[fld]!r:.30}")
                        expects[fld] = ANY  # fine alone; together with another, a 4xx may name it
            for _m in range(rng.choice([0, 0, 1, 1, 1, 2, 3]) if names else rng.choice([1, 1, 1, 2, 3])):
                fld, what, exp = self._mutate_field(body, fields)
                expects[fld] = self._fix_expectation(path, body, fld, exp)
                names.append(what)
            raw, what, exp, headers, chunked = self._encode(body)
            if what:
                names.append(what)
                if what.startswith(("dup-key", "nan-like", "deep")):  # (field) or (field,depth)
                    expects[what[what.find("(") + 1:-1].split(",")[0]] = exp
                else:
                    expects[""] = exp
            expect = REJECT if REJECT in expects.values() else ANY
            touched = [f for f in expects if f]
            stream = body.get("stream") is True and path.startswith("/v1/") and "embeddings" not in path
            yield Case(f"{path}: {', '.join(names)}", path, raw, expect, tuple(touched), stream, headers, chunked)


# -- the offline API ---------------------------------------------------------------------------------
# SamplingParams' own fields (the HTTP fields of the same name carry the same rules).
PARAMS_FIELDS: dict[str, str] = {
    k: v for k, v in SAMPLING_FIELDS.items()
    if k not in ("stream", "user", "request_id", "cache_salt", "return_token_ids", "use_beam_search", "model",
                 "stream_options", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "guided_decoding_backend", "response_format")
} | {"logprobs": INT, "detokenize": BOOL}
# Python values of the wrong type for SamplingParams (no JSON here: tuples, bytes, objects too).
PY_WRONG = {INT: ["1", 1.5, True, None, [1], b"1"], NUM: ["0.5", None, [0.5], b"1", True, float("nan")],
            BOOL: ["true", 1, None, [True], "no"], "stop": [1, [1], [["a"]], {"a": 1}, b"ab", (None,)],
            "ids": ["12", [1.5], [[1]], ["1"], 7, [True], b"\x01", (None,)],
            "strs": ["a", [1], [["a"]], 3, [None], b"ab"], "bias": [[1, 2], "1", {"1": "5"}, {"1": [1]}, 5, {1.5: 1},
                                                                  {None: 1}, {1: float("nan")}, {1: float("inf")}],
            "obj": ["x", 1, [1], True, {"regex": "a", "backend": 5}, {"json_object": "yes"}]}


@dataclass
class OfflineCase:
    name: str
    kwargs: dict[str, Any]  # SamplingParams(**kwargs)
    prompt: Any  # LLM.generate's prompts, or LLM.chat's messages when chat
    chat: bool = False
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    expect: str = ANY
    fields: tuple[str, ...] = ()


class OfflineFuzzer:
    """Seeded cases for LLM.generate / LLM.chat: bad SamplingParams values, prompts and messages."""

    def __init__(self, seed: int, *, vocab_size: int, max_model_len: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab_size
        self.max_len = max_model_len

    def _value(self, fld: str) -> tuple[Any, str]:
        rng = self.rng
        own = _malformed_values(fld, self.vocab, self.max_len)
        if own and rng.random() < 0.6:
            value, expect = rng.choice(own)
            if fld == "stop_token_ids" and len(value) > 1000:
                expect = ANY  # --max-stop-token-ids is the server's limit; the LLM has none (vLLM's neither)
            if fld == "seed" and 0 <= value < 2**64:
                expect = ANY  # the HTTP field stops at 2**63 - 1 (vLLM's); torch's generators take up to 2**64 - 1
            return copy.deepcopy(value), expect
        value = copy.deepcopy(rng.choice(PY_WRONG[PARAMS_FIELDS[fld]]))
        kind = PARAMS_FIELDS[fld]
        if value is None and fld in ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs", "logit_bias",
                                     "truncate_prompt_tokens", "stop", "stop_token_ids", "allowed_token_ids",
                                     "bad_words", "structured_outputs"):
            return value, ANY  # None is these fields' default
        if value is True and fld in ("logprobs", "prompt_logprobs"):
            return value, ANY  # vLLM's spelling of 1 (the sampled token's logprob), as the HTTP field's True
        if kind == NUM and isinstance(value, bool):
            return value, REJECT
        return value, REJECT

    def cases(self, count: int) -> Iterator[OfflineCase]:
        rng = self.rng
        for _ in range(count):
            kwargs: dict[str, Any] = {"max_tokens": rng.randint(1, 3)}
            expects: dict[str, str] = {}
            for _m in range(rng.choice([1, 1, 2])):
                fld = rng.choice(sorted(PARAMS_FIELDS))
                kwargs[fld], expects[fld] = self._value(fld)
            names = [f"{k}={v!r:.40}" for k, v in kwargs.items()]
            roll = rng.random()
            chat, chat_kwargs, prompt = False, {}, rng.choice(["hi", [1, 2, 3], {"prompt": "hi"}])
            if roll < 0.2:  # a bad prompt instead
                kwargs, expects = {"max_tokens": 2}, {}
                prompt, exp = rng.choice([
                    ("", ANY), ([], ANY), ([-1], REJECT), ([self.vocab], REJECT), ([1.5], REJECT),
                    ({"prompt_token_ids": [self.vocab + 1]}, REJECT), ({}, REJECT), ({"prompt": 5}, REJECT),
                    ([1] * (self.max_len + 1), REJECT), (["hi", 5], REJECT), ([[1], [2]], ANY), (None, REJECT), (["a"], ANY),
                    (5, REJECT), ({"prompt_token_ids": "12"}, REJECT), ("\u0000\u202e", ANY), ([[]], REJECT),
                    (["hi", [self.vocab]], REJECT), ({"prompt": "hi", "multi_modal_data": {"image": None}}, REJECT),
                    ({"prompt_token_ids": [1, 2], "cache_salt": "s"}, ANY)])
                expects["prompt"] = exp
                names = [f"prompt={prompt!r:.60}"]
            elif roll < 0.4:  # LLM.chat with odd messages / template arguments
                chat = True
                value, exp = rng.choice(_malformed_values("messages", self.vocab, self.max_len)
                                        + [(rng.choice(_wrong_type_values("messages")), REJECT)])
                prompt = copy.deepcopy(value)
                expects["messages"] = exp
                names.append(f"messages={prompt!r:.80}")
                if rng.random() < 0.3:
                    ctk, exp = rng.choice(_malformed_values("chat_template_kwargs", self.vocab, self.max_len))
                    chat_kwargs["chat_template_kwargs"] = ctk
                    expects["chat_template_kwargs"] = exp
                    names.append(f"chat_template_kwargs={ctk!r}")
                if rng.random() < 0.3:  # LLM.chat(tools=...): the server's tools check
                    tools, exp = rng.choice(_malformed_values("tools", self.vocab, self.max_len))
                    chat_kwargs["tools"] = copy.deepcopy(tools)
                    expects["tools"] = exp
                    names.append(f"tools={tools!r:.60}")
            expect = REJECT if REJECT in expects.values() else ANY
            yield OfflineCase(", ".join(names), kwargs, prompt, chat, chat_kwargs, expect, tuple(expects))


def run_offline_case(llm: Any, case: OfflineCase) -> list[str]:
    """One case through the LLM; -> its problems. A refusal must be ValueError or TypeError naming a
    field the case set; an accepted case must give well-formed outputs."""
    from pagedllm import SamplingParams

    try:
        params = SamplingParams(**case.kwargs)
        if case.chat:
            outs = llm.chat(case.prompt, params, use_tqdm=False, **case.chat_kwargs)
        else:
            outs = llm.generate(case.prompt, params, use_tqdm=False)
    except (ValueError, TypeError) as e:
        msg = str(e)
        words = (*case.fields, "prompt", "message", "token id", "maximum context length", "vocabulary")
        if not any(w in msg for w in words):
            return [f"{type(e).__name__} names none of {case.fields}: {msg!r:.200}"]
        return []
    except Exception as e:  # noqa: BLE001 - every other exception is the finding
        return [f"{type(e).__name__} (not ValueError/TypeError): {e!s:.300}"]
    if case.expect == REJECT:
        return ["accepted a value that must be refused"]
    problems = []
    for out in outs:
        if not out.finished or not all(isinstance(c.text, str) for c in out.outputs):
            problems.append(f"output not finished / no text: {out!r:.200}")
    return problems


# -- sending and checking ---------------------------------------------------------------------------
@dataclass
class Answer:
    status: int | None  # None: no answer (the connection dropped)
    body: bytes
    error: str = ""
    content_type: str = ""


def send_case(client: httpx.Client, base_url: str, case: Case, headers: dict[str, str] | None = None,
              timeout: float = 60) -> Answer:
    hdrs = {"content-type": "application/json", **(headers or {}), **case.headers}
    content: Any = case.body
    if case.chunked:
        def pieces(b: bytes = case.body) -> Iterator[bytes]:
            for i in range(0, len(b), 7):
                yield b[i:i + 7]
        content = pieces()
    try:
        with client.stream("POST", base_url + case.path, content=content, headers=hdrs, timeout=timeout) as r:
            return Answer(r.status_code, r.read(), content_type=r.headers.get("content-type", ""))
    except httpx.HTTPError as e:
        return Answer(None, b"", f"{type(e).__name__}: {e}")


def _error_problems(case: Case, body: Any) -> list[str]:
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return [f"4xx body is not OpenAI's error shape: {body!r:.300}"]
    err = body["error"]
    problems = []
    if set(err) != {"message", "type", "param", "code"}:
        problems.append(f"error keys {sorted(err)}")
    if not isinstance(err.get("message"), str) or not err["message"]:
        problems.append("error message empty")
    if err.get("type") != "invalid_request_error":
        problems.append(f"error type {err.get('type')!r}")
    if case.fields and not any(
        f in (err.get("param") or "") or f in (err.get("message") or "") for f in case.fields
    ):
        # Errors about the body as a whole (not JSON, size, content type, the model) name no field.
        generic = ("JSON", "Content-Type", "body", "model", "too large", "UTF-8", "maximum context length", "bytes",
                   "--max-", "prompt", "messages", "tool")
        if not any(g in (err.get("message") or "") for g in generic):
            problems.append(f"error names none of {case.fields}: param={err.get('param')!r} "
                            f"message={err.get('message')!r:.200}")
    return problems


def _sse_events(text: str) -> tuple[list[Any], bool]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    done = bool(data) and data[-1] == "[DONE]"
    return [json.loads(d) for d in (data[:-1] if done else data)], done


FINISH_REASONS = ("stop", "length", "tool_calls")


def _num_choices(case: Case) -> int | None:
    """How many choices the request asks for (n x prompts), or None when the body cannot say."""
    try:
        req = json.loads(case.body)
    except ValueError:
        return None
    n = req.get("n", 1)
    n = 1 if n is None else n
    prompt = req.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return n * prompts if isinstance(n, int) else None


def _stream_problems(case: Case, text: str) -> list[str]:
    events, done = _sse_events(text)
    problems = [] if done else ["stream did not end with data: [DONE]"]
    finished: dict[int, int] = {}
    errored = False
    for ev in events:
        if "error" in ev:
            if not structured_outputs_error(case, ev):
                problems.append(f"in-band stream error: {ev['error']!r:.300}")
            errored = True
        elif ev.get("object") not in ("text_completion", "chat.completion.chunk"):
            problems.append(f"stream chunk object {ev.get('object')!r}")
        else:
            for c in ev.get("choices", []):
                if c.get("finish_reason") is not None:
                    if c["finish_reason"] not in FINISH_REASONS:
                        problems.append(f"finish_reason {c['finish_reason']!r}")
                    finished[c["index"]] = finished.get(c["index"], 0) + 1
    want = _num_choices(case)
    if want is not None and done and not errored and sorted(finished) != list(range(want)):
        problems.append(f"stream finished choices {sorted(finished)} of {want}")
    if any(k > 1 for k in finished.values()):
        problems.append(f"a choice finished more than once: {finished}")
    return problems


def _generation_problems(case: Case, body: dict[str, Any]) -> list[str]:
    problems = []
    want = _num_choices(case)
    choices = body.get("choices", [])
    if want is not None and sorted(c.get("index") for c in choices) != list(range(want)):
        problems.append(f"choices {[c.get('index') for c in choices]} for {want} asked")
    for c in choices:
        if c.get("finish_reason") not in FINISH_REASONS:
            problems.append(f"finish_reason {c.get('finish_reason')!r}")
    usage = body.get("usage") or {}
    if usage.get("total_tokens") != usage.get("prompt_tokens", 0) + (usage.get("completion_tokens") or 0):
        problems.append(f"usage does not add up: {usage}")
    return problems


def _shape_problems(case: Case, answer: Answer) -> list[str]:
    text = answer.body.decode("utf-8", "replace")
    try:
        # A duplicate "stream" key decides by its last value: the answer's type says which it was.
        if answer.content_type.startswith("text/event-stream"):
            return _stream_problems(case, text)
        body = json.loads(text)
    except (json.JSONDecodeError, ValueError) as e:
        return [f"200 body is not JSON: {e}: {text[:200]!r}"]
    if case.path in ("/v1/completions", "/v1/chat/completions") and isinstance(body, dict):
        more = _generation_problems(case, body)
        if more:
            return more
    if case.path == "/v1/completions":
        ok = body.get("object") == "text_completion" and all(isinstance(c.get("text"), str) for c in body["choices"])
    elif case.path == "/v1/chat/completions":
        ok = body.get("object") == "chat.completion" and all("message" in c for c in body["choices"])
    elif case.path == "/tokenize":
        ok = isinstance(body.get("tokens"), list) and body.get("count") == len(body["tokens"])
    elif case.path == "/detokenize":
        ok = isinstance(body.get("prompt"), str)
    elif "rerank" in case.path:
        ok = isinstance(body.get("results"), list) and isinstance(body.get("usage"), dict)
    else:
        ok = body.get("object") == "list" and isinstance(body.get("data"), list)
    if ok and case.path.startswith("/v1/") and "usage" not in body:
        ok = False
    return [] if ok else [f"200 body has the wrong shape: {text[:300]!r}"]


def check_response(case: Case, answer: Answer) -> list[str]:
    """Everything wrong with this answer to this case (empty: fine)."""
    if answer.status is None:
        if "oversize" in case.name:
            return []  # a body over the limit may be cut off by closing the connection
        return [f"no answer: {answer.error}"]
    if answer.status == 503 and b"server_overloaded" in answer.body:
        return []  # full (admission): a concurrent run may fill the server; its answer is the 503
    if answer.status >= 500:
        return [f"status {answer.status}: {answer.body[:400]!r}"]
    if answer.status == 200:
        if case.expect == REJECT:
            return [f"200 for a value that must be refused: {answer.body[:200]!r}"]
        return _shape_problems(case, answer)
    if not 400 <= answer.status < 500:
        return [f"status {answer.status}"]
    try:
        body = json.loads(answer.body)
    except ValueError:
        return [f"4xx body is not JSON: {answer.body[:200]!r}"]
    return _error_problems(case, body)


def run_cases(base_url: str, cases: list[Case], headers: dict[str, str] | None = None,
              log: Callable[[str], None] | None = None, statuses: dict[int | None, int] | None = None,
              timeout: float = 60, resets: list[Case] | None = None) -> list[tuple[Case, list[str]]]:
    """Send every case, one at a time; -> the cases that had problems (`statuses` counts the codes).

    With `resets` (a list), a case whose kept-alive connection was reset before any answer is sent
    again once on a new connection, as HTTP clients do (the openai client retries it), and listed
    there; seen under concurrent load only (3 of 2,500 cases once), cause not found yet."""
    failures = []
    with httpx.Client() as client:
        for i, case in enumerate(cases):
            answer = send_case(client, base_url, case, headers, timeout)
            if resets is not None and answer.status is None and "reset by peer" in answer.error:
                resets.append(case)
                with httpx.Client() as fresh:
                    answer = send_case(fresh, base_url, case, headers, timeout)
            if statuses is not None:
                statuses[answer.status] = statuses.get(answer.status, 0) + 1
            problems = check_response(case, answer)
            if problems:
                failures.append((case, problems))
                if log is not None:
                    log(f"[{i}] {case}\n      {problems}")
    return failures


def run_concurrently(base_url: str, cases: list[Case], threads: int, timeout: float = 60,
                     statuses: dict[int | None, int] | None = None,
                     resets: list[Case] | None = None) -> list[tuple[Case, list[str]]]:
    """run_cases on `threads` interleaved slices of the cases at once (one client each)."""
    from concurrent.futures import ThreadPoolExecutor

    counts: list[dict[int | None, int]] = [{} for _ in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda i: run_cases(base_url, cases[i::threads], statuses=counts[i], timeout=timeout,
                                                    resets=resets),
                                range(threads)))
    if statuses is not None:
        for c in counts:
            for k, v in c.items():
                statuses[k] = statuses.get(k, 0) + v
    return [f for r in results for f in r]


# -- structured outputs: grammars refused, and grammars other masks leave without a token (h59) ------
def structured_outputs_error(case: Case, event: dict[str, Any]) -> bool:
    """A stream's in-band error that is an answer, not a failure: the request's grammar and a mask the case
    set (allowed_token_ids, bad_words, min_tokens) left no token mid-output, so the engine ended it
    (structured_output/sample_check.py); it names the mask, and the stream still ends with [DONE]."""
    err = event.get("error")
    message = err.get("message", "") if isinstance(err, dict) else ""
    return message.startswith("structured outputs:") and any(f in message for f in case.fields)


def structured_outputs_cases(model: str) -> list[Case]:
    """Fixed cases, chat and completions: grammars that derive no finite string or regexes that match
    nothing (a 4xx naming them; they ran unconstrained before), a grammar error naming a non-ASCII
    character (whole, not cut), a grammar and another mask that leave nothing to sample from the first
    token (a 4xx), and ones that meet the conflict only while running (a 400, or in a stream an in-band
    error then [DONE]; before, a 200 whose output broke the grammar). `check_structured_outputs_answer`
    checks each."""
    refused = [
        ({"structured_outputs": {"grammar": "root ::= root"}}, ("structured_outputs",), "root ::= root"),
        ({"guided_grammar": 'root ::= "a" root'}, ("structured_outputs", "guided_grammar"), "no finite string"),
        ({"guided_grammar": 'root ::= x "!"\nx ::= x "a"'}, ("structured_outputs", "guided_grammar"), "'x'"),
        ({"guided_regex": "[^\\s\\S]"}, ("structured_outputs", "guided_regex"), "matches no string"),
        ({"structured_outputs": {"regex": "a[^\\d\\D]"}}, ("structured_outputs",), "matches no string"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}}, ("response_format",),
         "admits no finite JSON value"),
        ({"guided_grammar": 'root ::= "é" é'}, ("structured_outputs", "guided_grammar"), "'é'"),
        ({"guided_grammar": 'root ::= "日本" 語'}, ("structured_outputs", "guided_grammar"), "'語'"),
        ({"guided_choice": ["yes", "no"], "min_tokens": 4}, ("min_tokens",), "min_tokens=4"),
        ({"structured_outputs": {"choice": ["a"]}, "allowed_token_ids": [0]}, ("allowed_token_ids",), "conflicts"),
        ({"guided_choice": ["{"], "bad_words": ["{"]}, ("bad_words",), "conflicts"),
    ]
    running = [
        ({"structured_outputs": {"regex": "[0-9]{2}"}, "min_tokens": 6}, ("min_tokens",)),
        ({"guided_regex": "[0-9]{1,2}x", "bad_words": ["x"]}, ("bad_words",)),
    ]
    cases = []
    for path in ("/v1/chat/completions", "/v1/completions"):
        head: dict[str, Any] = {"model": model, "max_tokens": 12, "temperature": 0}
        head.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
        for extra, fields, words in refused:
            body = json.dumps({**head, **extra}, ensure_ascii=False).encode()
            cases.append(Case(f"{path}: structured outputs refused ({words})", path, body, REJECT, fields))
        for extra, fields in running:
            for stream in (False, True):
                body = json.dumps({**head, **extra, "stream": stream}).encode()
                cases.append(Case(f"{path}: structured outputs conflict while running{' (stream)' if stream else ''}",
                                  path, body, ANY, fields, stream))
    return cases


def check_structured_outputs_answer(case: Case, answer: Answer) -> list[str]:
    """check_response, and for a conflict met while running: a 400 naming the mask, or a stream whose last
    event before [DONE] is the error naming it (a 200 without it: the output broke the grammar)."""
    problems = check_response(case, answer)
    if problems or case.expect == REJECT:
        return problems
    if answer.status != 200:
        return []  # a 400 naming a touched field (check_response checked it)
    if not case.stream:
        return [f"200 for a request whose grammar and masks leave no token: {answer.body[:300]!r}"]
    events, done = _sse_events(answer.body.decode("utf-8", "replace"))
    if not done or not events or not structured_outputs_error(case, events[-1]):
        return [f"the stream did not end with the conflict's error event: {answer.body[-300:]!r}"]
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--embeddings", action="store_true", help="the server runs a pooling model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--threads", type=int, default=1, help="send this many cases at once")
    args = p.parse_args()
    fuzz = RequestFuzzer(args.seed, model=args.model, vocab_size=args.vocab_size, max_model_len=args.max_model_len,
                         generate=not args.embeddings, embeddings=args.embeddings)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    statuses: dict[int | None, int] = {}
    cases = list(fuzz.cases(args.cases))
    if args.threads > 1:
        resets: list[Case] = []
        failures = run_concurrently(args.url.rstrip("/"), cases, args.threads, statuses=statuses, resets=resets)
        for case, problems in failures:
            print(f"{case}\n      {problems}")
        for case in resets:
            print(f"connection reset, answered when sent again: {case}")
    else:
        failures = run_cases(args.url.rstrip("/"), cases, headers, log=print, statuses=statuses)
    health = httpx.get(args.url.rstrip("/") + "/health", timeout=10).status_code
    print(f"{len(failures)} of {args.cases} cases had problems; /health {health}; statuses "
          + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))))
    return 1 if failures or health != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
