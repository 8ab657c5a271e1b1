"""Where W1's time goes on an MoE shape: every step timed by kind against its floor, one decode step and one
prefill-carrying step under torch.profiler by kernel family against their floors, then fused-MoE tile
variants on the engine's own expert weights. Table printed last.

    python3 scripts/gpu_moe_w1_probe.py --model qwen3-30b-a3b --load-format dummy --dataset w1 \
        --max-model-len 4096 [--deadline 95] [--skip-variants] [any `bench throughput` flag]

(one H200, ~95 s with a cold Triton cache: the engine's start ~35 s, W1 ~25 s, the rest until --deadline).

1. W1 through the engine's step loop (the requests of `bench throughput --dataset w1`, all added at once),
   each step's forward path recorded (decode graph / mixed graph / eager) with CUDA events around
   `execute_model`: a step's device period is the time from its first event to the next step's. Steps are
   grouped by kind and decode batch, each group against the sum of its steps' floors:
       decode floor  = (dense weights + the experts its batch hits (expected, uniform routing)
                        + KV of its contexts read + KV written) / copy bandwidth
       prefill floor = max(that with every expert, (2 x active params x tokens + attention) / matmul peak)
2. torch.profiler (CUDA activity) over one eager 8192-token prefill-carrying step and one decode step at
   the full batch of a fresh pass of the same requests (prefix cache reset): kernel time per family
   (fused MoE GEMMs, align, router, attention, dense GEMMs, norms, ...) against the family's floor.
3. `fused_experts` and its two grouped GEMMs, one tile config at a time, at 128 / 256 / 8192 tokens,
   CUDA-graph replays rotating over the engine's 48 layers' experts (each call reads its weights from
   DRAM), against the experts' bytes (decode) or FLOPs (prefill); until --deadline seconds since start.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import traceback

from _gpu_common import print_results, record, rel_err, rotating_graph_us

T_START = time.monotonic()


def elapsed() -> float:
    return time.monotonic() - T_START


class Shape:
    """The byte and FLOP counts of an MoE model the floors need (from its hf_config): Qwen3-MoE-like (GQA
    attention, routed experts in every layer) or DeepSeek-V2-like (MLA: one latent of kv_lora_rank +
    qk_rope_head_dim per token and layer in the cache; shared experts on every token; the first
    first_k_dense_replace layers with a dense MLP)."""

    def __init__(self, cfg) -> None:
        self.layers = cfg.num_hidden_layers
        self.hidden = h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.mla = getattr(cfg, "kv_lora_rank", None) is not None
        self.experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
        self.shared = (getattr(cfg, "n_shared_experts", None) or 0) if self.mla else 0
        self.top_k = cfg.num_experts_per_tok
        self.inter = cfg.moe_intermediate_size
        dense_layers = getattr(cfg, "first_k_dense_replace", 0) or 0
        self.moe_layers = self.layers - dense_layers
        if self.mla:  # DeepSeek-V2-Lite: q_proj (no q LoRA) + kv_a, kv_b (absorbed), o_proj
            qk, v, r, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, \
                cfg.qk_rope_head_dim
            q_a = cfg.q_lora_rank or self.heads * qk
            attn = h * (q_a + r + rope) + (cfg.q_lora_rank or 0) * self.heads * qk + r * self.heads * (qk - rope + v) \
                + self.heads * v * h
            self.kv_token_bytes = self.layers * (r + rope) * 2
            self.pair_flops = 2 * self.heads * (qk + v)  # prefill chunks attend over expanded heads
            self.kv_heads, self.head_dim = 1, r + rope
        else:
            self.kv_heads = cfg.num_key_value_heads
            self.head_dim = getattr(cfg, "head_dim", None) or h // self.heads
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            attn = h * (q + 2 * kv) + q * h
            self.kv_token_bytes = self.layers * 2 * kv * 2
            self.pair_flops = 4 * self.heads * self.head_dim
        # attention + router per layer, the dense layers' MLP, the LM head (the embedding is gathered).
        self.dense_params = (self.layers * attn + self.moe_layers * h * self.experts
                             + dense_layers * 3 * h * cfg.intermediate_size + cfg.vocab_size * h)
        self.expert_bytes = 3 * h * self.inter * 2  # w1, w3, w2 of one expert, bf16
        self.active_params = self.dense_params + self.moe_layers * (self.top_k + self.shared) * 3 * h * self.inter
        self.lm_head_params = cfg.vocab_size * h

    def experts_hit(self, tokens: int) -> float:
        """Expected distinct experts a layer's batch hits under uniform routing (dummy weights route ~so),
        the shared ones included."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** tokens) + (self.shared if tokens else 0)

    def moe_bytes(self, tokens: int) -> float:
        return self.moe_layers * self.experts_hit(tokens) * self.expert_bytes

    def attn_flops(self, q_lens, seq_lens) -> float:
        """pair_flops x layers per (query, key) pair, causal inside the chunk."""
        keys = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(q_lens, seq_lens))
        return self.layers * self.pair_flops * keys

    def step_floor(self, q_lens, seq_lens, bw: float, flops: float) -> tuple[float, float, float, float]:
        """-> (floor s, moe bytes s, kv bytes s, compute s) of a step."""
        tokens = sum(q_lens)
        moe_s = self.moe_bytes(tokens) / bw
        kv_s = (sum(seq_lens)) * self.kv_token_bytes / bw
        by_s = self.dense_params * 2 / bw + moe_s + kv_s
        fl_s = (2 * self.active_params * tokens + self.attn_flops(q_lens, seq_lens)) / flops
        return max(by_s, fl_s), moe_s, kv_s, fl_s


