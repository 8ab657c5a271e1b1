"""The pooler: a step's flat hidden states -> one output per request.

    hidden (T, H), query_start_loc [0, 3, 7]  (request 0: tokens 0-2, request 1: tokens 3-6)
    CLS   -> rows [0, 3]                      LAST -> rows [2, 6]
    MEAN  -> mean of rows 0-2, mean of 3-6    ALL  -> hidden[0:3], hidden[3:7] (token embeddings)
    then, per request: embed    -> first `dimensions` values (matryoshka) -> L2-normalize
                       classify -> the model's head on the CLS row -> sigmoid (1 label) / softmax

Outputs are float32 on the CPU: they leave the engine right away.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.pooling.config import PoolerConfig
from pagedllm.pooling.params import PoolingParams


class Pooler:
    def __init__(self, config: PoolerConfig, model: nn.Module) -> None:
        self.config = config
        self.classify_fn = getattr(model, "classify", None)
        if config.task == "classify" and self.classify_fn is None:
            raise ValueError(f"{type(model).__name__} has no classification head; it can only embed.")

    def __call__(self, hidden: torch.Tensor, query_start_loc: np.ndarray,
                 params: list[PoolingParams]) -> list[torch.Tensor]:
        qsl = torch.from_numpy(query_start_loc.astype(np.int64))
        starts, ends = qsl[:-1], qsl[1:]
        cfg = self.config
        if cfg.pooling_type == "ALL":
            rows = hidden.float().cpu()
            return [self._finish_embed(rows[s:e], p) for s, e, p in zip(starts.tolist(), ends.tolist(), params)]
        if cfg.pooling_type == "CLS":
            pooled = hidden[starts.to(hidden.device)]
        elif cfg.pooling_type == "LAST":
            pooled = hidden[(ends - 1).to(hidden.device)]
        else:  # MEAN: one (R, T) x (T, H) product with 1/len weights (index_add_ took 0.2 s a step)
            lens = (ends - starts).to(torch.float32)
            tok = torch.arange(hidden.shape[0])[None, :]
            weights = ((tok >= starts[:, None]) & (tok < ends[:, None])).to(torch.float32) / lens[:, None]
            pooled = weights.to(hidden.device) @ hidden.float()
        if cfg.task == "classify":
            assert self.classify_fn is not None
            logits = self.classify_fn(pooled.to(hidden.dtype)).float().cpu()
            return [self._finish_classify(row, p) for row, p in zip(logits, params)]
        pooled = pooled.float().cpu()
        return [self._finish_embed(row, p) for row, p in zip(pooled, params)]

    def _finish_embed(self, x: torch.Tensor, p: PoolingParams) -> torch.Tensor:
        dims = p.dimensions if p.dimensions is not None else self.config.dimensions
        if dims is not None:
            x = x[..., :dims]
        normalize = self.config.normalize if p.normalize is None else p.normalize
        if normalize:
            x = F.normalize(x, p=2, dim=-1)  # sentence-transformers' Normalize (eps 1e-12)
        return x.contiguous()

    def _finish_classify(self, logits: torch.Tensor, p: PoolingParams) -> torch.Tensor:
        use = self.config.use_activation if p.use_activation is None else p.use_activation
        if not use:
            return logits
        return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)
