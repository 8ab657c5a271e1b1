"""Gated sampling: a constrained step's sampling is queued with its forward pass, and waits on the
device for its grammar bitmask, which the host fills while the forward runs.

    host, step k:  schedule k | launch forward k, [gate k], mask copy, sample k | collect k-1 ->
                   accept k-1's tokens, fill mask k (thread / grammar worker) -> open gate k | return
    device:        ... sample k-1 | forward k | waits for gate k | mask k -> device | sample k | forward k+1 ...

Step k's forward needs step k-1's tokens (on the device already), not step k's bitmask; only its
sampling does. So the launch queues the whole step, with a wait in the stream before the mask's
copy: the device waits for a flag word in host memory to reach the step's sequence number, which
whoever fills the bitmask writes after the fill (the bitmask thread, or each grammar worker process
its own word: backend_process.py). The step loop never waits for the fill; it waits, in the next
step's collect, for the sampled tokens, as an unconstrained step does.

The wait on CUDA is `cuStreamWaitValue32` (the driver's stream memory operation, called through
ctypes: torch does not bind it) on the flag's device address (host memory mapped into the device's
address space: pinned by torch's allocator or registered with `cudaHostRegisterMapped`); where the
driver refuses stream memory operations, a one-program Triton kernel spins on the word instead.
On the CPU there is no stream: the runner samples a gated step when its output is first needed
(its `get()`, or the next launch, which reads its tokens), after the flag is up (`host_wait`).

Why the order is safe: the bitmask's copy is queued behind the wait, so it reads the buffer only
after the fill's last store (the flag is written after it; x86 stores reach the device in order),
and the buffer's next fill is two steps later, after that step's tokens were collected, i.e. after
its copy ran. The step loop must open every gate it launched, whatever happens: a gate left shut
stops the device's stream for good (engine/grammar_step.py opens it whatever fails).

The job is posted BEFORE the wait is queued (EngineCore._step_gated, in engine/grammar_step.py: launch
forward k, collect k-1, submit job k, only then queue wait k + sampling k). Once the wait is in the stream, any host call
that synchronizes the device blocks until the gate opens, and the CUDA calls that may do so are
not only the obvious ones: the first launch of a kernel (lazy module loading, CUDA's default, "may
require context synchronization"), a cudaMalloc of the caching allocator's next segment, a pinned
host allocation. The first gated sampling of an engine launches the Gumbel kernel's masked variant
for the first time, and a batch whose rows join step by step asks new tensor sizes each step; with
the wait queued before the job was posted, such a call waited for a fill that only the same thread
would post later: the hang of h48's round 2 (BENCHMARKS.md, issue 22, h52). Posted first, the fill
runs without this thread (a worker process, or the bitmask thread, which gets the GIL: the CUDA
calls release it), so a synchronizing call only waits for it.

A gate its filler leaves shut for GATE_TIMEOUT_S (a dead or stuck worker, a stuck bitmask thread) is
forced open by a watchdog (`FlagWords.force_open`): the device samples with whatever the buffer
holds, so the step's constrained rows are not to be trusted; `GrammarGate.forced()` says so, and the
engine core aborts those requests at that step's collect (their tokens dropped, never emitted).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

HOST_WAIT_TIMEOUT_S = 120.0  # a CPU step's wait for its bitmask: a hung filler is an error, not a hang
# A gate shut this long is forced open (its constrained rows then aborted): far above any fill (~1-3 ms
# a step) and a worker's wait for its own compile of a grammar the engine has compiled (seconds).
GATE_TIMEOUT_S = 30.0
WATCH_PERIOD_S = 0.2  # how often the bitmask thread's watchdog looks at the gates
# The CPU's stand-in for the device's worst case (tests): a gated CPU step then waits for its gate
# at its sampling launch (engine_core calls sample_tokens), as the sampling launch may synchronize
# the device there (see above), instead of when its tokens are first needed; its wait fails after
# this many seconds. With the wait queued before the job was posted it always failed.
SYNC_AT_LAUNCH_S: float | None = None
CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (int32)(*addr - value) >= 0


@dataclass(eq=False)
class GrammarGate:
    """One gated step, as the engine core hands it to the runner (in `SchedulerOutput.grammar_gate`).

    request_ids: the constrained requests that sample in the step, in batch order; bitmask row i is
    request_ids[i]'s (a row whose grammar has ended by the fill is all ones). bitmask: int32 (k, W)
    host view, pinned on a GPU, filled after the launch. flags: int32 host words, one per filler;
    the step may sample once every flags[i] >= seq."""

    request_ids: list[str]
    bitmask: torch.Tensor
    flags: np.ndarray
    seq: int
    device_flags: int | None = None  # the flags' device address (CUDA), from FlagWords
    opened: bool = field(default=False)
    source: FlagWords | None = None  # the FlagWords that issued it (None: a gate made by hand)

    def open(self) -> None:
        """Let the step sample with whatever the buffer holds (the fillers open it themselves; the
        step loop calls this only to release a gate whose job failed or was never posted)."""
        if self.source is not None:
            self.source.raise_words(self.flags, self.seq)
        else:
            self.flags[:] = self.seq
        self.opened = True

    def is_open(self) -> bool:
        return bool((self.flags.astype(np.int64) >= self.seq).all())

    def forced(self) -> bool:
        """Whether a watchdog opened it before its fillers had filled its rows: the step's constrained
        rows sampled under an unfilled (stale) bitmask and must not be emitted."""
        return self.source is not None and self.source.was_forced(self.seq)


class FlagWords:
    """The flag words of one filler set, in host memory the device can read: a numpy view, and on a
    GPU its device address. `memory` is int32 host memory, pinned (torch) or registered mapped: word
    i < `fillers` is filler i's; with several grammar workers whose jobs come through their job areas,
    word `combined` is raised by worker 0 once every filler's word has the step (grammar_worker.py),
    so that the device waits on one word instead of one per filler."""

    def __init__(self, memory: torch.Tensor, device: torch.device | None, fillers: int = 1,
                 combined: int | None = None) -> None:
        assert memory.dtype == torch.int32 and memory.dim() == 1
        assert fillers <= memory.numel() and (combined is None or fillers <= combined < memory.numel())
        self.memory = memory
        self.words = memory.numpy()
        self.words[:] = 0
        self.fillers, self.combined = fillers, combined
        self.seq = 0
        self.device_address: int | None = None
        # In-process writers (the bitmask thread, the watchdog, the step loop) raise words under this
        # lock, never lower them: a late fill's store must not shut a gate a watchdog forced open.
        self.lock = threading.Lock()
        # force_open: gates with seq > forced_after were opened unfilled; failure says why.
        self.forced_after: int | None = None
        self.failure: str | None = None
        if device is not None and device.type == "cuda":
            self.device_address = device_pointer(memory.data_ptr())

    def next_seq(self) -> int:
        # 2**31 gated steps (weeks at 1 ms) would wrap the int32 word; the engine refuses to.
        if self.seq >= 2**31 - 1:
            raise RuntimeError("gated sampling: the flag words' sequence is exhausted")
        self.seq += 1
        return self.seq

    def next_gate(self, request_ids: list[str], bitmask: torch.Tensor, combined: bool = False) -> GrammarGate:
        """The next step's gate, on the fillers' words or (combined) on the combined word alone."""
        address = self.device_address
        if combined and self.combined is not None:
            c = self.combined
            return GrammarGate(request_ids, bitmask, self.words[c:c + 1], self.next_seq(),
                               None if address is None else address + 4 * c, source=self)
        return GrammarGate(request_ids, bitmask, self.words[: self.fillers], self.next_seq(), address, source=self)

    def raise_words(self, words: np.ndarray, seq: int) -> None:
        """words (a view of these flags) raised to seq, none lowered (the in-process writers' store)."""
        with self.lock:
            np.maximum(words, seq, out=words)

    def pending(self) -> bool:
        """A gate issued whose fillers have not all raised their words yet."""
        return self.seq > 0 and int(self.words[: self.fillers].min()) < self.seq

    def open_all(self) -> None:
        """Every gate issued so far open (after the fillers were ended: nothing fills them any more)."""
        with self.lock:
            self.words[:] = self.seq

    def force_open(self, reason: str) -> None:
        """A watchdog's: every gate issued so far opened although its fillers may not have filled it
        (dead, stuck). The first call records which gates were not filled (those above the lowest
        filler word: the fillers raise their words after their rows) and why, before any word moves,
        so that whoever sees a forced gate open also sees it marked. Later calls only open again."""
        with self.lock:
            if self.forced_after is None:
                self.forced_after = int(self.words[: self.fillers].min())
                self.failure = reason
            self.words[:] = self.seq

    def was_forced(self, seq: int) -> bool:
        return self.forced_after is not None and seq > self.forced_after


class GateWatchdog:
    """The bitmask thread's watchdog (the grammar workers have their own: backend_process.watch_gates):
    a gate left shut GATE_TIMEOUT_S is forced open, and every gate issued after it too until `stop`
    (the engine core aborts their constrained rows and fails the thread over to a new one)."""

    def __init__(self, flags: FlagWords, filler: str = "the bitmask thread") -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(flags, filler, self._stop),
                                        name="pagedllm-gate-watchdog", daemon=True)
        self._thread.start()

    @staticmethod
    def _watch(flags: FlagWords, filler: str, stop: threading.Event) -> None:
        filled, since = -1, 0.0  # the lowest filler word (the last gate filled), and since when
        while not stop.wait(WATCH_PERIOD_S):
            if flags.failure is not None:
                flags.force_open(flags.failure)  # gates issued since: open them too
                continue
            if not flags.pending():
                continue
            low, now = int(flags.words[: flags.fillers].min()), time.monotonic()
            if low != filled:
                filled, since = low, now  # progress (or the first look at this shut gate)
            elif now - since > GATE_TIMEOUT_S:
                reason = f"{filler} did not fill gated step {low + 1} within {GATE_TIMEOUT_S:.0f} s"
                logger.error("gated sampling: %s; it is forced open and its constrained requests aborted", reason)
                flags.force_open(reason)
        if flags.failure is not None:
            flags.force_open(flags.failure)  # stopped after a failure: nothing fills these gates any more

    def stop(self) -> None:
        self._stop.set()


