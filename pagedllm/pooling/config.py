"""`PoolerConfig`: how a pooling model turns hidden states into its output, resolved once.

Where the values come from, later wins (vLLM's order):

    1. the architecture's defaults     BertModel / XLMRobertaModel: CLS, normalized; a decoder used
                                       as an embedder (Qwen3-Embedding): LAST, normalized;
                                       *ForSequenceClassification: CLS + the model's head
    2. the checkpoint's sentence-transformers files
         modules.json                  a Normalize module -> normalize; a Dense module is refused
         1_Pooling/config.json         pooling_mode_cls_token / _mean_tokens / _lasttoken -> type
         sentence_bert_config.json     max_seq_length -> max_model_len (ST truncates there; so do we
                                       with truncate_prompt_tokens=-1)
    3. the user's `pooler_config` (vLLM's --pooler-config; `override_pooler_config` is its older
       name): {"pooling_type": "MEAN", "normalize": false, "dimensions": 256, "use_activation": true}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL")
_USER_KEYS = ("pooling_type", "normalize", "dimensions", "use_activation")

# ST pooling modes we compute, as 1_Pooling/config.json names them; the others are refused.
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "CLS"
    normalize: bool = True
    dimensions: int | None = None  # default output size for matryoshka models (None: the full one)
    use_activation: bool = True  # classifiers: sigmoid (1 label) / softmax (several)
    # What the pooler produces: "embed" (a vector) or "classify" (the model's head: logits).
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.")
        if self.task not in ("embed", "classify"):
            raise ValueError(f"pooler task must be embed or classify, got {self.task!r}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"pooler_config dimensions must be >= 1, got {self.dimensions}.")


def parse_user_pooler_config(value: Any) -> dict[str, Any]:
    """--pooler-config '{"pooling_type": "MEAN"}' / a dict / a PoolerConfig -> the keys it sets."""
    if value is None:
        return {}
    if isinstance(value, PoolerConfig):
        return {k: getattr(value, k) for k in _USER_KEYS}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}: {e}.") from e
    if not isinstance(value, dict):
        raise ValueError(f"pooler_config must be a dict or a JSON object, got {type(value).__name__}.")
    unknown = sorted(set(value) - set(_USER_KEYS))
    if unknown:
        raise ValueError(f"pooler_config keys {unknown} are not supported; supported: {', '.join(_USER_KEYS)}.")
    out = {k: v for k, v in value.items() if v is not None}
    if "pooling_type" in out:
        out["pooling_type"] = str(out["pooling_type"]).upper()
    return out


def read_sentence_transformers_config(path: Path | None) -> dict[str, Any]:
    """The pooler keys and max_seq_length a sentence-transformers checkpoint directory states.

    all-MiniLM-L6-v2 -> {"pooling_type": "MEAN", "normalize": True, "max_seq_length": 256}. {} when
    the directory has no modules.json (a plain transformers checkpoint)."""
    if path is None or not (path / "modules.json").is_file():
        return {}
    out: dict[str, Any] = {"normalize": False}
    modules = json.loads((path / "modules.json").read_text())
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Normalize":
            out["normalize"] = True
        elif kind == "Pooling":
            out.update(_read_st_pooling(path / m.get("path", "")))
        elif kind == "Dense":
            raise ValueError(
                f"{path}: the sentence-transformers Dense module ({m.get('path')}) is not supported; "
                "only Transformer, Pooling and Normalize modules are."
            )
        elif kind not in ("Transformer", ""):
            raise ValueError(f"{path}: the sentence-transformers module {m.get('type')!r} is not supported.")
    sbert = path / "sentence_bert_config.json"
    if sbert.is_file():
        data = json.loads(sbert.read_text())
        if isinstance(data.get("max_seq_length"), int):
            out["max_seq_length"] = data["max_seq_length"]
        if data.get("do_lower_case"):
            raise ValueError(f"{path}: sentence_bert_config do_lower_case=true is not supported.")
    return out


def _read_st_pooling(pool_dir: Path) -> dict[str, Any]:
    cfg_file = pool_dir / "config.json"
    if not cfg_file.is_file():
        return {}
    cfg = json.loads(cfg_file.read_text())
    bad = [k for k in _ST_UNSUPPORTED if cfg.get(k)]
    if bad:
        raise ValueError(f"{cfg_file}: pooling modes {bad} are not supported; built: CLS, MEAN, LAST.")
    modes = [t for k, t in _ST_MODES.items() if cfg.get(k)]
    if len(modes) != 1:
        raise ValueError(f"{cfg_file}: exactly one pooling mode must be set, got {modes or 'none'}.")
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{cfg_file}: include_prompt=false is not supported.")
    return {"pooling_type": modes[0]}


def resolve_pooler_config(defaults: PoolerConfig, st_config: dict[str, Any], user: dict[str, Any]) -> PoolerConfig:
    """Apply the checkpoint's sentence-transformers keys, then the user's, over the defaults."""
    st = {k: v for k, v in st_config.items() if k in ("pooling_type", "normalize")}
    return replace(defaults, **st, **user)


# vLLM's older `task` argument -> (runner, convert).
_TASK_TO_RUNNER = {
    "auto": ("auto", "auto"), "generate": ("generate", "none"), "embed": ("pooling", "embed"),
    "embedding": ("pooling", "embed"), "encode": ("pooling", "embed"), "classify": ("pooling", "classify"),
    "score": ("pooling", "classify"),
}
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")


@dataclass(frozen=True)
class ResolvedRunner:
    runner_type: str  # "generate" | "pooling"
    pooler_config: PoolerConfig | None
    max_model_len: int | None  # the embedder's own cap (ST max_seq_length, RoBERTa's offset positions)


def resolve_runner(runner: str, convert: str, task: str | None, pooler_config: Any, override_pooler_config: Any,
                   hf_config: Any, checkpoint_dir: Path | None) -> ResolvedRunner:
    """vLLM's runner / convert / task arguments and the architecture -> what the engine runs.

    runner="auto" pools for architectures without an LM head (BertModel, XLMRobertaModel,
    *ForSequenceClassification, Qwen3Model, ...) and generates otherwise."""
    from pagedllm.models.registry import POOLING_ONLY_ARCHS

    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}.")
    if task is not None:
        if task not in _TASK_TO_RUNNER:
            raise ValueError(f"task must be one of {', '.join(_TASK_TO_RUNNER)}, got {task!r}.")
        task_runner, task_convert = _TASK_TO_RUNNER[task]
        if runner == "auto":
            runner = task_runner
        if convert == "auto":
            convert = task_convert
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    pooling_only = arch in POOLING_ONLY_ARCHS
    if runner == "auto":
        runner = "pooling" if pooling_only or convert in ("embed", "classify") else "generate"
    if runner == "generate":
        if pooling_only:
            raise ValueError(f"{arch} has no LM head and cannot generate; serve it with runner='pooling'.")
        if pooler_config is not None or override_pooler_config is not None:
            raise ValueError("pooler_config applies to runner='pooling' only.")
        return ResolvedRunner("generate", None, None)

    is_classifier = arch.endswith("ForSequenceClassification")
    if convert == "classify" and not is_classifier:
        raise ValueError(f"{arch} has no classification head: convert='classify' is not supported for it "
                         "(use a *ForSequenceClassification checkpoint).")
    pool_task = "classify" if is_classifier and convert != "embed" else "embed"
    encoder = getattr(hf_config, "model_type", "") in ("bert", "roberta", "xlm-roberta")
    defaults = PoolerConfig(pooling_type="CLS" if encoder or pool_task == "classify" else "LAST", task=pool_task)
    st = read_sentence_transformers_config(checkpoint_dir)
    if pooler_config is not None and override_pooler_config is not None:
        raise ValueError("pooler_config and override_pooler_config (its older name) are mutually exclusive.")
    user = parse_user_pooler_config(pooler_config if pooler_config is not None else override_pooler_config)
    resolved = resolve_pooler_config(defaults, st if pool_task == "embed" else {}, user)
    if pool_task == "classify" and resolved.pooling_type != "CLS":
        raise ValueError("a classification head reads the first token: pooling_type must be CLS for it.")
    if resolved.dimensions is not None:
        check_dimensions(hf_config, resolved.dimensions)
    caps = [st["max_seq_length"]] if "max_seq_length" in st else []
    if getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta"):
        # Positions start at pad_token_id + 1: 514 position embeddings hold 512 tokens.
        caps.append(int(hf_config.max_position_embeddings) - int(hf_config.pad_token_id) - 1)
    return ResolvedRunner("pooling", resolved, min(caps) if caps else None)


def check_dimensions(hf_config: Any, dimensions: int) -> None:
    """vLLM's rule: `dimensions` only for matryoshka models (config is_matryoshka or
    matryoshka_dimensions), and then one of the listed sizes when there is a list."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if not (getattr(hf_config, "is_matryoshka", False) or dims):
        raise ValueError(
            "This model does not support matryoshka representation (its config sets neither is_matryoshka nor "
            "matryoshka_dimensions): changing output dimensions would give poor embeddings."
        )
    if dims and dimensions not in dims:
        raise ValueError(f"dimensions must be one of the model's matryoshka_dimensions {list(dims)}, got {dimensions}.")
    hidden = getattr(hf_config, "hidden_size", None)
    if hidden is not None and dimensions > hidden:
        raise ValueError(f"dimensions ({dimensions}) is larger than the model's embedding size ({hidden}).")
