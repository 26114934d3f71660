/* int4 and int8 products on bfloat16 pairs (AVX512-BF16), split from qgemm.c. int8, and int4 below 32
   rows, widen their stored integers straight to pairs (exact); int4 from 32 rows dequantizes the tile
   there (pd_dequant_tile) and rounds it to pairs here. All multiply with vdpbf16ps, or with Intel
   AMX's tiles where the kernel grants them, from kernels/tuning.py's measured row counts (int4's exact
   tiles from a few rows, its rounded tile from more; int8's from a few). Products of up to
   pd_qgemm_invariant's rows (model.batch_invariant) take the exact paths from 1 row: int4's exact
   tiles or pairs, int8's tiles or pairs. Without AVX512-BF16 every entry point says no (NULL rows),
   and the float32 kernel runs. */
#include <stdint.h>
#include "qgemm.h"
#include "vec.h"   /* pd_to_bf16 */

#ifdef __AVX512BF16__
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
/* int4 from BF16_ROWS rows on (a prefill; unless measured otherwise: pairs_rounded4 below), on a CPU with AVX512-BF16: the activations and the
   dequantized tile are rounded to bfloat16 and multiplied in pairs (vdpbf16ps: 32 products into
   float32 sums per instruction, twice the float32 FMA's), where the float32 kernel sits at the
   cores' FMA peak. Weights quantized to 4 or 8 bits lose far more than bfloat16's 8-bit mantissa does
   to either operand; float32 weights keep the float32 kernel. A decode step of 32 or more rows
   takes it too (layer.c's products): it is GEMM-bound the same way (at 32 rows the layers' products
   are most of the step), and quant_quality's agreement is measured through this path (it
   scores whole sequences, a prefill). Up to 8 rows keep float32 activations (qgemm.c). */
#define BF16_ROWS 32
#define MRB 12
/* int4 from 9 to 31 rows (past qgemm.c's register rows, DIRECT_ROWS; a decode step of 9-31 streams):
   its nibbles are small integers, exact in bfloat16, so the pairs hold q itself and the group's scale
   and offset stay float32 (sum x * w = d * sum x * q + m * sum x, as in qgemm.c's direct4). Only the
   activations are rounded, and sum x is of the rounded x too, so their rounding meets the centred w,
   not q in 0..15 (relative error of a 960 x 960 product: 1.7e-3, against 2.4e-3 with the weight
   rounded as well). A nibble pair widens straight into a bfloat16 pair (vpermw over a table of 0..15):
   no float32 tile between. On a Zen 4 it beat the float32 kernel from 9 rows; from 32 rows it ran no
   faster than the rounded tile below and slower on long prefills (two FMAs a row per group of 32 to scale
   the sums), so those keep the tile (figures: docs/benchmarks.md). Other cores differ: the rounded
   tile's start is measured at first load (pairs_rounded4 below). */
#if defined(__AVX512BW__)
#define BF16_ROWS4 9
#else
#define BF16_ROWS4 BF16_ROWS
#endif
/* int8 from 9 rows, all of them: its values are integers in -127..127, exact in bfloat16 too, and
   with one scale per channel the pairs' sums need only scaling at the end (tile_q8): less work than
   the rounded tile at any row count, and only the activations are rounded. */
#define BF16_ROWS8 9

/* A row count the tuning sets, clamped to [lo, hi]; returned as stored. */
static int set_rows(int *slot, int rows, int lo, int hi) {  /* below 0: only returns the value */
    if (rows < 0) return __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    rows = rows < lo ? lo : rows > hi ? hi : rows;
    __atomic_store_n(slot, rows, __ATOMIC_RELEASE);
    return rows;
}

/* From how many rows int4 on the vector pairs takes the rounded tile instead of the exact pairs:
   BF16_ROWS unless kernels/tuning.py measured otherwise on this machine (where it wins depends on the
   core's vdpbf16ps rate against its FMAs'). AMX's tiles, where they run, have their own (below). */
#define PAIRS_ROUNDED_MAX 64
static int pairs_rounded4 = BF16_ROWS;

static int pairs_rounded_rows(void) { return __atomic_load_n(&pairs_rounded4, __ATOMIC_ACQUIRE); }
int pd_qgemm_pairs_rounded_from(int rows) { return set_rows(&pairs_rounded4, rows, BF16_ROWS4, PAIRS_ROUNDED_MAX); }

/* vpermw's index that interleaves vcvtne2ps2bf16's halves (lo's 16 values in words 0-15, hi's in 16-31)
   into pairs: word 2c = lo's c, word 2c + 1 = hi's c. */
static inline __m512i pair_index(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                            19, 3, 18, 2, 17, 1, 16, 0);
}

/* Two float vectors rounded to one vector of bfloat16 pairs: lane c = bf16(lo[c]) | bf16(hi[c]) << 16
   (one rounding instruction and one permute, where rounding each and widening took six). */
static inline __m512i round_pairs(__m512 lo, __m512 hi, __m512i index) {
    return _mm512_permutexvar_epi16(index, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* The f32 block buf [kn][16] as bf16 pairs along k: wb[p][c] = bf16(w[2p][c]) | bf16(w[2p + 1][c]) << 16. */
static void bf16_pairs(const float *buf, int kn, uint32_t *wb) {
    const __m512i index = pair_index();
    for (int p = 0; p < kn / 2; p++)
        _mm512_store_si512((void *)(wb + p * NC),
                           round_pairs(_mm512_load_ps(buf + 2 * p * NC), _mm512_load_ps(buf + (2 * p + 1) * NC), index));
}

/* acc[i] = the sums of rows xb [mr] (ldb apart) times pairs [p0, p1) of wb [][16]. */
static inline __attribute__((always_inline)) void dot_pairs(int mr, const uint16_t *xb, int64_t ldb,
                                                            const uint32_t *wb, int p0, int p1, __m512 *acc) {
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int p = p0; p < p1; p++) {
        const __m512bh w = (__m512bh)_mm512_load_si512((const void *)(wb + p * NC));
        for (int i = 0; i < mr; i++) {
            const int32_t pair = *(const int32_t *)(xb + i * ldb + 2 * p);
            acc[i] = _mm512_dpbf16_ps(acc[i], w, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
}

/* rows xb [mr, 2 np] of bf16 (ldb apart) times wb [np][16] pairs into y [mr, 16], added unless first. */
static inline __attribute__((always_inline)) void micro_bf16(int mr, const uint16_t *xb, int64_t ldb,
                                                             const uint32_t *wb, int np, float *y, int64_t ldy,
                                                             int first) {
    __m512 acc[MRB];
    dot_pairs(mr, xb, ldb, wb, 0, np, acc);
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

/* int8 rows 2p and 2p + 1 of a tile (q[k][16]) as bfloat16 pairs, exactly (an integer's float has
   its low 16 bits zero): lane c = bf16(q[2p][c]) | bf16(q[2p + 1][c]) << 16. */
static void q8_pairs(const int8_t *q, int kn, uint32_t *wb) {
    for (int p = 0; p < kn / 2; p++) {
        const __m512i lo = _mm512_castps_si512(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 2 * p * NC)))));
        const __m512i hi = _mm512_castps_si512(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + (2 * p + 1) * NC)))));
        _mm512_store_si512((void *)(wb + p * NC), _mm512_or_si512(_mm512_srli_epi32(lo, 16),
                                                                   _mm512_and_si512(hi, _mm512_set1_epi32((int)0xFFFF0000u))));
    }
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

/* Several tiles at once: a block of MR2 rows by NT2 tiles (24 accumulators) loads NT2 weight vectors
   and MR2 broadcasts for 24 vdpbf16ps, where one tile a call (micro_bf16) loads one broadcast for each
   (and a weight vector for every 12): on a Zen 5 the single-tile loop sat at three quarters of
   oneDNN's bfloat16 rate in a prefill. Each (row, channel) sums the same pairs in the same order as
   micro_bf16 (a block of KB from zero, then added to y), so the results are the same bits. */
