/* int4 (and int8) products with the activations quantized to int8 (model.activation_quantization: int8), as
   llama.cpp multiplies its Q4_1 weights: each row of x is quantized on its own in blocks of 32 input
   values (one per weight group), qx = rint(x * 127 / max|x|), with the block's scale sx = max|x| / 127
   and ss = sx * sum qx. Within a group w = q * d + m, so

       sum over the group of w * (sx * qx) = (d * sx) * I + m * ss,   I = sum q * qx (exact, in int32),

   and y = the groups' terms added in group order, each as two float FMAs:
       acc = fma(d * sx, I, acc); acc = fma(m, ss, acc).
   That is the product of the dequantized weight with the *quantized* activations, rounded only where
   float arithmetic rounds the per-group terms. The integer sums are exact whatever their order, and
   the float steps are the same for every row whatever the rows around it (1 row, a batch, a
   speculative verify step, a thread's chunk of tiles), so a row's output depends on that row alone.

   Why: the float32 kernel (qgemm.c) dequantizes every weight to float and runs one FMA per weight
   and row; here 4-bit by 8-bit products run 32 a instruction (AVX2 vpmaddubsw: unsigned nibbles x
   signed activations, summed in pairs to int16; AVX-512 VNNI or AVX-VNNI vpdpbusd: four into int32),
   and the float work is two FMAs per group of 32.

   The weight stays in qgemm.c's int4 tile layout (nib[t][k/2][c]: value k of channel c in the low
   nibble, k+1 in the high; d, m [t][k/32][c] float16). A 32-byte load holds input values 4j..4j+3
   of the tile's 16 channels; the nibbles are rearranged in registers so that each 32-bit lane holds
   one channel's four consecutive values (the operand order vpdpbusd and vpmaddubsw + vpmaddwd
   want): channels 0-3 and 8-11 in one vector, 4-7 and 12-15 in the other. The activations' four
   bytes are then one broadcast. Past MRQ rows the rearranged weights of a run of groups go to an L1
   buffer once and every block of rows reads them.

   int8 weights (q[t][k][c] int8, one scale d per channel: w = q * d) take the same rows: per group
   acc = fma(sx, I, acc), and y = acc * d at the end. Both operands are signed there, so the weight's
   magnitude is the unsigned operand and its sign moves onto the activations (vpsignb) first.

   Variants by the build's flags (native.py): AVX2 (vpmaddubsw; int16 sums stay exact over a group:
   16 products of at most 15 * 127 each), AVX-512 VNNI with VL or AVX-VNNI (vpdpbusd on the same
   256-bit vectors), and portable C. All compute the same integers and the same float operations in
   the same order, so they agree bit for bit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "qgemm.h"

/* The prepared rows: q int8 [M][K], then sx [M][K/32] and ss [M][K/32] floats. */
static inline int8_t *rows_q(void *xq) { return (int8_t *)xq; }
static inline float *rows_sx(void *xq, int M, int K) { return (float *)((int8_t *)xq + (size_t)M * K); }
static inline float *rows_ss(void *xq, int M, int K) { return rows_sx(xq, M, K) + (size_t)M * (K / 32); }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_AVX2 1
#include <immintrin.h>
#endif

/* One block of 32 values: the reference the vector version below reproduces (rint rounds half to
   even, as vroundps does). |x * 127 / amax| <= 127 up to one rounding, so the clamp never bites on
   finite input; NaN becomes 0 instead of undefined. */
static void quantize_block_c(const float *x, int8_t *q, float *sx, float *ss) {
    float amax = 0.0f;
    for (int k = 0; k < 32; k++) {
        const float a = fabsf(x[k]);
        amax = a > amax ? a : amax;
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int k = 0; k < 32; k++) {
        float v = rintf(x[k] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v == v ? v : 0.0f;
        q[k] = (int8_t)v;
        sum += q[k];
    }
    *sx = amax / 127.0f;
    *ss = *sx * (float)sum;
}

#ifdef Q8_AVX2
static void quantize_block(const float *x, int8_t *q, float *sx, float *ss) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], a = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + 8 * j), a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[j]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    if (!(amax > 0.0f) || !(amax <= 3.4e38f)) {    /* zeros, NaN or inf: the reference's special cases */
        quantize_block_c(x, q, sx, ss);
        return;
    }
    const __m256 id = _mm256_set1_ps(127.0f / amax);
    __m256i i32[4];
    for (int j = 0; j < 4; j++)
        i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    /* packs interleave the lanes: 0-3 8-11 | 4-7 12-15 ... ; the permute restores the order */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *sx = amax / 127.0f;
    *ss = *sx * (float)_mm_cvtsi128_si32(s4);
}
#else
#define quantize_block quantize_block_c
#endif

