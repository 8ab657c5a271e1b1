"""The GGUF GEMV / dequant kernels compiled for sm_90 (H100/H200) on a machine without a GPU: registers,
stack (spills), shared memory, and the main loop's SASS instructions per weight, a static proxy for the
GEMV's speed where the device cannot be had (its H200 times track instructions a weight, not bytes:
BENCHMARKS.md, issue 19). Uses tests/kernels/sm90_compile_check.py's recorder and compile helpers.

    PYTHONPATH=$PWD python scripts/gguf_sm90_sass.py [--types Q4_K,Q6_K] [--ms 1,2,4,16]

One line per (type, M): the default launch config at N x K = 4096 x 14336. Minutes of CPU time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedllm.kernels import gguf_dequant, gguf_gemv  # noqa: E402
from pagedllm.kernels.gguf_dequant import GGUF_BLOCK, GGUFPacked, pack_factor  # noqa: E402
from tests.kernels.sm90_compile_check import _OPTION_KEYS, _Recorder, _signature, _stack_bytes  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_ADDR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")


def zero_packed(qtype: str, n: int, k: int) -> GGUFPacked:
    """A packed weight of the right dtypes and shapes (zeros: nothing runs)."""
    g = 16 if qtype == "Q6_K" else 32
    sdt = {"Q4_K": torch.uint8, "Q6_K": torch.int8}.get(qtype, torch.float16)
    kq = qtype in ("Q4_K", "Q6_K")
    return GGUFPacked(
        qtype, torch.zeros(k // pack_factor(qtype), n, dtype=torch.int32),
        torch.zeros(k // 16, n, dtype=torch.int32) if qtype == "Q6_K" else None,
        torch.zeros(k // g, n, dtype=sdt),
        torch.zeros(k // 32, n, dtype=sdt) if qtype in ("Q4_1", "Q4_K") else None,
        torch.zeros(k // 256, n, dtype=torch.float16) if kq else None,
        torch.zeros(k // 256, n, dtype=torch.float16) if qtype == "Q4_K" else None, n, k)


def loop_stats(cubin: bytes) -> tuple[int, int]:
    """(instructions, shared-memory ops) of the longest backward branch's body: the K loop."""
    with open("/tmp/_gguf_sm90.cubin", "wb") as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", "/tmp/_gguf_sm90.cubin"],
                          capture_output=True, text=True, check=True).stdout
    lines = [(int(m.group(1), 16), ln) for ln in sass.splitlines() if (m := _ADDR.match(ln))]
    lo = hi = 0
    for addr, ln in lines:
        b = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if b and int(b.group(1), 16) < addr and addr - int(b.group(1), 16) > hi - lo:
            lo, hi = int(b.group(1), 16), addr
    body = [ln for addr, ln in lines if lo <= addr <= hi]
    return len(body), sum(1 for ln in body if re.search(r"\b(STS|LDS|LDSM)\b", ln))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(GGUF_BLOCK))
    ap.add_argument("--ms", default="1,2,4,16")
    args = ap.parse_args()
    launches: list = []
    gguf_gemv._gguf_gemv_kernel = _Recorder(gguf_gemv._gguf_gemv_kernel, launches)
    gguf_dequant._dequant_kernel = _Recorder(gguf_dequant._dequant_kernel, launches)
    gguf_gemv._workspaces[torch.device("cpu")] = (torch.zeros(1 << 23), torch.zeros(1 << 15, dtype=torch.int32))
    n, k = 4096, 14336
    spills = 0
    for qtype in args.types.split(","):
        p = zero_packed(qtype, n, k)
        for m in (int(v) for v in args.ms.split(",")):
            launches.clear()
            gguf_gemv.gguf_gemv(torch.zeros(m, k, dtype=torch.bfloat16), p)
            kernel, kargs, kwargs = launches[0]
            sig, consts, attrs = _signature(kernel, kargs, kwargs)
            options = {key: kwargs[key] for key in _OPTION_KEYS if key in kwargs}
            compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            regs, stack = _stack_bytes(compiled.asm["cubin"])
            instrs, smem_ops = loop_stats(compiled.asm["cubin"])
            cfg = gguf_gemv.gguf_gemv_config(m, p)
            weights = cfg.BLOCK_N * cfg.BLOCK_KP * pack_factor(qtype) / (32 * cfg.num_warps)  # a thread's, a step
            print(f"{qtype} M={m} {tuple(cfg)}: {regs} registers, {stack} B stack, {compiled.metadata.shared} B "
                  f"shared; K loop {instrs} instructions = {instrs / weights:.2f} a weight, {smem_ops} shared-"
                  f"memory ops in it", flush=True)
            spills += stack > 0
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
