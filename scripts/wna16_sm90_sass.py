"""The one-row int4 stream kernel's variants (kernels/wna16_stream.py) compiled for sm_90 on a machine
without a GPU: registers, stack, and SASS instructions per packed word a thread handles (the kernel
is unrolled, so the whole program counts; its split-K epilogue included), with a histogram of the
opcodes. A static proxy for the one-row GEMV's speed (its H200 times track instructions a word:
BENCHMARKS.md, issue 19). Uses tests/kernels/sm90_compile_check.py's recorder and compile helpers.

    PYTHONPATH=$PWD python scripts/wna16_sm90_sass.py [--shapes 4096x14336,6144x4096] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedllm.kernels import wna16_stream  # noqa: E402
from pagedllm.kernels.wna16_stream import StreamConfig  # noqa: E402
from tests.kernels.sm90_compile_check import _OPTION_KEYS, _Recorder, _signature, _stack_bytes  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")

VARIANTS = {
    "fp32 64x8w2": StreamConfig(64, 8, 2), "fp32 128x2w4": StreamConfig(128, 2, 4),
    "f16 r2 64x8w2": StreamConfig(64, 8, 2, MATH="f16x2", ROWS=2),
    "f16 r2 64x4w2": StreamConfig(64, 4, 2, MATH="f16x2", ROWS=2),
    "f16 r2 256x2w4": StreamConfig(256, 2, 4, MATH="f16x2", ROWS=2),
    "f16 r4 64x8w2 xs": StreamConfig(64, 8, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True),
    "f16 r4 64x8w2 xs sz": StreamConfig(64, 8, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True, SZ_TILE=True),
    "f16 r4 64x4w2 xs sz early": StreamConfig(64, 4, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True, SZ_TILE=True,
                                              EARLY=True),
    "f16 r2 64x4w2 early": StreamConfig(64, 4, 2, MATH="f16x2", ROWS=2, EARLY=True),
}


def sass_ops(cubin: bytes) -> list[str]:
    with open("/tmp/_wna16_sm90.cubin", "wb") as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", "/tmp/_wna16_sm90.cubin"],
                          capture_output=True, text=True, check=True).stdout
    return [m.group(1) for ln in sass.splitlines() if (m := _OP.search(ln))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x14336,6144x4096")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    launches: list = []
    wna16_stream._wna16_stream_kernel = _Recorder(wna16_stream._wna16_stream_kernel, launches)
    wna16_stream._workspaces[torch.device("cpu")] = (torch.zeros(1 << 22), torch.zeros(1 << 15, dtype=torch.int32))
    spills = 0
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        qw = torch.zeros(k // 8, n, dtype=torch.int32)
        s, z = torch.zeros(k // 128, n, dtype=torch.bfloat16), torch.zeros(k // 128, n, dtype=torch.uint8)
        for name in args.variants.split(","):
            cfg = VARIANTS[name]
            launches.clear()
            wna16_stream.wna16_stream_linear(torch.zeros(1, k, dtype=torch.bfloat16), qw, s, z, 128, config=cfg)
            kernel, kargs, kwargs = launches[0]
            sig, consts, attrs = _signature(kernel, kargs, kwargs)
            options = {key: kwargs[key] for key in _OPTION_KEYS if key in kwargs}
            compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            regs, stack = _stack_bytes(compiled.asm["cubin"])
            ops = sass_ops(compiled.asm["cubin"])
            words = cfg.BLOCK_N * cfg.BLOCK_KW * consts["STEPS"] / (32 * cfg.num_warps)  # a thread's
            hist = collections.Counter(op.split(".")[0] for op in ops)
            print(f"{shape} {name}: {regs} regs, {stack} B stack; {len(ops)} SASS = {len(ops) / words:.1f} a word "
                  f"({words:.0f} words a thread); " + " ".join(f"{o} {c / words:.1f}" for o, c in hist.most_common(args.top)),
                  flush=True)
            spills += stack > 0
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
