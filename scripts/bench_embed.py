"""Embedding throughput on the CPU: pagedllm's pooling runner (LLM.embed) against
sentence-transformers' encode, the same 1,000 texts, batch size and dtype, side by side in one run.

    PYTHONPATH=. python scripts/bench_embed.py [--num-texts 1000] [--batch-size 32] [--rounds 3]

The two alternate (ST, ours, ST, ours, ...) so a machine whose load changes during the run affects
both alike; the table reports the median of each, wall and process CPU time, and the ratios. The
texts are real prose: standard-library docstrings cut into 1-6 sentence pieces (~10-200 tokens).
Both sides truncate at the model's 256 tokens.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import re
import statistics
import time

import torch

MODULES = ("json", "collections", "functools", "itertools", "pathlib", "shutil", "textwrap", "statistics", "csv",
           "heapq", "bisect", "string", "fractions", "random", "argparse", "logging", "typing", "subprocess",
           "threading", "datetime", "decimal", "socket", "zipfile", "tarfile", "email", "http.client", "urllib.parse")


def make_texts(n: int, seed: int = 0) -> list[str]:
    sentences: list[str] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, a) for a in dir(mod) if not a.startswith("_")]:
            doc = inspect.getdoc(obj) if (inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.isclass(obj)) else None
            if doc:
                sentences += [s for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())) if len(s) > 3]
    rng = random.Random(seed)
    return [" ".join(rng.choice(sentences) for _ in range(rng.randint(1, 6))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-texts", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM
    from pagedllm.pooling.embedded import embedded_embedding_model_path

    texts = make_texts(args.num_texts)
    path = str(embedded_embedding_model_path())
    st = SentenceTransformer(path, device="cpu")
    llm = LLM(path, dtype="float32", max_num_seqs=args.batch_size)
    ntok = sum(len(ids) for ids in st.tokenizer(texts, truncation=True, max_length=256)["input_ids"])
    # Warm-up, and the two agree (cosine >= 0.99999) on what is timed.
    a = st.encode(texts[:64], batch_size=args.batch_size, convert_to_tensor=True)
    b = torch.tensor([o.outputs.embedding for o in llm.embed(texts[:64], truncate_prompt_tokens=-1, use_tqdm=False)])
    cos = torch.nn.functional.cosine_similarity(a, b).min().item()
    runs: dict[str, list[tuple[float, float]]] = {"sentence-transformers": [], "pagedllm": []}
    for r in range(args.rounds):
        for name, fn in (("sentence-transformers", lambda: st.encode(texts, batch_size=args.batch_size)),
                         ("pagedllm", lambda: llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False))):
            w, c = time.perf_counter(), time.process_time()
            fn()
            runs[name].append((time.perf_counter() - w, time.process_time() - c))
            print(f"round {r} {name}: {runs[name][-1][0]:.2f} s wall, {runs[name][-1][1]:.2f} s cpu", flush=True)
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in runs.items()}
    print(f"\n{args.num_texts} texts, {ntok} tokens, batch {args.batch_size}, float32, torch threads "
          f"{torch.get_num_threads()}, min cosine {cos:.7f}")
    print(f"{'':24} {'wall s (median)':>16} {'texts/s':>9} {'cpu s (median)':>15}")
    for k, (w, c) in med.items():
        print(f"{k:24} {w:16.2f} {args.num_texts / w:9.1f} {c:15.2f}")
    st_w, st_c = med["sentence-transformers"]
    pg_w, pg_c = med["pagedllm"]
    print(f"{'speed-up (pagedllm)':24} {st_w / pg_w:15.2f}x {'':9} {st_c / pg_c:14.2f}x")


if __name__ == "__main__":
    main()
