"""Model loading the way vLLM users' models arrive: hub ids in the local HF cache (offline, with
revisions and --download-dir), pytorch_model.bin checkpoints, trust_remote_code reaching the
config loader, generation_config.json's EOS list and max_new_tokens, hf_overrides, and a quantized
checkpoint refused by its method's name. Each failed before the change that made it pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.loader.source import resolve_model
from tests.utils import tiny_model

PROMPT = {"prompt_token_ids": [1, 2, 3, 4]}


def _copy_model(tmp_path: Path, name: str = "m") -> Path:
    src, _ = tiny_model("llama3")
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _hub_cache(root: Path, repo_id: str, model_dir: Path, commit: str = "a" * 40, ref: str = "main") -> Path:
    """huggingface_hub's layout: models--org--name/{refs/<ref>, snapshots/<commit>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    shutil.copytree(model_dir, snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


def _greedy(llm: LLM, **kw) -> list[int]:
    params = SamplingParams(temperature=0, ignore_eos=kw.pop("ignore_eos", False), **kw)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def test_hub_id_resolves_through_hf_home_hub_cache_and_download_dir(tmp_path, monkeypatch):
    model = _copy_model(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snap = _hub_cache(tmp_path / "home" / "hub", "acme/tiny-llama", model)
    src = resolve_model("acme/tiny-llama")
    assert src.kind == "hf_dir" and src.path == snap.resolve() and src.default_name == "acme/tiny-llama"
    # HF_HUB_CACHE wins over HF_HOME; --download-dir over both; --revision picks refs/<name>.
    other = _hub_cache(tmp_path / "hub2", "acme/tiny-llama", model, commit="b" * 40, ref="v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub2"))
    assert resolve_model("acme/tiny-llama", revision="v2").path == other.resolve()
    third = _hub_cache(tmp_path / "dl", "acme/tiny-llama", model, commit="c" * 40)
    assert resolve_model("acme/tiny-llama", download_dir=str(tmp_path / "dl")).path == third.resolve()
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve_model("acme/tiny-llama", revision="nope")
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve_model("acme/absent-model")


def test_pytorch_bin_checkpoint_loads_like_safetensors(tmp_path):
    st_dir = _copy_model(tmp_path, "st")
    bin_dir = _copy_model(tmp_path, "bin")
    from safetensors.torch import load_file

    state = {}
    for f in bin_dir.glob("*.safetensors"):
        state.update(load_file(f))
        f.unlink()
    (bin_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    torch.save(state, bin_dir / "pytorch_model.bin")
    kw = dict(skip_tokenizer_init=True, num_gpu_blocks_override=32, max_model_len=64)
    want = _greedy(LLM(str(st_dir), **kw), max_tokens=6, ignore_eos=True)
    assert _greedy(LLM(str(bin_dir), **kw), max_tokens=6, ignore_eos=True) == want
    assert _greedy(LLM(str(bin_dir), load_format="pt", **kw), max_tokens=6, ignore_eos=True) == want


def test_trust_remote_code_reaches_the_config_loader(tmp_path):
    model = _copy_model(tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_custom.CustomLlamaConfig"}
    cfg["model_type"] = "custom_llama"
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass CustomLlamaConfig(LlamaConfig):\n"
        "    model_type = 'custom_llama'\n"
    )
    with pytest.raises(ValueError, match="trust_remote_code"):
        resolve_model(str(model))
    assert type(resolve_model(str(model), trust_remote_code=True).hf_config).__name__ == "CustomLlamaConfig"
    config = EngineArgs(model=str(model), trust_remote_code=True, load_format="dummy").create_engine_config()
    assert type(config.model_config.hf_config).__name__ == "CustomLlamaConfig"


def test_generation_config_eos_list_and_max_new_tokens_are_applied(tmp_path):
    model = _copy_model(tmp_path)
    kw = dict(skip_tokenizer_init=True, num_gpu_blocks_override=32, max_model_len=64)
    free = _greedy(LLM(str(model), **kw), max_tokens=8, ignore_eos=True)
    stop_at = free[2]
    assert stop_at not in free[:2]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, stop_at], "max_new_tokens": 5}))
    llm = LLM(str(model), **kw)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:3] and out.finish_reason == "stop"
    assert llm.get_default_sampling_params().max_tokens == 5
    unbounded = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(unbounded[0].outputs[0].token_ids) == 5
    # --generation-config vllm: the model's file is not read.
    plain = LLM(str(model), generation_config="vllm", **kw)
    assert plain.llm_engine.model_config.generation_config == {}


def test_hf_overrides_and_quantized_checkpoints(tmp_path):
    model = _copy_model(tmp_path)
    cfg = EngineArgs(model=str(model), load_format="dummy", hf_overrides='{"rope_theta": 1234.0}').create_engine_config()
    assert cfg.model_config.hf_config.rope_theta == 1234.0
    data = json.loads((model / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="quantized with 'awq'"):
        EngineArgs(model=str(model)).create_engine_config()


def test_seed_beyond_64_bits_is_refused_at_validation():
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(seed=2**70)
    SamplingParams(seed=2**64 - 1)


def test_offline_outputs_carry_scheduling_times():
    path, _ = tiny_model("llama3")
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=32, max_model_len=64)
    m = llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[1].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
