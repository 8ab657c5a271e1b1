"""The <think>...</think> parsers. Text-based, so one method serves a whole output and every
streamed prefix of it:

    split("<think>a b</think>\\n\\nAnswer", final=True)  -> ("a b", "Answer")
    split("<think>a b</th", final=False)              -> ("a b", None)   # "</th" may become "</think>"
"""

from __future__ import annotations

from typing import Any


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` ("ab</th", "</think>" -> 4)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    start = "<think>"
    end = "</think>"
    # Whether output that never closes the think block is reasoning (True) or answer (False).
    unclosed_is_reasoning = True

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        if self.end not in vocab:
            raise ValueError(
                f"--reasoning-parser needs {self.end!r} to be one token of the model's vocabulary; it is not."
            )
        self.end_token_id = vocab[self.end]

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning so far, answer so far or None while still thinking)."""
        body = text.lstrip()
        if not final and self.start.startswith(body):
            return "", None  # "<thi" may still open the block
        opened = body.startswith(self.start)
        if opened:
            body = body[len(self.start):]
        elif not self.unclosed_is_reasoning:
            # qwen3: the answer did not open a think block, so all of it is answer (a later
            # "</think>" is text); deciding otherwise would take back content already streamed.
            return "", text
        i = body.find(self.end)
        if i >= 0:
            return body[:i].lstrip("\n"), body[i + len(self.end):].lstrip("\n")
        hold = 0 if final else partial_suffix(body, self.end)
        return body[: len(body) - hold].lstrip("\n"), None

    def reasoning_ended_in_prompt(self, prompt: str) -> bool:
        """The prompt itself closes the think block (enable_thinking=false): the answer starts at once."""
        tail = prompt.rstrip()
        return tail.endswith(self.end)


class DeepSeekR1ReasoningParser(ReasoningParser):
    unclosed_is_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    unclosed_is_reasoning = False
