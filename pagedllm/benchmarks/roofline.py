"""Speed-of-light floor: the least time a run could take on this device, from bytes moved and FLOPs.

A step that computes `T` tokens (prefill chunks and decode tokens together) costs at least

    max(bytes / bandwidth, flops / peak_flops)
    bytes = weights (read once per step) + cached KV read (each request's context, once)
            + KV written (T tokens)
    flops = 2 * params * T + attention (2 * 2 * layers * heads * head_dim per key attended)

and the run's floor is the sum over the steps of the ideal schedule under the engine's own limits:
at most `max_num_seqs` requests resident, at most `max_num_batched_tokens` tokens a step, decode
tokens of running requests first, then prefill chunks (vLLM v1's token-budget scheduler). With every
request resident from the start this is the peers' /work/shared/peers/roofline.py schedule: prefill
in chunks of the budget, then one decode token per running request per step.

Conventions kept from the peers so that the figures line up with their table (W1: 35,793 tok/s for
Qwen3-0.6B, 12,818 for Llama-3.1-8B at 4.3 TB/s and 790 TFLOP/s): every weight, the input embedding
included, is read once per step and counted in `params`; norms are left out (< 0.01% of the bytes);
the prompt's forward pass yields no token, so each request takes `output_len` decode steps.

Quantized runs (`linear_weight_bytes`): the linear layers' weights are counted at their stored size,
scales and zero points included (fp8 / int8: 1 byte a weight; AWQ / GPTQ 4-bit, group 128 with zero
points: 0.5 + 2.5 / 128), the embedding and LM head in the model dtype (they are not quantized), and
the KV cache at its `kv_cache_dtype`. FLOPs stay at the measured bf16 matmul peak, so for fp8 / int8
compute the floor of prefill-heavy steps is lenient (their tensor cores run twice as fast).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )

    @property
    def params(self) -> int:
        """q, k, v, o projections + gate/up/down MLP per layer, embedding (+ LM head when untied)."""
        return self.linear_params + self.embedding_params

    @property
    def linear_params(self) -> int:
        """The decoder layers' q, k, v, o and gate/up/down weights: what a quantization method stores."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.num_layers * (h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size)

    @property
    def embedding_params(self) -> int:
        """The token embedding, and the LM head when it is not tied to it."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def weight_bytes(self, dtype_bytes: int, linear_bytes: float | None = None) -> int:
        """Bytes of weights a step reads: linear layers at `linear_bytes` a weight (default: the dtype)."""
        per = dtype_bytes if linear_bytes is None else linear_bytes
        return int(self.linear_params * per) + self.embedding_params * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def attn_flops_per_key(self) -> int:
        """QK^T and PV for one query token against one cached key: 2 matmuls x 2 FLOPs x heads x head_dim."""
        return 2 * 2 * self.num_layers * self.num_heads * self.head_dim


@dataclass(frozen=True)
class DeviceSpec:
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s in the run's dtype
    source: str  # "measured on cuda", "given", ...

    def describe(self) -> str:
        if self.bandwidth >= 1e12:
            return f"{self.bandwidth / 1e12:.2f} TB/s, {self.flops / 1e12:.1f} TFLOP/s ({self.source})"
        return f"{self.bandwidth / 1e9:.1f} GB/s, {self.flops / 1e9:.1f} GFLOP/s ({self.source})"


@dataclass(frozen=True)
class Floor:
    seconds: float
    output_tokens: int
    num_steps: int
    num_decode_steps: int  # steps that computed no prefill token

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")


# -- the device ------------------------------------------------------------------------------------
def _cuda_timed(fn, iters: int) -> float:
    fn()  # warm: allocation, kernel selection
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _cpu_timed(fn, iters: int) -> float:
    """Best of `iters`: the CPU is shared with whatever else runs, and the floor wants the peak."""
    fn()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_bandwidth(device: str, nbytes: int, timed, iters: int) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), iters)


def _matmul_flops(device: str, n: int, dtype: torch.dtype, timed, iters: int) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / timed(lambda: a @ b, iters)


@functools.cache
def measure_device(device: str) -> DeviceSpec:
    """Copy bandwidth (read + write counted) and matmul FLOP/s, measured once per process.

    cuda: a 1 GiB device-to-device copy and a bf16 8192^3 matmul; cpu: a 256 MiB memcpy and an
    fp32 1024^3 matmul (the CPU path computes in fp32). About a second either way.
    """
    if device == "cuda":
        bw = _copy_bandwidth(device, 1 << 30, _cuda_timed, 20)
        fl = _matmul_flops(device, 8192, torch.bfloat16, _cuda_timed, 20)
        torch.cuda.empty_cache()  # hand the scratch back before the engine sizes its KV cache
    elif device == "cpu":
        bw = _copy_bandwidth(device, 1 << 28, _cpu_timed, 5)
        fl = _matmul_flops(device, 1024, torch.float32, _cpu_timed, 5)
    else:
        raise ValueError(f"cannot measure device {device!r}; give --hbm-bandwidth and --peak-flops.")
    return DeviceSpec(bw, fl, f"measured on {device}")


def device_spec(device: str, bandwidth: float | None = None, flops: float | None = None) -> DeviceSpec:
    """The given figures where the user gave them, measured ones for the rest."""
    if bandwidth is not None and flops is not None:
        return DeviceSpec(bandwidth, flops, "given")
    measured = measure_device(device)
    if bandwidth is None and flops is None:
        return measured
    return DeviceSpec(bandwidth or measured.bandwidth, flops or measured.flops, f"given + {measured.source}")


# -- the floor -------------------------------------------------------------------------------------
def _step_cost(
    shape: ModelShape,
    dev: DeviceSpec,
    wbytes: int,
    kv_tok: int,
    num_tokens: int,
    kv_read_tokens: int,
    attended_keys: int,
) -> float:
    by = wbytes + (kv_read_tokens + num_tokens) * kv_tok
    fl = 2 * shape.params * num_tokens + shape.attn_flops_per_key * attended_keys
    return max(by / dev.bandwidth, fl / dev.flops)


def throughput_floor(
    shape: ModelShape,
    input_lens: list[int],
    output_lens: list[int],
    dev: DeviceSpec,
    dtype_bytes: int = 2,
    max_num_batched_tokens: int = 16384,
    max_num_seqs: int | None = None,
    linear_bytes: float | None = None,
    kv_dtype_bytes: int | None = None,
) -> Floor:
    """Floor of an offline run: all requests queued at t=0, served in order.

    Each step: every resident request past its prompt decodes one token, then the leftover token
    budget goes to prompt chunks of resident requests in arrival order; finished requests leave and
    waiting ones are admitted. Example (budget 4, prompts A, B of 3 tokens, outputs [1, 1]): step 1
    computes A's prompt and B's first token, step 2 A's decode token and B's last 2 prompt tokens,
    step 3 B's decode token.
    """
    if len(input_lens) != len(output_lens) or not input_lens:
        raise ValueError("input_lens and output_lens must be non-empty and of equal length.")
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}.")
    max_seqs = max_num_seqs or len(input_lens)
    wbytes = shape.weight_bytes(dtype_bytes, linear_bytes)
    kv_tok = shape.kv_bytes_per_token(kv_dtype_bytes or dtype_bytes)
    waiting = deque(range(len(input_lens)))
    prefilling: deque[int] = deque()  # resident, prompt not done (in arrival order)
    computed = [0] * len(input_lens)  # prompt tokens done
    ctx = list(input_lens)  # tokens in the cache once decoding
    left = list(output_lens)
    decoding: list[int] = []
    decode_ctx = 0  # sum of ctx over `decoding`, kept incrementally: the loop is O(steps + requests)
    seconds, steps, decode_steps = 0.0, 0, 0
    while waiting or prefilling or decoding:
        while waiting and len(prefilling) + len(decoding) < max_seqs:
            prefilling.append(waiting.popleft())
        # decode tokens first: each reads its request's cache (ctx keys) and attends ctx + 1 keys
        tokens = len(decoding)
        kv_read = decode_ctx
        attended = decode_ctx + tokens
        budget = max_num_batched_tokens - tokens
        done_prefill: list[int] = []
        for i in prefilling:
            if budget <= 0:
                break
            a = computed[i]
            n = min(budget, input_lens[i] - a)
            tokens += n
            kv_read += a
            attended += n * a + n * (n + 1) // 2  # token at position p attends p + 1 keys
            computed[i] += n
            budget -= n
            if computed[i] == input_lens[i]:
                done_prefill.append(i)
        seconds += _step_cost(shape, dev, wbytes, kv_tok, tokens, kv_read, attended)
        steps += 1
        decode_steps += tokens == len(decoding)
        still: list[int] = []
        for i in decoding:
            left[i] -= 1
            if left[i] > 0:
                ctx[i] += 1
                still.append(i)
            else:
                decode_ctx -= ctx[i]
        decode_ctx += len(still)
        decoding = still
        for i in done_prefill:
            prefilling.remove(i)
            if left[i] > 0:
                decoding.append(i)
                decode_ctx += ctx[i]
    return Floor(seconds, sum(output_lens), steps, decode_steps)


def decode_step_floor(
    shape: ModelShape, context_lens: list[int], dev: DeviceSpec, dtype_bytes: int = 2,
    linear_bytes: float | None = None, kv_dtype_bytes: int | None = None,
) -> float:
    """Floor of one decode step for a batch whose requests have `context_lens` tokens cached."""
    kv_read = sum(context_lens)
    return _step_cost(
        shape,
        dev,
        shape.weight_bytes(dtype_bytes, linear_bytes),
        shape.kv_bytes_per_token(kv_dtype_bytes or dtype_bytes),
        len(context_lens),
        kv_read,
        kv_read + len(context_lens),
    )


def mean_decode_step_floor(
    shape: ModelShape,
    batch_size: int,
    input_len: int,
    num_decode_steps: int,
    dev: DeviceSpec,
    dtype_bytes: int = 2,
    linear_bytes: float | None = None,
    kv_dtype_bytes: int | None = None,
) -> float:
    """Mean floor over the decode steps of one batch: step k (k >= 1) has input_len + k - 1 tokens cached."""
    if num_decode_steps < 1:
        raise ValueError("need at least one decode step (output_len >= 2).")
    total = sum(
        decode_step_floor(shape, [input_len + k - 1] * batch_size, dev, dtype_bytes, linear_bytes, kv_dtype_bytes)
        for k in range(1, num_decode_steps + 1)
    )
    return total / num_decode_steps


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def linear_weight_bytes(method: str | None, quant_cfg: dict[str, Any] | None, dtype_bytes: int) -> float:
    """Stored bytes per weight of the quantized linear layers, scales and zero points included.

    method: the canonical quantization name (None: dense). quant_cfg: config.json's quantization_config
    (None: the method's defaults, as dummy weights use them: 4-bit group 128, W8A8). Example: AWQ 4-bit,
    group 128, zero points -> 0.5 + (2 + 0.5) / 128 = 0.5195 bytes a weight. GGUF on the GPU is
    dequantized to the dtype.
    """
    cfg = quant_cfg or {}
    if method is None or method == "gguf":
        return float(dtype_bytes)
    if method == "fp8":
        return 1.0
    if method in ("awq", "gptq"):
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        zeros = cfg.get("zero_point", True) if method == "awq" else not cfg.get("sym", True)
        return _grouped_bytes(bits, group, 2, zeros)
    if method == "compressed-tensors":
        groups = list((cfg.get("config_groups") or {}).values())
        weights = (groups[0].get("weights") if groups else None) or {"num_bits": 8}
        bits = int(weights.get("num_bits", 8))
        group = weights.get("group_size") if weights.get("strategy") == "group" else None
        return _grouped_bytes(bits, int(group), 2, not weights.get("symmetric", True)) if group else bits / 8
    raise ValueError(f"no weight-size rule for quantization method {method!r}")


def _grouped_bytes(bits: int, group: int, scale_bytes: int, zeros: bool) -> float:
    if group <= 0:  # one scale per output channel: negligible next to the weights
        return bits / 8
    return bits / 8 + (scale_bytes + (bits / 8 if zeros else 0)) / group


def engine_bytes(model_config: Any, cache_config: Any) -> tuple[int, float, int]:
    """(dtype bytes, linear weight bytes, KV bytes) of an engine's configs, for the floor functions."""
    from pagedllm.config import KV_CACHE_DTYPES
    from pagedllm.quantization.registry import checkpoint_quant_config

    db = dtype_bytes(model_config.dtype)
    lb = linear_weight_bytes(model_config.quantization, checkpoint_quant_config(model_config.hf_config), db)
    kv = db if cache_config.cache_dtype == "auto" else dtype_bytes(KV_CACHE_DTYPES[cache_config.cache_dtype])
    return db, lb, kv
