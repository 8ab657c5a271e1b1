"""The last guard before a constrained token is emitted: was it allowed by the step's bitmask?

The grammar bitmask sets every token the grammar forbids to -inf. Other masks of the same request do
the same to other tokens: allowed_token_ids (all but the listed ids), bad_words (a banned next token)
and min_tokens (the stop tokens, until the output is long enough). Together they may leave no token at
all, e.g. a `choice` of ["yes"] at min_tokens=3: after "yes" the grammar allows only EOS, which
min_tokens bans. A row of -inf samples some token all the same (argmax of the row: id 0), one the
grammar refuses. Such a token must never reach the client.

So the rows of requests that carry such a mask (`needs_sample_check`: usually none, and then nothing
here runs) are checked when their step is collected, before the scheduler takes the tokens: a sampled
token whose bit is 0 in the bitmask row it was sampled under ends its request with an error (engine
core: finish_reason "error", the token dropped, the KV blocks freed); the batch's other rows are left
as they are. The conflicts the frontend can see before queueing are refused there with a 400
(conflicts.py); this catches the rest (a conflict reached later in the output).

    bitmask row (int32 words): token t allowed  <=>  (row[t // 32] >> (t % 32)) & 1
    t = 70 -> word 2, bit 6
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.sampling_params import SamplingParams


def needs_sample_check(params: SamplingParams) -> bool:
    """Whether a constrained request carries a mask that may, with its grammar, leave no token."""
    return bool(params.allowed_token_ids or params.bad_words_token_ids or params.min_tokens)


def conflicting_masks(params: SamplingParams) -> str:
    """The request's masks besides the grammar, by their field names: 'allowed_token_ids and min_tokens'."""
    names = [name for name, on in (("allowed_token_ids", params.allowed_token_ids),
                                   ("bad_words", params.bad_words_token_ids),
                                   ("min_tokens", params.min_tokens)) if on]
    return " and ".join(names)


def token_allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    """bitmask_row: int32 (W,) host tensor (a view of the step's bitmask)."""
    word = int(bitmask_row[token >> 5])
    return (word >> (token & 31)) & 1 == 1


class SampleChecks:
    """Steps in flight whose bitmask has rows to check: id(SchedulerOutput) -> ([(request id, bitmask
    row)], the step's host bitmask). Recorded when the step's bitmask is taken (its fill may still run),
    read once when it is collected (the buffer's next fill comes two steps later: manager.py)."""

    # More steps than ever in flight at once (async scheduling: 2; a pipeline-parallel batch queue: its
    # depth): an entry this old belongs to a step that was never collected (an engine failing over).
    MAX_STEPS = 16

    def __init__(self) -> None:
        # The entry holds its SchedulerOutput, so that object's id cannot be reused while it is here.
        self._steps: dict[int, tuple[SchedulerOutput, list[tuple[str, int]], torch.Tensor]] = {}

    def record(self, so: SchedulerOutput, rows: list[tuple[str, int]], bitmask: torch.Tensor) -> None:
        if len(self._steps) >= self.MAX_STEPS:
            del self._steps[next(iter(self._steps))]
        self._steps[id(so)] = (so, rows, bitmask)

    def snapshot(self, so: SchedulerOutput) -> None:
        """Keep copies of the checked rows (a bitmask filled at once, whose buffer may be reused before
        the step is collected: a pipeline-parallel batch queue deeper than the two buffers)."""
        entry = self._steps.get(id(so))
        if entry is not None:
            _, rows, bitmask = entry
            self._steps[id(so)] = (so, [(rid, i) for i, (rid, _) in enumerate(rows)],
                                   bitmask[[row for _, row in rows]].clone())

    def refused(self, so: SchedulerOutput, result: ModelRunnerOutput, live) -> dict[str, int]:
        """The checked rows of `so` whose sampled token the bitmask forbids: request id -> token.
        `live`: the requests still constrained (a row whose request left meanwhile is skipped)."""
        entry = self._steps.pop(id(so), None)
        if entry is None:
            return {}
        _, rows, bitmask = entry
        refused: dict[str, int] = {}
        req_ids = result.req_ids
        for rid, row in rows:
            if rid not in live or rid not in req_ids:
                continue
            token = result.sampled_token_ids[req_ids.index(rid)]
            if not token_allowed(bitmask[row], token):
                refused[rid] = token
        return refused

    def clear(self) -> None:
        self._steps.clear()
