"""The user documentation points at things that exist: every relative link of README.md, ARCHITECTURE.md and
docs/*.md names a file of the repository (and an in-page `#anchor` a heading of the page it names), and every
path-like file reference (`worker/graph_plan.py`, `tests/models/test_gemma.py`, `scripts/gen_env_doc.py`) whose
first component is a directory of the repository, or of the pagedllm package, names a file that is there.

References that name no repository file are left alone: C headers and names without a directory (`Python.h`,
`envs.py`), checkpoint files (`1_Pooling/config.json`: `1_Pooling` is no directory of ours), absolute paths
(`/tmp/cpuperf`), variables (`$PAGEDLLM_CACHE_ROOT/graph_plans/<key>.json`) and placeholders
(`models/<name>.py`). A glob (`kernels/*.py`) must match something; braces expand
(`tests/models/test_{gemma,phi3}.py` names two files)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pagedllm"
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target): the target up to a space or the closing parenthesis (titles are not used in these docs).
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
# dir/.../name.ext, not starting inside a longer path, a URL or a variable; braces and * allowed in the last part.
PATH_REF = re.compile(
    r"(?<![\w./$~{}<>*-])((?:[\w.-]+/)+[\w.*{},<>-]+\.(?:py|md|sh|json|ya?ml|toml|html|c|h|txt))(?![\w/])"
)
EXTERNAL = ("http://", "https://", "mailto:")


def _dirs(base: Path) -> set[str]:
    return {p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}


TOP_DIRS = _dirs(ROOT)
PACKAGE_DIRS = _dirs(PACKAGE)


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: "## The RAG service (`pip install pagedllm[rag]`)" ->
    "the-rag-service-pip-install-pagedllmrag" (lower case, punctuation dropped, spaces -> -)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    out, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            out.add(github_slug(m.group(1)))
    return out


def expand_braces(ref: str) -> list[str]:
    """"a/test_{x,y}.py" -> ["a/test_x.py", "a/test_y.py"] (one level: all these docs use)."""
    m = re.search(r"\{([^{}]*)\}", ref)
    if m is None:
        return [ref]
    return [out for alt in m.group(1).split(",") for out in expand_braces(ref[:m.start()] + alt + ref[m.end():])]


def resolve(ref: str) -> list[Path] | None:
    """The candidate locations of a path-like reference, or None when it names no repository file."""
    if "<" in ref or ">" in ref:
        return None  # a placeholder: models/<name>.py
    first = ref.split("/", 1)[0]
    bases = []
    if first in TOP_DIRS:
        bases.append(ROOT)
    if first in PACKAGE_DIRS:
        bases.append(PACKAGE)  # docs name package files from inside the package: worker/graph_plan.py
    return [base / ref for base in bases] or None


def exists(candidate: Path) -> bool:
    if "*" in candidate.name:
        return any(candidate.parent.glob(candidate.name))
    return candidate.is_file()


def test_slug_and_braces_and_resolution():
    """The helpers themselves, so that a passing check below means something."""
    assert github_slug("The RAG service (`pip install pagedllm[rag]`)") == "the-rag-service-pip-install-pagedllmrag"
    assert github_slug("Not built") == "not-built"
    assert expand_braces("tests/models/test_{gemma,phi3}.py") == ["tests/models/test_gemma.py", "tests/models/test_phi3.py"]
    assert resolve("1_Pooling/config.json") is None
    assert resolve("models/<name>.py") is None
    assert resolve("worker/graph_plan.py") == [PACKAGE / "worker/graph_plan.py"]
    assert not exists(PACKAGE / "worker" / "no_such_module.py")
    assert exists(PACKAGE / "kernels" / "*.py")
    refs = [m.group(1) for m in PATH_REF.finditer(
        "see worker/graph_plan.py, /tmp/x/y.py, $ROOT/a/b.py, https://x.org/a/b.md and `Python.h`")]
    assert refs == ["worker/graph_plan.py"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(doc: Path):
    bad = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        if not page.exists():
            bad.append(f"{target}: no such file")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            bad.append(f"{target}: no heading #{anchor} in {page.relative_to(ROOT)}")
    assert not bad, f"{doc.relative_to(ROOT)}: broken links: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_file_references_exist(doc: Path):
    bad = []
    for ref in sorted(set(PATH_REF.findall(doc.read_text()))):
        for one in expand_braces(ref):
            candidates = resolve(one)
            if candidates is not None and not any(exists(c) for c in candidates):
                bad.append(one)
    assert not bad, f"{doc.relative_to(ROOT)} names files that are not in the repository: {bad}"
