"""`iter_weights(source, load_format)`: the checkpoint's tensors under their HF names.

    load_format   reads                                    valid for
    auto          safetensors for hf_dir, gguf for gguf    hf_dir, gguf
    safetensors   *.safetensors (index-aware)              hf_dir
    pt            pytorch_model*.bin (index-aware)         hf_dir (auto picks it when no safetensors)
    gguf          the .gguf file, dequantized to float32   gguf
    dummy         nothing: use initialize_dummy_weights    any (presets have no weights at all)

The model's `load_weights` consumes the iterator; nothing here knows about model classes.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from pagedllm.loader.gguf_weights import gguf_weights_iterator
from pagedllm.loader.lazy_tensor import LazySlice
from pagedllm.loader.source import ModelSource

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"


def resolve_load_format(source: ModelSource, load_format: str = "auto") -> str:
    """The concrete format ("safetensors", "gguf" or "dummy") for `source`; ValueError if impossible."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load_format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}.")
    if load_format == "dummy":
        return "dummy"
    if source.kind == "preset":
        raise ValueError(
            f"Model {source.default_name!r} is a bundled config without weights; "
            f"use load_format='dummy' (--load-format dummy), not {load_format!r}."
        )
    natural = "gguf" if source.kind == "gguf" else "safetensors"
    if natural == "safetensors" and not _has_safetensors(source.path) and _has_pt(source.path):
        natural = "pt"  # as vLLM's auto: safetensors when present, else the PyTorch .bin files
    if load_format == "auto":
        return natural
    if load_format == "pt" and natural == "safetensors" and _has_pt(source.path):
        return "pt"
    if load_format != natural:
        raise ValueError(
            f"load_format={load_format!r} is impossible for {source.path}: it is "
            f"{'a GGUF file' if source.kind == 'gguf' else 'an HF checkpoint directory'}, "
            f"which holds {natural} weights; use load_format='auto' or {natural!r}."
        )
    return natural


def iter_weights(
    source: ModelSource,
    load_format: str = "auto",
    use_tqdm: bool = True,
    keep_quantized: Container[str] = (),
    skip_dense: Container[str] = (),
    lazy: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, CPU tensor) for every tensor of the checkpoint.

    lazy=True (tensor-parallel ranks): safetensors tensors come as `LazySlice`s, read only where a
    weight loader narrows them to this rank's slice (loader/lazy_tensor.py).

    Validation happens here, at call time, not at the first `next()`. Safetensors tensors keep their
    stored dtype; GGUF tensors are dequantized to float32 (for the names in `keep_quantized` the raw
    uint8 blocks come as `.qweight` too, and names in `skip_dense` come only that way; see
    gguf_weights_iterator). The caller casts floats to the model's dtype.
    """
    fmt = resolve_load_format(source, load_format)
    if fmt == "dummy":
        raise ValueError(
            "load_format='dummy' reads no checkpoint, so there are no weights to iterate; "
            "fill the model with pagedllm.loader.initialize_dummy_weights(model) instead."
        )
    if fmt == "gguf":
        return gguf_weights_iterator(source.path, source.hf_config, use_tqdm=use_tqdm,
                                     keep_quantized=keep_quantized, skip_dense=skip_dense)
    if fmt == "pt":
        return pt_weights_iterator(pt_files(source.path), use_tqdm=use_tqdm)
    return safetensors_weights_iterator(safetensors_files(source.path), use_tqdm=use_tqdm, lazy=lazy)


def _has_safetensors(model_dir: Path) -> bool:
    return (model_dir / SAFETENSORS_INDEX).is_file() or any(model_dir.glob("*.safetensors"))


def _has_pt(model_dir: Path) -> bool:
    return (model_dir / PT_INDEX).is_file() or any(model_dir.glob("*.bin"))


def _indexed_shards(model_dir: Path, index_name: str) -> list[Path] | None:
    """The shards a checkpoint index (`*.index.json`) names, each checked to exist; None without an index."""
    index = model_dir / index_name
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map'; the checkpoint index is damaged.")
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{index} names shards that are not in {model_dir}: {', '.join(missing)}")
    return files


def pt_files(model_dir: Path) -> list[Path]:
    """The .bin shards: those named in pytorch_model.bin.index.json, else every *.bin except
    training leftovers (training_args.bin, optimizer states)."""
    files = _indexed_shards(model_dir, PT_INDEX)
    if files is not None:
        return files
    files = [f for f in sorted(model_dir.glob("*.bin")) if f.name not in ("training_args.bin", "optimizer.bin")]
    if not files:
        raise ValueError(f"No pytorch_model*.bin files in {model_dir}.")
    return files


def pt_weights_iterator(files: list[Path], use_tqdm: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each PyTorch .bin file. `weights_only=True`: a pickle can run code
    on load, so only tensors and plain containers are accepted (a file needing more is refused)."""
    for file in tqdm(files, desc="Loading pt checkpoint shards", disable=not use_tqdm):
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ...
            raise ValueError(
                f"{file} could not be read as a weights-only PyTorch checkpoint ({type(e).__name__}: {e}); "
                "convert it to safetensors."
            ) from e
        if not isinstance(state, dict):
            raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict of tensors.")
        yield from state.items()
        del state


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards to read: those named in model.safetensors.index.json, else every *.safetensors.

    With an index, stray files next to the shards (e.g. a `consolidated.safetensors` copy of the whole
    model in some repos) are not read twice.
    """
    files = _indexed_shards(model_dir, SAFETENSORS_INDEX)
    if files is not None:
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(others)}; use load_format='auto' or 'pt' for .bin files)" if others else ""
        raise ValueError(f"No *.safetensors files in {model_dir}{hint}.")
    return files


def safetensors_weights_iterator(
    files: list[Path], use_tqdm: bool = True, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each safetensors file in turn, one progress step per file; with
    `lazy`, (name, LazySlice) to be read where it is used, while the file is open."""
    for file in tqdm(files, desc="Loading safetensors checkpoint shards", disable=not use_tqdm):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, (LazySlice.from_safetensors(f.get_slice(name)) if lazy else f.get_tensor(name))
