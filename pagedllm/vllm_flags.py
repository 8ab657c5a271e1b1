"""vLLM's `vllm serve` flags and `LLM(...)` keyword arguments this engine does not implement as such.

A launch script written for vLLM must either run unchanged or stop with a message that says what
to do. Every flag of `vllm serve --help` (vLLM 0.21's groups: frontend, ModelConfig, LoadConfig,
ParallelConfig, CacheConfig, SchedulerConfig, ...) is in one of three states:

    works    the parser defines it and it does what vLLM's does (not listed here: the parser itself
             holds those; tests/test_vllm_flags.py holds the whole table against the parser)
    note     vLLM-design-only: accepted, has no effect here, one warning line says what runs instead;
             where only some values mean what runs here (`--logprobs-mode raw_logprobs`), the others are
             refused like the third state (`FlagNote.accepted`)
    refused  a feature that is not built: the flag is parsed, and using it stops start-up with a
             message saying why and what to use

`NOTE_FLAGS` and `REFUSED_FLAGS` below are the second and third states; `WORKING_FLAGS` lists the
first (the parser must define each, with its own meaning). docs/FLAGS.md is the same table in prose.
Nothing here imports the rest of pagedllm, so the engine (LLM kwargs) and the server (CLI flags)
share it.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger("pagedllm")

# How a flag takes its value on the command line: 0 = a switch (store_true), 1 = one value,
# "+" = one or more values.
Arity = Literal[0, 1, "+"]


@dataclass(frozen=True)
class FlagNote:
    note: str  # what runs instead (note) / why not and what to use (refused)
    arity: Arity = 1
    # A note flag's values that ask for what runs here (vLLM's spelling); any other value asks for a
    # feature that is not built and is refused. Empty: every value only warns.
    accepted: tuple[str, ...] = ()
    # Where a value is structured (a JSON object): whether it asks only for what runs here; `accepted`
    # then holds one such value (the tests' example), not the whole set.
    accepts: Callable[[Any], bool] | None = None

    def refuses(self, value: Any) -> bool:
        if self.accepts is not None:
            return not self.accepts(value)
        return bool(self.accepted) and str(value) not in self.accepted


def _xgrammar_config(value: Any) -> bool:
    """--structured-outputs-config / structured_outputs_config: only {"backend": "xgrammar" or "auto"} asks for
    what runs (a JSON string on the command line, a dict as an LLM keyword)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    return isinstance(value, dict) and set(value) <= {"backend"} and value.get("backend", "auto") in _XGRAMMAR


_GPU_ONLY_ATTN = "pagedllm runs its own attention kernels (TRITON_ATTN on a GPU, CPU_ATTN on the CPU)"
_XGRAMMAR = ("auto", "xgrammar")  # structured_output/params.SUPPORTED_BACKENDS (this module imports none of pagedllm)
_STRUCTURED = ("constrained decoding always runs xgrammar, per request (docs/STRUCTURED_OUTPUTS.md); the other "
               "backends and options are not built")
_I22 = "not built: tool calling takes --enable-auto-tool-choice / --tool-call-parser, constrained decoding is xgrammar per request (docs/STRUCTURED_OUTPUTS.md)"

