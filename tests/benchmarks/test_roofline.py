"""The speed-of-light floor: the peers' figures for W1, a worked example, the shape read from HF configs."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm.benchmarks.datasets import w1_requests
from pagedllm.benchmarks.roofline import (
    DeviceSpec,
    Floor,
    ModelShape,
    decode_step_floor,
    device_spec,
    linear_weight_bytes,
    mean_decode_step_floor,
    measure_device,
    throughput_floor,
)
from pagedllm.loader.source import resolve_model

H200 = DeviceSpec(4.3e12, 790e12, "given")  # the peers' figures


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(resolve_model(name).hf_config)


def w1_floor(name: str, **kw) -> Floor:
    reqs = w1_requests()
    return throughput_floor(shape(name), [r.prompt_len for r in reqs], [r.expected_output_len for r in reqs], H200,
                            dtype_bytes=2, **kw)


@pytest.mark.parametrize("name,peers", [("qwen3-0.6b", 35793), ("llama3-8b", 12818)])
def test_w1_floor_matches_the_peers(name: str, peers: int) -> None:
    # /work/shared/peers/roofline.py: prefill chunks of 16384 tokens, then decode.
    f = w1_floor(name, max_num_batched_tokens=16384)
    assert f.output_tok_per_s == pytest.approx(peers, rel=0.01)
    assert f.output_tokens == 133966 and f.num_decode_steps == 1024  # the longest output takes 1024 steps
    # The engine's own CUDA budget (8192) changes the prefill's chunking only.
    assert w1_floor(name, max_num_batched_tokens=8192).output_tok_per_s == pytest.approx(peers, rel=0.01)


def test_fewer_resident_requests_lower_the_floor() -> None:
    full = w1_floor("qwen3-0.6b", max_num_batched_tokens=8192)
    part = w1_floor("qwen3-0.6b", max_num_batched_tokens=8192, max_num_seqs=64)
    assert part.output_tok_per_s < 0.95 * full.output_tok_per_s and part.num_decode_steps > 2 * full.num_decode_steps


def test_quantized_weights_and_kv_count_at_their_stored_size() -> None:
    ll = shape("llama3-8b")
    assert linear_weight_bytes(None, None, 2) == 2 and linear_weight_bytes("fp8", None, 2) == 1
    assert linear_weight_bytes("awq", {"bits": 4, "group_size": 128, "zero_point": True}, 2) == 0.5 + 2.5 / 128
    assert linear_weight_bytes("gptq", {"bits": 4, "group_size": 128, "sym": True}, 2) == 0.5 + 2 / 128
    ct_int8 = {"config_groups": {"g": {"weights": {"num_bits": 8, "strategy": "channel", "symmetric": True}}}}
    ct_w4 = {"config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 32,
                                                 "symmetric": False}}}}
    assert linear_weight_bytes("compressed-tensors", ct_int8, 2) == 1
    assert linear_weight_bytes("compressed-tensors", ct_w4, 2) == 0.5 + 2.5 / 32
    # fp8 halves the decoder's weights; the embedding and LM head (1.05 G parameters) stay bf16.
    assert ll.weight_bytes(2, 1.0) == ll.linear_params + 2 * ll.embedding_params
    assert ll.linear_params + ll.embedding_params == ll.params
    bf16 = decode_step_floor(ll, [128], H200)
    assert decode_step_floor(ll, [128], H200, linear_bytes=1.0) < 0.6 * bf16
    # An fp8 KV cache halves the K/V bytes of a long-context W1-like run.
    reqs = w1_requests()
    lens = [r.prompt_len for r in reqs], [r.expected_output_len for r in reqs]
    plain = throughput_floor(ll, *lens, H200, linear_bytes=1.0)
    fp8_kv = throughput_floor(ll, *lens, H200, linear_bytes=1.0, kv_dtype_bytes=1)
    assert fp8_kv.seconds < 0.95 * plain.seconds


def test_shapes_of_the_presets() -> None:
    q, ll = shape("qwen3-0.6b"), shape("llama3-8b")
    assert (q.num_layers, q.hidden_size, q.num_kv_heads, q.head_dim, q.tie_word_embeddings) == (28, 1024, 8, 128, True)
    assert q.params == pytest.approx(0.596e9, rel=1e-3) and ll.params == pytest.approx(8.03e9, rel=1e-3)
    assert q.kv_bytes_per_token(2) == 112 * 1024 and ll.kv_bytes_per_token(2) == 128 * 1024
    # Batch-1 decode step floors of the peers' table: 0.28 ms and 3.73 ms (weights over 4.3 TB/s).
    assert decode_step_floor(q, [128], H200) * 1e3 == pytest.approx(0.28, abs=0.01)
    assert decode_step_floor(ll, [128], H200) * 1e3 == pytest.approx(3.73, abs=0.01)


def test_params_count_every_matrix_of_an_hf_model() -> None:
    """params = the HF model's matrices (norms left out); untied models count the LM head too."""
    for tied in (True, False):
        cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=24, vocab_size=100, tie_word_embeddings=tied)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        matrices = {id(p): p.numel() for p in model.parameters() if p.dim() == 2}
        assert ModelShape.from_hf_config(cfg).params == sum(matrices.values())


