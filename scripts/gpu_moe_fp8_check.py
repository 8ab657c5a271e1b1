# budget: 60 s (H200, cold Triton cache; `--only` runs a part)
"""FP8 MoE experts (quantization/fp8_moe.py, the fused MoE kernels' W_SCALED variant, W8A16) on the GPU.

    kernel   fused_experts with fp8 experts + per-expert scales at Qwen3-30B-A3B's expert shape against
             the torch reference on the same weights (dequantized per expert): decode sizes (row lists),
             mid sizes and a prefill size (the align path; FP8 leaves out the TMA tiles)
    greedy   a tiny random Qwen3-MoE saved as an FP8 checkpoint (experts fp8, vLLM's "fp8" layout;
             attention in ignored_layers), served by `LLM` on CUDA with CUDA graphs (fp32 compute), its
             greedy tokens against transformers on the dequantized weights on the CPU: >= 90% of the
             16 prompts equal over 32 tokens
    speed    Qwen3-30B-A3B's fused MoE per layer, fp8 against bf16 experts (CUDA-graph replays over two
             weight copies, so the experts come from HBM), with the floor (experts hit, read once)

    PYTHONPATH=$PWD python3 scripts/gpu_moe_fp8_check.py [--only kernel greedy speed]
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 scripts/gpu_moe_fp8_check.py --cpu   # kernel + greedy, no GPU

Exit status 1 if a check is WRONG or fails. The table last; figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # _gpu_common beside this script

FP8 = torch.float8_e4m3fn
OK = {"ok": True}


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) -> e4m3 and (E,) fp32 per-expert scales (amax / 448), the online FP8 rule."""
    s = (w.float().abs().amax((1, 2)) / 448.0).clamp(min=1e-12)
    return (w.float() / s[:, None, None]).clamp(-448, 448).to(FP8), s.contiguous()


def check_kernel(device: str = "cuda") -> None:
    """device "cpu" (--cpu): Triton's interpreter at a tiny shape in fp16 (its bf16 dot is wrong)."""
    from _gpu_common import MOE_SHAPES, record, rel_err

    from pagedllm.kernels.fused_moe import _config, _scan_config, fused_experts
    from pagedllm.layers.fused_moe.router import select_experts
    from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

    cpu = device == "cpu"
    e, top_k, hidden, inter = (8, 2, 64, 32) if cpu else MOE_SHAPES["qwen3-30b-a3b"]
    dtype = torch.float16 if cpu else torch.bfloat16
    w13 = torch.randn(e, 2 * inter, hidden, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(e, hidden, inter, device=device, dtype=dtype) * 0.02
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    del w13, w2
    for t in (1, 32) if cpu else (1, 32, 256, 1024, 8192):
        x = torch.randn(t, hidden, device=device, dtype=dtype)
        w, ids = select_experts(torch.randn(t, e, device=device), top_k, True)
        cfg = _scan_config(t * top_k, e, dtype) or _config(t * top_k, dtype)
        ref = fused_experts_ref(x, q13, q2, w, ids, s13, s2)
        # 16-bit outputs, fp32 sums in another order (a wrong scale or expert is O(1))
        err = rel_err(fused_experts(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2), ref)
        # the top-k outputs unsummed (for the next residual add + RMSNorm), summed here
        parts = fused_experts(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, sum_topk=False)
        err_parts = rel_err(parts.float().sum(1), ref)
        good = err < 2e-2 and parts.shape == (t, top_k, hidden) and err_parts < 2e-2
        OK["ok"] &= good
        record(f"fp8 fused_experts {t} tokens on {device} ({'row lists' if cfg.get('SCAN') else 'align'})",
               f"rel err {err:.1e}, unsummed {err_parts:.1e} {'OK' if good else 'WRONG'}")


def check_greedy(device: str = "cuda") -> None:
    from _gpu_common import record

    from pagedllm import LLM, SamplingParams
    from tests.quantization import moe_fp8_ckpt as mc

    t0 = time.monotonic()
    ckpt, ref = mc.fp8_moe_checkpoint(mc.tiny_moe("qwen3_moe"), static=False, attention=False)
    gen = torch.Generator().manual_seed(11)
    prompts = torch.randint(1, 256, (16, 12), generator=gen).tolist()
    with torch.no_grad():
        out = ref.generate(torch.tensor(prompts), max_new_tokens=32, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    expected = out[:, 12:].tolist()
    llm = LLM(ckpt, skip_tokenizer_init=True, dtype="float32", device=device, num_gpu_blocks_override=96,
              max_model_len=128)
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model
    experts = [m for m in model.modules() if hasattr(m, "w13_weight_scale")]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), 32) for r, g in zip(expected, got)]
    equal = sum(f == 32 for f in firsts) / len(prompts)
    good = equal >= 0.9
    dtypes = sorted({str(m.w13_weight.dtype).removeprefix("torch.") for m in experts}) or ["none FP8: WRONG"]
    good &= bool(experts) and dtypes == ["float8_e4m3fn"]
    record(f"tiny fp8 Qwen3-MoE greedy on {device} vs transformers (CPU, dequantized)",
           f"{equal:.0%} of prompts equal, first divergences {firsts}, experts {dtypes} "
           f"({time.monotonic() - t0:.0f} s) {'OK' if good else 'WRONG'}")
    OK["ok"] &= good


def check_speed() -> None:
    from _gpu_common import MOE_SHAPES, copy_bandwidth, moe_expert_weights, moe_floor_us, record, rotating_graph_us

    from pagedllm.kernels.fused_moe import fused_experts
    from pagedllm.layers.fused_moe.router import select_experts

    e, top_k, hidden, inter = MOE_SHAPES["qwen3-30b-a3b"]
    bw = copy_bandwidth()
    bf16 = [moe_expert_weights(e, hidden, inter) for _ in range(2)]
    fp8 = [(*quantize_experts(w13), *quantize_experts(w2)) for w13, w2 in bf16]
    for t in (1, 32, 128, 256, 1024, 4096):
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        w, ids = select_experts(torch.randn(t, e, device="cuda"), top_k, True)
        hit = int(torch.unique(ids).numel())
        us_bf16 = rotating_graph_us(lambda i, x=x, w=w, ids=ids: fused_experts(x, *bf16[i], w, ids), 2)
        us_fp8 = rotating_graph_us(lambda i, x=x, w=w, ids=ids: fused_experts(
            x, fp8[i][0], fp8[i][2], w, ids, w13_scale=fp8[i][1], w2_scale=fp8[i][3]), 2)
        floor = moe_floor_us(hit, hidden, inter, bw)  # bf16 bytes; fp8's floor is half
        record(f"Qwen3-30B-A3B fused MoE a layer, {t} tokens ({hit} experts hit)",
               f"fp8 {us_fp8:.1f} us, bf16 {us_bf16:.1f} us ({us_bf16 / us_fp8:.2f}x); floor bf16 {floor:.1f} / "
               f"fp8 {floor / 2:.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", choices=["kernel", "greedy", "speed"],
                        default=["kernel", "greedy", "speed"])
    parser.add_argument("--cpu", action="store_true",
                        help="kernel (interpreter, tiny shape) and greedy on the CPU; speed needs the GPU")
    args = parser.parse_args()
    from _gpu_common import run_sections

    sections = {"kernel": check_kernel, "greedy": check_greedy, "speed": check_speed}
    if args.cpu:
        sections = {"kernel": lambda: check_kernel("cpu"), "greedy": lambda: check_greedy("cpu")}
        args.only = [n for n in args.only if n in sections]
    if not run_sections(sections, args.only):
        OK["ok"] = False
    return 0 if OK["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
