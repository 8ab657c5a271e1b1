"""Every quantization method on the CPU, on tiny checkpoints in the formats real tools write
(tests/quantization/quant_ckpt.py), held to transformers run on the same weights dequantized (fp32).

Per method:
  - logits of a 24-token prompt through pagedllm's model (paged KV cache) vs transformers:
    weight-only int4/int8: within 1e-4 (same fp32 weights, sums in another order);
    W8A8: within 1e-4 of transformers with the activations rounded the same way (hooks), which is
    the method's exact math; vs plain dequantized transformers only the agreement below is asked
  - greedy tokens of 16 prompts x 32 tokens through `LLM` vs transformers' generate on the
    dequantized weights: equal for >= 90% of positions (all of them for weight-only methods); the
    first divergence of each prompt is printed (pytest -s). One variant of each method and scheme
    runs this (the CI budget); the others differ only in what the logit check covers exactly.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kernels.scaled_mm import FP8_DTYPE
from pagedllm.loader.model_loader import load_model
from tests.models.hf_compare import PagedRunner, hf_logits
from tests.quantization import quant_ckpt as qc


@torch.no_grad()
def hf_greedy_batch(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = model.generate(torch.tensor(prompts), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[:, len(prompts[0]):].tolist()

NUM_PROMPTS, NEW_TOKENS = 16, 32
_gen = torch.Generator().manual_seed(7)
# One length, so transformers generates all 16 in one batch without padding (exactly as one by one).
PROMPTS = torch.randint(1, 512, (NUM_PROMPTS, 12), generator=_gen).tolist()
LOGIT_PROMPT = torch.randint(1, 512, (24,), generator=_gen).tolist()


@pytest.fixture(scope="module")
def base():
    return qc.fidelity_model()


# name -> (builder(path, model) -> (checkpoint path, dequantized model, LLM kwargs), activation qdtype,
#          min greedy agreement, or None: logits only)
METHODS = {
    "gptq-4bit-g32-sym": (lambda p, m: (*qc.gptq_checkpoint(m, 4, 32), {}), None, None),
    "gptq-4bit-g32-asym-desc_act": (lambda p, m: (*qc.gptq_checkpoint(m, 4, 32, desc_act=True, sym=False),
                                                  {"quantization": "gptq_marlin"}), None, 1.0),
    "gptq-8bit-channel": (lambda p, m: (*qc.gptq_checkpoint(m, 8, -1), {}), None, None),
    "awq-4bit-g32": (lambda p, m: (*qc.awq_checkpoint(m, 32), {"quantization": "awq"}), None, 1.0),
    "ct-w4a16-g32": (lambda p, m: (*qc.ct_checkpoint(m, "W4A16"), {}), None, None),
    "ct-w4a16-asym-g32": (lambda p, m: (*qc.ct_checkpoint(m, "W4A16_ASYM"), {}), None, 1.0),
    "ct-w8a8-int8": (lambda p, m: (*qc.ct_checkpoint(m, "W8A8"), {}), torch.int8, 0.9),
    "ct-w8a8-fp8-static": (lambda p, m: (*qc.ct_checkpoint(m, "FP8", calib=PROMPTS), {}), FP8_DTYPE, 0.9),
    "ct-w8a8-fp8-dynamic": (lambda p, m: (*qc.ct_checkpoint(m, "FP8_DYNAMIC"), {}), FP8_DTYPE, None),
    "fp8-per-tensor-static": (lambda p, m: (*qc.fp8_checkpoint(m, False, True, PROMPTS), {}), FP8_DTYPE, None),
    "fp8-per-channel-dynamic": (lambda p, m: (*qc.fp8_checkpoint(m, True, False), {"quantization": "fp8"}),
                                FP8_DTYPE, None),
    "fp8-online": (lambda p, m: (p, qc.online_fp8_reference(m), {"quantization": "fp8"}), FP8_DTYPE, 0.9),
    "fp8-block-32x48-dynamic": (lambda p, m: (*qc.fp8_block_checkpoint(m, (32, 48)), {}), FP8_DTYPE, 0.9),
    "ct-fp8-block-32x32": (lambda p, m: (*qc.ct_checkpoint(m, "FP8_BLOCK", block=(32, 32)), {}), FP8_DTYPE, None),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_method_matches_transformers_on_dequantized_weights(base, method):
    build, act_qdtype, min_agreement = METHODS[method]
    ckpt, deq, kwargs = build(*base)

    # Logits, one prefill through the paged model.
    config = EngineArgs(model=str(ckpt), skip_tokenizer_init=True, **kwargs).create_engine_config()
    model = load_model(config.model_config, torch.device("cpu"))
    assert config.model_config.quantization is not None
    assert not any(type(m.quant_method).__name__ == "UnquantizedLinearMethod"
                   for n, m in model.named_modules() if n.endswith("_proj")), "a linear was left dense"
    ours = PagedRunner(model).step({"a": LOGIT_PROMPT})["a"]
    plain = hf_logits(deq, LOGIT_PROMPT)
    if act_qdtype is None:
        torch.testing.assert_close(ours, plain, atol=1e-4, rtol=1e-4)
    else:
        handles = qc.fake_quant_activations(deq, act_qdtype, getattr(deq, "static_input_scales", None) or None,
                                            getattr(deq, "act_group_size", None))
        exact = hf_logits(deq, LOGIT_PROMPT)
        for h in handles:
            h.remove()
        torch.testing.assert_close(ours, exact, atol=1e-4, rtol=1e-4)
    logit_diff = (ours - plain).abs().max().item()
    if min_agreement is None:
        print(f"\n{method}: max |logit diff| vs dequantized fp32 {logit_diff:.3g}")
        return

    # Greedy tokens through the engine.
    llm = LLM(str(ckpt), skip_tokenizer_init=True, num_gpu_blocks_override=96, max_model_len=128, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    equal, firsts = 0, []
    for ref, out in zip(hf_greedy_batch(deq, PROMPTS, NEW_TOKENS), outs):
        got = list(out.outputs[0].token_ids)
        equal += sum(a == b for a, b in zip(ref, got))
        firsts.append(next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), NEW_TOKENS))
    agreement = equal / (NUM_PROMPTS * NEW_TOKENS)
    print(f"\n{method}: {agreement:.1%} of greedy tokens equal; first divergence per prompt {firsts}; "
          f"max |logit diff| vs dequantized fp32 {logit_diff:.3g}")
    assert agreement >= min_agreement, f"{method}: {agreement:.1%} equal, first divergences {firsts}"
