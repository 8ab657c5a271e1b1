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


def test_spaces_between_special_tokens_false_joins_adjacent_added_tokens():
    """vLLM's rule: with skip_special_tokens=False and spaces_between_special_tokens=False, an added
    token right after another is emitted as its raw text. A WordPiece decode spaces every token apart,
    so the rule shows; the default keeps the tokenizer's own decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world"])}
    wp = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wp.pre_tokenizer, wp.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                  pad_token="[PAD]")
    hello, cls, sep, world = (tok.convert_tokens_to_ids(t) for t in ("hello", "[CLS]", "[SEP]", "world"))
    new = [cls, sep, cls, world]

    def run(**kw) -> str:
        det = IncrementalDetokenizer(tok, [hello], skip_special_tokens=False, **kw)
        for t in new:  # one token a step, as the engine streams them
            det.update([t])
        return det.output_text

    assert run() == tok.decode([hello, *new], skip_special_tokens=False)[len("hello"):] == " [CLS] [SEP] [CLS] world"
    assert run(spaces_between_special_tokens=False) == " [CLS][SEP][CLS] world"
    # Skipping special tokens leaves nothing to join: the flag changes nothing then.
    det = IncrementalDetokenizer(tok, [hello], skip_special_tokens=True, spaces_between_special_tokens=False)
    det.update(new)
    assert det.output_text == " world"


def test_the_rust_decode_shortcut_decodes_as_the_tokenizer_does():
    # The frontend calls the Rust decode directly when that is all tokenizer.decode would do.
    import random

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from pagedllm.engine.detokenizer import rust_decoder

    tok = smollm_tokenizer()
    fast = rust_decoder(tok)
    assert fast is not None
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    # A tokenizer with a clean-up pass (BERT's, which strips spaces before punctuation) keeps tokenizer.decode.
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, ".": 2}, unk_token="[UNK]"))
    cleaned = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    assert rust_decoder(cleaned) is None


def test_several_tokens_at_once_give_the_text_of_one_at_a_time():
    """The merged steps of a lagging frontend (several tokens per update) decode once per update on a
    byte-level tokenizer: the same text at every update boundary as token by token, for text, for
    multibyte characters split across updates, and for random ids (invalid UTF-8 included)."""
    import random

    tok = smollm_tokenizer()
    rng = random.Random(0)
    cases = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(60)] for _ in range(20)]
    # Byte tokens of multibyte characters (the 256 byte-level tokens come first in this vocabulary).
    cases += [[rng.randrange(256) for _ in range(60)] for _ in range(20)]
    prompt = tok.encode("Say something:")
    for ids in cases:
        one = IncrementalDetokenizer(tok, prompt)
        many = IncrementalDetokenizer(tok, prompt)
        assert many._batch_decode
        i = 0
        while i < len(ids):
            k = rng.randrange(1, 6)
            for t in ids[i : i + k]:
                one.update([t])
            many.update(ids[i : i + k])
            i += k
            assert many.output_text == one.output_text


def test_the_stop_string_first_in_the_text_wins_not_the_first_listed():
    """h61's fuzzer: stop ["e", " "] and a first token " competitors" answered " comp" with
    stop_reason "e": the text held the stop string " " (vLLM's loop takes the first listed too)."""
    tok = smollm_tokenizer()
    (token,) = tok.encode(" competitors", add_special_tokens=False)
    for include, text in ((False, ""), (True, " ")):
        d = IncrementalDetokenizer(tok, [], stop=["e", " "], include_stop_str_in_output=include)
        assert d.update([token]) == " "
        assert d.output_text == text
    d = IncrementalDetokenizer(tok, [], stop=["tit", "pet"])  # same for two later in the text
    assert d.update([token]) == "pet" and d.output_text == " com"
