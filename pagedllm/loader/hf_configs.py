"""transformers' config classes for the model types pagedllm serves, loaded without transformers'
auto-model machinery.

Why: a config class module (e.g. `transformers.models.llama.configuration_llama`) decorates its class
with `@auto_docstring`, which writes the class's docstring from transformers' auto-model registry
and imports it to do so: `transformers.models.auto.modeling_auto`, whose `auto_factory` brings the
generation utilities (scikit-learn), masking_utils (torch._dynamo) and FSDP (torch.distributed.tensor).
On the H200 host (transformers 5.17) that was 11.8 s of `pagedllm serve`'s start, paid by the frontend
and again by the engine process (BENCHMARKS.md, issue 16, h47). A config used for serving needs no
generated docstring, so the decorator is the identity while such a module imports
(`without_generated_docstrings`), and the class is taken directly (`config_class`) instead of
through AutoConfig, whose own module is the same registry.

Under PAGEDLLM_LIGHT_CONFIG_IMPORT=1 the class's type validators import with stand-ins for the modules
they take one name each from (loader/light_validators.py).

A completed start also keeps its config's attributes on disk (`note`, `remember`); the next start
reads them back as a `ConfigSnapshot` (`recall`) and imports no transformers config module at all.

This module reads no environment variable at import: the engine's fork server may import it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedllm.loader.light_validators import light_type_validators

# model_type (config.json) -> (transformers.models.<module>, config class): the class AutoConfig maps
# the type to (tests/loader/test_hf_configs.py holds the table to transformers' CONFIG_MAPPING).
CONFIG_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaConfig"),
    "mistral": ("mistral", "MistralConfig"),
    "qwen2": ("qwen2", "Qwen2Config"),
    "qwen3": ("qwen3", "Qwen3Config"),
    "mixtral": ("mixtral", "MixtralConfig"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig"),
    "gemma2": ("gemma2", "Gemma2Config"),
    "gemma3": ("gemma3", "Gemma3Config"),
    "gemma3_text": ("gemma3", "Gemma3TextConfig"),
    "phi3": ("phi3", "Phi3Config"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Config"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config"),
    "bert": ("bert", "BertConfig"),
    "xlm-roberta": ("xlm_roberta", "XLMRobertaConfig"),
}


def _identity_docstring(obj: Any = None, **_: Any) -> Any:
    """`@auto_docstring` and `@auto_docstring(checkpoint=...)`, writing nothing."""
    return obj if obj is not None else (lambda o: o)


@contextlib.contextmanager
def without_generated_docstrings() -> Iterator[None]:
    """While this context is open, transformers modules imported for the first time get an identity
    `auto_docstring` (their classes keep their own docstrings only); restored on exit. Where this
    transformers has no such decorator, nothing changes. With PAGEDLLM_LIGHT_CONFIG_IMPORT=1, the
    config classes' type validators also import without `transformers.activations`, `video_utils` or
    `image_utils` (loader/light_validators.py)."""
    try:
        import transformers.utils as utils

        original = utils.auto_docstring
    except (ImportError, AttributeError):
        yield
        return
    from pagedllm import envs

    utils.auto_docstring = _identity_docstring
    try:
        with light_type_validators() if envs.PAGEDLLM_LIGHT_CONFIG_IMPORT else contextlib.nullcontext():
            yield
    finally:
        utils.auto_docstring = original


def config_class(model_type: Any) -> type | None:
    """The transformers config class for `model_type`, imported without generated docstrings; None
    for a type not in CONFIG_CLASSES or one this transformers lacks (AutoConfig then decides)."""
    entry = CONFIG_CLASSES.get(model_type) if isinstance(model_type, str) else None
    if entry is None:
        return None
    module_name = f"transformers.models.{entry[0]}.configuration_{entry[0]}"
    try:
        with without_generated_docstrings():
            return getattr(importlib.import_module(module_name), entry[1])
    except (ImportError, AttributeError):
        return None


# -- a kept snapshot of a config, for later starts ----------------------------------------------------
#
# Even without the auto-model registry, a transformers 5 config class imports type validators ->
# activations -> hub kernels -> torch.distributed.tensor (sympy): ~5-7 s of the H200 host's start,
# on the engine process's critical path (its fork server's imports). A start that completed keeps its
# config's attributes on disk (`remember`); the next start with the same config.json and transformers
# reads them back (`recall`) into a `ConfigSnapshot` and imports no config class at all.

_SNAPSHOT_FORMAT = 1
_pending: dict[Path, dict[str, Any]] = {}  # snapshots of configs loaded in this process, written by `remember`


class ConfigSnapshot:
    """A transformers config's attributes as plain values (the instance's, its class's and its
    properties', as read from the config when it was built): what pagedllm reads from `hf_config` is
    attribute access only. An attribute whose value could not be kept (an object of transformers'
    own) raises instead of passing for missing, so no getattr() default can hide it."""

    def __init__(self, class_name: str, values: dict[str, Any], unavailable: list[str]) -> None:
        self.__dict__.update(values)
        self.__dict__["_snapshot_of"] = class_name
        self.__dict__["_unavailable"] = frozenset(unavailable)

    def __getattr__(self, name: str) -> Any:  # only for names not set
        if name in self.__dict__.get("_unavailable", ()):
            raise RuntimeError(f"{self._snapshot_of}.{name} was not kept in the config snapshot; load the config "
                               "with transformers (delete $PAGEDLLM_CACHE_ROOT/hf_configs)")
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfigSnapshot) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self._snapshot_of})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _encode(value: Any) -> Any:
    """A JSON-able form that decodes to an equal value of the same type; TypeError if there is none."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": sorted((_encode(v) for v in value), key=repr), "frozen": isinstance(value, frozenset)}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v) for k, v in value.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    import torch

    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    raise TypeError(type(value).__name__)


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__set__" in value:
        items = {_decode(v) for v in value["__set__"]}
        return frozenset(items) if value["frozen"] else items
    if "__items__" in value:
        return {_decode(k): _decode(v) for k, v in value["__items__"]}
    if "__dtype__" in value:
        import torch

        return getattr(torch, value["__dtype__"])
    return {k: _decode(v) for k, v in value.items()}


