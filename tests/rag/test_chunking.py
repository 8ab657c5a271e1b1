"""Chunking: paragraphs packed to a size, long ones split at sentence ends (English and Chinese),
CJK characters weighted, stable ids per document."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.rag.chunking import chunk_document, read_document, split_text, weighted_len


def test_split_packs_and_splits():
    text = "Short one.\n\nShort two.\n\n" + "A long sentence here. " * 20 + "\n\n" + "很长的中文句子。" * 30
    chunks = split_text(text, 120)
    assert chunks[0].startswith("Short one. Short two. A long sentence here.")  # packed in order
    assert all(weighted_len(c) <= 120 for c in chunks)
    assert "".join(chunks).replace(" ", "").count("很长的中文句子。") == 30
    assert weighted_len("ab中") == 5


def test_chunk_ids_are_stable_and_bad_files_refused(tmp_path: Path):
    f = tmp_path / "doc.md"
    f.write_text("one\n\ntwo", encoding="utf-8")
    a, b = chunk_document(f, read_document(f), 3), chunk_document(f, read_document(f), 3)
    assert [c.id for c in a] == [c.id for c in b] and len(a) == 2
    (tmp_path / "x.bin").write_bytes(b"\x00")
    with pytest.raises(ValueError, match="not a text document"):
        read_document(tmp_path / "x.bin")
    (tmp_path / "e.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_document(tmp_path / "e.txt")