#define MR2 6
#define NT2 4
static inline __attribute__((always_inline)) void micro_nt(int mr, int nt, const uint16_t *xb, int64_t ldb,
                                                           const uint32_t *wb, int np, float *y, int64_t ldy,
                                                           int first) {
    __m512 acc[MR2][NT2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
        __m512bh wv[NT2];
        for (int j = 0; j < nt; j++) wv[j] = (__m512bh)_mm512_load_si512((const void *)(wb + (j * KB / 2 + p) * NC));
        for (int i = 0; i < mr; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(xb + i * ldb + 2 * p));
            for (int j = 0; j < nt; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) {
            float *o = y + i * ldy + j * NC;
            _mm512_storeu_ps(o, first ? acc[i][j] : _mm512_add_ps(_mm512_loadu_ps(o), acc[i][j]));
        }
}

static void rows_nt(int nt, int M, const uint16_t *xb, int64_t ldb, const uint32_t *wb, int np, float *y,
                    int64_t ldy, int first) {
    int i = 0;
#define NT_CASE(n) case n: \
        for (; i + MR2 <= M; i += MR2) micro_nt(MR2, n, xb + i * ldb, ldb, wb, np, y + i * ldy, ldy, first); \
        switch (M - i) { \
            case 5: micro_nt(5, n, xb + i * ldb, ldb, wb, np, y + i * ldy, ldy, first); break; \
            case 4: micro_nt(4, n, xb + i * ldb, ldb, wb, np, y + i * ldy, ldy, first); break; \
            case 3: micro_nt(3, n, xb + i * ldb, ldb, wb, np, y + i * ldy, ldy, first); break; \
            case 2: micro_nt(2, n, xb + i * ldb, ldb, wb, np, y + i * ldy, ldy, first); break; \
            case 1: micro_nt(1, n, xb + i * ldb, ldb, wb, np, y + i * ldy, ldy, first); break; \
            default: break; \
        } \
        break;
    switch (nt) {
        NT_CASE(4) NT_CASE(3) NT_CASE(2)
        default: break;
    }
#undef NT_CASE
}

/* Tiles [t, t + nt) (2 <= nt <= NT2) of an int4 weight on the rounded tile (bits 4), or of an int8
   weight on its exact pairs (bits 8, each channel's scale once at the end): tile_bf16 and tile_q8,
   side by side. */
static void tiles_nt(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y,
                     int64_t ldy, int M, int K, int t, int nt) {
    float buf[KB * NC] __attribute__((aligned(64)));
    uint32_t wb[NT2 * KB / 2 * NC] __attribute__((aligned(64)));
    float *yt = y + t * NC;
    for (int k0 = 0; k0 < K; k0 += KB) {
        const int k1 = k0 + KB < K ? k0 + KB : K;
        for (int j = 0; j < nt; j++) {
            if (bits == 8) {
                q8_pairs((const int8_t *)w + (int64_t)(t + j) * K * NC + (int64_t)k0 * NC, k1 - k0, wb + j * KB / 2 * NC);
            } else {
                pd_dequant_tile(bits, w, d, m, K, t + j, k0, k1, buf);
                bf16_pairs(buf, k1 - k0, wb + j * KB / 2 * NC);
            }
        }
        /* Each tile's next block on its way while this block's rows run (the last block's: the tiles
           after these, for the next call). */
        for (int j = 0; j < nt; j++) {
            const int64_t tj = t + j + (k1 < K ? 0 : nt), kn = k1 < K ? k1 : 0;
            if (bits == 8) {
                const int8_t *q = (const int8_t *)w + tj * K * NC + kn * NC;
                for (int b = 0; b < KB * NC; b += 64) __builtin_prefetch(q + b, 0, 3);
            } else {
                const uint8_t *nib = (const uint8_t *)w + tj * (K / 2) * NC + kn / 2 * NC;
                const uint16_t *td = (const uint16_t *)d + tj * (K / 32) * NC + kn / 32 * NC;
                const uint16_t *tm = (const uint16_t *)m + tj * (K / 32) * NC + kn / 32 * NC;
                for (int b = 0; b < KB / 2 * NC; b += 64) __builtin_prefetch(nib + b, 0, 3);
                for (int b = 0; b < KB / 32 * NC; b += 32) __builtin_prefetch(td + b, 0, 3), __builtin_prefetch(tm + b, 0, 3);
            }
        }
        rows_nt(nt, M, xb + k0, K, wb, (k1 - k0) / 2, yt, ldy, k0 == 0);
    }
    if (bits == 8)
        for (int j = 0; j < nt; j++) {
            const __m512 dc = _mm512_loadu_ps((const float *)d + (t + j) * NC);
            for (int i = 0; i < M; i++)
                _mm512_storeu_ps(yt + i * ldy + j * NC, _mm512_mul_ps(_mm512_loadu_ps(yt + i * ldy + j * NC), dc));
        }
}

#if defined(__AVX512BW__)
/* vpermw's table: word i = bf16(i & 15) (it reads an index's low 5 bits; q4_pair leaves bit 4 set). */
static inline __m512i q4_table(void) {
    const __m512 v = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
}

/* The 16 bytes of a tile row pair (value 2p of channel c in the low nibble of byte c, 2p + 1 in the
   high one) as bfloat16 pairs: lane c = bf16(lo) | bf16(hi) << 16. With byte c widened to lane c,
   v | v << 12 has the low nibble (and the high one's lowest bit) in the low word's 5 index bits and
   the high nibble alone in the high word's: one table lookup gives both. */
static inline __m512i q4_pair(const uint8_t *b, __m512i table) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    return _mm512_permutexvar_epi16(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), table);
}

/* rows xb [mr, 32 ng] (ldb apart) times the block's pairs wb [16 ng][16] into y [mr, 16], added unless
   first; per group g: y += d_g * (sum x * q) + m_g * sx[g] (sx: the rows' float32 sums per group,
   lds apart). The rows' outputs stay in registers over the block's groups. */
static inline __attribute__((always_inline)) void micro_q4(int mr, const uint16_t *xb, int64_t ldb,
                                                           const float *sx, int64_t lds, const uint32_t *wb,
                                                           const float *dg, const float *mg, int ng, float *y,
                                                           int64_t ldy, int first) {
    __m512 out[MRB];
    for (int i = 0; i < mr; i++) out[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * ldy);
    for (int g = 0; g < ng; g++) {
        __m512 acc[MRB];
        dot_pairs(mr, xb, ldb, wb, g * 16, g * 16 + 16, acc);
        const __m512 d = _mm512_load_ps(dg + g * NC), m = _mm512_load_ps(mg + g * NC);
        for (int i = 0; i < mr; i++)
            out[i] = _mm512_fmadd_ps(acc[i], d, _mm512_fmadd_ps(_mm512_set1_ps(sx[i * lds + g]), m, out[i]));
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(y + i * ldy, out[i]);
}

static void rows_q4(int M, const uint16_t *xb, int64_t ldb, const float *sx, int64_t lds, const uint32_t *wb,
                    const float *dg, const float *mg, int ng, float *y, int64_t ldy, int first) {
    int i = 0;
    for (; i + MRB <= M; i += MRB)
        micro_q4(MRB, xb + i * ldb, ldb, sx + i * lds, lds, wb, dg, mg, ng, y + i * ldy, ldy, first);
    xb += i * ldb, sx += i * lds, y += i * ldy;
#define TAIL(r) case r: micro_q4(r, xb, ldb, sx, lds, wb, dg, mg, ng, y, ldy, first); break;
    switch (M - i) {
        TAIL(11) TAIL(10) TAIL(9) TAIL(8) TAIL(7) TAIL(6) TAIL(5) TAIL(4) TAIL(3) TAIL(2) TAIL(1)
        default: break;
    }
#undef TAIL
}

/* Tile t of an int4 weight: each block of KB input values widened to pairs once (8 KB, in L1), its
   groups' scales and offsets to float32, then every row through it. */
static void tile_q4(const void *w, const void *d, const void *m, const uint16_t *xb, const float *sx, float *y,
                    int64_t ldy, int M, int K, int t) {
    const uint8_t *nib = (const uint8_t *)w + (int64_t)t * (K / 2) * NC;
    const uint16_t *td = (const uint16_t *)d + (int64_t)t * (K / 32) * NC, *tm = (const uint16_t *)m + (int64_t)t * (K / 32) * NC;
    uint32_t wb[KB / 2 * NC] __attribute__((aligned(64)));
    float dg[KB / 32 * NC] __attribute__((aligned(64))), mg[KB / 32 * NC] __attribute__((aligned(64)));
    const __m512i table = q4_table();
    for (int k0 = 0; k0 < K; k0 += KB) {
        const int k1 = k0 + KB < K ? k0 + KB : K, ng = (k1 - k0) / 32;
        for (int p = 0; p < (k1 - k0) / 2; p++)
            _mm512_store_si512((void *)(wb + p * NC), q4_pair(nib + (int64_t)(k0 / 2 + p) * NC, table));
        for (int g = 0; g < ng; g++) {
            _mm512_store_ps(dg + g * NC, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(td + (k0 / 32 + g) * NC))));
            _mm512_store_ps(mg + g * NC, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tm + (k0 / 32 + g) * NC))));
        }
        /* The next block's nibbles and scales on their way while this block's rows run (past the tile's
           end: the next tile's start, as qgemm.c's direct4 does). */
        for (int b = 0; b < KB / 2 * NC; b += 64) __builtin_prefetch(nib + (int64_t)(k1 / 2) * NC + b, 0, 3);
        for (int b = 0; b < KB / 32 * NC; b += 32)
            __builtin_prefetch(td + (k1 / 32) * NC + b, 0, 3), __builtin_prefetch(tm + (k1 / 32) * NC + b, 0, 3);
        rows_q4(M, xb + k0, K, sx + k0 / 32, K / 32, wb, dg, mg, ng, y + t * NC, ldy, k0 == 0);
    }
}
#endif

