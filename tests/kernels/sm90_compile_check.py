"""Compile every kernel launch the wrappers make, for an H100/H200 (sm_90), on a machine without a GPU.

The interpreter runs kernels as NumPy and so accepts code that the real compiler rejects, and it
says nothing of registers. This script calls each wrapper on bf16 CPU tensors of model shapes with
the kernels swapped for recorders (nothing runs, so big zero tensors are never touched), then
compiles each recorded launch exactly as Triton's JIT would (argument types from the values,
16-divisible pointers and ints marked so) down to a cubin with Triton's bundled ptxas, and prints
one line per distinct compiled kernel (registers, stack and shared-memory bytes). A launch that
spills registers to the stack (a slow kernel) is an error. Run as a script (TRITON_INTERPRET=0);
`test_compile_sm90.py` does.
Exit status 0 = all compiled without spills.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from pagedllm.attention.metadata import build_metadata  # noqa: E402
from pagedllm.kernels import (  # noqa: E402
    activation,
    decode_attention,
    fp8_block_gemm,
    fused_moe,
    gemv,
    kv_cache_write,
    mla_decode,
    mla_prefill,
    mla_prep,
    moe_align,
    moe_grouped_gemm,
    moe_router,
    moe_row_lists,
    moe_sum,
    paged_attention,
    qkv_prep,
    quant_act,
    rmsnorm,
    rotary,
    sampling,
    split_k,
    w8a8_gemm,
    wna16_gemm,
    wna16_gemv,
    wna16_mma,
    wna16_mma8,
    wna16_stream,
    wna16_tc,
    wna16_wgmma,
    wna16_wgmma_config,
)

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.float8_e4m3fn: "fp8e4nv",
}
_OPTION_KEYS = ("num_warps", "num_stages")


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records instead of launching."""

    def __init__(self, kernel: Any, launches: list) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((self.kernel, args, kwargs))

        return launch


