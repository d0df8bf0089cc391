/* The KV digest's mix, one pass over the blocks' words: kv_digest.py's
 * documented digest, for the CPU. Built with the compiled path
 * (python -m kvtrace.compile); kv_digest.py calls kvt_digest through ctypes
 * and checks its first digests against its NumPy chunks before it uses it.
 *
 * A block's digest: over the layers in order, acc = acc * FOLD + sum, where
 * sum is, over each 64-bit word v of the block's bytes in that layer (its
 * parts in order: one where the blocks come first, K and V where they come
 * second), v ^= v >> 31; v *= the weight of its position; v ^= v >> 29;
 * v *= MIX; v ^= v >> 32; all modulo 2^64. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FOLD 0x5851F42D4C957F2DULL
#define MIX 0x2545F4914F6CDD1DULL

/* Where the compiler can, copies for AVX-512 (a 64-bit multiply of its own)
 * and AVX2 besides the baseline one, chosen when the library loads by what
 * the CPU has. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 12
#define KVT_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define KVT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KVT_CLONES
#endif

/* The digests of the n blocks idx over L layers into out. Layer l starts at
 * address base[l]; its block k's part p starts block_stride[l] * k +
 * part_stride[l] * p words in; each part is words[l] words, weighted by the
 * words[l] * parts[l] words at address weights[l]. The caller checks each
 * idx is a block of every layer. */
KVT_CLONES
void kvt_digest(int64_t L, const int64_t *base, const int64_t *block_stride,
                const int64_t *part_stride, const int64_t *parts, const int64_t *words,
                const int64_t *weights, const int64_t *idx, int64_t n, uint64_t *out)
{
    for (int64_t l = 0; l < L; l++) {
        const unsigned char *layer = (const unsigned char *)(uintptr_t)base[l];
        const uint64_t *w = (const uint64_t *)(uintptr_t)weights[l];
        const int64_t nw = words[l];
        for (int64_t i = 0; i < n; i++) {
            uint64_t sum = 0;
            for (int64_t p = 0; p < parts[l]; p++) {
                const unsigned char *x = layer + 8 * (idx[i] * block_stride[l] + p * part_stride[l]);
                const uint64_t *wp = w + p * nw;
                for (int64_t k = 0; k < nw; k++) {
                    uint64_t v;
                    memcpy(&v, x + 8 * k, 8);   /* the layer may start anywhere */
                    v ^= v >> 31;
                    v *= wp[k];
                    v ^= v >> 29;
                    v *= MIX;
                    v ^= v >> 32;
                    sum += v;
                }
            }
            out[i] = l ? out[i] * FOLD + sum : sum;
        }
    }
}

/* An extension module like the compiled path's others, with nothing in it:
 * kv_digest.py loads the library itself. */
static struct PyModuleDef kvt_module = {PyModuleDef_HEAD_INIT, "_kv_digest",
                                        "The KV digest's mix (kvt_digest, through ctypes).",
                                        -1, NULL};

PyMODINIT_FUNC PyInit__kv_digest(void) { return PyModule_Create(&kvt_module); }
