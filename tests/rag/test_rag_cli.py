"""`pagedllm rag ingest` end to end (progress, chunks/s, re-ingest unchanged, a bad file skipped) and
`pagedllm rag serve`'s refusal of an empty store."""

from __future__ import annotations

from pathlib import Path

from pagedllm.entrypoints.cli import main

CORPUS = Path(__file__).parent / "corpus"


def test_rag_ingest_cli(tmp_path: Path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe broken")
    store = str(tmp_path / "store")
    assert main(["rag", "ingest", str(CORPUS), str(bad), "--store", store, "--chunk-size", "300"]) == 0
    out = capsys.readouterr()
    assert "ingested 21 chunks from 2 documents" in out.err and "chunks/s" in out.err and "bad.txt" in out.err
    assert main(["rag", "ingest", str(CORPUS), "--store", store, "--chunk-size", "300"]) == 0
    assert "ingested 0 chunks from 0 documents" in capsys.readouterr().out  # both unchanged
    assert main(["rag", "serve", "--store", str(tmp_path / "empty")]) == 2
    assert "holds no chunks" in capsys.readouterr().err
