"""The embedded SmolLM2-135M-Instruct Q4_1 GGUF: config, tokenizer, and weights checked against transformers.

The transformers reference uses transformers' own pieces (the meta-device model for names and shapes,
gguf-py's HF<->GGUF name table, `LlamaTensorProcessor` for the q/k un-permute) on tensors read with a
stock `gguf.GGUFReader`. `load_gguf_checkpoint` as a whole gives the same result for all 272 tensors
but needs ~20 s on two cores, mostly mapping names through 300 nested `state_dict()` calls.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from pagedllm.loader import get_tokenizer, iter_weights, resolve_model
from pagedllm.loader.gguf_cache import gguf_cache_dir
from pagedllm.loader.source import DEFAULT_MODEL_FILE, ModelSource

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def weights(source: ModelSource) -> dict[str, torch.Tensor]:
    return dict(iter_weights(source, use_tqdm=False))


@pytest.fixture(scope="module")
def stock_reader(source: ModelSource) -> gguf.GGUFReader:
    return gguf.GGUFReader(source.path)


def test_resolves_embedded_model(source: ModelSource) -> None:
    assert source.kind == "gguf"
    assert source.path.name == DEFAULT_MODEL_FILE and source.path.is_file()
    assert source.tokenizer_path == source.path
    assert source.default_name == "SmolLM2-135M-Instruct"
    config = source.hf_config
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    # the config came through transformers once and is cached for the next start
    assert (gguf_cache_dir(source.path, "config") / "config.json").is_file()


def test_alias_resolves_to_embedded_model(source: ModelSource) -> None:
    alias = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert alias.path == source.path and alias.default_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model(str(source.path)).path == source.path
    assert resolve_model(str(source.path.parent)).path == source.path  # the only .gguf in that directory


def test_tokenizer_round_trip_and_chat_template(source: ModelSource) -> None:
    tok = get_tokenizer(source)
    ids = tok(PROMPT).input_ids
    assert ids == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.decode(ids) == PROMPT
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    assert (gguf_cache_dir(source.path, "tokenizer") / "tokenizer.json").is_file()
    # an explicit tokenizer argument (the .gguf file) gives the same tokenizer
    assert get_tokenizer(source, tokenizer=str(source.path))(PROMPT).input_ids == ids


def test_names_and_shapes_match_transformers(source: ModelSource, weights: dict[str, torch.Tensor]) -> None:
    with torch.device("meta"):
        reference = LlamaForCausalLM(source.hf_config).state_dict()
    # tied embeddings: the GGUF has no output.weight, transformers' lm_head shares the embedding
    reference.pop("lm_head.weight")
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert tensor.shape == reference[name].shape, name
        assert tensor.dtype == torch.float32, name


def test_gguf_names_match_gguf_py_table(
    weights: dict[str, torch.Tensor], stock_reader: gguf.GGUFReader
) -> None:
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    expected = set()
    for hf_name in weights:
        base, _, suffix = hf_name.rpartition(".")
        expected.add(f"{table.get_name(base)}.{suffix}")
    assert expected == {t.name for t in stock_reader.tensors}


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),  # Q4_1, un-permuted, 9 heads
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),  # Q4_1, un-permuted, 3 heads
        ("blk.29.attn_q.weight", "model.layers.29.self_attn.q_proj.weight"),
        ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight"),
        ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
        ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),  # F32
        ("output_norm.weight", "model.norm.weight"),
    ],
)
def test_values_match_transformers(
    source: ModelSource,
    weights: dict[str, torch.Tensor],
    stock_reader: gguf.GGUFReader,
    gguf_name: str,
    hf_name: str,
) -> None:
    tensor = next(t for t in stock_reader.tensors if t.name == gguf_name)
    processor = LlamaTensorProcessor(config=source.hf_config.to_dict())
    expected = processor.process(gguf.dequantize(tensor.data, tensor.tensor_type), gguf_name).weights
    assert torch.equal(weights[hf_name], torch.from_numpy(expected.copy()))
    if "attn_q" in gguf_name or "attn_k" in gguf_name:
        # the un-permute really moved rows: the raw GGUF order differs from the HF order
        raw = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
        assert not torch.equal(weights[hf_name], raw)