/* Tile t of an int8 weight: sum x * q over all of K on pairs, then each channel's scale once. */
static void tile_q8(const void *w, const void *d, const uint16_t *xb, float *y, int64_t ldy, int M, int K, int t) {
    const int8_t *q = (const int8_t *)w + (int64_t)t * K * NC;
    uint32_t wb[KB / 2 * NC] __attribute__((aligned(64)));
    float *yt = y + t * NC;
    for (int k0 = 0; k0 < K; k0 += KB) {
        const int k1 = k0 + KB < K ? k0 + KB : K;
        q8_pairs(q + (int64_t)k0 * NC, k1 - k0, wb);
        rows_bf16(M, xb + k0, K, wb, (k1 - k0) / 2, yt, ldy, k0 == 0);
    }
    const __m512 dc = _mm512_loadu_ps((const float *)d + t * NC);
    for (int i = 0; i < M; i++) _mm512_storeu_ps(yt + i * ldy, _mm512_mul_ps(_mm512_loadu_ps(yt + i * ldy), dc));
}

/* Rows of the bf16 copy (pd_qgemm_bf16_x): int4 past 16 rows in whole tiles of 16 (AMX's exact tiles
   load and store them so; the padding is zero). */
static int padded_rows(int bits, int M) { return bits == 4 && M > 16 ? (M + 15) / 16 * 16 : M; }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* Intel AMX (where the CPU has it and the kernel grants it): the same bfloat16 pairs as above, 16 rows
   by 16 channels by 32 input values an instruction (tdpbf16ps) into float32 sums held in a tile
   register, where vdpbf16ps does 16 channels by 2 values. The tile's pairs for all of K are laid out
   once per output tile, exactly as the rows above read them ([K/2][16]: a B tile's rows), and each
   block of rows runs over all of K in registers. A row's sums do not depend on its block or on M
   (the last rows take tiles of fewer rows), so a row's result is its own here too; the sums' order
   differs from vdpbf16ps's, so the two agree to rounding, not bit for bit. */
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused, -2: turned off (pd_qgemm_amx) */

/* Linux hands out the tile registers per process on request: asked before any tile is used (from
   pd_qgemm_bf16_x, on the thread that prepares a product). */
static int amx_request(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

int pd_qgemm_amx(int want) {
    if (!want) __atomic_store_n(&amx_state, -2, __ATOMIC_RELEASE);
    else if (__atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) == -2) __atomic_store_n(&amx_state, 0, __ATOMIC_RELEASE);
    return want ? amx_request() : 0;
}

static int amx_granted(void) { return __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) > 0; }

/* From how many rows int4 products below the rounded tile take amx_q4_exact (fewer: qgemm.c's float32
   kernel): BF16_ROWS4 unless measured otherwise (kernels/tuning.py; a tile's latency is the same for 1
   row as for 16, so where it beats the float32 kernel's FMAs depends on the core). */
static int amx_exact_from = BF16_ROWS4;

int pd_qgemm_amx_exact_from(int rows) { return set_rows(&amx_exact_from, rows, 1, BF16_ROWS4); }

static int amx_exact_rows(void) {
#if defined(__AVX512BW__)
    return amx_granted() ? __atomic_load_n(&amx_exact_from, __ATOMIC_ACQUIRE) : 0;
#else
    return 0;
#endif
}

/* From how many rows int4 products take the tiles (the rounded tile): from BF16_ROWS unless measured
   otherwise (kernels/tuning.py: below it the exact tiles with float32 group scales run). */
static int amx_from4 = BF16_ROWS;

int pd_qgemm_amx_from(int rows) { return set_rows(&amx_from4, rows, BF16_ROWS4, BF16_ROWS); }

/* From how many rows int8 products take the tiles (fewer: qgemm.c's float32 kernel): BF16_ROWS8 unless
   measured otherwise (kernels/tuning.py). Its pairs are exact and scaled once a channel, so the tiles
   cost about the same from 1 row to 16; the float32 kernel's FMAs grow with the rows. */
static int amx_from8 = BF16_ROWS8;

int pd_qgemm_amx8_from(int rows) { return set_rows(&amx_from8, rows, 1, BF16_ROWS8); }

/* From how many rows products of bits 4 or 8 take the tiles (fewer keep qgemm.c's float32 kernel, or
   int4's exact tiles), where they are granted (else 0). */
int pd_qgemm_amx_rows(int bits) {
    if (!amx_granted()) return 0;
    return __atomic_load_n(bits == 4 ? &amx_from4 : &amx_from8, __ATOMIC_ACQUIRE);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tmm0-1: sums of two blocks of 16 rows; tmm2-3: their activations; tmm4: the weight's pairs;
   tmm6-7: the last rem (< 16) rows' activations and sums. Loaded on every call: the tile
   configuration is the thread's, and other code on the thread (torch's) may load its own. */
static void amx_configure(int rem) {
    amx_config c = {0};
    c.palette = 1;
    for (int i = 0; i < 5; i++) c.colsb[i] = 64, c.rows[i] = 16;
    if (rem) c.colsb[6] = c.colsb[7] = 64, c.rows[6] = c.rows[7] = (uint8_t)rem;
    _tile_loadconfig(&c);
}

/* From which depth K (input values) amx_tiles' blocks of rows take two output tiles at a time
   (amx_block_pair): never unless kernels/tuning.py measured it faster here. Sharing each step's
   activations saves a tile load per two products; on an Intel Xeon it paid from K = 1,536 and lost
   at 576, where the two tiles' pairs read from L2 cost more than the activations' reload from L1. */
#define NO_TILE_PAIRS (1 << 20)
static int tile_pairs_from_k = NO_TILE_PAIRS;

int pd_qgemm_amx_pairs_from_k(int K) { return set_rows(&tile_pairs_from_k, K, 32, NO_TILE_PAIRS); }

/* amx_tiles' blocks of rows (from 48 rows): tmm0-1 the sums of two output tiles for 16 rows, tmm2
   their activations, tmm4-5 the two tiles' pairs; tmm3 and tmm7 the sums and tmm6 the activations of
   the last rem (< 16) rows. amx_rows' tiles (0, 2, 4; 7, 6, 4) keep their shapes. */
static void amx_configure_blocks(int rem) {
    amx_config c = {0};
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = (uint8_t)(i == 3 || i == 6 || i == 7 ? rem : 16);
    if (!rem) c.colsb[3] = c.colsb[6] = c.colsb[7] = 0, c.rows[3] = c.rows[6] = c.rows[7] = 0;
    _tile_loadconfig(&c);
}

/* A thread's buffer for `tiles` output tiles' pairs over all of K. */
static __thread uint32_t *amx_wb;
static __thread size_t amx_cap;

/* From 48 rows (a prefill's) the tiles' pairs are laid out AMX_CHUNK_BYTES at a time (in L2) and the
   rows multiplied a block at a time, every tile of the chunk in turn: a block's activations then stay
   close, where each tile's pass over all the rows had read them all again from L2 or memory. Blocks
   of 32 and 64 rows through one tile at a time measured slower than 16 (their activations spill L1 at
   K = 576); 32 rows by two tiles (amx_block_quad) measured faster, since each product then needs
   one tile load rather than one and a half or two. Chunks of 256 KB and 1 MB about the same as
   512 KB (docs/benchmarks.md). */