def test_worked_example() -> None:
    """One layer of hidden 1, so every count is small enough to do by hand.

    params = 1*1 (q) + 2*1*1 (k, v) + 1*1 (o) + 3*1*1 (mlp) + 2 (tied embedding) = 9; kv/token = 2 bytes
    (1 byte dtype). Bandwidth 1 B/s and 1e9 FLOP/s: every step is bandwidth-bound, cost = bytes.
    Prompts [3, 3], outputs [1, 2], budget 4 (decode tokens first, then prompt chunks):
      step 1: A's prompt (3) + B's first prompt token: weights 9 + KV written 4 * 2 = 17
      step 2: A decodes (3 cached) + B's last 2 prompt tokens (1 cached): 9 + (3 + 1 + 1 + 2) * 2 = 23
      step 3: B decodes (3 cached): 9 + (3 + 1) * 2 = 17
      step 4: B decodes (4 cached): 9 + (4 + 1) * 2 = 19
    """
    tiny = ModelShape(1, 1, 1, 1, 1, 1, vocab_size=2, tie_word_embeddings=True)
    assert tiny.params == 9 and tiny.kv_bytes_per_token(1) == 2
    dev = DeviceSpec(1.0, 1e9, "given")
    f = throughput_floor(tiny, [3, 3], [1, 2], dev, dtype_bytes=1, max_num_batched_tokens=4)
    assert (f.num_steps, f.num_decode_steps, f.output_tokens) == (4, 2, 3)
    assert f.seconds == pytest.approx(17 + 23 + 17 + 19)
    # One request resident at a time: prefill 3, decode 1, prefill 3, decode 2 (4 cached the 2nd time).
    g = throughput_floor(tiny, [3, 3], [1, 2], dev, dtype_bytes=1, max_num_batched_tokens=4, max_num_seqs=1)
    assert g.seconds == pytest.approx((9 + 6) + (9 + 8) + (9 + 6) + (9 + 8) + (9 + 10))
    # Compute-bound instead (1 FLOP/s): 2 * params * tokens + 4 FLOPs per attended key.
    slow = DeviceSpec(1e12, 1.0, "given")
    assert decode_step_floor(tiny, [3], slow, 1) == pytest.approx(2 * 9 * 1 + 4 * 4)
    assert mean_decode_step_floor(tiny, 1, 3, 2, slow, 1) == pytest.approx(((18 + 16) + (18 + 20)) / 2)


def test_measured_cpu_device_and_overrides() -> None:
    m = measure_device("cpu")
    assert m.bandwidth > 1e8 and m.flops > 1e8 and measure_device("cpu") is m  # once per process
    assert device_spec("cpu", 4.3e12, 790e12) == H200
    half = device_spec("cpu", 4.3e12, None)
    assert half.bandwidth == 4.3e12 and half.flops == m.flops
    with pytest.raises(ValueError, match="hbm-bandwidth"):
        measure_device("tpu")
    assert torch.get_num_threads() >= 1
