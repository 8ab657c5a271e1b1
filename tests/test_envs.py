"""pagedllm/envs.py is the one place the environment is read: no other module of the package reads
it (an AST scan), every PAGEDLLM_* name the package mentions is declared there, each with a comment
that documents it, and an attribute reads the environment as it is when accessed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import pagedllm
import pagedllm.envs as envs

PACKAGE = Path(pagedllm.__file__).parent
ENVS = PACKAGE / "envs.py"
# The engine process takes the frontend's whole environment before any pagedllm module reads it:
# a hand-over, not a read of a variable.
HANDOVER = {("engine/core_proc_main.py", "clear"), ("engine/core_proc_main.py", "update"), ("engine/core_proc.py", "dict"),
            ("executor/multiproc.py", "dict"),  # the rank processes get this process's environment
            ("structured_output/backend_process.py", "dict")}  # so does the grammar worker process


def _environment_uses(path: Path) -> list[tuple[int, str]]:
    """(line, how) for every use of os.environ / os.getenv / os.putenv in the file."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            parent = parents.get(node)
            how = node.attr
            if node.attr == "environ" and isinstance(parent, ast.Attribute):
                how = parent.attr  # os.environ.get / .clear / ...
            elif isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name):
                how = parent.func.id  # dict(os.environ)
            uses.append((node.lineno, how))
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
            a.name in ("environ", "getenv", "putenv") for a in node.names
        ):
            uses.append((node.lineno, "from os import"))
    return uses


def test_no_module_but_envs_reads_the_environment():
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == ENVS:
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        for line, how in _environment_uses(path):
            if (rel, how) not in HANDOVER:
                strays.append(f"{rel}:{line} ({how})")
    assert not strays, "environment read outside pagedllm/envs.py: " + ", ".join(strays)


def test_every_pagedllm_variable_is_declared_and_documented():
    mentioned = set()
    for path in PACKAGE.rglob("*.py"):
        mentioned |= set(re.findall(r"\bPAGEDLLM_[A-Z0-9_]+\b", path.read_text()))
    assert mentioned - set(envs.environment_variables) == set()
    lines = ENVS.read_text().splitlines()
    for name in envs.environment_variables:
        (i,) = [i for i, line in enumerate(lines) if line.strip().startswith(f'"{name}":')]
        assert lines[i - 1].strip().startswith("#"), f"{name} has no comment above its entry in envs.py"


def test_attributes_read_the_environment_when_accessed(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path))
    assert envs.PAGEDLLM_CACHE_ROOT == tmp_path
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", "0")
    assert envs.kernel_switches().fused_decode is False
    monkeypatch.delenv("PAGEDLLM_FUSED_DECODE")
    assert envs.kernel_switches().fused_decode is True
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "2")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        getattr(envs, "PAGEDLLM_ENABLE_MULTIPROCESSING")  # noqa: B009 - the read itself raises
    with pytest.raises(AttributeError):
        getattr(envs, "PAGEDLLM_NOT_A_SWITCH")  # noqa: B009


def test_triton_cache_dir_defaults_under_the_cache_root_and_keeps_the_users(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path / "root"))
    path = envs.use_triton_cache_dir()
    assert path == tmp_path / "root" / "triton" and path.is_dir()
    assert envs.TRITON_CACHE_DIR == str(path)  # written for Triton and for worker processes
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert envs.use_triton_cache_dir() == tmp_path / "mine" and (tmp_path / "mine").is_dir()
    assert envs.TRITON_CACHE_DIR == str(tmp_path / "mine")


def test_environment_doc_is_current():
    """docs/ENVIRONMENT.md is generated from envs.py's comments: a switch added, removed or reworded
    without `python scripts/gen_env_doc.py` fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_env_doc", PACKAGE.parent / "scripts" / "gen_env_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rows = gen.entries(ENVS.read_text())
    assert [name for _, name, _, _ in rows] == list(envs.environment_variables)
    assert all(text for *_, text in rows)
    assert gen.DOC.read_text() == gen.render(), "docs/ENVIRONMENT.md is stale: run python scripts/gen_env_doc.py"
