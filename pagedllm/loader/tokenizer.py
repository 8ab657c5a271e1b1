"""`get_tokenizer(source)`: the HF tokenizer of a model, from its directory or its GGUF metadata.

Presets have no tokenizer: `get_tokenizer` returns None, and the engine then takes token ids only
(vLLM's `skip_tokenizer_init`), which is what `--load-format dummy` benchmarks need.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedllm.loader.gguf_cache import load_or_create
from pagedllm.loader.gguf_reader import open_gguf, read_field
from pagedllm.loader.source import ModelSource


def get_tokenizer(
    source: ModelSource, tokenizer: str | None = None, trust_remote_code: bool = False, use_fast: bool = True
) -> PreTrainedTokenizerBase | None:
    """The tokenizer for `source`, or the one at `tokenizer` (a directory or a .gguf file) if given.

    None when the source has no tokenizer (presets) and none is given. use_fast=False is vLLM's
    `--tokenizer-mode slow` (the Python tokenizer, where the checkpoint has one).
    """
    if tokenizer is not None:
        return load_tokenizer(Path(tokenizer).expanduser(), trust_remote_code, use_fast)
    if source.tokenizer_path is None:
        return None
    return load_tokenizer(source.tokenizer_path, trust_remote_code, use_fast)


def load_tokenizer(path: Path, trust_remote_code: bool = False, use_fast: bool = True) -> PreTrainedTokenizerBase:
    """AutoTokenizer from a directory, or from the metadata of a .gguf file (cached on disk)."""
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, use_fast=use_fast)
    if path.is_file():
        return load_gguf_tokenizer(path)
    raise ValueError(
        f"Tokenizer {str(path)!r} does not exist; pass a local tokenizer directory or .gguf file "
        "(pagedllm downloads nothing from a model hub)."
    )


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from a GGUF file, with the file's chat template.

    Not `AutoTokenizer.from_pretrained(dir, gguf_file=...)`: with a GGUF, AutoTokenizer first rebuilds
    the model config through transformers' legacy GGUF reader, 4.2 of its 4.6 s for SmolLM2, only to
    pick a class. The tokenizer itself is the same GGUF-converted `tokenizers` backend either way, and
    the generic fast class gives identical ids, special tokens and template (tests compare the two).
    The result is saved with `save_pretrained` in pagedllm's cache and read back next time (~0.3 s).
    """
    path = path.resolve()

    def create() -> PreTrainedTokenizerBase:
        tok = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
        if not tok.chat_template:
            # Older transformers drop `tokenizer.chat_template` from the metadata: put it back.
            template = read_field(open_gguf(path), "tokenizer.chat_template")
            if template:
                tok.chat_template = template
        return tok

    return load_or_create(
        path,
        "tokenizer",
        load=AutoTokenizer.from_pretrained,
        create=create,
        save=lambda tok, entry: tok.save_pretrained(entry),
    )
