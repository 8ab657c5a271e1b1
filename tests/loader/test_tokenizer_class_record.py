"""A tokenizer directory's class, as AutoTokenizer picked it, remembered for the next load
(loader/tokenizer.py, load_tokenizer_dir): the next load skips AutoTokenizer and gives the same
tokenizer; an edited directory or a damaged record goes back to AutoTokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from pagedllm.loader import tokenizer as tokenizer_mod
from pagedllm.loader.tokenizer import load_tokenizer

TEXT = "hello world hello"


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                               unk_token="[UNK]")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "tok"
    tok.save_pretrained(path)
    return path


def _count_auto_calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = transformers.AutoTokenizer.from_pretrained

    def counted(path, *args, **kwargs):
        calls.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return calls


def test_the_second_load_takes_the_remembered_class(tokenizer_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path / "cache"))
    calls = _count_auto_calls(monkeypatch)
    first = load_tokenizer(tokenizer_dir)
    assert len(calls) == 1
    records = list((tmp_path / "cache" / "tokenizer_classes").glob("*.json"))
    assert len(records) == 1
    assert json.loads(records[0].read_text())["class"] == [type(first).__module__, type(first).__qualname__]

    second = load_tokenizer(tokenizer_dir)
    assert len(calls) == 1  # AutoTokenizer not asked again
    assert type(second) is type(first)
    assert second(TEXT).input_ids == first(TEXT).input_ids == [3, 4, 3]
    assert (second.bos_token, second.eos_token, second.chat_template) == (
        first.bos_token, first.eos_token, first.chat_template)
    assert second.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_an_edited_directory_or_a_damaged_record_asks_autotokenizer(tokenizer_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path / "cache"))
    calls = _count_auto_calls(monkeypatch)
    load_tokenizer(tokenizer_dir)
    record = tokenizer_mod._class_record(tokenizer_dir, False, True)
    assert record is not None and record.is_file()
    record.write_text("{not json")
    assert load_tokenizer(tokenizer_dir)(TEXT).input_ids == [3, 4, 3]
    assert len(calls) == 2 and json.loads(record.read_text())["class"]  # rewritten whole

    config = tokenizer_dir / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")  # another size: another key
    assert tokenizer_mod._class_record(tokenizer_dir, False, True) != record
    load_tokenizer(tokenizer_dir)
    assert len(calls) == 3



_PROBE = """
import sys
from pathlib import Path
from pagedllm.loader.tokenizer import load_tokenizer_dir
import transformers
path, how, text = sys.argv[1:]
tok = load_tokenizer_dir(Path(path)) if how == "pagedllm" else transformers.AutoTokenizer.from_pretrained(path)
print(tok(text)["input_ids"], "transformers.models.auto.modeling_auto" in sys.modules, sep="|")
"""


def test_a_first_load_imports_no_auto_model_registry(tokenizer_dir: Path, tmp_path: Path):
    """AutoTokenizer's modules write their docstrings from the auto-model registry (modeling_auto, whose
    factory imports generation and masking utilities: seconds of a first start on the H200 host); under
    pagedllm's light import (no class remembered yet) they do not, and the tokenizer is the same."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PAGEDLLM_CACHE_ROOT": str(tmp_path / "cache")}

    def probe(how: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(tokenizer_dir), how, TEXT], env=env, check=True,
                              capture_output=True, text=True)
        return done.stdout.strip().splitlines()[-1].split("|")

    ids, registry = probe("pagedllm")
    want_ids, want_registry = probe("transformers")
    assert want_registry == "True"  # what the light import avoids (so this test can fail)
    assert registry == "False"
    assert ids == want_ids
