"""Which structured-output backend the engine core builds: the grammar worker processes
(backend_process.py) or xgrammar in this process with the bitmask thread (backend_xgrammar.py,
fill_thread.py), and how many xgrammar threads each gets (PAGEDLLM_GRAMMAR_WORKER(S),
PAGEDLLM_XGRAMMAR_THREADS, PAGEDLLM_GRAMMAR_SPIN)."""

from __future__ import annotations

import logging
import os

from pagedllm import envs
from pagedllm.structured_output.backend_types import StructuredOutputBackend

logger = logging.getLogger(__name__)


def use_grammar_worker() -> bool:
    """PAGEDLLM_GRAMMAR_WORKER: 1 the grammar worker processes, 0 or unset the bitmask thread, gated
    or not, on any device: on the H200 gated sampling with the thread met issue 22's cost bar beside
    vLLM (0.914 / 0.915 of unconstrained at the Qwen3-0.6B shape), and main's path alone was no faster
    with a worker (BENCHMARKS.md, issue 22, h38 and the fifteenth session)."""
    return envs.PAGEDLLM_GRAMMAR_WORKER is True


def make_backend(tokenizer, vocab_size: int, worker: bool = False, rows: int = 0,
                 pin_memory: bool = False, threads: int | None = None,
                 num_workers: int | None = None, spin: bool | None = None) -> StructuredOutputBackend:
    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

    # xgrammar's compile and batch-fill threads: half the host's cores, 2 to 8 (the fill must stay
    # well under a GPU decode step), unless PAGEDLLM_XGRAMMAR_THREADS (or the caller) says.
    cores = os.cpu_count() or 2
    if worker:
        from pagedllm.structured_output.backend_process import ProcessBackend

        # Two worker processes of 6 threads on a host of 12+ cores: on the H200's 16-core host each
        # one's accept + fill of its ~32 of 64 rows took 0.80 ms a step, against one worker's 1.10-1.17
        # for all 64 (8 threads; 12 threads: 1.20-1.25), BENCHMARKS.md, issue 22, h38. Else one.
        num_workers = num_workers or envs.PAGEDLLM_GRAMMAR_WORKERS or (2 if cores >= 12 else 1)
        threads = threads or envs.PAGEDLLM_XGRAMMAR_THREADS or (
            6 if num_workers == 2 and cores >= 12 else max(2, min(8, cores // 2)))
        if spin is None:  # PAGEDLLM_GRAMMAR_SPIN (grammar_worker.py's job channel), opt-in
            spin = bool(envs.PAGEDLLM_GRAMMAR_SPIN)
        try:
            return ProcessBackend(tokenizer, vocab_size, threads, rows, pin_memory, num_workers=num_workers, spin=spin)
        except Exception as e:  # noqa: BLE001 - the thread path serves the same requests
            logger.warning("grammar worker process unavailable (%s); bitmasks are filled on a thread", e)
    threads = threads or envs.PAGEDLLM_XGRAMMAR_THREADS or max(2, min(8, cores // 2))
    return XgrammarBackend(tokenizer, vocab_size, max_threads=threads)