#define AMX_CHUNK_BYTES (512 * 1024)
#define AMX_ROW_BLOCK 16
static uint32_t *amx_pairs_buffer(int K, int tiles) {
    const size_t need = (size_t)K / 2 * NC * 4 * tiles;
    if (need > amx_cap) {
        free(amx_wb);
        amx_wb = aligned_alloc(64, (need + 63) / 64 * 64);
        amx_cap = amx_wb ? need : 0;
    }
    return amx_wb;
}

/* Group g (32 input values) of tile t of an int4 weight as rounded pairs, rows 16g.. of wb [K/2][16],
   straight from its nibbles (no float32 block between): lane c of pair row p = bf16(q[2p][c] d + m) |
   bf16(q[2p + 1][c] d + m) << 16. */
static inline __attribute__((always_inline)) void amx_q4_group(const void *w, const void *d, const void *m, int K,
                                                               int t, int g, uint32_t *wb) {
    const uint8_t *nib = (const uint8_t *)w + (int64_t)t * (K / 2) * NC;
    const uint16_t *td = (const uint16_t *)d + (int64_t)t * (K / 32) * NC, *tm = (const uint16_t *)m + (int64_t)t * (K / 32) * NC;
    const __m512i low = _mm512_set1_epi32(15), index = pair_index();
    const __m512 dg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(td + g * NC)));
    const __m512 mg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tm + g * NC)));
    for (int kp = 0; kp < 16; kp++) {
        const int64_t p = (int64_t)g * 16 + kp;
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nib + p * NC)));
        const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), dg, mg);
        const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dg, mg);
        _mm512_store_si512((void *)(wb + p * NC), round_pairs(lo, hi, index));
    }
}

/* The tile whose pairs are laid out while another's multiply (amx_rows_once): tile t (t < 0: none) of
   an int4 (bits 4, rounded pairs) or int8 (exact pairs) weight. */
typedef struct {
    const void *w, *d, *m;
    int bits, t;
} amx_next;

/* Group g (32 input values, pair rows 16g..) of amx_next's tile into wb [K/2][16]. */
static inline __attribute__((always_inline)) void amx_next_group(amx_next next, int K, int g, uint32_t *wb) {
    if (next.bits == 8)
        q8_pairs((const int8_t *)next.w + (int64_t)next.t * K * NC + (int64_t)g * 32 * NC, 32, wb + (int64_t)g * 16 * NC);
    else
        amx_q4_group(next.w, next.d, next.m, K, next.t, g, wb);
}

/* y [M, 16] (ldy apart) = rows xb [M, K] (bf16) times wb [K/2][16] pairs, over all of K. */
static void amx_rows(int M, const uint16_t *xb, int K, const uint32_t *wb, float *y, int64_t ldy) {
    const int64_t sa = (int64_t)K * 2, sy = ldy * 4;
    int i = 0;
    for (; i + 32 <= M; i += 32) {
        const uint16_t *a = xb + (int64_t)i * K;
        _tile_zero(0);
        _tile_zero(1);
        for (int k = 0; k < K; k += 32) {
            _tile_loadd(4, wb + (int64_t)k / 2 * NC, 64);
            _tile_loadd(2, a + k, sa);
            _tile_loadd(3, a + 16 * (int64_t)K + k, sa);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(1, 3, 4);
        }
        _tile_stored(0, y + i * ldy, sy);
        _tile_stored(1, y + (i + 16) * ldy, sy);
    }
/* One block of rows from row i over all of K: sums in tile C, activations in tile A (tile numbers
   are part of the instruction, hence a macro). */
#define AMX_BLOCK(C, A)                                                      \
    do {                                                                     \
        const uint16_t *a = xb + (int64_t)i * K;                             \
        _tile_zero(C);                                                       \
        for (int k = 0; k < K; k += 32) {                                    \
            _tile_loadd(4, wb + (int64_t)k / 2 * NC, 64);                    \
            _tile_loadd(A, a + k, sa);                                       \
            _tile_dpbf16ps(C, A, 4);                                         \
        }                                                                    \
        _tile_stored(C, y + i * ldy, sy);                                    \
    } while (0)
    for (; i + 16 <= M; i += 16) AMX_BLOCK(0, 2);
    if (i < M) AMX_BLOCK(7, 6); /* the last M % 16 rows: tiles 6 and 7 are configured that tall */
#undef AMX_BLOCK
}

/* Rows [0, rows) (16, or the last rem) of xb [, K] times two tiles' pairs wb0, wb1 into y0, y1 (ldy
   apart): each step's activations loaded once for both tiles (three tile loads for two products,
   where a tile at a time took four). Each sum is amx_rows' (its rows over all of K in order). */
static void amx_block_pair(int rows, const uint16_t *xb, int K, const uint32_t *wb0, const uint32_t *wb1, float *y0,
                           float *y1, int64_t ldy) {
    const int64_t sa = (int64_t)K * 2, sy = ldy * 4;
#define PAIR_BLOCK(C0, C1, A)                                                \
    do {                                                                     \
        _tile_zero(C0);                                                      \
        _tile_zero(C1);                                                      \
        for (int k = 0; k < K; k += 32) {                                    \
            _tile_loadd(A, xb + k, sa);                                      \
            _tile_loadd(4, wb0 + (int64_t)k / 2 * NC, 64);                   \
            _tile_dpbf16ps(C0, A, 4);                                        \
            _tile_loadd(5, wb1 + (int64_t)k / 2 * NC, 64);                   \
            _tile_dpbf16ps(C1, A, 5);                                        \
        }                                                                    \
        _tile_stored(C0, y0, sy);                                            \
        _tile_stored(C1, y1, sy);                                            \
    } while (0)
    if (rows == 16) PAIR_BLOCK(0, 1, 2);
    else PAIR_BLOCK(7, 3, 6);
#undef PAIR_BLOCK
}

/* Rows [0, 32) of xb [, K] (two blocks of 16) times two tiles' pairs wb0, wb1 into y0, y1 (ldy apart):
   each step's four products from four tile loads, where amx_block_pair's two took three and amx_rows'
   one two. A tile load and a product do not overlap on the tile unit (an Intel Xeon measured), so a
   product costs its own time plus its share of the loads. Each sum is amx_rows' (its rows over all
   of K in order). Tiles: sums 0-3, pairs 4-5, rows 6-7, all 16 rows (amx_configure_quad). */
static void amx_block_quad(const uint16_t *xb, int K, const uint32_t *wb0, const uint32_t *wb1, float *y0, float *y1,
                           int64_t ldy) {
    const int64_t sa = (int64_t)K * 2, sy = ldy * 4;
    const uint16_t *x1 = xb + 16 * (int64_t)K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < K; k += 32) {
        _tile_loadd(6, xb + k, sa);
        _tile_loadd(4, wb0 + (int64_t)k / 2 * NC, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_loadd(5, wb1 + (int64_t)k / 2 * NC, 64);
        _tile_dpbf16ps(1, 6, 5);
        _tile_loadd(7, x1 + k, sa);
        _tile_dpbf16ps(2, 7, 4);
        _tile_dpbf16ps(3, 7, 5);
    }
    _tile_stored(0, y0, sy);
    _tile_stored(1, y1, sy);
    _tile_stored(2, y0 + 16 * ldy, sy);
    _tile_stored(3, y1 + 16 * ldy, sy);
}

/* amx_block_quad's tiles, and amx_rows' for 32 rows (0-4), all 16 rows tall. */
static void amx_configure_quad(void) {
    amx_config c = {0};
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}

/* amx_rows for fewer than 48 rows (a decode step's), every block in one pass over K: rows 0-15 in
   tiles 0 (sums) and 2 (activations), 16-31 in 1 and 3, the last M % 16 in 7 and 6, as amx_rows
   places them, so each output has its bits. Each step's pairs are then read once, and the next
   tile's (`next`) are laid out in their place as the step's products run: the pairs stay one
   tile's size in L1 and no separate pass lays them out. (The tile unit's time and the vector
   work's add up rather than overlap on the Intel Xeon measured, in any order tried:
   docs/kernels.md.) */
