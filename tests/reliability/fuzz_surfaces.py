"""Seeded requests for the surfaces fuzz_requests.py does not reach, and the deeper checks of what
a 200 says. Three servers' worth (test_fuzz_surfaces.py):

- tools: tools / tool_choice / parallel_tool_calls, messages that carry tool_calls, role "tool" and
  names, malformed schemas; the answer's text forced with guided_choice to what a model of the
  server's --tool-call-parser writes (fuzz_tools.py's outputs, behind a think block for the
  --reasoning-parser), streamed or whole, enable_thinking on or off;
- sampling: logprobs / top_logprobs / prompt_logprobs, n and best_of, echo, stop strings and stop
  token ids with include_stop_str_in_output, stream_options, max_tokens at max_model_len, seeds,
  return_token_ids, unknown fields (logged and counted on these endpoints, vLLM's rule);
- pooling: /v1/embeddings, /pooling, /score, /rerank, /classify with empty lists, token ids,
  dimensions, base64, truncate_prompt_tokens, unknown fields (refused there).

Every answer passes fuzz_requests.check_response first (200 or a 4xx naming a field, never a 5xx or
a dropped connection); a 200 is then strict JSON (no NaN), parses as the openai client's type
(ChatCompletion, ChatCompletionChunk, Completion, CreateEmbeddingResponse), and says what the
request asked: as many logprobs as asked, a stop string cut (or kept) as asked, usage where
stream_options put it, tool-call deltas in OpenAI's shape whose arguments join into a JSON object.

Longer by hand, against a server started as test_fuzz_surfaces.py's:

    python -m tests.reliability.fuzz_surfaces --url http://127.0.0.1:8000 --kind tools --cases 2000
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import math
import random
import sys
from collections.abc import Iterator
from typing import Any

from tests.reliability.fuzz_requests import ANY, REJECT, Answer, Case, _malformed_values, check_response
from tests.reliability.fuzz_tools import ToolOutputFuzzer, _strict_json, tool_delta_problems

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
    {"type": "function", "function": {"name": "ping"}},
    {"type": "function", "function": {"name": "名前", "description": "\U0001f600", "parameters": {}, "strict": True}},
]
# (tools, expectation) beyond fuzz_requests' "tools" table: schemas a grammar cannot be built from
# are the request's fault (a 400 under required / named), fine under auto (no grammar).
ODD_TOOLS: list[tuple[Any, str]] = [
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}], ANY),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}], ANY),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["zz"]}}}], ANY),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], ANY),
    ([{"type": "function", "function": {"name": "f", "description": 5}}], ANY),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], ANY),
    ([{"type": "function", "function": {"name": f"t{i}"}} for i in range(40)], ANY),
    ([{"function": {"name": "f"}}], ANY),  # type defaults to "function" (vLLM's)
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}}], ANY),
]
DEEP = "[" * 20000 + "]" * 20000
HISTORY: list[tuple[list[dict[str, Any]], str]] = [
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "22C"}], ANY),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}], ANY),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]}], REJECT),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": NaN}'}}]}], ANY),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}], ANY),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": 5, "arguments": "{}"}}]}], REJECT),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]}], REJECT),
    ([{"role": "tool", "content": "r"}], ANY),
    ([{"role": "tool", "content": "r", "tool_call_id": ["x"]}], ANY),
    ([{"role": "tool", "content": [{"type": "text", "text": "r"}], "tool_call_id": "c1", "name": "f"}], ANY),
    ([{"role": "user", "content": "hi", "name": "alice"}], ANY),
    ([{"role": "assistant", "content": "ok", "tool_calls": []}], ANY),
    ([{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * 30}], ANY),
]
TOOL_CHOICES: list[tuple[Any, str]] = [
    (None, ANY), ("none", ANY), ("auto", ANY), ("required", ANY), ({"type": "function", "function": {"name": "ping"}}, ANY),
    ({"type": "function", "function": {"name": "get_weather"}}, ANY), ({"type": "function", "function": {"name": "nope"}},
                                                                       REJECT),
    ("Required", REJECT), ({"type": "function", "function": {}}, REJECT), ({"type": "tool", "function": {"name": "f"}},
                                                                           REJECT),
]

# Fields of the sampling surface and their values beyond fuzz_requests' table.
SAMPLING_EXTRA: dict[str, list[tuple[Any, str]]] = {
    "n": [(1, ANY), (2, ANY), (4, ANY)],
    "best_of": [(2, ANY), (1, ANY)],
    "echo": [(True, ANY), (False, ANY)],
    "include_stop_str_in_output": [(True, ANY), (False, ANY)],
    "stop": [(["e", " "], ANY), ("a", ANY), (["the", "\n"], ANY)],
    "stop_token_ids": [([2, 3, 4, 5, 6, 7, 8, 9, 10], ANY), ([0], ANY)],
    "stream_options": [({"include_usage": True}, ANY), ({"include_usage": False, "continuous_usage_stats": True}, ANY),
                       ({"include_usage": True, "continuous_usage_stats": True}, ANY),
                       ({"include_usage": None}, ANY), ({"continuous_usage_stats": 1}, REJECT)],
    "seed": [(0, ANY), (-(2**63), ANY), (7, ANY)],
    "return_token_ids": [(True, ANY)],
    "max_tokens": [(3, ANY), (1, ANY), (8, ANY)],
    "logprobs": [(0, ANY), (1, ANY), (5, ANY), (20, ANY), (21, ANY)],
    "top_logprobs": [(0, ANY), (1, ANY), (5, ANY), (20, ANY), (21, ANY)],
    "logit_bias": [({"0": -100, "1": 100}, ANY), ({"5": 100}, ANY)],
    "allowed_token_ids": [([5, 6, 7], ANY)],
    "temperature": [(0.0, ANY), (1.0, ANY)],
    "min_tokens": [(2, ANY), (5, ANY)],
}
SAMPLING_FIELDS = ("n", "best_of", "echo", "include_stop_str_in_output", "stop", "stop_token_ids", "stream_options",
                   "seed", "return_token_ids", "max_tokens", "logprobs", "prompt_logprobs", "logit_bias",
                   "allowed_token_ids", "temperature", "min_tokens", "stream")
UNKNOWN_FIELDS: list[dict[str, Any]] = [{"nope": 1}, {"store": True}, {"metadata": {"a": "b"}}, {"x" * 100: None},
                                        {"reasoning_effort": "low"}, {"service_tier": "auto"}, {"": 1}]


class SurfaceFuzzer:
    """Seeded cases of one kind: "tools" (chat with tools and reasoning), "sampling" (completions and
    chat with the output options) or "pooling" (the pooling endpoints of an embedding model)."""

    def __init__(self, seed: int, kind: str, *, model: str, vocab_size: int, max_model_len: int,
                 tool_parser: str = "hermes", reasoning_parser: str | None = None) -> None:
        if kind not in ("tools", "sampling", "pooling"):
            raise ValueError(f"kind must be tools, sampling or pooling, got {kind!r}")
        self.rng = random.Random(seed)
        self.kind = kind
        self.model = model
        self.vocab = vocab_size
        self.max_len = max_model_len
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.outputs = ToolOutputFuzzer(seed)

    def _pick(self, table: list[tuple[Any, str]], good: float = 0.0) -> tuple[Any, str]:
        """A (value, expectation) of `table`; one of its fine values with probability `good` (a body
        with several fields is then still often served)."""
        fine = [row for row in table if row[1] == ANY]
        value, expect = self.rng.choice(fine if fine and self.rng.random() < good else table)
        return copy.deepcopy(value), expect

    # -- tools -------------------------------------------------------------------------------------
    def _tools_case(self) -> Case:
        rng = self.rng
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(1, 4),
                                "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
        expects: dict[str, str] = {}
        names = []
        roll = rng.random()
        if roll < 0.75:
            body["tools"] = copy.deepcopy(rng.sample(TOOLS, rng.randint(1, len(TOOLS))))
        elif roll < 0.95:
            body["tools"], expects["tools"] = self._pick(ODD_TOOLS + _malformed_values("tools", self.vocab, self.max_len))
            names.append("tools=odd")
        if rng.random() < 0.7:
            choice, expects["tool_choice"] = self._pick(TOOL_CHOICES)
            if choice is not None:
                body["tool_choice"] = choice
            names.append(f"tool_choice={choice!r:.40}")
        if rng.random() < 0.3:
            body["parallel_tool_calls"] = rng.choice([True, False, None, "yes"])
            expects["parallel_tool_calls"] = REJECT if body["parallel_tool_calls"] == "yes" else ANY
        if rng.random() < 0.3:
            history, expects["messages"] = self._pick(HISTORY)
            body["messages"] = body["messages"] + history + [{"role": "user", "content": "and now?"}]
            names.append("messages=history")
        if rng.random() < 0.5:
            body["chat_template_kwargs"] = {"enable_thinking": rng.choice([True, False])}
        if rng.random() < 0.7:  # the answer forced to a model's tool-call text (or thinking, then one)
            thinking = self.reasoning_parser if body.get("chat_template_kwargs", {}).get("enable_thinking", True) \
                else None
            text, how = self.outputs.output(self.tool_parser, thinking)
            if len(text) > 300 or not text:
                text = text[:300] or "plain answer"
            body["guided_choice"] = [text]
            body["max_tokens"] = rng.choice([len(text) + 8, len(text) // 4 + 1])  # whole, or cut off
            names.append(f"forced({how})")
            expects.setdefault("guided_choice", ANY)
        body["stream"] = rng.random() < 0.5
        if body["stream"] and rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}
        if rng.random() < 0.1:
            body["n"] = 2
        expect = REJECT if REJECT in expects.values() else ANY
        return Case(f"tools: {', '.join(names) or 'plain'}", "/v1/chat/completions", json.dumps(body).encode(),
                    expect, tuple(expects), bool(body["stream"]))

    # -- sampling ----------------------------------------------------------------------------------
    def _sampling_case(self) -> Case:
        rng = self.rng
        chat = rng.random() < 0.5
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(1, 6)}
        if chat:
            body["messages"] = [{"role": "user", "content": rng.choice(["hi", "Tell me a story"])}]
        else:
            body["prompt"] = rng.choice(["hi", "The quick brown fox", [1, 2, 3], ["a", "b"]])
        expects: dict[str, str] = {}
        names = []
        for fld in rng.sample(SAMPLING_FIELDS, rng.randint(1, 5)):
            if fld == "stream":
                body["stream"] = True
                continue
            name = "top_logprobs" if chat and fld == "logprobs" else fld
            table = SAMPLING_EXTRA.get(fld, [])
            own = [(v, e) for v, e in _malformed_values(name, self.vocab, self.max_len)]
            value, expect = self._pick(table if table and (rng.random() < 0.7 or not own) else own or table)
            if value is None:
                continue
            body[name] = value
            expects[name] = expect
            names.append(f"{name}={value!r:.30}")
            if name == "top_logprobs" and rng.random() < 0.9:
                body["logprobs"] = True
        if "stream_options" in body and rng.random() < 0.8:
            body["stream"] = True
        if rng.random() < 0.1:
            extra = copy.deepcopy(rng.choice(UNKNOWN_FIELDS))
            body.update(extra)
            names.append(f"unknown={sorted(extra)!r:.30}")
        if rng.random() < 0.05:  # max_tokens right at the context's end: the prompt leaves fewer tokens
            body["max_tokens"] = self.max_len - rng.choice([1, 2, 3])
            expects["max_tokens"] = ANY
        expect = REJECT if REJECT in expects.values() else ANY
        path = "/v1/chat/completions" if chat else "/v1/completions"
        stream = body.get("stream") is True
        return Case(f"sampling {path}: {', '.join(names)}", path, json.dumps(body).encode(), expect, tuple(expects),
                    stream)

    # -- pooling -----------------------------------------------------------------------------------
    def _pooling_case(self) -> Case:
        rng = self.rng
        inputs: list[tuple[Any, str]] = [
            ("hello", ANY), (["a", "b"], ANY), ([101, 7592, 102], ANY), ([[101, 102], [101, 7592, 102]], ANY),
            ("", ANY), ([""], ANY), ([], REJECT), ([[]], REJECT), ([-1], REJECT), ([self.vocab], REJECT),
            ([2**63], REJECT), ("word " * 600, ANY), ([1.5], REJECT), (["a", 1], REJECT), (None, REJECT), (5, REJECT),
            ({"text": "a"}, REJECT), (["\u0000", "\U0001f600", "é"], ANY), ([[1] * 600], ANY)]
        path = rng.choice(["/v1/embeddings", "/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank",
                           "/v1/rerank", "/classify"])
        body: dict[str, Any] = {"model": self.model}
        expects: dict[str, str] = {}
        if path in ("/v1/embeddings", "/pooling", "/classify"):
            body["input"], expects["input"] = self._pick(inputs, good=0.7)
            if path != "/classify" and rng.random() < 0.4:
                body["encoding_format"], expects["encoding_format"] = self._pick(
                    [("base64", ANY), ("float", ANY), ("hex", REJECT), ("", REJECT), (None, ANY), (1, REJECT)],
                    good=0.7)
            if path != "/classify" and rng.random() < 0.3:
                body["dimensions"], expects["dimensions"] = self._pick(
                    [(8, ANY), (384, ANY), (385, REJECT), (0, REJECT), (-1, REJECT), (2**63, REJECT), (1.5, REJECT),
                     (None, ANY)], good=0.7)
            if path != "/classify" and rng.random() < 0.2:
                body["normalize"], expects["normalize"] = self._pick([(True, ANY), (False, ANY), ("yes", REJECT)],
                                                                     good=0.7)
        elif "score" in path:
            texts = [("a", ANY), (["a", "b"], ANY), ([], REJECT), ("", ANY), (["x"] * 3, ANY), (5, REJECT),
                     ([1, 2], REJECT), ("word " * 600, ANY)]
            k1, k2 = rng.choice([("text_1", "text_2"), ("queries", "documents"), ("text_1", "documents")])
            body[k1], expects[k1] = self._pick(texts, good=0.8)
            if rng.random() < 0.9:
                body[k2], expects[k2] = self._pick(texts, good=0.8)
            else:
                expects[k2] = REJECT
        else:
            body["query"], expects["query"] = self._pick([("q", ANY), ("", ANY), (5, REJECT), (["q"], REJECT)],
                                                         good=0.7)
            body["documents"], expects["documents"] = self._pick(
                [(["a", "b", "c"], ANY), ([], ANY), ([{"text": "a"}, "b"], ANY), ([{"txt": "a"}], REJECT),
                 ([5], REJECT), ("a", REJECT), (["word " * 600], ANY)], good=0.7)
            if rng.random() < 0.4:
                body["top_n"], expects["top_n"] = self._pick(
                    [(1, ANY), (0, ANY), (10, ANY), (-1, ANY), ("1", REJECT)], good=0.7)
            if rng.random() < 0.2:
                body["return_documents"], expects["return_documents"] = self._pick([(False, ANY), (1, REJECT)],
                                                                                   good=0.7)
        if rng.random() < 0.25:
            body["truncate_prompt_tokens"], expects["truncate_prompt_tokens"] = self._pick(
                [(-1, ANY), (1, ANY), (3, ANY), (0, ANY), (-2, REJECT), (10**6, ANY), (2**63, REJECT), ("3", REJECT)],
                good=0.7)
        if rng.random() < 0.1:
            extra = copy.deepcopy(rng.choice(UNKNOWN_FIELDS))
            body.update(extra)
            expects[next(iter(extra)) or "Unknown field"] = REJECT  # the pooling endpoints refuse unknown fields
        names = [f"{k}={v!r:.30}" for k, v in body.items() if k != "model"]
        expect = REJECT if REJECT in expects.values() else ANY
        return Case(f"pooling {path}: {', '.join(names)}", path, json.dumps(body).encode(), expect,
                    tuple(k for k in expects if k))

    def cases(self, count: int) -> Iterator[Case]:
        make = {"tools": self._tools_case, "sampling": self._sampling_case, "pooling": self._pooling_case}[self.kind]
        for _ in range(count):
            yield make()


# -- checks ----------------------------------------------------------------------------------------
def _events(text: str) -> list[Any]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [_strict_json(d) for d in data if d != "[DONE]"]


def _logprob_problems(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (int, float)) or math.isnan(value) or value > 1e-6:
        return [f"{where} logprob {value!r} is not a number <= 0"]
    return []


def _completion_choice_problems(req: dict[str, Any], c: dict[str, Any], stream: bool) -> list[str]:
    problems = []
    k = req.get("logprobs")
    lp = c.get("logprobs")
    if isinstance(k, int) and not isinstance(k, bool) and not stream:
        if lp is None:
            return [f"logprobs={k} asked, choice {c.get('index')} has none"]
        n = len(lp["tokens"])
        if not (len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n):
            problems.append(f"logprobs lists of different lengths: {[len(v) for v in lp.values()]}")
        for j, top in enumerate(lp["top_logprobs"]):
            if top is not None and not (min(k, 1) <= len(top) <= k + 1):
                problems.append(f"top_logprobs[{j}] has {len(top)} entries for logprobs={k}")
            for t, v in (top or {}).items():
                problems += _logprob_problems(v, f"top_logprobs[{j}][{t!r}]")
        for j, v in enumerate(lp["token_logprobs"]):
            problems += _logprob_problems(v, f"token_logprobs[{j}]")
        if lp["text_offset"] != sorted(lp["text_offset"]):
            problems.append(f"text_offset not increasing: {lp['text_offset'][:20]}")
    text = c.get("text", "")
    problems += _stop_problems(req, text, c, echo=bool(req.get("echo")))
    return problems


def _stop_problems(req: dict[str, Any], text: str, c: dict[str, Any], echo: bool) -> list[str]:
    """A stop string ends the text (include_stop_str_in_output) or is cut, and appears nowhere before."""
    reason = c.get("stop_reason")
    if c.get("finish_reason") != "stop" or echo:
        return []
    if isinstance(reason, str):
        stops = req.get("stop")
        stops = [stops] if isinstance(stops, str) else stops or []
        if reason not in stops:
            return [f"stop_reason {reason!r} is none of stop {stops!r}"]
        body = text[:-len(reason)] if req.get("include_stop_str_in_output") else text
        if req.get("include_stop_str_in_output") and not text.endswith(reason):
            return [f"include_stop_str_in_output: text {text[-40:]!r} does not end with {reason!r}"]
        if any(s and s in body for s in stops):
            return [f"text {text[-60:]!r} holds a stop string before its end ({stops!r})"]
    elif isinstance(reason, int) and reason not in (req.get("stop_token_ids") or []):
        return [f"stop_reason {reason} is none of stop_token_ids {req.get('stop_token_ids')!r}"]
    return []


def _chat_choice_problems(req: dict[str, Any], c: dict[str, Any], tool_calls: list[dict[str, Any]]) -> list[str]:
    problems = []
    finish = c.get("finish_reason")
    choice = req.get("tool_choice")
    names = [t["function"]["name"] for t in req.get("tools") or [] if isinstance(t, dict) and "function" in t]
    if finish == "tool_calls" and not tool_calls:
        problems.append("finish_reason tool_calls without tool calls")
    for call in tool_calls:
        args = call.get("function", {}).get("arguments", "")
        fn = call.get("function", {}).get("name")
        if finish == "length":
            continue  # cut off: the last call's arguments may be half written
        try:
            value = _strict_json(args)
        except ValueError as e:
            problems.append(f"tool call {fn!r} arguments are not JSON ({e}): {args[:200]!r}")
            continue
        schema = next((t["function"].get("parameters") for t in req.get("tools") or []
                       if isinstance(t, dict) and t.get("function", {}).get("name") == fn), None)
        if not isinstance(value, dict) and (schema or {}).get("type", "object") == "object":
            problems.append(f"tool call {fn!r} arguments are not an object: {args[:200]!r}")
    if isinstance(choice, dict) and finish == "stop" and [t["function"]["name"] for t in tool_calls] \
            != [choice["function"]["name"]]:
        problems.append(f"named tool_choice {choice!r}: calls {[t['function']['name'] for t in tool_calls]}")
    if choice == "required" and finish in ("stop", "tool_calls"):
        called = [t["function"]["name"] for t in tool_calls]
        if not called or any(n not in names for n in called):
            problems.append(f"tool_choice required: calls {called} of tools {names}")
        if req.get("parallel_tool_calls") is False and len(called) > 1:
            problems.append(f"parallel_tool_calls false: {len(called)} calls")
    if choice == "none" and tool_calls:
        problems.append("tool_choice none answered with tool calls")
    return problems


def _chat_logprob_problems(req: dict[str, Any], c: dict[str, Any], content: list[dict[str, Any]] | None) -> list[str]:
    if not req.get("logprobs"):
        return []
    if content is None:
        return [f"logprobs asked, choice {c.get('index')} has none"]
    k = req.get("top_logprobs") or 0
    problems = []
    for j, entry in enumerate(content):
        problems += _logprob_problems(entry.get("logprob"), f"content[{j}]")
        if len(entry.get("top_logprobs", [])) != k:
            problems.append(f"content[{j}] has {len(entry.get('top_logprobs', []))} top_logprobs for {k}")
        for t in entry.get("top_logprobs", []):
            problems += _logprob_problems(t.get("logprob"), f"content[{j}].top_logprobs")
    return problems


def _full_problems(case: Case, req: dict[str, Any], body: dict[str, Any]) -> list[str]:
    from openai.types import Completion, CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    problems: list[str] = []
    if case.path == "/v1/chat/completions":
        ChatCompletion.model_validate(body)
        for c in body["choices"]:
            msg = c["message"]
            problems += _chat_choice_problems(req, c, msg.get("tool_calls") or [])
            lp = (c.get("logprobs") or {}).get("content")
            problems += _chat_logprob_problems(req, c, lp)
            if isinstance(lp, list) and req.get("n", 1) in (1, None) and len(lp) != body["usage"]["completion_tokens"]:
                problems.append(f"{len(lp)} logprobs for {body['usage']['completion_tokens']} tokens")
            # With a reasoning parser the text (and its stop string) may be all thinking.
            text = (msg.get("reasoning_content") or "") + (msg.get("content") or "")
            problems += _stop_problems(req, text, c, echo=bool(req.get("echo")))
    elif case.path == "/v1/completions":
        Completion.model_validate(body)
        for c in body["choices"]:
            problems += _completion_choice_problems(req, c, stream=False)
    elif case.path == "/v1/embeddings":
        fmt = req.get("encoding_format") or "float"
        dims = req.get("dimensions") or 384
        for d in body["data"]:
            vec = d["embedding"]
            if fmt == "base64":
                raw = base64.b64decode(vec)
                if len(raw) != 4 * dims:
                    problems.append(f"base64 embedding of {len(raw)} bytes for {dims} dimensions")
                d["embedding"] = [0.0] * dims  # the openai client decodes base64 itself; its type holds floats
            elif len(vec) != dims or not all(math.isfinite(x) for x in vec):
                problems.append(f"embedding of {len(vec)} values (finite: {all(map(math.isfinite, vec))}) for {dims}")
        CreateEmbeddingResponse.model_validate(body)
        if sorted(d["index"] for d in body["data"]) != list(range(len(body["data"]))):
            problems.append(f"embedding indices {[d['index'] for d in body['data']]}")
    elif case.path in ("/score", "/v1/score"):
        if not all(math.isfinite(d["score"]) for d in body["data"]):
            problems.append(f"scores not finite: {body['data']!r:.200}")
    elif case.path in ("/rerank", "/v1/rerank"):
        scores = [r["relevance_score"] for r in body["results"]]
        if scores != sorted(scores, reverse=True):
            problems.append(f"rerank results not by score: {scores}")
        top_n = req.get("top_n")
        n_docs = len(req.get("documents") or [])
        if isinstance(top_n, int) and top_n > 0 and len(scores) != min(top_n, n_docs):
            problems.append(f"{len(scores)} rerank results for top_n={top_n} of {n_docs}")
        if req.get("return_documents") is False and any(r.get("document") for r in body["results"]):
            problems.append("return_documents false, documents returned")
    return problems


def _stream_problems(case: Case, req: dict[str, Any], events: list[Any]) -> list[str]:
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    chat = case.path == "/v1/chat/completions"
    opts = req.get("stream_options") or {}
    include = bool(opts.get("include_usage"))
    continuous = include and bool(opts.get("continuous_usage_stats"))
    problems: list[str] = []
    deltas: dict[int, list[dict[str, Any]]] = {}
    texts: dict[int, str] = {}
    finish: dict[int, Any] = {}
    lps: dict[int, list[Any]] = {}
    for j, ev in enumerate(events):
        if chat:
            ChatCompletionChunk.model_validate(ev)
        else:  # the client's Completion wants a finish_reason; a chunk before the last has null (vLLM's too)
            Completion.model_validate({**ev, "choices": [{**c, "finish_reason": c["finish_reason"] or "length"}
                                                         for c in ev["choices"]]})
        last = j == len(events) - 1
        has_usage = ev.get("usage") is not None
        if include and last and (ev["choices"] or not has_usage):
            problems.append(f"include_usage: the last chunk is not the usage chunk: {ev!r:.200}")
        if not last and has_usage and not continuous:
            problems.append(f"usage on a chunk before the last without continuous_usage_stats: {ev!r:.200}")
        if continuous and not has_usage:
            problems.append(f"continuous_usage_stats: a chunk without usage: {ev!r:.200}")
        if not include and last and not ev["choices"]:
            problems.append("a usage chunk without include_usage")
        for c in ev["choices"]:
            i = c["index"]
            if chat:
                delta = c["delta"]
                deltas.setdefault(i, []).extend(delta.get("tool_calls") or [])
                texts[i] = texts.get(i, "") + (delta.get("reasoning_content") or "") + (delta.get("content") or "")
                lps.setdefault(i, []).extend((c.get("logprobs") or {}).get("content") or [])
            else:
                texts[i] = texts.get(i, "") + c.get("text", "")
            if c.get("finish_reason") is not None:
                finish[i] = c
    for i, c in finish.items():
        if chat:
            more, calls = tool_delta_problems(deltas.get(i, []))
            problems += more
            tool_calls = [{"function": {"name": name, "arguments": args}} for name, args in calls.values()]
            problems += _chat_choice_problems(req, c, tool_calls)
            problems += _chat_logprob_problems(req, c, lps.get(i) if req.get("logprobs") else None)
        problems += _stop_problems(req, texts.get(i, ""), c, echo=bool(req.get("echo")))
    return problems


def check_surface(case: Case, answer: Answer) -> list[str]:
    """fuzz_requests.check_response, then (for a 200) strict JSON, the openai client's types and what
    the request asked for."""
    problems = check_response(case, answer)
    if problems or answer.status != 200:
        return problems
    req = json.loads(case.body)
    text = answer.body.decode("utf-8", "replace")
    try:
        if answer.content_type.startswith("text/event-stream"):
            return _stream_problems(case, req, _events(text))
        return _full_problems(case, req, _strict_json(text))
    except (ValueError, KeyError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        return [f"200 body: {type(e).__name__}: {e!s:.300}"]


def _streamed_message(text: str) -> dict[str, Any]:
    """A chat stream's events -> the message they add up to (choice 0): reasoning, content, calls."""
    reasoning, content, deltas = "", "", []
    for ev in _events(text):
        for c in ev["choices"]:
            if c["index"] == 0:
                reasoning += c["delta"].get("reasoning_content") or ""
                content += c["delta"].get("content") or ""
                deltas += c["delta"].get("tool_calls") or []
    _, calls = tool_delta_problems(deltas)
    return {"reasoning_content": reasoning or None, "content": content,
            "tool_calls": [(name, _strict_json(args)) for name, args in calls.values()]}


