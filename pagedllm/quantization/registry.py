"""Which quantization a model runs with: `quantization=` / `--quantization` and config.json's
`quantization_config`, resolved once, as vLLM does.

    checkpoint says   user says              result
    nothing           None                   dense (GGUF files: see quantization/gguf.py)
    nothing           "fp8"                  online FP8: bf16/fp32 weights quantized at load
    "awq"             None / "awq" / "awq_marlin"   AWQ (our W4A16 kernel plays Marlin's part)
    "gptq"            None / "gptq" / "gptq_marlin"  GPTQ
    "fp8"             None / "fp8"           FP8 checkpoint
    "compressed-tensors"  None / "compressed-tensors"
    "awq"             "gptq"                 ValueError: the two disagree (vLLM's message)

A method vLLM knows but this build does not (bitsandbytes, modelopt, ...) is refused with its name
before anything loads; so is any unknown name.
"""

from __future__ import annotations

from typing import Any

from pagedllm.quantization.base import QuantizationConfig

# The names `quantization=` accepts; the value is the method whose config class runs it.
QUANTIZATION_ALIASES: dict[str, str] = {
    "fp8": "fp8",
    "compressed-tensors": "compressed-tensors",
    "compressed_tensors": "compressed-tensors",
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "gguf": "gguf",
}
# vLLM 0.21 methods that are not built here: refused with their name (never silently run dense).
NOT_BUILT = (
    "aqlm", "bitblas", "bitsandbytes", "deepspeedfp", "experts_int8", "fbgemm_fp8", "fp_quant", "gptq_bitblas",
    "hqq", "inc", "ipex", "marlin", "modelopt", "modelopt_fp4", "moe_wna16", "mxfp4", "petit_nvfp4", "ptpc_fp8",
    "quark", "rtn", "torchao", "tpu_int8",
)
# Methods that need a quantized checkpoint's tensors (online quantization exists for fp8 only).
NEEDS_CHECKPOINT = ("awq", "gptq", "compressed-tensors")


def canonical_method(name: str) -> str:
    """"awq_marlin" -> "awq"; ValueError naming the method when it is not built."""
    key = name.strip().lower()
    if key in QUANTIZATION_ALIASES:
        return QUANTIZATION_ALIASES[key]
    built = ", ".join(sorted(QUANTIZATION_ALIASES))
    if key in NOT_BUILT:
        raise ValueError(f"quantization method {name!r} is not built in pagedllm; built: {built}.")
    raise ValueError(f"unknown quantization method {name!r}; built: {built}.")


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` (or the older `compression_config`) as a dict, if any."""
    raw = getattr(hf_config, "quantization_config", None) or getattr(hf_config, "compression_config", None)
    if raw is None:
        return None
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    if not isinstance(raw, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {type(raw).__name__}")
    return dict(raw)


def resolve_quantization(quantization: str | None, hf_config: Any) -> str | None:
    """The method the model runs with (canonical name), checking the user's choice against the
    checkpoint's; ValueError with vLLM's wording when they disagree or a method is not built."""
    ckpt = checkpoint_quant_config(hf_config)
    ckpt_method = None
    if ckpt is not None:
        raw = ckpt.get("quant_method")
        if not isinstance(raw, str):
            raise ValueError(f"config.json's quantization_config has no 'quant_method' string: {ckpt}")
        ckpt_method = canonical_method(raw)
    asked = canonical_method(quantization) if quantization is not None else None
    if asked is not None and ckpt_method is not None and asked != ckpt_method:
        raise ValueError(
            f"Quantization method specified in the model config ({ckpt_method}) does not match the "
            f"quantization method specified in the `quantization` argument ({quantization})."
        )
    return ckpt_method or asked


def build_quant_config(method: str, hf_config: Any, load_format: str) -> QuantizationConfig:
    """The config object for `method` (canonical), from the checkpoint's settings.

    Methods that need a quantized checkpoint refuse a checkpoint without settings, except with
    dummy weights, where the method's defaults (4-bit, group 128, or W8A8-INT8) shape the layers.
    """
    from pagedllm.quantization.awq import AWQConfig
    from pagedllm.quantization.compressed_tensors import CompressedTensorsConfig
    from pagedllm.quantization.fp8 import Fp8Config
    from pagedllm.quantization.gptq import GPTQConfig

    classes: dict[str, type[QuantizationConfig]] = {
        "fp8": Fp8Config, "awq": AWQConfig, "gptq": GPTQConfig, "compressed-tensors": CompressedTensorsConfig,
    }
    ckpt = checkpoint_quant_config(hf_config)
    if ckpt is None:
        if method == "fp8":
            return Fp8Config(is_checkpoint_fp8_serialized=False)
        if method in NEEDS_CHECKPOINT and load_format != "dummy":
            raise ValueError(
                f"quantization={method!r} needs a quantized {method} checkpoint (config.json with a quantization_config); "
                "this model has none. Online quantization is built for 'fp8' only."
            )
        return classes[method].default_for_dummy()
    return classes[method].from_config(ckpt)
