"""transformers' type validators imported without transformers.activations, video_utils or image_utils.

`light_type_validators()` is the context loader/hf_configs.py's light config import opens (with
PAGEDLLM_LIGHT_CONFIG_IMPORT=1): while transformers' `utils/type_validators.py` runs for the first time
inside it, the three modules it takes one name each from are stand-ins answering that name. Why and
how each answer is exact: the comment block below.

This module reads no environment variable at import: the engine's fork server may import it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# -- type validators without transformers.activations, video_utils or image_utils -------------------
#
# A transformers 5 config class imports its validators module (utils/type_validators.py), which imports
# three modules for one name each:
# - `ACT2FN` from transformers.activations, to validate `hidden_act` (`value in ACT2FN`). activations
#   imports hub kernels -> conversion mapping -> core model loading -> torch.distributed.tensor (sympy):
#   on a 2-core CPU 0.82 s of the 8B config's 1.62 s after torch (BENCHMARKS.md, issue 16, h50).
# - `VideoMetadataType` from transformers.video_utils, in the annotation of `video_metadata_validator`'s
#   parameter (evaluated when the def runs, read by nothing after: transformers' processors import the
#   name from video_utils itself).
# - `PILImageResampling` from transformers.image_utils where PIL.Image imports, for an isinstance() in
#   `resampling_validator`.
# video_utils imports image_transforms and image_utils, and where Pillow, torch and torchvision are
# installed these import torchvision (-> torchvision.models -> torchvision.ops -> torch._dynamo, sympy):
# on the H200 host (transformers 5.17) 3.5 s of a config build's ~8 s, in both processes of a first
# start (`python -X importtime`, h64). pagedllm uses none of transformers' image or video processing.
#
# So while the validators module runs for the first time (only then: `_StandInFinder` hands it
# `_StandInLoader`), each of the three modules not imported yet is a stand-in in sys.modules answering
# its one name, each answer exact for what the validators module does with it:
# - ACT2FN: `_ActivationNames`, whose names below answer `in` without the import; any other use (another
#   name, the list for an error message) imports the real module then.
# - VideoMetadataType: a forward reference to transformers.video_utils.VideoMetadataType: the annotation
#   holds it unresolved, and typing.get_type_hints resolves it to the real union (importing video_utils).
# - PILImageResampling: `PIL.Image.Resampling`, the very object image_utils binds to that name.
# Only during that run: the context also wraps tokenizer class imports and the engine's unpickler, and
# another module taking a name from a stand-in (processing_utils: VideoMetadataType) would keep it.
# The last two are made only where this transformers' sources say so (the validators module uses
# VideoMetadataType in `: VideoMetadataType | None` annotations only, video_utils defines it, image_utils
# binds `PILImageResampling = PIL.Image.Resampling` once, under `if is_vision_available():`); else the
# real module imports. Any other attribute of a stand-in is the real module's (imported then). The
# stand-ins leave sys.modules as soon as the validators module has run; should it fail with them, it
# runs again without them (transformers' own outcome). A later import of any of the three modules is the
# real, complete module.

# Activation names every transformers 5 accepts (tests/loader/test_hf_configs.py holds them to ACT2FN).
_ACTIVATION_NAMES = frozenset({"gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "sigmoid", "silu", "swish", "tanh"})
_VALIDATORS = "transformers.utils.type_validators"
_ACTIVATIONS = "transformers.activations"
_VIDEO_UTILS = "transformers.video_utils"
_IMAGE_UTILS = "transformers.image_utils"
_VIDEO_IMPORT = "from ..video_utils import VideoMetadataType"
_stand_ins: dict[str, Any] = {}  # module name -> its stand-in, while the validators module runs with them


def _real(name: str) -> Any:
    """The module `name` itself (its stand-in leaves sys.modules first)."""
    import sys

    stand_in = _stand_ins.get(name)
    if stand_in is not None and sys.modules.get(name) is stand_in:
        del sys.modules[name]
    return importlib.import_module(name)


def _real_activations() -> Any:
    return _real(_ACTIVATIONS)


class _ActivationNames(Mapping):
    """ACT2FN as type_validators reads it: `name in table` and `len(table) > 0`."""

    def __contains__(self, key: object) -> bool:
        return key in _ACTIVATION_NAMES or key in _real_activations().ACT2FN

    def __len__(self) -> int:  # the validator only asks whether the table is empty
        return len(_ACTIVATION_NAMES)

    def __getitem__(self, key: str) -> Any:
        return _real_activations().ACT2FN[key]

    def __iter__(self) -> Iterator[str]:
        return iter(_real_activations().ACT2FN)


def _stand_in(name: str, answers: Mapping[str, Callable[[], Any]]) -> Any:
    """A module `name` whose attributes in `answers` are the answer's result when read, and any other
    attribute the real module's (imported then). The import system's own lookups (`__path__`: is it a
    package?) get the plain module's answer."""
    import types

    module = types.ModuleType(name)

    def attribute(attr: str) -> Any:
        if attr in answers:
            return answers[attr]()
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(_real(name), attr)

    module.__getattr__ = attribute  # type: ignore[method-assign]
    return module