def stream_whole_problems(client: Any, base_url: str, case: Case) -> list[str]:
    """The same answer asked for whole and streamed (greedy): both say the same (thinking, content,
    calls). For tools cases whose text is forced (guided_choice) and fits max_tokens."""
    req = json.loads(case.body)
    req.pop("stream_options", None)
    # Greedy: with thinking on, the grammar starts only after </think> (which a random model never
    # writes), so the text is the model's own and must not differ by sampling.
    req["temperature"] = 0.0
    whole = client.post(base_url + case.path, json={**req, "stream": False}, timeout=20)
    streamed = client.post(base_url + case.path, json={**req, "stream": True}, timeout=20)
    if whole.status_code != 200 or streamed.status_code != 200:
        return [] if whole.status_code == streamed.status_code else [
            f"whole {whole.status_code}, streamed {streamed.status_code}: {whole.text[:200]} / {streamed.text[:200]}"]
    msg = whole.json()["choices"][0]["message"]
    want = {"reasoning_content": msg.get("reasoning_content"), "content": msg.get("content") or "",
            "tool_calls": [(t["function"]["name"], _strict_json(t["function"]["arguments"]))
                           for t in msg.get("tool_calls") or []]}
    got = _streamed_message(streamed.text)
    if want["tool_calls"]:  # a whole answer with calls drops the content's trailing whitespace
        got["content"] = got["content"].rstrip()
    return [] if got == want else [f"streamed {got!r:.300} != whole {want!r:.300}"]


