"""PendingOutput: a launched step's sampled ids (and logprobs) on their way to the host.

    ModelRunner.execute_model -> PendingOutput   the device -> host copies queued, an event recorded
    engine core: pending.get()                   waits for the event, -> ModelRunnerOutput
    next execute_model                           the runner takes `sampled_ids` into its input batch

A sampled row per request that samples; the rest (mid-prefill chunks) read 0:

    req_ids ["a", "b", "c"], sample_rows [0, 2], sampled [7, 9]  ->  sampled_token_ids [7, 0, 9]
"""

from __future__ import annotations

import torch

from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.sample.sampler import LogprobsTensors
from pagedllm.worker.prompt_logprobs import to_lists


class PendingOutput:
    """A launched step's results, copied to the host in the background; `get()` waits for them.

    `get()` may be called more than once (it returns the same output) and touches nothing outside
    this object: the runner reads `sampled_ids` (None until read) at its next step."""

    def __init__(
        self,
        step_id: int,
        req_ids: list[str],
        sample_rows: list[int],
        sampled: torch.Tensor | None,
        logprobs: LogprobsTensors | None,
        num_logprobs: list[int | None],
    ) -> None:
        self.step_id = step_id
        self.req_ids = req_ids
        self.sample_rows = sample_rows
        self.num_logprobs = num_logprobs
        self.event = None
        if sampled is not None and sampled.is_cuda:
            sampled = sampled.to("cpu", non_blocking=True)
            if logprobs is not None:
                logprobs = LogprobsTensors(*(t.to("cpu", non_blocking=True) for t in logprobs))
            self.event = torch.cuda.Event()
            self.event.record()
        self.sampled = sampled
        self.logprobs = logprobs
        self.sampled_ids: list[int] | None = None  # one per sample row, once read
        self._output: ModelRunnerOutput | None = None
        self.before_read = None  # a gated CPU step: samples it (gated_cpu_sample.py)
        self._prompt_lp: tuple | None = None  # (job, ids, logprobs, ranks, event): attach_prompt_logprobs

    def attach_prompt_logprobs(self, job, ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor) -> None:
        """The step's prompt logprobs (worker/prompt_logprobs.py), copied to the host behind the step."""
        event = None
        if ids.is_cuda:
            ids, lps, ranks = (t.to("cpu", non_blocking=True) for t in (ids, lps, ranks))
            event = torch.cuda.Event()
            event.record()
        self._prompt_lp = (job, ids, lps, ranks, event)

    def _prompt_logprobs(self) -> dict | None:
        if self._prompt_lp is None:
            return None
        job, ids, lps, ranks, event = self._prompt_lp
        if event is not None:
            event.synchronize()
        return to_lists(job, ids, lps, ranks)

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            if self.before_read is not None:
                self.before_read()
            self._output = self._read()
        return self._output

    def _read(self) -> ModelRunnerOutput:
        if self.event is not None:
            self.event.synchronize()
        logprobs: list | None = None
        if self.sampled is None:
            return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=[0] * len(self.req_ids),
                                     prompt_logprobs=self._prompt_logprobs())
        ids = self.sampled.tolist()
        if len(ids) == len(self.req_ids):  # every row sampled (sample_rows is 0..R-1): no scatter
            sampled = list(ids)
        else:
            sampled = [0] * len(self.req_ids)
            for row, tok in zip(self.sample_rows, ids):
                sampled[row] = tok
        self.sampled_ids = ids
        if self.logprobs is not None:
            lp_ids, lps, ranks = self.logprobs.tolists()
            logprobs = [([], [], 0)] * len(self.req_ids)
            for j, (row, k) in enumerate(zip(self.sample_rows, self.num_logprobs)):
                if k is not None:
                    logprobs[row] = (lp_ids[j][: k + 1], lps[j][: k + 1], ranks[j])
        return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=self._prompt_logprobs())
