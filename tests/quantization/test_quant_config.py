"""`quantization=` and config.json's quantization_config: what is refused at start (with its name),
and malformed quantized checkpoints failing at load naming the tensor and what was expected."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.loader.model_loader import load_model
from tests.quantization import quant_ckpt as qc
from tests.utils import tiny_model


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama3")


@pytest.fixture(scope="module")
def gptq(base):
    return qc.gptq_checkpoint(base[1], 4, 32)[0]


@pytest.fixture(scope="module")
def fp8(base):
    return qc.fp8_checkpoint(base[1], per_channel=False, static=True)[0]


@pytest.fixture(scope="module")
def fp8_block(base):
    return qc.fp8_block_checkpoint(base[1], (32, 48))[0]


def _load(path, **kwargs):
    config = EngineArgs(model=str(path), skip_tokenizer_init=True, **kwargs).create_engine_config()
    return load_model(config.model_config, torch.device("cpu"))


def _variant(src: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of checkpoint `src` with its tensors and/or quantization_config edited."""
    dst = Path(tempfile.mkdtemp(prefix="pagedllm-bad-"))
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("name", "message"), [
    ("foo", "unknown quantization method 'foo'"),
    ("bitsandbytes", "'bitsandbytes' is not built"),
    ("modelopt", "'modelopt' is not built"),
])
def test_unbuilt_methods_refused_by_name(base, name, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=base[0], quantization=name).create_engine_config()


def test_method_must_match_the_checkpoint(gptq):
    with pytest.raises(ValueError, match=r"model config \(gptq\) does not match .* argument \(awq\)"):
        EngineArgs(model=str(gptq), quantization="awq").create_engine_config()
    # vLLM's kernel-named spelling of the same method is accepted.
    assert EngineArgs(model=str(gptq), quantization="gptq_marlin").create_engine_config().model_config.quantization \
        == "gptq"


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: c.update(bits=3), "GPTQ with 3-bit weights is not built"),
    (lambda c: c.update(dynamic={"-:.*down_proj": {}}), "'dynamic' overrides are not built"),
    (lambda c: c.update(quant_method="awq", version="gemv"), "AWQ version 'gemv' is not built"),
    # block-wise scales are built for dynamic activations only (vLLM's rule), and need [block_n, block_k]
    (lambda c: c.update(quant_method="fp8", activation_scheme="static", weight_block_size=[128, 128]),
     r"weight_block_size=\[128, 128\] .* needs activation_scheme 'dynamic', got 'static'"),
    (lambda c: c.update(quant_method="fp8", weight_block_size=[128]),
     r"weight_block_size must be \[block_n, block_k\], two positive ints, got \[128\]"),
    (lambda c: c.update(quant_method="fp8", weight_block_size=[0, 128]), r"two positive ints, got \[0, 128\]"),
    (lambda c: c.update(quant_method="fp8", weight_block_size=[128.0, 128]), r"got \[128.0, 128\]"),
    (lambda c: c.update(quant_method="fp8", activation_scheme="per_token"), "activation_scheme"),
    (lambda c: c.update(group_size=24), "group_size must be -1"),
])
def test_unbuilt_schemes_refused_at_start(gptq, edit, message):
    bad = _variant(gptq, edit_config=edit)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(bad)).create_engine_config()


def test_compressed_tensors_unbuilt_scheme_named(base):
    path, _ = qc.ct_checkpoint(base[1], "W4A16")

    def to_w4a8(c):
        c["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    bad = _variant(path, edit_config=to_w4a8)
    with pytest.raises(ValueError, match=r"weights int4 group sym, input activations int8 token sym dynamic"):
        EngineArgs(model=str(bad)).create_engine_config()


@pytest.mark.parametrize(("edit", "message"), [
    (lambda g: g["input_activations"].update(dynamic=False), "is not built; compressed-tensors block-wise"),
    (lambda g: g["input_activations"].update(group_size=16), r"activation group 16\) is not built"),
    (lambda g: g["input_activations"].update(strategy="token"), "is not built; compressed-tensors block-wise"),
    (lambda g: g["weights"].update(block_structure=[32]), r"two positive ints, got \[32\]"),
    (lambda g: g["weights"].update(type="int"), "is not built; compressed-tensors block-wise"),
])
def test_compressed_tensors_fp8_block_refusals(base, edit, message):
    path, _ = qc.ct_checkpoint(base[1], "FP8_BLOCK", block=(32, 32))
    EngineArgs(model=str(path)).create_engine_config()  # the checkpoint as written loads
    bad = _variant(path, edit_config=lambda c: edit(c["config_groups"]["group_0"]))
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(bad)).create_engine_config()


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name, fn):
    def edit(t):
        t[name] = fn(t[name])
    return edit


