"""Programmatic dependent launch (kernels/pdl.py): who gets it, and what a PDL kernel compiles to.

The contract that makes an early launch safe is in the compiled code: `griddepcontrol.wait` before any
load or store of the kernel, and the launch option set only together with the kernel's USE_PDL (a
kernel placed early without its wait would read what the kernel before it is still writing). Checked
here without a GPU by compiling for sm_90 with Triton's bundled ptxas; the timing is the H200's
(BENCHMARKS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.kernels import pdl

pytestmark = pytest.mark.skipif(not pdl._triton_has_pdl(), reason="this Triton has no launch_pdl")


def test_no_pdl_off_cuda_or_when_switched_off(monkeypatch):
    assert pdl.launch_kwargs(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.uses_pdl(torch.device("cuda", 0))  # decided before any CUDA call
    monkeypatch.setattr(pdl, "uses_pdl", lambda device: True)
    assert pdl.launch_kwargs(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedllm.kernels import rmsnorm, wna16_stream
from tests.kernels.sm90_compile_check import pdl_violations

def ptx(kernel, sig, consts, use_pdl):
    sig = sig | {name: "constexpr" for name in consts}
    options = {"num_warps": 4} | ({"launch_pdl": True} if use_pdl else {})
    c = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=options)
    assert bool(getattr(c.metadata, "launch_pdl", False)) == use_pdl
    return c.asm["ptx"]

norm_sig = {n: "*bf16" for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr")}
norm_sig |= {n: "i32" for n in ("stride_x", "stride_r", "stride_o", "stride_ro", "hidden")} | {"eps": "fp32"}
for use in (False, True):
    text = ptx(rmsnorm._rms_norm_kernel, norm_sig, dict(HAS_RESIDUAL=True, BLOCK_N=4096, PARTS=1, USE_PDL=use), use)
    print("norm", use, "griddepcontrol.wait" in text, "griddepcontrol.launch_dependents" in text, pdl_violations(text))
# the one-row int4 GEMV at Llama-3.1-8B's o_proj launch: L2 prefetches of its words before the wait
cfg = wna16_stream.stream_config(4096, 4096)
gemv_sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "bias_ptr": "*bf16",
            "perm_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "counter_ptr": "*i32", "xp_ptr": "*bf16",
            "N": "i32", "SPLIT": "i32", "magic_even": "i32", "magic_odd": "i32", "x_half": "i32", "r_ptr": "*bf16",
            "nw_ptr": "*bf16", "r_out_ptr": "*bf16", "eps": "fp32"}
consts = dict(GROUP_SIZE=128, STEPS=wna16_stream.program_steps(cfg, 4096), HAS_BIAS=False, HAS_PERM=False,
              USE_SPLIT=True, RED_ROWS=16, BLOCK_N=cfg.BLOCK_N, BLOCK_KW=cfg.BLOCK_KW, STEP_SUMS=False, PREFETCH=False,
              MATH=cfg.MATH, ROWS=cfg.ROWS, X_SCRATCH=False, SZ_TILE=False, EVEN_N=True, EARLY=False, X_ACT=0,
              HIDDEN_PAD=4096, USE_ASM=True, USE_PDL=True)
text = ptx(wna16_stream._wna16_stream_kernel, gemv_sig, consts, True)
wait = text.index("griddepcontrol.wait")
print("gemv", pdl_violations(text), "prefetch.global.L2" in text[:wait], "prefetch.global.L2" in text[wait:])
# the check itself: a load before the wait is caught
print("caught", pdl_violations("ld.global.b32 %r1, [%rd1];\\ngriddepcontrol.wait;"),
      pdl_violations("ld.global.b32 %r1, [%rd1];"))
"""


def test_pdl_kernels_wait_before_touching_memory():
    # Compiled for sm_90 in a process of its own: this suite runs kernels in Triton's interpreter.
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "norm False False False ['no griddepcontrol.wait']" in lines  # no PDL: no griddepcontrol at all
    assert "norm True True True []" in lines
    assert "gemv [] True False" in lines
    assert "caught ['ld.global.b32 %r1, [%rd1];'] ['no griddepcontrol.wait']" in lines
