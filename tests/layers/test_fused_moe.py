"""Expert routing and the FusedMoE layer: selection rules, weight loading, the quantization hook."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.fused_moe import FusedMoE, FusedMoEMethodBase, select_experts
from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref
from pagedllm.layers.linear import UnquantizedLinearMethod


def test_softmax_topk_worked_example():
    w, ids = select_experts(torch.tensor([[2.0, 1.0, 0.0, 1.0]]), 2, renormalize=True)
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int32
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0, 1.0]), -1)
    torch.testing.assert_close(w, (p[[0, 1]] / p[[0, 1]].sum())[None])
    w_raw, _ = select_experts(torch.tensor([[2.0, 1.0, 0.0, 1.0]]), 2, renormalize=False)
    torch.testing.assert_close(w_raw, p[[0, 1]][None])


def test_grouped_sigmoid_routing_picks_only_from_best_groups():
    # 8 experts in 4 groups of 2; the bias makes group 3 the best even though expert 0 scores highest.
    logits = torch.tensor([[3.0, -3.0, 0.0, 0.0, 0.1, 0.1, 1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    w, ids = select_experts(logits, 2, renormalize=True, scoring_func="sigmoid", num_expert_group=4, topk_group=1,
                            e_score_correction_bias=bias, routed_scaling_factor=2.5)
    assert sorted(ids[0].tolist()) == [6, 7]
    s = logits.sigmoid()[0, [6, 7]]
    torch.testing.assert_close(w[0], s / s.sum() * 2.5)  # weights from the unbiased scores
    # Softmax + group max (DeepSeek-V2 group_limited_greedy): best 2 groups are {0, 3}.
    _, ids = select_experts(logits, 3, renormalize=False, num_expert_group=4, topk_group=2)
    assert set(ids[0].tolist()) <= {0, 1, 6, 7}


def test_bad_routing_arguments_are_refused():
    with pytest.raises(ValueError, match="scoring_func"):
        select_experts(torch.zeros(1, 4), 2, True, scoring_func="relu")
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.zeros(1, 4), 5, True)


def test_expert_weights_load_per_expert_and_match_a_loop():
    torch.manual_seed(0)
    layer = FusedMoE(3, 2, hidden_size=8, intermediate_size=6, prefix="model.layers.0.mlp.experts")
    experts = [{k: torch.randn(*s) for k, s in (("w1", (6, 8)), ("w3", (6, 8)), ("w2", (8, 6)))} for _ in range(3)]
    params = dict(layer.named_parameters())
    for _, ckpt, (e, shard) in FusedMoE.make_expert_params_mapping("w1", "w2", "w3", 3):
        name = "w2_weight" if shard == "w2" else "w13_weight"
        assert ckpt == f".experts.{e}.{shard}."
        params[name].weight_loader(params[name], experts[e][shard], (e, shard))
    x, logits = torch.randn(5, 8), torch.randn(5, 3)
    out = layer(x, logits)
    w, ids = select_experts(logits, 2, True)
    ref = torch.zeros(5, 8)
    for t in range(5):
        for j in range(2):
            ex = experts[int(ids[t, j])]
            ref[t] += w[t, j] * ((torch.nn.functional.silu(x[t] @ ex["w1"].T) * (x[t] @ ex["w3"].T)) @ ex["w2"].T)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_experts_ref(x, layer.w13_weight, layer.w2_weight, w, ids), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shape"):
        layer.weight_loader(layer.w2_weight, torch.zeros(8, 5), (0, "w2"))
    with pytest.raises(ValueError, match="out of range"):
        layer.weight_loader(layer.w2_weight, torch.zeros(8, 6), (3, "w2"))


class _Cfg:
    """A quantization config whose answer for the experts is chosen by the test."""

    def __init__(self, method):
        self.method = method

    def get_name(self):
        return "test-quant"

    def get_quant_method(self, layer, prefix):
        return self.method


def test_quant_hook_takes_a_moe_method_and_refuses_a_linear_one():
    class Doubling(FusedMoEMethodBase):
        def create_weights(self, layer, num_experts, hidden_size, inter, params_dtype, **attrs):
            layer.register_parameter("w13_weight", torch.nn.Parameter(torch.ones(num_experts, 2 * inter, hidden_size)))
            layer.register_parameter("w2_weight", torch.nn.Parameter(torch.ones(num_experts, hidden_size, inter)))

        def apply(self, layer, x, topk_weights, topk_ids):
            return 2 * x

    layer = FusedMoE(2, 1, 4, 4, quant_config=_Cfg(Doubling()), prefix="p")
    torch.testing.assert_close(layer(torch.ones(1, 4), torch.zeros(1, 2)), 2 * torch.ones(1, 4))
    with pytest.raises(ValueError, match="test-quant.*no method for MoE experts"):
        FusedMoE(2, 1, 4, 4, quant_config=_Cfg(UnquantizedLinearMethod()), prefix="p")


def test_fused_shared_experts_equal_the_shared_mlp():
    # A shared MLP of 2 * inter loaded as experts E, E + 1 of the fused MoE: the same output as the
    # routed experts plus the separate MLP (DeepSeek's shared experts, models/deepseek_v2.py).
    from pagedllm.models.llama import LlamaMLP

    g = torch.Generator().manual_seed(5)
    e, hidden, inter, top_k = 4, 16, 8, 2
    moe = FusedMoE(e, top_k, hidden, inter, renormalize=False, routed_scaling_factor=1.5)
    fused = FusedMoE(e, top_k, hidden, inter, renormalize=False, routed_scaling_factor=1.5,
                     num_fused_shared_experts=2)
    mlp = LlamaMLP(hidden, 2 * inter, "silu")
    ckpt = {f"experts.{i}.{p}.weight": torch.randn(shape, generator=g) for i in range(e)
            for p, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))}
    shared = {f"shared_experts.{p}.weight": torch.randn(shape, generator=g) for p, shape in
              (("gate_proj", (2 * inter, hidden)), ("up_proj", (2 * inter, hidden)), ("down_proj", (hidden, 2 * inter)))}
    mlp.gate_up_proj.weight.data.copy_(torch.cat([shared["shared_experts.gate_proj.weight"],
                                                  shared["shared_experts.up_proj.weight"]]))
    mlp.down_proj.weight.data.copy_(shared["shared_experts.down_proj.weight"])
    pieces = [p for n, t in shared.items() for p in
              FusedMoE.split_shared_expert_weights(n, t, "shared_experts.", "experts.", e, 2)]
    assert sorted(n for n, _ in pieces) == sorted(f"experts.{i}.{p}.weight" for i in (4, 5)
                                                  for p in ("gate_proj", "up_proj", "down_proj"))
    shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for layer, tensors in ((moe, list(ckpt.items())), (fused, list(ckpt.items()) + pieces)):
        for name, t in tensors:
            _, i, p, _ = name.split(".")
            param = layer.w2_weight if p == "down_proj" else layer.w13_weight
            layer.weight_loader(param, t, (int(i), shard[p]))
    x, logits = torch.randn(7, hidden, generator=g), torch.randn(7, e, generator=g)
    torch.testing.assert_close(fused(x, logits), moe(x, logits) + mlp(x), atol=1e-5, rtol=1e-5)


def test_unsummed_topk_outputs_with_shared_experts_sum_to_forward(monkeypatch):
    # DeepSeek's blocks on one CUDA rank hand the next RMSNorm (T, top_k + shared, hidden) unsummed
    # outputs (models/deepseek_v2.py); their sum is forward's. The Triton kernels here run in the
    # interpreter (forced past the CUDA check), so the fp32 sums agree closely.
    from pagedllm.layers.fused_moe import layer as layer_mod

    g = torch.Generator().manual_seed(9)
    e, hidden, inter, top_k, shared = 4, 16, 16, 2, 2
    moe = FusedMoE(e, top_k, hidden, inter, renormalize=False, num_fused_shared_experts=shared)
    for p in (moe.w13_weight, moe.w2_weight):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x, logits = torch.randn(5, hidden, generator=g), torch.randn(5, e, generator=g)
    with pytest.raises(ValueError, match="unsummed"):
        moe(x, logits, sum_topk=False)  # a CPU tensor: not allowed
    monkeypatch.setattr(layer_mod.FusedMoE, "can_leave_topk_unsummed", lambda self, h: True)
    parts = moe(x, logits, sum_topk=False)
    assert parts.shape == (5, top_k + shared, hidden)
    torch.testing.assert_close(parts.sum(1), moe(x, logits), atol=1e-4, rtol=1e-4)