@pytest.mark.parametrize(("which", "edit", "message"), [
    ("gptq", _drop("model.layers.1.mlp.down_proj.scales"),
     r"parameters without weights: \['model.layers.1.mlp.down_proj.scales'\]"),
    ("gptq", _drop("model.layers.0.self_attn.k_proj.qzeros"),
     r"model.layers.0.self_attn.qkv_proj.qzeros \(has shards \['q', 'v'\]\)"),
    ("gptq", _reshape("model.layers.0.self_attn.q_proj.scales", lambda s: s[:1]),
     r"'model.layers.0.self_attn.q_proj.scales'.*has shape \(1, 64\), expected \(2, 64\)"),
    # 8-bit packing in a checkpoint that says 4 bits: qweight has K/4 rows, not K/8.
    ("gptq", _reshape("model.layers.0.mlp.down_proj.qweight", lambda q: torch.cat([q, q])),
     r"'model.layers.0.mlp.down_proj.qweight'.*shape \(32, 64\), expected 16 along dim 0"),
    ("gptq", _reshape("model.layers.0.mlp.up_proj.qweight", lambda q: q.float()),
     r"'model.layers.0.mlp.up_proj.qweight'.*dtype float32, expected int32"),
    ("fp8", _reshape("model.layers.0.self_attn.o_proj.weight", lambda w: w.to(torch.bfloat16)),
     r"model.layers.0.self_attn.o_proj.weight: .*dtype bfloat16, expected float8_e4m3fn"),
    ("fp8", _drop("model.layers.0.mlp.gate_proj.input_scale"),
     r"model.layers.0.mlp.gate_up_proj.input_scale \(has shards \['1'\]\)"),
    ("fp8", _reshape("model.layers.0.mlp.down_proj.weight_scale", lambda s: torch.ones(3)),
     r"model.layers.0.mlp.down_proj.weight_scale: .*shape \(3,\), expected a per-tensor scale"),
    # block-wise fp8 (block (32, 48)): o_proj's scale grid is (2, 2), k_proj's (1, 2), up_proj's (4, 2),
    # down_proj's (2, 3)
    ("fp8_block", _drop("model.layers.0.self_attn.k_proj.weight_scale_inv"),
     r"model.layers.0.self_attn.qkv_proj.weight_scale_inv \(has shards \['q', 'v'\]\)"),
    ("fp8_block", _drop("model.layers.1.mlp.down_proj.weight_scale_inv"),
     r"parameters without weights: \['model.layers.1.mlp.down_proj.weight_scale_inv'\]"),
    ("fp8_block", _reshape("model.layers.0.self_attn.o_proj.weight_scale_inv", lambda s: s[:, :1].contiguous()),
     r"model.layers.0.self_attn.o_proj.weight_scale_inv: checkpoint tensor has shape \(2, 1\), expected \(2, 2\) "
     r"\(one scale per \(32, 48\) block of the \(64, 64\) weight\)"),
    ("fp8_block", _reshape("model.layers.0.self_attn.k_proj.weight_scale_inv", lambda s: torch.cat([s, s])),
     r"'model.layers.0.self_attn.k_proj.weight_scale_inv'.*shape \(2, 2\), expected 1 along dim 0.*"
     r"counted in \(32, 48\) weight blocks"),
    ("fp8_block", _reshape("model.layers.0.mlp.up_proj.weight_scale_inv", lambda s: s[:, :1].contiguous()),
     r"'model.layers.0.mlp.up_proj.weight_scale_inv'.*shape \(4, 1\), expected \(4, 2\)"),
    ("fp8_block", _reshape("model.layers.0.mlp.down_proj.weight_scale_inv", lambda s: s.to(torch.int32)),
     r"model.layers.0.mlp.down_proj.weight_scale_inv: .*dtype int32, expected float32"),
    ("fp8_block", _reshape("model.layers.0.mlp.gate_proj.weight", lambda w: w.to(torch.bfloat16)),
     r"model.layers.0.mlp.gate_up_proj.weight: .*dtype bfloat16, expected float8_e4m3fn"),
])
def test_malformed_checkpoints_name_the_tensor(gptq, fp8, fp8_block, which, edit, message):
    bad = _variant({"gptq": gptq, "fp8": fp8, "fp8_block": fp8_block}[which], edit_tensors=edit)
    with pytest.raises(ValueError, match=message):
        _load(bad)