# -- CUDA -----------------------------------------------------------------------------------------
@functools.cache
def _libcuda():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib


def device_pointer(host_ptr: int) -> int:
    """The device address of mapped host memory (cuMemHostGetDevicePointer); with unified addressing
    it is usually the host address itself, which is the answer when the driver call is missing."""
    lib = _libcuda()
    fn = getattr(lib, "cuMemHostGetDevicePointer_v2", None) if lib is not None else None
    if fn is None:
        return host_ptr
    out = ctypes.c_uint64(0)
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    err = fn(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if err != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed ({err}): the gate's flag words are not mapped "
                           "host memory")
    return out.value


@functools.cache
def _wait_value_fn():
    lib = _libcuda()
    if lib is None:
        return None
    for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


_stream_ops_refused = False


def device_wait(gate: GrammarGate, stream: torch.cuda.Stream | None = None) -> str:
    """Queue on `stream` (the current one) a wait until every flag word of `gate` is >= its seq.
    Returns which mechanism queued it ("stream_op" or "spin")."""
    global _stream_ops_refused
    assert gate.device_flags is not None, "a CUDA gate needs its flags' device address"
    stream = stream or torch.cuda.current_stream()
    fn = None if _stream_ops_refused else _wait_value_fn()
    if fn is not None:
        handle = ctypes.c_void_p(stream.cuda_stream)
        for i in range(len(gate.flags)):
            err = fn(handle, gate.device_flags + 4 * i, gate.seq, CU_STREAM_WAIT_VALUE_GEQ)
            if err != 0:
                if i:
                    raise RuntimeError(f"cuStreamWaitValue32 failed ({err}) after {i} flag words were queued")
                logger.warning("cuStreamWaitValue32 refused (%d): gated sampling waits with a spinning kernel", err)
                _stream_ops_refused = True
                break
        else:
            return "stream_op"
    from pagedllm.kernels.grammar_gate import spin_until_geq

    spin_until_geq(gate.device_flags, len(gate.flags), gate.seq, stream)
    return "spin"


