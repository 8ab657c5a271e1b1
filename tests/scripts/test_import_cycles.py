"""scripts/import_cycles.py finds no import cycle among pagedllm's modules (TYPE_CHECKING imports
counted), and does find one when two modules import each other, also through TYPE_CHECKING."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "import_cycles.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_pagedllm_has_no_import_cycle():
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("modules") and r.stdout.startswith("0 import cycle(s)")


def test_a_type_checking_cycle_is_found(tmp_path):
    pkg = tmp_path / "pagedllm"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from pagedllm.engine.b import B\n")
    (pkg / "engine" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedllm.engine import a\nclass B: ...\n")
    (pkg / "engine" / "c.py").write_text("def f():\n    from . import a\n")  # local: not counted
    r = run("--root", str(tmp_path))
    assert r.returncode == 1
    assert "pagedllm.engine.a -> pagedllm.engine.b -> pagedllm.engine.a" in r.stdout
    assert "1 import cycle(s) among 5 modules" in r.stdout
