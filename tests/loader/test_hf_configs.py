"""Config classes taken directly (loader/hf_configs.py, loader/source.py load_hf_config) are the ones
AutoConfig builds: the same class and the same values for every bundled preset and for a
config.json of each listed model type; anything else still goes to AutoConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

from pagedllm.loader.hf_configs import CONFIG_CLASSES, config_class, without_generated_docstrings
from pagedllm.loader.source import MODEL_CONFIGS_DIR, available_presets, load_hf_config


def test_the_table_is_transformers_mapping():
    for model_type, (module, name) in CONFIG_CLASSES.items():
        assert CONFIG_MAPPING_NAMES[model_type] == name
        assert model_type_to_module_name(model_type) == module
        assert config_class(model_type) is getattr(transformers, name)
    assert config_class("no-such-type") is None and config_class(None) is None


@pytest.mark.parametrize("preset", available_presets())
def test_presets_load_as_autoconfig_does(preset: str):
    path = MODEL_CONFIGS_DIR / preset
    ours, auto = load_hf_config(path), AutoConfig.from_pretrained(path)
    assert type(ours) is type(auto)
    assert ours.to_dict() == auto.to_dict()


def _outcome(load, path: Path) -> tuple[str, object]:
    try:
        config = load(path)
    except Exception as e:  # noqa: BLE001 - the error is the outcome
        return type(e).__name__, str(e)
    return type(config).__name__, config.to_dict()


def test_other_configs_get_autoconfigs_outcome(tmp_path: Path):
    """Remote code, a mistral config AutoConfig reads as ministral, a type outside the table, a
    broken file: the result, or the error, is AutoConfig's."""
    cases = {
        "remote": json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}),
        "ministral": json.dumps({"model_type": "mistral", "layer_types": ["full_attention"] * 2,
                                 "num_hidden_layers": 2}),
        "gpt2": json.dumps({"model_type": "gpt2", "n_layer": 2}),
        "no_type": json.dumps({"hidden_size": 8}),
        "broken": "{not json",
    }
    for name, text in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        assert _outcome(load_hf_config, folder) == _outcome(AutoConfig.from_pretrained, folder), name


def test_generated_docstrings_come_back_after_the_context():
    original = transformers.utils.auto_docstring
    with without_generated_docstrings():
        assert transformers.utils.auto_docstring is not original
    assert transformers.utils.auto_docstring is original
