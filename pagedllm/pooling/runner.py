"""The pooling runner: the generation runner's inputs and forward, then a pooler instead of a sampler.

How a pooling request runs (decided for both encoders and decoder embedders):
- The scheduler runs its prompt whole in one step: runner="pooling" turns chunked prefill off (a
  mean over a prompt split across steps would need the earlier chunks' hidden states) and prefix
  caching off (a cached prefix would skip tokens the pooler reads). As vLLM does for encoders.
- Encoders (BERT, XLM-RoBERTa) attend bidirectionally over the step's own tokens (models/bert.py)
  and have no attention layer with a KV cache: the block pool is bookkeeping only (no memory
  behind it), sized for max_num_seqs prompts of max_model_len tokens.
- Decoder embedders attend causally through the paged KV cache like generation; their blocks are
  freed when the request finishes, at the end of its one step.
- The request then finishes with the pooled output (Scheduler.update_from_output).
"""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import cdiv
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.host_copy import to_device_async
from pagedllm.pooling.pooler import Pooler
from pagedllm.worker.model_runner import ModelRunner


def encoder_num_blocks(config: EngineConfig) -> int:
    """Bookkeeping blocks of a model with no KV cache (an encoder): a full batch of longest prompts."""
    sc = config.scheduler_config
    return sc.max_num_seqs * cdiv(sc.max_model_len, config.cache_config.block_size)


def make_model_runner(config: EngineConfig, model: torch.nn.Module, device: torch.device) -> ModelRunner:
    """The generation runner, or this one for runner="pooling" (the worker's one hook)."""
    if config.model_config.runner_type == "pooling":
        return PoolingModelRunner(config, model, device)
    return ModelRunner(config, model, device)


class PoolingModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
        super().__init__(config, model, device)
        pooler_config = config.model_config.pooler_config
        assert pooler_config is not None, "runner='pooling' resolves a pooler config"
        self.pooler = Pooler(pooler_config, self.model)
        self.uses_token_type_ids = bool(getattr(self.model, "uses_token_type_ids", False))

    def make_graph_runner(self, tuning: bool = True) -> None:
        """No CUDA graphs: every pooling step is a prefill."""
        return None

    def capture_model(self, tuning: bool = True, runner: object = None) -> None:
        """No CUDA graphs (make_graph_runner)."""

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> PooledOutput:
        self.input_batch.update_states(so)
        self.step_id += 1
        if so.total_num_scheduled_tokens == 0:
            return PooledOutput(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        params = {new.req_id: new.pooling_params for new in so.scheduled_new_reqs}
        inp = self.input_batch.prepare_inputs(so)
        # Whole prompts only (see the module docstring): every request is new and pools this step.
        assert len(inp.sample_rows) == len(inp.req_ids) and all(r in params for r in inp.req_ids), \
            "a pooling request was scheduled in pieces"
        md = self._metadata(inp)
        dev = self.device
        input_ids = to_device_async(torch.from_numpy(inp.input_ids), dev)
        positions = to_device_async(torch.from_numpy(inp.positions), dev)
        kwargs = {}
        if self.uses_token_type_ids:
            kwargs["token_type_ids"] = self._token_type_ids(inp.req_ids, params, len(inp.input_ids))
        hidden = self.model(input_ids, positions, md, **kwargs)
        pooled = self.pooler(hidden, inp.query_start_loc, [params[r] for r in inp.req_ids])
        return PooledOutput(ModelRunnerOutput(
            req_ids=inp.req_ids, sampled_token_ids=[0] * len(inp.req_ids), pooler_output=pooled,
        ))

    def _token_type_ids(self, req_ids: list[str], params: dict, num_tokens: int) -> torch.Tensor | None:
        """Segment ids of cross-encoder pairs, flat in batch order; None when no request has any."""
        per_req = [(params[r].extra_kwargs or {}).get("token_type_ids") for r in req_ids]
        if all(t is None for t in per_req):
            return None
        flat: list[int] = []
        for r, t in zip(req_ids, per_req):
            flat.extend(t if t is not None else [0] * len(self.input_batch.requests[r].token_ids))
        assert len(flat) == num_tokens
        return to_device_async(torch.tensor(flat, dtype=torch.int64), self.device)


class PooledOutput:
    """A pooling step's results, ready at once (the pooler copied them to the host)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def get(self) -> ModelRunnerOutput:
        return self.output