static void amx_rows_once(int M, const uint16_t *xb, int K, uint32_t *wb, float *y, int64_t ldy, amx_next next) {
    const int64_t sa = (int64_t)K * 2, sy = ldy * 4;
    const int full = M / 16, rem = M % 16;
    const uint16_t *a1 = xb + 16 * (int64_t)K, *a2 = xb + (int64_t)full * 16 * K;
    if (full > 0) _tile_zero(0);
    if (full > 1) _tile_zero(1);
    if (rem) _tile_zero(7);
    for (int k = 0; k < K; k += 32) {
        _tile_loadd(4, wb + (int64_t)k / 2 * NC, 64);
        if (full > 0) {
            _tile_loadd(2, xb + k, sa);
            _tile_dpbf16ps(0, 2, 4);
        }
        if (full > 1) {
            _tile_loadd(3, a1 + k, sa);
            _tile_dpbf16ps(1, 3, 4);
        }
        if (rem) {
            _tile_loadd(6, a2 + k, sa);
            _tile_dpbf16ps(7, 6, 4);
        }
        if (next.t >= 0) amx_next_group(next, K, k / 32, wb);
    }
    if (full > 0) _tile_stored(0, y, sy);
    if (full > 1) _tile_stored(1, y + 16 * ldy, sy);
    if (rem) _tile_stored(7, y + (int64_t)full * 16 * ldy, sy);
}

#if defined(__AVX512BW__)
/* int4 below the rounded tile's rows, on AMX (the exact tiles): tile_q4's operands (the nibbles as exact
   bfloat16 pairs, the activations rounded, each group's scale and offset in float32 after its sums), one
   tdpbf16ps per group of 32 input values and 16 rows, where the pairs take 16 vdpbf16ps a row. A
   group's sums leave the tile each time and are scaled in registers: y_i = fma(sum_i, d, fma(sx_i, m,
   y_i)), micro_q4's formula in its order, so a row's result is its own at any row count (the sums
   inside a group in AMX's order).

   Two output tiles and a block of up to 16 rows at a time, whose outputs stay in registers over all
   of K: scaling a group's sums is then two FMAs a row that read the stored sums, where outputs kept
   in memory had each row's output loaded and stored again every group, and the store port set the
   pace from about 12 rows. The tiles' pairs are laid out once, group by group during their first
   block of rows, and read again by the others.

   The round trip of a group's sums (zero, product, store, load) has a latency no row count hides, so
   the loop runs as a pipeline over groups: group g's products are issued, then group g - 1's sums
   (stored a group earlier) are scaled, then group g + 1's nibbles widened, so no step waits on the
   round trip just issued. Double-buffered by group parity P: the sums of output tile j in tile
   2P + j, its pairs in 4 + j, the rows in 6 + P (all 8 tile registers). */
/* Groups ahead that the nibbles are prefetched, as qgemm.c's direct rows do (a decode step's products
   are small and threads' chunks interleave, so the hardware prefetcher keeps restarting); past a
   tile's end, the start of the tile that follows it in this loop. */
#ifndef EXACT_PF
#define EXACT_PF 8
#endif

/* Group g of output tile t as pairs into wb [G][16][16], prefetching EXACT_PF groups ahead (past the
   tile's end: the tile nt on, the next this loop reaches). */
static inline __attribute__((always_inline)) void exact_pairs(const uint8_t *w, const uint16_t *d, const uint16_t *m,
                                                              int K, int t, int nt, int t1, int g, uint32_t *wb,
                                                              __m512i table) {
    const int G = K / 32;
    const uint8_t *nib = w + (int64_t)t * (K / 2) * NC + (int64_t)g * 16 * NC;
    int pt = t, pg = g + EXACT_PF;
    if (pg >= G) pt += nt, pg -= G;
    if (pt < t1) {
        const uint8_t *pn = w + (int64_t)pt * (K / 2) * NC + (int64_t)pg * 16 * NC;
        for (int b = 0; b < 16 * NC; b += 64) __builtin_prefetch(pn + b, 0, 3);
        if ((pg & 1) == 0) {   /* two groups' scales a line */
            const int64_t gi = (int64_t)pt * G * NC + (int64_t)pg * NC;
            __builtin_prefetch(d + gi, 0, 3), __builtin_prefetch(m + gi, 0, 3);
        }
    }
    uint32_t *o = wb + (int64_t)g * 16 * NC;
    for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(o + p * NC), q4_pair(nib + p * NC, table));
}

/* Group g's sums (R rows of 16) scaled into the outputs out[0, R) of tile t. */
static inline __attribute__((always_inline)) void exact_scale(int R, const uint16_t *d, const uint16_t *m,
                                                              const float *sx, int G, int t, int g,
                                                              const float *sums, __m512 *out) {
    const int64_t gi = (int64_t)t * G * NC + g * NC;
    const __m512 dg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + gi)));
    const __m512 mg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + gi)));
    for (int i = 0; i < R; i++)
        out[i] = _mm512_fmadd_ps(_mm512_load_ps(sums + i * NC), dg,
                                 _mm512_fmadd_ps(_mm512_set1_ps(sx[(int64_t)i * G + g]), mg, out[i]));
}

/* Group g's products of NT output tiles into sums[P][j] (tiles C0 and C1; pairs in 4 and 5, rows in
   A: tile numbers are literals). */
#define EXACT_GROUP(P, C0, C1, A)                                                 \
    do {                                                                          \
        _tile_loadd(A, xb + g * 32, sa);                                          \
        _tile_loadd(4, wb + (int64_t)g * 16 * NC, 64);                            \
        _tile_zero(C0);                                                           \
        _tile_dpbf16ps(C0, A, 4);                                                 \
        _tile_stored(C0, sums[P][0], 64);                                         \
        if (NT > 1) {                                                             \
            _tile_loadd(5, wb + tile_pairs + (int64_t)g * 16 * NC, 64);           \
            _tile_zero(C1);                                                       \
            _tile_dpbf16ps(C1, A, 5);                                             \
            _tile_stored(C1, sums[P][1], 64);                                     \
        }                                                                         \
    } while (0)

/* Rows [0, R) (xb, sx and y at the block's first row) of output tiles [t, t + NT) over all of K; their
   pairs laid out into wb (tile_pairs apart) on the way where `lay` (the tiles' first block), else read
   from it. */
static inline __attribute__((always_inline)) void exact_block(int R, int NT, const uint8_t *w, const uint16_t *d,
                                                              const uint16_t *m, const uint16_t *xb,
                                                              const float *sx, float *y, int64_t ldy, int K, int t,
                                                              int t1, int lay, uint32_t *wb, __m512i table) {
    const int G = K / 32;
    const int64_t sa = (int64_t)K * 2, tile_pairs = (int64_t)K / 2 * NC;
    float sums[2][2][16 * NC] __attribute__((aligned(64)));
    __m512 out[2][16];
    for (int j = 0; j < NT; j++)
        for (int i = 0; i < R; i++) out[j][i] = _mm512_setzero_ps();
    for (int j = 0; j < NT && lay; j++) exact_pairs(w, d, m, K, t + j, NT, t1, 0, wb + j * tile_pairs, table);
    for (int g = 0; g < G; g++) {
        if (g & 1) EXACT_GROUP(1, 2, 3, 7);
        else EXACT_GROUP(0, 0, 1, 6);
        for (int j = 0; j < NT && g; j++) exact_scale(R, d, m, sx, G, t + j, g - 1, sums[(g - 1) & 1][j], out[j]);
        for (int j = 0; j < NT && lay && g + 1 < G; j++)
            exact_pairs(w, d, m, K, t + j, NT, t1, g + 1, wb + j * tile_pairs, table);
    }
    for (int j = 0; j < NT; j++) {
        exact_scale(R, d, m, sx, G, t + j, G - 1, sums[(G - 1) & 1][j], out[j]);
        for (int i = 0; i < R; i++) _mm512_storeu_ps(y + i * ldy + j * NC, out[j][i]);
    }
}
#undef EXACT_GROUP

/* Returns 0 where it cannot run (no buffer): the vector pairs run instead. */
static int amx_q4_exact(const void *w, const void *d, const void *m, const uint16_t *xb, const float *sx, float *y,
                        int64_t ldy, int M, int K, int t0, int t1) {
    uint32_t *wb = amx_pairs_buffer(K, 2);
    if (wb == NULL) return 0;
    const __m512i table = q4_table();
    const int G = K / 32;
    const uint8_t *nw = (const uint8_t *)w;
    const uint16_t *dd = (const uint16_t *)d, *mm = (const uint16_t *)m;
    for (int t = t0; t < t1; t += 2)
        for (int i0 = 0; i0 < M; i0 += 16) {
            const uint16_t *xi = xb + (int64_t)i0 * K;
            const float *si = sx + (int64_t)i0 * G;
            float *yi = y + (int64_t)i0 * ldy + t * NC;
            const int lay = i0 == 0;
#define BLOCK(r)                                                                              \
    case r:                                                                                   \
        if (t + 1 < t1) exact_block(r, 2, nw, dd, mm, xi, si, yi, ldy, K, t, t1, lay, wb, table); \
        else exact_block(r, 1, nw, dd, mm, xi, si, yi, ldy, K, t, t1, lay, wb, table);          \
        break;
            switch (M - i0 < 16 ? M - i0 : 16) {
                BLOCK(16) BLOCK(15) BLOCK(14) BLOCK(13) BLOCK(12) BLOCK(11) BLOCK(10) BLOCK(9)
                BLOCK(8) BLOCK(7) BLOCK(6) BLOCK(5) BLOCK(4) BLOCK(3) BLOCK(2) BLOCK(1)
                default: break;
            }
#undef BLOCK
        }
    return 1;
}

