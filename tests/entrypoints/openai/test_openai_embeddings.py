"""all-MiniLM-L6-v2 (the embedded embedding model) served with runner=pooling, through the official
openai client, against sentence-transformers: cosine >= 0.99999 on 64 varied texts (English,
Chinese, empty-ish, long ones truncated at max_seq_length 256 by the same rule), batched and alone;
/v1/score and /rerank by cosine; the wrong kind of request on either kind of server is a 400."""

from __future__ import annotations

import random

import numpy as np
import openai
import pytest

from tests.entrypoints.openai.conftest import TINY_NAMES

NAME = "all-MiniLM-L6-v2"


def varied_texts() -> list[str]:
    rng = random.Random(0)
    words = ("paged attention schedules blocks of key value cache while the scheduler batches requests "
             "continuously and embeddings map sentences to vectors for retrieval").split()
    zh = ["向量检索", "大语言模型推理引擎", "今天天气很好，我们去公园散步吧。", "分页注意力把键值缓存分成固定大小的块。",
          "检索增强生成结合了搜索与生成。", "中文分词使用结巴。"]
    texts = ["", " ", ".", "\n", "a", "?!", "Hello!", "vLLM是一个高性能LLM推理引擎"]
    texts += zh + [z + " mixed with English words" for z in zh[:4]]
    texts += [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(38)]
    # Long: well past 256 word pieces, so both sides truncate.
    texts += [" ".join(rng.choice(words) for _ in range(n)) for n in (300, 500, 800)]
    texts += ["长文本" * 200, ("embedding " * 400).strip(), "\u00e9t\u00e9 caf\u00e9 na\u00efve " * 120,
              "tokens " * 255, "x " * 256]
    assert len(texts) == 64
    return texts


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    from pagedllm.pooling.embedded import embedded_embedding_model_path

    return SentenceTransformer(str(embedded_embedding_model_path()), device="cpu")


# Started by the package's server pool (conftest.ServerPool) beside the next server it needs.
SERVERS = {"embed": (["--model", "sentence-transformers/all-MiniLM-L6-v2", "--served-model-name", NAME, "qwen-72b",
                      "--max-num-seqs", "32", "--disable-uvicorn-access-log"], {})}


@pytest.fixture(scope="module")
def embed_server(server_pool):
    return server_pool.take("embed", __name__)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_embeddings_match_sentence_transformers(embed_server, st_model):
    texts = varied_texts()
    ref = st_model.encode(texts, batch_size=16, convert_to_numpy=True)
    client = embed_server.client()
    trunc = {"truncate_prompt_tokens": -1}  # vLLM's field: truncate to the model's 256, as ST does
    batched = client.embeddings.create(model=NAME, input=texts, encoding_format="float", extra_body=trunc)
    got = np.array([d.embedding for d in batched.data], dtype=np.float32)
    assert [d.index for d in batched.data] == list(range(64))
    assert _cos(got, ref).min() >= 0.99999
    tok = st_model.tokenizer
    n_tokens = sum(min(len(tok(t)["input_ids"]), 256) for t in texts)
    assert batched.usage.prompt_tokens == n_tokens == batched.usage.total_tokens
    # Alone (one input a request), and in the client's default base64 encoding.
    alone = np.array([client.embeddings.create(model=NAME, input=t, extra_body=trunc).data[0].embedding
                      for t in texts], dtype=np.float32)
    assert _cos(alone, ref).min() >= 0.99999
    assert np.abs(alone - got).max() < 1e-5


def test_embedding_input_forms_and_refusals(embed_server, st_model):
    client = embed_server.client()
    ids = st_model.tokenizer("token ids in")["input_ids"]
    a = client.embeddings.create(model=NAME, input="token ids in", encoding_format="float").data[0].embedding
    b = client.embeddings.create(model=NAME, input=ids, encoding_format="float").data[0].embedding
    c = client.embeddings.create(model=NAME, input=[ids, ids[:3]], encoding_format="float").data
    assert np.allclose(a, b, atol=1e-6) and np.allclose(c[0].embedding, a, atol=1e-6) and len(c) == 2
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.embeddings.create(model=NAME, input="word " * 400)
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model=NAME, input="x", dimensions=128)
    r = embed_server.post("/v1/embeddings", {"model": NAME, "input": "x", "bogus_field": 1})
    assert r.status_code == 400 and "bogus_field" in r.text
    with pytest.raises(openai.BadRequestError, match="runner='pooling'"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="runner='pooling'"):
        client.completions.create(model=NAME, prompt="hi")


