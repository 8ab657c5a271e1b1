"""Seeded model outputs (fuzz_tools.py) through every tool-call parser and reasoning parser, whole
and streamed in random pieces: nothing raises, every tool-call delta has OpenAI's wire shape, the
arguments are JSON objects, and the stream says what the whole answer says.

CI runs 2,000 outputs with seed 0 in about two seconds. Longer runs:

    FUZZ_TOOL_CASES=50000 FUZZ_SEED=7 pytest tests/reliability/test_fuzz_tools.py
"""

from __future__ import annotations

import os

from tests.reliability.fuzz_tools import ToolOutputFuzzer, check_choice_parsing

CASES = int(os.environ.get("FUZZ_TOOL_CASES", "2000"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))


def test_tool_and_reasoning_parsers_fuzz():
    failures = []
    kinds: set[tuple[str | None, str | None]] = set()
    for case in ToolOutputFuzzer(SEED).cases(CASES):
        kinds.add((case.tool_parser, case.reasoning_parser))
        problems = check_choice_parsing(case)
        if problems:
            failures.append((case, problems))
    lines = [f"{len(failures)} outputs had problems (FUZZ_SEED={SEED}); the first 10:"]
    for case, problems in failures[:10]:
        lines += [f"  {case}", f"      {problems[:3]}"]
    assert not failures, "\n".join(lines)
    assert len(kinds) == 15, kinds  # every tool parser (and none) with every reasoning parser (and none)
