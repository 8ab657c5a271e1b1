"""iter_weights on HF safetensors directories (sharded or not), and load_format validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm.loader import iter_weights, resolve_load_format, resolve_model
from pagedllm.loader.source import ModelSource
from pagedllm.loader.weights import SAFETENSORS_INDEX, safetensors_files


def tiny_model(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def assert_same_state(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(expected)
    for name, ref in expected.items():
        assert loaded[name].dtype == ref.dtype and torch.equal(loaded[name], ref), name


def test_sharded_checkpoint(tmp_path: Path) -> None:
    model = tiny_model()
    # embed/lm_head are 500*64*2 B = 64 KB each: a 100 KB limit makes several shards
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / SAFETENSORS_INDEX).is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    src = resolve_model(str(tmp_path))
    assert resolve_load_format(src) == "safetensors"
    assert_same_state(dict(iter_weights(src, use_tqdm=False)), model.state_dict())
    assert_same_state(dict(iter_weights(src, "safetensors", use_tqdm=False)), model.state_dict())


def test_index_ignores_stray_safetensors(tmp_path: Path) -> None:
    model = tiny_model()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    save_file({"stray": torch.zeros(2)}, tmp_path / "consolidated.safetensors")
    assert "consolidated.safetensors" not in {f.name for f in safetensors_files(tmp_path)}
    assert_same_state(dict(iter_weights(resolve_model(str(tmp_path)), use_tqdm=False)), model.state_dict())


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    tiny_model().save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / SAFETENSORS_INDEX).read_text())
    next(iter(sorted(tmp_path.glob("model-*.safetensors")))).unlink()
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names shards that are not in"):
        iter_weights(resolve_model(str(tmp_path)))


def test_single_file_tied_checkpoint(tmp_path: Path) -> None:
    model = tiny_model(tie=True)
    model.save_pretrained(tmp_path)
    assert not (tmp_path / SAFETENSORS_INDEX).exists()
    loaded = dict(iter_weights(resolve_model(str(tmp_path)), use_tqdm=False))
    # tied: the checkpoint has no lm_head.weight; the model ties it to the embedding itself
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert_same_state(loaded, expected)


def test_dir_without_safetensors(tmp_path: Path) -> None:
    tiny_model().config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    # auto falls back to the .bin file (as vLLM); an empty one is refused by name.
    with pytest.raises(ValueError, match=r"pytorch_model.bin could not be read as a weights-only"):
        list(iter_weights(resolve_model(str(tmp_path)), use_tqdm=False))
    with pytest.raises(ValueError, match=r"holds pt weights; use load_format='auto' or 'pt'"):
        iter_weights(resolve_model(str(tmp_path)), "safetensors")


def fake_gguf_source(tmp_path: Path) -> ModelSource:
    return ModelSource(
        kind="gguf",
        path=tmp_path / "m.gguf",
        hf_config=LlamaConfig(),
        generation_config={},
        tokenizer_path=tmp_path / "m.gguf",
        default_name="m",
    )


def test_load_format_validation(tmp_path: Path) -> None:
    tiny_model().save_pretrained(tmp_path / "hf")
    hf = resolve_model(str(tmp_path / "hf"))
    gguf_src = fake_gguf_source(tmp_path)
    preset = resolve_model("qwen3-0.6b")

    assert resolve_load_format(gguf_src, "auto") == "gguf"
    assert resolve_load_format(gguf_src, "gguf") == "gguf"
    for src in (hf, gguf_src, preset):
        assert resolve_load_format(src, "dummy") == "dummy"

    with pytest.raises(ValueError, match=r"Unknown load_format 'npcache'.*auto, safetensors, pt, gguf, dummy"):
        iter_weights(hf, "npcache")
    # validated when called, not at the first next()
    with pytest.raises(ValueError, match="a GGUF file.*use load_format='auto' or 'gguf'"):
        iter_weights(gguf_src, "safetensors")
    with pytest.raises(ValueError, match="HF checkpoint directory.*'safetensors'"):
        iter_weights(hf, "gguf")
    with pytest.raises(ValueError, match="without weights.*load_format='dummy'"):
        iter_weights(preset)
    with pytest.raises(ValueError, match="initialize_dummy_weights"):
        iter_weights(hf, "dummy")
