/* CPU kernels for pagedllm: the one translation unit, compiled at first use with
 * `cc -O3 -march=native -pthread` (see build.py) and loaded with ctypes.
 *
 *   vec.h        16-lane vectors (GCC vector extensions: AVX-512, AVX2 or SSE), exp, reductions
 *   pool.h       the thread pool every parallel kernel runs on (tolerates preempted helpers)
 *   gguf_gemm.h  matmuls on GGUF Q4_0 / Q4_1 / Q8_0 blocks, and their dequantization
 *   attention.h  paged decode attention and the KV-cache write
 *   rows.h       RMSNorm (+ residual), rotary embedding, silu * mul, row argmax
 *   decoder.h    a Llama decoder stack for a step of few tokens in one call, from the kernels above
 */
#include "attention.h"
#include "decoder.h"
#include "gguf_gemm.h"
#include "pool.h"
#include "rows.h"
#include "vec.h"
