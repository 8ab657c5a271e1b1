"""Gated sampling's device wait (structured_output/gate.py, kernels/grammar_gate.py): on CUDA a copy
queued behind the wait runs only once a host thread has filled the buffer and both fillers' byte
lanes of the flag word hold the step (the driver's stream memory operation and the spinning kernel,
across the byte's wrap); on the CPU (Triton's interpreter) the spinning kernel returns on an open
flag, and its reference `host_wait` waits for every lane."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedllm.kernels.grammar_gate import _spin_kernel
from pagedllm.structured_output import gate as gate_mod
from pagedllm.structured_output.gate import FlagWords, host_wait, lanes_value


def test_an_open_flag_lets_the_kernel_and_its_reference_return(device):
    # Two fillers: the word holds both lanes' byte of step 0x105 (0x05 0x05) -> open for that step only.
    word = torch.tensor([0x0505], dtype=torch.int32, device=device)
    _spin_kernel[(1,)](word, 0x0505, num_warps=1)  # equal: returns
    if device.type == "cuda":
        torch.cuda.synchronize()
    flags = FlagWords(torch.zeros(1, dtype=torch.int32), 2, None)
    flags.seq = 0x104
    gate = flags.next_gate(["r"], torch.zeros(1, 1, dtype=torch.int32))
    assert gate.target == lanes_value(0x105, 2) == 0x0505 and not gate.is_open()
    flags.lanes[0] = 0x05  # one filler done: still shut
    with pytest.raises(RuntimeError, match="not filled"):
        host_wait(gate, timeout_s=0.05)
    flags.lanes[1] = 0x05
    host_wait(gate, timeout_s=1)  # open: returns at once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mechanism", ["stream_op", "spin"])
def test_a_copy_behind_the_wait_reads_the_buffer_after_the_flags(mechanism, monkeypatch):
    monkeypatch.setattr(gate_mod, "_stream_ops_refused", mechanism == "spin")
    dev = torch.device("cuda")
    host = torch.zeros((8, 100), dtype=torch.int32, pin_memory=True)
    out = torch.empty((8, 100), dtype=torch.int32, device=dev)
    flags = FlagWords(torch.zeros(1, dtype=torch.int32, pin_memory=True), 2, dev)
    flags.seq = 254  # through the byte's wrap: 255, 256 (byte 0), 257
    for _ in range(3):
        gate = flags.next_gate(["r"], host)
        seq = gate.seq
        host.numpy().fill(-seq)
        torch.cuda.synchronize()
        assert gate_mod.device_wait(gate) == mechanism
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        flags.lanes[0] = seq & 0xFF  # one of two fillers done: still shut
        time.sleep(0.01)
        assert not done.query()

        def fill(seq=seq):
            host.numpy().fill(seq)
            flags.lanes[1] = seq & 0xFF

        t = threading.Thread(target=fill)
        t.start()
        t.join()
        done.synchronize()
        assert bool((out == seq).all())