NOTE_FLAGS: dict[str, FlagNote] = {
    "--use-v2-block-manager": FlagNote("the block manager is always the paged, prefix-caching one", 0),
    "--num-scheduler-steps": FlagNote("multi-step scheduling is subsumed by async scheduling (--async-scheduling)"),
    "--multi-step-stream-outputs": FlagNote("multi-step scheduling is subsumed by async scheduling", 0),
    "--no-multi-step-stream-outputs": FlagNote("multi-step scheduling is subsumed by async scheduling", 0),
    "--max-seq-len-to-capture": FlagNote("CUDA graphs capture decode batches of any length; see --max-cudagraph-capture-size"),
    "--scheduler-delay-factor": FlagNote("the token-budget scheduler admits waiting requests every step"),
    "--num-lookahead-slots": FlagNote("no speculative decoding: no lookahead slots are reserved"),
    "--disable-async-output-proc": FlagNote("outputs are processed on the frontend's own thread", 0),
    "--disable-custom-all-reduce": FlagNote(
        "no custom all-reduce kernel is built: tensor-parallel layers always all-reduce through "
        "torch.distributed (NCCL on GPUs, gloo on the CPU)", 0),
    "--max-parallel-loading-workers": FlagNote("weights load in one pass per process"),
    "--disable-cascade-attn": FlagNote("cascade attention is not built; shared prefixes use the prefix cache", 0),
    "--disable-chunked-mm-input": FlagNote("no multimodal inputs are handled", 0),
    "--disable-hybrid-kv-cache-manager": FlagNote("one KV cache group per model: there is no hybrid manager", 0),
    "--prefix-caching-hash-algo": FlagNote("prefix blocks are keyed by chained hashes of their token ids"),
    "--kv-sharing-fast-prefill": FlagNote("no cross-layer KV sharing is built", 0),
    "--use-tqdm-on-load": FlagNote("a progress bar is shown while weights load", 0),
    "--no-use-tqdm-on-load": FlagNote("a progress bar is shown while weights load", 0),
    "--disable-frontend-multiprocessing": FlagNote(
        "the engine runs in its own process; PAGEDLLM_ENABLE_MULTIPROCESSING=0 runs it in a thread of the "
        "server's process", 0),
    "--disable-fastapi-docs": FlagNote("FastAPI's /docs pages are served as usual", 0),
    "--enable-server-load-tracking": FlagNote("server load is exported as pagedllm:num_admitted_seqs on /metrics", 0),
    "--enable-prompt-tokens-details": FlagNote("usage.prompt_tokens_details (cached_tokens) is always returned", 0),
    "--show-hidden-metrics-for-version": FlagNote("every metric (and vLLM's older names the Grafana dashboard reads) is shown"),
    "--model-impl": FlagNote("pagedllm's own model classes always run (auto, vllm); the transformers "
                             "backend is not built", accepted=("auto", "vllm")),
    "--config-format": FlagNote("configs are read in Hugging Face format (config.json or GGUF metadata); "
                                "Mistral's params.json is not read", accepted=("auto", "hf")),
    "--safetensors-load-strategy": FlagNote("safetensors shards are memory-mapped and read one by one"),
    "--worker-cls": FlagNote("pagedllm's own worker runs; a worker class of your own is not loaded",
                             accepted=("auto",)),
    "--logprobs-mode": FlagNote(
        "logprobs are vLLM's raw_logprobs (the log-softmax of the model's logits, before penalties, "
        "temperature, top-k and top-p); the other modes are not built", accepted=("raw_logprobs",)),
    "--headless": FlagNote("one server, one engine: there is no headless data-parallel mode", 0),
    "--api-server-count": FlagNote("one API server process runs; more are not built", accepted=("1",)),
    "-asc": FlagNote("one API server process runs; more are not built", accepted=("1",)),
    "--enable-ssl-refresh": FlagNote("certificates are read once at start-up; restart to pick up new ones", 0),
    "--guided-decoding-backend": FlagNote(_STRUCTURED, accepted=_XGRAMMAR),
    "--structured-outputs-config": FlagNote(_STRUCTURED, accepted=('{"backend": "xgrammar"}',),
                                            accepts=_xgrammar_config),
}

