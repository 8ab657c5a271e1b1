"""Incremental detokenization and stop strings.

Decoding token by token loses leading spaces (SentencePiece's "▁") and splits multibyte
characters across tokens. So each step decodes a short window twice — the tokens already shown
(prefix..read) and the same window plus the new ones — and emits only the difference, and only
once it no longer ends in an incomplete character (U+FFFD):

    ids = [..., "▁The", "▁capital"], prefix window "▁The" -> "The"; with "▁capital" -> "The capital"
    new text = " capital"   (the space survives because "▁The" is in the window)

Several tokens at once (the steps a lagging frontend merges: engine/output_pump.py) decode the two
windows once for all of them when the tokenizer is byte-level BPE (its text is the UTF-8 of the tokens'
bytes, so one window's difference is the per-token differences joined), and token by token when that
window ends in an incomplete character (the per-token loop then emits what is complete, as before).

`spaces_between_special_tokens=False` (with `skip_special_tokens=False`) is vLLM's rule: an added token
right after another added token is emitted as its raw text, so "[CLS] [SEP]" (a WordPiece decode) reads
"[CLS][SEP]". Tokenizers whose decode puts nothing between added tokens (byte-level BPE) are unchanged.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


def byte_level(tokenizer: Any) -> bool:
    """Whether `tokenizer` is a fast tokenizer whose decoder is byte-level BPE's (GPT-2, Llama 3, Qwen,
    SmolLM): decoding a window is decoding its tokens' bytes, with no per-token spacing rules."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"


def rust_decoder(tokenizer: Any) -> Any | None:
    """`tokenizer.decode` without transformers' Python around the Rust call, when that call is all
    it does: a fast tokenizer whose `_decode` is the library's own, with no clean-up pass. Each token
    decodes two short windows, so the wrapper's per-call conversions (to_py_obj, kwargs) were most of
    the frontend's detokenization time (BENCHMARKS.md, issue 16). None: use `tokenizer.decode`."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    owner = next((c for c in type(tokenizer).__mro__ if "_decode" in c.__dict__), None)
    if owner is None or owner.__module__ not in ("transformers.tokenization_utils_tokenizers",
                                                 "transformers.tokenization_utils_fast"):
        return None
    return backend.decode
# How many already-shown tokens to keep in the window; enough for any merge/space effect.
_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._rust_decode = rust_decoder(tokenizer)
        # {token id: its text} of the added tokens, when adjacent ones must not be spaced apart.
        self._added: dict[int, str] = {}
        if not (spaces_between_special_tokens or skip_special_tokens):
            self._added = {tid: tok.content for tid, tok in tokenizer.added_tokens_decoder.items()}
        # Several new tokens may share one pair of decodes (byte-level BPE without the added-token rule).
        self._batch_decode = not self._added and byte_level(tokenizer)
        self._last_added = False
        self.ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        # Streaming holds back the tail that could still grow into a stop string, so streamed
        # text never shows characters the final text will not have.
        self.stop_buffer_length = max((len(s) for s in self.stop), default=1) - 1
        self._sent_len = 0

    def _decode(self, ids: list[int]) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string if one appeared (output_text is then cut there)."""
        start_len = len(self.output_text)
        if len(new_token_ids) > 1 and self._batch_decode and self._update_at_once(new_token_ids):
            return self._check_stop_strings(start_len) if self.stop else None
        for tok in new_token_ids:
            self.ids.append(tok)
            raw = self._added.get(tok) if self._added else None
            if raw is not None and self._last_added:
                self.output_text += raw  # adjacent added tokens: no space between them (vLLM's rule)
                self.prefix_offset = max(self.read_offset, len(self.ids) - _WINDOW)
                self.read_offset = len(self.ids)
                continue
            self._last_added = raw is not None
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full_text = self._decode(self.ids[self.prefix_offset :])
            if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
                self.output_text += full_text[len(prefix_text) :]
                self.prefix_offset = max(self.read_offset, len(self.ids) - _WINDOW)
                self.read_offset = len(self.ids)
        return self._check_stop_strings(start_len) if self.stop else None

    def _update_at_once(self, new_token_ids: list[int]) -> bool:
        """All of `new_token_ids` with one pair of decodes; False (nothing changed) when the text would
        end in an incomplete character: the token-by-token loop then emits the complete part."""
        n = len(self.ids)
        self.ids.extend(new_token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if full_text.endswith(_REPLACEMENT):
            del self.ids[n:]
            return False
        if len(full_text) > len(prefix_text):
            self.output_text += full_text[len(prefix_text) :]
            self.prefix_offset = max(self.read_offset, len(self.ids) - _WINDOW)
            self.read_offset = len(self.ids)
        return True

    def _check_stop_strings(self, start_len: int) -> str | None:
        """The stop string that appears first in the new text (output_text cut there), or None. One
        update may add several characters: stop ["e", " "] and new text " competitors" stop at the
        " " (index 0), not at the "e" listed first, or the text returned would hold a stop string."""
        best: tuple[int, int] | None = None  # (index, position in self.stop)
        for k, s in enumerate(self.stop):
            # Only a match that ends inside the new text can be new.
            idx = self.output_text.find(s, max(0, start_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, k)
        if best is None:
            return None
        idx, k = best
        s = self.stop[k]
        self.output_text = self.output_text[:idx + len(s) if self.include_stop_str_in_output else idx]
        return s

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to show now: all of it, or only what is new since the last delta."""
        hold = 0 if finished or self.include_stop_str_in_output else self.stop_buffer_length
        end = max(len(self.output_text) - hold, self._sent_len if delta else 0)
        if not delta:
            return self.output_text[:end]
        text = self.output_text[self._sent_len : end]
        self._sent_len = end
        return text