class HostEvent:
    """torch.cuda.Event's two calls on the host clock (a CPU run of this script, to check its plumbing)."""

    def __init__(self, **_) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: HostEvent) -> float:
        return (other.t - self.t) * 1e3


def make_event():
    import torch

    return torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else HostEvent()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def instrument(runner):
    """Wrap the runner's forward / execute_model: per step (kind, tokens, reqs, q_lens, seq_lens, events)."""
    steps: list[dict] = []
    fwd, exe = runner.forward, runner.execute_model
    cur: dict = {}

    def forward(inp):
        gr, mr = runner.graph_runner, runner.mixed_graph_runner
        if gr is not None and gr.can_run(inp):
            kind = "decode-graph"
        elif mr is not None and mr.can_run(inp):
            kind = "mixed-graph"
        else:
            kind = "eager-decode" if int(inp.query_start_loc[-1]) == len(inp.req_ids) else "eager-mixed"
        qsl = inp.query_start_loc
        cur.update(kind=kind, tokens=int(qsl[-1]), reqs=len(inp.req_ids),
                   q_lens=[int(b - a) for a, b in zip(qsl[:-1], qsl[1:])], seq_lens=[int(s) for s in inp.seq_lens])
        return fwd(inp)

    def execute_model(so):
        cur.clear()
        start = make_event()
        start.record()
        t = time.perf_counter()
        out = exe(so)
        host = time.perf_counter() - t
        if cur:
            end = make_event()
            end.record()
            steps.append(dict(cur, start=start, end=end, host=host))
        return out

    runner.forward, runner.execute_model = forward, execute_model
    return steps, (fwd, exe)


def add_requests(engine, requests, temperature: float, tag: str) -> None:
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    for i, r in enumerate(requests):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(temperature=temperature, top_p=1.0, max_tokens=r.expected_output_len,
                                          ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA))