REFUSED_FLAGS: dict[str, FlagNote] = {
    "--calculate-kv-scales": FlagNote(
        "computing KV-cache scales from the first batch is not built: an fp8 KV cache (--kv-cache-dtype fp8) "
        "uses the checkpoint's k_scale / v_scale, else 1.0 (docs/QUANTIZATION.md)", 0),
    "--ray-workers-use-nsight": FlagNote(
        "Nsight profiling of Ray workers is not built; run the server under `nsys profile` with "
        "--distributed-executor-backend mp", 0),
    "--uds": FlagNote("Unix domain sockets are not built; serve on --host/--port"),
    "--hf-config-path": FlagNote("the config is read from the model itself; pass a local model directory"),
    "--code-revision": FlagNote("remote code is loaded from the local model directory only"),
    "--tokenizer-revision": FlagNote("the tokenizer is read from the model's own snapshot; pass --tokenizer PATH"),
    "--rope-scaling": FlagNote("use --hf-overrides '{\"rope_scaling\": {...}}'"),
    "--rope-theta": FlagNote("use --hf-overrides '{\"rope_theta\": ...}'"),
    "--hf-token": FlagNote("nothing is downloaded from a model hub, so no token is needed; use a local path or the HF cache"),
    "--allowed-local-media-path": FlagNote("multimodal inputs are not built"),
    "--allowed-media-domains": FlagNote("multimodal inputs are not built"),
    "--enable-prompt-embeds": FlagNote("prompt embeddings as input are not built; send text or token ids"),
    "--override-generation-config": FlagNote("use --generation-config DIR with a generation_config.json of your own"),
    "--enable-sleep-mode": FlagNote("sleep mode (freeing GPU memory while idle) is not built"),
    "--override-attention-dtype": FlagNote("attention runs in the model dtype (--dtype)"),
    "--logits-processors": FlagNote("custom logits processors are not built"),
    "--logits-processor-pattern": FlagNote("custom logits processors are not built"),
    "--io-processor-plugin": FlagNote("IO processor plugins are not built"),
    "--model-loader-extra-config": FlagNote("the loaders take no extra config"),
    "--ignore-patterns": FlagNote("only the model's safetensors / .bin / .gguf weights are read"),
    "--pt-load-map-location": FlagNote(".bin weights are always loaded to the CPU, then moved"),
    "--decode-context-parallel-size": FlagNote("context parallelism is not built"),
    "-dcp": FlagNote("context parallelism is not built"),
    "--data-parallel-size": FlagNote("data parallelism is not built; run one server per GPU behind a load balancer"),
    "-dp": FlagNote("data parallelism is not built; run one server per GPU behind a load balancer"),
    "--data-parallel-rank": FlagNote("data parallelism is not built"),
    "--data-parallel-start-rank": FlagNote("data parallelism is not built"),
    "--data-parallel-size-local": FlagNote("data parallelism is not built"),
    "--data-parallel-address": FlagNote("data parallelism is not built"),
    "--data-parallel-rpc-port": FlagNote("data parallelism is not built"),
    "--data-parallel-backend": FlagNote("data parallelism is not built"),
    "--data-parallel-hybrid-lb": FlagNote("data parallelism is not built", 0),
    "--enable-expert-parallel": FlagNote("expert parallelism is not built", 0),
    "--enable-eplb": FlagNote("expert load balancing is not built", 0),
    "--eplb-config": FlagNote("expert load balancing is not built"),
    "--expert-placement-strategy": FlagNote("expert parallelism is not built"),
    "--enable-dbo": FlagNote("dual-batch overlap is not built", 0),
    "--worker-extension-cls": FlagNote("worker extensions are not built"),
    "--kv-cache-memory-bytes": FlagNote("size the cache with --gpu-memory-utilization or --num-gpu-blocks-override"),
    "--cpu-offload-gb": FlagNote("weight offloading to the CPU is not built"),
    "--mamba-cache-dtype": FlagNote("Mamba models are not built"),
    "--mamba-ssm-cache-dtype": FlagNote("Mamba models are not built"),
    "--limit-mm-per-prompt": FlagNote("multimodal inputs are not built"),
    "--media-io-kwargs": FlagNote("multimodal inputs are not built"),
    "--mm-processor-kwargs": FlagNote("multimodal inputs are not built"),
    "--mm-processor-cache-gb": FlagNote("multimodal inputs are not built"),
    "--disable-mm-preprocessor-cache": FlagNote("multimodal inputs are not built", 0),
    "--mm-encoder-tp-mode": FlagNote("multimodal inputs are not built"),
    "--interleave-mm-strings": FlagNote("multimodal inputs are not built", 0),
    "--skip-mm-profiling": FlagNote("multimodal inputs are not built", 0),
    "--enable-lora": FlagNote("LoRA adapters are not built; merge the adapter into the weights first", 0),
    "--enable-lora-bias": FlagNote("LoRA adapters are not built", 0),
    "--lora-modules": FlagNote("LoRA adapters are not built; merge the adapter into the weights first", "+"),
    "--max-loras": FlagNote("LoRA adapters are not built"),
    "--max-lora-rank": FlagNote("LoRA adapters are not built"),
    "--lora-extra-vocab-size": FlagNote("LoRA adapters are not built"),
    "--lora-dtype": FlagNote("LoRA adapters are not built"),
    "--max-cpu-loras": FlagNote("LoRA adapters are not built"),
    "--fully-sharded-loras": FlagNote("LoRA adapters are not built", 0),
    "--default-mm-loras": FlagNote("LoRA adapters are not built"),
    "--otlp-traces-endpoint": FlagNote("OpenTelemetry tracing is not built; scrape /metrics"),
    "--collect-detailed-traces": FlagNote("OpenTelemetry tracing is not built; scrape /metrics"),
    "--max-num-partial-prefills": FlagNote("concurrent partial prefills are scheduled by the token budget alone"),
    "--max-long-partial-prefills": FlagNote("concurrent partial prefills are scheduled by the token budget alone"),
    "--long-prefill-token-threshold": FlagNote("concurrent partial prefills are scheduled by the token budget alone"),
    "--scheduler-cls": FlagNote("pagedllm's token-budget scheduler is the only one"),
    "--speculative-config": FlagNote("speculative decoding is not built"),
    "--kv-transfer-config": FlagNote("KV transfer (disaggregated prefill) is not built"),
    "--kv-events-config": FlagNote("KV cache events are not built"),
    "--additional-config": FlagNote("there are no platform plugins to configure"),
    "--middleware": FlagNote("custom ASGI middleware is not loaded; put a proxy in front", "+"),
    "--chat-template-content-format": FlagNote("message content is rendered as strings (text parts joined)"),
    "--tool-server": FlagNote(_I22),
    "--tool-parser-plugin": FlagNote(_I22),
    "--exclude-tools-when-tool-choice-none": FlagNote(_I22, 0),
    "--log-config-file": FlagNote("pagedllm logs through Python's logging with its own format; configure it in code"),
    "--enable-tokenizer-info-endpoint": FlagNote("the /tokenizer_info endpoint is not built; /tokenize and /detokenize are", 0),
    "--enable-log-outputs": FlagNote("generated text is not logged", 0),
    "--log-error-stack": FlagNote("errors are logged with their traceback on the server", 0),
    "--tokens-only": FlagNote("the server always runs its tokenizer", 0),
}

