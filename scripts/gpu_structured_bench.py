"""Cost of constrained decoding: decode throughput of N concurrent requests that all follow a JSON
schema, against the same requests unconstrained, in one process (and vLLM's xgrammar path the same
way with --vllm, when vLLM is importable).

    # here (needs gguf): a model folder with Qwen3-0.6B's shape and SmolLM2's real tokenizer
    python scripts/gpu_structured_bench.py --prepare bench_model
    # on the GPU machine (carry bench_model/ and the xgrammar wheel; see BENCHMARKS.md)
    python3 scripts/gpu_structured_bench.py --model bench_model [--vllm]
    # on this CPU: the embedded SmolLM2 at 16 requests
    python scripts/gpu_structured_bench.py --device cpu --num-requests 16 --max-tokens 48

Every request generates exactly --max-tokens tokens (ignore_eos, and a schema that cannot end
sooner: an array with minItems far beyond max_tokens), so both runs decode the same batch sizes.
Prints one JSON line per run and a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# An array of records: objects with a string, an integer, an enum and a list, as API outputs look.
SCHEMA = {
    "type": "array",
    "minItems": 10000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    },
}


def prepare(folder: str) -> None:
    """Qwen3-0.6B's config (vocabulary cut to the tokenizer's 49,152) + SmolLM2's tokenizer from the GGUF."""
    from transformers import AutoTokenizer

    from pagedllm.loader import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(folder)
    here = os.path.dirname(os.path.abspath(__file__))
    cfg_path = os.path.join(here, "..", "pagedllm", "model_configs", "qwen3-0.6b", "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(vocab_size=49152, bos_token_id=1, eos_token_id=2)
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"), indent=1)
    print(f"wrote {folder}: tokenizer + config (carry it to the GPU machine)")


def prompts(tokenizer, n: int) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"List users as JSON, batch {i}."}],
                                          tokenize=False, add_generation_prompt=True) for i in range(n)]


def run_pagedllm(args) -> list[dict]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    kwargs = dict(max_model_len=1024, seed=0)
    if args.model:
        kwargs.update(model=args.model, load_format="dummy")
    if args.device == "cpu":
        kwargs.update(num_gpu_blocks_override=64 * args.num_requests)
    llm = LLM(**kwargs)
    ps = prompts(llm.get_tokenizer(), args.num_requests)
    results = []
    for constrained in (False, True, False, True):  # alternated; the best of two each
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        sp = SamplingParams(temperature=0.8, seed=None, max_tokens=args.max_tokens, ignore_eos=True,
                            structured_outputs=so)
        llm.generate(ps[:2], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)  # compile, warm
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        assert toks == args.num_requests * args.max_tokens, toks
        if constrained:
            text = outs[0].outputs[0].text
            assert text.lstrip().startswith("["), text[:80]
        results.append({"engine": "pagedllm", "constrained": constrained, "requests": args.num_requests,
                        "output_tokens": toks, "seconds": round(dt, 3), "tok_per_s": round(toks / dt, 1)})
        print(json.dumps(results[-1]), flush=True)
    return results


def run_vllm(args) -> list[dict]:
    from vllm import LLM, SamplingParams

    try:
        from vllm.sampling_params import StructuredOutputsParams
        so_kw = lambda: {"structured_outputs": StructuredOutputsParams(json=SCHEMA)}  # noqa: E731
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams
        so_kw = lambda: {"guided_decoding": GuidedDecodingParams(json=SCHEMA)}  # noqa: E731
    # 0.8: this process's parent keeps a CUDA context (~1 GiB) of its own run.
    llm = LLM(model=args.model, load_format="dummy", max_model_len=1024, seed=0, gpu_memory_utilization=0.8)
    ps = prompts(llm.get_tokenizer(), args.num_requests)
    results = []
    for constrained in (False, True, False, True):
        extra = so_kw() if constrained else {}
        sp = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, **extra)
        llm.generate(ps[:2], SamplingParams(max_tokens=4, **extra), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        results.append({"engine": "vllm", "constrained": constrained, "requests": args.num_requests,
                        "output_tokens": toks, "seconds": round(dt, 3), "tok_per_s": round(toks / dt, 1)})
        print(json.dumps(results[-1]), flush=True)
    return results


def table(results: list[dict]) -> None:
    print("\n| engine | requests | unconstrained tok/s | JSON schema tok/s | schema / plain |")
    print("|---|---|---|---|---|")
    for engine in dict.fromkeys(r["engine"] for r in results):
        plain = max(r["tok_per_s"] for r in results if r["engine"] == engine and not r["constrained"])
        schema = max(r["tok_per_s"] for r in results if r["engine"] == engine and r["constrained"])
        n = results[0]["requests"]
        print(f"| {engine} | {n} | {plain:,.0f} | {schema:,.0f} | {schema / plain:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", metavar="DIR", help="write the model folder and exit")
    ap.add_argument("--model", help="a folder from --prepare (dummy weights); default: the embedded SmolLM2")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--vllm", action="store_true", help="also run vLLM (in a second process, after ours)")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    results = run_pagedllm(args)
    if args.vllm:
        import gc

        import torch

        gc.collect()  # our engine's KV cache and weights back to the device before vLLM's start
        torch.cuda.empty_cache()
        import subprocess

        cmd = [sys.executable, __file__, "--model", args.model, "--num-requests", str(args.num_requests),
               "--max-tokens", str(args.max_tokens), "--vllm-child"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        sys.stderr.write(out.stderr[-3000:])
        results += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    table(results)


if __name__ == "__main__":
    if "--vllm-child" in sys.argv:
        sys.argv.remove("--vllm-child")
        ap = argparse.ArgumentParser()
        ap.add_argument("--model")
        ap.add_argument("--num-requests", type=int)
        ap.add_argument("--max-tokens", type=int)
        run_vllm(ap.parse_args())
    else:
        main()
