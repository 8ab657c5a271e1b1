"""Imported by the engine's fork server before torch (engine/fork_server.py, PAGEDLLM_BYTECODE_CACHE=1):
installs pagedllm's byte-code cache there (pagedllm/bytecode_cache.py), so every engine process forked
from it imports pagedllm's modules through it."""

from pagedllm.bytecode_cache import install

install()
