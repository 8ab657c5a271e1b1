"""POST /v1/completions through the official `openai` client against the real server."""

from __future__ import annotations

import math

import openai
import pytest

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog and then"


def streamed(client, **kwargs):
    return list(client.completions.create(model=MODEL, stream=True, **kwargs))


def test_stream_equals_non_stream_and_usage(client, tiny_tokenizer):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.choices[0].finish_reason == "length"
    n_prompt = len(tiny_tokenizer.encode(PROMPT))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        n_prompt, 20, n_prompt + 20
    )
    chunks = streamed(client, prompt=PROMPT, max_tokens=20, temperature=0, stream_options={"include_usage": True})
    assert "".join(ch.text for c in chunks for ch in c.choices) == full.choices[0].text
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # vLLM's continuous_usage_stats: running usage on every chunk
    chunks = streamed(
        client, prompt=PROMPT, max_tokens=5, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    completion_counts = [c.usage.completion_tokens for c in chunks]
    assert completion_counts == sorted(completion_counts) and completion_counts[-1] == 5


def test_stop_string(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = text[10:13]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]
    chunks = streamed(client, prompt=PROMPT, max_tokens=30, temperature=0, stop=stop)
    assert "".join(ch.text for c in chunks for ch in c.choices) == text[: text.index(stop)]


def test_prompt_forms(client, tiny_tokenizer):
    """A string, a list of strings, token ids, lists of token ids: same tokens -> same text."""
    other = "Once upon a time"
    ids_a, ids_b = tiny_tokenizer.encode(PROMPT), tiny_tokenizer.encode(other)
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    a = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    b = client.completions.create(prompt=other, **kw).choices[0].text
    assert client.completions.create(prompt=ids_a, **kw).choices[0].text == a
    r = client.completions.create(prompt=[PROMPT, other], **kw)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == [a, b]
    assert r.usage.prompt_tokens == len(ids_a) + len(ids_b) and r.usage.completion_tokens == 12
    r = client.completions.create(prompt=[ids_a, ids_b], **kw)
    assert [c.text for c in r.choices] == [a, b]
    # two prompts x n=2: index = prompt_index * n + sample_index, streamed too
    r = client.completions.create(prompt=[PROMPT, other], n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and [c.text for c in r.choices] == [a, a, b, b]
    texts = [""] * 4
    for c in streamed(client, prompt=[PROMPT, other], n=2, max_tokens=6, temperature=0):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [a, a, b, b]


@pytest.mark.parametrize("stream", [False, True])
def test_echo(client, stream):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    if stream:
        text = "".join(ch.text for c in streamed(client, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
                       for ch in c.choices)
    else:
        text = client.completions.create(echo=True, **kw).choices[0].text
    assert text == PROMPT + plain


def test_logprobs_shape(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 1 <= len(top) <= 3 and tok in top
        # greedy: the chosen token has the highest logprob of the alternatives
        assert math.isclose(max(top.values()), tlp, abs_tol=1e-5)
    chunks = streamed(client, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    assert [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens] == lp.tokens
    offsets = [o for c in chunks for ch in c.choices if ch.logprobs for o in ch.logprobs.text_offset]
    assert offsets == lp.text_offset


def test_seed_reproducible_and_default_max_tokens(client):
    kw = dict(model=MODEL, prompt=PROMPT, temperature=1.0, top_p=0.9, seed=42, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    # OpenAI's default max_tokens for completions is 16
    assert a.usage.completion_tokens == 48


def test_cached_tokens_in_usage(client):
    """A second identical prompt is served from the prefix cache: usage says how much."""
    prompt = list(range(100, 150))  # 50 token ids: 3 full blocks of 16 + 2
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 48  # only the last 2 tokens computed
    assert second.choices[0].text == first.choices[0].text


def test_cache_salt_separates_prefix_caches(client):
    prompt = list(range(200, 250))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    other = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-b"})
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens == 48


def test_best_of_equal_to_n_is_served(client):
    """best_of may equal n (beam-style best_of > n is refused): each of the n samples is one request of
    n=1, which the engine process refused while it kept best_of=n (a 500)."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    r = client.completions.create(n=2, best_of=2, **kw)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6
    assert [c.text for c in client.completions.create(best_of=1, **kw).choices] == [r.choices[0].text]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          n=2, extra_body={"best_of": 2})
    assert [c.index for c in chat.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=1, best_of=3, **kw)


def test_prompt_logprobs_in_whole_answers(client, tiny_tokenizer):
    # vLLM's extra field: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    ids = tiny_tokenizer.encode(PROMPT)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    plp = full.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for t in range(1, len(ids)):
        entry = plp[t]
        assert str(ids[t]) in entry and 2 <= len(entry) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str) for v in entry.values())
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    cplp = chat.model_extra["prompt_logprobs"]
    assert cplp[0] is None and all(len(e) == 1 for e in cplp[1:]) and chat.usage.prompt_tokens == len(cplp)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None


def test_echo_with_logprobs_scores_the_prompt(client, tiny_tokenizer):
    # lm-eval's loglikelihood request to an OpenAI-compatible server: echo, logprobs=1, max_tokens=1; the
    # echoed prompt's tokens come first in logprobs, the first with None (vLLM's shape)
    ids = tiny_tokenizer.encode(PROMPT)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert full.choices[0].text.startswith(PROMPT[:10])
    # the same prompt positions as prompt_logprobs gives them
    plp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    for t in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[t], plp[t][str(ids[t])]["logprob"], abs_tol=1e-5)
    chunks = streamed(client, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True)
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert tokens[0] is None and len(tokens) == len(ids) + 2
