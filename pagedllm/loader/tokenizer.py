"""`get_tokenizer(source)`: the HF tokenizer of a model, from its directory or its GGUF metadata.

Presets have no tokenizer: `get_tokenizer` returns None, and the engine then takes token ids only
(vLLM's `skip_tokenizer_init`), which is what `--load-format dummy` benchmarks need.

A directory's tokenizer is AutoTokenizer's, whose choice of class is remembered on disk
(`$PAGEDLLM_CACHE_ROOT/tokenizer_classes/`): the next start loads that class directly. Why: in some
transformers versions AutoTokenizer's module alone brings transformers' generation, masking and
FSDP modules (scikit-learn, torch._dynamo, torch.distributed.tensor: seconds of a server's start,
BENCHMARKS.md, issue 16), which a tokenizer never uses.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

import pagedllm.envs as envs
from pagedllm.loader.gguf_cache import load_or_create
from pagedllm.loader.gguf_reader import open_gguf, read_field
from pagedllm.loader.hf_configs import without_generated_docstrings
from pagedllm.loader.source import ModelSource

logger = logging.getLogger(__name__)


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
        return load_tokenizer_dir(path, trust_remote_code, use_fast)
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
        load=load_tokenizer_dir,
        create=create,
        save=lambda tok, entry: tok.save_pretrained(entry),
    )


def load_tokenizer_dir(path: Path, trust_remote_code: bool = False, use_fast: bool = True) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(path)`, or, when an earlier load of the same files with the same
    transformers remembered the class AutoTokenizer picked, that class's own `from_pretrained(path)`:
    the call AutoTokenizer ends with (it hands its keyword arguments on unchanged), without importing
    AutoTokenizer's module. Classes from remote code are never remembered."""
    record = _class_record(path, trust_remote_code, use_fast)
    if record is not None and record.is_file():
        try:
            module, qualname = json.loads(record.read_text())["class"]
            with without_generated_docstrings():  # loader/hf_configs.py: no auto-model registry with it
                cls: Any = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except Exception as e:  # noqa: BLE001 - a damaged record or another transformers: ask AutoTokenizer
            logger.debug("tokenizer class record %s not usable (%s)", record, e)
        else:
            return cls.from_pretrained(path)
    # Under the light import too: AutoTokenizer's modules (and the config classes it builds to pick a class)
    # would otherwise write their docstrings from the auto-model registry, importing generation and
    # masking utilities, and import the type validators with torchvision where it is installed
    # (loader/hf_configs.py); the classes and the tokenizer are the same.
    with without_generated_docstrings():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, use_fast=use_fast)
    cls = type(tok)
    if record is not None and cls.__module__.startswith("transformers.") and "<locals>" not in cls.__qualname__:
        _write_record(record, {"class": [cls.__module__, cls.__qualname__]})
    return tok


def _class_record(path: Path, trust_remote_code: bool, use_fast: bool) -> Path | None:
    """The record file for this directory's tokenizer: keyed by the directory, its top-level files
    (name, size, mtime: an edited tokenizer_config.json or config.json makes a new key), the
    transformers version and the arguments. None when the directory cannot be listed."""
    try:
        path = path.resolve()
        files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file())
        version = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    ident = json.dumps([str(path), files, version, trust_remote_code, use_fast])
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return envs.PAGEDLLM_CACHE_ROOT / "tokenizer_classes" / f"{key}.json"


def _write_record(record: Path, content: dict[str, Any]) -> None:
    """Written whole (a temporary file renamed into place); a cache that cannot be written is skipped."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".class-")
        with os.fdopen(fd, "w") as f:
            json.dump(content, f)
        os.replace(tmp, record)
    except OSError as e:
        logger.debug("tokenizer class record %s not written (%s)", record, e)
