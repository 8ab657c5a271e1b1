"""Documents -> chunks: paragraphs (blank-line separated) packed up to `chunk_size`; a longer
paragraph is split at sentence ends (. ! ? and 。！？) and, failing those, hard at the size.

Sizes are weighted characters: a CJK character counts 3 (it is about one token, where English
averages about four characters a token), so a size means about as many tokens in either script.

A chunk never crosses a document. Chunk ids are stable: uuid5(document id, chunk index), and the
document id is uuid5 of its resolved path, so re-ingesting a file overwrites its own chunks.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

# Suffixes read as text; anything else is reported and skipped.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".markdown", ".text")
_NAMESPACE = uuid.UUID("6a1f2d3c-8b7e-4f60-9d21-5c4b3a291807")
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s*")


@dataclass(frozen=True)
class Chunk:
    id: str  # uuid string (Qdrant point id)
    doc_id: str
    source: str  # the file's path
    index: int  # position in its document
    text: str


def document_id(path: Path) -> str:
    return str(uuid.uuid5(_NAMESPACE, str(path.resolve())))


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_document(path: Path) -> str:
    """The file's text; ValueError naming the problem (not a text file, not UTF-8, empty)."""
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise ValueError(f"{path}: not a text document (suffix {path.suffix or 'none'}; read: {', '.join(TEXT_SUFFIXES)})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ValueError(f"{path}: empty document")
    return text


def split_text(text: str, chunk_size: int) -> list[str]:
    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        if weighted_len(para) <= chunk_size:
            pieces.append(para)
            continue
        for sent in _SENTENCE_END.split(para):
            while weighted_len(sent) > chunk_size:
                cut = _cut_at(sent, chunk_size)
                pieces.append(sent[:cut])
                sent = sent[cut:]
            if sent:
                pieces.append(sent)
    chunks: list[str] = []
    for piece in pieces:  # pack small pieces together, in order
        if chunks and weighted_len(chunks[-1]) + 1 + weighted_len(piece) <= chunk_size:
            chunks[-1] = f"{chunks[-1]} {piece}" if not _cjk(piece) else chunks[-1] + piece
        else:
            chunks.append(piece)
    return chunks


def weighted_len(s: str) -> int:
    return len(s) + 2 * sum(1 for ch in s if "\u4e00" <= ch <= "\u9fff")


def _cut_at(s: str, size: int) -> int:
    """The longest prefix of `s` whose weighted length fits `size` (at least one character)."""
    total = 0
    for i, ch in enumerate(s):
        total += 3 if "\u4e00" <= ch <= "\u9fff" else 1
        if total > size:
            return max(i, 1)
    return len(s)


def _cjk(s: str) -> bool:
    return bool(s) and "\u4e00" <= s[0] <= "\u9fff"


def chunk_document(path: Path, text: str, chunk_size: int) -> list[Chunk]:
    doc = document_id(path)
    return [Chunk(str(uuid.uuid5(uuid.UUID(doc), str(i))), doc, str(path), i, t)
            for i, t in enumerate(split_text(text, chunk_size))]