/* amx_q4_exact's tiles: sums 0-3 and rows 6-7 M tall up to 16 rows (16 past that: the rows are padded,
   padded_rows), pairs 4-5 16. */
static void amx_configure_exact(int M) {
    amx_config c = {0};
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = (uint8_t)(i == 4 || i == 5 || M > 16 ? 16 : M);
    _tile_loadconfig(&c);
}
#endif

/* Tile t's pairs over all of K into wb (amx_next_group, a group at a time). */
static void amx_tile_pairs(int bits, const void *w, const void *d, const void *m, int K, int t, uint32_t *wb) {
    for (int g = 0; g < K / 32; g++) amx_next_group((amx_next){w, d, m, bits, t}, K, g, wb);
}

/* int8's sums of tile t, rows [0, rows) of yt, times each channel's scale. */
static void amx_scale8(const void *d, int t, float *yt, int64_t ldy, int rows) {
    const __m512 dc = _mm512_loadu_ps((const float *)d + t * NC);
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(yt + r * ldy, _mm512_mul_ps(_mm512_loadu_ps(yt + r * ldy), dc));
}

/* Output tiles [t0, t1) of an int4 (dequantized, rounded to pairs) or int8 (exact pairs, scaled per
   channel after) weight on AMX; 0 where it does not run (not granted, K not in whole steps of 32, no
   buffer), and the vector paths do. */
static int amx_tiles(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y, int64_t ldy,
                     int M, int K, int t0, int t1) {
    if (!amx_granted() || K % 32) return 0;
    const int once = M < 48; /* a decode step's rows: amx_rows_once; else chunks of tiles, blocks of rows */
    const int64_t tile_pairs = (int64_t)K / 2 * NC, fit = AMX_CHUNK_BYTES / (tile_pairs * 4);
    const int chunk = once || fit < 1 ? 1 : (int)fit;
    const int two = K >= __atomic_load_n(&tile_pairs_from_k, __ATOMIC_ACQUIRE);
    uint32_t *wb = amx_pairs_buffer(K, chunk);
    if (wb == NULL) return 0;
    if (once) {   /* each tile's pairs laid out during the tile before it */
        amx_configure(M % 16);
        if (t0 < t1) amx_tile_pairs(bits, w, d, m, K, t0, wb);
        for (int t = t0; t < t1; t++) {
            amx_rows_once(M, xb, K, wb, y + t * NC, ldy, (amx_next){w, d, m, bits, t + 1 < t1 ? t + 1 : -1});
            if (bits == 8) amx_scale8(d, t, y + t * NC, ldy, M);
        }
    } else {
        amx_configure_blocks(M % 16);
        for (int c0 = t0; c0 < t1; c0 += chunk) {
            const int c1 = c0 + chunk < t1 ? c0 + chunk : t1;
            for (int t = c0; t < c1; t++) amx_tile_pairs(bits, w, d, m, K, t, wb + (t - c0) * tile_pairs);
            int i = 0;
            if (c1 - c0 > 1) {   /* 32 rows at a time, two tiles a block where the chunk has them */
                amx_configure_quad();
                for (; i + 32 <= M; i += 32)
                    for (int t = c0, nt; t < c1; t += nt) {
                        nt = t + 1 < c1 ? 2 : 1;
                        float *yt = y + i * ldy + t * NC;
                        if (nt == 2)
                            amx_block_quad(xb + (int64_t)i * K, K, wb + (t - c0) * tile_pairs,
                                           wb + (t + 1 - c0) * tile_pairs, yt, yt + NC, ldy);
                        else
                            amx_rows(32, xb + (int64_t)i * K, K, wb + (t - c0) * tile_pairs, yt, ldy);
                        for (int j = 0; bits == 8 && j < nt; j++) amx_scale8(d, t + j, yt + j * NC, ldy, 32);
                    }
                amx_configure_blocks(M % 16);
            }
            for (; i < M; i += AMX_ROW_BLOCK) {   /* a multiple of 16: the last block keeps M % 16 */
                const int rows = M - i < AMX_ROW_BLOCK ? M - i : AMX_ROW_BLOCK;
                for (int t = c0, nt; t < c1; t += nt) {
                    nt = two && t + 1 < c1 ? 2 : 1;
                    float *yt = y + i * ldy + t * NC;
                    if (nt == 2)
                        amx_block_pair(rows, xb + (int64_t)i * K, K, wb + (t - c0) * tile_pairs,
                                       wb + (t + 1 - c0) * tile_pairs, yt, yt + NC, ldy);
                    else
                        amx_rows(rows, xb + (int64_t)i * K, K, wb + (t - c0) * tile_pairs, yt, ldy);
                    for (int j = 0; bits == 8 && j < nt; j++) amx_scale8(d, t + j, yt + j * NC, ldy, rows);
                }
            }
        }
    }
    _tile_release();
    return 1;
}
#if defined(__AVX512BW__)
/* AMX's tiles copied on vector FMAs, bit for bit, for a few rows. A tdpbf16ps of 16 pairs sums the
   even-indexed products in one chain and the odd-indexed in another, each in order from zero, adds
   the two, then adds that to the tile's sum (found by comparing the two on this CPU's tiles; each
   process checks it once before the copy runs: amx_vectors_agree). A bfloat16 activation times a
   nibble or an int8 value is exact in float32, so fma(x, q, chain) rounds as the tile's addition
   does. At a row or two a tile wastes 15 of its 16 rows and int4's exact tiles add a round trip (zero,
   product, store) per group of 32 that no row count hides there; the vectors widen each weight once, as
   qgemm.c's register rows do. Which is faster at how many rows is measured (kernels/tuning.py), and
   needs no agreement between processes: the bits are the same either way. */
#define VEC_MAX 8
static int vectors_below4 = 1, vectors_below8 = 1;   /* 1: the tiles from 1 row until measured */

int pd_qgemm_amx_vectors4_below(int rows) { return set_rows(&vectors_below4, rows, 1, VEC_MAX + 1); }
int pd_qgemm_amx_vectors8_below(int rows) { return set_rows(&vectors_below8, rows, 1, VEC_MAX + 1); }

/* The bf16 rows (xb, M x K) as floats: a broadcast from memory then needs no shift. */
static __thread float *vec_x;
static __thread size_t vec_cap;

static float *vector_rows(const uint16_t *xb, int M, int K) {
    const size_t need = (size_t)M * K * 4;
    if (need > vec_cap) {
        free(vec_x);
        vec_x = aligned_alloc(64, (need + 63) / 64 * 64);
        vec_cap = vec_x ? need : 0;
        if (vec_x == NULL) return NULL;
    }
    for (int64_t i = 0; i < (int64_t)M * K; i += 16)
        _mm512_store_ps(vec_x + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + i))), 16)));
    return vec_x;
}

/* Input values 2p and 2p + 1 of group (or block of 32) g of a tile, 16 channels each, as floats: int4's
   nibbles looked up (vpermps reads an index's low 4 bits), int8's bytes converted. */
static inline __attribute__((always_inline)) void vec_weights(int bits, const uint8_t *tw, int g, int p, __m512 *lo,
                                                              __m512 *hi) {
    if (bits == 4) {
        const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tw + ((int64_t)g * 16 + p) * NC)));
        *lo = _mm512_permutexvar_ps(v, values);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
    } else {
        const int8_t *q = (const int8_t *)tw + ((int64_t)g * 32 + 2 * p) * NC;
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + NC))));
    }
}

/* Groups (blocks of 32 input values) [g0, g0 + ng) of tile tw over mr rows (xr: the rows as floats, K
   apart) into out: each group's two chains a row are independent of the other groups', so a row or two
   fill the FMA units' pipelines that way. int4: per group out = fma(sum, d, fma(sx, m, out)),
   amx_q4_exact's scaling in its order; int8: each block's sum added to out in order over K, as the tile
   sums over all of K (amx_rows_once). */
