"""The structured-output backend interface (vLLM v1's shape): a backend compiles a request's
constraint into a grammar; a grammar advances with accepted tokens and fills its bitmask row.

Bitmask layout (xgrammar's, shared by every backend): int32 (rows, ceil(vocab_size / 32)); bit
j of word w of a row allows token 32 * w + j. Vocabulary 70 -> 3 words; token 33 is bit 1 of word 1.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from pagedllm.structured_output.params import StructuredOutputsParams


class GrammarBackendError(RuntimeError):
    """The grammar backend's own machinery failed (a grammar worker process exited, stuck, or failed
    a step): the grammars it holds are lost, so the constrained requests in flight cannot go on. The
    engine core aborts them and serves later ones with the in-process backend (manager.fail_over)."""


class StructuredOutputGrammar(ABC):
    """One request's matcher state."""

    # The tokens whose acceptance can end the grammar (its stop tokens); None when unknown, and
    # then the manager asks is_terminated after every token (the slow path).
    stop_ids: frozenset[int] | None = None

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance by `tokens`; False (and the state left at the first refused one) if any is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of the host bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""

    def may_terminate(self, token: int) -> bool:
        """Whether accepting `token` can end the grammar (a stop token); True when unknown. Lets the
        caller skip asking is_terminated after every ordinary token."""
        return self.stop_ids is None or token in self.stop_ids


class StructuredOutputBackend(ABC):
    vocab_size: int
    # True: the grammars live in another process (backend_process.py); the manager then sends the
    # fill job instead of running it, and tells the backend which requests are done (`release`).
    remote = False

    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem when `params` cannot be compiled (frontend, before queueing)."""

    @abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams, stop_token_ids: list[int]) -> StructuredOutputGrammar:
        """A fresh grammar for one request; thread-safe (called from a compile pool); cached by constraint."""

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill row rows[i] from grammars[i]; a backend may do it in parallel."""
        for grammar, row in zip(grammars, rows, strict=True):
            grammar.fill_bitmask(bitmask, row)

    def fill_job(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor) -> Callable[[], None]:
        """A call with no arguments that fills row i of `bitmask` from grammars[i], for the bitmask
        thread: a backend returns one whose first Python line is its GIL-free fill
        (structured_output/fill_thread.py says why)."""
        return functools.partial(self.fill_bitmasks, grammars, bitmask, list(range(len(grammars))))

    def accept_tokens_batch(self, grammars: list[StructuredOutputGrammar], tokens: list[int]) -> list[bool] | None:
        """Advance grammars[i] by the one token tokens[i]; a backend may do it in one call. None when
        every token was accepted, else one bool per grammar."""
        oks = [grammar.accept_tokens([token]) for grammar, token in zip(grammars, tokens, strict=True)]
        return None if all(oks) else oks

    def release(self, grammar: StructuredOutputGrammar) -> None:
        """A remote backend drops a finished request's grammar (the manager calls it when `remote`)."""
        return None  # an in-process grammar goes with its request

    def shutdown(self) -> None:
        """Let go of what the backend holds outside this process (the grammar worker's); idempotent."""
        return None  # an in-process backend holds nothing outside

    def allocate_bitmask(self, num_rows: int, pin_memory: bool = False) -> torch.Tensor:
        """Host int32 (num_rows, ceil(vocab_size / 32)), every token allowed (-1 is all bits set);
        pinned when it is bound for a GPU (its copy then needs no staging).

        Filled through numpy, not torch.full: torch's fill of these ~100k words runs on its intra-op
        thread pool, whose barrier stalls for milliseconds when other threads (xgrammar's fill
        threads, the frontend's) hold the cores (BENCHMARKS.md, structured outputs); numpy fills it in
        one thread in ~20 us."""
        bitmask = torch.empty((num_rows, (self.vocab_size + 31) // 32), dtype=torch.int32, pin_memory=pin_memory)
        bitmask.numpy().fill(-1)
        return bitmask