def w1_steps(llm, runner, requests, temperature: float, shape: Shape, bw: float, flops: float) -> None:
    """Section 1."""
    from triton.runtime import jit

    from pagedllm.benchmarks import throughput as tp

    steps, originals = instrument(runner)
    compiles: list[tuple[int, str, float]] = []
    compile_fn = jit.JITFunction._do_compile

    def timed_compile(self, *a, **kw):
        t = time.perf_counter()
        try:
            return compile_fn(self, *a, **kw)
        finally:
            compiles.append((len(steps), self.fn.__name__, time.perf_counter() - t))

    jit.JITFunction._do_compile = timed_compile
    try:  # `bench throughput`'s own measured call (llm.generate), with the runner instrumented
        result = tp.run_throughput(llm, requests, temperature, tp.roofline.DeviceSpec(bw, flops, "measured"))
    finally:
        jit.JITFunction._do_compile = compile_fn
        runner.forward, runner.execute_model = originals
    sync()
    wall = result.elapsed_time
    out_tokens = result.total_output_tokens
    record("W1 (bench throughput's run, runner instrumented)",
           f"{result.output_tokens_per_second:.0f} output tok/s ({wall:.2f} s, {len(steps)} steps)")
    record("Triton compiles during W1", f"{len(compiles)}, {sum(c[2] for c in compiles):.2f} s" + (
        ": " + ", ".join(f"{n}@step {k} {t:.2f}s" for k, n, t in compiles[:8]) if compiles else ""))
    for i, s in enumerate(steps):
        nxt = steps[i + 1]["start"] if i + 1 < len(steps) else s["end"]
        s["period"] = s["start"].elapsed_time(nxt) / 1e3
        s["busy"] = s["start"].elapsed_time(s["end"]) / 1e3
        s["floor"], s["moe_s"], s["kv_s"], s["fl_s"] = shape.step_floor(s["q_lens"], s["seq_lens"], bw, flops)
    lead = steps[0]["start"].elapsed_time(steps[-1]["end"]) / 1e3
    record("W1 device span first step -> last (s); wall - span", f"{lead:.2f}; {wall - lead:.2f}")
    total_floor = sum(s["floor"] for s in steps)
    record("W1 sum of step floors (s)", f"{total_floor:.2f} -> {out_tokens / total_floor:.0f} tok/s; reached "
           f"{100 * total_floor / wall:.1f}% (MoE bytes {sum(s['moe_s'] for s in steps):.2f} s, KV "
           f"{sum(s['kv_s'] for s in steps):.2f} s at {bw / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s)")

    def bucket(s) -> str:
        if s["kind"] in ("decode-graph", "eager-decode"):
            b = s["reqs"]
            lo = next(x for x in (224, 192, 128, 64, 32, 16, 1) if b >= x)
            return f"{s['kind']} batch >= {lo}"
        t = s["tokens"]
        return f"{s['kind']} {'>= 4096' if t >= 4096 else '< 4096'} tokens"

    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for s in steps:
        groups[bucket(s)].append(s)
    print("\n| step group | steps | device s (sum of periods) | mean ms | p50 host launch ms | floor s | % of floor | "
          "MoE floor ms/step |\n|---|---|---|---|---|---|---|---|")
    for name, g in sorted(groups.items(), key=lambda kv: -sum(s["period"] for s in kv[1])):
        per = sum(s["period"] for s in g)
        fl = sum(s["floor"] for s in g)
        row = (f"{len(g)} | {per:.2f} | {1e3 * per / len(g):.2f} (p50 {1e3 * statistics.median(s['period'] for s in g):.2f}, "
               f"max {1e3 * max(s['period'] for s in g):.1f}) | {1e3 * statistics.median(s['host'] for s in g):.2f} | "
               f"{fl:.2f} | {100 * fl / per:.0f}% | {1e3 * statistics.fmean(s['moe_s'] for s in g):.2f}")
        print(f"| {name} | {row} |")
        record(f"steps: {name} (n, device s, mean ms, host p50 ms, floor s, %, MoE floor ms)", row.replace(" | ", ", "))


