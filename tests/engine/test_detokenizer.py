"""Incremental detokenization: streamed pieces join to the full decode, no split characters or lost spaces."""

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from tests.utils import smollm_tokenizer

TEXTS = [
    " The capital of France is Paris.  Two  spaces, tabs\tand\nnewlines.",
    "Emoji 🤖🚀 and accents: café, naïve, Zürich — “quotes”.",
    "中文字符测试，日本語のテキスト、한국어 텍스트.",
]


def stream(tok, prompt_ids, ids, **kw):
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    pieces = []
    for t in ids:
        d.update([t])
        pieces.append(d.get_next_output_text(finished=False, delta=True))
    pieces.append(d.get_next_output_text(finished=True, delta=True))
    return d, pieces


def test_stream_equals_full_decode():
    tok = smollm_tokenizer()
    prompt = tok.encode("Say something:")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        d, pieces = stream(tok, prompt, ids)
        assert "".join(pieces) == tok.decode(ids) == d.output_text
        assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_held_back_while_streaming():
    tok = smollm_tokenizer()
    ids = tok.encode("one two three four five", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["three"])
    shown = ""
    for t in ids:
        found = d.update([t])
        shown += d.get_next_output_text(finished=found is not None, delta=True)
        if found:
            break
    assert found == "three"
    assert shown == "one two " == d.output_text
