"""Config classes taken directly (loader/hf_configs.py, loader/source.py load_hf_config) are the ones
AutoConfig builds: the same class and the same values for every bundled preset and for a
config.json of each listed model type; anything else still goes to AutoConfig. A kept snapshot of a
config reads back every attribute, and the engine generates the same tokens from it."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import pytest
import transformers
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

from pagedllm.loader import hf_configs, light_validators
from pagedllm.loader.hf_configs import CONFIG_CLASSES, ConfigSnapshot, config_class, without_generated_docstrings
from pagedllm.loader.source import MODEL_CONFIGS_DIR, available_presets, load_hf_config, resolve_model


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


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path / "cache"))
    hf_configs._pending.clear()
    return tmp_path / "cache"


@pytest.mark.parametrize("preset", available_presets())
def test_a_kept_snapshot_reads_back_every_attribute(preset: str, cache_root: Path):
    """After a completed start (remember), the same config.json loads as a ConfigSnapshot whose every
    attribute (methods aside) equals the transformers config's, type included; what could not be
    kept raises instead of passing for missing."""
    path = MODEL_CONFIGS_DIR / preset
    real = load_hf_config(path, keep=True)
    assert not isinstance(real, ConfigSnapshot)
    assert isinstance(load_hf_config(path, keep=True), type(real))  # nothing kept before remember()
    hf_configs.remember()
    kept = load_hf_config(path, keep=True)
    assert isinstance(kept, ConfigSnapshot)
    assert not isinstance(load_hf_config(path), ConfigSnapshot)  # keep=False: always transformers
    data = hf_configs.snapshot(real)
    for name in data["values"]:
        value = getattr(real, name)
        assert getattr(kept, name) == value and type(getattr(kept, name)) is type(value), name
    for name in data["unavailable"]:
        with pytest.raises(RuntimeError, match="not kept"):
            getattr(kept, name)
    assert getattr(kept, "no_such_attribute", "default") == "default"
    assert pickle.loads(pickle.dumps(kept)) == kept


def test_a_snapshot_is_taken_before_overrides_and_follows_the_file(cache_root: Path, tmp_path: Path):
    src = MODEL_CONFIGS_DIR / "llama3-8b" / "config.json"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(src.read_text())
    first = resolve_model(str(folder), hf_overrides={"rms_norm_eps": 1e-3})
    assert first.hf_config.rms_norm_eps == 1e-3
    hf_configs.remember()
    again = resolve_model(str(folder))
    assert isinstance(again.hf_config, ConfigSnapshot) and again.hf_config.rms_norm_eps == 1e-5
    text = (folder / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06')
    (folder / "config.json").write_text(text)  # an edited file: another key, transformers again
    edited = resolve_model(str(folder))
    assert not isinstance(edited.hf_config, ConfigSnapshot) and edited.hf_config.rms_norm_eps == 1e-6


def test_the_engine_generates_the_same_tokens_from_a_snapshot(cache_root: Path, tmp_path: Path):
    from pagedllm import LLM, SamplingParams
    from tests.entrypoints.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    outs = []
    for _ in range(2):  # the first engine start keeps the snapshot, the second reads it back
        llm = LLM(str(folder), max_model_len=128, num_gpu_blocks_override=64)
        outs.append((type(llm.llm_engine.config.model_config.hf_config),
                     [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]))
        del llm
    assert outs[0][0] is not ConfigSnapshot and outs[1][0] is ConfigSnapshot
    assert outs[0][1] == outs[1][1]


def test_the_engine_process_unpickles_either_kind_of_config(cache_root: Path):
    """The engine process's unpickler (engine/core_proc.py) gives back an equal EngineConfig whether
    its model config is a transformers class or a kept snapshot."""
    import subprocess
    import sys

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.core_proc import _load_config

    args = EngineArgs(model="llama3-8b", load_format="dummy", max_model_len=512, device="cpu")
    real = args.create_engine_config()
    hf_configs.remember()
    kept = args.create_engine_config()
    assert isinstance(kept.model_config.hf_config, ConfigSnapshot)
    for config in (real, kept):
        assert _load_config(pickle.dumps(config)) == config
    # A snapshot's config needs no transformers at all in a process that has not imported it.
    code = ("import pickle, sys; from pagedllm.engine.core_proc import _load_config; "
            "_load_config(sys.stdin.buffer.read()); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(kept), capture_output=True, check=True)
    assert out.stdout.strip() == b"False"


def test_the_stand_in_activation_names_are_transformers_own():
    from transformers.activations import ACT2FN

    assert light_validators._ACTIVATION_NAMES <= set(ACT2FN)


# A fresh interpreter (this one imported transformers.activations long ago): every preset's config as
# to_dict(), which modules the configs imported, then the validators' table's answers (a name outside
# the stand-in's own asks the real table) and the real module afterwards.
_LIGHT_PROBE = r"""
import json, sys
from pagedllm.loader.source import MODEL_CONFIGS_DIR, available_presets, load_hf_config
out = {"configs": {p: load_hf_config(MODEL_CONFIGS_DIR / p).to_dict() for p in available_presets()}}
out["activations_imported"] = "transformers.activations" in sys.modules
try:
    from transformers.utils.type_validators import ACT2FN as table
    out["answers"] = [len(table) > 0, "silu" in table, "gelu_new" in table, "xielu" in table, "no_such" in table]