def test_ct_weight_shape_checked(base):
    path, _ = qc.ct_checkpoint(base[1], "W4A16")
    bad = _variant(path, edit_tensors=_reshape("model.layers.0.mlp.down_proj.weight_shape",
                                               lambda s: torch.tensor([64, 256])))
    with pytest.raises(ValueError, match=r"down_proj.weight_shape: checkpoint says the weight is \[64, 256\], "
                                         r"expected \[64, 128\]"):
        _load(bad)


def test_online_fp8_and_dummy_quantized_layouts(base, gptq):
    """Online fp8 keeps only fp8 weights; dummy weights take each method's quantized layout (from the
    checkpoint's quantization_config, or the method's defaults when it has none)."""
    model = _load(base[0], quantization="fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (qkv.weight.shape[0],)
    awq = _variant(gptq, edit_config=lambda c: c.update(quant_method="awq", version="gemm", zero_point=True))
    for path, method, param in [(awq, None, "wna16_qweight"), (gptq, None, "wna16_qweight"),
                                (base[0], "compressed-tensors", "weight")]:
        model = _load(path, quantization=method, load_format="dummy")
        layer = model.model.layers[0].mlp.down_proj
        tensor = getattr(layer, param)
        assert tensor.dtype in (torch.int32, torch.int8) and tensor.unique().numel() > 8, method
        out = layer(torch.randn(3, 128))
        assert out.shape == (3, 64) and torch.isfinite(out).all()


def test_gptq_v2_stores_zero_points_without_the_offset(base, gptq):
    from pagedllm.quantization.wna16 import unpack_int32

    def to_v2(tensors):
        for name in [n for n in tensors if n.endswith(".qzeros")]:
            true_zero = unpack_int32(tensors[name], 4, dim=1) + 1  # v1 stores zero - 1
            tensors[name] = qc.gptq_pack_qzeros(true_zero + 1, 4)  # the packer subtracts 1: stores zero
    v2 = _variant(gptq, edit_tensors=to_v2, edit_config=lambda c: c.update(checkpoint_format="gptq_v2"))
    x = torch.randn(3, 64)
    a, b = _load(gptq).model.layers[0].self_attn.qkv_proj, _load(v2).model.layers[0].self_attn.qkv_proj
    assert torch.equal(a.wna16_zeros, b.wna16_zeros) and torch.equal(a(x), b(x))


def test_fp8_block_partitions_must_be_whole_blocks(fp8_block):
    # block_n 48: qkv_proj's q shard (64 rows) would put rows 48..63 and k's first rows under one scale
    bad = _variant(fp8_block, edit_config=lambda c: c.update(weight_block_size=[48, 32]))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj: output partition 64 \(of partitions "
                                         r"\[64, 32, 32\]\) is not a multiple of the fp8 weight block's block_n 48"):
        _load(bad)
    from pagedllm.quantization.fp8 import Fp8Config

    with pytest.raises(ValueError, match=r"weight_block_size=\[128, 128\] needs fp8 weights in the checkpoint"):
        Fp8Config(is_checkpoint_fp8_serialized=False, weight_block_size=[128, 128])


def _tp(monkeypatch, rank: int, size: int) -> None:
    """Layers built after this see TP rank `rank` of `size` (their loaders slice for it; no collectives run)."""
    import pagedllm.layers.linear as linear

    monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: size)


