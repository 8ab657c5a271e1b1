"""The runner's own per-request state and the flat inputs of one step.

The runner remembers each running request's tokens and block ids, so a step only needs the
scheduler's deltas. `prepare_inputs` turns a SchedulerOutput into flat numpy arrays:

    requests A (prefill chunk of 3 at position 0) and B (decode at position 9), block_size 4
    input_ids    [a0, a1, a2, b9]
    positions    [0, 1, 2, 9]
    query_lens   [3, 1]   -> query_start_loc [0, 3, 4]
    seq_lens     [3, 10]
    slot_mapping [A0*4+0, A0*4+1, A0*4+2, B2*4+1]     # block ids from each block table
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    # Async scheduling: the token after token_ids was sampled by a step whose result has not
    # been collected yet; it sits at row `pending_row` of that step's sampled-ids tensor.
    pending_step: int | None = None
    pending_row: int = 0
    # Its row of InputBatch's persistent block table, and how many of block_ids are written there.
    table_row: int = -1
    num_table_blocks: int = 0


@dataclass
class StepInputs:
    req_ids: list[str]
    input_ids: np.ndarray  # int64 (T,)
    positions: np.ndarray  # int64 (T,)
    query_start_loc: np.ndarray  # int32 (R + 1,)
    seq_lens: np.ndarray  # int32 (R,)
    block_table: np.ndarray  # int32 (R, max_blocks)
    slot_mapping: np.ndarray  # int64 (T,)
    sample_rows: list[int]  # rows whose last known token is computed this step: they sample
    # Flat positions whose input token is still on the device (async scheduling), and the rows
    # of the previous step's sampled ids that hold them.
    pending_positions: list[int]
    pending_rows: list[int]


class InputBatch:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        self.prompt_logprob_ids: set[str] = set()  # requests asking for prompt logprobs (most steps: none)
        # Seeded requests draw from their own generator, so the batch around them does not matter.
        # It lives here, on the sampling device, from a request's first step to its end: a
        # preempted request's state is rebuilt when it resumes, its generator carries on.
        self.generators: dict[str, torch.Generator] = {}
        # Bumped whenever a request state is added or dropped: a state object seen under one
        # value is the one the runner holds for that request (the runner's SamplingMetadata cache).
        self.membership = 0
        # Every request's block ids, one row each, written as blocks arrive (vLLM's persistent block
        # table): a step gathers its rows with one numpy index instead of a copy per request.
        # Grows in both directions; a freed row is zeroed and reused.
        self._table = np.zeros((16, 16), dtype=np.int32)
        self._free_rows: list[int] = list(range(15, -1, -1))

    def _generator(self, req_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(req_id)
        if gen is None:
            gen = self.generators[req_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen

    def update_states(self, so: SchedulerOutput) -> None:
        if so.finished_req_ids or so.scheduled_new_reqs:
            # Another set of request states: what was cached for the old one is stale.
            self.membership += 1
        for req_id in so.finished_req_ids:
            self.prompt_logprob_ids.discard(req_id)
            st = self.requests.pop(req_id, None)
            if st is not None:
                self._release_row(st)
            if req_id not in so.preempted_req_ids:
                self.generators.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            if old is not None:  # rebuilt without a finish in between: its old row goes first
                self._release_row(old)
            st = self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                generator=self._generator(new.req_id, new.sampling_params.seed),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            self._write_blocks(st)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprob_ids.add(new.req_id)
        for cached in so.scheduled_cached_reqs:
            st = self.requests[cached.req_id]
            if cached.new_block_ids:
                st.block_ids.extend(cached.new_block_ids)
                self._write_blocks(st)
            st.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids:
                self._take_sent_tokens(st, cached.num_computed_tokens, cached.new_token_ids)

    def _write_blocks(self, st: CachedRequestState) -> None:
        """Copy the block ids not yet in st's table row there (a row first, if it has none)."""
        if st.table_row < 0:
            if not self._free_rows:
                rows = self._table.shape[0]
                self._table = np.concatenate([self._table, np.zeros_like(self._table)])
                self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
            st.table_row = self._free_rows.pop()
        n = len(st.block_ids)
        if n > self._table.shape[1]:
            width = max(n, 2 * self._table.shape[1])
            self._table = np.pad(self._table, ((0, 0), (0, width - self._table.shape[1])))
        self._table[st.table_row, st.num_table_blocks:n] = st.block_ids[st.num_table_blocks:]
        st.num_table_blocks = n

    def _release_row(self, st: CachedRequestState) -> None:
        if st.table_row >= 0:
            self._table[st.table_row, : st.num_table_blocks] = 0
            self._free_rows.append(st.table_row)
            st.table_row, st.num_table_blocks = -1, 0

    @staticmethod
    def _take_sent_tokens(st: CachedRequestState, num_computed: int, tokens: list[int]) -> None:
        """Pipeline parallel: sampled tokens from the scheduler, at positions max(num_computed,
        prompt) onwards; the ones this rank holds already are skipped. A prompt of 5, 2 outputs
        known, decode at num_computed 7 with [t7]: token_ids grows from 7 to 8."""
        first = max(num_computed, st.num_prompt_tokens)
        known = len(st.token_ids)
        assert first <= known, f"{st.req_id}: tokens {known}..{first} never arrived"
        new = tokens[known - first:]
        st.token_ids.extend(new)
        st.output_token_ids.extend(new)

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        req_ids = list(so.num_scheduled_tokens)
        num_reqs = len(req_ids)
        states = [self.requests[r] for r in req_ids]
        q_lens = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int32, count=num_reqs)
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])
        starts = np.array([st.num_computed_tokens for st in states], dtype=np.int64)
        seq_lens = (starts + q_lens).astype(np.int32)
        # positions: per request arange(start, start + q_len), without a Python loop over tokens.
        # q_lens [3, 1], starts [0, 9] -> offsets [0, 1, 2, 0] -> positions [0, 1, 2, 9]
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        offsets = np.arange(total, dtype=np.int64) - qsl[:-1].astype(np.int64)[req_of_token]
        positions = starts[req_of_token] + offsets

        # The rows of the persistent table, as wide as the longest one (zeros after each row's blocks).
        max_blocks = max(max([st.num_table_blocks for st in states], default=1), 1)
        table_rows = np.array([st.table_row for st in states], dtype=np.int64)
        block_table = self._table[table_rows, :max_blocks]  # a copy: later writes do not reach it
        input_ids = np.full(total, -1, dtype=np.int64)  # -1: a slot left unfilled fails loudly
        sample_rows: list[int] = []
        pending_positions: list[int] = []
        pending_rows: list[int] = []
        # Python ints: indexing numpy arrays element by element costs more than the loop itself.
        for i, (st, s, e, q0) in enumerate(zip(states, starts.tolist(), seq_lens.tolist(), qsl.tolist())):
            tokens = st.token_ids
            known = len(tokens)
            if e > known:
                # Only the newest token can be in flight: [s, known) from the host, then one.
                assert st.pending_step is not None and e == known + 1, f"{st.req_id}: tokens missing"
                if known > s:
                    input_ids[q0 : q0 + known - s] = tokens[s:known]
                pending_positions.append(q0 + known - s)
                pending_rows.append(st.pending_row)
                sample_rows.append(i)
            else:
                if e - s == 1:
                    input_ids[q0] = tokens[s]
                else:
                    input_ids[q0 : q0 + e - s] = tokens[s:e]
                if e == known and st.pending_step is None:
                    sample_rows.append(i)
        bs = self.block_size
        block_ids = block_table[req_of_token, positions // bs].astype(np.int64)
        slot_mapping = block_ids * bs + positions % bs
        return StepInputs(
            req_ids, input_ids, positions, qsl, seq_lens, block_table, slot_mapping, sample_rows,
            pending_positions, pending_rows,
        )

    def mark_pending(self, req_id: str, step_id: int, row: int) -> None:
        st = self.requests[req_id]
        st.pending_step, st.pending_row = step_id, row

    def append_sampled(self, req_id: str, token_id: int, step_id: int) -> None:
        """The token sampled by step `step_id` is known now (a no-op for a dropped request)."""
        self.append_sampled_rows([req_id], [0], [token_id], step_id)

    def append_sampled_rows(self, req_ids: list[str], rows: list[int], token_ids: list[int], step_id: int) -> None:
        """append_sampled for each (req_ids[row], token) of one step: the whole batch in one loop."""
        requests = self.requests
        for row, tok in zip(rows, token_ids):
            st = requests.get(req_ids[row])
            if st is None:
                continue
            st.token_ids.append(tok)
            st.output_token_ids.append(tok)
            if st.pending_step == step_id:
                st.pending_step = None