/* x [M, K] (ldx apart) quantized for pd_qgemm_q8_tiles, where `bits` asks for it (PD_AQ8 with 4 or 8);
   else NULL and the other kernels run. */
void *pd_qgemm_q8_x(int bits, const float *x, int64_t ldx, int M, int K) {
    if ((bits != (4 | PD_AQ8) && bits != (8 | PD_AQ8)) || M <= 0) return NULL;
    void *xq = aligned_alloc(64, ((size_t)M * K + (size_t)M * (K / 32) * 8 + 63) / 64 * 64);
    if (xq == NULL) abort();
    int8_t *q = rows_q(xq);
    float *sx = rows_sx(xq, M, K), *ss = rows_ss(xq, M, K);
    const int G = K / 32;
    for (int i = 0; i < M; i++)
        for (int g = 0; g < G; g++)
            quantize_block(x + i * ldx + g * 32, q + (size_t)i * K + g * 32, sx + (size_t)i * G + g,
                           ss + (size_t)i * G + g);
    return xq;
}

void pd_qgemm_q8_free(void *xq) { free(xq); }

/* The rows' copy of the prepared activations as Python checks them: q [M][K] int8, sx and ss [M][K/32]. */
void pd_qgemm_q8_rows(const float *x, int64_t ldx, int M, int K, int8_t *q, float *sx, float *ss) {
    void *xq = pd_qgemm_q8_x(4 | PD_AQ8, x, ldx, M, K);
    if (xq == NULL) return;
    memcpy(q, rows_q(xq), (size_t)M * K);
    memcpy(sx, rows_sx(xq, M, K), sizeof(float) * M * (K / 32));
    memcpy(ss, rows_ss(xq, M, K), sizeof(float) * M * (K / 32));
    free(xq);
}

#ifdef Q8_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#define DPBUSD(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#elif defined(__AVXVNNI__)
#define Q8_VNNI 1
#define DPBUSD(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#endif

/* Rows a block: 8 integer accumulators, 2 weight vectors, a broadcast. 2, 3 and 4 measured within a
   few percent of each other at 8-32 rows (4 ahead), 5 and 6 slower (-DMRQ=n builds another). */
#ifndef MRQ
#define MRQ 4
#endif
#define QG 16    /* groups a buffered run: 16 x 512 bytes of rearranged weights, in L1 */

/* 32 bytes of a tile (input values 4j..4j+3 of its 16 channels as nibble pairs) into two vectors of
   one channel's four values per 32-bit lane: w0 channels 0-3 | 8-11, w1 4-7 | 12-15. */
static inline __attribute__((always_inline)) void widen(const uint8_t *p, __m256i *w0, __m256i *w1) {
    const __m256i mask = _mm256_set1_epi8(15);
    /* qwords 0 2 1 3: lane 0 = values 4j, 4j+1 of channels 0-7 then 4j+2, 4j+3 of channels 0-7 */
    const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)p), 0xd8);
    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
    *w0 = _mm256_unpacklo_epi16(a, b);
    *w1 = _mm256_unpackhi_epi16(a, b);
}

/* The int8 tile's input values 4j..4j+3 (four rows of 16 bytes) into the same lane order as widen's. */
static inline __attribute__((always_inline)) void widen8(const int8_t *p, __m256i *w0, __m256i *w1) {
    const __m256i a = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)p), 0xd8);
    const __m256i b = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(p + 32)), 0xd8);
    /* per lane: values 4j and 4j+1 (or 4j+2, 4j+3) of 8 channels, interleaved by byte */
    const __m256i ab = _mm256_unpacklo_epi8(a, _mm256_srli_si256(a, 8));
    const __m256i cd = _mm256_unpacklo_epi8(b, _mm256_srli_si256(b, 8));
    *w0 = _mm256_unpacklo_epi16(ab, cd);
    *w1 = _mm256_unpackhi_epi16(ab, cd);
}

/* Rows [mr] of a tile over groups [g0, g1): their partial outputs accumulate in y, in the vectors'
   channel order (restored by the caller at the tile's end). wb: the run's rearranged weights, or
   NULL to rearrange them here (few rows: each is used once). */
