"""The fused MoE's default paths on this GPU against the torch reference, at Qwen3-30B-A3B's expert shape
(bf16): decode sizes (the row-list path), a mid size and a prefill size (the align path), plus the top-k
sum and the MoE block's top-k outputs left unsummed for the next RMSNorm. Exit status 1 if any differs
or fails to compile, so a round script can fall back (PAGEDLLM_MOE_SCAN=0 PAGEDLLM_MOE_SUM_IN_NORM=0) before a
long run. ~10 s on a cold Triton cache (its compiles are the engine's).

    PYTHONPATH=$PWD python3 scripts/gpu_moe_smoke.py || export PAGEDLLM_MOE_SCAN=0 PAGEDLLM_MOE_SUM_IN_NORM=0
"""

from __future__ import annotations

import sys
import time
import traceback

import torch
from _gpu_common import MOE_SHAPES, moe_expert_weights, rel_err


def main() -> int:
    from pagedllm.kernels.fused_moe import _config, _scan_config, fused_experts, moe_sum
    from pagedllm.layers.fused_moe.router import select_experts
    from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

    t0 = time.monotonic()
    e, top_k, hidden, inter = MOE_SHAPES["qwen3-30b-a3b"]
    w13, w2 = moe_expert_weights(e, hidden, inter)
    ok = True
    for t in (1, 32, 128, 256, 1024, 8192):
        try:
            x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
            w, ids = select_experts(torch.randn(t, e, device="cuda"), top_k, True)
            cfg = _scan_config(t * top_k, e, torch.bfloat16) or _config(t * top_k, torch.bfloat16)
            err = rel_err(fused_experts(x, w13, w2, w, ids), fused_experts_ref(x, w13, w2, w, ids))
            good = err < 2e-2
            print(f"fused_experts {t} tokens ({'row lists' if cfg.get('SCAN') else 'align'}, BLOCK_M {cfg['BLOCK_M']}): "
                  f"rel err {err:.1e} {'OK' if good else 'WRONG'}", flush=True)
            ok &= good
        except Exception:
            traceback.print_exc()
            print(f"fused_experts {t} tokens: FAILED", flush=True)
            ok = False
    down = torch.randn(256 * top_k, hidden, device="cuda", dtype=torch.bfloat16)
    # fp32 sums in another order than torch's: equal up to the last bf16 place.
    err = rel_err(moe_sum(down, top_k), down.view(256, top_k, hidden).float().sum(1).to(torch.bfloat16))
    same = err < 4e-3
    print(f"moe_sum == torch sum: rel err {err:.1e} {'OK' if same else 'WRONG'}", flush=True)
    ok &= same
    # Qwen3-30B-A3B's MoE block on one rank: its top-k outputs left unsummed for the next residual add
    # + RMSNorm to sum, against the summed block output through the same norm.
    try:
        import json
        import os

        from transformers import Qwen3MoeConfig

        from pagedllm.layers.layernorm import RMSNorm
        from pagedllm.models.qwen2_moe import Qwen2MoeSparseMoeBlock

        with open(os.path.join("pagedllm", "model_configs", "qwen3-30b-a3b", "config.json")) as f:
            cfg = Qwen3MoeConfig(**json.load(f))
        del w13, w2
        with torch.device("cuda"):
            block = Qwen2MoeSparseMoeBlock(cfg, None, "model.layers.0.mlp").to(torch.bfloat16)
            norm = RMSNorm(hidden, cfg.rms_norm_eps).to(torch.bfloat16)
        for p in block.parameters():
            p.data.normal_(0, 0.02)
        for t in (1, 256, 1024):
            x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
            parts = block(x)
            a = norm(parts, residual)
            b = norm(block.experts.forward(x, block.gate(x)), residual)
            errs = (rel_err(a[0], b[0]), rel_err(a[1], b[1]))
            good = parts.shape == (t, top_k, hidden) and max(errs) < 2e-2
            print(f"MoE block, top-k unsummed into the norm, {t} tokens: {tuple(parts.shape)}, rel err "
                  f"{errs[0]:.1e} / {errs[1]:.1e} {'OK' if good else 'WRONG'}", flush=True)
            ok &= good
    except Exception:
        traceback.print_exc()
        print("MoE block unsummed: FAILED", flush=True)
        ok = False
    print(f"[smoke {'OK' if ok else 'FAILED'}, {time.monotonic() - t0:.0f} s]", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