static inline __attribute__((always_inline)) void vec_groups(int bits, int mr, int ng, const uint8_t *tw,
                                                             const uint16_t *td, const uint16_t *tm, const float *xr,
                                                             const float *sx, int K, int g0, int64_t ahead,
                                                             const uint8_t *end, __m512 *out) {
    const int G = K / 32;
    const int64_t group_bytes = bits == 4 ? 16 * NC : 32 * NC;
    __m512 a[4][4], b[4][4];
    for (int i = 0; i < mr; i++)
        for (int u = 0; u < ng; u++) a[i][u] = b[i][u] = _mm512_setzero_ps();
    /* `ahead` groups on, as qgemm.c's register rows prefetch (int4 into L2, int8 into L1), never past
       `end` (the tiles this call computes; the next ones are another thread's) */
    for (int u = 0; u < ng; u++) {
        const uint8_t *pf = tw + (g0 + u + ahead) * group_bytes;
        if (pf >= end) break;
        for (int64_t o = 0; o < group_bytes; o += 64) {
            if (bits == 4) __builtin_prefetch(pf + o, 0, 2);
            else __builtin_prefetch(pf + o, 0, 3);
        }
        if (bits == 4 && ((g0 + u + ahead) & 1) == 0)   /* two groups' scales a line */
            __builtin_prefetch(td + (g0 + u + ahead) * NC, 0, 2), __builtin_prefetch(tm + (g0 + u + ahead) * NC, 0, 2);
    }
    for (int p = 0; p < 16; p++)
        for (int u = 0; u < ng; u++) {
            __m512 lo, hi;
            vec_weights(bits, tw, g0 + u, p, &lo, &hi);
            const int k = (g0 + u) * 32 + 2 * p;
            for (int i = 0; i < mr; i++) {
                a[i][u] = _mm512_fmadd_ps(_mm512_set1_ps(xr[(int64_t)i * K + k]), lo, a[i][u]);
                b[i][u] = _mm512_fmadd_ps(_mm512_set1_ps(xr[(int64_t)i * K + k + 1]), hi, b[i][u]);
            }
        }
    for (int u = 0; u < ng; u++) {
        const int g = g0 + u;
        if (bits == 4) {
            const __m512 dg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(td + g * NC)));
            const __m512 mg = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tm + g * NC)));
            for (int i = 0; i < mr; i++)
                out[i] = _mm512_fmadd_ps(_mm512_add_ps(a[i][u], b[i][u]), dg,
                                         _mm512_fmadd_ps(_mm512_set1_ps(sx[(int64_t)i * G + g]), mg, out[i]));
        } else {
            for (int i = 0; i < mr; i++) out[i] = _mm512_add_ps(out[i], _mm512_add_ps(a[i][u], b[i][u]));
        }
    }
}

/* Tile t over mr (<= 4) rows, ng groups at a time (the last few one at a time); int8's sums times the
   channel's scale at the end (amx_scale8). */
static inline __attribute__((always_inline)) void vec_tile(int bits, int mr, int ng, const void *w, const void *d,
                                                           const void *m, const float *xr, const float *sx, float *y,
                                                           int64_t ldy, int K, int t, int64_t ahead,
                                                           const uint8_t *end) {
    const int G = K / 32;
    const uint8_t *tw = (const uint8_t *)w + (int64_t)t * (bits == 4 ? K / 2 : K) * NC;
    const uint16_t *td = (const uint16_t *)d + (int64_t)t * G * NC, *tm = (const uint16_t *)m + (int64_t)t * G * NC;
    __m512 out[4];
    for (int i = 0; i < mr; i++) out[i] = _mm512_setzero_ps();
    int g0 = 0;
    for (; g0 + ng <= G; g0 += ng) vec_groups(bits, mr, ng, tw, td, tm, xr, sx, K, g0, ahead, end, out);
    for (; g0 < G; g0++) vec_groups(bits, mr, 1, tw, td, tm, xr, sx, K, g0, ahead, end, out);
    const __m512 dc = bits == 8 ? _mm512_loadu_ps((const float *)d + t * NC) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++)
        _mm512_storeu_ps(y + (int64_t)i * ldy + t * NC, bits == 8 ? _mm512_mul_ps(out[i], dc) : out[i]);
}

/* Tiles [t0, t1) of rows [0, M) (M <= VEC_MAX) on the vectors; 0 where the rows' buffer is not had. */
static int vec_tiles(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, const float *sx,
                     float *y, int64_t ldy, int M, int K, int t0, int t1) {
    const float *xr = vector_rows(xb, M, K);
    if (xr == NULL) return 0;
    const int64_t group_bytes = bits == 4 ? 16 * NC : 32 * NC, ahead = (pd_qgemm_prefetch(-1) + group_bytes - 1) / group_bytes;
    const uint8_t *end = (const uint8_t *)w + (int64_t)t1 * (K / 32) * group_bytes;
    for (int i0 = 0; i0 < M; i0 += 4) {   /* at most 4 rows a pass: their chains fit the registers */
        const int mr = M - i0 < 4 ? M - i0 : 4;
        const float *xi = xr + (int64_t)i0 * K, *si = sx ? sx + (int64_t)i0 * (K / 32) : NULL;
        float *yi = y + (int64_t)i0 * ldy;
        for (int t = t0; t < t1; t++) {
            /* each (format, rows) inlined with its constants: 4 groups at a time for 1-2 rows, 2 for 3-4 */
#define VEC_CASE(b, r, g) case r: vec_tile(b, r, g, w, d, m, xi, si, yi, ldy, K, t, ahead, end); break;
#define VEC_ROWS(b) switch (mr) { VEC_CASE(b, 1, 4) VEC_CASE(b, 2, 4) VEC_CASE(b, 3, 2) VEC_CASE(b, 4, 2) default: break; }
            if (bits == 4) VEC_ROWS(4)
            else VEC_ROWS(8)
#undef VEC_ROWS
#undef VEC_CASE
        }
    }
    return 1;
}

/* Whether the vectors give this CPU's tiles' bits: int4's exact tiles and int8's tiles against
   vec_tiles on a few products of random operands (1 to 5 rows, a tail of groups); 1 they do, 0 they
   do not (the tiles then run at every row count), checked once a process. */
static int vectors_state;   /* 0: not checked, 1: the same bits, -1: not */

static int vectors_check(void) {
    enum { K = 96, T = 3, MAXR = 5 };
    uint8_t w4[T * K / 2 * NC];
    int8_t w8[T * K * NC];
    uint16_t d4[T * K / 32 * NC], m4[T * K / 32 * NC], xb[MAXR * K];
    float d8[T * NC], sx[MAXR * K / 32], y0[MAXR * T * NC], y1[MAXR * T * NC];
    uint64_t s = 0x9E3779B97F4A7C15ull;
#define NEXT() (s ^= s << 13, s ^= s >> 7, s ^= s << 17, s)
    for (size_t i = 0; i < sizeof w4; i++) w4[i] = (uint8_t)NEXT();
    for (size_t i = 0; i < sizeof w8; i++) w8[i] = (int8_t)((int)(NEXT() % 255) - 127);
    for (int i = 0; i < T * K / 32 * NC; i++) {   /* scales 2^-8..2^-1, offsets of either sign */
        d4[i] = _cvtss_sh((float)(NEXT() % 1024 + 1) / (float)(1 << (8 + NEXT() % 8)), 0);
        m4[i] = _cvtss_sh(-(float)(NEXT() % 1024) / (float)(1 << (9 + NEXT() % 8)), 0);
    }
    for (int i = 0; i < T * NC; i++) d8[i] = (float)(NEXT() % 1000 + 1) * 1e-4f;
    for (int i = 0; i < MAXR * K; i++) {   /* magnitudes 2^-6..2^5, either sign, rounded to nearest even */
        xb[i] = pd_to_bf16(((float)(NEXT() % 2001) - 1000.0f) / 1000.0f * (float)(1 << (NEXT() % 12)) / 64.0f);
    }
    for (int i = 0; i < MAXR * K / 32; i++) sx[i] = (float)(NEXT() % 2001) / 100.0f - 10.0f;
    const int rows[] = {1, 2, 3, 5};
    for (int r = 0; r < 4; r++) {
        const int M = rows[r];
        amx_configure_exact(M);
        const int done = amx_q4_exact(w4, d4, m4, xb, sx, y0, T * NC, M, K, 0, T);
        _tile_release();
        if (!done || !vec_tiles(4, w4, d4, m4, xb, sx, y1, T * NC, M, K, 0, T) ||
            memcmp(y0, y1, sizeof(float) * M * T * NC))
            return -1;
        if (!amx_tiles(8, w8, d8, NULL, xb, y0, T * NC, M, K, 0, T) ||
            !vec_tiles(8, w8, d8, NULL, xb, NULL, y1, T * NC, M, K, 0, T) ||
            memcmp(y0, y1, sizeof(float) * M * T * NC))
            return -1;
    }
#undef NEXT
    return 1;
}

