"""A prompt dict's keys (vLLM's TextPrompt / TokensPrompt): the built ones work, the others are refused
with a ValueError naming the key, never dropped (a dropped multi_modal_data would run the text alone)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.processor import PROMPT_KEYS, Processor
from pagedllm.pooling.processing import tokenize_for_pooling
from tests.utils import tiny_model


class _Tok:
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def __call__(self, text: str, truncation: bool, max_length: int) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)[:max_length]}


def _processor() -> Processor:
    mc = SimpleNamespace(vocab_size=100, max_model_len=64, eos_token_ids=[], generation_config={})
    return Processor(SimpleNamespace(model_config=mc), _Tok())


def test_built_keys_work():
    p = _processor()
    assert PROMPT_KEYS == {"prompt", "prompt_token_ids", "cache_salt"}
    assert p.tokenize_prompt({"prompt": "ab"}).prompt_token_ids == [97, 98]
    pp = p.tokenize_prompt({"prompt": "ab", "prompt_token_ids": [5, 6], "cache_salt": "user-1"})
    assert (pp.prompt, pp.prompt_token_ids, pp.cache_salt) == ("ab", [5, 6], "user-1")
    # vLLM's types allow the multimodal keys set to None: that asks for nothing.
    assert p.tokenize_prompt({"prompt": "a", "multi_modal_data": None, "mm_processor_kwargs": {}}).prompt_token_ids == [97]


@pytest.mark.parametrize("key, value, why", [
    ("multi_modal_data", {"image": object()}, "multimodal inputs are not built"),
    ("mm_processor_kwargs", {"num_crops": 4}, "multimodal inputs are not built"),
    ("multi_modal_uuids", {"image": ["u1"]}, "multimodal inputs are not built"),
    ("prompt_embeds", [[0.0]], "prompt embeddings as input are not built"),
    ("token_type_ids", [0, 0], "token_type_ids are read by pooling models only"),
    ("encoder_prompt", "x", "encoder-decoder models are not built"),
])
def test_keys_not_built_are_refused_by_name(key, value, why):
    with pytest.raises(ValueError, match=f"prompt key '{key}' is not supported: {why}"):
        _processor().tokenize_prompt({"prompt": "ab", key: value})


def test_unknown_key_and_bad_salt_are_refused():
    with pytest.raises(ValueError, match="unknown prompt key 'promt'; a prompt dict takes cache_salt, prompt, "):
        _processor().tokenize_prompt({"promt": "ab", "prompt_token_ids": [1]})
    with pytest.raises(ValueError, match="cache_salt must be a string, got int"):
        _processor().tokenize_prompt({"prompt": "ab", "cache_salt": 7})


def test_pooling_takes_token_type_ids_and_refuses_images_even_when_it_retokenizes():
    p = _processor()
    assert tokenize_for_pooling(p, {"prompt_token_ids": [1, 2], "token_type_ids": [0, 1]}, None) == (None, [1, 2], [0, 1])
    # With truncation the text is tokenized again into a new dict: the check runs on the caller's dict first.
    with pytest.raises(ValueError, match="prompt key 'multi_modal_data' is not supported"):
        tokenize_for_pooling(p, {"prompt": "ab", "multi_modal_data": {"image": 1}}, 8)


def test_llm_generate_refuses_multi_modal_data():
    path, _ = tiny_model("llama3")
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=32, max_model_len=64)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt key 'multi_modal_data' is not supported: multimodal inputs"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": b"png"}}, params, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 2, 3], "cache_salt": "s"}, params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
