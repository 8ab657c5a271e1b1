"""resolve_model + get_tokenizer + iter_weights on a tiny GGUF, with an empty cache: the build paths."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pagedllm.loader import get_tokenizer, iter_weights, resolve_model
from pagedllm.loader import tokenizer as tokenizer_mod
from pagedllm.loader.gguf_cache import gguf_cache_dir

TEXT = "hello world, or hello"


@pytest.fixture
def tiny_llama_gguf(tmp_path: Path, gguf_writer: Callable) -> tuple[Path, LlamaForCausalLM]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=263,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    path = gguf_writer(tmp_path / "tiny.gguf", "llama", model.state_dict(), config, True)
    return path, model


def test_config_generation_config_and_cache(
    tiny_llama_gguf: tuple[Path, LlamaForCausalLM], isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, model = tiny_llama_gguf
    src = resolve_model(str(path))
    assert src.kind == "gguf" and src.path == path.resolve() and src.tokenizer_path == path.resolve()
    assert src.default_name == str(path)
    cfg = src.hf_config
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        2,
        64,
        4,
        2,
    )
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.max_position_embeddings) == (263, 96, 512)
    assert not cfg.tie_word_embeddings  # output.weight is in the file
    # the same config transformers makes from the file, plus `architectures`
    reference = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    reference.update(architectures=["LlamaForCausalLM"], _name_or_path=str(path.resolve()))
    assert cfg.to_dict() == reference
    # llama.cpp's general.sampling.* keys under HF names; 0.7 stored as float32 comes back as 0.7
    assert src.generation_config == {"temperature": 0.7, "top_k": 7}

    entry = gguf_cache_dir(path, "config")
    assert entry.is_relative_to(isolated_cache) and (entry / "config.json").is_file()

    # second time: from the cache, without transformers' GGUF parse
    def no_gguf_parse(*args, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError("config rebuilt from the GGUF although it is cached")
        return real(*args, **kwargs)

    real = AutoConfig.from_pretrained
    monkeypatch.setattr(AutoConfig, "from_pretrained", no_gguf_parse)
    again = resolve_model(str(path))
    assert again.hf_config.to_dict() == cfg.to_dict() and again.generation_config == src.generation_config

    # weights through the resolved source: all tensors back, q/k un-permuted
    loaded = dict(iter_weights(again, use_tqdm=False))
    for name, ref in model.state_dict().items():
        assert torch.equal(loaded[name], ref), name


def test_tokenizer_matches_auto_tokenizer_and_is_cached(
    tiny_llama_gguf: tuple[Path, LlamaForCausalLM], isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_llama_gguf
    src = resolve_model(str(path))
    tok = get_tokenizer(src)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tok(TEXT).input_ids
    assert ids == reference(TEXT).input_ids
    assert tok.decode(ids) == TEXT
    assert tok.convert_ids_to_tokens(ids[:2]) == ["he", "ll"]  # the file's merges are used
    assert (
        (tok.bos_token, tok.eos_token)
        == (reference.bos_token, reference.eos_token)
        == ("<|im_start|>", "<|im_end|>")
    )
    assert tok.chat_template == reference.chat_template and "<|im_start|>" in tok.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (gguf_cache_dir(path, "tokenizer") / "tokenizer.json").is_file()

    real = tokenizer_mod.PreTrainedTokenizerFast.from_pretrained

    def no_build(*args, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError("tokenizer rebuilt from the GGUF although it is cached")
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer_mod.PreTrainedTokenizerFast, "from_pretrained", no_build)
    cached = get_tokenizer(src)
    assert cached(TEXT).input_ids == ids and cached.chat_template == tok.chat_template


def test_chat_template_restored_when_transformers_drops_it(
    tiny_llama_gguf: tuple[Path, LlamaForCausalLM], isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers before 4.46 built GGUF tokenizers without `tokenizer.chat_template`
    path, _ = tiny_llama_gguf
    real = tokenizer_mod.PreTrainedTokenizerFast.from_pretrained

    def without_template(*args, **kwargs):
        tok = real(*args, **kwargs)
        tok.chat_template = None
        return tok

    monkeypatch.setattr(tokenizer_mod.PreTrainedTokenizerFast, "from_pretrained", without_template)
    tok = get_tokenizer(resolve_model(str(path)))
    assert tok.chat_template and tok.chat_template.startswith("{% for m in messages %}")


def test_explicit_tokenizer_argument(
    tiny_llama_gguf: tuple[Path, LlamaForCausalLM], isolated_cache: Path
) -> None:
    path, _ = tiny_llama_gguf
    preset = resolve_model("qwen3-0.6b")
    tok = get_tokenizer(preset, tokenizer=str(path))  # a preset with a tokenizer given explicitly
    assert tok(TEXT).input_ids[:2] == tok.convert_tokens_to_ids(["he", "ll"])
    with pytest.raises(ValueError, match="does not exist"):
        get_tokenizer(preset, tokenizer=str(path.parent / "nope"))
