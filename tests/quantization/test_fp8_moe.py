"""FP8 MoE experts (quantization/fp8_moe.py) on the CPU: tiny Mixtral and Qwen3-MoE, FP8 checkpoints in
vLLM's "fp8" layout (dynamic and static) and bf16 checkpoints with online `quantization="fp8"`
(tests/quantization/moe_fp8_ckpt.py), held to transformers on the weights dequantized (fp32).

  - the experts hold float8_e4m3fn (1 byte a weight), one fp32 scale per expert and GEMM;
  - logits of a 24-token prompt within 1e-4 of transformers with the attention linears' activation
    rounding applied by hooks (W8A8 linears; the experts are weight-only, so exact), but for at most
    2 positions where an activation's rounding flips (within 1e-2 there);
  - greedy tokens of 16 prompts x 32 through `LLM`: >= 90% of prompts equal to that exact-math
    reference over all 32 tokens, and >= 80% of positions equal to plain dequantized transformers
    (the linears' activation rounding moves near-ties); first divergences printed (pytest -s);
  - "experts-only" (attention linears in ignored_layers): plain dequantized transformers is the exact
    math, so every logit within 1e-4 and >= 90% of positions equal;
  - malformed checkpoints fail at load naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kernels.scaled_mm import FP8_DTYPE
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.loader.model_loader import load_model
from pagedllm.quantization.fp8_moe import Fp8MoEMethod
from tests.models.hf_compare import PagedRunner, hf_logits
from tests.quantization import moe_fp8_ckpt as mc
from tests.quantization import quant_ckpt as qc
from tests.quantization.test_quant_fidelity import NEW_TOKENS, NUM_PROMPTS, hf_greedy_batch

_gen = torch.Generator().manual_seed(11)
# One length (transformers generates the 16 in one batch, unpadded); the tiny models' vocabulary is 256.
PROMPTS = torch.randint(1, 256, (NUM_PROMPTS, 12), generator=_gen).tolist()
LOGIT_PROMPT = torch.randint(1, 256, (24,), generator=_gen).tolist()

VARIANTS = {
    "dynamic": lambda m: (*mc.fp8_moe_checkpoint(m, static=False), {}),
    "static": lambda m: (*mc.fp8_moe_checkpoint(m, static=True), {}),
    "online": lambda m: (*mc.online_moe_checkpoint(m), {"quantization": "fp8"}),
    # only the experts FP8 (attention in ignored_layers): plain dequantized transformers is the exact math
    "experts-only": lambda m: (*mc.fp8_moe_checkpoint(m, static=False, attention=False), {}),
}


def _load(path: str, **kwargs):
    config = EngineArgs(model=path, skip_tokenizer_init=True, dtype="float32", **kwargs).create_engine_config()
    return load_model(config.model_config, torch.device("cpu"))


def _experts(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fp8_experts_match_transformers_on_dequantized_weights(arch, variant):
    ckpt, ref, kwargs = VARIANTS[variant](mc.tiny_moe(arch))
    model = _load(ckpt, **kwargs)
    moes = _experts(model)
    assert moes
    for moe in moes:
        assert isinstance(moe.quant_method, Fp8MoEMethod)
        e = moe.num_experts
        assert moe.w13_weight.dtype == moe.w2_weight.dtype == FP8_DTYPE and moe.w13_weight.element_size() == 1
        assert moe.w13_weight_scale.shape == moe.w2_weight_scale.shape == (e,)
        assert hasattr(moe, "w13_input_scale") == (variant == "static")

    experts_only = variant == "experts-only"
    handles = [] if experts_only else qc.fake_quant_activations(ref, FP8_DTYPE,
                                                                 getattr(ref, "static_input_scales", None) or None)
    try:
        ours = PagedRunner(model).step({"a": LOGIT_PROMPT})["a"]
        per_position = (ours - hf_logits(ref, LOGIT_PROMPT)).abs().amax(1)  # (24,)
        # An activation at an e4m3 rounding boundary may round the other way after sums in another
        # order (qwen3_moe online: one position of 24 off by 8.8e-4, the rest <= 4e-6; plain
        # dequantized transformers is 0.1 away): at most 2 such positions, none off by 1e-2.
        assert (per_position <= 1e-4).sum() >= len(LOGIT_PROMPT) - (0 if experts_only else 2), per_position
        assert per_position.max() <= 1e-2, per_position
        exact = hf_greedy_batch(ref, PROMPTS, NEW_TOKENS)
    finally:
        for h in handles:
            h.remove()
    plain = hf_greedy_batch(ref, PROMPTS, NEW_TOKENS)

    llm = LLM(ckpt, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=96, max_model_len=128, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    prompts_equal = sum(g == r for g, r in zip(got, exact)) / NUM_PROMPTS
    firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), NEW_TOKENS) for r, g in zip(exact, got)]
    positions_plain = sum(a == b for r, g in zip(plain, got) for a, b in zip(r, g)) / (NUM_PROMPTS * NEW_TOKENS)
    print(f"\n{arch} {variant}: {prompts_equal:.0%} of prompts equal to the exact-math reference (first divergence "
          f"per prompt {firsts}); {positions_plain:.1%} of positions equal to plain dequantized transformers")
    assert prompts_equal >= 0.9, firsts
    # Against plain dequantized transformers the attention linears' FP8 activations (W8A8, not the
    # experts) move near-tie tokens: 89.8% on Mixtral dynamic; the FP8 linears' own tests ask 90%
    # of a dense model (test_quant_fidelity.py), where every linear is 1/2 of the compute.
    assert positions_plain >= (0.9 if experts_only else 0.8)


@pytest.fixture(scope="module")
def dynamic_mixtral() -> str:
    return mc.fp8_moe_checkpoint(mc.tiny_moe("mixtral"), static=False)[0]


def _edited(path: str, edit) -> str:
    """A copy of checkpoint `path` with its tensors passed through edit(dict) (in place)."""
    state = load_file(str(Path(path) / "model.safetensors"))
    edit(state)
    out = qc._tmpdir("moe-bad")
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((Path(path) / "config.json").read_text())
    return str(out)


EXPERT = "model.layers.1.block_sparse_moe.experts.2"


def test_missing_expert_scale_fails_naming_the_tensor(dynamic_mixtral):
    bad = _edited(dynamic_mixtral, lambda s: s.pop(f"{EXPERT}.w3.weight_scale"))
    with pytest.raises(ValueError, match=r"w13_weight_scale \(has 7 of 8 shards\), missing checkpoint tensors: "
                       r"model.layers.1.mlp.experts.2.w3.weight_scale"):
        _load(bad)


@pytest.mark.parametrize("tensor, value, match", [
    ("w1.weight_scale", torch.ones(32), r"experts.2.w1.weight_scale.*shape \(32,\).*per-channel expert scales"),
    ("w2.weight", torch.zeros(64, 100, dtype=FP8_DTYPE), r"experts.2.w2.weight.*shape"),
    ("w1.weight", torch.zeros(128, 64, dtype=torch.bfloat16), r"experts.2.w1.weight.*dtype bfloat16"),
])
def test_malformed_expert_tensors_fail_naming_the_tensor(dynamic_mixtral, tensor, value, match):
    bad = _edited(dynamic_mixtral, lambda s: s.__setitem__(f"{EXPERT}.{tensor}", value))
    with pytest.raises(ValueError, match=match):
        _load(bad)


def test_static_checkpoint_without_expert_input_scales_is_refused():
    ckpt, _ = mc.fp8_moe_checkpoint(mc.tiny_moe("mixtral"), static=True)
    bad = _edited(ckpt, lambda s: s.pop(f"{EXPERT}.w2.input_scale"))
    with pytest.raises(ValueError, match=r"experts.2.w2.input_scale"):
        _load(bad)


def test_ignored_experts_stay_dense_and_block_scales_are_refused(dynamic_mixtral):
    from pagedllm.layers.fused_moe import UnquantizedFusedMoEMethod
    from pagedllm.quantization.fp8 import Fp8Config

    cfg = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                 "ignored_layers": ["model.layers.0.mlp.experts"]})
    skipped = FusedMoE(4, 2, 16, 8, quant_config=cfg, prefix="model.layers.0.mlp.experts")
    assert type(skipped.quant_method) is UnquantizedFusedMoEMethod and skipped.w13_weight.dtype == torch.float32
    kept = FusedMoE(4, 2, 16, 8, quant_config=cfg, prefix="model.layers.1.mlp.experts")
    assert isinstance(kept.quant_method, Fp8MoEMethod) and kept.w13_weight.dtype == FP8_DTYPE
    with pytest.raises(ValueError, match="fused shared experts need unquantized experts"):
        FusedMoE(4, 2, 16, 8, num_fused_shared_experts=1, quant_config=cfg, prefix="model.layers.1.mlp.experts")
    # A block-scaled FP8 MoE checkpoint (DeepSeek-V3, Qwen3-30B-A3B-FP8) is refused when its experts are built,
    # before any weight loads (block-wise linears are built: a block the tiny attention's q / k / v rows fill
    # whole, so construction reaches the experts).
    config = json.loads((Path(dynamic_mixtral) / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [16, 16]
    bad = _edited(dynamic_mixtral, lambda s: None)
    (Path(bad) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size=\[16, 16\]: block-wise scales of MoE experts "
                                         r"\(model.layers.0.mlp.experts, a FusedMoE layer\) are not built"):
        _load(bad)


def test_w1_w3_requantized_to_the_larger_scale():
    # One expert, H = 1: w1 holds 160 at scale 0.01 (= 1.6), w3 holds 160 at 0.02 (= 3.2); after
    # loading both halves are on 0.02 and w1's 160 became 80 (still 1.6).
    from pagedllm.quantization.fp8_moe import _requantize_w13

    w13 = torch.full((1, 2, 1), 160.0).to(FP8_DTYPE)
    out, scale = _requantize_w13(w13.clone(), torch.tensor([[0.01, 0.02]]))
    assert scale.tolist() == pytest.approx([0.02])
    assert out.float().flatten().tolist() == [80.0, 160.0]


def test_fp8_unsummed_topk_outputs_sum_to_forward(monkeypatch):
    # On one CUDA rank the MoE block hands the next RMSNorm its (T, top_k, hidden) outputs unsummed
    # (FusedMoE.can_leave_topk_unsummed): the fused kernels' fp8 variant (the interpreter here, forced
    # past the CUDA check) summed equals forward's torch reference on the same experts.
    from pagedllm.quantization.fp8 import Fp8Config

    g = torch.Generator().manual_seed(4)
    e, hidden, inter, top_k = 4, 32, 16, 2
    moe = FusedMoE(e, top_k, hidden, inter, quant_config=Fp8Config(is_checkpoint_fp8_serialized=False),
                   prefix="model.layers.0.mlp.experts")
    for p in (moe.w13_weight, moe.w2_weight):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    moe.quant_method.process_weights_after_loading(moe)
    assert moe.w13_weight.dtype == FP8_DTYPE
    x, logits = torch.randn(5, hidden, generator=g), torch.randn(5, e, generator=g)
    with pytest.raises(ValueError, match="unquantized or FP8 experts"):
        moe(x, logits, sum_topk=False)  # a CPU tensor: not allowed
    monkeypatch.setattr(FusedMoE, "can_leave_topk_unsummed", lambda self, h: True)
    parts = moe(x, logits, sum_topk=False)
    assert parts.shape == (5, top_k, hidden)
    torch.testing.assert_close(parts.sum(1), moe(x, logits), atol=1e-4, rtol=1e-4)


def test_dummy_weights_with_online_fp8_give_fp8_experts():
    # `--load-format dummy --quantization fp8` (the W1 benchmark's shape runs): random experts, then
    # quantized after loading like a real bf16 checkpoint.
    ckpt, _ = mc.online_moe_checkpoint(mc.tiny_moe("qwen3_moe"))
    model = _load(ckpt, quantization="fp8", load_format="dummy")
    moes = _experts(model)
    assert moes and all(m.w13_weight.dtype == FP8_DTYPE and torch.isfinite(m.w13_weight_scale).all() for m in moes)
    logits = PagedRunner(model).step({"a": LOGIT_PROMPT})["a"]
    assert torch.isfinite(logits).all()