def snapshot(config: Any) -> dict[str, Any]:
    """{"class", "values" (encoded), "unavailable"} of a transformers config: every attribute dir()
    lists (dunders and methods aside), read as pagedllm would read it."""
    import logging
    import warnings

    values, unavailable = {}, []
    quiet = logging.getLogger("transformers")  # deprecated aliases (torch_dtype, ...) warn when read
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        names = [n for n in dir(config) if not n.startswith("__")]
        read: dict[str, Any] = {}
        for name in names:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    read[name] = getattr(config, name)
            except Exception:  # noqa: BLE001 - a property that refuses: not kept
                unavailable.append(name)
    finally:
        quiet.setLevel(level)
    for name, value in read.items():
        if inspect.isroutine(value):
            continue  # a method
        try:
            values[name] = _encode(value)
        except TypeError:
            unavailable.append(name)
    return {"format": _SNAPSHOT_FORMAT, "class": type(config).__name__, "values": values, "unavailable": unavailable}


def _record(config_json: Path) -> Path | None:
    """Where the snapshot of the config built from `config_json` lives: keyed by the file (path, size,
    mtime) and the transformers version. None when the file cannot be read."""
    import hashlib
    import importlib.metadata
    import json

    from pagedllm import envs

    try:
        stat = config_json.stat()
        version = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    ident = json.dumps([str(config_json.resolve()), stat.st_size, stat.st_mtime_ns, version, _SNAPSHOT_FORMAT])
    return envs.PAGEDLLM_CACHE_ROOT / "hf_configs" / (hashlib.sha256(ident.encode()).hexdigest()[:24] + ".json")


def recall(config_json: Path) -> ConfigSnapshot | None:
    """The kept snapshot of this config.json's config, or None (not kept yet, unreadable)."""
    import json

    record = _record(config_json)
    if record is None or not record.is_file():
        return None
    try:
        data = json.loads(record.read_text())
        if data.get("format") != _SNAPSHOT_FORMAT:
            return None
        return ConfigSnapshot(data["class"], {k: _decode(v) for k, v in data["values"].items()}, data["unavailable"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def note(config_json: Path, config: Any) -> None:
    """Keep this config's snapshot for `remember` (taken now, before any hf_overrides change it)."""
    record = _record(config_json)
    if record is not None and not record.is_file():
        _pending[record] = snapshot(config)


def remember() -> None:
    """Write the snapshots noted in this process (the engine calls this once its start completed, so a
    snapshot read back never meets a config built by transformers in the same start). A cache that
    cannot be written is skipped."""
    import json
    import os
    import tempfile

    while _pending:
        record, data = _pending.popitem()
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".config-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, record)
        except OSError:
            pass