def _signature(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    names = kernel.arg_names
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k not in _OPTION_KEYS}
    no_spec = {names[i] if isinstance(i, int) else i for i in getattr(kernel, "do_not_specialize", ())}
    const_names = {names[p.num] for p in kernel.params if p.is_constexpr}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = values.get(name, kernel.params[i].default)  # arguments left to their defaults
        if name in const_names or v is None:  # None arguments: constexprs, as Triton's JIT specializes them
            sig[name], consts[name] = "constexpr", v
            continue
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
            aligned = v.data_ptr() % 16 == 0
        elif isinstance(v, bool):
            sig[name], aligned = "i1", False
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            aligned = v % 16 == 0 and name not in no_spec
        else:
            sig[name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _stack_bytes(cubin: bytes) -> tuple[int, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(tok.split(":") for tok in text.split() if tok.startswith(("REG:", "STACK:")))
    return int(fields["REG"]), int(fields["STACK"])


# Recorded (so the wrappers run without a GPU) but not compiled: TMA descriptor arguments.
_NOT_COMPILED = {"_fused_moe_tma_kernel"}


def _record(launches: list) -> None:
    """Call every wrapper in the configurations a model uses."""
    for mod, name in [
        (paged_attention, "_paged_attention_kernel"),
        (split_k, "_merge_splits_kernel"),
        (kv_cache_write, "_write_kv_cache_kernel"),
        (rmsnorm, "_rms_norm_kernel"),
        (rotary, "_rotary_kernel"),
        (activation, "_silu_and_mul_kernel"),
        (qkv_prep, "_qkv_prep_kernel"),
        (sampling, "_gumbel_argmax_split_kernel"),
        (sampling, "_argmax_partials_kernel"),
        (gemv, "_skinny_linear_kernel"),
        (moe_grouped_gemm, "_fused_moe_kernel"),
        # Not compiled here (its descriptor argument has no signature type in this check): the TMA
        # prefill tile ran on the H200 and equals the torch reference there (BENCHMARKS.md, issue 24).
        (moe_grouped_gemm, "_fused_moe_tma_kernel"),
        (moe_row_lists, "_fused_moe_rows_kernel"),
        (moe_align, "_moe_rows_to_sorted_kernel"),
        # the row lists' kernel is launched from both modules (the align from lists, the row-list path)
        (moe_align, "_moe_expert_rows_kernel"),
        (moe_row_lists, "_moe_expert_rows_kernel"),
        (moe_sum, "_moe_sum_kernel"),
        (wna16_gemv, "_wna16_gemv_kernel"),
        (wna16_gemm, "_wna16_gemm_kernel"),
        (wna16_gemm, "_wna16_dequant_kernel"),
        (wna16_tc, "_wna16_tc_kernel"),
        (wna16_mma, "_wna16_mma_kernel"),
        (wna16_wgmma, "_wna16_wgmma_kernel"),
        (wna16_mma8, "_wna16_mma8_kernel"),
        (wna16_stream, "_wna16_stream_kernel"),
        (quant_act, "_quant_row_kernel"),
        (quant_act, "_scale_epilogue_kernel"),
        (decode_attention, "_decode_fused_kernel"),
        (w8a8_gemm, "_w8a8_gemm_kernel"),
        (w8a8_gemm, "_split_k_sum_kernel"),
        (fp8_block_gemm, "_per_token_group_quant_kernel"),
        (fp8_block_gemm, "_fp8_block_gemm_kernel"),
        (quant_act, "_rms_norm_quant_kernel"),
        (quant_act, "_silu_and_mul_quant_kernel"),
        (moe_align, "_moe_align_kernel"),
        (mla_decode, "_mla_decode_kernel"),
        (mla_decode, "_mla_decode_rc_kernel"),
        (mla_decode, "_mla_merge_kernel"),
        (moe_router, "_topk_softmax_kernel"),
        (mla_prefill, "_mla_prefill_kernel"),
        (mla_prep, "_mla_prep_kernel"),
    ]:
        setattr(mod, name, _Recorder(getattr(mod, name), launches))
    _record_attention_and_layers()
    _record_qkv_prep()
    _record_sampling()
    _record_gemv()
    _record_model_families()
    _record_quant()


def _record_quant() -> None:
    """Issue 19's kernels at Llama-3.1-8B's down projection (int4 g128): the dispatch's int4 GEMM
    (wna16_mma: M 8, 64, 200), the tensor-core kernel (wna16_tc: M 8 and 64; one row: wna16_stream, also
    at gate_up's 28672 x 4096), the dequantization (larger M); 8-bit weights' GEMV and tile kernel;
    W8A8's activation quantizer (int8, fp8) and scale epilogue."""
    bf16 = torch.bfloat16
    n, k = 4096, 14336
    qw = torch.zeros(k // 8, n, dtype=torch.int32)
    s, z = torch.zeros(k // 128, n, dtype=bf16), torch.zeros(k // 128, n, dtype=torch.uint8)
    wna16_gemv._workspaces[torch.device("cpu")] = (torch.zeros(1 << 23), torch.zeros(1 << 15, dtype=torch.int32))
    wna16_stream._workspaces[torch.device("cpu")] = (torch.zeros(1 << 22), torch.zeros(1 << 15, dtype=torch.int32))
    wna16_mma._workspaces[torch.device("cpu")] = (torch.zeros(1 << 23), torch.zeros(1 << 15, dtype=torch.int32))
    # Past the int4 GEMM's buckets the dispatch dequantizes and multiplies with torch: the dequant kernel is
    # recorded by the call below; a wna16_linear call there would run a (512 x 14336) @ (14336 x 4096) bf16
    # matmul on the CPU. Rows 8, 64 and 200: the GEMM's 16-, 64- and 256-row tiles of its table (200: 64-input
    # steps); the tensor-core kernel's launches with PAGEDLLM_WNA16_MMA=0's dispatch.
    for m in (1, 8, 64, 200):
        wna16_gemm.wna16_linear(torch.zeros(m, k, dtype=bf16), qw, s, z, 4, 128)
    for m in (8, 64):
        wna16_tc.wna16_tc_linear(torch.zeros(m, k, dtype=bf16), qw, s, z, 128)
    # the GPU's form of the GEMM (the inline-PTX dequantization) at the same three launches
    for m in (8, 64, 200):
        wna16_mma.wna16_mma_linear(torch.zeros(m, k, dtype=bf16), qw, s, z, 128, use_asm=True)
    # the Gluon int4 GEMM (sm_90's pick of W1's batches): every launch of its measured table, at the table's
    # largest row count for the tile (a ragged M where it is not a multiple), and one in fp16; its compile also
    # checks that the words' layout is wgmma's A operand layout (`convert_layout(..., assert_trivial=True)`)
    wna16_wgmma._workspaces[torch.device("cpu")] = (torch.zeros(1 << 23), torch.zeros(1 << 15, dtype=torch.int32))
    picks: dict[wna16_wgmma.WGMMAConfig, int] = {}
    for buckets in wna16_wgmma_config.TABLE.values():
        for rows, cfg in buckets:
            if cfg is not None:
                picks[cfg] = max(rows, picks.get(cfg, 0))
    launches = [(rows, cfg, bf16) for cfg, rows in picks.items()]
    launches.append((160, wna16_wgmma.WGMMAConfig(256, 128, 2, 8, 4, 8), torch.float16))
    for m, cfg, dt in launches:
        wna16_wgmma.wna16_wgmma_linear(torch.zeros(m, k, dtype=dt), qw, s.to(dt), z, 128, cfg)
    # the mma.sync one-row kernel (M <= 8) with and without its vector column order, bf16 and fp16; its compile
    # checks that the words' and x's layouts are mma.sync's A and B operand layouts (assert_trivial)
    wna16_mma8._workspaces[torch.device("cpu")] = (torch.zeros(1 << 22), torch.zeros(1 << 15, dtype=torch.int32))
    for cfg, dt in ((wna16_mma8.MMA8Config(128, 8, 4, True), bf16), (wna16_mma8.MMA8Config(64, 4, 2), torch.float16)):
        wna16_mma8.wna16_mma8_linear(torch.zeros(1, k, dtype=dt), qw, s.to(dt), z, 128, cfg)
    # the packed fp16 math of the one-row kernel (MATH="f16x2"), plain, with SwiGLU's activation and with
    # residual add + RMSNorm in its x prologue (the norm at qkv / gate_up's K: hidden 4096)
    for cfg in (wna16_stream.StreamConfig(64, 8, 2, MATH="f16x2", ROWS=2),
                wna16_stream.StreamConfig(64, 8, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True, SZ_TILE=True)):
        wna16_stream.wna16_stream_linear(torch.zeros(1, k, dtype=bf16), qw, s, z, 128, config=cfg)
        wna16_stream.wna16_stream_linear(torch.zeros(1, 2 * k, dtype=bf16), qw, s, z, 128, config=cfg,
                                         act="silu_and_mul")
        xk, qk = torch.zeros(1, 4096, dtype=bf16), torch.zeros(512, n, dtype=torch.int32)
        wna16_stream.wna16_stream_linear_rms_norm(xk, xk, torch.ones(4096, dtype=bf16), 1e-5, qk, s[:32], z[:32], 128,
                                                  config=cfg)
    wna16_gemm.wna16_linear(torch.zeros(1, 4096, dtype=bf16), torch.zeros(512, 28672, dtype=torch.int32),
                            torch.zeros(32, 28672, dtype=bf16), torch.zeros(32, 28672, dtype=torch.uint8), 4, 128)
    # 8-bit weights keep the FMA GEMV (M 1) and the tile kernel (M 64): the tensor-core kernel is 4-bit.
    qw8 = torch.zeros(k // 4, n, dtype=torch.int32)
    for m in (1, 64):
        wna16_gemm.wna16_linear(torch.zeros(m, k, dtype=bf16), qw8, s, z, 8, 128)
    wna16_gemm.dequantize_wna16_triton(qw, s, z, 4, 128, bf16)
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        quant_act.quantize_activation_triton(torch.zeros(2, k, dtype=bf16), qdtype)
    # The W8A8 GEMM's split-K launches at Llama-3.1-8B's down projection, fp8, 64 rows: the (64, 128, 128)
    # pointer kernel in 8 K slices and the slices' sum (two launches); the one-launch sum (SERIAL: the last
    # arrival sums the slices) on 64 / 128-row tiles; the pointer-kernel picks of w8a8_gemm.DECODE_TABLE (the
    # recorder takes no TMA descriptors, so the TMA picks are compiled on the GPU only).
    fp8 = torch.float8_e4m3fn
    decode = [c for buckets in w8a8_gemm.DECODE_TABLE.values() for _, c in buckets if c is not None and not c.TMA]
    for cfg in (w8a8_gemm.W8A8Config(64, 128, 128, 8, 4, 4, False, 8), w8a8_gemm.W8A8Config(64, 128, 128, 8, 4, 4, False, 4, True),
                w8a8_gemm.W8A8Config(128, 128, 128, 8, 8, 3, False, 2, True), *decode):
        w8a8_gemm.w8a8_gemm(torch.zeros(128, k, dtype=fp8), torch.zeros(n, k, dtype=fp8), torch.ones(128, 1),
                            torch.ones(n), None, bf16, config=cfg)
    # Block-wise FP8 (weight_block_size 128 x 128, Qwen3-8B-FP8's) at Llama-3.1-8B's o / qkv projections: the
    # per-token-group quantizer and the GEMM's three row buckets (16, 64 and 128-row tiles), one with a bias.
    for m, nn_ in ((16, 4096), (64, 6144), (256, 6144), (256, 4096)):
        qa, a_s = fp8_block_gemm.per_token_group_quant_fp8(torch.zeros(m, 4096, dtype=bf16), 128)
        fp8_block_gemm.fp8_block_gemm(qa, torch.ones(m, 32), torch.zeros(nn_, 4096, dtype=fp8), torch.ones(nn_ // 128, 32),
                                      (128, 128), bf16, torch.zeros(nn_, dtype=bf16) if nn_ == 4096 else None)
    # The fused producers of a W8A8 linear's input (layers/quant_fusion.py) at Llama-3.1-8B's widths.
    x = torch.zeros(2, 4096, dtype=bf16)
    quant_act.rms_norm_quant(x, torch.ones(4096, dtype=bf16), 1e-5, torch.float8_e4m3fn, x)
    quant_act.rms_norm_quant(x, torch.ones(4096, dtype=bf16), 1e-5, torch.float8_e4m3fn, x,  # a ScaledOutput's
                             in_scales=(torch.ones(2, 1), torch.ones(4096)))
    quant_act.silu_and_mul_quant(torch.zeros(2, 2 * k, dtype=bf16), torch.float8_e4m3fn)
    quant_act.silu_and_mul_quant(torch.zeros(2, 2 * k, dtype=bf16), torch.float8_e4m3fn,  # gate_up's ScaledOutput
                                 in_scales=(torch.ones(2, 1), torch.ones(2 * k)))
    # qkv_proj's ScaledOutput (PAGEDLLM_FP8_DEFER_SCALES, 17-256 rows) at Llama-3.1-8B's heads: the fused prep of a
    # mixed step and the fused decode step (one split and split-K) with the scales (IN_SCALES) on a bf16 cache.
    width = 48 * 128
    cos_sin, cache = rotary.build_cos_sin_cache(128, 64), torch.zeros(2, 8, 16, 8, 128, dtype=bf16)
    qkv_prep.fused_qkv_prep(torch.zeros(64, width, dtype=bf16), torch.arange(64), cos_sin, cache, torch.arange(64),
                            32, 8, 128, in_scales=(torch.ones(64, 1), torch.ones(width)))
    md_bf16 = build_metadata([1, 1], [20, 30], [[0, 1], [2, 3]], 16)
    for splits in (1, 4):
        decode_attention.decode_attention_fused(torch.zeros(2, width, dtype=bf16), torch.arange(2), cos_sin, cache,
                                                md_bf16, 0.1, 32, 8, 128, num_splits=splits,
                                                in_scales=(torch.ones(2, 1), torch.ones(width)))
    # An fp8 KV cache's decode loop (decode_attention.FP8_KV_VARIANT: fp8 wgmma, ~240 registers at Llama's heads).
    md = build_metadata([1, 1], [20, 30], [[0, 1], [2, 3]], 16)
    decode_attention.decode_attention_fused(torch.zeros(2, 48 * 128, dtype=bf16), torch.arange(2),
                                            rotary.build_cos_sin_cache(128, 64),
                                            torch.zeros(2, 8, 16, 8, 128, dtype=torch.float8_e4m3fn), md, 0.1, 32, 8,
                                            128, num_splits=1)
    quant_act.scale_epilogue(torch.zeros(32, n, dtype=torch.int32), torch.zeros(32, 1), torch.zeros(n), None, 2, bf16)


def _record_model_families() -> None:
    """Fused MoE at Qwen3-30B-A3B's expert shape (decode and prefill tiles, the align program, the
    fused router); attention with a sliding
    window + soft-cap at Gemma-2's head_dim 256; MLA's latent MQA at DeepSeek-V2's width 576."""
    bf16 = torch.bfloat16
    w13, w2 = torch.zeros(128, 2 * 768, 2048, dtype=bf16), torch.zeros(128, 2048, 768, dtype=bf16)
    # 4 / 128 / 256 tokens: the align-free decode path's three row blocks (16 / 32 / 64, _scan_config);
    # 512 and 2048: the align path's two larger tile configs of moe_grouped_gemm._config.
    for t in (4, 128, 256, 512, 2048):
        ids = (torch.arange(t * 8, dtype=torch.int32) % 128).view(t, 8)
        fused_moe.fused_experts(torch.zeros(t, 2048, dtype=bf16), w13, w2, torch.ones(t, 8), ids)
        moe_router.topk_softmax(torch.zeros(t, 128, dtype=bf16), 8, True)  # Qwen3-30B-A3B's routing
    # FP8 experts (quantization/fp8_moe.py, the kernels' W_SCALED variant) at the same shape: the row
    # lists (4 / 256 tokens), the align path's mid tile (512) and the prefill tile without TMA (8192).
    fp8 = torch.float8_e4m3fn
    q13, q2, scales = torch.zeros(128, 2 * 768, 2048, dtype=fp8), torch.zeros(128, 2048, 768, dtype=fp8), torch.ones(128)
    for t in (4, 256, 512, 8192):
        ids = (torch.arange(t * 8, dtype=torch.int32) % 128).view(t, 8)
        fused_moe.fused_experts(torch.zeros(t, 2048, dtype=bf16), q13, q2, torch.ones(t, 8), ids, w13_scale=scales,
                                w2_scale=scales)
    # The two-launch align of prefill-sized steps (PAGEDLLM_MOE_ALIGN_ROWS), 8192 tokens x 8.
    fused_moe.moe_align_block_size_rows((torch.arange(8192 * 8, dtype=torch.int32) % 128).view(8192, 8), 128, 128)
    # The next layer's residual add + RMSNorm summing the MoE block's top-8 outputs (kernels/rmsnorm.py).
    rmsnorm.rms_norm(torch.zeros(4, 8, 2048, dtype=bf16), torch.ones(2048, dtype=bf16), 1e-6, torch.zeros(4, 2048, dtype=bf16))
    moe_router.topk_softmax(torch.zeros(4, 64, dtype=bf16), 6, False)  # DeepSeek-V2-Lite's
    moe_router.topk_softmax(torch.zeros(4, 64, dtype=bf16), 6, False, num_shared=2)  # with its shared experts
    # DeepSeek-V2-Lite's experts (64 routed + 2 shared, 2048 -> 1408), top 6 + 2, decode tiles.
    w13, w2 = torch.zeros(66, 2 * 1408, 2048, dtype=bf16), torch.zeros(66, 2048, 1408, dtype=bf16)
    for t in (4, 256):
        ids = (torch.arange(t * 8, dtype=torch.int32) % 66).view(t, 8)
        fused_moe.fused_experts(torch.zeros(t, 2048, dtype=bf16), w13, w2, torch.ones(t, 8), ids)
    # The row lists with the 2 shared experts as token chunks (PAGEDLLM_MOE_SCAN_SHARED), 32 and 64 rows.
    for t, block_m in ((128, 32), (256, 64)):
        ids = torch.cat([(torch.arange(t * 6, dtype=torch.int32) % 64).view(t, 6),
                         torch.tensor([64, 65], dtype=torch.int32).expand(t, 2)], 1)
        cfg = dict(SCAN=True, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, DOWN=dict(BLOCK_N=128))
        fused_moe.fused_experts(torch.zeros(t, 2048, dtype=bf16), w13, w2, torch.ones(t, 8), ids, config=cfg,
                                shared_experts=2)
    # MLA's decode at DeepSeek-V2-Lite's latent: 256 requests (fixed 256-key partitions + the merge), 4
    # (unsplit), and the chunked kernel (PAGEDLLM_MLA_DECODE_CHUNKS=4).
    lat_cache = torch.zeros(1, 64, 16, 1, 576, dtype=bf16)
    for n in (256, 4):
        md = build_metadata([1] * n, [700] * n, [[0] * 44] * n, 16)
        md.max_seq_len = 4096 if n > 4 else 700
        for num_rc in (0, 4):
            mla_decode.mla_decode(torch.zeros(n, 16, 576, dtype=bf16), lat_cache, md, 0.1, 512, num_rc=num_rc,
                                  num_splits=1 if n == 4 else None)
    # MLA's prep at DeepSeek-V2-Lite's widths: q_pe from the q_proj rows, the latent, the cache write.
    q, lat = torch.zeros(4, 16, 192, dtype=bf16), torch.zeros(4, 576, dtype=bf16)
    mla_prep.mla_prep(torch.arange(4), q[..., 128:], torch.zeros(4, 16, 576, dtype=bf16)[..., 512:], lat,
                      torch.ones(512, dtype=bf16), 1e-6, rotary.build_cos_sin_cache(64, 16),
                      torch.zeros(1, 8, 16, 1, 576, dtype=bf16), torch.arange(4), 4)
    mixed = build_metadata([5, 1], [20, 30], [[0, 1], [2, 3]], 16)
    decode = build_metadata([1, 1], [20, 30], [[0, 1], [2, 3]], 16)
    cache = torch.zeros(2, 8, 16, 8, 256, dtype=bf16)
    for md in (mixed, decode):
        q = torch.zeros(md.num_actual_tokens, 16, 256, dtype=bf16)
        paged_attention.paged_attention(q, cache, md, 0.0625, num_splits=1, sliding_window=4096, logits_soft_cap=50.0)
    # MLA's expanded prefill at DeepSeek-V2's heads (q/k 128 + 64, v 128): q from the q_proj rows, k_pe
    # and the expanded k_nope / v as the views attention/mla_prefill.py hands in.
    q, kv, lat = torch.zeros(64, 16, 192, dtype=bf16), torch.zeros(64, 16, 256, dtype=bf16), torch.zeros(64, 576, dtype=bf16)
    mla_prefill.mla_prefill_attention(torch.zeros(64, 16, 128, dtype=bf16), torch.zeros(64, 16), q[..., :128],
                                      q[..., 128:], kv[..., :128], lat[:, 512:], kv[..., 128:],
                                      torch.zeros(1, 6, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), 0.1)
    latent = torch.zeros(1, 8, 16, 1, 576, dtype=bf16).expand(2, 8, 16, 1, 576)
    for md in (mixed, decode):
        paged_attention.paged_attention(torch.zeros(md.num_actual_tokens, 16, 576, dtype=bf16), latent, md, 0.1,
                                        num_splits=1)


def _record_attention_and_layers() -> None:
    bf16 = torch.bfloat16
    # (num_heads, num_kv_heads, head_dim): Llama-3-8B's GQA; MHA with a padded head_dim of 80.
    for heads, kv_heads, head_dim in [(32, 8, 128), (32, 32, 80)]:
        cache = torch.zeros(2, 8, 16, kv_heads, head_dim, dtype=bf16)
        mixed = build_metadata([5, 1], [20, 30], [[0, 1], [2, 3]], 16)
        decode = build_metadata([1, 1], [20, 30], [[0, 1], [2, 3]], 16)
        for md, splits in [(mixed, 1), (decode, 1), (decode, 4)]:
            q = torch.zeros(md.num_actual_tokens, heads, head_dim, dtype=bf16)
            paged_attention.paged_attention(q, cache, md, 0.1, num_splits=splits)
        kv = torch.zeros(2, kv_heads, head_dim, dtype=bf16)
        kv_cache_write.write_kv_cache(kv, kv, cache, torch.tensor([0, 1]))
    x = torch.zeros(3, 4096, dtype=bf16)
    rmsnorm.rms_norm(x, torch.ones(4096, dtype=bf16), 1e-5)
    rmsnorm.rms_norm(x, torch.ones(4096, dtype=bf16), 1e-5, residual=x)
    q, k = torch.zeros(3, 32 * 128, dtype=bf16), torch.zeros(3, 8 * 128, dtype=bf16)
    rotary.rotary_embedding(torch.arange(3), q, k, 128, rotary.build_cos_sin_cache(128, 16))
    activation.silu_and_mul(torch.zeros(3, 2 * 14336, dtype=bf16))


def _record_qkv_prep() -> None:
    # (num_heads, num_kv_heads, head_dim, q/k norms): Qwen3-0.6B (per-head q_norm/k_norm) and
    # Llama-3.1-8B (none); a decode step (T=1) and a prefill chunk (T=256). The fp32 cos/sin cache,
    # int64 positions and slots are what `Attention.forward_qkv` passes.
    bf16 = torch.bfloat16
    for heads, kv_heads, head_dim, norms in [(16, 8, 128, True), (32, 8, 128, False)]:
        cache = torch.zeros(2, 32, 16, kv_heads, head_dim, dtype=bf16)
        cos_sin = rotary.build_cos_sin_cache(head_dim, 512)
        w = torch.ones(head_dim, dtype=bf16) if norms else None
        for t in (1, 256):
            qkv = torch.zeros(t, (heads + 2 * kv_heads) * head_dim, dtype=bf16)
            positions = torch.arange(t, dtype=torch.int64)
            qkv_prep.fused_qkv_prep(qkv, positions, cos_sin, cache, positions.clone(), heads, kv_heads, head_dim,
                                    q_norm_weight=w, k_norm_weight=w)


def _record_sampling() -> None:
    # A full batch over Qwen3's vocabulary. On CPU tensors `_fast_log2` says no (the interpreter has
    # no libdevice); the GPU takes the MUFU lg2 variant, so that is the one compiled here.
    fast_log2 = sampling._fast_log2
    sampling._fast_log2 = lambda device: True
    try:
        sampling.gumbel_argmax(torch.zeros(256, 151936, dtype=torch.bfloat16), torch.ones(256), 1234)
    finally:
        sampling._fast_log2 = fast_log2


def _record_gemv() -> None:
    # Decode linears `use_skinny_linear` sends here, one per distinct `gemv_config` (its docstring):
    # (m, n, k) = Llama-8B/Qwen3 shapes for the FMA path at BLOCK_M 1, 2, 4, 8 and Qwen3's LM head
    # at m=4 on the tensor-core path. Weights are left untouched (torch.zeros is lazily mapped).
    for m, n, k in [(1, 4096, 1024), (2, 28672, 4096), (4, 1024, 3072), (8, 1024, 2048), (4, 151936, 1024)]:
        gemv.skinny_linear(torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16))


_JOBS: list = []  # (kernel, signature, constexprs, attrs, options): one per distinct compiled kernel


def _compile(i: int) -> tuple[str, int]:
    """Compile job i for sm_90: (its report line, bytes of stack). Runs in a forked worker."""
    kernel, sig, consts, attrs, options = _JOBS[i]
    source = GluonASTSource if getattr(kernel, "is_gluon", lambda: False)() else ASTSource
    compiled = triton.compile(source(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    regs, stack = _stack_bytes(compiled.asm["cubin"])
    # scalar constexprs only (a Gluon kernel's layouts and inline PTX are not shown)
    shown = {k: v for k, v in consts.items() if k.isupper() and k not in ("DOT_PRECISION",)
             and isinstance(v, (bool, int, float))}
    return (f"{kernel.fn.__name__} {shown} {options}: {regs} registers, {stack} bytes of stack, "
            f"{compiled.metadata.shared} bytes of shared memory"), stack


def main() -> int:
    launches: list = []
    _record(launches)
    seen = set()
    for kernel, args, kwargs in launches:
        if kernel.fn.__name__ in _NOT_COMPILED:
            continue
        sig, consts, attrs = _signature(kernel, args, kwargs)
        options = {k: kwargs[k] for k in _OPTION_KEYS if k in kwargs}
        # Calls that differ only in values the JIT does not specialize on (T=1 vs T=256, say) are
        # one compiled kernel: check it once.
        key = (kernel.fn.__name__, repr(sig), repr(consts), repr(attrs), repr(options))
        if key not in seen:
            seen.add(key)
            _JOBS.append((kernel, sig, consts, attrs, options))
    # The compiles are independent and CPU-bound (MLIR passes, ptxas): one forked worker per core
    # (CI's 2 cores: ~half the time). Forked, so the recorded kernels need no pickling.
    workers = max(1, min(len(_JOBS), os.cpu_count() or 1))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        results = pool.map(_compile, range(len(_JOBS)), chunksize=1)
    failures = 0
    for line, stack in results:
        print(line)
        if stack:
            print("  ^ spills registers", file=sys.stderr)
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
