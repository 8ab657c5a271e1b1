"""Seeded model outputs for the tool-call and reasoning parsers, and the checks every parse must pass.

A random model never writes a tool call, so these are the texts a model *could* write: each parser's
own format (hermes' <tool_call> blocks, llama3_json's objects, mistral's [TOOL_CALLS] array,
pythonic's call list) with odd names and arguments (unicode, escapes, "}" inside strings, huge
numbers, NaN, Python literals JSON has no spelling for), then mutated (cut off, junk after, a marker
doubled, deep nesting), sometimes behind a <think> block:

    fuzz = ToolOutputFuzzer(seed=0)
    for case in fuzz.cases(500):
        problems = check_choice_parsing(case)

`check_choice_parsing` feeds the text to `ChoiceOutputParser` whole and in random pieces (as a
stream does) and holds both to the rules: nothing raises; each tool-call delta has OpenAI's wire
shape (a call's first delta: index, id, type "function", function.name, arguments ""; later ones:
index and an arguments fragment; indices 0, 1, 2 in order); a call's concatenated fragments are a
JSON object (strict JSON: no NaN); the stream says what the whole answer says (same reasoning,
content and calls); the message parses as the openai client's ChatCompletionMessage.

The same texts reach the real server through guided_choice (test_fuzz_tools.py), where the
openai client parses every answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")

NAMES = ["get_weather", "f", "g_2", "search", "x" * 80, "名前", "with space", "", "a.b", "print", "__import__"]
ODD_TEXT = ["", " ", "}", "{", "]", "[", "\"", "\\", "\n", "a}b", "\u0000", "\u202e", "\U0001f600", "é", "'",
            "</tool_call>", "<tool_call>", "[TOOL_CALLS]", "</think>", "<think>", "\\u0041", "\t"]


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value (objects and arrays to depth 3)."""
    roll = rng.random()
    if depth < 3 and roll < 0.2:
        return {rng.choice(["a", "city", "days", "", "é", "}"]): _json_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if depth < 3 and roll < 0.35:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([0, -1, 1.5, 2**70, -1e-300, True, False, None, "Paris", *ODD_TEXT])


def _args(rng: random.Random) -> dict[str, Any]:
    return {rng.choice(["city", "days", "q", "é", "", "}"]): _json_value(rng) for _ in range(rng.randint(0, 3))}


# Python literals for pythonic arguments, as source text: JSON's values and the ones it has no spelling for.
PY_LITERALS = ["1", "-2", "1.5", "'Paris'", '"a}b"', "True", "None", "[1, 'x']", "{'a': 1}", "(1, 2)", "1e999",
               "-1e999", "float('nan')", "1+2j", "{1, 2}", "b'x'", "{1: 'a'}", "{(1, 2): 3}", "'\\u0000'",
               "...", "x", "f(1)", "[" * 40 + "]" * 40, "10**100", "0x10", "'''a\nb'''", "{'a': {'b': [None]}}"]


@dataclass
class ToolOutputCase:
    name: str  # what the text is: "hermes: 2 calls, cut"
    tool_parser: str | None  # None: tool_choice none (content only)
    reasoning_parser: str | None
    text: str
    pieces: list[int]  # the stream's piece lengths (sum == len(text))

    def __str__(self) -> str:
        return f"{self.name} [{self.tool_parser}/{self.reasoning_parser}] {self.text[:300]!r}"


class ToolOutputFuzzer:
    """Seeded model outputs for every tool parser, with and without a reasoning parser."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def _call_obj(self, parser: str) -> dict[str, Any]:
        rng = self.rng
        obj: dict[str, Any] = {"name": rng.choice(NAMES)}
        key = "parameters" if parser == "llama3_json" else "arguments"
        if rng.random() < 0.15:
            key = "parameters" if key == "arguments" else "arguments"
        args: Any = _args(rng)
        roll = rng.random()
        if roll < 0.1:
            args = json.dumps(args)  # arguments as a JSON string, as some models write them
        elif roll < 0.15:
            args = rng.choice(["{", "[1]", 5, None, "not json", [], "{\"a\": NaN}"])
        elif roll < 0.2:
            obj.pop("name")
        if roll >= 0.2 or rng.random() < 0.5:
            obj[key] = args
        if rng.random() < 0.05:
            obj["name"] = rng.choice([5, None, ["f"], {"a": 1}])
        return obj

    def _json_text(self, obj: Any) -> str:
        rng = self.rng
        text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 2]))
        if rng.random() < 0.05:
            text = text.replace("1.5", "NaN", 1).replace("-1", "-Infinity", 1)  # Python's json reads these
        return text

    def _pythonic_call(self) -> str:
        rng = self.rng
        name = rng.choice(["get_weather", "f", "search", "名前", "x.y", "f(1)", "lambda: 1", "1f"])
        kwargs = [f"{rng.choice(['city', 'days', 'q', 'é'])}={rng.choice(PY_LITERALS)}"
                  for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.1:
            kwargs.append(rng.choice(["1", "*a", "**{'a': 1}", "x"]))  # positional / starred: not a call's form
        return f"{name}({', '.join(kwargs)})"

    def _format(self, parser: str) -> str:
        rng = self.rng
        count = rng.choice([0, 1, 1, 1, 2, 3])
        if parser == "pythonic":
            body = "[" + ", ".join(self._pythonic_call() for _ in range(count)) + "]"
            if rng.random() < 0.2:
                body = "<|python_start|>" + body + rng.choice(["<|python_end|>", ""])
            return body
        calls = [self._json_text(self._call_obj(parser)) for _ in range(count)]
        if parser == "hermes":
            before = rng.choice(["", "Let me check.\n", "<tool_call", "text with </tool_call> in it\n"])
            nl = ["\n", ""]
            blocks = "".join("<tool_call>" + rng.choice(nl) + c + rng.choice(nl) + "</tool_call>"
                             + rng.choice(["\n", "", " "]) for c in calls)
            return before + blocks
        if parser == "llama3_json":
            sep = rng.choice(["; ", ";", "\n", " ", ", "])
            return rng.choice(["", "", "<|python_tag|>", "  "]) + sep.join(calls)
        # mistral
        inner = ", ".join(calls)
        return rng.choice(["", "Sure. "]) + "[TOOL_CALLS]" + rng.choice([" ", ""]) + (
            f"[{inner}]" if rng.random() < 0.8 else inner)

    def _mutate(self, text: str) -> tuple[str, str]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.45 or not text:
            return text, "whole"
        if roll < 0.65:
            return text[:rng.randint(0, len(text) - 1)], "cut"
        if roll < 0.75:
            return text + rng.choice([" trailing words", "\n\nDone.", "}", "]", "<tool_call>", "[TOOL_CALLS]"]), "tail"
        if roll < 0.85:
            i = rng.randint(0, len(text))
            return text[:i] + rng.choice(ODD_TEXT + ["x" * 50]) + text[i:], "insert"
        if roll < 0.9:
            depth = rng.choice([50, 2000, 20_000])
            return text.replace("{", "{\"deep\": " + "[" * depth + "]" * depth + ", ", 1), f"deep{depth}"
        return "".join(rng.choice(ODD_TEXT + ["word ", "{", "[", "(", ")"]) for _ in range(rng.randint(1, 30))), "junk"

    def _think(self, text: str, reasoning: str) -> str:
        rng = self.rng
        thought = rng.choice(["I should call a tool.", "", "<tool_call>{\"name\": \"f\"}</tool_call>", "\n\n",
                              "[TOOL_CALLS] [] <think>"])
        form = rng.random()
        if form < 0.5:
            opened = "<think>" if reasoning == "qwen3" or rng.random() < 0.3 else ""
            return opened + rng.choice(["", "\n"]) + thought + "</think>" + rng.choice(["", "\n\n"]) + text
        if form < 0.7:
            return f"<think>{thought}"  # cut off while thinking
        return text  # no think block

    def _pieces(self, n: int) -> list[int]:
        rng = self.rng
        size = rng.choice([1, 2, 3, 7, 1000])
        least = max(1, n // 100)  # a long output in at most ~100 pieces (each re-parses the text so far)
        pieces = []
        while n > 0:
            k = min(n, max(least, rng.randint(1, size)))
            pieces.append(k)
            n -= k
        return pieces or [0]

    def output(self, parser: str, reasoning: str | None) -> tuple[str, str]:
        """One model output in `parser`'s format (behind a think block when `reasoning`) -> (text, how)."""
        text, how = self._mutate(self._format(parser))
        return (self._think(text, reasoning) if reasoning is not None else text), how

    def cases(self, count: int) -> Iterator[ToolOutputCase]:
        rng = self.rng
        for _ in range(count):
            parser = rng.choice(TOOL_PARSER_NAMES)
            reasoning = rng.choice([None, None, *REASONING_PARSER_NAMES])
            text, how = self.output(parser, reasoning)
            tool_parser = parser if rng.random() < 0.9 else None
            yield ToolOutputCase(f"{parser}: {how}", tool_parser, reasoning, text, self._pieces(len(text)))


# -- checks ----------------------------------------------------------------------------------------
class ThinkVocab:
    """The one tokenizer method the reasoning parsers call."""

    def get_vocab(self) -> dict[str, int]:
        return {"</think>": 7}


def _strict_json(text: str) -> Any:
    def refuse(const: str) -> Any:
        raise ValueError(f"{const} is not JSON")

    return json.loads(text, parse_constant=refuse)


def tool_delta_problems(deltas: list[dict[str, Any]]) -> tuple[list[str], dict[int, tuple[str, str]]]:
    """OpenAI's tool-call delta rules -> (problems, {index: (name, concatenated arguments)})."""
    problems: list[str] = []
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for d in deltas:
        index = d.get("index")
        fn = d.get("function")
        if not isinstance(index, int) or not isinstance(fn, dict):
            problems.append(f"delta without an int index and a function: {d!r:.200}")
            continue
        if index not in calls:
            if index != len(calls):
                problems.append(f"tool call index {index} after {sorted(calls)}")
            if set(d) != {"index", "id", "type", "function"} or d["type"] != "function":
                problems.append(f"a call's first delta has keys {sorted(d)}: {d!r:.200}")
            if not isinstance(d.get("id"), str) or not d.get("id"):
                problems.append(f"a call's first delta has no id: {d!r:.200}")
            if set(fn) != {"name", "arguments"} or not isinstance(fn.get("name"), str) or not fn["name"]:
                problems.append(f"a call's first delta has no name: {d!r:.200}")
            calls[index] = []
            names[index] = fn.get("name", "")
        elif set(d) != {"index", "function"} or set(fn) != {"arguments"}:
            problems.append(f"a later delta of call {index} has keys {sorted(d)} / {sorted(fn)}")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            problems.append(f"arguments fragment is not a string: {args!r:.100}")
            continue
        calls[index].append(args)
    return problems, {i: (names[i], "".join(parts)) for i, parts in calls.items()}


def _calls_problems(calls: dict[int, tuple[str, str]], where: str) -> list[str]:
    problems = []
    for i, (name, args) in calls.items():
        try:
            value = _strict_json(args)
        except ValueError as e:
            problems.append(f"{where} call {i} ({name!r}) arguments are not JSON ({e}): {args[:200]!r}")
            continue
        if not isinstance(value, dict):
            problems.append(f"{where} call {i} ({name!r}) arguments are not an object: {args[:200]!r}")
    return problems


def _make_parser(case: ToolOutputCase) -> Any:
    from pagedllm.entrypoints.openai.chat_output import ChoiceOutputParser
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from pagedllm.reasoning import get_reasoning_parser

    reasoning = get_reasoning_parser(case.reasoning_parser)(ThinkVocab()) if case.reasoning_parser else None
    if case.tool_parser is None:
        return ChoiceOutputParser(reasoning, "none")
    return ChoiceOutputParser(reasoning, "auto", TOOL_PARSERS[case.tool_parser](None))


def check_choice_parsing(case: ToolOutputCase) -> list[str]:
    """Everything wrong with how ChoiceOutputParser handles this output, whole and streamed."""
    from openai.types.chat import ChatCompletionMessage
    from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall

    try:
        whole = _make_parser(case)
        whole.feed(case.text, final=True)
        w_reasoning, w_content, w_calls = whole.message()
        w_finish = whole.finish_reason("stop")
    except Exception as e:  # noqa: BLE001 - any exception is the finding (a 500, or an in-band stream error)
        return [f"whole: {type(e).__name__}: {e!s:.200}"]
    problems = []
    whole_calls = {i: (c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(w_calls)}
    problems += _calls_problems(whole_calls, "whole")
    if any(not name for name, _ in whole_calls.values()):
        problems.append(f"whole: a tool call with an empty name: {w_calls!r:.200}")
    try:
        ChatCompletionMessage.model_validate({"role": "assistant", "content": w_content, "tool_calls": w_calls or None,
                                              "reasoning_content": w_reasoning})
    except Exception as e:  # noqa: BLE001
        problems.append(f"whole: the openai client refuses the message: {e!s:.200}")
    if w_finish != ("tool_calls" if w_calls else "stop"):
        problems.append(f"finish_reason {w_finish!r} with {len(w_calls)} calls")

    streamed = _make_parser(case)
    reasoning, content, deltas, pos = "", "", [], 0
    try:
        for k, n in enumerate(case.pieces):
            r, c, d = streamed.feed(case.text[pos:pos + n], final=k == len(case.pieces) - 1)
            pos += n
            reasoning, content, deltas = reasoning + r, content + c, deltas + d
    except Exception as e:  # noqa: BLE001
        return problems + [f"stream: {type(e).__name__}: {e!s:.200}"]
    delta_problems, stream_calls = tool_delta_problems(deltas)
    problems += delta_problems + _calls_problems(stream_calls, "stream")
    for d in deltas:
        try:
            ChoiceDeltaToolCall.model_validate(d)
        except Exception as e:  # noqa: BLE001
            problems.append(f"the openai client refuses the delta {d!r:.100}: {e!s:.100}")
    if stream_calls != whole_calls:
        problems.append(f"stream calls {stream_calls!r:.200} != whole {whole_calls!r:.200}")
    if reasoning != (w_reasoning or ""):
        problems.append(f"stream reasoning {reasoning!r:.100} != whole {w_reasoning!r:.100}")
    # A whole answer with calls drops the content's trailing whitespace; a stream sent it already.
    if (content.rstrip() if w_calls else content) != (w_content or ""):
        problems.append(f"stream content {content!r:.100} != whole {w_content!r:.100}")
    return problems
