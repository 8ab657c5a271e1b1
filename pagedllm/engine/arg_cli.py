"""The engine's command-line flags (vLLM's names, `pagedllm serve` / `bench` / `generate`) and the
value tables they share with `EngineArgs`' checks. `EngineArgs.add_cli_args` is the entry point;
`EngineArgs.from_cli_args` maps the parsed flags back onto its fields by name."""

from __future__ import annotations

import argparse

from pagedllm.config import EXECUTOR_BACKENDS

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
TOKENIZER_MODES = ("auto", "slow")


def add_engine_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> argparse.ArgumentParser:
    g = parser.add_argument_group("engine")
    if model_positional:
        g.add_argument("model_tag", nargs="?", default=None, help="model path, GGUF file or preset")
    g.add_argument("--model", default=None, help="HF model dir, .gguf file, or preset (qwen3-0.6b, llama3-8b)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--skip-tokenizer-init", action="store_true")
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "float16", "half", "bfloat16"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS))
    g.add_argument("--quantization", "-q", default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--swap-space", type=float, default=4.0, help="CPU swap space per GPU, GiB")
    g.add_argument("--cpu-kvcache-space", type=float, default=None, help="KV cache GiB when on the CPU")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache element type: auto (the model dtype; float16 for GGUF weights computed on "
                        "the CPU), float16, bfloat16, float32, or fp8 / fp8_e4m3 (per-tensor scales from the "
                        "checkpoint, else 1.0)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over steps (default: on); off: a prompt runs whole in one step")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None,
                   help="decode batch sizes to capture as CUDA graphs (default: 1 2 4 8 16 ... max-num-seqs)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="largest CUDA graph; sizes follow vLLM's 1 2 4 8 ... 248 256 272 ... pattern")
    g.add_argument("--compilation-config", "-O", default=None,
                   help="vLLM's compilation config as JSON (cudagraph_capture_sizes, max_cudagraph_capture_size, "
                        "cudagraph_mode: FULL_AND_PIECEWISE (default), FULL, FULL_DECODE_ONLY, NONE) "
                        "or a level (no effect: no torch.compile here)")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, help=argparse.SUPPRESS)
    g.add_argument("--attention-backend", default=None,
                   help="auto (default), or the backend built for the device: TRITON_ATTN (GPU), CPU_ATTN (CPU)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--distributed-executor-backend", default=None, metavar="{" + ",".join(EXECUTOR_BACKENDS) + "}",
                   help="where the ranks run: mp (one process per rank, this node), ray (Ray actors, one "
                        "node or many), uni (one worker in the engine process), or the qualified name of an "
                        "Executor subclass (package.module.Class); default: uni for one rank, else mp, or "
                        "ray with --ray-address")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster for the ray backend: auto (the `ray start` of this node) or host:port")
    g.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"])
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling with the running step (default: on for CUDA)")
    g.add_argument("--cpu-threads", type=int, default=None, help="torch threads on the CPU (default: all cores)")
    g.add_argument("--tokenizer-mode", default="auto", choices=list(TOKENIZER_MODES) + ["mistral", "custom"],
                   help="auto: the fast tokenizer when there is one; slow: the Python one")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a hub id, looked up in the local HF cache (refs/NAME)")
    g.add_argument("--download-dir", default=None,
                   help="an HF hub cache directory searched before HF_HUB_CACHE / HF_HOME (nothing is downloaded)")
    g.add_argument("--hf-overrides", default=None,
                   help='JSON object of keys set on the model config, e.g. \'{"rope_theta": 1e6}\'')
    g.add_argument("--generation-config", default="auto",
                   help="auto: sampling defaults and EOS ids from the model's generation_config.json; vllm: "
                        "none; or a directory holding a generation_config.json")
    g.add_argument("--disable-sliding-window", action="store_true",
                   help="cap max_model_len at the (smallest) sliding window, as vLLM does (the window is built: this "
                        "only caps the length)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs (priority is refused: not built)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats log line (/metrics is still served)")
    g.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate tokens, or pool (embeddings, scores, classes); auto: by architecture")
    g.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "classify"])
    g.add_argument("--task", default=None, help="older vLLM's runner choice: generate, embed, score, classify")
    g.add_argument("--pooler-config", default=None,
                   help='JSON, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' (pooling runner)')
    g.add_argument("--override-pooler-config", default=None, help=argparse.SUPPRESS)
    return parser
