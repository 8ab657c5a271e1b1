/* The kernels as a CPython extension module: the same functions, names and argument order as the
 * ctypes library (build.py declares both), called through METH_FASTCALL.
 *
 * Why: a decode step makes ~270 kernel calls. ctypes converts every argument through its argtypes,
 * with the GIL held, several times slower than a METH_FASTCALL call (per-call costs and their share
 * of a 16-stream step: BENCHMARKS.md), and that is GIL time the server's event loop waits for.
 *
 * Arguments: pointers are Python ints (tensor.data_ptr()) or None (NULL), integers ints, floats
 * floats. Every kernel runs with the GIL released, as ctypes.CDLL does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.c"

static inline void *arg_ptr(PyObject *o) { return o == Py_None ? NULL : PyLong_AsVoidPtr(o); }
static inline long arg_long(PyObject *o) { return PyLong_AsLong(o); }
static inline float arg_float(PyObject *o) { return (float)PyFloat_AsDouble(o); }

static int check_nargs(const char *name, Py_ssize_t given, Py_ssize_t want) {
    if (given == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, given);
    return 0;
}

#define FN(name) static PyObject *py_##name(PyObject *self, PyObject *const *a, Py_ssize_t nargs)
#define BEGIN(name, n)                                  \
    (void)self;                                         \
    if (!check_nargs(#name, nargs, n)) return NULL;
#define CALL(stmt)                                      \
    if (PyErr_Occurred()) return NULL;                  \
    Py_BEGIN_ALLOW_THREADS stmt;                        \
    Py_END_ALLOW_THREADS

FN(cpu_pool_init) {
    BEGIN(cpu_pool_init, 1)
    const int n = (int)arg_long(a[0]);
    int r = 0;
    CALL(r = cpu_pool_init(n))
    return PyLong_FromLong(r);
}

FN(cpu_pool_size) {
    BEGIN(cpu_pool_size, 0)
    (void)a;
    return PyLong_FromLong(cpu_pool_size());
}

FN(cpu_set_sgemm) {
    BEGIN(cpu_set_sgemm, 2)
    void *fn = arg_ptr(a[0]), *set_threads = arg_ptr(a[1]);
    CALL(cpu_set_sgemm(fn, set_threads))
    Py_RETURN_NONE;
}

#define GEMM_ARGS                                                                                             \
    const int kind = (int)arg_long(a[0]);                                                                     \
    const float *x = arg_ptr(a[1]);                                                                           \
    const long ldx = arg_long(a[2]);                                                                          \
    const uint8_t *w = arg_ptr(a[3]);                                                                         \
    float *y = arg_ptr(a[4]);                                                                                 \
    const long ldy = arg_long(a[5]), M = arg_long(a[6]), N = arg_long(a[7]), K = arg_long(a[8]);

FN(gguf_gemm) {
    BEGIN(gguf_gemm, 9)
    GEMM_ARGS
    int r = 0;
    CALL(r = gguf_gemm(kind, x, ldx, w, y, ldy, M, N, K))
    return PyLong_FromLong(r);
}

FN(gguf_gemm_dense) {
    BEGIN(gguf_gemm_dense, 9)
    GEMM_ARGS
    int r = 0;
    CALL(r = gguf_gemm_dense(kind, x, ldx, w, y, ldy, M, N, K))
    return PyLong_FromLong(r);
}

FN(gguf_dequantize) {
    BEGIN(gguf_dequantize, 5)
    const int kind = (int)arg_long(a[0]);
    const uint8_t *w = arg_ptr(a[1]);
    float *out = arg_ptr(a[2]);
    const long N = arg_long(a[3]), K = arg_long(a[4]);
    CALL(gguf_dequantize(kind, w, out, N, K))
    Py_RETURN_NONE;
}

FN(write_kv_cache) {
    BEGIN(write_kv_cache, 10)
    const float *key = arg_ptr(a[0]);
    const long key_stride = arg_long(a[1]);
    const float *value = arg_ptr(a[2]);
    const long value_stride = arg_long(a[3]);
    void *kv_cache = arg_ptr(a[4]);
    const long num_slots = arg_long(a[5]);
    const int64_t *slot_mapping = arg_ptr(a[6]);
    const long num_tokens = arg_long(a[7]), row = arg_long(a[8]);
    const int kv_type = (int)arg_long(a[9]);
    CALL(write_kv_cache(key, key_stride, value, value_stride, kv_cache, num_slots, slot_mapping, num_tokens, row,
                        kv_type))
    Py_RETURN_NONE;
}

FN(paged_attention_rows) {
    BEGIN(paged_attention_rows, 26)
    const float *query = arg_ptr(a[0]);
    const long q_stride = arg_long(a[1]);
    const float *key = arg_ptr(a[2]);
    const long key_stride = arg_long(a[3]);
    const float *value = arg_ptr(a[4]);
    const long value_stride = arg_long(a[5]);
    const int64_t *slot_mapping = arg_ptr(a[6]);
    const long num_tokens = arg_long(a[7]);
    float *out = arg_ptr(a[8]);
    const long out_stride = arg_long(a[9]);
    void *kv_cache = arg_ptr(a[10]);
    const int kv_type = (int)arg_long(a[11]);
    const long num_slots = arg_long(a[12]);
    const int block_size = (int)arg_long(a[13]), num_heads = (int)arg_long(a[14]);
    const int num_kv_heads = (int)arg_long(a[15]), head_dim = (int)arg_long(a[16]);
    const int32_t *block_table = arg_ptr(a[17]);
    const long block_table_stride = arg_long(a[18]);
    const int64_t *row_token = arg_ptr(a[19]);
    const int32_t *row_req = arg_ptr(a[20]), *row_seq = arg_ptr(a[21]);
    const long n_rows = arg_long(a[22]);
    const float scale = arg_float(a[23]);
    void *scratch = arg_ptr(a[24]);
    const long scratch_per_worker = arg_long(a[25]);
    CALL(paged_attention_rows(query, q_stride, key, key_stride, value, value_stride, slot_mapping, num_tokens, out,
                              out_stride, kv_cache, kv_type, num_slots, block_size, num_heads, num_kv_heads,
                              head_dim, block_table, block_table_stride, row_token, row_req, row_seq, n_rows,
                              scale, scratch, scratch_per_worker))
    Py_RETURN_NONE;
}

FN(rms_norm) {
    BEGIN(rms_norm, 10)
    const float *x = arg_ptr(a[0]);
    const long x_stride = arg_long(a[1]);
    const float *residual = arg_ptr(a[2]);
    const long res_stride = arg_long(a[3]);
    float *residual_out = arg_ptr(a[4]);
    const float *weight = arg_ptr(a[5]);
    float *out = arg_ptr(a[6]);
    const long num_tokens = arg_long(a[7]), hidden = arg_long(a[8]);
    const float eps = arg_float(a[9]);
    CALL(rms_norm(x, x_stride, residual, res_stride, residual_out, weight, out, num_tokens, hidden, eps))
    Py_RETURN_NONE;
}

FN(rotary_embedding) {
    BEGIN(rotary_embedding, 14)
    const int64_t *positions = arg_ptr(a[0]);
    const float *q = arg_ptr(a[1]);
    const long q_stride = arg_long(a[2]);
    const float *k = arg_ptr(a[3]);
    const long k_stride = arg_long(a[4]);
    float *q_out = arg_ptr(a[5]), *k_out = arg_ptr(a[6]);
    const long num_tokens = arg_long(a[7]), num_q_heads = arg_long(a[8]), num_k_heads = arg_long(a[9]);
    const long head_size = arg_long(a[10]), rotary_dim = arg_long(a[11]);
    const float *cos_sin_cache = arg_ptr(a[12]);
    const int neox = (int)arg_long(a[13]);
    CALL(rotary_embedding(positions, q, q_stride, k, k_stride, q_out, k_out, num_tokens, num_q_heads, num_k_heads,
                          head_size, rotary_dim, cos_sin_cache, neox))
    Py_RETURN_NONE;
}

FN(silu_and_mul) {
    BEGIN(silu_and_mul, 5)
    const float *x = arg_ptr(a[0]);
    const long x_stride = arg_long(a[1]);
    float *out = arg_ptr(a[2]);
    const long num_tokens = arg_long(a[3]), d = arg_long(a[4]);
    CALL(silu_and_mul(x, x_stride, out, num_tokens, d))
    Py_RETURN_NONE;
}

FN(argmax_rows) {
    BEGIN(argmax_rows, 5)
    const float *x = arg_ptr(a[0]);
    const long ld = arg_long(a[1]), rows = arg_long(a[2]), n = arg_long(a[3]);
    int64_t *out = arg_ptr(a[4]);
    CALL(argmax_rows(x, ld, rows, n, out))
    Py_RETURN_NONE;
}

FN(llama_decoder_stack) {
    BEGIN(llama_decoder_stack, 6)
    const int64_t *model = arg_ptr(a[0]), *layers = arg_ptr(a[1]);
    const long n_layers = arg_long(a[2]);
    const int64_t *step = arg_ptr(a[3]);
    const float eps = arg_float(a[4]), scale = arg_float(a[5]);
    int r = 0;
    CALL(r = llama_decoder_stack(model, layers, n_layers, step, eps, scale))
    return PyLong_FromLong(r);
}

#define ENTRY(name) {#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, NULL}

static PyMethodDef METHODS[] = {
    ENTRY(cpu_pool_init), ENTRY(cpu_pool_size), ENTRY(cpu_set_sgemm), ENTRY(gguf_gemm), ENTRY(gguf_gemm_dense),
    ENTRY(gguf_dequantize), ENTRY(write_kv_cache), ENTRY(paged_attention_rows), ENTRY(rms_norm),
    ENTRY(rotary_embedding), ENTRY(silu_and_mul), ENTRY(argmax_rows), ENTRY(llama_decoder_stack), {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "pagedllm_cpu_kernels", NULL, -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pagedllm_cpu_kernels(void) { return PyModule_Create(&MODULE); }
