"""One request's grammar, as the engine core holds it: compiled in the manager's pool, advanced by
the tokens the scheduler accepted, asked for its bitmask row before each sampling step.

Reasoning models: with `_reasoning_end_token_ids` set (the frontend's reasoning parser), the
thinking text is unconstrained; the grammar starts with the first token after the end token.
    output  [<think>, a, b, </think>, {, "]  ->  the grammar sees [{, "]
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from pagedllm.structured_output.backend_types import StructuredOutputGrammar
from pagedllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    def __init__(self, request_id: str, params: StructuredOutputsParams, future: Future) -> None:
        self.request_id = request_id
        self.params = params
        self.future = future  # -> StructuredOutputGrammar
        self.reasoning_end_ids = frozenset(params._reasoning_end_token_ids)
        self.reasoning_ended = not self.reasoning_end_ids
        self.ended = False  # the grammar accepted a stop token (kept here: read per row per step)
        self.check_samples = False  # its sampled tokens are checked against its bitmask (sample_check.py)
        self.refused = False  # the grammar refused an accepted token: the request is ended with an error
        self._grammar: StructuredOutputGrammar | None = None
        # The grammar while it constrains the next token (compiled, reasoning over, not ended), else
        # None: the one attribute the manager's per-row loops read (set by `activate`).
        self.active_grammar: StructuredOutputGrammar | None = None

    @property
    def ready(self) -> bool:
        return self._grammar is not None or self.future.done()

    @property
    def grammar(self) -> StructuredOutputGrammar:
        # Kept once compiled: Future.result() takes a lock, and this is read per row per step.
        if self._grammar is None:
            self._grammar = self.future.result()
        return self._grammar

    def grammar_tokens(self, new_token_ids: list[int]) -> list[int]:
        """The part of accepted tokens the grammar must see (none while reasoning, or once it has
        ended: after the stop token the request is finishing)."""
        tokens = new_token_ids
        if not self.reasoning_ended:
            for i, t in enumerate(tokens):
                if t in self.reasoning_end_ids:
                    self.reasoning_ended = True
                    tokens = tokens[i + 1:]
                    break
            else:
                return []
        if not tokens or self.ended:
            return []
        return tokens

    def accepted(self, tokens: list[int], ok: bool, refused: list[int] | None = None) -> bool:
        """Book `tokens` fed to the grammar (by `advance`; the manager's batch call books its own
        and reports a refused token here as `refused`)."""
        grammar = self.grammar
        if any(grammar.may_terminate(t) for t in tokens):
            self.ended = grammar.is_terminated()
            if self.ended:
                self.active_grammar = None
        if not ok:
            # Never expected: the bitmask allowed the token, and a row that another mask left without
            # any allowed token is caught before its token is emitted (sample_check.py). The manager
            # reports the request (`refused_ids`) and the engine core ends it with an error.
            logger.error("%s: the grammar refused sampled tokens %s", self.request_id, refused or tokens)
            self.refused = True
        return ok

    def advance(self, new_token_ids: list[int]) -> bool:
        """Feed accepted tokens; False if the grammar refused one (see `accepted`)."""
        tokens = self.grammar_tokens(new_token_ids)
        if not tokens:
            return True
        return self.accepted(tokens, self.grammar.accept_tokens(tokens))

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is constrained (reasoning over, grammar not yet ended)."""
        return self.reasoning_ended and not self.ended

    def activate(self) -> StructuredOutputGrammar | None:
        """`active_grammar`, set once the next token is constrained (the request is scheduled only
        once its grammar compiled, so `grammar` does not block here)."""
        if self.active_grammar is None and self.constrains_next:
            self.active_grammar = self.grammar
        return self.active_grammar
