"""The parallel compile's collect pass (worker/precompile.py): Triton's jit_cache_hook, as Triton
calls it for a variant not compiled yet, is answered "handled" and the variant's specialization
data kept; a call of another shape is left to Triton. The compile itself needs a GPU
(scripts/gpu_cold_start.py checks it there: same greedy tokens, start-up times)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from triton import knobs

from pagedllm.worker.precompile import can_precompile, collect_variants


def test_collect_pass_records_each_variant_once_and_restores_the_hook():
    previous = knobs.runtime.jit_cache_hook
    answers = []

    def forwards():
        hook = knobs.runtime.jit_cache_hook
        for spec, fn in (("spec-a", "kernel_a"), ("spec-b", "kernel_b"), ("spec-a", "kernel_a")):
            answers.append(hook(key=spec, repr=spec, fn=SimpleNamespace(jit_function=fn),
                                compile={"specialization_data": spec}, is_manual_warmup=False,
                                already_compiled=False))
        answers.append(hook(key="odd", repr="odd", fn=None, compile={}))  # not the expected shape

    found = collect_variants(forwards)
    assert found == {"spec-a": "kernel_a", "spec-b": "kernel_b"}
    assert answers == [True, True, True, None]
    assert knobs.runtime.jit_cache_hook is previous


def test_only_cuda_models_are_precompiled():
    assert not can_precompile(torch.nn.Linear(2, 2), torch.device("cpu"))


def test_early_compile_processes_only_for_a_cache_without_warm_markers(tmp_path, monkeypatch):
    """A start that has not built its config yet starts the compile processes only on a Triton
    cache no start has completed on (a fresh machine): elsewhere they would mostly cost a warm
    start their imports."""
    from pagedllm.worker import compile_pool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert not compile_pool._has_warm_markers()  # no cache directory at all
    (tmp_path / "triton" / "pagedllm-warm").mkdir(parents=True)
    assert not compile_pool._has_warm_markers()
    (tmp_path / "triton" / "pagedllm-warm" / "0123abcd").touch()
    assert compile_pool._has_warm_markers()
    compile_pool.start_compile_pool(early=True)
    assert compile_pool.current() is None


def test_forked_compile_processes_answer_every_variant_and_are_reaped():
    """Compile processes forked from this process (the engine process's way on a fresh machine)
    take their share over a pipe and answer each variant; a variant they cannot compile (here: no
    GPU target, or no such kernel) is counted as failed, for the parent to compile itself."""
    import os
    import select

    from pagedllm.worker.compile_pool import CompilePool

    r, w = os.pipe()
    pool = CompilePool(2, fork=True, close_in_child=(w,))  # w: like the engine's pipe to its frontend
    os.close(w)
    assert select.select([r], [], [], 10)[0] and os.read(r, 1) == b""  # EOF: no child kept the write end
    os.close(r)
    pids = [child.pid for child in pool.children]
    try:
        items = [("pagedllm.kernels.rmsnorm", "no_such_kernel", "{}")] * 3
        assert pool.compile(items, 0, 90) == 3
    finally:
        pool.close()
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
            raise AssertionError(f"compile process {pid} was not reaped")
        except ChildProcessError:
            pass


def test_the_prestarted_engine_forks_compile_processes_unless_told_not_to(tmp_path, monkeypatch):
    """PAGEDLLM_PARALLEL_COMPILE unset: the prestarted engine process forks its compile processes on a
    cache without warm markers; =0 never; a cache with a marker never (a warm start)."""
    from pagedllm.worker import compile_pool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    for setting, forks in ((None, True), ("0", False), ("1", True)):
        if setting is None:
            monkeypatch.delenv("PAGEDLLM_PARALLEL_COMPILE", raising=False)
        else:
            monkeypatch.setenv("PAGEDLLM_PARALLEL_COMPILE", setting)
        compile_pool.fork_compile_pool()
        assert (compile_pool.current() is not None) == forks, setting
        compile_pool.close_compile_pool()
    (tmp_path / "triton" / "pagedllm-warm").mkdir(parents=True)
    (tmp_path / "triton" / "pagedllm-warm" / "0123abcd").touch()
    monkeypatch.delenv("PAGEDLLM_PARALLEL_COMPILE", raising=False)
    compile_pool.fork_compile_pool()
    assert compile_pool.current() is None
