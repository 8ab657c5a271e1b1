"""Write docs/ENVIRONMENT.md from pagedllm/envs.py, whose comment above each entry is the variable's
documentation (tests/test_envs.py checks the file is current): `python scripts/gen_env_doc.py`.

The table is read from the source text, not by importing: a section starts at a `# -- name --` line
inside `environment_variables`, and an entry's text is the run of `#` lines right above its
`"NAME": reader,` line. The default is the second argument of `_flag` / `_str` / `_int` / `_names` when the
reader is one of those, "unset" for readers without one, else what the text says.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / "pagedllm" / "envs.py"
DOC = ROOT / "docs" / "ENVIRONMENT.md"

HEAD = """# Environment variables

Every variable pagedllm reads, with its default. `pagedllm/envs.py` is the one module that reads the
environment (tests/test_envs.py checks that no other does); each entry's comment there is its
documentation, and this page is generated from those comments by `scripts/gen_env_doc.py`.

The switches under "kernels and the GPU fast path" exist for A/B timings and for checks that wait for a
GPU: their defaults are the measured choices (BENCHMARKS.md has the measurements); a default run sets
none of them.
"""

_ENTRY = re.compile(r'^\s*"([A-Z0-9_]+)":\s*(.*)$')
_SECTION = re.compile(r"^\s*# -- (.+?) --")
_DEFAULT = re.compile(r'^_(?:flag|str|int|names)\("[A-Z0-9_]+",\s*(.+?)\),?$')
_OR_NUMBER = re.compile(r"\bor (\d+)\)")
# Readers with no default of their own: unset means "not set", with the meaning the text gives it.
_UNSET = re.compile(r'^(?:_str\("[A-Z0-9_]+"\)|lambda: _(?:optional_flag|positive_int)\("[A-Z0-9_]+"\)'
                    r'(?: or 0)?|_multiprocessing|_cache_root|_fail_at_step),?$')


def entries(source: str) -> list[tuple[str, str, str, str]]:
    """(section, name, default, text) for every entry of `environment_variables`, in file order."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("environment_variables"))
    section, comment, rows = "", [], []
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        if m := _SECTION.match(line):
            section, comment = m.group(1), []
        elif line.strip().startswith("#"):
            comment.append(line.strip()[1:].strip())
        elif m := _ENTRY.match(line):
            name, reader = m.groups()
            d = _DEFAULT.match(reader.strip())
            if d:
                default = {"True": "1", "False": "0", '""': "empty"}.get(d.group(1), d.group(1))
            elif _UNSET.match(reader.strip()):
                default = "unset"
            elif m := _OR_NUMBER.search(reader):
                default = m.group(1)  # float(os.environ.get(NAME) or 300)
            else:
                default = "0" if reader.strip().endswith('== "1",') else "see text"
            rows.append((section, name, default.strip('"'), " ".join(comment)))
            comment = []
    return rows


def render() -> str:
    out, section = [HEAD], None
    for sec, name, default, text in entries(ENVS.read_text()):
        if sec != section:
            section = sec
            out.append(f"\n## {sec[0].upper()}{sec[1:]}\n\n| variable | default | meaning |\n|---|---|---|\n")
        out.append(f"| `{name}` | {default} | {text.replace('|', '/')} |\n")
    return "".join(out)


def main() -> None:
    DOC.write_text(render())
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
