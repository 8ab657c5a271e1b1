"""The embedded SmolLM2-135M-Instruct served as `make serve` serves it (no --model), and the seed
article's `openai` client snippets run against it with only base_url and the model name changed
(and max_tokens lowered from 2000 / 1024 so the test takes seconds on a CPU)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"

SEED_SNIPPET = '''
from openai import OpenAI

# 指向vLLM服务
client = OpenAI(
    base_url="http://localhost:8000/v1",
    api_key="not-needed",  # vLLM默认不验证API key
)

# Chat Completions
response = client.chat.completions.create(
    model="qwen-72b",
    messages=[
        {"role": "system", "content": "你是一个技术文档生成器。"},
        {"role": "user", "content": "写一篇关于Docker容器网络的技术文档。"},
    ],
    temperature=0.7,
    max_tokens=2000,
)
print(response.choices[0].message.content)

# 流式输出
stream = client.chat.completions.create(
    model="qwen-72b",
    messages=[{"role": "user", "content": "解释Kubernetes的调度算法。"}],
    stream=True,
    max_tokens=1024,
)
for chunk in stream:
    if chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
'''


def test_seed_article_snippets_run(smollm2_server):
    code = (
        SEED_SNIPPET.replace("http://localhost:8000/v1", smollm2_server.base_url)
        .replace('"qwen-72b"', f'"{MODEL}"')
        .replace("max_tokens=2000", "max_tokens=24")
        .replace("max_tokens=1024", "max_tokens=24")
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "seed_snippet", "exec"), {})
    assert len(out.getvalue().strip()) > 10


def test_real_model_answers_and_streams_the_same_text(smollm2_server):
    client = smollm2_server.client()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20,
        temperature=0,
    )
    assert "Paris" in r.choices[0].message.content
    # multibyte text: streamed deltas never split a character and add up to the full answer
    msgs = [{"role": "user", "content": "解释Kubernetes的调度算法。"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True))
    deltas = [ch.delta.content or "" for c in chunks for ch in c.choices]
    assert "".join(deltas) == full.choices[0].message.content
    assert not any("\ufffd" in d for d in deltas)
    count = smollm2_server.post("/tokenize", {"model": MODEL, "messages": msgs}).json()["count"]
    assert full.usage.prompt_tokens == count


def test_readme_server_examples_work(smollm2_server):
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("## The server"):]
    curl = section[section.index("```bash"):section.index("```", section.index("```bash") + 3)]
    body = json.loads(curl[curl.index("-d '") + 4:curl.rindex("'")])
    r = httpx.post(smollm2_server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    start = section.index("```python") + len("```python")
    code = section[start:section.index("```", start)].replace("http://127.0.0.1:8000/v1", smollm2_server.base_url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "readme_snippet", "exec"), {})
    assert out.getvalue().strip()  # sampled with the model's default temperature: any answer
