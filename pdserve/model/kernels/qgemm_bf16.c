/* int4 and int8 products on bfloat16 pairs (AVX512-BF16), split from qgemm.c: the tile is dequantized
   there (pd_dequant_tile), rounded to pairs here and multiplied with vdpbf16ps. Without AVX512-BF16
   every entry point says no (NULL rows), and the float32 kernel runs. */
#include <stdint.h>
#include "qgemm.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#include <stdlib.h>
/* Quantized weights from BF16_ROWS rows on (a prefill), on a CPU with AVX512-BF16: the activations
   and the dequantized tile are rounded to bfloat16 and multiplied in pairs (vdpbf16ps: 32 products
   into float32 sums per instruction, twice the float32 FMA's), where the float32 kernel sits at the
   cores' FMA peak. Weights quantized to 4 or 8 bits lose far more than bfloat16's 8-bit mantissa does
   to either operand; float32 weights keep the float32 kernel. A decode step of 32 or more rows
   takes it too (layer.c's products and the head): it was GEMM-bound the same way (int4, 32 rows:
   the layers' products ~35 of a 65 ms step), and quant_quality's agreement is measured through
   this path (it scores whole sequences, a prefill). Fewer rows keep float32 activations. */
#define BF16_ROWS 32
#define MRB 12

/* The f32 block buf [kn][16] as bf16 pairs along k: wb[p][c] = bf16(w[2p][c]) | bf16(w[2p + 1][c]) << 16. */
static void bf16_pairs(const float *buf, int kn, uint32_t *wb) {
    for (int p = 0; p < kn / 2; p++) {
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(buf + 2 * p * NC)));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(buf + (2 * p + 1) * NC)));
        _mm512_store_si512((void *)(wb + p * NC), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

/* rows xb [mr, 2 np] of bf16 (ldb apart) times wb [np][16] pairs into y [mr, 16], added unless first. */
static inline __attribute__((always_inline)) void micro_bf16(int mr, const uint16_t *xb, int64_t ldb,
                                                             const uint32_t *wb, int np, float *y, int64_t ldy,
                                                             int first) {
    __m512 acc[MRB];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
        const __m512bh w = (__m512bh)_mm512_load_si512((const void *)(wb + p * NC));
        for (int i = 0; i < mr; i++) {
            const int32_t pair = *(const int32_t *)(xb + i * ldb + 2 * p);
            acc[i] = _mm512_dpbf16_ps(acc[i], w, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    for (int i = 0; i < mr; i++) {
        float *o = y + i * ldy;
        _mm512_storeu_ps(o, first ? acc[i] : _mm512_add_ps(_mm512_loadu_ps(o), acc[i]));
    }
}

static void rows_bf16(int M, const uint16_t *xb, int64_t ldb, const uint32_t *wb, int np, float *y, int64_t ldy,
                      int first) {
    int i = 0;
    for (; i + MRB <= M; i += MRB) micro_bf16(MRB, xb + i * ldb, ldb, wb, np, y + i * ldy, ldy, first);
    xb += i * ldb, y += i * ldy;
#define TAIL(r) case r: micro_bf16(r, xb, ldb, wb, np, y, ldy, first); break;
    switch (M - i) {
        TAIL(11) TAIL(10) TAIL(9) TAIL(8) TAIL(7) TAIL(6) TAIL(5) TAIL(4) TAIL(3) TAIL(2) TAIL(1)
        default: break;
    }
#undef TAIL
}

static void tile_bf16(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y,
                      int64_t ldy, int M, int K, int t) {
    float buf[KB * NC] __attribute__((aligned(64)));
    uint32_t wb[KB / 2 * NC] __attribute__((aligned(64)));
    for (int k0 = 0; k0 < K; k0 += KB) {
        const int k1 = k0 + KB < K ? k0 + KB : K;
        pd_dequant_tile(bits, w, d, m, K, t, k0, k1, buf);
        bf16_pairs(buf, k1 - k0, wb);
        rows_bf16(M, xb + k0, K, wb, (k1 - k0) / 2, y + t * NC, ldy, k0 == 0);
    }
}

/* The entry points (qgemm.h): pd_qgemm and layer.c's products, which hand out tiles themselves.
   x [M, K] as bf16 [M, K] (round to nearest even), or NULL where the float32 kernel runs. */
uint16_t *pd_qgemm_bf16_x(int bits, const float *x, int64_t ldx, int M, int K) {
    if (bits == 32 || M < BF16_ROWS) return NULL;
    uint16_t *xb = aligned_alloc(64, ((size_t)M * K * 2 + 63) / 64 * 64);
    if (xb == NULL) return NULL;
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(xb + (int64_t)i * K + k),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i * ldx + k)));
    return xb;
}

void pd_qgemm_bf16_free(uint16_t *xb) { free(xb); }
void pd_qgemm_bf16_tiles(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y,
                         int64_t ldy, int M, int K, int t0, int t1) {
    for (int t = t0; t < t1; t++) tile_bf16(bits, w, d, m, xb, y, ldy, M, K, t);
}
#else
uint16_t *pd_qgemm_bf16_x(int bits, const float *x, int64_t ldx, int M, int K) {
    (void)bits, (void)x, (void)ldx, (void)M, (void)K;
    return 0;
}
void pd_qgemm_bf16_free(uint16_t *xb) { (void)xb; }
void pd_qgemm_bf16_tiles(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y,
                         int64_t ldy, int M, int K, int t0, int t1) {
    (void)bits, (void)w, (void)d, (void)m, (void)xb, (void)y, (void)ldy, (void)M, (void)K, (void)t0, (void)t1;
}
#endif

/* From how many rows int4/int8 products round their operands to bfloat16 here (0: never). */
int pd_qgemm_bf16_rows(void) {
#ifdef __AVX512BF16__
    return BF16_ROWS;
#else
    return 0;
#endif
}
