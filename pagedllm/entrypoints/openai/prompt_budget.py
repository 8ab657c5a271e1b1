"""A per-request CPU budget for preparing a prompt (chat template + tokenization), --max-prompt-cpu-seconds.

A chat template is a program: the server's own, or a request's under --trust-request-chat-template,
can loop for a long time (`range()` is bounded to 100,000 items, two nested loops are not), and a
tokenizer pool thread cannot be stopped from outside. So while a request's prompt is prepared, its
pool thread traces the template's own code (Jinja compiles templates to code named "<template>"):
each line executed there checks the thread's CPU time, and past the budget raises, which ends the
render with a 400. Code outside templates is not traced (returning None from the call hook), so a
normal render pays a few microseconds. A tokenizer call is one native call and cannot be
interrupted; its work is bounded by --max-prompt-bytes, checked on the rendered text before it, and
the budget is checked again after it.

    with prompt_cpu_budget(2.0, "messages"):   # in the pool thread
        text = render_chat(...)                # a runaway template: APIError 400 after 2 s of CPU
        ids = tokenizer.encode(text)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from pagedllm.entrypoints.openai.errors import APIError

TEMPLATE_FILENAME = "<template>"


class PromptBudgetExceeded(APIError):
    def __init__(self, seconds: float, param: str | None) -> None:
        super().__init__(
            f"Preparing this prompt (chat template and tokenization) took more than {seconds:g} s of CPU time, "
            "the limit (--max-prompt-cpu-seconds). Shorten the conversation or simplify the template.",
            param=param,
            code="prompt_too_expensive",
        )


@contextmanager
def prompt_cpu_budget(seconds: float, param: str | None = None) -> Iterator[None]:
    """Raise PromptBudgetExceeded in this thread once it used `seconds` of CPU inside the block
    (checked on every line of template code, and on leaving the block)."""
    deadline = time.thread_time() + seconds

    def line_hook(frame: FrameType, event: str, arg: Any) -> Any:
        if time.thread_time() > deadline:
            raise PromptBudgetExceeded(seconds, param)
        return line_hook

    def call_hook(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == TEMPLATE_FILENAME:
            return line_hook(frame, event, arg)
        return None

    previous = sys.gettrace()
    sys.settrace(call_hook)
    try:
        yield
    finally:
        sys.settrace(previous)
    if time.thread_time() > deadline:
        raise PromptBudgetExceeded(seconds, param)
