"""Gated sampling's device wait (structured_output/gate.py, kernels/grammar_gate.py): on CUDA a copy
queued behind the wait runs only once a host thread has filled the buffer and raised the flag words
(both the driver's stream memory operation and the spinning kernel); on the CPU (Triton's
interpreter) the spinning kernel returns on open flags, as its reference `host_wait` does."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from pagedllm.kernels.grammar_gate import _spin_kernel
from pagedllm.structured_output import gate as gate_mod
from pagedllm.structured_output.gate import FlagWords, GrammarGate, host_wait


def test_open_flags_let_the_kernel_and_its_reference_return(device):
    flags = torch.tensor([5, 9], dtype=torch.int32, device=device)
    _spin_kernel[(1,)](flags, 2, 5, num_warps=1)  # 5 >= 5 and 9 >= 5: returns
    if device.type == "cuda":
        torch.cuda.synchronize()
    gate = GrammarGate(["r"], torch.zeros(1, 1, dtype=torch.int32), flags.cpu().numpy(), 5)
    host_wait(gate, timeout_s=1)  # open: returns at once
    shut = GrammarGate(["r"], torch.zeros(1, 1, dtype=torch.int32), np.array([5, 4], dtype=np.int32), 5)
    with pytest.raises(RuntimeError, match="not filled"):
        host_wait(shut, timeout_s=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mechanism", ["stream_op", "spin"])
def test_a_copy_behind_the_wait_reads_the_buffer_after_the_flags(mechanism, monkeypatch):
    monkeypatch.setattr(gate_mod, "_stream_ops_refused", mechanism == "spin")
    dev = torch.device("cuda")
    host = torch.zeros((8, 100), dtype=torch.int32, pin_memory=True)
    out = torch.empty((8, 100), dtype=torch.int32, device=dev)
    flags = FlagWords(torch.zeros(2, dtype=torch.int32, pin_memory=True), dev)
    for _ in range(3):
        seq = flags.next_seq()
        gate = GrammarGate(["r"], host, flags.words, seq, flags.device_address)
        host.numpy().fill(-seq)
        torch.cuda.synchronize()
        assert gate_mod.device_wait(gate) == mechanism
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        flags.words[0] = seq  # one of two fillers done: still shut
        time.sleep(0.01)
        assert not done.query()

        def fill(seq=seq):
            host.numpy().fill(seq)
            flags.words[1] = seq

        t = threading.Thread(target=fill)
        t.start()
        t.join()
        done.synchronize()
        assert bool((out == seq).all())