/* Groups ahead that the loops prefetch, as qgemm.c's direct rows do (a decode step's products are
   small and threads' chunks of tiles interleave, so the hardware prefetcher keeps restarting): a
   tile's groups follow each other and tiles follow each other, so past a tile's end this is the next
   tile's start. */
#define PF_GROUPS 8
static inline __attribute__((always_inline)) void prefetch_group(int bits, const void *wt, const void *d,
                                                                 const void *m, int64_t g) {
    if (bits == 4) {
        for (int b = 0; b < 16 * NC; b += 64) __builtin_prefetch((const char *)wt + g * 16 * NC + b, 0, 3);
        if ((g & 1) == 0)   /* two groups' float16 scales (or offsets) a line */
            __builtin_prefetch((const uint16_t *)d + g * NC, 0, 3), __builtin_prefetch((const uint16_t *)m + g * NC, 0, 3);
    } else {
        for (int b = 0; b < 32 * NC; b += 64) __builtin_prefetch((const char *)wt + g * 32 * NC + b, 0, 3);
    }
}

/* The vectors of weights a run of groups holds per four input values: int4 2 (the nibbles), int8 4
   (magnitudes and the signed values, for vpsignb). */
#define WV(bits) ((bits) == 4 ? 2 : 4)

/* The weights for input values 4j..4j+3 of group g, as vectors w[WV]. */
static inline __attribute__((always_inline)) void weights_at(int bits, const __m256i *wb, const void *wt, int g,
                                                             int g0, int j, __m256i *w) {
    if (wb) {
        for (int v = 0; v < WV(bits); v++) w[v] = _mm256_load_si256(wb + ((g - g0) * 8 + j) * WV(bits) + v);
    } else if (bits == 4) {
        widen((const uint8_t *)wt + ((int64_t)g * 8 + j) * 32, &w[0], &w[1]);
    } else {
        widen8((const int8_t *)wt + ((int64_t)g * 32 + 4 * j) * NC, &w[2], &w[3]);
        w[0] = _mm256_abs_epi8(w[2]), w[1] = _mm256_abs_epi8(w[3]);
    }
}

static inline __attribute__((always_inline)) void rows_q8(int bits, int mr, const __m256i *wb, const void *wt,
                                                          const uint16_t *d, const uint16_t *m, const int8_t *q,
                                                          const float *sx, const float *ss, int K, int g0, int g1,
                                                          float *y, int64_t ldy) {
    const int G = K / 32;
    for (int g = g0; g < g1; g++) {
        if (!wb) prefetch_group(bits, wt, d, m, g + PF_GROUPS);   /* the buffered runs prefetch as they fill */
        __m256i acc[MRQ][2];
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i w[4];
            weights_at(bits, wb, wt, g, g0, j, w);
            for (int r = 0; r < mr; r++) {
                int32_t four;
                memcpy(&four, q + (int64_t)r * K + g * 32 + 4 * j, 4);
                const __m256i xv = _mm256_set1_epi32(four);
                for (int h = 0; h < 2; h++) {
                    /* int8: |w| times x with w's sign (each pair at most 2 * 127 * 127, within int16) */
                    const __m256i xs = bits == 4 ? xv : _mm256_sign_epi8(xv, w[2 + h]);
#ifdef Q8_VNNI
                    acc[r][h] = DPBUSD(acc[r][h], w[h], xs);
#else
                    const __m256i p = _mm256_maddubs_epi16(w[h], xs);
                    acc[r][h] = bits == 4 ? _mm256_add_epi16(acc[r][h], p)
                                          : _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
                }
            }
        }
        if (bits == 8) {   /* the channel's scale comes at the end (tile_q8) */
            for (int r = 0; r < mr; r++) {
                const __m256 s = _mm256_set1_ps(sx[r * G + g]);
                for (int h = 0; h < 2; h++) {
                    float *o = y + r * ldy + 8 * h;
                    const __m256 a = g ? _mm256_loadu_ps(o) : _mm256_setzero_ps();
                    _mm256_storeu_ps(o, _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(acc[r][h]), a));
                }
            }
            continue;
        }
        const __m256 dl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g * NC)));
        const __m256 dh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g * NC + 8)));
        const __m256 ml = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g * NC)));
        const __m256 mh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g * NC + 8)));
        const __m256 dv[2] = {_mm256_permute2f128_ps(dl, dh, 0x20), _mm256_permute2f128_ps(dl, dh, 0x31)};
        const __m256 mv[2] = {_mm256_permute2f128_ps(ml, mh, 0x20), _mm256_permute2f128_ps(ml, mh, 0x31)};
        for (int r = 0; r < mr; r++) {
            const __m256 s = _mm256_set1_ps(sx[r * G + g]), z = _mm256_set1_ps(ss[r * G + g]);
            for (int h = 0; h < 2; h++) {
#ifdef Q8_VNNI
                const __m256 f = _mm256_cvtepi32_ps(acc[r][h]);
#else
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][h], _mm256_set1_epi16(1)));
#endif
                float *o = y + r * ldy + 8 * h;
                __m256 a = g ? _mm256_loadu_ps(o) : _mm256_setzero_ps();
                a = _mm256_fmadd_ps(_mm256_mul_ps(dv[h], s), f, a);
                a = _mm256_fmadd_ps(mv[h], z, a);
                _mm256_storeu_ps(o, a);
            }
        }
    }
}

