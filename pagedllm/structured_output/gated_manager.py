"""The manager's side of gated sampling (gate.py): a step whose constrained rows can sample with its
launch gets a gate (`gate_step`); after the step in flight is collected its bitmask job is posted
(`submit_gate`: the grammar workers, or the bitmask thread), whose filler opens the gate. A mixin of
StructuredOutputManager (manager.py), whose state it reads: the requests, the queued tokens, the
bitmask buffers, the backend, the flag words and the last gated job."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagedllm.structured_output.backend_types import GrammarBackendError
from pagedllm.structured_output.fill_thread import FillThread
from pagedllm.structured_output.gate import FlagWords, GateWatchdog, GrammarGate

if TYPE_CHECKING:
    from pagedllm.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)


class GatedSamplingMixin:
    def gate_step(self, so: SchedulerOutput) -> GrammarGate | None:
        """Before the launch: the step's gate, if it can sample with its launch, i.e. every
        constrained request that samples has its grammar active already (or ended for good). A
        request still reasoning is not gated: the token in flight may end its reasoning, and only
        the fill after it knows. None also when no row is constrained."""
        ids = self.sampling_request_ids(so)
        if not ids:
            return None
        last = self._gate_rows
        if last is not None and last[0] == self._layout_version and last[1] == ids:
            rows = last[1]  # the last gated step's rows, every grammar still active (nothing ended or left)
        else:
            requests = self.requests
            rows = []
            for rid in ids:
                sor = requests[rid]
                if sor.active_grammar is None and sor.activate() is None:
                    if sor.ended:
                        continue  # its grammar took its stop token: free from now on
                    return None
                rows.append(rid)
            if not rows:
                return None
            self._gate_rows = (self._layout_version, rows) if len(rows) == len(ids) else None
        combined = self._remote and self._backend.combined_gates
        return self._gate_flags().next_gate(rows, self._take_bitmask(len(rows)), combined)

    def _gate_flags(self) -> FlagWords:
        if self._flags is None:
            backend = self.backend()
            cuda = self.config.device_config.device == "cuda"
            device = torch.device("cuda") if cuda else None
            if self._remote:  # one flag word per worker (and their combined word), in the shared block
                self._flags = backend.gate_flags(device)
            else:
                self._flags = FlagWords(torch.zeros(1, dtype=torch.int32, pin_memory=cuda), device)
            if self._remote:
                backend.watch_gates(self._flags)
            else:
                self._gate_watchdog = GateWatchdog(self._flags)
        return self._flags

    def gate_forced(self, gate: GrammarGate) -> str | None:
        """Why `gate` was forced open unfilled (a watchdog's: its fillers died or stuck), if it was and
        its flags are still this manager's (after fail_over its constrained requests are aborted already)."""
        flags = self._flags
        if flags is None or gate.source is not flags or not gate.forced():
            return None
        return flags.failure or "a gate was forced open"

    def submit_gate(self, gate: GrammarGate) -> None:
        """After the step in flight was collected (its tokens queued by `advance`): feed the queued
        tokens and fill the gate's rows beside the step loop; the filler opens the gate. A row
        whose request finished or whose grammar ended meanwhile is all ones (its token is dropped,
        or free). If anything here fails, the gate is opened before the error propagates: a shut
        gate would stop the device's stream for good."""
        try:
            if gate.source is not self._flags:
                # Issued before a fail_over (in this very step, by the collect's): its requests are
                # aborted and nothing will fill it; opened so that the step's sampling can run.
                gate.open()
                return
            if self._gate_job is not None:
                self._wait_gate_job()
            requests, bitmask = self.requests, gate.bitmask
            accept, accepted_by = None, []
            if self._remote:
                layout = self._gate_layout
                if (layout is not None and not self._to_accept and layout[0] == self._layout_version
                        and layout[1] == gate.request_ids):
                    # The same rows as the last gated step, none finished or ended since: its layout.
                    if self._to_accept_one:
                        self._accept_queued()  # only queues them into the workers' next messages
                    self._gate_job = self.backend().send_gated(layout[2], bitmask, gate.seq)
                    return
                if self._to_accept_one or self._to_accept:
                    self._accept_queued()
            elif self.accept_on_thread and self._to_accept_one and not self._to_accept:
                # The batch accept goes to the thread too, its C++ call bound here (the fast path's
                # tokens are no stop tokens: nothing the step loop reads changes).
                one, self._to_accept_one = self._to_accept_one, {}
                accepted_by = list(one)
                accept = self.backend().accept_job([sor.active_grammar for sor in one], list(one.values()))
            elif self._to_accept_one or self._to_accept:
                self._accept_queued()  # xgrammar's batch accept, here (see accept_on_thread)
            grammars, rows = [], []
            for row, rid in enumerate(gate.request_ids):
                sor = requests.get(rid)
                g = sor.active_grammar if sor is not None else None
                if g is None:
                    bitmask[row] = -1  # finished (its token is dropped) or ended (free)
                    continue
                grammars.append(g)
                rows.append(row)
            backend = self.backend()
            if self._remote:
                self._gate_job, layout = backend.gate_job(grammars, bitmask, rows, gate.seq)
                # Kept for the next step while its rows are these (a row all ones is rewritten each
                # step, in the other buffer: not kept).
                full = len(rows) == len(gate.request_ids)
                self._gate_layout = (self._layout_version, list(gate.request_ids), layout) if full else None
                return
            fill = backend.fill_job(grammars, bitmask, None if len(rows) == len(gate.request_ids) else rows)
            flags, words, seq = self._flags, gate.flags, gate.seq

            def fill_and_open() -> None:
                try:
                    if accept is not None:
                        refused = accept()
                        if 0 in refused:
                            for sor, ok in zip(accepted_by, refused):
                                if not ok:
                                    sor.accepted([], ok=False)
                                    self.refused_ids.append(sor.request_id)
                    if grammars:
                        fill()
                finally:
                    # After the fill's stores: the device may copy the rows now. Raised, never lowered
                    # (a watchdog may have forced it further meanwhile).
                    flags.raise_words(words, seq)

            if self._fill_thread is None:
                self._fill_thread = FillThread()
            self._fill_thread.submit(fill_and_open)
            self._gate_job = self._fill_thread.wait
        except BaseException:
            gate.open()
            raise

    def _wait_gate_job(self) -> None:
        """The last gated job's end before another job uses the thread or the grammars (the thread's
        return; for the grammar workers, which send no reply, their error words), re-raising its error."""
        wait, self._gate_job = self._gate_job, None
        flags = self._flags
        if flags is not None and flags.failure is not None:
            # A watchdog forced a gate open: the filler is dead or stuck (a stuck bitmask thread's
            # wait would never return), so its job is not waited for; the caller fails over.
            raise GrammarBackendError(f"gated sampling: {flags.failure}")
        if wait is not None:
            wait()

    def _stop_gate_watchdog(self) -> None:
        if self._gate_watchdog is not None:
            self._gate_watchdog.stop()  # (after a failure it forces the gates open once more)
            self._gate_watchdog = None
