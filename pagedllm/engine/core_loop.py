"""The engine core's busy loop, shared by both of AsyncLLM's engine shells: a thread of the frontend's
process (engine/core_client.py) and the engine process (engine/core_proc.py).

    while True:
        commands = next_commands(block=idle)      # wait only when nothing runs
        apply them (match on engine/messages.py)  # adds, aborts, stops, ... ; Shutdown ends the loop
        step() while requests run -> emit(StepOutputs)

Only this loop touches the EngineCore, which stays single-threaded. The shells supply
`next_commands` (a queue, or a pipe of msgpack frames) and `emit` (the frontend's OutputPump, or
the pipe back); `emit` returns False when the frontend is stopping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreCommand,
    EngineCoreReply,
    ErrorInfo,
    InjectFault,
    PrefixCacheReset,
    RequestFailure,
    RequestsFailed,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
    StopRequests,
)
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCoreLoop:
    def __init__(self, core: EngineCore, emit: Callable[[EngineCoreReply], bool],
                 fail_at_step: int | None = None) -> None:
        self.core = core
        self.emit = emit
        self.fail_at_step = fail_at_step  # the InjectFault test hook
        self.num_steps = 0
        # Added, not scheduled yet: their time in queue is measured when a step schedules them.
        self.unscheduled: dict[str, Request] = {}

    def run(self, next_commands: Callable[[bool], list[EngineCoreCommand]]) -> None:
        """Serve until Shutdown or until `emit` refuses. Exceptions propagate to the shell, which
        reports them (EngineDead) or, for a closed transport, just ends."""
        core = self.core
        while True:
            commands = next_commands(not core.has_unfinished_requests())
            if commands:
                if not self.apply(commands):
                    return
                if not core.has_unfinished_requests():
                    # Aborts may have emptied the engine: publish the state (0 running, free pool).
                    if not self.emit(StepOutputs([], core.make_stats(), [], self.num_steps)):
                        return
                    continue
            if not core.has_unfinished_requests():
                continue
            self.num_steps += 1
            if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
                raise RuntimeError(f"injected fault in engine step {self.num_steps} (test hook InjectFault)")
            outputs, queue_times = self.step()
            if not self.emit(StepOutputs(outputs, core.make_stats(), queue_times, self.num_steps)):
                return

    def apply(self, commands: list[EngineCoreCommand]) -> bool:
        """Apply frontend commands in order; False once Shutdown is among them."""
        core = self.core
        failures: list[RequestFailure] = []
        running = True
        for cmd in commands:
            match cmd:
                case AddRequests(requests=requests):
                    for r in requests:
                        try:  # a request the core cannot take fails alone; the loop serves the rest
                            req = r.to_request()
                            core.add_request(req)
                            self.unscheduled[req.request_id] = req
                        except Exception as e:  # noqa: BLE001 - reported to the request's owner
                            if not isinstance(e, ValueError):
                                logger.exception("engine core refused request %s", r.request_id)
                            failures.append(RequestFailure(r.request_id, ErrorInfo.from_exception(e)))
                case AbortRequests(request_ids=ids):
                    core.abort_requests(ids)
                case StopRequests(stops=stops):
                    core.stop_requests(stops)
                case ResetPrefixCache(call_id=call_id):
                    self.emit(PrefixCacheReset(call_id, core.reset_prefix_cache()))
                case InjectFault(at_step=at_step):
                    self.fail_at_step = at_step
                case Shutdown():
                    running = False
                    break
                case _:
                    raise AssertionError(f"unknown engine command {cmd!r}")
        if failures:
            self.emit(RequestsFailed(failures))
        return running

    def step(self) -> tuple[list[EngineCoreOutput], list[float]]:
        """One `core.step()`, and the time in queue of each request this step scheduled first: from
        its arrival until the step started (vLLM's time-in-queue metric)."""
        step_start = time.time()
        outputs = self.core.step()
        queue_times = []
        waiting = RequestStatus.WAITING
        for rid, req in [(rid, req) for rid, req in self.unscheduled.items() if req.status != waiting]:
            if req.is_finished():
                del self.unscheduled[rid]
            elif req.status != RequestStatus.WAITING:
                queue_times.append(step_start - req.arrival_time)
                del self.unscheduled[rid]
        return outputs, queue_times