/* One tile (bits 4: wt the nibbles, d and m float16 [G][16]; bits 8: wt the bytes, d float [16]). */
static inline __attribute__((always_inline)) void tile_bits(int bits, const void *wt, const void *d, const void *m,
                                                            const int8_t *q, const float *sx, const float *ss, int M,
                                                            int K, float *y, int64_t ldy) {
    const int G = K / 32, qg = bits == 4 ? QG : QG / 2;   /* 8 KB of buffered vectors either way */
    __m256i wb[QG * 16] __attribute__((aligned(64)));
    for (int g0 = 0; g0 < G; g0 += qg) {
        const int g1 = g0 + qg < G ? g0 + qg : G;
        const __m256i *buf = NULL;
        if (M > MRQ) {
            for (int g = g0; g < g1; g++) {
                prefetch_group(bits, wt, d, m, g + PF_GROUPS);
                for (int j = 0; j < 8; j++) weights_at(bits, NULL, wt, g, g0, j, &wb[((g - g0) * 8 + j) * WV(bits)]);
            }
            buf = wb;
        }
        int i = 0;
        for (; i + MRQ <= M; i += MRQ)
            rows_q8(bits, MRQ, buf, wt, d, m, q + (int64_t)i * K, sx + i * G, ss + i * G, K, g0, g1, y + i * ldy, ldy);
        const int8_t *qi = q + (int64_t)i * K;
        const float *sxi = sx + i * G, *ssi = ss + i * G;
        float *yi = y + i * ldy;
        switch (M - i) {   /* constant row counts, so each call unrolls */
#if MRQ > 7
            case 7: rows_q8(bits, 7, buf, wt, d, m, qi, sxi, ssi, K, g0, g1, yi, ldy); break;
#endif
#if MRQ > 6
            case 6: rows_q8(bits, 6, buf, wt, d, m, qi, sxi, ssi, K, g0, g1, yi, ldy); break;
#endif
#if MRQ > 5
            case 5: rows_q8(bits, 5, buf, wt, d, m, qi, sxi, ssi, K, g0, g1, yi, ldy); break;
#endif
#if MRQ > 4
            case 4: rows_q8(bits, 4, buf, wt, d, m, qi, sxi, ssi, K, g0, g1, yi, ldy); break;
#endif
#if MRQ > 3
            case 3: rows_q8(bits, 3, buf, wt, d, m, qi, sxi, ssi, K, g0, g1, yi, ldy); break;
#endif
            case 2: rows_q8(bits, 2, buf, wt, d, m, qi, sxi, ssi, K, g0, g1, yi, ldy); break;
            case 1: rows_q8(bits, 1, buf, wt, d, m, qi, sxi, ssi, K, g0, g1, yi, ldy); break;
            default: break;
        }
    }
    for (int i = 0; i < M; i++) {   /* the vectors' channel order (0-3 8-11 | 4-7 12-15) back to 0-15 */
        float *o = y + i * ldy;
        __m256 a = _mm256_loadu_ps(o), b = _mm256_loadu_ps(o + 8);
        __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
        if (bits == 8) lo = _mm256_mul_ps(lo, _mm256_loadu_ps((const float *)d)), hi = _mm256_mul_ps(hi, _mm256_loadu_ps((const float *)d + 8));
        _mm256_storeu_ps(o, lo);
        _mm256_storeu_ps(o + 8, hi);
    }
}

