/* Eight-float vectors (GCC vector extensions: the width and FMA come from the build's -m flags) and
   the vector e^x, shared by the kernels that include this header. */
#ifndef PD_VEC_H
#define PD_VEC_H
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));
#define LD(p) (*(const v8fu *)(p))
#ifdef __AVX512F__
typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define LD16(p) (*(const v16fu *)(p))
#endif

/* bfloat16 <-> float32 for a KV cache held in bfloat16 (cache.kv_dtype): a bfloat16 is a float's upper
   half, so widening is exact; narrowing rounds to nearest even, NaN to torch's quiet NaN, the same
   bits as torch's .to(torch.bfloat16). */
static inline float pd_from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
static inline uint16_t pd_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* e^x for x <= 0 (scores minus their maximum; silu's -|x|), within a few units in the last place: x = n ln2 + r,
   |r| <= ln2/2, e^r by its Taylor polynomial to degree 7, 2^n built in the exponent bits. libm's
   expf is called one value at a time here (no vector math library without -ffast-math), which
   cost more than the rest of the kernel. */
#define PD_VEXP(name, F, I)                                                                          \
    static inline F name(F x) {                                                                      \
        const F lo = (F){0} - 87.0f;                                                                 \
        const I under = x < lo; /* e^-87 ~ 1.6e-38: below it, weights vanish next to the maximum's 1 */ \
        x = (F)(((I)x & ~under) | ((I)lo & under));                                                  \
        const F t = x * 1.44269504f;                                                                 \
        const F big = (F){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */         \
        const F n = (t + big) - big;                                                                 \
        const F r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln 2 in two parts */             \
        F p = (F){0} + 1.0f / 5040;                                                                  \
        p = p * r + 1.0f / 720;                                                                      \
        p = p * r + 1.0f / 120;                                                                      \
        p = p * r + 1.0f / 24;                                                                       \
        p = p * r + 1.0f / 6;                                                                        \
        p = p * r + 0.5f;                                                                            \
        p = p * r + 1.0f;                                                                            \
        p = p * r + 1.0f;                                                                            \
        const I e = (__builtin_convertvector(n, I) + 127) << 23;                                     \
        return p * (F)e;                                                                             \
    }
PD_VEXP(vexp, v8f, v8i)
#ifdef __AVX512F__
PD_VEXP(vexp16, v16f, v16i) /* the same, sixteen lanes */
#endif

#endif