# Flags of `vllm serve` that the parser defines with their vLLM meaning (the test checks each).
WORKING_FLAGS: tuple[str, ...] = (
    "--host", "--port", "--uvicorn-log-level", "--disable-uvicorn-access-log", "--allow-credentials",
    "--allowed-origins", "--allowed-methods", "--allowed-headers", "--api-key", "--served-model-name",
    "--chat-template", "--trust-request-chat-template", "--response-role", "--ssl-keyfile", "--ssl-certfile",
    "--ssl-ca-certs", "--ssl-cert-reqs", "--root-path", "--return-tokens-as-token-ids",
    "--enable-request-id-headers", "--max-log-len", "--enable-force-include-usage",
    "--h11-max-incomplete-event-size", "--h11-max-header-count", "--config", "--disable-log-stats",
    "--enable-log-requests", "--disable-log-requests",
    "--model", "--tokenizer", "--tokenizer-mode", "--skip-tokenizer-init", "--trust-remote-code", "--dtype",
    "--seed", "--revision", "--max-model-len", "--quantization", "-q", "--enforce-eager", "--max-logprobs",
    "--disable-sliding-window", "--hf-overrides", "--generation-config", "--load-format", "--download-dir",
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--block-size",
    "--gpu-memory-utilization", "--swap-space", "--kv-cache-dtype", "--num-gpu-blocks-override",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--max-num-batched-tokens", "--max-num-seqs",
    "--cuda-graph-sizes", "--scheduling-policy", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--async-scheduling", "--no-async-scheduling", "--preemption-mode", "--compilation-config", "-O",
    "--device", "--attention-backend", "--distributed-executor-backend", "--ray-address",
    "--runner", "--convert", "--task", "--pooler-config", "--override-pooler-config",
    "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
)


