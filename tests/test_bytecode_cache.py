"""pagedllm/bytecode_cache.py: with PAGEDLLM_BYTECODE_CACHE=1 (the default) and no __pycache__ writes,
the first process compiles pagedllm's modules and keeps their code; the next one compiles none of
them; a changed source gets a new entry; other packages and the switch at 0 are left to Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pagedllm import bytecode_cache

ROOT = Path(__file__).resolve().parents[1]

# Counts the pagedllm modules compiled from source after the finder is installed while importing a few
# of them, and checks that they work.
_PROBE = r"""
import importlib.machinery, json, sys
compiled = []
original = importlib.machinery.SourceFileLoader.source_to_code
def spy(self, data, path, *args, **kwargs):
    compiled.append(path)
    return original(self, data, path, *args, **kwargs)
importlib.machinery.SourceFileLoader.source_to_code = spy
from pagedllm import bytecode_cache
installed = bytecode_cache.install()
before = len(compiled)  # pagedllm, its envs and this module itself: imported before the finder
import pagedllm.sampling_params, pagedllm.core.block_pool, json as _json
from pagedllm.sampling_params import SamplingParams
assert SamplingParams(temperature=0.5, top_p=0.9).top_p == 0.9
pool = pagedllm.core.block_pool.BlockPool(4, True)
assert pool.get_num_free_blocks() == 4
print("RESULT " + json.dumps({"installed": installed, "ours": sum("pagedllm" in p for p in compiled[before:]),
                              "others": [p for p in compiled if "pagedllm" not in p]}))
"""


def _probe(cache: Path, switch: str) -> dict:
    env = dict(os.environ, PAGEDLLM_BYTECODE_CACHE=switch, PAGEDLLM_CACHE_ROOT=str(cache), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stderr[-3000:]
    return json.loads(line[0].removeprefix("RESULT "))


def test_the_second_process_compiles_none_of_pagedllm(tmp_path: Path):
    first = _probe(tmp_path, "1")
    assert first["installed"]
    kept = list((tmp_path / "bytecode").rglob("*.code"))
    # Either Python had __pycache__ files for them (nothing to keep) or they were compiled and kept.
    assert len(kept) == first["ours"]
    second = _probe(tmp_path, "1")
    assert second["ours"] == 0
    assert second["others"] == first["others"]  # other packages: Python's behaviour, unchanged


def test_switched_off_nothing_is_kept(tmp_path: Path):
    off = _probe(tmp_path, "0")
    assert not off["installed"]
    assert not (tmp_path / "bytecode").exists()


def test_a_changed_source_gets_another_entry(tmp_path: Path):
    source = tmp_path / "m.py"
    source.write_text("x = 1\n")
    before = bytecode_cache._entry(tmp_path / "cache", str(source))
    os.utime(source, ns=(1, 10**18))
    after = bytecode_cache._entry(tmp_path / "cache", str(source))
    assert before is not None and after is not None and before != after
    assert bytecode_cache._entry(tmp_path / "cache", str(tmp_path / "missing.py")) is None


def test_only_pagedllm_modules_are_handled(tmp_path: Path):
    finder = bytecode_cache.KeptBytecodeFinder(tmp_path)
    assert finder.find_spec("json") is None
    spec = finder.find_spec("pagedllm.sampling_params", [str(ROOT / "pagedllm")])
    assert spec is not None and isinstance(spec.loader, bytecode_cache._KeptBytecodeLoader)
