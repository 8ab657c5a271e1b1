"""Imported by the engine's fork server (engine/fork_server.py PRELOAD): the transformers modules
every model config's module imports (in transformers 5: configuration_utils, and type validators ->
activations -> hub kernels -> distributed tensors), under the identity `@auto_docstring` of
loader/hf_configs.py, so that none of them brings transformers' auto-model registry (generation,
masking, FSDP: seconds) into every engine process. A module this transformers lacks is skipped.

Reads no environment variable (the fork server lives as long as its process)."""

import importlib

from pagedllm.loader.hf_configs import without_generated_docstrings

with without_generated_docstrings():
    for _name in ("transformers", "transformers.configuration_utils", "transformers.activations"):
        try:
            importlib.import_module(_name)
        except ImportError:
            pass
