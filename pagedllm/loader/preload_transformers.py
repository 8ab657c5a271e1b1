"""Imported by the engine's fork server (engine/fork_server.py PRELOAD): the transformers modules
every engine process imports (the package, and configuration_utils for the models' PretrainedConfig),
under the identity `@auto_docstring` of loader/hf_configs.py, so that none of them brings
transformers' auto-model registry (generation, masking, FSDP: seconds) into every engine process.
Not the config classes' own imports (type validators -> activations -> hub kernels -> distributed
tensors: ~5-7 s on the H200 host): a start whose config snapshot was kept (hf_configs.recall) never
needs them, and a first start imports them after the fork, as serially as here. A module this
transformers lacks is skipped.

Reads no environment variable (the fork server lives as long as its process)."""

import importlib

from pagedllm.loader.hf_configs import without_generated_docstrings

with without_generated_docstrings():
    for _name in ("transformers", "transformers.configuration_utils"):
        try:
            importlib.import_module(_name)
        except ImportError:
            pass
