"""MLA's prefill path: a step's prefill chunks attend with the latents expanded into per-head K/V.

The cache keeps only the latent [c_kv (r) | k_pe (rope)] per token (attention/mla.py). Decode tokens
attend in latent space (absorbed weights: cheap per key, one key row for all heads). A prefill
chunk of q tokens over s keys costs q * s * H * (r + rope + r) MACs that way; expanding the s
latents once through kv_b_proj (s * r * H * (nope + v) MACs) and attending per head costs
q * s * H * (nope + rope + v) more: DeepSeek-V2-Lite's 192 + 128 against 576 + 512 per pair, and the
expansion pays for itself from a few query tokens on. vLLM's MLA backends split a step the same way.

A step's plan (built once on the host from the metadata's host ints, shared by every layer):
  decode requests (query_len 1, 1-token chunks included) -> the absorbed path, with their own
    decode-only metadata (so mla_decode runs, as in a decode-only step);
  prefill requests (query_len > 1) -> passes: each pass gathers at most `max_keys` keys' latents
    from the paged cache (this step's already written), expands them and runs the prefill
    attention (kernels/mla_prefill.py on the Triton backend, `mla_prefill_ref` elsewhere). A request
    whose keys do not fit one pass is cut into ranges over consecutive passes, merged through lse.

Pass size: max(step tokens, MIN_PASS_KEYS) keys, so the largest expansion of any step is that of
the memory-profiling step (max_num_batched_tokens keys; worker/gpu_memory.py) or MIN_PASS_KEYS.
DeepSeek-V2-Lite: 16 x 256 expanded + 576 latent features = 9.3 KB a key in bf16 (4096 keys: 38 MB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.host_copy import to_device_async

__all__ = ["MIN_PASS_KEYS", "MLAStepPlan", "mla_prefill_forward", "mla_prefill_ref", "plan_mla_step"]

MIN_PASS_KEYS = 4096
_LOG2E = 1.0 / math.log(2.0)


@dataclass
class PrefillPass:
    entries_host: list[tuple[int, int, int, int, int, int]]  # (q_start, q_len, k_start, k_len, delta, first)
    slots: torch.Tensor  # int64 (num_keys,): cache slots of the pass's keys, in entry order
    entries: torch.Tensor  # int32 (num_entries, 6) on the device
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)  # BLOCK_M -> int32 (num_tiles, 2), built lazily

    def tiles_for(self, block_m: int) -> torch.Tensor:
        """(entry, first query row) of every BLOCK_M-row program; rows that see no key of the
        entry's range (i + delta < 0) are left out."""
        if block_m not in self.tiles:
            rows = [(e, off) for e, (_, q_len, _, _, delta, _) in enumerate(self.entries_host)
                    for off in range(max(0, -delta) // block_m * block_m, q_len, block_m)]
            t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
            self.tiles[block_m] = to_device_async(t, self.slots.device)
        return self.tiles[block_m]


@dataclass
class MLAStepPlan:
    md: AttentionMetadata  # the step this plan is for (compared by identity)
    decode_md: AttentionMetadata | None  # the decode requests as a decode-only batch; None: none
    decode_tokens: torch.Tensor | None  # int64 (num_decodes,): their rows in the step's tokens
    passes: list[PrefillPass]


_last_plan: list[MLAStepPlan] = []  # one entry: every layer of a step reuses its plan


def plan_mla_step(md: AttentionMetadata, block_size: int, max_keys: int | None = None) -> MLAStepPlan:
    """The step's split into decode and prefill requests and its prefill passes (cached per md)."""
    if _last_plan and _last_plan[0].md is md and max_keys is None:
        return _last_plan[0]
    n = md.num_reqs
    qsl = md.query_start_loc_cpu[: n + 1].tolist()
    seq = md.seq_lens_cpu[:n].tolist()
    dev = md.query_start_loc.device
    dec = [r for r in range(n) if qsl[r + 1] - qsl[r] == 1]
    pre = [r for r in range(n) if qsl[r + 1] - qsl[r] > 1]
    decode_md = decode_tokens = None
    if dec:
        idx = to_device_async(torch.tensor([dec, [qsl[r] for r in dec]], dtype=torch.int64), dev)
        decode_tokens = idx[1]
        nd = len(dec)
        decode_md = AttentionMetadata(
            num_actual_tokens=nd, num_reqs=nd, max_query_len=1, max_seq_len=max(seq[r] for r in dec),
            query_start_loc=torch.arange(nd + 1, dtype=torch.int32, device=dev),
            seq_lens=md.seq_lens[idx[0]], block_table=md.block_table[idx[0]], slot_mapping=md.slot_mapping[idx[1]],
            query_start_loc_cpu=torch.arange(nd + 1, dtype=torch.int32),
            seq_lens_cpu=torch.tensor([seq[r] for r in dec], dtype=torch.int32),
        )
    cap = max_keys or max(md.num_actual_tokens, MIN_PASS_KEYS)
    # Greedy fill: each request's keys 0 .. seq_len - 1 in order, cut where a pass is full.
    groups: list[list[tuple[int, int, int]]] = [[]]  # per pass: (request, range start, range end)
    used = 0
    for r in pre:
        a = 0
        while a < seq[r]:
            if used == cap:
                groups.append([])
                used = 0
            b = min(seq[r], a + cap - used)
            groups[-1].append((r, a, b))
            used += b - a
            a = b
    passes = [_make_pass(g, qsl, seq, md, block_size) for g in groups if g]
    plan = MLAStepPlan(md, decode_md, decode_tokens, passes)
    if max_keys is None:
        _last_plan[:] = [plan]
    return plan


def _make_pass(group: list[tuple[int, int, int]], qsl: list[int], seq: list[int], md: AttentionMetadata,
               block_size: int) -> PrefillPass:
    entries, k_start = [], 0
    for r, a, b in group:
        q_len = qsl[r + 1] - qsl[r]
        entries.append((qsl[r], q_len, k_start, b - a, seq[r] - q_len - a, int(a == 0)))
        k_start += b - a
    lens = np.array([b - a for _, a, b in group], dtype=np.int64)
    starts = np.cumsum(lens) - lens
    reqs = np.repeat(np.array([r for r, _, _ in group], dtype=np.int64), lens)
    pos = np.arange(k_start, dtype=np.int64) - np.repeat(starts - np.array([a for _, a, _ in group]), lens)
    dev = md.query_start_loc.device
    host = torch.from_numpy(np.stack([reqs, pos]))
    rp = to_device_async(host, dev)
    blocks = md.block_table[rp[0], rp[1] // block_size].long()
    slots = blocks * block_size + rp[1] % block_size
    ent = to_device_async(torch.tensor(entries, dtype=torch.int32), dev)
    return PrefillPass(entries, slots, ent)


def mla_prefill_ref(
    out: torch.Tensor,  # (T, H, DV), written at the entries' query rows
    lse: torch.Tensor,  # fp32 (T, H): log2 of the softmax denominator (base-2 scores), for merging
    q_nope: torch.Tensor,  # (T, H, NOPE)
    q_pe: torch.Tensor,  # (T, H, ROPE)
    k_nope: torch.Tensor,  # (K, H, NOPE)
    k_pe: torch.Tensor,  # (K, ROPE)
    v: torch.Tensor,  # (K, H, DV)
    entries: list[tuple[int, int, int, int, int, int]],
    scale: float,
) -> None:
    """Plain torch of kernels/mla_prefill.py's one pass (the CPU path and the kernel's reference)."""
    h = q_nope.shape[1]
    for qs, ql, ks, kl, delta, first in entries:
        q = torch.cat([q_nope[qs : qs + ql], q_pe[qs : qs + ql]], -1).float()
        k = torch.cat([k_nope[ks : ks + kl], k_pe[ks : ks + kl, None, :].expand(kl, h, -1)], -1).float()
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        hidden = torch.arange(kl)[None, :] > (torch.arange(ql) + delta)[:, None]  # (ql, kl)
        s = s.masked_fill(hidden.to(s.device)[None], float("-inf"))
        lse_e = torch.logsumexp(s, -1)  # (H, ql); -inf where a row sees no key of the range
        p = torch.exp(s - torch.where(torch.isinf(lse_e), 0.0, lse_e)[..., None])
        o = torch.einsum("hqk,khv->qhv", p, v[ks : ks + kl].float())
        lse2 = (lse_e * _LOG2E).transpose(0, 1)  # (ql, H), base 2 as the kernel keeps it
        if not first:
            prev_o, prev_l = out[qs : qs + ql].float(), lse[qs : qs + ql]
            top = torch.maximum(prev_l, lse2)
            w_prev, w_cur = torch.exp2(prev_l - top), torch.exp2(lse2 - top)
            o = (prev_o * w_prev[..., None] + o * w_cur[..., None]) / (w_prev + w_cur)[..., None]
            lse2 = top + torch.log2(w_prev + w_cur)
        out[qs : qs + ql] = o.to(out.dtype)
        lse[qs : qs + ql] = lse2


def mla_prefill_forward(
    out: torch.Tensor,  # (T, H, v): the prefill requests' rows are written
    q_nope: torch.Tensor,  # (T, H, nope)
    q_pe: torch.Tensor,  # (T, H, rope), rotated
    kv_cache: torch.Tensor,  # (1, num_blocks, block_size, 1, r + rope), this step's latents written
    w_kv: torch.Tensor,  # kv_b_proj's weight (H * (nope + v), r)
    plan: MLAStepPlan,
    scale: float,
    use_triton: bool,
) -> None:
    """Every pass of the plan: gather the keys' latents, expand them, attend."""
    t, h, nope = q_nope.shape
    width = kv_cache.shape[-1]
    r = w_kv.shape[1]
    flat = kv_cache.view(-1, width)
    lse = torch.empty((t, h), dtype=torch.float32, device=out.device)
    for p in plan.passes:
        lat = flat[p.slots].to(w_kv.dtype)  # (K, r + rope)
        kv = torch.nn.functional.linear(lat[:, :r], w_kv).view(lat.shape[0], h, -1)  # (K, H, nope + v)
        k_nope, v, k_pe = kv[..., :nope], kv[..., nope:], lat[:, r:]
        if use_triton:
            from pagedllm.kernels.mla_prefill import PREFILL_TILE, mla_prefill_attention

            mla_prefill_attention(out, lse, q_nope, q_pe, k_nope, k_pe, v, p.entries, p.tiles_for(PREFILL_TILE[0]),
                                  scale)
        else:
            mla_prefill_ref(out, lse, q_nope, q_pe, k_nope, k_pe, v, p.entries_host, scale)