static int vectors_agree(void) {
    if (!amx_granted()) return -1;   /* not known while the tiles are off (pd_qgemm_amx) */
    int state = __atomic_load_n(&vectors_state, __ATOMIC_ACQUIRE);
    if (state == 0) {   /* threads checking at once reach the same answer */
        state = vectors_check();
        __atomic_store_n(&vectors_state, state, __ATOMIC_RELEASE);
    }
    return state;
}

/* 1 where the vectors give the tiles' bits here, 0 where they do not or no tiles run (qgemm.h); asks for
   the tiles first, as a product would. */
int pd_qgemm_amx_vectors_agree(void) { return amx_request() && vectors_agree() == 1; }

/* Whether tiles [t0, t1) of M rows, which would take AMX's tiles at this row count, run on the vectors. */
static int vectors_take(int bits, int M, int K) {
    const int below = __atomic_load_n(bits == 4 ? &vectors_below4 : &vectors_below8, __ATOMIC_ACQUIRE);
    return M < below && K % 32 == 0 && vectors_agree() == 1;   /* vectors_agree: -1 while no tiles run */
}
#else
int pd_qgemm_amx_vectors4_below(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_vectors8_below(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_vectors_agree(void) { return 0; }
#endif
#else
static int amx_request(void) { return 0; }
int pd_qgemm_amx_vectors4_below(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_vectors8_below(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_vectors_agree(void) { return 0; }
static int amx_exact_rows(void) { return 0; }
int pd_qgemm_amx_exact_from(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_from(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx8_from(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_pairs_from_k(int K) { return K < 0 ? 0 : K; }
int pd_qgemm_amx_rows(int bits) {
    (void)bits;
    return 0;
}
int pd_qgemm_amx(int want) {
    (void)want;
    return 0;
}
static int amx_tiles(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y, int64_t ldy,
                     int M, int K, int t0, int t1) {
    (void)bits, (void)w, (void)d, (void)m, (void)xb, (void)y, (void)ldy, (void)M, (void)K, (void)t0, (void)t1;
    return 0;
}
#endif

/* The rows' float32 sums per group of 32, after the bf16 rows (padded_rows of them). */
static float *group_sums(uint16_t *xb, int M, int K) { return (float *)(xb + (size_t)padded_rows(4, M) * K); }

/* Tiles [t0, t1) on the rounded tile (int4) or int8's pairs: NT2 at a time while MR2 rows or more
   fill a block (fewer rows would leave most of the accumulators idle), the rest one at a time. */
static void tiles_grouped(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y,
                          int64_t ldy, int M, int K, int t0, int t1) {
    int t = t0;
    if (M >= MR2)
        for (; t + 1 < t1; t += NT2) tiles_nt(bits, w, d, m, xb, y, ldy, M, K, t, t1 - t < NT2 ? t1 - t : NT2);
    for (; t < t1; t++)
        if (bits == 8) tile_q8(w, d, xb, y, ldy, M, K, t);
        else tile_bf16(bits, w, d, m, xb, y, ldy, M, K, t);
}

/* The entry points (qgemm.h): pd_qgemm and layer.c's products, which hand out tiles themselves.
   x [M, K] as bf16 [M, K] (round to nearest even), or NULL where the float32 kernel runs. */
uint16_t *pd_qgemm_bf16_x(int bits, const float *x, int64_t ldx, int M, int K) {
    if (bits != 4 && bits != 8) return NULL;
    if (M < pd_qgemm_bf16_rows(bits)) return NULL;    /* asks for the tiles first, where built in */
    /* the group sums for tile_q4 and the exact tiles */
    const int want_sums = bits == 4 && (M < pairs_rounded_rows() || M < pd_qgemm_amx_rows(4) || pd_qgemm_invariant_at(M));
    const size_t sums = want_sums ? (size_t)M * (K / 32) * 4 : 0, Mp = (size_t)padded_rows(bits, M);
    uint16_t *xb = aligned_alloc(64, (Mp * K * 2 + sums + 63) / 64 * 64);
    if (xb == NULL) return NULL;
    memset(xb + (size_t)M * K, 0, (Mp - M) * K * 2);
    float *sx = group_sums(xb, M, K);
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k += 16) {
            const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i * ldx + k));
            _mm256_storeu_si256((__m256i *)(xb + (int64_t)i * K + k), r);
            if (sums) {      /* of the rounded values: two halves of a group of 32 */
                const float s = _mm512_reduce_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
                if (k % 32) sx[i * (K / 32) + k / 32] += s; else sx[i * (K / 32) + k / 32] = s;
            }
        }
    return xb;
}

void pd_qgemm_bf16_free(uint16_t *xb) { free(xb); }
void pd_qgemm_bf16_tiles(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y,
                         int64_t ldy, int M, int K, int t0, int t1) {
    /* int4 keeps its exact paths at every row count model.batch_invariant covers (qgemm.h) */
    const int exact4 = bits == 4 && pd_qgemm_invariant_at(M);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
    /* where the tiles would run (int8's; int4's exact tiles), their bits on the vectors at a few rows */
    if ((bits == 8 || M < pd_qgemm_amx_rows(4) || exact4) && vectors_take(bits, M, K) &&
        vec_tiles(bits, w, d, m, xb, bits == 4 ? group_sums((uint16_t *)xb, M, K) : NULL, y, ldy, M, K, t0, t1))
        return;
#endif
    /* AMX takes what the rounded tile and int8's pairs take: the same operands, many rows at once. */
    if ((bits == 8 || (M >= pd_qgemm_amx_rows(4) && !exact4)) && amx_tiles(bits, w, d, m, xb, y, ldy, M, K, t0, t1))
        return;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
    if (bits == 4 && (M < pd_qgemm_amx_rows(4) || exact4) && amx_granted() && K % 32 == 0) {
        amx_configure_exact(M);
        const int done = amx_q4_exact(w, d, m, xb, group_sums((uint16_t *)xb, M, K), y, ldy, M, K, t0, t1);
        _tile_release();
        if (done) return;
    }
#endif
    if (bits == 8) {
        tiles_grouped(bits, w, d, m, xb, y, ldy, M, K, t0, t1);
        return;
    }
#if defined(__AVX512BW__)
    if (bits == 4 && (M < pairs_rounded_rows() || exact4)) {
        const float *sx = group_sums((uint16_t *)xb, M, K);
        for (int t = t0; t < t1; t++) tile_q4(w, d, m, xb, sx, y, ldy, M, K, t);
        return;
    }
#endif
    tiles_grouped(bits, w, d, m, xb, y, ldy, M, K, t0, t1);
}
#else
int pd_qgemm_amx_vectors4_below(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_vectors8_below(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_vectors_agree(void) { return 0; }
int pd_qgemm_pairs_rounded_from(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_exact_from(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_from(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx8_from(int rows) { return rows < 0 ? 0 : rows; }
int pd_qgemm_amx_pairs_from_k(int K) { return K < 0 ? 0 : K; }
int pd_qgemm_amx_rows(int bits) {
    (void)bits;
    return 0;
}
int pd_qgemm_amx(int want) {
    (void)want;
    return 0;
}
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

/* From how many rows products of this weight format (bits 4 or 8) round to bfloat16 here (0: never). */
int pd_qgemm_bf16_rows(int bits) {
#ifdef __AVX512BF16__
    amx_request();   /* the tiles' rows where the kernel grants them: asked once, as a product would */
    if (pd_qgemm_invariant_at(1)) return 1;   /* model.batch_invariant: the exact paths from 1 row */
    if (bits == 4 && amx_exact_rows()) return amx_exact_rows();
    if (bits == 8 && pd_qgemm_amx_rows(8)) return pd_qgemm_amx_rows(8);
    return bits == 4 ? BF16_ROWS4 : BF16_ROWS8;
#else
    (void)bits;
    return 0;
#endif
}
