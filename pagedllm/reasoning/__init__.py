"""Reasoning parsers (vLLM's --reasoning-parser): split a thinking model's output into the thinking
text (`reasoning_content`) and the answer (`content`).

    deepseek_r1  the template opens <think>; the output is reasoning until </think> (all of it when
                 no </think> came: the model was cut off while thinking)
    qwen3        the model writes <think>...</think> itself; output that does not open with <think>
                 is all answer (enable_thinking=false renders an empty think block in the prompt).
                 Templates that open <think> in the prompt (Qwen3 "thinking-2507") want deepseek_r1.
"""

from __future__ import annotations

from pagedllm.reasoning.think_parser import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not available; choose from {', '.join(REASONING_PARSERS)}.")
    return REASONING_PARSERS[name]


__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser"]
