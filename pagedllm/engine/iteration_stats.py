"""One batch of engine steps' outputs through the OutputProcessor, with the IterationStats they make.

The latencies need each request's token times before the outputs are applied (the first token of a
request is a time to first token, a later one an inter-token latency), the finished requests after:

    outputs [a: 1 token (a's first), b: 1 token, a: 1 token (a later step, merged)]
      -> time_to_first_tokens [now - a.arrival], inter_token_latencies [now - b.last, 0.0]
         num_generation_tokens 3; num_prompt_tokens len(a's prompt)

A request's later step in a merged batch (AsyncLLM takes the steps queued while it was behind as one)
arrives at the same instant as its earlier one: an inter-token latency of 0.
"""

from __future__ import annotations

import time

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats
from pagedllm.outputs import RequestOutput


def process_outputs_with_stats(
    op: OutputProcessor, outputs: list[EngineCoreOutput], queue_times: list[float]
) -> tuple[list[RequestOutput], dict[str, str], IterationStats]:
    """(RequestOutputs to deliver, {core id: stop string} for the core, the batch's stats)."""
    now = time.time()
    it = IterationStats(queue_times=queue_times)
    touched: dict[str, RequestState] = {}
    with_tokens: set[str] = set()  # requests whose earlier output in `outputs` carried tokens
    for o in outputs:
        st = op.request_states.get(o.request_id)
        if st is None:
            continue  # aborted, or stopped by a stop string while this step ran
        touched.setdefault(o.request_id, st)
        n = len(o.new_token_ids)
        if not n:
            continue
        it.num_generation_tokens += n
        if o.request_id in with_tokens:  # a later step of merged ones: here at the same instant
            it.inter_token_latencies.append(0.0)
        elif st.metrics.first_token_time is None:
            it.time_to_first_tokens.append(now - st.metrics.arrival_time)
            if st.index == 0:  # once per prompt, not per choice
                it.num_prompt_tokens += len(st.prompt_token_ids)
        elif st.metrics.last_token_time is not None:
            it.inter_token_latencies.append(now - st.metrics.last_token_time)
        with_tokens.add(o.request_id)
    request_outputs, stops = op.process_outputs(outputs)
    for st in touched.values():
        if st.finish_reason is not None:
            it.finished_requests.append(FinishedRequestStats.from_state(st, now))
    return request_outputs, stops, it
