"""Grammars refused before queueing (no finite string, an empty regex, xgrammar's cut non-ASCII
messages) and the bit arithmetic of the sampled-token check. No model: xgrammar on a toy vocabulary."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import xgrammar as xgr

from pagedllm.structured_output.backend_xgrammar import XgrammarBackend
from pagedllm.structured_output.conflicts import unpack_bitmask_row
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.productive import check_productive, class_is_empty, unproductive_rules
from pagedllm.structured_output.sample_check import SampleChecks, token_allowed


@pytest.fixture(scope="module")
def backend() -> XgrammarBackend:
    b = XgrammarBackend.__new__(XgrammarBackend)  # a toy vocabulary instead of a tokenizer's
    b.vocab_size = 5
    b.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "é", " ", "<eos>"], stop_token_ids=[4]))
    return b


@pytest.mark.parametrize("grammar, bad", [
    ('root ::= root', ["root"]),
    ('root ::= "a" root', ["root"]),
    ('root ::= x "!"\nx ::= x "a"', ["root", "x"]),
    ('root ::= x+\nx ::= x "a"', ["root", "root_1", "x"]),  # root_1: xgrammar's helper for x+
    ('root ::= x | y\nx ::= "a" x\ny ::= y x', ["root", "x", "y"]),
    ('root ::= "a" root | "b"', []),
    ('root ::= x*\nx ::= x "a"', []),  # zero repetitions end
    ('root ::= "a"* b? c+ [a-z]{0,} "x" | (e | f)\nb ::= "b"\nc ::= [^"\\]] "q"\ne ::= ""\nf ::= "f" (= "g")', []),
    ('root ::= [^\\n]{2} "]" ("[" ")")', []),
])
def test_unproductive_rules_from_xgrammars_print(grammar, bad):
    assert unproductive_rules(str(xgr.Grammar.from_ebnf(grammar))) == bad


@pytest.mark.parametrize("regex, empty", [
    ("[^\\s\\S]", True), ("a[^\\s\\S]", True), ("[^\\d\\D]", True), ("a|[^\\s\\S]", False), (".*", False),
    ("[^a]", False), ("\\d{3}-\\w+[\\]\\[]", False), ("(é|ü)+", False),
])
def test_a_regex_that_matches_nothing_is_refused(regex, empty):
    if empty:
        with pytest.raises(ValueError, match="regex matches no string"):
            check_productive("regex", regex)
    else:
        check_productive("regex", regex)


def test_class_is_empty():
    assert class_is_empty("") and class_is_empty("^\\0-\\U0010ffff")
    assert class_is_empty("^\\0-\\x7f\\x80-\\U0010ffff")
    assert not class_is_empty("^\\0-\\x7f\\x81-\\U0010ffff")  # \x80 is left
    assert not class_is_empty("a-z") and not class_is_empty("^a")


def test_the_unproductive_rule_is_named_in_the_400(backend):
    with pytest.raises(ValueError, match=r"rules 'root', 'x' derive no finite string"):
        backend.validate(StructuredOutputsParams(grammar='root ::= x "!"\nx ::= x "a"'))
    backend.validate(StructuredOutputsParams(grammar='root ::= "a" root | "b"'))


@pytest.mark.parametrize("grammar, message", [
    ('root ::= "é" é', "line 1, column 14: Unexpected character: 'é'"),
    ('root ::= "日本" 語', "line 1, column 15: Unexpected character: '語'"),
    ('root ::= "a"\nx ::= ü', "line 2, column 7: Unexpected character: 'ü'"),
])
def test_xgrammars_message_with_a_non_ascii_character_comes_back_whole(backend, grammar, message):
    # xgrammar quotes the character by its first byte; the message would not even decode.
    with pytest.raises(ValueError) as e:
        backend.validate(StructuredOutputsParams(grammar=grammar))
    assert str(e.value) == f"structured_outputs.grammar cannot be compiled: EBNF lexer error at {message}"


def test_bitmask_bits():
    row = torch.tensor([0b101, -(2**31)], dtype=torch.int32)  # tokens 0, 2 and 63 (the sign bit)
    assert [token_allowed(row, t) for t in (0, 1, 2, 62, 63)] == [True, False, True, False, True]
    assert unpack_bitmask_row(row, 64).nonzero().flatten().tolist() == [0, 2, 63]


def test_sample_checks_find_the_forbidden_token_once():
    checks = SampleChecks()
    so = object()
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    bitmask[0, 0] = 0b100  # row 0 allows token 2 only; row 1 allows nothing
    checks.record(so, [("a", 0), ("b", 1)], bitmask)
    checks.snapshot(so)
    bitmask.fill_(-1)  # the buffer's next fill: the snapshot kept this step's rows
    result = SimpleNamespace(req_ids=["x", "b", "a"], sampled_token_ids=[5, 7, 2])
    assert checks.refused(so, result, {"a": None}) == {}  # "b" left meanwhile: skipped
    checks.record(so, [("a", 0), ("b", 1)], bitmask.zero_())
    assert checks.refused(so, result, {"a": None, "b": None}) == {"a": 2, "b": 7}
    assert checks.refused(so, result, {"a": None, "b": None}) == {}  # read once


@pytest.mark.parametrize("schema, empty", [
    ({"type": "string", "pattern": "[^\\s\\S]"}, True),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "a[^\\d\\D]"}}, "required": ["a"]}, True),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),  # never ends
    ({"type": "array", "items": {"type": "string", "pattern": "[^\\s\\S]"}}, False),  # [] is fine
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, False),  # {} is fine
])
def test_a_json_schema_that_admits_no_value_is_refused(backend, schema, empty):
    params = StructuredOutputsParams(json=schema)
    if empty:
        with pytest.raises(ValueError, match="admits no finite JSON value"):
            backend.validate(params)
    else:
        backend.validate(params)


def test_the_fifty_schemas_are_productive():
    from tests.structured_output.schemas import SCHEMAS

    for schema in SCHEMAS:
        check_productive("json", json.dumps(schema), True, 24)
