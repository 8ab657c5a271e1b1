"""Perplexity of the embedded SmolLM2-135M on real text (tests/quantization/test_fp8_kv_cache.TEXT) through the
GPU's decode kernel: the text fed one token a step (every step a decode-only batch through
`decode_attention_fused`, reading all earlier tokens back from the paged cache), with a bf16 cache, an fp8
(e4m3, scale 1) cache on the fp16-dot loop (decode_attention variant 0, the default) and on the opt-in fp8
loop (FP8_KV_VARIANT, PAGEDLLM_FP8_KV_DOTS=1: e4m3 QK, q rounded to e4m3 per row). Eager steps, the model in its CUDA default dtype.

    PYTHONPATH=$PWD python3 scripts/gpu_fp8_kv_ppl.py
"""

from __future__ import annotations

import math
import sys
import time

import torch


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=0, help="only the text's first N tokens (0: all)")
    ap.add_argument("--cpu", action="store_true", help="a check of the script on the CPU: TRITON_INTERPRET=1, "
                    "PAGEDLLM_CPU_FUSED_DECODER=0 (so attention runs through the modules), a few tokens")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_fp8_kv_ppl.py needs a CUDA device (or --cpu)")
        return 2
    from pagedllm.attention.layer import Attention
    from pagedllm.attention.metadata import build_metadata
    from pagedllm.attention.triton_backend import TritonAttentionBackend
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.kernels import decode_attention
    from pagedllm.loader import get_tokenizer
    from pagedllm.loader.model_loader import load_model
    from tests.quantization.test_fp8_kv_cache import TEXT

    t0 = time.monotonic()
    config = EngineArgs(model=None).create_engine_config()
    dev = torch.device("cpu" if args.cpu else "cuda")
    model = load_model(config.model_config, dev)
    ids = get_tokenizer(config.model_config.source).encode(TEXT)
    ids = ids[: args.tokens] if args.tokens else ids
    block_size, num_blocks = 16, 32
    rows = []
    # The opt-in loop second: a cut run still has the comparison that decides its default.
    for tag, cache_dtype, variant in (("bf16 KV", torch.bfloat16, None),
                                      (f"fp8 KV, e4m3 QK (v{decode_attention.FP8_KV_VARIANT}, PAGEDLLM_FP8_KV_DOTS=1)",
                                       torch.float8_e4m3fn, decode_attention.FP8_KV_VARIANT),
                                      ("fp8 KV, fp16 dots (v0, the default)", torch.float8_e4m3fn, 0)):
        decode_attention.FP8_KV_DOTS = variant != 0
        for m in model.modules():
            if isinstance(m, Attention):
                m.bind_kv_cache(torch.zeros(2, num_blocks, block_size, m.num_kv_heads, m.head_dim, device=dev,
                                            dtype=cache_dtype), TritonAttentionBackend())
        table = list(range(num_blocks))
        nll = 0.0
        with torch.no_grad():
            for pos in range(len(ids) - 1):
                md = build_metadata([1], [pos + 1], [table[: pos // block_size + 1]], block_size, device=dev)
                hidden = model(torch.tensor([ids[pos]], device=dev), torch.tensor([pos], device=dev), md)
                logits = model.compute_logits(hidden).float()
                nll += torch.nn.functional.cross_entropy(logits, torch.tensor([ids[pos + 1]], device=dev)).item()
        ppl = math.exp(nll / (len(ids) - 1))
        rows.append((tag, ppl))
        print(f"[{time.monotonic() - t0:.1f} s] {tag}: perplexity {ppl:.3f}", flush=True)
    base = rows[0][1]
    print(f"\n| SmolLM2-135M, {len(ids)} tokens one a step (decode kernel), {config.model_config.dtype} | perplexity "
          f"| vs bf16 KV |\n|---|---|---|")
    for tag, ppl in rows:
        print(f"| {tag} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