except ImportError:
    out["answers"] = None
import transformers.activations as real
out["real_after"] = type(real.ACT2FN).__name__ + " " + type(real.get_activation("silu")).__name__
print("RESULT " + json.dumps(out, default=str))
"""


def _light_probe(tmp_path: Path, light: str) -> dict:
    import os
    import subprocess
    import sys

    env = dict(os.environ, PAGEDLLM_LIGHT_CONFIG_IMPORT=light, PAGEDLLM_CACHE_ROOT=str(tmp_path / "cache"),
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-c", _LIGHT_PROBE], capture_output=True, text=True, env=env, timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stderr[-3000:]
    return json.loads(line[0].removeprefix("RESULT "))


def test_light_config_import_gives_the_same_configs_and_answers(tmp_path: Path):
    """PAGEDLLM_LIGHT_CONFIG_IMPORT=1: the same config of every preset without importing
    transformers.activations, the same validation answers, and the real module afterwards."""
    plain, light = _light_probe(tmp_path, "0"), _light_probe(tmp_path, "1")
    assert light["configs"] == plain["configs"]
    assert light["answers"] == plain["answers"]
    assert light["real_after"] == plain["real_after"] and "_ActivationNames" not in light["real_after"]
    if plain["answers"] is not None:  # transformers 5: the validators import the module, unless the stand-in
        assert plain["answers"] == [True, True, True, True, False]
        assert plain["activations_imported"] and not light["activations_imported"]


# -- type validators without torchvision -------------------------------------------------------------
#
# CI has neither Pillow nor torchvision, so the subprocesses below get fakes of both on PYTHONPATH:
# with them transformers sees vision and torchvision available and (PAGEDLLM_LIGHT_CONFIG_IMPORT=0)
# imports torchvision for a config's validators, as on the H200 host. This process is left untouched.

_FAKE_VISION = {
    "PIL/__init__.py": '__version__ = "12.0.0"\n',
    "PIL/Image.py": ("import enum\n\n\nclass Resampling(enum.IntEnum):\n"
                     "    NEAREST = 0\n    LANCZOS = 1\n    BILINEAR = 2\n    BICUBIC = 3\n    BOX = 4\n    HAMMING = 5\n\n\n"
                     "class Image:\n    pass\n"),
    "PIL/ImageOps.py": "",
    "pillow-12.0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: pillow\nVersion: 12.0.0\n",
    "torchvision/__init__.py": '__version__ = "0.26.0"\nfrom . import io, transforms  # noqa: F401\n',
    "torchvision/io.py": ("import enum\n\n\nclass ImageReadMode(enum.Enum):\n    UNCHANGED = 0\n\n\n"
                          "def decode_image(*args, **kwargs):\n    raise NotImplementedError\n"),
    "torchvision/transforms/__init__.py": (
        "import enum\n\n\nclass InterpolationMode(enum.Enum):\n"
        + "".join(f"    {m} = {m.lower()!r}\n" for m in ("NEAREST", "NEAREST_EXACT", "BILINEAR", "BICUBIC", "BOX",
                                                        "HAMMING", "LANCZOS"))),
    "torchvision/transforms/functional.py": "def pil_to_tensor(pic):\n    raise NotImplementedError\n",
    "torchvision/transforms/v2/__init__.py": "",
    "torchvision/transforms/v2/functional.py": "def resize(*args, **kwargs):\n    raise NotImplementedError\n",
    "torchvision-0.26.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.26.0\n",
}

# Every preset's config (to_dict) and invalid ones' errors, the modules the configs imported, the
# validators' answers, then the real modules afterwards and whether any stand-in is left anywhere.
# BREAK=1: the stand-in PILImageResampling fails, so the validators module must run again without them.
_VISION_PROBE = r"""
import json, os, sys, types, typing
import torch
from pagedllm.loader import hf_configs, light_validators
from pagedllm.loader.source import MODEL_CONFIGS_DIR, available_presets, load_hf_config
if os.environ.get("BREAK") == "1":
    light_validators._pil_resampling = lambda: 1 / 0