# -- CPU ------------------------------------------------------------------------------------------
def host_wait(gate: GrammarGate, timeout_s: float = HOST_WAIT_TIMEOUT_S) -> None:
    """Block (the GIL released) until the gate is open; the fillers write the flags from another
    thread or process."""
    if gate.is_open():
        return
    deadline = time.monotonic() + timeout_s
    delay = 1e-5
    while not gate.is_open():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the grammar bitmask of a gated step (seq {gate.seq}) was not filled within "
                               f"{timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


# -- the order before h52, kept for its A/B ----------------------------------------------------------
def step_gated_old_order(core, so, gate: GrammarGate) -> list:
    """EngineCore._step_gated as it was until h52: the sampling, and with it the device wait, launched
    with the forward; the step in flight collected and the job posted only after them. A call that
    synchronizes the device between the wait and the post then waits for a fill nobody has posted yet
    (the hang above). Not used by the engine: put in place of `EngineCore._step_gated` by
    scripts/gpu_gate_check.py --old-order and tests/structured_output/test_gate_joining.py, which show
    the hang (GPU) and its CPU stand-in (SYNC_AT_LAUNCH_S) with it. `core`: the EngineCore."""
    so.grammar_gate = gate
    outputs: list = []
    core.model_executor.execute_model(so)
    pending = core.model_executor.sample_tokens(gate)
    core.step_count += 1
    if core.inflight is not None:
        outputs = core._collect_inflight()
    core.inflight = (so, pending)
    core.structured_output_manager.submit_gate(gate)
    return outputs