def run_surface_cases(base_url: str, cases: list[Case], timeout: float = 20) -> tuple[list[tuple[Case, list[str]]],
                                                                                       dict[int | None, int]]:
    """Send every case, one at a time -> (the cases with problems, the count of each status)."""
    import httpx

    from tests.reliability.fuzz_requests import send_case

    failures, statuses = [], {}
    with httpx.Client() as client:
        for case in cases:
            answer = send_case(client, base_url, case, timeout=timeout)
            statuses[answer.status] = statuses.get(answer.status, 0) + 1
            problems = check_surface(case, answer)
            if problems:
                failures.append((case, problems))
    return failures, statuses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--kind", choices=["tools", "sampling", "pooling"], required=True)
    p.add_argument("--cases", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--tool-call-parser", default="hermes")
    p.add_argument("--reasoning-parser", default=None)
    args = p.parse_args()
    fuzz = SurfaceFuzzer(args.seed, args.kind, model=args.model, vocab_size=args.vocab_size,
                         max_model_len=args.max_model_len, tool_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser)
    failures, statuses = run_surface_cases(args.url.rstrip("/"), list(fuzz.cases(args.cases)))
    for case, problems in failures:
        print(f"{case}\n      {problems}")
    print(f"{len(failures)} of {args.cases} cases had problems; statuses {statuses}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