out = {"configs": {p: load_hf_config(MODEL_CONFIGS_DIR / p).to_dict() for p in available_presets()}}
out["errors"] = []
for kwargs in ({"initializer_range": 5.0}, {"vocab_size": "x"}, {"hidden_size": 10, "num_attention_heads": 3},
               {"hidden_act": "no_such_activation"}):
    try:
        out["errors"].append(hf_configs.config_class("llama")(**kwargs).to_dict())
    except Exception as e:
        out["errors"].append([type(e).__name__, str(e)])
watched = ("torchvision", "transformers.video_utils", "transformers.image_utils", "transformers.image_transforms",
           "transformers.activations")
out["imported"] = [m for m in watched if m in sys.modules]
import PIL.Image
import transformers.utils.type_validators as tv
answers = []
for value in (None, 2, 7, PIL.Image.Resampling.BICUBIC, "bicubic", 2.0):
    try:
        tv.resampling_validator(value)
        answers.append("ok")
    except ValueError as e:
        answers.append(str(e))
out["resampling"] = answers
out["resampling_is_pil"] = tv.PILImageResampling is PIL.Image.Resampling
hints = typing.get_type_hints(tv.video_metadata_validator)
import transformers, transformers.image_utils as iu, transformers.video_utils as vu
import transformers.image_processing_utils, transformers.video_processing_utils, transformers.processing_utils
out["hints_are_real"] = hints == {"value": vu.VideoMetadataType | None}
out["real_after"] = [iu.PILImageResampling is PIL.Image.Resampling, len(iu.pil_torch_interpolation_mapping),
                     vu.VideoMetadata.__module__, vars(vu)["torchvision_io"].__name__,
                     transformers.image_utils is iu, transformers.video_utils is vu]
out["stand_ins_left"] = sorted(
    f"{holder}.{attr}" for holder, module in list(sys.modules.items()) for attr, value in list(vars(module).items())
    if isinstance(value, types.ModuleType) and value.__name__ in watched and value.__spec__ is None
) + sorted(name for name in watched if name in sys.modules and sys.modules[name].__spec__ is None)
out["finder_left"] = any(isinstance(f, light_validators._StandInFinder) for f in sys.meta_path) or bool(light_validators._stand_ins)
print("RESULT " + json.dumps(out, default=str))
"""


def _vision_probes(tmp_path: Path, *modes: tuple[str, bool]) -> list[dict]:
    """The probe's results, one subprocess per (PAGEDLLM_LIGHT_CONFIG_IMPORT, broken stand-in), run at once."""
    import os
    import subprocess
    import sys

    fakes = tmp_path / "fakes"
    for name, text in _FAKE_VISION.items():
        (fakes / name).parent.mkdir(parents=True, exist_ok=True)
        (fakes / name).write_text(text)
    running = []
    for light, broken in modes:
        env = dict(os.environ, PAGEDLLM_LIGHT_CONFIG_IMPORT=light, PAGEDLLM_CACHE_ROOT=str(tmp_path / "cache"),
                   PYTHONPATH=os.pathsep.join([str(fakes), str(Path(__file__).resolve().parents[2])]),
                   BREAK="1" if broken else "0")
        running.append(subprocess.Popen([sys.executable, "-c", _VISION_PROBE], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env))
    results = []
    for p in running:
        stdout, stderr = p.communicate(timeout=300)
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        assert line, stderr[-3000:]
        results.append(json.loads(line[0].removeprefix("RESULT ")))
    return results


