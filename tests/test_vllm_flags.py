"""The vLLM flag table (pagedllm/vllm_flags.py, docs/FLAGS.md) held against the real parser: every
flag of `vllm serve` works, warns once, or is refused with its reason, and docs/FLAGS.md lists
each one in the same state. No model is loaded here."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from pagedllm.entrypoints.openai.api_server import parse_server_args
from pagedllm.entrypoints.openai.cli_args import expand_config_args
from pagedllm.vllm_flags import NOTE_FLAGS, REFUSED_FLAGS, WORKING_FLAGS, check_llm_kwargs

DOC = Path(__file__).resolve().parents[1] / "docs" / "FLAGS.md"


def _value_args(flag: str, arity) -> list[str]:
    return [flag] if arity == 0 else [flag, "1"] if arity == 1 else [flag, "a", "b"]


def test_states_are_disjoint_and_every_working_flag_is_the_parsers_own():
    assert not set(NOTE_FLAGS) & set(REFUSED_FLAGS)
    assert not set(WORKING_FLAGS) & (set(NOTE_FLAGS) | set(REFUSED_FLAGS))
    parser_flags = set(_parser()._option_string_actions)
    for flag in WORKING_FLAGS:
        assert flag in parser_flags, f"{flag} is listed as working but the parser does not define it"
        action = _parser()._option_string_actions[flag]
        assert not action.dest.startswith("vllm_flag__"), flag


def _parser():
    import argparse

    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    return make_arg_parser(argparse.ArgumentParser())


@pytest.mark.parametrize("flag", sorted(NOTE_FLAGS))
def test_note_flags_are_accepted_with_one_warning(flag, caplog):
    caplog.set_level(logging.WARNING)
    entry = NOTE_FLAGS[flag]
    parse_server_args([flag, entry.accepted[0]] if entry.accepted else _value_args(flag, entry.arity))
    lines = [r.getMessage() for r in caplog.records if flag in r.getMessage()]
    assert len(lines) == 1 and NOTE_FLAGS[flag].note in lines[0], lines


@pytest.mark.parametrize("flag", sorted(REFUSED_FLAGS))
def test_refused_flags_say_why(flag):
    with pytest.raises(ValueError, match=re.escape(f"{flag} is not supported: {REFUSED_FLAGS[flag].note}")):
        parse_server_args(_value_args(flag, REFUSED_FLAGS[flag].arity))


@pytest.mark.parametrize("flag", sorted(f for f, e in NOTE_FLAGS.items() if e.accepted))
def test_note_flag_values_that_ask_for_what_is_not_built_are_refused(flag):
    # --logprobs-mode processed_logprobs asks for logprobs after penalties and temperature: not built.
    with pytest.raises(ValueError, match=re.escape(f"{flag} other is not supported: {NOTE_FLAGS[flag].note}")):
        parse_server_args([flag, "other"])
    with pytest.raises(ValueError, match="logprobs_mode='processed_logprobs' is not supported: logprobs are"):
        check_llm_kwargs({"logprobs_mode": "processed_logprobs"})
    assert check_llm_kwargs({"logprobs_mode": "raw_logprobs", "max_model_len": 8}) == {"max_model_len": 8}


def test_notes_that_the_code_contradicted_now_say_what_runs():
    # An fp8 KV cache exists (scales from the checkpoint), so computing scales is refused, not "no cache";
    # a Ray executor exists, so nsight on its workers is refused; TP does all-reduce (torch.distributed).
    for flag in ("--calculate-kv-scales", "--ray-workers-use-nsight"):
        assert flag in REFUSED_FLAGS and flag not in NOTE_FLAGS
    assert "checkpoint's k_scale" in REFUSED_FLAGS["--calculate-kv-scales"].note
    assert "torch.distributed" in NOTE_FLAGS["--disable-custom-all-reduce"].note
    assert "raw_logprobs" in NOTE_FLAGS["--logprobs-mode"].note


def test_unused_table_flags_say_nothing(caplog):
    caplog.set_level(logging.WARNING)
    parse_server_args([])
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]


def test_docs_list_every_flag_in_its_state():
    text = DOC.read_text()
    rows = dict(re.findall(r"^\| `(-[-\w]+)` \| (works|accepted with a note|refused) \|", text, re.M))
    expected = {**{f: "works" for f in WORKING_FLAGS}, **{f: "accepted with a note" for f in NOTE_FLAGS},
                **{f: "refused" for f in REFUSED_FLAGS}}
    assert rows == expected


def test_llm_kwargs_follow_the_table(caplog):
    caplog.set_level(logging.WARNING)
    rest = check_llm_kwargs({"use_v2_block_manager": True, "num_scheduler_steps": 8, "max_model_len": 64,
                             "enable_lora": False, "task": "generate"})
    assert rest == {"max_model_len": 64, "task": "generate"}  # task is built (runner="pooling", issue 21)
    assert len([r for r in caplog.records if "has no effect" in r.getMessage()]) == 2
    with pytest.raises(ValueError, match="enable_lora=True is not supported: LoRA"):
        check_llm_kwargs({"enable_lora": True})


def test_config_yaml_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_num_seqs: 8\nport: 9001\nenable-prefix-caching: false\ntrust_remote_code: true\n"
                   "hf_overrides:\n  rope_theta: 1000.0\nserved-model-name: [a, b]\n")
    args = parse_server_args(["--config", str(cfg), "--port", "9002"])
    assert (args.max_num_seqs, args.port, args.trust_remote_code) == (8, 9002, True)
    assert args.served_model_name == ["a", "b"] and '"rope_theta": 1000.0' in args.hf_overrides
    assert expand_config_args(["serve", "m", "--config", str(cfg)])[:3] == ["serve", "m", "--max-num-seqs"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        parse_server_args(["--config", str(bad)])


def test_max_num_seqs_zero_is_refused():
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        EngineArgs.from_cli_args(parse_server_args(["--max-num-seqs", "0", "--load-format", "dummy",
                                                    "--model", "qwen3-0.6b"])).create_engine_config()


def test_vllm_api_key_is_honoured(monkeypatch):
    from pagedllm.entrypoints.openai.cli_args import api_keys

    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")
    assert api_keys(parse_server_args([])) == ["sk-vllm"]


def test_structured_output_backend_flags_take_xgrammar_and_refuse_the_rest():
    # vLLM scripts name the backend that runs here (xgrammar); naming another is refused by name
    from pagedllm.structured_output.params import SUPPORTED_BACKENDS
    from pagedllm.vllm_flags import _XGRAMMAR

    assert _XGRAMMAR == SUPPORTED_BACKENDS  # the table's copy (it imports none of pagedllm) and the engine's
    assert check_llm_kwargs({"guided_decoding_backend": "xgrammar", "structured_outputs_config": {"backend": "auto"},
                             "max_model_len": 8}) == {"max_model_len": 8}
    parse_server_args(["--structured-outputs-config", '{"backend": "xgrammar"}', "--guided-decoding-backend", "auto"])
    for kwargs in ({"guided_decoding_backend": "outlines"}, {"structured_outputs_config": {"backend": "guidance"}},
                   {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}):
        with pytest.raises(ValueError, match="is not supported: constrained decoding always runs xgrammar"):
            check_llm_kwargs(kwargs)
    with pytest.raises(ValueError, match="--structured-outputs-config not-json is not supported"):
        parse_server_args(["--structured-outputs-config", "not-json"])
