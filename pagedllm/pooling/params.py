"""`PoolingParams`: what a pooling request asks of the pooler (vLLM's class, its field names).

    PoolingParams()                               # the model's defaults (config or checkpoint)
    PoolingParams(dimensions=256)                 # matryoshka: the first 256 dims, re-normalized
    PoolingParams(normalize=False)                # raw pooled vector
    PoolingParams(task="score", use_activation=False)  # cross-encoder logit, no sigmoid

Every invalid value raises ValueError naming the field, so the server turns it into a 400.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pagedllm.sampling_params import RequestOutputKind

# vLLM's pooling tasks. "encode" is the generic one (LLM.encode): the model's own pooler output.
POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    task: str | None = None  # None: the frontend's call decides (embed, score, classify, encode)
    dimensions: int | None = None
    normalize: bool | None = None  # None: the model's pooler config (embed: True)
    use_activation: bool | None = None  # classify / score: softmax / sigmoid (None: on)
    truncate_prompt_tokens: int | None = None  # -1: the model's max length; k: keep the first k
    # Set by the frontend, never by users: a cross-encoder pair's segment ids (BERT token_type_ids).
    extra_kwargs: dict[str, Any] | None = field(default=None, repr=False)
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        for name in ("normalize", "use_activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be a boolean, got {v!r}.")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}.")

    # vLLM's older spelling of use_activation.
    @property
    def activation(self) -> bool | None:
        return self.use_activation

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)