@pytest.mark.skipif(importlib.util.find_spec("transformers.utils.type_validators") is None,
                    reason="transformers 4 has no type validators")
def test_config_validators_import_without_torchvision(tmp_path: Path):
    """With Pillow and torchvision installed, PAGEDLLM_LIGHT_CONFIG_IMPORT=1: every preset's config,
    and invalid ones' errors, as transformers' own imports give them, without importing torchvision,
    video_utils or image_utils; the validators answer as before (the very PIL.Image.Resampling, the
    real VideoMetadataType for get_type_hints); afterwards the modules are the real, complete ones and
    no stand-in is left anywhere. A stand-in that fails: the validators run as transformers' own."""
    plain, light, broken = _vision_probes(tmp_path, ("0", False), ("1", False), ("1", True))
    assert "torchvision" in plain["imported"] and "transformers.video_utils" in plain["imported"]  # the fakes work
    assert light["imported"] == []
    assert "torchvision" in broken["imported"]
    for probe in (light, broken):
        for key in ("configs", "errors", "resampling", "resampling_is_pil", "hints_are_real", "real_after"):
            assert probe[key] == plain[key], key
        assert probe["stand_ins_left"] == [] and not probe["finder_left"]
    assert plain["resampling_is_pil"] and plain["hints_are_real"]
    assert [e[0] for e in plain["errors"][:3]] == ["StrictDataclassFieldValidationError"] * 2 + [
        "StrictDataclassClassValidationError"]
    assert plain["real_after"] == [True, 6, "transformers.video_utils", "torchvision.io", True, True]


def test_stand_ins_are_made_only_for_the_sources_they_answer():
    """The installed transformers' sources have the shapes the stand-ins answer for (else a stand-in
    is silently not made, and the config import is slow again); other shapes get no stand-in."""

    def source(name: str) -> str:
        return Path(importlib.util.find_spec(name).origin).read_text()

    validators, video, image = (source("transformers.utils.type_validators"), source("transformers.video_utils"),
                                source("transformers.image_utils"))
    assert light_validators._video_metadata_type(validators, video) is not None
    assert light_validators._binds_pil_resampling(image)
    used_otherwise = validators + "\n\ndef f(value):\n    return isinstance(value, VideoMetadataType)\n"
    assert light_validators._video_metadata_type(used_otherwise, video) is None
    assert light_validators._video_metadata_type(validators.replace("VideoMetadataType | None", "list[VideoMetadataType]"),
                                           video) is None
    assert light_validators._video_metadata_type(validators, video.replace("\nVideoMetadataType =", "\n_Other =")) is None
    head, _, tail = image.partition("    PILImageResampling = PIL.Image.Resampling\n")
    assert light_validators._binds_pil_resampling(head + "    PILImageResampling = PIL.Image.Resampling\n" + tail)
    assert not light_validators._binds_pil_resampling(head + "    PILImageResampling = _OwnEnum\n" + tail)
    assert not light_validators._binds_pil_resampling(image + "\nelse:\n    PILImageResampling = _OwnEnum\n")
    assert not light_validators._binds_pil_resampling(image.replace("if is_vision_available():", "if is_torch_available():"))
    assert not light_validators._binds_pil_resampling("")