def _source(name: str) -> str:
    """Module `name`'s source text, read without importing it; "" where there is none to read."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
        return Path(spec.origin).read_text(encoding="utf-8") if spec is not None and spec.origin else ""
    except (ImportError, ValueError, OSError, UnicodeDecodeError):
        return ""


def _video_metadata_type(validators: str, video_utils: str) -> Any:
    """A forward reference to transformers.video_utils.VideoMetadataType where the validators module
    (its source text) imports the name once and uses it only as `: VideoMetadataType | None` in def
    lines, and video_utils (its source text) defines it at module level; None otherwise."""
    import re
    import typing

    uses = [line.strip() for line in validators.splitlines() if "VideoMetadataType" in line]
    annotations = [line for line in uses if line.startswith("def ")
                   and "VideoMetadataType" not in re.sub(r":\s*VideoMetadataType\s*\|\s*None\b", "", line)]
    if uses.count(_VIDEO_IMPORT) != 1 or len(annotations) != len(uses) - 1:
        return None
    if len(re.findall(r"^VideoMetadataType\s*=", video_utils, re.M)) != 1:
        return None
    # Not ForwardRef("VideoMetadataType", module=...): get_type_hints looks the name up in the validators
    # module first, where it is this very reference.
    ref = typing.ForwardRef(f"__import__({_VIDEO_UTILS!r}, fromlist=['VideoMetadataType']).VideoMetadataType")
    try:
        ref | None  # noqa: B018 - what the annotation evaluates; a typing that cannot: no stand-in
    except TypeError:
        return None
    return ref


def _binds_pil_resampling(text: str) -> bool:
    """Whether transformers.image_utils (its source text) binds PILImageResampling once, to
    `PIL.Image.Resampling`, in an `if is_vision_available():` block: the condition the validators
    module imports it under."""
    import re

    bindings = re.findall(r"^[ \t]*PILImageResampling\b[^=\n]*=(?!=)|\bas[ \t]+PILImageResampling\b", text, re.M)
    block = (r"^if is_vision_available\(\):[ \t]*\n(?:[ \t]*\n|[ \t]+\S.*\n)*?"
             r"[ \t]+PILImageResampling = PIL\.Image\.Resampling[ \t]*$")
    return len(bindings) == 1 and re.search(block, text, re.M) is not None


def _pil_resampling() -> Any:
    import PIL.Image

    return PIL.Image.Resampling


def _make_stand_ins(validators: str) -> dict[str, Any]:
    """The stand-ins for the modules not imported yet, given the validators module's source text."""
    import sys

    made: dict[str, Any] = {}
    if _ACTIVATIONS not in sys.modules:
        made[_ACTIVATIONS] = _stand_in(_ACTIVATIONS, {"ACT2FN": _ActivationNames})
    if _VIDEO_UTILS not in sys.modules and (ref := _video_metadata_type(validators, _source(_VIDEO_UTILS))) is not None:
        made[_VIDEO_UTILS] = _stand_in(_VIDEO_UTILS, {"VideoMetadataType": lambda: ref})
    if _IMAGE_UTILS not in sys.modules and _binds_pil_resampling(_source(_IMAGE_UTILS)):
        made[_IMAGE_UTILS] = _stand_in(_IMAGE_UTILS, {"PILImageResampling": _pil_resampling})
    return made


class _StandInLoader:
    """Runs the validators module with the stand-ins in sys.modules (see above); the module keeps the
    loader it was found with."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import sys

        spec = module.__spec__
        module.__loader__ = spec.loader = self.loader
        try:
            validators = Path(spec.origin).read_text(encoding="utf-8") if spec.origin else ""
        except (OSError, UnicodeDecodeError):
            validators = ""
        stand_ins = _make_stand_ins(validators)
        if stand_ins:
            _stand_ins.update(stand_ins)
            sys.modules.update(stand_ins)
            try:
                self.loader.exec_module(module)
                return
            except Exception as e:  # noqa: BLE001 - the run below, without stand-ins, is transformers' own
                logger.debug("%s did not run with stand-ins (%r); running it with transformers' imports", _VALIDATORS, e)
            finally:
                for name, stand_in in stand_ins.items():
                    if sys.modules.get(name) is stand_in:
                        del sys.modules[name]
                _stand_ins.clear()
        self.loader.exec_module(module)


class _StandInFinder:
    """A sys.meta_path finder for the validators module only: the spec the finders after it give, with
    `_StandInLoader` wrapping its loader."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        import sys

        if name != _VALIDATORS:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if isinstance(finder, _StandInFinder) or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _StandInLoader(spec.loader)
                return spec
        return None


@contextlib.contextmanager
def light_type_validators() -> Iterator[None]:
    """While open, a first import of transformers' type validators runs with stand-ins for
    transformers.activations, video_utils and image_utils (see above). Nothing changes where the
    validators module is imported already; on exit no stand-in is left anywhere in sys.modules."""
    import sys

    if _VALIDATORS in sys.modules or any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        yield
        return
    finder = _StandInFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
