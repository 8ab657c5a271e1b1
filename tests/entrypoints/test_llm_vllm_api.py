"""LLM's calls as a vLLM script makes them: vLLM's keyword arguments (lora_request=None, priority,
chat's continue_final_message, ...) run or are refused by name, never a TypeError for a keyword
vLLM takes. Found by exploratory testing of the offline API against vLLM 0.21's signatures."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import assert_pool_idle

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_gpu_blocks_override=128, max_model_len=256)


def test_generate_takes_vllms_keyword_arguments_at_their_off_values(llm):
    """lora_request=None / priority=[0, ...] / tokenization_kwargs=None were TypeErrors (unexpected keyword)."""
    ref = [o.outputs[0].token_ids for o in llm.generate(["a b", "c d"], GREEDY, use_tqdm=False)]
    outs = llm.generate(["a b", "c d"], GREEDY, use_tqdm=False, lora_request=None, priority=[0, 0],
                        tokenization_kwargs=None)
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("kwargs, words", [
    ({"lora_request": object()}, ["lora_request", "LoRA"]),
    ({"priority": [1]}, ["priority", "not built"]),
    ({"priority": [0, 0]}, ["priority", "one integer per prompt"]),
    ({"tokenization_kwargs": {"truncation": True}}, ["tokenization_kwargs"]),
])
def test_generate_refuses_what_is_not_built_by_name(llm, kwargs, words):
    with pytest.raises(ValueError) as e:
        llm.generate("a b", GREEDY, use_tqdm=False, **kwargs)
    for w in words:
        assert w in str(e.value), e.value
    assert_pool_idle(llm)


def test_use_tqdm_may_be_a_progress_bar_class(llm):
    """vLLM's use_tqdm: bool | Callable[..., tqdm]; a class was read as True and ignored."""
    made = []

    class Bar:
        def __init__(self, **kwargs):
            made.append(kwargs["total"])

        def update(self, n):
            made.append(n)

        def close(self):
            made.append("closed")

    llm.generate(["a", "b"], GREEDY, use_tqdm=Bar)
    assert made == [2, 1, 1, "closed"]


def test_chat_continue_final_message(llm, tiny_tokenizer):
    """continue_final_message was a TypeError; the last assistant message is rendered open."""
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, my name"}]
    out = llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    want = tiny_tokenizer.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert out.prompt == want and out.prompt.endswith("Hello, my name")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conv, GREEDY, use_tqdm=False, continue_final_message=True)  # add_generation_prompt defaults True


def test_chat_takes_vllms_arguments_in_vllms_order(llm):
    conv = [{"role": "user", "content": "Hi"}]
    ref = llm.chat(conv, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # vLLM's positional order: messages, sampling_params, use_tqdm, lora_request, chat_template
    out = llm.chat(conv, GREEDY, False, None, None, chat_template_content_format="string",
                   mm_processor_kwargs=None)[0]
    assert out.outputs[0].token_ids == ref
    with pytest.raises(ValueError, match="chat_template_content_format='openai'"):
        llm.chat(conv, GREEDY, use_tqdm=False, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat(conv, GREEDY, use_tqdm=False, lora_request=object())


def test_stop_strings_without_detokenize_are_refused():
    """vLLM refuses them; here they were silently never matched (the text is never built)."""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    assert SamplingParams(stop_token_ids=[5], detokenize=False).stop == []


def test_stop_strings_without_a_tokenizer_are_refused(tiny_model_dir):
    """skip_tokenizer_init: stop strings were silently never matched (no text is built)."""
    llm = LLM(str(tiny_model_dir), num_gpu_blocks_override=32, max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_vllms_prompt_types_import_and_run(llm):
    """`from vllm.inputs import TokensPrompt` / `from vllm import TextPrompt` had no pagedllm module to come from."""
    from pagedllm import PromptType, TextPrompt  # noqa: F401 - vLLM's top-level names
    from pagedllm.inputs import TokensPrompt

    a, b = llm.generate([TextPrompt(prompt="a b"), TokensPrompt(prompt_token_ids=[64, 65])], GREEDY, use_tqdm=False)
    assert a.prompt == "a b" and b.prompt_token_ids == [64, 65]


def test_outputs_have_vllms_fields(llm):
    """vLLM's RequestOutput / CompletionOutput fields for LoRA and encoder-decoder / multimodal models
    were AttributeErrors; they exist, empty, as in vLLM for a text-only model without adapters."""
    out = llm.generate("a b", GREEDY, use_tqdm=False)[0]
    assert out.lora_request is None and out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    assert out.multi_modal_placeholders == {} and out.outputs[0].lora_request is None


def test_vllm_methods_not_built_refuse_by_name(llm):
    # RLHF loops call these on vLLM's LLM; here each says what is not built instead of an AttributeError
    for call, name in ((lambda: llm.sleep(level=1), "LLM.sleep"), (lambda: llm.wake_up(), "LLM.wake_up"),
                       (lambda: llm.collective_rpc("report"), "LLM.collective_rpc"),
                       (lambda: llm.apply_model(lambda m: m), "LLM.apply_model")):
        with pytest.raises(NotImplementedError, match=f"{name} is not built"):
            call()
