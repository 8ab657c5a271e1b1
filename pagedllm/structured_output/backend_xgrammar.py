"""The xgrammar backend: StructuredOutputsParams -> xgrammar CompiledGrammar -> GrammarMatcher.

Compiling needs the tokenizer's vocabulary (TokenizerInfo, built once, ~0.2 s for 49k tokens);
xgrammar's GrammarCompiler is thread-safe and caches compiled grammars by their source, so the
64 requests of a batch that share one schema compile it once.

JSON schema keywords xgrammar would silently ignore (uniqueItems, multipleOf on numbers, not,
if/then/else, ...) are refused with a message naming the keyword and where it is, so a request
never gets output that looks constrained but is not.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import torch
import xgrammar as xgr

from pagedllm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.productive import check_productive

# Keywords the JSON-schema converter does not enforce (xgrammar 0.2.x): refused.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {"uniqueItems", "contains", "minContains", "maxContains", "multipleOf", "not", "if", "then", "else",
     "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
     "contentEncoding", "contentMediaType", "contentSchema"}
)
# String formats xgrammar turns into a grammar; any other format would be ignored, so it is refused.
SUPPORTED_STRING_FORMATS = frozenset(
    {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
     "uri-template", "json-pointer", "relative-json-pointer"}
)
# Keys whose value is a sub-schema, a list of them, or a name -> sub-schema map.
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")

# Whitespace characters allowed between two JSON elements. Unbounded, a small model can loop on
# newlines inside an object until max_tokens (seen with SmolLM2-135M: 1 in ~20 schemas); 24 still
# fits pretty-printed JSON five levels deep at 4-space indents.
MAX_WHITESPACE = 24
_BATCH_FILL_MIN_ROWS = 16  # below this, one call per row costs less than the batch call's set-up

# xgrammar's C++ batch matcher, under its Python wrapper (see accept_tokens_batch); None if moved.
_CORE_BATCH = getattr(getattr(getattr(xgr, "matcher", None), "_core", None), "BatchGrammarMatcher", None)
if _CORE_BATCH is not None and not hasattr(_CORE_BATCH, "batch_accept_token"):
    _CORE_BATCH = None

_CPP_PREFIX = re.compile(r"\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def clean_error(e: BaseException) -> str:
    """xgrammar's C++ message without its timestamp and source location:
    '[08:57:21] /project/cpp/regex_converter.cc:94: Regex parsing error ...' -> 'Regex parsing error ...'."""
    return _CPP_PREFIX.sub("", str(e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__


_AT_LINE_COLUMN = re.compile(r"line (\d+), column (\d+): Unexpected character: ")


def cut_error_text(e: UnicodeDecodeError, source: str | None) -> str:
    """xgrammar's message when it does not decode: its EBNF lexer quotes an unexpected character by
    its first byte only ('Unexpected character: \\xc3' for 'é'), so the message is not UTF-8 and
    Python's decoding of it fails. The character is read back from `source` at the line and byte column
    the message names, and the column given in characters:
        'root ::= "é" é' -> 'EBNF lexer error at line 1, column 14: Unexpected character: 'é''"""
    raw = e.object if isinstance(e.object, bytes) else bytes(e.object)
    text = raw.decode("utf-8", errors="replace")
    m = _AT_LINE_COLUMN.search(text)
    lines = source.split("\n") if source is not None else []
    if m is None or not 0 < int(m.group(1)) <= len(lines):
        return clean_error(RuntimeError(text))
    line = lines[int(m.group(1)) - 1].encode("utf-8")
    byte_col = int(m.group(2)) - 1
    char = line[byte_col:].decode("utf-8", errors="ignore")[:1]
    char_col = len(line[:byte_col].decode("utf-8", errors="ignore")) + 1
    rest = text[m.end():].lstrip("\ufffd")
    fixed = f"{text[:m.start()]}line {m.group(1)}, column {char_col}: Unexpected character: {char!r}{rest}"
    return clean_error(RuntimeError(fixed))


def check_json_schema(schema: Any, where: str = "schema") -> None:
    """Refuse keywords the backend would not enforce; ValueError names the keyword and its path."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}.")
    for key, value in schema.items():
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            raise ValueError(f"JSON schema keyword {key!r} (at {where}) is not supported by the xgrammar backend.")
        if key == "format" and schema.get("type") == "string" and value not in SUPPORTED_STRING_FORMATS:
            raise ValueError(f"JSON schema string format {value!r} (at {where}) is not supported by the xgrammar "
                             f"backend; supported: {', '.join(sorted(SUPPORTED_STRING_FORMATS))}.")
        if key == "pattern" and ("minLength" in schema or "maxLength" in schema):
            raise ValueError(f"JSON schema 'pattern' together with minLength / maxLength (at {where}) is not supported "
                             "by the xgrammar backend (it would drop the length); put the length in the pattern.")
        if key in ("anyOf", "oneOf", "allOf") and value == []:
            # JSON Schema requires a non-empty list; xgrammar compiles [] to a grammar that ends at once.
            raise ValueError(f"JSON schema {key!r} (at {where}) must be a non-empty list of schemas.")
        if key == "required" and isinstance(value, list) and isinstance(schema.get("properties", {}), dict):
            # xgrammar enforces only the required names that `properties` declares: {"required": ["a"],
            # "properties": {}} would give {} - refused rather than answered with a JSON that breaks the schema.
            missing = [n for n in value if n not in schema.get("properties", {})]
            if missing:
                raise ValueError(f"JSON schema 'required' names {', '.join(map(repr, missing))} (at {where}) that "
                                 "'properties' does not declare; the xgrammar backend would not enforce them: "
                                 "declare each one in 'properties'.")
        if key in _SUBSCHEMA and isinstance(value, (dict, bool)):
            check_json_schema(value, f"{where}.{key}")
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_json_schema(sub, f"{where}.{key}[{i}]")
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_json_schema(sub, f"{where}.{key}.{name}")
        elif key == "items" and isinstance(value, list):
            for i, sub in enumerate(value):
                check_json_schema(sub, f"{where}.items[{i}]")


