"""POST /v1/chat/completions through the official `openai` client against the real server."""

from __future__ import annotations

import math

import openai
import pytest

MODEL = "tiny"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me something about the sea."},
]


def stream_chat(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("model", MODEL)
    return list(client.chat.completions.create(stream=True, **kwargs))


def test_stream_equals_non_stream_at_temperature_0(client, tiny_tokenizer, tiny_chat_template):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    # usage: the tokens of the server's chat template (--chat-template), exactly
    text = tiny_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, chat_template=tiny_chat_template
    )
    assert text.startswith("CUSTOM TEMPLATE\n")
    prompt_ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == len(prompt_ids) + 24

    chunks = stream_chat(
        client, messages=MESSAGES, max_tokens=24, temperature=0, stream_options={"include_usage": True}
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.delta.role is None for c in chunks[1:] for ch in c.choices)
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert text == choice.message.content
    finishing = [ch for c in chunks for ch in c.choices if ch.finish_reason is not None]
    assert [ch.finish_reason for ch in finishing] == ["length"]
    # include_usage: a last chunk with no choices and the usage; no usage before it
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage_counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(chunks[-1].usage, k) for k in usage_counts] == [getattr(full.usage, k) for k in usage_counts]
    # the same prompt a second time: its full blocks came from the prefix cache (block size 16)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // 16 * 16
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = stream_chat(client, messages=MESSAGES, max_tokens=5, temperature=0)
    assert all(c.usage is None for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)


def test_stop_string_and_include_stop_str(client):
    base = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0)
    text = base.choices[0].message.content
    stop = text[8:12]  # a piece from the middle of what the model says
    assert len(stop) == 4
    cut = text[: text.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == cut
    assert r.choices[0].model_extra["stop_reason"] == stop
    # streamed: the text never shows the stop string, and stops at the same place
    chunks = stream_chat(client, messages=MESSAGES, max_tokens=30, temperature=0, stop=stop)
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == cut
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["stop"]
    # vLLM's include_stop_str_in_output
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].message.content == cut + stop


def test_n3_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, n=3, seed=1234)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 36
    # the same seed streamed gives the same three texts, each choice finishing exactly once
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    texts = ["", "", ""]
    finishes = [0, 0, 0]
    roles = [0, 0, 0]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] += ch.finish_reason is not None
            roles[ch.index] += ch.delta.role == "assistant"
    assert texts == [c.message.content for c in a.choices]
    assert finishes == [1, 1, 1] and roles == [1, 1, 1]


def test_logprobs_shape(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token and math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-5)
    # logprobs=True alone: the sampled token's logprob, no alternatives
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True)
    assert [len(t.top_logprobs) for t in r.choices[0].logprobs.content] == [0, 0, 0]
    # streamed logprobs arrive with their deltas
    chunks = stream_chat(client, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_content_parts_and_max_completion_tokens(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=5, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=joined, max_tokens=5, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.usage.completion_tokens == 5
    assert a.choices[0].message.content == b.choices[0].message.content


def test_vllm_extra_body_fields(client):
    base = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    tokens = base.choices[0].model_extra["token_ids"]
    assert len(tokens) == 8 and len(base.model_extra["prompt_token_ids"]) == base.usage.prompt_tokens
    third = tokens[2]
    # stop_token_ids: stops on (and reports) that id; the other vLLM fields are accepted
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [third], "ignore_eos": True, "top_k": 5, "min_p": 0.0,
                    "repetition_penalty": 1.0, "skip_special_tokens": True, "spaces_between_special_tokens": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == third
    assert r.usage.completion_tokens == tokens.index(third) + 1
    # min_tokens holds the stop token back until min_tokens were generated
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
        extra_body={"stop_token_ids": [tokens[0]], "min_tokens": 4},
    )
    assert r.usage.completion_tokens >= 4
    # streamed token ids add up to the same ids
    chunks = stream_chat(client, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra["token_ids"]] == tokens
    assert chunks[0].model_extra["prompt_token_ids"] == base.model_extra["prompt_token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_continues_the_assistant_message(client, stream):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    kwargs = dict(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                  extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True})
    if stream:
        text = "".join(ch.delta.content or "" for c in stream_chat(client, **kwargs) for ch in c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text.startswith("Well,") and len(text) > len("Well,")