def test_fp8_block_tensor_parallel_slices(monkeypatch):
    """At TP 2, rank 1 of a merged column layer takes its shards' scale rows, a row-parallel layer its scale
    columns; a rank's inputs or rows that are not whole blocks are refused naming the layer."""
    from pagedllm.kernels.fp8_block_gemm import fp8_block_linear_ref
    from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from pagedllm.quantization.fp8 import Fp8Config

    cfg = Fp8Config(weight_block_size=[32, 64])
    _tp(monkeypatch, 1, 2)
    gen = torch.Generator().manual_seed(0)

    def ckpt(n, k):
        q = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
        return q, torch.rand(-(-n // 32), -(-k // 64), generator=gen) + 0.5

    gate_up = MergedColumnParallelLinear(200, [128, 128], bias=False, quant_config=cfg, prefix="mlp.gate_up_proj")
    (gq, gs), (uq, us) = ckpt(128, 200), ckpt(128, 200)
    for shard, (q, s) in enumerate([(gq, gs), (uq, us)]):
        gate_up.weight.weight_loader(gate_up.weight, q, shard)
        gate_up.weight_scale_inv.weight_loader(gate_up.weight_scale_inv, s, shard)
    gate_up.quant_method.process_weights_after_loading(gate_up)
    # rank 1's rows 64..127 of each shard: scale rows 2..3 of each; the 200 inputs (4 blocks, the last ragged) whole
    assert torch.equal(gate_up.weight_scale_inv, torch.cat([gs[2:], us[2:]]))
    assert torch.equal(gate_up.weight.view(torch.uint8), torch.cat([gq[64:], uq[64:]]).view(torch.uint8))
    x = torch.randn(3, 200)
    torch.testing.assert_close(gate_up(x), fp8_block_linear_ref(x, gate_up.weight, gate_up.weight_scale_inv, (32, 64)))

    down = RowParallelLinear(256, 96, bias=False, quant_config=cfg, prefix="mlp.down_proj")
    dq, ds = ckpt(96, 256)
    down.weight.weight_loader(down.weight, dq)
    down.weight_scale_inv.weight_loader(down.weight_scale_inv, ds)
    assert torch.equal(down.weight_scale_inv, ds[:, 2:])  # inputs 128..255: scale columns 2..3

    with pytest.raises(ValueError, match=r"mlp.down_proj: this rank's input partition of 96 \(of 192\) is not a "
                                         r"multiple of the fp8 weight block's block_k 64"):
        RowParallelLinear(192, 96, bias=False, quant_config=cfg, prefix="mlp.down_proj")
    with pytest.raises(ValueError, match=r"mlp.gate_up_proj: output partition 48 .* block_n 32"):
        MergedColumnParallelLinear(200, [96, 96], bias=False, quant_config=cfg, prefix="mlp.gate_up_proj")


def test_fp8_block_scale_never_loaded_is_named():
    # A loader that skipped a scale (not every model's loader checks completeness) leaves NaN blocks: found
    # after loading, naming the tensor. An unsplit layer takes a ragged grid whole (100 rows: 2 scale rows).
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.quantization.fp8 import Fp8Config

    layer = ReplicatedLinear(200, 100, bias=False, quant_config=Fp8Config(weight_block_size=[64, 48]), prefix="proj")
    assert layer.weight_scale_inv.shape == (2, 5)
    with pytest.raises(ValueError, match=r"proj.weight_scale_inv: block scales are missing after loading"):
        layer.quant_method.process_weights_after_loading(layer)
    layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, torch.ones(2, 5, dtype=torch.bfloat16))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight_scale_inv.dtype == torch.float32 and bool((layer.weight_scale_inv == 1).all())
