"""Hub ids (`Qwen/Qwen2.5-7B-Instruct`) resolved through the local Hugging Face cache, offline.

Users' models live in the HF hub cache that `huggingface-cli download` and every `from_pretrained`
fill. Its layout (huggingface_hub's, read here through `snapshot_download(local_files_only=True)`,
which never touches the network):

    <cache>/models--Qwen--Qwen2.5-7B-Instruct/refs/main          -> "a1b2c3..." (a commit hash)
    <cache>/models--Qwen--Qwen2.5-7B-Instruct/snapshots/a1b2c3.../config.json, *.safetensors

Caches searched, in order (as vLLM): `download_dir` (--download-dir), then `HF_HUB_CACHE`, then
`$HF_HOME/hub`, then `~/.cache/huggingface/hub`. The environment is read at each call, not when
huggingface_hub was imported, so a variable set later still counts. `revision` is a branch or tag
(a file under refs/) or a commit hash (a snapshot directory); None means "main".
"""

from __future__ import annotations

import os
from pathlib import Path


def hub_cache_dirs(download_dir: str | None = None) -> list[Path]:
    """The HF hub cache directories to search, first match wins; duplicates dropped."""
    dirs: list[Path] = []
    if download_dir:
        dirs.append(Path(download_dir).expanduser())
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]).expanduser())
    home = Path(os.environ.get("HF_HOME") or "~/.cache/huggingface").expanduser()
    dirs.append(home / "hub")
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def looks_like_hub_id(name: str) -> bool:
    """'org/name' with no path syntax: what a hub id looks like (a local path is tried first anyway)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/")) and "\\" not in name


def find_cached_snapshot(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> Path | None:
    """The snapshot directory of `repo_id` at `revision` in the first cache that has it, else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    for cache in hub_cache_dirs(download_dir):
        if not (cache / ("models--" + repo_id.replace("/", "--"))).is_dir():
            continue
        try:
            path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
        except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
            continue
        if path.is_dir():
            return path
    return None


def describe_search(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """For the error message: where the hub id was looked for."""
    where = ", ".join(str(d) for d in hub_cache_dirs(download_dir))
    rev = f" at revision {revision!r}" if revision else ""
    return f"{repo_id!r}{rev} is not in the local Hugging Face cache (searched {where})"