def add_table_flags(parser: argparse.ArgumentParser) -> None:
    """Define every note / refused flag the parser does not already have (help says why)."""
    known = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public lookup
    g = parser.add_argument_group("vLLM flags without effect here (docs/FLAGS.md)")
    for table, kind in ((NOTE_FLAGS, "no effect"), (REFUSED_FLAGS, "not built")):
        for flag, entry in table.items():
            if flag in known:
                continue
            dest = "vllm_flag__" + flag.lstrip("-").replace("-", "_")
            kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": f"{kind}: {entry.note}"}
            if entry.arity == 0:
                kwargs["action"] = "store_const"
                kwargs["const"] = True
            elif entry.arity == "+":
                kwargs["nargs"] = "+"
            g.add_argument(flag, **kwargs)


def check_table_flags(args: argparse.Namespace) -> None:
    """After parsing: one warning per note flag given; ValueError for the first refused flag given."""
    for table, refuse in ((REFUSED_FLAGS, True), (NOTE_FLAGS, False)):
        for flag, entry in table.items():
            dest = "vllm_flag__" + flag.lstrip("-").replace("-", "_")
            if getattr(args, dest, None) is None:
                continue
            if refuse:
                raise ValueError(f"{flag} is not supported: {entry.note}.")
            if entry.refuses(getattr(args, dest)):
                raise ValueError(f"{flag} {getattr(args, dest)} is not supported: {entry.note}.")
            logger.warning("%s has no effect in pagedllm: %s.", flag, entry.note)


def kwarg_flag(name: str) -> str:
    """LLM(...) keyword -> its CLI flag: use_v2_block_manager -> --use-v2-block-manager."""
    return "--" + name.replace("_", "-")


def check_llm_kwargs(kwargs: dict[str, Any], engine_arg_names: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """Drop LLM(...) keywords that are vLLM-design-only (one warning each) and refuse the keywords
    of features not built (ValueError); return the rest untouched. A keyword left at a value that
    means "off" (False, None) is dropped silently: it asks for nothing. Names in engine_arg_names
    (EngineArgs' own fields) always pass: a feature built later is no longer the table's."""
    rest: dict[str, Any] = {}
    for name, value in kwargs.items():
        flag = kwarg_flag(name)
        if name in engine_arg_names:
            rest[name] = value
            continue
        if flag in REFUSED_FLAGS:
            if value in (None, False, 0, "", [], {}) or (name == "task" and value in ("auto", "generate")):
                continue
            raise ValueError(f"{name}={value!r} is not supported: {REFUSED_FLAGS[flag].note}.")
        if flag in NOTE_FLAGS:
            if value is not None and NOTE_FLAGS[flag].refuses(value):
                raise ValueError(f"{name}={value!r} is not supported: {NOTE_FLAGS[flag].note}.")
            if value not in (None, False):
                logger.warning("%s=%r has no effect in pagedllm: %s.", name, value, NOTE_FLAGS[flag].note)
            continue
        rest[name] = value
    return rest
