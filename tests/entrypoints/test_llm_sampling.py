"""The LLM API's sampling behaviour, as in vLLM: seeds, n, stop strings/ids, min/max tokens, ignore_eos."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import assert_pool_idle, hf_greedy, tiny_model

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm():
    path, _ = tiny_model("llama3", vocab_size=49152, with_tokenizer=True)
    return LLM(path, num_gpu_blocks_override=256, max_model_len=256)


def gen(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_idle(llm)
    return outs


def test_seeded_sampling_reproducible_across_batches(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = gen(llm, PROMPT, p)[0].outputs[0].token_ids
    again = gen(llm, PROMPT, p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = gen(llm, ["Hello there", PROMPT, "Another prompt here"], [others, p, others])[1].outputs[0].token_ids
    assert alone == again == mixed
    unseeded = [gen(llm, PROMPT, others)[0].outputs[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # 20 tokens of a 49k vocabulary: a clash means no randomness


def test_n_gives_n_distinct_outputs(llm):
    out = gen(llm, PROMPT, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    again = gen(llm, PROMPT, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_max_tokens_and_ignore_eos(llm):
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"


def test_stop_token_ids_and_min_tokens(llm):
    ref = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens: the stop token is masked until min_tokens are out, so the output must differ
    late = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                           stop_token_ids=[stop_tok]))[0].outputs[0]
    assert len(late.token_ids) >= first + 2
    assert stop_tok not in late.token_ids[: first + 1]


def test_stop_strings(llm):
    tok = llm.get_tokenizer()
    ref = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"degenerate stop string from {text!r}"
    cut = text.index(stop)
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    inc = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                          include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == text[: cut + len(stop)]
    assert tok.decode(out.token_ids).startswith(text[:cut])


def test_detokenized_text_equals_decode(llm):
    out = gen(llm, PROMPT, SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.0001), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=5, min_tokens=6), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_too_long_and_bad_inputs(llm):
    long_prompt = {"prompt_token_ids": [5] * 250}
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.generate(long_prompt, SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(PROMPT, SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate(PROMPT, SamplingParams(logprobs=21), use_tqdm=False)
    assert_pool_idle(llm)


def test_unsupported_engine_args_fail_clearly():
    path, _ = tiny_model("llama3")
    with pytest.raises(ValueError, match="4 attention heads are not divisible by tensor_parallel_size 3"):
        LLM(path, tensor_parallel_size=3, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="quantization='awq' needs a quantized awq checkpoint"):
        LLM(path, quantization="awq", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="'bitsandbytes' is not built"):
        LLM(path, quantization="bitsandbytes", skip_tokenizer_init=True)
    with pytest.raises(TypeError, match="not_a_flag"):
        LLM(path, not_a_flag=1)


def test_sliding_window_does_not_cap_max_model_len(tmp_path):
    # Sliding-window attention is built (tests/models/test_sliding_window.py holds it to transformers),
    # so a model serves its whole max_position_embeddings, as in vLLM.
    import transformers

    from pagedllm.engine.arg_utils import EngineArgs

    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                     max_position_embeddings=1024, sliding_window=256)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path)
    config = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True).create_engine_config()
    assert config.model_config.max_model_len == 1024
    assert config.model_config.kv_sliding_window == 256  # every layer windowed: blocks behind it are freed
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=2048).create_engine_config()
    # vLLM's --disable-sliding-window caps the context at the window.
    capped = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, disable_sliding_window=True)
    assert capped.create_engine_config().model_config.max_model_len == 256
    with pytest.raises(ValueError, match="capped at the sliding window"):
        EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, disable_sliding_window=True,
                   max_model_len=512).create_engine_config()


def test_repetition_penalty_covers_the_prompt_as_in_transformers():
    # A 512-token vocabulary and a prompt of every odd id (no id 0, which transformers' generate
    # would mask as padding): the unpenalized continuation reuses prompt ids, so a penalty that
    # skipped the prompt would part from transformers', which penalizes prompt and output alike (as
    # vLLM). The runner copies the prompt only for rows with a penalty; the other row must not care.
    path, hf = tiny_model("qwen2")
    llm = LLM(path, num_gpu_blocks_override=64, max_model_len=512)
    prompt = list(range(1, 512, 2))
    penalized = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=2.0)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = gen(llm, [{"prompt_token_ids": prompt}] * 2, [penalized, plain])
    got_penalized, got_plain = (o.outputs[0].token_ids for o in outs)
    assert got_plain == hf_greedy(hf, prompt, 8)
    assert any(t in prompt for t in got_plain)  # the penalty has prompt ids to act on
    assert got_penalized == hf_greedy(hf, prompt, 8, repetition_penalty=2.0)
    assert got_penalized != got_plain


def test_bad_calls_are_refused_by_name_and_leave_nothing_behind(llm):
    """Found by the offline fuzzer (tests/reliability/test_fuzz_requests.py): these raised "'NoneType'
    object is not iterable" and the like, and a prompt refused with a TypeError left the prompts
    before it queued in the engine (their blocks held, their outputs never returned)."""
    for prompts, words in [(None, "prompts must be"), (5, "prompts must be")]:
        with pytest.raises(TypeError, match=words):
            llm.generate(prompts, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be"):
        llm.generate(["a", "b"], [{"max_tokens": 2}, {"max_tokens": 2}], use_tqdm=False)
    with pytest.raises(TypeError, match="messages must be a list"):
        llm.chat("hi", use_tqdm=False)
    with pytest.raises(TypeError, match="chat_template must be a Jinja template string"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template=5, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"tokenize": True}, use_tqdm=False)
    with pytest.raises(TypeError):
        llm.generate([PROMPT, {"prompt": "a", "prompt_token_ids": 5}], SamplingParams(max_tokens=2), use_tqdm=False)
    # vLLM's multimodal prompt key: the image was ignored and text-only output returned
    with pytest.raises(ValueError, match="prompt key 'multi_modal_data' is not supported"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": None}}, use_tqdm=False)
    assert_pool_idle(llm)
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3
