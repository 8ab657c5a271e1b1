"""Admission control: how much work the server takes on, decided before any tokenization.

The engine runs at most --max-num-seqs sequences at once; --max-num-queued-reqs more may wait.
Past that, a request gets 503 with `Retry-After` at once, instead of growing a queue whose tail
would time out anyway. Work is counted in sequences, as the engine runs them: a completions
request with 3 prompts and n=2 is 6.

    max_num_seqs=16, max_num_queued_reqs=32: 48 sequences in flight; the 49th gets 503.

A request holds its admission (a Ticket) from before tokenization until its last output has been
sent or it was aborted, so the count is exact and never waits on the engine's own statistics.
While the server drains for shutdown, nothing new is admitted.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus

from pagedllm.entrypoints.openai.errors import APIError

# Seconds a refused client is told to wait. Short: a slot frees whenever any request finishes.
RETRY_AFTER_S = 1
SHUTTING_DOWN_CODE = "server_shutting_down"


def shutting_down_error(message: str = "The server is shutting down and accepts no new requests.") -> APIError:
    # Connection: close, so a client's pool reconnects (through a load balancer, elsewhere).
    return APIError(message, HTTPStatus.SERVICE_UNAVAILABLE, code=SHUTTING_DOWN_CODE, headers={"Connection": "close"})


class Ticket:
    """One admitted request's share of the capacity; release() is idempotent."""

    def __init__(self, controller: AdmissionController, num_seqs: int) -> None:
        self.controller = controller
        self.num_seqs = num_seqs
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.controller._change(-self.num_seqs, -1)


class AdmissionController:
    """Event-loop only (no locks): admit() and Ticket.release() run on the server's loop."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_queued_reqs: int,
        *,
        on_reject: Callable[[str], None] | None = None,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}.")
        if max_num_queued_reqs < 0:
            raise ValueError(f"--max-num-queued-reqs must be >= 0, got {max_num_queued_reqs}.")
        self.max_num_seqs = max_num_seqs
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_in_flight = max_num_seqs + max_num_queued_reqs
        self.in_flight = 0  # sequences admitted and not yet finished
        self.num_requests = 0  # requests holding a ticket
        self.num_rejected = 0
        self.draining = False
        # Metrics hooks: on_reject(reason) per 503 ("queue_full" | "shutting_down"); on_change(in_flight).
        self.on_reject = on_reject or (lambda reason: None)
        self.on_change = on_change or (lambda in_flight: None)

    def _change(self, seqs: int, requests: int) -> None:
        self.in_flight += seqs
        self.num_requests += requests
        self.on_change(self.in_flight)

    def admit(self, num_seqs: int) -> Ticket:
        """A Ticket, or APIError: 503 while draining or full, 400 for a request that can never fit."""
        if self.draining:
            self.on_reject("shutting_down")
            raise shutting_down_error()
        if num_seqs > self.max_in_flight:
            raise APIError(
                f"This request needs {num_seqs} sequences (prompts x n), more than the {self.max_in_flight} the "
                f"server ever runs or queues at once (--max-num-seqs {self.max_num_seqs} + --max-num-queued-reqs "
                f"{self.max_num_queued_reqs}). Send fewer prompts or a smaller n.",
                param="n",
            )
        if self.in_flight + num_seqs > self.max_in_flight:
            self.num_rejected += 1
            self.on_reject("queue_full")
            raise APIError(
                f"The server is at capacity ({self.in_flight} sequences running or queued, at most "
                f"{self.max_in_flight}: --max-num-seqs {self.max_num_seqs} + --max-num-queued-reqs "
                f"{self.max_num_queued_reqs}). Retry after {RETRY_AFTER_S} s.",
                HTTPStatus.SERVICE_UNAVAILABLE,
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._change(num_seqs, 1)
        return Ticket(self, num_seqs)
