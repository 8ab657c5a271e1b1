"""The streamed completion chunk that the server writes without pydantic (one per token per stream,
part of the CPU serving speed work) is the pydantic models' JSON text, character for character."""

import pytest

from pagedllm.entrypoints.openai.protocol import CompletionResponseStreamChoice, CompletionStreamResponse, UsageInfo
from pagedllm.entrypoints.openai.serving_completion import stream_chunk_head, stream_chunk_json
from pagedllm.entrypoints.openai.serving_engine import sse

TEXTS = ["", "Paris", " the", "é€😀 日本", 'quote " backslash \\ slash /', "".join(map(chr, range(0, 0x21))) + "\x7f",
         "\u2028\u2029"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(
    "finish,stop,prompt_ids,ids,usage",
    [
        (None, None, None, None, None),
        ("stop", "\n\n", [1, 2, 3], [7], UsageInfo(prompt_tokens=3, completion_tokens=1, total_tokens=4,
                                                    prompt_tokens_details={"cached_tokens": 0})),
        ("stop", 2, None, [5, 6], None),
        ("length", None, None, [], UsageInfo(prompt_tokens=1, total_tokens=1)),
    ],
)
def test_same_text_as_pydantic(text, finish, stop, prompt_ids, ids, usage):
    rid, created, model = "cmpl-abc\u00e9", 1700000000, 'm"odel/é'
    expected = sse(CompletionStreamResponse(
        id=rid, created=created, model=model, usage=usage,
        choices=[CompletionResponseStreamChoice(index=3, text=text, finish_reason=finish, stop_reason=stop,
                                                prompt_token_ids=prompt_ids, token_ids=ids)],
    ))
    got = stream_chunk_json(stream_chunk_head(rid, created, model), 3, text, finish, stop, prompt_ids, ids, usage)
    assert got == expected


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_chat_content_chunk_same_text_as_pydantic(text):
    from pagedllm.entrypoints.openai.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        DeltaMessage,
    )
    from pagedllm.entrypoints.openai.serving_chat import chat_chunk_head, chat_content_chunk

    rid, created, model = "chatcmpl-abc\u00e9", 1700000000, 'm"odel/é'
    expected = sse(ChatCompletionStreamResponse(
        id=rid, created=created, model=model,
        choices=[ChatCompletionResponseStreamChoice(index=2, delta=DeltaMessage(content=text))],
    ))
    assert chat_content_chunk(chat_chunk_head(rid, created, model), 2, text) == expected