def choice_to_ebnf(choices: list[str]) -> str:
    """['yes', 'a "b"'] -> 'root ::= "yes" | "a \\"b\\""' (JSON string escapes, which the EBNF parser reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher
        self.handle = matcher._handle  # the C++ matcher, for the batch calls below
        # An xgrammar matcher ends only by accepting one of these (terminate_without_stop_token off);
        # None (a release without the property): ask after every token.
        stop_ids = getattr(matcher, "stop_token_ids", None)
        self.stop_ids = None if stop_ids is None else frozenset(stop_ids)

    def accept_tokens(self, tokens: list[int]) -> bool:
        return all(self.matcher.accept_token(t) for t in tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, max_threads: int = 2,
                 tokenizer_info: xgr.TokenizerInfo | None = None) -> None:
        # vocab_size is the logits' width (may exceed the tokenizer's: padded embeddings).
        # tokenizer_info: one already built (the grammar worker gets the engine's, serialized).
        self.vocab_size = vocab_size
        if tokenizer_info is None:
            tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.tokenizer_info = tokenizer_info
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    def _compile(self, p: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = p.kind
        try:
            if kind == "json":
                schema = json.loads(p.json) if isinstance(p.json, str) else p.json
                check_json_schema(schema)
                return self.compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=not p.disable_any_whitespace, strict_mode=True,
                    max_whitespace_cnt=MAX_WHITESPACE,
                )
            if kind == "json_object":
                # Any object (any keys, any values), with the same whitespace bound as a schema.
                return self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not p.disable_any_whitespace, strict_mode=False,
                    max_whitespace_cnt=MAX_WHITESPACE,
                )
            if kind == "regex":
                return self.compiler.compile_regex(p.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_to_ebnf(p.choice))
            if kind == "grammar":
                return self.compiler.compile_grammar(p.grammar)
            return self._compile_structural_tag(p.structural_tag)
        except UnicodeDecodeError as e:  # a message naming a non-ASCII character, cut by xgrammar (a ValueError)
            source = p.grammar if kind == "grammar" else choice_to_ebnf(p.choice) if kind == "choice" else None
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {cut_error_text(e, source)}") from None
        except ValueError:
            raise
        except (RuntimeError, TypeError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as e:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {clean_error(e)}") from None

    def _compile_structural_tag(self, text: str) -> xgr.CompiledGrammar:
        try:
            tag = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}.") from None
        if isinstance(tag, dict) and "structures" in tag:
            # vLLM's documented form: {"type": "structural_tag", "structures": [{begin, schema, end}], "triggers": [...]}
            items = []
            for i, s in enumerate(tag["structures"]):
                if not isinstance(s, dict) or not {"begin", "end"} <= set(s):
                    raise ValueError(f"structural_tag.structures[{i}] needs begin, schema and end.")
                schema = s.get("schema", {})
                check_json_schema(schema, f"structural_tag.structures[{i}].schema")
                items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(schema), end=s["end"]))
            triggers = tag.get("triggers")
            if not isinstance(triggers, list) or not triggers:
                raise ValueError("structural_tag.triggers must be a non-empty list of strings.")
            return self.compiler.compile_structural_tag(items, triggers)
        return self.compiler.compile_structural_tag(text)  # xgrammar's own StructuralTag JSON

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        # Many rows: xgrammar's batch call fills them on its own threads, outside the GIL.
        if len(rows) >= _BATCH_FILL_MIN_ROWS:
            self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)
        else:
            super().fill_bitmasks(grammars, bitmask, rows)

    def fill_job(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int] | None = None):
        # The C++ batch fill itself, its arguments bound here: on the bitmask thread no Python runs
        # before the GIL is released (rows None: row i of the bitmask for matcher i; the grammar
        # worker's share of a batch names its rows). Any number of rows: a few rows' set-up cost is
        # off the step loop, and one call per row would hold the GIL between rows.
        return functools.partial(self._batch._handle.batch_fill_next_token_bitmask,
                                 [g.handle for g in grammars], bitmask, rows, False)

    def accept_tokens_batch(self, grammars: list[StructuredOutputGrammar], tokens: list[int]) -> list[bool] | None:
        # One C++ call for the batch instead of one Python -> C++ call per row (64 a decode step).
        # xgrammar's wrapper turns the result into a Python list element by element, which costs
        # more than the accepts (BENCHMARKS.md, issue 22, h28); its core call's result answers
        # "any refused?" in one C call. Older releases lack either: the public paths.
        if _CORE_BATCH is not None:
            result = _CORE_BATCH.batch_accept_token([g.handle for g in grammars], tokens, False)
            return [bool(ok) for ok in result] if 0 in result else None
        matchers = [g.matcher for g in grammars]
        if hasattr(xgr.BatchGrammarMatcher, "batch_accept_token"):
            oks = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
            return None if all(oks) else oks
        return super().accept_tokens_batch(grammars, tokens)

    def accept_job(self, grammars: list[StructuredOutputGrammar], tokens: list[int]):
        """The batch accept as a call with no arguments (run on the bitmask thread): returns one
        0 / 1 per row, 1 accepted."""
        if _CORE_BATCH is not None:
            return functools.partial(_CORE_BATCH.batch_accept_token, [g.handle for g in grammars], tokens, False)
        return lambda: [int(ok) for ok in (self.accept_tokens_batch(grammars, tokens) or [True] * len(tokens))]

    def validate(self, params: StructuredOutputsParams) -> None:
        self._compile(params)
        # A grammar whose root derives no finite string compiles, then masks every token or never allows
        # a stop token: refused here (productive.py).
        if params.kind in ("grammar", "regex"):
            check_productive(params.kind, params.grammar if params.kind == "grammar" else params.regex)
        elif params.kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            check_productive("json", json.dumps(schema), not params.disable_any_whitespace, MAX_WHITESPACE)

    def compile_grammar(self, params: StructuredOutputsParams, stop_token_ids: list[int]) -> XgrammarGrammar:
        compiled = self._compile(params)
        # The request's own stop ids (EOS from generation_config, stop_token_ids): the grammar allows
        # them only where it may end, so EOS can never cut a JSON value short.
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids) or None)
        return XgrammarGrammar(matcher)