FAMILIES = [  # first match wins
    ("moe gemm", ("_fused_moe_kernel", "_fused_moe_rows_kernel", "_fused_moe_rows_persistent_kernel",
                  "_fused_moe_tma_kernel")),
    ("moe align", ("_moe_align", "_moe_expert_rows", "_moe_rows_to_sorted", "sort", "scatter", "searchsorted",
                   "cumsum", "arange", "index_put", "fill")),
    ("mla prep", ("_mla_prep",)),
    ("moe sum", ("_moe_sum",)),
    ("router", ("topk_softmax", "_topk", "softmax")),
    ("attention", ("attn", "attention", "paged", "decode", "merge", "flash", "unified", "mla")),
    ("dense gemm", ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas", "xmma", "wgmma", "matmul", "splitk")),
    ("norm", ("rms", "norm")),
    ("rotary", ("rope", "rotary")),
    ("silu", ("silu", "act_and_mul")),
    ("moe sum", ("reduce",)),
    ("sampling", ("sampl", "gumbel", "argmax", "multinomial", "exponential", "log_softmax")),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other"


def profile_steps(llm, runner, requests, temperature: float, shape: Shape, bw: float, flops: float,
                  decode_at: int) -> None:
    """Section 2: the first eager prefill-carrying step of 8192 tokens and decode step `decode_at`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    if not llm.reset_prefix_cache():
        print("warning: the prefix cache could not be reset", flush=True)
    steps, originals = instrument(runner)
    add_requests(engine, requests, temperature, "prof")
    want = {"mixed": None, "decode": None}
    k = 0
    try:
        while engine.has_unfinished_requests() and (want["mixed"] is None or want["decode"] is None):
            # Which kind the next step is, is known only after it: profile candidates, keep the first match.
            candidate = (want["mixed"] is None and k >= 2) or (want["decode"] is None and k >= decode_at)
            if not candidate:
                engine.step()
                k += 1
                continue
            torch.cuda.synchronize()
            n_before = len(steps)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            k += 1
            new = steps[n_before:]
            if not new:
                continue
            s = new[-1]
            kind = "decode" if s["kind"].endswith("decode") or s["kind"] == "decode-graph" else "mixed"
            if kind == "mixed" and s["tokens"] < 4096:
                continue
            if want[kind] is None:
                want[kind] = (s, prof, wall)
    finally:
        runner.forward, runner.execute_model = originals
        engine.abort_request([f"prof-{i}" for i in range(len(requests))])
        while engine.has_unfinished_requests():
            engine.step()
    for kind, got in want.items():
        if got is None:
            record(f"profile {kind}", "no such step found")
            continue
        s, prof, wall = got
        fams: dict[str, float] = collections.defaultdict(float)
        names: dict[str, list[float]] = collections.defaultdict(list)
        lo, hi = float("inf"), 0.0
        for ev in prof.events():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            dur = (ev.time_range.end - ev.time_range.start) / 1e6
            fams[family(ev.name)] += dur
            names[ev.name].append(dur)
            lo, hi = min(lo, ev.time_range.start), max(hi, ev.time_range.end)
        total = sum(fams.values())
        tok = s["tokens"]
        floor, moe_s, kv_s, fl_s = shape.step_floor(s["q_lens"], s["seq_lens"], bw, flops)
        moe_fl = 2 * shape.moe_layers * (shape.top_k + shape.shared) * 3 * shape.hidden * shape.inter * tok / flops
        dense_fl = 2 * (shape.dense_params - shape.lm_head_params) * tok / flops  # the LM head: sampled rows only
        attn_fl = shape.attn_flops(s["q_lens"], s["seq_lens"]) / flops
        floors = {  # the family's own floor: bytes for a decode step, FLOPs (or bytes, if more) for a prefill one
            "moe gemm": max(moe_s, moe_fl),
            "attention": max(kv_s, attn_fl),
            "dense gemm": max(shape.dense_params * 2 / bw, dense_fl),
        }
        head = (f"{s['kind']}, {tok} tokens / {s['reqs']} requests, ctx sum {sum(s['seq_lens'])}: wall {1e3 * wall:.1f} ms, "
                f"kernels {1e3 * total:.2f} ms over a span of {(hi - lo) / 1e3:.2f} ms, step floor {1e3 * floor:.2f} ms")
        record(f"profile {kind}", head)
        print(f"\n{head}\n| family | ms | % | floor ms | % of floor |\n|---|---|---|---|---|")
        for fam, sec in sorted(fams.items(), key=lambda kv: -kv[1]):
            f = floors.get(fam)
            ftxt = f"{1e3 * f:.2f} | {100 * f / sec:.0f}%" if f else "- | -"
            print(f"| {fam} | {1e3 * sec:.2f} | {100 * sec / total:.1f} | {ftxt} |")
            record(f"profile {kind}: {fam} ms (floor ms, %)", f"{1e3 * sec:.2f}" + (f" ({1e3 * f:.2f}, {100 * f / sec:.0f}%)"
                                                                                   if f else ""))
        print("| kernel | calls | ms | mean us |\n|---|---|---|---|")
        for name, durs in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:14]:
            short = name if len(name) <= 80 else name[:77] + "..."
            print(f"| `{short}` | {len(durs)} | {1e3 * sum(durs):.2f} | {1e6 * statistics.fmean(durs):.1f} |")


def _c(m: int, n: int, k: int, w: int, st: int, **kw) -> dict:
    return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=st, **kw)


def variant_set(name: str, base: dict[int, dict]) -> list[tuple[int, str, dict]]:
    """(tokens, label, fused_experts config) to time, most informative first (the deadline cuts the tail).
    base: `_config`'s tiles per token count."""
    c = _c
    if name == "r1":
        return [
            (256, "default", dict(base[256])),
            (8192, "default", dict(base[8192])),
            # SiLU in GEMM 1 at prefill size: two 128 x 128 accumulators (the registers of one 128 x 256).
            (8192, "128x128x64 w8 s4 silu-fused", c(128, 128, 64, 8, 4, FUSE_SILU=True)),
            (8192, "128x128x64 w8 s4 silu-fused TMA", c(128, 128, 64, 8, 4, FUSE_SILU=True, TMA=True)),
            (256, "16x128x128 w4 s2", c(16, 128, 128, 4, 2)),
            (256, "16x128x128 w4 s3 TMA", c(16, 128, 128, 4, 3, TMA=True)),
            (256, "32x64x128 w4 s3", c(32, 64, 128, 4, 3)),
            (128, "default", dict(base[128])),
            (8192, "128x128x64 w8 s3 silu-fused", c(128, 128, 64, 8, 3, FUSE_SILU=True)),
            (256, "16x64x128 w4 s3", c(16, 64, 128, 4, 3)),
            (256, "16x256x128 w8 s2", c(16, 256, 128, 8, 2)),
            (128, "16x128x128 w4 s2", c(16, 128, 128, 4, 2)),
            (8192, "64x128x64 w4 s4 silu-fused", c(64, 128, 64, 4, 4, FUSE_SILU=True)),
            (256, "64x64x64 w4 s4", c(64, 64, 64, 4, 4)),
            (8192, "128x256x64 w8 s4 TMA", c(128, 256, 64, 8, 4, TMA=True)),
            (256, "64x64x64 w4 s3 TMA", c(64, 64, 64, 4, 3, TMA=True)),
            (8192, "128x128x64 w8 s4", c(128, 128, 64, 8, 4)),
        ]
    if name == "r4":  # the defaults after round 3 against the paths they replaced
        return [
            (256, "default", dict(base[256])),
            (256, "align path 64x64x64", c(64, 64, 64, 4, 3)),
            (128, "default", dict(base[128])),
            (8192, "default", dict(base[8192])),
            (8192, "128x256x64 w8 s4, SiLU apart", c(128, 256, 64, 8, 4)),
            (32, "default", dict(base[32])),
            (32, "align path 16x64x128", c(16, 64, 128, 4, 3)),
        ]
    if name == "r2":  # the row-list decode path (default) against the align path it replaced
        return [
            (256, "default (row lists)", dict(base[256])),
            (256, "align path 64x64x64", c(64, 64, 64, 4, 3)),
            (128, "default (row lists)", dict(base[128])),
            (128, "align path 64x64x64", c(64, 64, 64, 4, 3)),
            (8192, "default", dict(base[8192])),
            (8192, "128x128x64 w8 s4 silu-fused TMA", c(128, 128, 64, 8, 4, FUSE_SILU=True, TMA=True)),
            (256, "rows 32x64x128, down 32x128x128", c(32, 64, 128, 4, 3, SCAN=True, DOWN=dict(BLOCK_N=128))),
            (256, "rows 64x64x64 s4, down 64x64x64", c(64, 64, 64, 4, 4, SCAN=True)),
            (256, "rows 64x32x64 s4, down 64x64x64", c(64, 32, 64, 4, 4, SCAN=True, DOWN=dict(BLOCK_N=64))),
            (128, "rows 16x64x128, down 16x128x128", c(16, 64, 128, 4, 3, SCAN=True, DOWN=dict(BLOCK_N=128))),
            (8192, "128x256x64 w8 s4 TMA", c(128, 256, 64, 8, 4, TMA=True)),
        ]
    raise ValueError(f"unknown variant set {name!r}")


def moe_variants(w13s: list, w2s: list, shape: Shape, bw: float, flops: float, deadline: float, which: str) -> None:
    """Section 3: tile configs of the fused MoE on the given layers' experts (rotated)."""
    import torch

    from pagedllm.kernels import fused_moe as fm
    from pagedllm.layers.fused_moe.router import select_experts
    from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

    e, top_k, hidden = shape.experts, shape.top_k, shape.hidden
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {}
    for t in (32, 128, 256, 8192):
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        w, ids = select_experts(torch.randn(t, e, device="cuda", generator=g), top_k, True)
        cases[t] = (x, w, ids)
    # Correctness of the default path on this GPU at a decode size (layer 0's weights).
    x, w, ids = cases[128]
    err = rel_err(fm.fused_experts(x, w13s[0], w2s[0], w, ids), fused_experts_ref(x, w13s[0], w2s[0], w, ids))
    record("fused_experts 128 tokens == torch reference (layer 0)", f"{'OK' if err < 2e-2 else 'WRONG'} (rel err {err:.1e})")
    # What fused_experts runs by default: the row lists at decode sizes, else _config's tiles.
    variants = variant_set(which, {t: fm._scan_config(t * top_k, e, torch.bfloat16) or fm._config(t * top_k, torch.bfloat16)
                                   for t in cases})
    copies = min(8, len(w13s))  # 8 layers' experts (~10 GB) rotated: every call reads from DRAM
    for t, name, cfg in variants:
        if elapsed() > deadline:
            record(f"variant {t} tokens {name}", "not run: deadline")
            continue
        try:
            time_variant(t, name, cfg, cases[t], w13s[:copies], w2s[:copies], shape, bw, flops)
        except Exception as exc:
            record(f"variant {t} tokens {name}", f"ERROR {type(exc).__name__}: {str(exc)[:120]}")
    torch.cuda.empty_cache()


def time_variant(t: int, name: str, cfg: dict, case, w13s, w2s, shape: Shape, bw: float, flops: float) -> None:
    """fused_experts, then its parts alone: the align (or the row lists) and GEMM 1 and GEMM 2 (the
    align computed once, outside the graph), each over the given layers' experts in turn."""
    import torch

    from pagedllm.kernels import fused_moe as fm

    x, w, ids = case
    top_k, hidden, inter, copies = shape.top_k, shape.hidden, shape.inter, len(w13s)
    from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

    err = rel_err(fm.fused_experts(x, w13s[0], w2s[0], w, ids, config=cfg), fused_experts_ref(x, w13s[0], w2s[0], w, ids))
    name = f"{name} [{'OK' if err < 2e-2 else 'WRONG'} {err:.0e}]"
    us = rotating_graph_us(lambda i: fm.fused_experts(x, w13s[i], w2s[i], w, ids, config=cfg), copies, reps=3 * copies)
    hit = int(torch.unique(ids).numel())
    floor_b = hit * shape.expert_bytes / bw * 1e6
    floor_f = 2 * t * top_k * 3 * hidden * inter / flops * 1e6
    floor = max(floor_b, floor_f)
    wf = w.reshape(-1).float().contiguous()
    ids32 = ids.reshape(-1).to(torch.int32).contiguous()
    if cfg.get("SCAN"):  # the row lists alone (the GEMMs are the rest of the call)
        rows = torch.empty((shape.experts, t), dtype=torch.int32, device="cuda")
        counts = torch.empty(shape.experts, dtype=torch.int32, device="cuda")
        chunk = max(16, min(1024, 1 << (t * top_k - 1).bit_length()))
        lists = rotating_graph_us(lambda i: fm._moe_expert_rows_kernel[(shape.experts,)](
            ids32, rows, counts, t * top_k, t, CHUNK=chunk, num_warps=4), 1, reps=24)
        record(f"variant {t} tokens {name} (row lists)", f"{us:.1f} us/layer ({100 * floor / us:.0f}% of {floor:.1f}); "
               f"the list kernel alone {lists:.1f} us")
        return
    align_us = rotating_graph_us(lambda i: fm.moe_align_block_size(ids, cfg["BLOCK_M"], shape.experts), 1, reps=24)
    sorted_ids, expert_ids, ntpp = fm.moe_align_block_size(ids, cfg["BLOCK_M"], shape.experts)
    fuse = cfg.get("FUSE_SILU", cfg["BLOCK_M"] * cfg["BLOCK_N"] <= fm.FUSED_SILU_MAX_TILE)
    h = torch.empty((t * top_k, inter if fuse else 2 * inter), dtype=x.dtype, device="cuda")
    down = torch.empty((t * top_k, hidden), dtype=x.dtype, device="cuda")
    hin = torch.empty((t * top_k, inter), dtype=x.dtype, device="cuda").normal_()
    g1 = rotating_graph_us(lambda i: fm._grouped_gemm(x, w13s[i], h, wf, sorted_ids, expert_ids, ntpp, top_k, False,
                                                      cfg, fuse_silu=fuse), copies, reps=3 * copies)
    g2 = rotating_graph_us(lambda i: fm._grouped_gemm(hin, w2s[i], down, wf, sorted_ids, expert_ids, ntpp, 1, True,
                                                      fm.down_config(cfg)), copies, reps=3 * copies)
    record(f"variant {t} tokens {name} ({'silu fused' if fuse else 'silu apart'})",
           f"{us:.1f} us/layer ({100 * floor / us:.0f}% of {floor:.1f}); align {align_us:.1f} us; GEMM1 {g1:.1f} us "
           f"({100 * floor_b * 2 / 3 / g1:.0f}% of bytes, {100 * floor_f * 2 / 3 / g1:.0f}% of FLOPs), GEMM2 "
           f"{g2:.1f} us ({100 * floor_b / 3 / g2:.0f}%, {100 * floor_f / 3 / g2:.0f}%)")


def attn_variants(shape: Shape, bw: float, deadline: float) -> None:
    """Section 4: the fused decode attention kernel's tiles at this model's heads (GQA groups of
    num_heads / num_kv_heads), W1-like decode batches, CUDA-graph replay, against its K/V bytes."""
    import functools
    import random

    import torch
    from _gpu_common import graph_time_us, shuffled_decode_metadata

    from pagedllm.kernels import decode_attention as da
    from pagedllm.kernels.rotary import build_cos_sin_cache

    nh, nkv, hd = shape.heads, shape.kv_heads, shape.head_dim
    original = da._tile_config
    # (BLOCK_M, BLOCK_Q, TILE_N, warps, stages) as _tile_config returns them, or None: its own; splits
    variants = [("default", None, None), ("64 keys s3", (16, 1, 64, 4, 3), None), ("128 keys s4", (16, 1, 128, 4, 4), None),
                ("64 keys s2", (16, 1, 64, 4, 2), None), ("128 keys s2", (16, 1, 128, 4, 2), None),
                ("256 keys s2 w8", (16, 1, 256, 8, 2), None), ("default, 2 splits", None, 2)]
    cos_sin = build_cos_sin_cache(hd, 8192, 1e6, device="cuda")
    norm_w = torch.ones(hd, device="cuda", dtype=torch.bfloat16)
    for n, (lo, hi) in {256: (150, 1100), 128: (500, 1800)}.items():  # early and mid-run W1 batches
        rng = random.Random(n)
        s_lens = [rng.randint(lo, hi) for _ in range(n)]
        md, blocks = shuffled_decode_metadata(s_lens, 16, rng)
        cache = torch.randn(2, blocks, 16, nkv, hd, device="cuda", dtype=torch.bfloat16)
        qkv = torch.randn(n, (nh + 2 * nkv) * hd, device="cuda", dtype=torch.bfloat16)
        pos = torch.tensor([s - 1 for s in s_lens], device="cuda")
        floor = sum(s_lens) * nkv * hd * 2 * 2 / bw * 1e6
        ref = None
        for name, tiles, splits in variants:
            if elapsed() > deadline:
                record(f"attention {n} requests {name}", "not run: deadline")
                continue
            call = functools.partial(da.decode_attention_fused, qkv, pos, cos_sin, cache, md, hd ** -0.5, nh, nkv, hd,
                                     norm_w, norm_w, num_splits=splits)
            try:
                if tiles is not None:
                    da._tile_config = functools.partial(lambda *a, t, **k: t, t=tiles)
                out = call().float()
                ref = out if ref is None else ref
                us = graph_time_us(call)
                record(f"attention {n} requests x {lo}-{hi} keys, {name}",
                       f"{us:.1f} us ({100 * floor / us:.0f}% of {floor:.1f}); max diff from default "
                       f"{(out - ref).abs().max().item():.1e}")
            except Exception as exc:
                record(f"attention {n} requests {name}", f"ERROR {type(exc).__name__}: {str(exc)[:100]}")
            finally:
                da._tile_config = original
        del cache


def main() -> int:
    import torch

    from pagedllm.benchmarks import throughput as tp
    from pagedllm.benchmarks.datasets import requests_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tp.add_cli_args(parser)
    parser.add_argument("--deadline", type=float, default=95.0, help="seconds since start: no variant starts after")
    parser.add_argument("--skip-variants", action="store_true")
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--decode-at", type=int, default=40, help="profile the first decode step from this index")
    parser.add_argument("--variants-only", action="store_true",
                        help="no engine: section 3 on 8 layers of random experts of --model's shape")
    parser.add_argument("--variant-set", default="r1")
    parser.add_argument("--attn", action="store_true", help="section 4: decode attention tiles (after the MoE variants)")
    parser.add_argument("--attn-deadline", type=float, default=95.0)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:  # the plumbing only (sections 1 and 2's bookkeeping), e.g. a tiny MoE config with --device cpu
        args.skip_variants = args.skip_profile = True
    requests = requests_from_args(args)
    temperature = args.temperature if args.temperature is not None else tp.W1_TEMPERATURE
    dev = tp.measured_device(args)
    record("device", f"{torch.cuda.get_device_name() if cuda else 'cpu'}: copy {dev.bandwidth / 1e12:.2f} TB/s, bf16 matmul "
           f"{dev.flops / 1e12:.0f} TFLOP/s")
    if args.variants_only:
        from _gpu_common import moe_expert_weights

        from pagedllm.engine.arg_utils import EngineArgs

        shape = Shape(EngineArgs.from_cli_args(args).create_engine_config().model_config.hf_config)
        weights = [moe_expert_weights(shape.experts, shape.hidden, shape.inter) for _ in range(8)]
        moe_variants([w[0] for w in weights], [w[1] for w in weights], shape, dev.bandwidth, dev.flops,
                     args.deadline, args.variant_set)
        del weights
        torch.cuda.empty_cache()
        if args.attn:
            attn_variants(shape, dev.bandwidth, args.attn_deadline)
        print_results()
        return 0
    llm = tp.make_llm(args)
    tp.warmup(llm, args.num_warmup)
    core = llm.llm_engine.engine_core
    runner = core.model_executor.driver_worker.model_runner
    mr = runner.mixed_graph_runner
    record("engine ready", f"{elapsed():.0f} s since start; mixed graphs "
           f"{(mr.sizes[0], mr.sizes[-1], len(mr.sizes)) if mr is not None else None}; decode graphs up to "
           f"{runner.graph_runner.max_bs if runner.graph_runner is not None else None}")
    shape = Shape(llm.llm_engine.config.model_config.hf_config)
    sections = [("w1", lambda: w1_steps(llm, runner, requests, temperature, shape, dev.bandwidth, dev.flops))]
    if not args.skip_profile:
        sections.append(("profile", lambda: profile_steps(llm, runner, requests, temperature, shape, dev.bandwidth,
                                                          dev.flops, args.decode_at)))
    if not args.skip_variants:
        from pagedllm.layers.fused_moe.layer import FusedMoE

        moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
        sections.append(("variants", lambda: moe_variants([m.w13_weight for m in moe], [m.w2_weight for m in moe],
                                                          shape, dev.bandwidth, dev.flops, args.deadline,
                                                          args.variant_set)))
    if args.attn:
        sections.append(("attention", lambda: attn_variants(shape, dev.bandwidth, args.attn_deadline)))
    for name, fn in sections:
        t0 = elapsed()
        try:
            fn()
        except Exception:
            traceback.print_exc()
            record(name, "ERROR (traceback above)")
        print(f"[{name}: {elapsed() - t0:.0f} s; {elapsed():.0f} s since start]", flush=True)
    print_results()
    return 0


if __name__ == "__main__":
    sys.exit(main())
