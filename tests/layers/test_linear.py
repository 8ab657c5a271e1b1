"""Linear layers: weight_loader slicing (at tp 1 and with a simulated TP rank), forward, quant hook."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pagedllm.layers.linear as linear_mod
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    load_slice,
)
from pagedllm.layers.utils import set_weight_attrs
from pagedllm.quantization.base import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod


@pytest.fixture
def fake_tp(monkeypatch):
    """Build layers as if this process were `rank` of `size` TP ranks (weights only; no collectives)."""

    def set_tp(rank: int, size: int) -> None:
        monkeypatch.setattr(linear_mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(linear_mod, "get_tensor_model_parallel_world_size", lambda: size)

    return set_tp


def load(layer: nn.Module, name: str, tensor: torch.Tensor, shard_id: Any = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def test_qkv_loads_each_shard_into_its_rows_and_forwards():
    torch.manual_seed(0)
    layer = QKVParallelLinear(32, head_size=8, total_num_heads=4, total_num_kv_heads=2, bias=True)
    q, k, v = torch.randn(32, 32), torch.randn(16, 32), torch.randn(16, 32)
    qb, kb, vb = torch.randn(32), torch.randn(16), torch.randn(16)
    for shard, w, b in (("v", v, vb), ("q", q, qb), ("k", k, kb)):  # order must not matter
        load(layer, "weight", w, shard)
        load(layer, "bias", b, shard)
    assert layer.output_partition_sizes == [32, 16, 16]
    torch.testing.assert_close(layer.weight, torch.cat([q, k, v]))
    torch.testing.assert_close(layer.bias, torch.cat([qb, kb, vb]))
    x = torch.randn(5, 32)
    torch.testing.assert_close(layer(x), x @ torch.cat([q, k, v]).T + torch.cat([qb, kb, vb]))

    fused = QKVParallelLinear(32, 8, 4, 2, bias=False)
    load(fused, "weight", torch.cat([q, k, v]))  # an already fused checkpoint tensor
    torch.testing.assert_close(fused.weight, layer.weight)


@pytest.mark.parametrize(
    "heads, kv_heads, tp, rank, q_heads, kv_head",
    [
        (4, 2, 2, 1, [2, 3], [1]),  # kv heads split: rank 1 holds kv head 1
        (4, 1, 2, 1, [2, 3], [0]),  # one kv head replicated on both ranks
        (8, 2, 4, 3, [6, 7], [1]),  # 2 replicas per kv head: ranks 2, 3 share kv head 1
    ],
)
def test_qkv_tp_slicing(fake_tp, heads, kv_heads, tp, rank, q_heads, kv_head):
    fake_tp(rank, tp)
    d = 4
    layer = QKVParallelLinear(16, d, heads, kv_heads, bias=False)
    q = torch.arange(heads * d, dtype=torch.float32)[:, None].expand(-1, 16)  # row i holds value i
    kv = torch.arange(kv_heads * d, dtype=torch.float32)[:, None].expand(-1, 16)
    for shard, w in (("q", q), ("k", kv), ("v", -kv)):
        load(layer, "weight", w, shard)

    def rows(head_ids: list[int]) -> torch.Tensor:
        return torch.tensor([h * d + i for h in head_ids for i in range(d)], dtype=torch.float32)

    expected = torch.cat([rows(q_heads), rows(kv_head), -rows(kv_head)])
    torch.testing.assert_close(layer.weight[:, 0], expected)


def test_merged_column_gate_up(fake_tp):
    gate, up = torch.randn(12, 8), torch.randn(12, 8)
    layer = MergedColumnParallelLinear(8, [12, 12], bias=False)
    load(layer, "weight", up, 1)
    load(layer, "weight", gate, 0)
    torch.testing.assert_close(layer.weight, torch.cat([gate, up]))
    fused = MergedColumnParallelLinear(8, [12, 12], bias=False)
    load(fused, "weight", torch.cat([gate, up]))
    torch.testing.assert_close(fused.weight, layer.weight)

    fake_tp(1, 2)  # rank 1 of 2 holds [gate[6:12]; up[6:12]], so SiluAndMul still splits in the middle
    sharded = MergedColumnParallelLinear(8, [12, 12], bias=False)
    load(sharded, "weight", gate, 0)
    load(sharded, "weight", up, 1)
    torch.testing.assert_close(sharded.weight, torch.cat([gate[6:], up[6:]]))


def test_column_and_row_tp_slicing(fake_tp):
    w_col, b_col, w_row, b_row = torch.randn(10, 6), torch.randn(10), torch.randn(6, 10), torch.randn(6)
    fake_tp(1, 2)
    col = ColumnParallelLinear(6, 10, bias=True)
    load(col, "weight", w_col)
    load(col, "bias", b_col)
    torch.testing.assert_close(col.weight, w_col[5:])
    torch.testing.assert_close(col.bias, b_col[5:])
    row = RowParallelLinear(10, 6, bias=True)
    load(row, "weight", w_row)
    load(row, "bias", b_row)
    torch.testing.assert_close(row.weight, w_row[:, 5:])
    torch.testing.assert_close(row.bias, b_row)  # replicated; added on rank 0 only
    x = torch.randn(3, 5)
    torch.testing.assert_close(row(x), x @ w_row[:, 5:].T)

    with pytest.raises(ValueError, match="divisible"):
        ColumnParallelLinear(6, 9)


def test_tp1_forward_matches_f_linear():
    torch.manual_seed(0)
    w, b, x = torch.randn(7, 5), torch.randn(7), torch.randn(4, 5)
    for layer in (ReplicatedLinear(5, 7), ColumnParallelLinear(5, 7), RowParallelLinear(5, 7)):
        load(layer, "weight", w)
        load(layer, "bias", b)
        torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_loader_rejects_bad_input():
    layer = QKVParallelLinear(32, 8, 4, 2, bias=False)
    with pytest.raises(ValueError, match="shard id"):
        load(layer, "weight", torch.randn(32, 32), "x")
    with pytest.raises(ValueError, match="shape"):
        load(layer, "weight", torch.randn(16, 32), "q")  # q needs 32 rows
    with pytest.raises(ValueError, match="shape"):
        load(layer, "weight", torch.randn(16, 31), "k")
    merged = MergedColumnParallelLinear(8, [12, 12], bias=False)
    with pytest.raises(ValueError, match="shard id"):
        load(merged, "weight", torch.randn(12, 8), 2)
    with pytest.raises(ValueError, match="shape"):
        load(RowParallelLinear(10, 6, bias=False), "weight", torch.randn(6, 11))


def test_load_slice_addresses_packed_dims_in_packed_units():
    # 32 logical rows stored as 4 int32 rows of 8 packed values; the checkpoint fuses two such shards.
    param = nn.Parameter(torch.zeros(4, 3, dtype=torch.int32), requires_grad=False)
    set_weight_attrs(param, {"packed_dim": 0, "pack_factor": 8})
    loaded = torch.arange(8 * 3, dtype=torch.int32).view(8, 3)
    load_slice(param, loaded, dim=0, param_offset=0, size=32, loaded_offset=32, loaded_total=64, what="t")
    torch.testing.assert_close(param.data, loaded[4:])


class ScaledLinearMethod(LinearMethodBase):
    """A toy quantized method: weight stored as int8 with a per-row float scale."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                          dtype=torch.int8), requires_grad=False)
        scale = nn.Parameter(torch.empty(sum(output_partition_sizes), dtype=torch.float32), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        set_weight_attrs(scale, {"output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight.float() * layer.weight_scale[:, None], bias)


class ToyQuantConfig(QuantizationConfig):
    def get_name(self):
        return "toy"

    def get_supported_act_dtypes(self):
        return [torch.float32]

    @classmethod
    def get_min_capability(cls):
        return 0

    @staticmethod
    def get_config_filenames():
        return []

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_quant_method(self, layer, prefix):
        return ScaledLinearMethod() if prefix.endswith("gate_up_proj") else None


def test_quant_method_hook_creates_loads_and_applies_weights():
    cfg = ToyQuantConfig()
    layer = MergedColumnParallelLinear(4, [3, 3], bias=False, quant_config=cfg, prefix="mlp.gate_up_proj")
    assert isinstance(layer.quant_method, ScaledLinearMethod)
    assert isinstance(RowParallelLinear(3, 4, quant_config=cfg, prefix="mlp.down_proj").quant_method,
                      UnquantizedLinearMethod)
    gate_q, up_q = torch.randint(-5, 5, (3, 4), dtype=torch.int8), torch.randint(-5, 5, (3, 4), dtype=torch.int8)
    gate_s, up_s = torch.rand(3), torch.rand(3)
    for shard, w, s in ((0, gate_q, gate_s), (1, up_q, up_s)):
        load(layer, "weight", w, shard)
        load(layer, "weight_scale", s, shard)
    x = torch.randn(2, 4)
    expected = torch.cat([x @ (gate_q.float() * gate_s[:, None]).T, x @ (up_q.float() * up_s[:, None]).T], -1)
    torch.testing.assert_close(layer(x), expected)
    assert QuantizationConfig.get_from_keys({"bits": 4}, ["w_bit", "bits"]) == 4
    with pytest.raises(ValueError, match="w_bit"):
        QuantizationConfig.get_from_keys({}, ["w_bit"])