static void tile_q4(const void *wt, const void *d, const void *m, const int8_t *q, const float *sx, const float *ss,
                    int M, int K, float *y, int64_t ldy) {
    tile_bits(4, wt, d, m, q, sx, ss, M, K, y, ldy);
}
static void tile_q8(const void *wt, const void *d, const int8_t *q, const float *sx, int M, int K, float *y,
                    int64_t ldy) {
    tile_bits(8, wt, d, NULL, q, sx, NULL, M, K, y, ldy);
}
#else
static float half_to_float(uint16_t h) {  /* IEEE binary16 -> float, subnormals included */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, f = h & 1023;
    union { uint32_t u; float f; } v;
    if (e == 31) v.u = sign | 0x7f800000u | (f << 13);
    else if (e) v.u = sign | ((e + 112) << 23) | (f << 13);
    else { v.f = (float)f * (1.0f / 16777216.0f); v.u |= sign; }
    return v.f;
}

static void tile_q8(const void *wt, const void *d, const int8_t *q, const float *sx, int M, int K, float *y,
                    int64_t ldy) {
    const int G = K / 32;
    const int8_t *w = wt;
    for (int i = 0; i < M; i++)
        for (int c = 0; c < NC; c++) {
            float acc = 0.0f;
            for (int g = 0; g < G; g++) {
                int32_t I = 0;
                for (int k = g * 32; k < g * 32 + 32; k++) I += w[(int64_t)k * NC + c] * q[(int64_t)i * K + k];
                acc = fmaf(sx[i * G + g], (float)I, acc);
            }
            y[i * ldy + c] = acc * ((const float *)d)[c];
        }
}

static void tile_q4(const void *wt, const void *dv, const void *mv, const int8_t *q, const float *sx, const float *ss,
                    int M, int K, float *y, int64_t ldy) {
    const int G = K / 32;
    const uint8_t *nib = wt;
    const uint16_t *d = dv, *m = mv;
    for (int i = 0; i < M; i++)
        for (int c = 0; c < NC; c++) {
            float acc = 0.0f;
            for (int g = 0; g < G; g++) {
                int32_t I = 0;
                for (int kp = 0; kp < 16; kp++) {
                    const uint8_t b = nib[((int64_t)g * 16 + kp) * NC + c];
                    I += (b & 15) * q[(int64_t)i * K + g * 32 + 2 * kp] + (b >> 4) * q[(int64_t)i * K + g * 32 + 2 * kp + 1];
                }
                const float dd = half_to_float(d[g * NC + c]) * sx[i * G + g];
                acc = fmaf(dd, (float)I, acc);
                acc = fmaf(half_to_float(m[g * NC + c]), ss[i * G + g], acc);
            }
            y[i * ldy + c] = acc;
        }
}
#endif

/* Output tiles [t0, t1) of the product of an int4 or int8 weight (qgemm.c's layouts) with rows prepared by
   pd_qgemm_q8_x. A tile's result does not depend on which thread computes it or with which others. */
void pd_qgemm_q8_tiles(int bits, const void *w, const void *d, const void *m, const void *xq, float *y,
                       int64_t ldy, int M, int K, int t0, int t1) {
    void *x = (void *)xq;
    const int8_t *q = rows_q(x);
    const float *sx = rows_sx(x, M, K), *ss = rows_ss(x, M, K);
#ifdef Q8_AVX2
    for (int g = 0; t0 < t1 && g < PF_GROUPS && g < K / 32; g++) {   /* a chunk's first groups */
        if ((bits & ~PD_AQ8) == 8)
            prefetch_group(8, (const int8_t *)w + (int64_t)t0 * K * NC, d, m, g);
        else
            prefetch_group(4, (const uint8_t *)w + (int64_t)t0 * (K / 2) * NC,
                           (const uint16_t *)d + (int64_t)t0 * (K / 32) * NC,
                           (const uint16_t *)m + (int64_t)t0 * (K / 32) * NC, g);
    }
#endif
    for (int t = t0; t < t1; t++)
        if ((bits & ~PD_AQ8) == 8)
            tile_q8((const int8_t *)w + (int64_t)t * K * NC, (const float *)d + t * NC, q, sx, M, K, y + t * NC, ldy);
        else
            tile_q4((const uint8_t *)w + (int64_t)t * (K / 2) * NC, (const uint16_t *)d + (int64_t)t * (K / 32) * NC,
                    (const uint16_t *)m + (int64_t)t * (K / 32) * NC, q, sx, ss, M, K, y + t * NC, ldy);
}

/* Which variant this build runs (tests and benchmarks print it). */
int pd_qgemm_q8_variant(void) {
#if defined(Q8_VNNI)
    return 2;
#elif defined(Q8_AVX2)
    return 1;
#else
    return 0;
#endif
}