def test_seed_embeddings_snippet(embed_server):
    # §3.2 of the seed article, as written (the server is started with --served-model-name qwen-72b).
    from openai import OpenAI

    client = OpenAI(base_url=embed_server.base_url, api_key="not-needed")
    embed_response = client.embeddings.create(model="qwen-72b", input="vLLM是一个高性能LLM推理引擎")
    assert len(embed_response.data[0].embedding) == 384


def test_score_and_rerank_by_cosine(embed_server, st_model):
    query, docs = "How are KV blocks managed?", ["Paged attention splits the KV cache into blocks.",
                                                 "The weather is nice today.", "向量检索"]
    ref = st_model.encode([query] + docs)
    want = _cos(np.repeat(ref[:1], 3, axis=0), ref[1:])
    s = embed_server.post("/v1/score", {"model": NAME, "text_1": query, "text_2": docs}).json()
    assert np.allclose([d["score"] for d in s["data"]], want, atol=1e-5)
    for path, body in (("/rerank", {"query": query, "documents": docs, "top_n": 2}),
                       ("/v2/rerank", {"query": query, "documents": [{"text": d} for d in docs], "top_n": 2})):
        r = embed_server.post(path, {"model": NAME, **body}).json()
        order = list(np.argsort(-want)[:2])
        assert [x["index"] for x in r["results"]] == order
        assert np.allclose([x["relevance_score"] for x in r["results"]], want[order], atol=1e-5)
        assert r["results"][0]["document"]["text"] == docs[order[0]] and r["usage"]["total_tokens"] > 0


def test_embeddings_on_a_generation_server_name_the_runner(tiny_server):
    r = tiny_server.post("/v1/embeddings", {"model": TINY_NAMES[0], "input": "hi"})
    assert r.status_code == 400 and "runner='generate'" in r.json()["error"]["message"]
    assert "--runner pooling" in r.json()["error"]["message"]
    r = tiny_server.post("/rerank", {"model": TINY_NAMES[0], "query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "runner='generate'" in r.text


def test_embeddings_fuzz(embed_server):
    """Seeded bad /v1/embeddings bodies (tests/reliability/fuzz_requests.py): 200 or a 4xx naming
    the field, never a 5xx or a hang; the server is idle and healthy after them."""
    from tests.reliability.fuzz_requests import RequestFuzzer, run_cases

    fuzz = RequestFuzzer(0, model=NAME, vocab_size=30522, max_model_len=256, generate=False, embeddings=True)
    failures = run_cases(embed_server.url(""), list(fuzz.cases(200)), timeout=20)
    assert not failures, [f"{c}: {p}" for c, p in failures[:5]]
    assert embed_server.get("/health").status_code == 200
    m = embed_server.wait_idle()
    assert m[("vllm:num_requests_running", ())] == 0 and m[("vllm:num_requests_waiting", ())] == 0


def test_truncate_prompt_tokens_past_the_context_names_the_field(embed_server):
    """serving_engine.add_request: the refusal had param null."""
    r = embed_server.post("/v1/embeddings", {"model": NAME, "input": "hi", "truncate_prompt_tokens": 10**30})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.mark.parametrize("body, param, words", [
    ({"queries": ["a", "b"], "documents": []}, "documents", "documents is empty"),
    ({"queries": [], "documents": ["a"]}, "queries", "queries is empty"),
    ({"text_1": ["a", "b"], "documents": ["x", "y", "z"]}, "documents", "text_1 has 2 texts and documents 3"),
    ({"queries": "q"}, "documents", "give text_1 and text_2"),
])
def test_score_errors_name_the_fields_the_request_used(embed_server, body, param, words):
    """serving_score.py (h61's fuzzer): a body of queries / documents was answered "text_2 is
    empty" with param text_2."""
    r = embed_server.post("/v1/score", {"model": NAME, **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param, r.text
