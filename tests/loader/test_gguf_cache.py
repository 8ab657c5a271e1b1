"""load_or_create: build once, read back after, rebuild damaged entries, survive an unwritable cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedllm.loader.gguf_cache import cache_root, gguf_cache_dir, load_or_create


class Recorder:
    """create/load/save callbacks that store a string in `value.txt` and count their calls."""

    def __init__(self, value: str) -> None:
        self.value, self.created, self.loaded = value, 0, 0

    def create(self) -> str:
        self.created += 1
        return self.value

    def load(self, entry: Path) -> str:
        self.loaded += 1
        return (entry / "value.txt").read_text()

    def save(self, value: str, entry: Path) -> None:
        (entry / "value.txt").write_text(value)

    def __call__(self, file: Path, what: str = "thing") -> str:
        return load_or_create(file, what, load=self.load, create=self.create, save=self.save)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF v1")
    return file


def test_cache_root_from_env(isolated_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_root() == isolated_cache
    monkeypatch.delenv("PAGEDLLM_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pagedllm"


def test_created_once_then_loaded(model_file: Path, isolated_cache: Path) -> None:
    rec = Recorder("payload")
    assert rec(model_file) == "payload" and (rec.created, rec.loaded) == (1, 0)
    assert rec(model_file) == "payload" and (rec.created, rec.loaded) == (1, 1)
    entry = gguf_cache_dir(model_file, "thing")
    assert (entry / "value.txt").read_text() == "payload"
    assert [p.name for p in entry.parent.iterdir()] == ["thing"]  # no temporary directory left behind
    assert gguf_cache_dir(model_file, "other") != entry


def test_changed_file_gets_a_new_entry(model_file: Path, isolated_cache: Path) -> None:
    before = gguf_cache_dir(model_file, "thing")
    model_file.write_bytes(b"GGUF v2, longer")
    os.utime(model_file, ns=(1, 1))
    assert gguf_cache_dir(model_file, "thing") != before


def test_damaged_entry_is_rebuilt(model_file: Path, isolated_cache: Path) -> None:
    rec = Recorder("payload")
    rec(model_file)
    (gguf_cache_dir(model_file, "thing") / "value.txt").unlink()
    assert rec(model_file) == "payload" and rec.created == 2
    assert (gguf_cache_dir(model_file, "thing") / "value.txt").is_file()


def test_unwritable_cache_still_returns_the_value(
    model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(blocker))  # mkdir under a file fails
    rec = Recorder("payload")
    assert rec(model_file) == "payload" and rec(model_file) == "payload"
    assert rec.created == 2
