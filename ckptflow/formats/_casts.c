/* The two narrowing casts a consolidation spends its CPU on, in one pass each and without the GIL:
 * float32 -> bfloat16 and float32 -> float16, on raw bits, bit for bit as torch's x86-64 kernels.
 *
 * `ckptflow.formats.casts` uses this module when the install built it and numpy otherwise; both are
 * compared with torch over the same millions of patterns (tests/test_casts.py). numpy needs seven
 * passes over each block for the bfloat16 rounding (3 GB/s of source on this project's machines),
 * this loop one (8 to 11 GB/s); numpy's float16 cast runs at well under 1 GB/s, F16C at several.
 *
 *   fp32_to_bf16(src, out)  round to nearest, ties to even; every NaN -> 0xFFFF (torch's AVX2 and
 *                           AVX-512 kernels); values that round past the largest bfloat16 -> inf.
 *   fp32_to_fp16(src, out)  the F16C instruction, which is what torch uses: round to nearest even,
 *                           overflow to inf, subnormals, NaNs keep sign and top payload bits, quieted.
 *                           Raises RuntimeError where the CPU has no F16C (see `has_f16c`).
 *
 * `src` is any buffer of whole float32 elements, `out` a writable buffer of exactly half its bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define X86 1
#include <immintrin.h>
#else
#define X86 0
#endif

/* One loop, compiled twice on x86-64 (AVX2 and the baseline) and picked when the module loads. */
#if X86
__attribute__((target_clones("avx2", "default")))
#endif
static void bf16_loop(const uint32_t *restrict src, uint16_t *restrict out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = src[i];
        uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        out[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0xFFFFu : (uint16_t)rounded;
    }
}

#if X86
__attribute__((target("avx,f16c")))
static void fp16_loop(const uint32_t *src, uint16_t *out, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps((const float *)(src + i));
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    if (i < n) {  /* the tail through the same instruction, so that it rounds and quiets alike */
        float rest[8] = {0};
        uint16_t done[8];
        memcpy(rest, src + i, (size_t)(n - i) * 4);
        _mm_storeu_si128((__m128i *)done, _mm256_cvtps_ph(_mm256_loadu_ps(rest), _MM_FROUND_TO_NEAREST_INT));
        memcpy(out + i, done, (size_t)(n - i) * 2);
    }
}
#endif

static int has_f16c(void) {
#if X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* Take the two buffers and check their sizes; 0 on success, -1 with an exception set. */
static int take(PyObject *args, const char *name, Py_buffer *src, Py_buffer *out) {
    if (!PyArg_ParseTuple(args, "y*w*", src, out)) {
        return -1;
    }
    if (src->len % 4 != 0 || out->len * 2 != src->len) {
        PyErr_Format(PyExc_ValueError, "%s: %zd source bytes are not whole float32 elements, or the output's "
                     "%zd bytes are not half of them", name, src->len, out->len);
        PyBuffer_Release(src);
        PyBuffer_Release(out);
        return -1;
    }
    return 0;
}

static PyObject *fp32_to_bf16(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    if (take(args, "fp32_to_bf16", &src, &out) < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    bf16_loop((const uint32_t *)src.buf, (uint16_t *)out.buf, src.len / 4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *fp32_to_fp16(PyObject *self, PyObject *args) {
    if (!has_f16c()) {
        PyErr_SetString(PyExc_RuntimeError, "fp32_to_fp16: this CPU has no F16C instruction");
        return NULL;
    }
    Py_buffer src, out;
    if (take(args, "fp32_to_fp16", &src, &out) < 0) {
        return NULL;
    }
#if X86
    Py_BEGIN_ALLOW_THREADS
    fp16_loop((const uint32_t *)src.buf, (uint16_t *)out.buf, src.len / 4);
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fp32_to_bf16", fp32_to_bf16, METH_VARARGS, "fp32_to_bf16(src, out): float32 bits to bfloat16 bits, as torch."},
    {"fp32_to_fp16", fp32_to_fp16, METH_VARARGS, "fp32_to_fp16(src, out): float32 to float16 with F16C, as torch."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_casts", NULL, -1, methods};

PyMODINIT_FUNC PyInit__casts(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "has_f16c", has_f16c()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
