/* y = x @ w.T for a quantized weight and float32 activations, with no rounding of the activations.
   Two weight formats: int4 in groups of 32 with a scale and an offset (GGUF's Q4_1), and int8 with
   one scale per output channel.

   torch's weight-only CPU kernels take bfloat16 activations (float32 falls back to a scalar loop)
   and, at 8-32 rows on an AVX2-only CPU, cost more than the float32 GEMM they replace. Here the
   weight is dequantized a tile at a time into a buffer that stays in L1 (16 output channels x KB
   input values) and a register-blocked float32 micro-kernel (MR rows x 16 channels of accumulators,
   the weight streamed, the activations broadcast) multiplies every row by it: a weight byte is read
   from memory once per product whatever the number of rows, and the arithmetic is float32 FMAs.
   One or two rows skip the buffer (dequantized into registers, used once). A float32 weight in the
   same tiled layout runs the same micro-kernel (MKL's small-M paths read it more slowly).
   Written with GCC vector extensions over VW-float vectors (16 with AVX-512, else 8; FMA from the
   build's -m flags, native.py), so the same source builds anywhere; the intrinsics only widen
   bytes, convert halves and broadcast.

   Weight layouts, prepared once at load (quant.py), per tile t of 16 output channels:
     int4: nib[t][k/2][c] uint8 (value k of channel c in the low nibble, k+1 in the high nibble),
           d[t][k/32][c], m[t][k/32][c] float16 (as GGUF stores them): w = q * d + m
     int8: q[t][k][c] int8, d[t][c] float: w = q * d (m unused)
     float32: w[t][k][c] (d, m unused): the same micro-kernel, reading the weight where it lies
   x: [M, K] rows ldx floats apart; y: [M, N] rows ldy floats apart. K % 32 == 0, N % 16 == 0. */
#include <omp.h>
#include <stdint.h>
#include "qgemm.h"      /* NC, KB; the bfloat16 products (qgemm_bf16.c) */

/* The vector width: 16 floats with AVX-512 (a tile row is one register, and 32 registers hold a
   taller block of rows), else 8 (two registers a tile row, 16 registers). The micro-kernel's
   arithmetic per element is the same either way, so both give the same results bit for bit (int4's
   register rows, direct4, keep other chains at each width). */
#ifdef __AVX512F__
#define VW 16
#define MR 12   /* rows per micro-kernel call: 12 accumulators + 1 weight vector */
#else
#define VW 8
#define MR 6    /* 12 accumulators + 2 weight vectors + 1 broadcast */
#endif
#define NV (NC / VW)   /* vectors per tile row */
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));

#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf splat(const float *p) { return (vf)_mm512_set1_ps(*p); }
/* The 16 bytes of a tile row pair: low nibbles (input value k) and high nibbles (k + 1) as floats. */
static inline void nibbles(const uint8_t *b, vf *lo, vf *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    lo[0] = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi[0] = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
/* The same floats looked up: vpermps takes a lane's value from a register of the 16 floats 0-15 by the
   index's low 4 bits, so the low nibble needs no mask and neither nibble a conversion (one shift and
   two lookups where a mask, a shift and two conversions ran). Where that is faster depends on the
   core's ports for the two (kernels/tuning.py measures it: pd_qgemm_lut_from). */
#define NIBBLE_LUT 1
static inline void nibbles_lut(const uint8_t *b, vf *lo, vf *hi) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    lo[0] = (vf)_mm512_permutexvar_ps(v, values);
    hi[0] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
}
static inline void bytes(const int8_t *b, vf *o) {
    o[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)));
}
static inline void halfs(const uint16_t *p, vf *o) { o[0] = (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vf splat(const float *p) { return (vf)_mm256_broadcast_ss(p); }
static inline void nibbles(const uint8_t *b, vf *lo, vf *hi) {
    for (int j = 0; j < 2; j++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * j)));
        lo[j] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        hi[j] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    }
}
static inline void bytes(const int8_t *b, vf *o) {
    for (int j = 0; j < 2; j++)
        o[j] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * j))));
}
#else
static inline vf splat(const float *p) {
    vf o;
    for (int j = 0; j < VW; j++) o[j] = *p;
    return o;
}
static inline void nibbles(const uint8_t *b, vf *lo, vf *hi) {
    for (int j = 0; j < NC; j++) lo[j / VW][j % VW] = (float)(b[j] & 15), hi[j / VW][j % VW] = (float)(b[j] >> 4);
}
static inline void bytes(const int8_t *b, vf *o) {
    for (int j = 0; j < NC; j++) o[j / VW][j % VW] = (float)b[j];
}
#endif

#if !defined(__AVX512F__) && defined(__F16C__)
static inline void halfs(const uint16_t *p, vf *o) {
    for (int j = 0; j < NV; j++) o[j] = (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * j)));
}
#elif !defined(__AVX512F__)
static inline float half(uint16_t h) {  /* IEEE binary16 -> float, subnormals included */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, f = h & 1023;
    union { uint32_t u; float f; } v;
    if (e == 31) v.u = sign | 0x7f800000u | (f << 13);
    else if (e) v.u = sign | ((e + 112) << 23) | (f << 13);
    else { v.f = (float)f * (1.0f / 16777216.0f); v.u |= sign; }
    return v.f;
}
static inline void halfs(const uint16_t *p, vf *o) {
    for (int j = 0; j < NC; j++) o[j / VW][j % VW] = half(p[j]);
}
#endif

#ifndef NIBBLE_LUT
#define NIBBLE_LUT 0
#define nibbles_lut nibbles
#endif

#define LOAD(p) (*(const vfu *)(p))

/* An int4 weight as the products sum it: q * d + m, rounded once (one FMA where the build has it). The
   dequantized block and the batch-invariant register rows both call this, so their bits agree. */
static inline vf weight4(vf q, vf d, vf m) { return q * d + m; }

/* The weight of one tile: its input values [k0, k1) into buf [k1 - k0][16]. */
static void dequant4(const uint8_t *nib, const uint16_t *d, const uint16_t *m, int k0, int k1, float *buf) {
    for (int g = k0 / 32; g < k1 / 32; g++) {
        vf dg[NV], mg[NV], lo[NV], hi[NV];
        halfs(d + g * NC, dg), halfs(m + g * NC, mg);
        for (int kp = 0; kp < 16; kp++) {
            float *o = buf + (g * 32 - k0 + 2 * kp) * NC;
            nibbles(nib + ((int64_t)g * 16 + kp) * NC, lo, hi);
            for (int j = 0; j < NV; j++) {
                *(vf *)(o + j * VW) = weight4(lo[j], dg[j], mg[j]);
                *(vf *)(o + NC + j * VW) = weight4(hi[j], dg[j], mg[j]);
            }
        }
    }
}

static void dequant8(const int8_t *q, const float *d, int k0, int k1, float *buf) {
    vf dc[NV], w[NV];
    for (int j = 0; j < NV; j++) dc[j] = LOAD(d + j * VW);
    for (int k = k0; k < k1; k++) {
        bytes(q + (int64_t)k * NC, w);
        for (int j = 0; j < NV; j++) *(vf *)(buf + (k - k0) * NC + j * VW) = w[j] * dc[j];
    }
}

/* Input values [k0, k1) of tile t of a quantized weight (bits 4 or 8), dequantized into buf (qgemm_bf16.c
   rounds it to pairs). */
void pd_dequant_tile(int bits, const void *w, const void *d, const void *m, int K, int t, int k0, int k1,
                         float *buf) {
    if (bits == 4)
        dequant4((const uint8_t *)w + (int64_t)t * (K / 2) * NC, (const uint16_t *)d + (int64_t)t * (K / 32) * NC,
                 (const uint16_t *)m + (int64_t)t * (K / 32) * NC, k0, k1, buf);
    else
        dequant8((const int8_t *)w + (int64_t)t * K * NC, (const float *)d + t * NC, k0, k1, buf);
}

/* rows x [mr, kn] (ldx apart) times buf [kn][16] into y [mr, 16] (ldy apart), added unless first. With
   pf, one cache line of it is prefetched every 2^sh steps (see rows_f32). */
static inline __attribute__((always_inline)) void micro(int mr, const float *x, int64_t ldx, const float *buf, int kn,
                                                        float *y, int64_t ldy, int first, const char *pf, int sh) {
    vf acc[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = (vf){0};
    for (int k = 0; k < kn; k++) {
        if (pf && (k & ((1 << sh) - 1)) == 0) __builtin_prefetch(pf + (k >> sh) * 64, 0, 2);
        vf w[NV];
        for (int j = 0; j < NV; j++) w[j] = *(const vf *)(buf + k * NC + j * VW);
        for (int i = 0; i < mr; i++) {
            const vf xb = splat(x + i * ldx + k);
            for (int j = 0; j < NV; j++) acc[i][j] += xb * w[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NV; j++) {
            vfu *o = (vfu *)(y + i * ldy + j * VW);
            *o = first ? acc[i][j] : *o + acc[i][j];
        }
}

/* Every row through one block, MR rows a call; a call's pf line range is its share of `next`'s bytes. */
static inline __attribute__((always_inline)) void rows_pf(int M, const float *x, int64_t ldx, const float *buf, int kn,
                                                          float *y, int64_t ldy, int first, const char *next,
                                                          int next_bytes) {
    const int calls = (M + MR - 1) / MR, lines = next_bytes / 64, per = (lines + calls - 1) / calls;
    int sh = 0;
    while (next && (2 << sh) * per <= kn) sh++;
    int i = 0, c = 0;
    for (; i + MR <= M; i += MR, c++)
        micro(MR, x + i * ldx, ldx, buf, kn, y + i * ldy, ldy, first, next ? next + (int64_t)c * per * 64 : 0, sh);
    const char *pf = next ? next + (int64_t)c * per * 64 : 0;
    x += i * ldx, y += i * ldy;
#define TAIL(r) case r: micro(r, x, ldx, buf, kn, y, ldy, first, pf, sh); break;
    switch (M - i) {  /* constant row counts, so each call unrolls */
#if MR > 6
        TAIL(11) TAIL(10) TAIL(9) TAIL(8) TAIL(7) TAIL(6)
#endif
        TAIL(5) TAIL(4) TAIL(3) TAIL(2) TAIL(1)
        default: break;
    }
#undef TAIL
}

/* Quantized weights: buf is the dequantized tile in L1, nothing to prefetch (a branch in the loop
   measured slower there). */
static void rows(int M, const float *x, int64_t ldx, const float *buf, int kn, float *y, int64_t ldy, int first) {
    rows_pf(M, x, ldx, buf, kn, y, ldy, first, 0, 0);
}

/* Float32 weights stream from memory into the micro-kernel as they lie: the first MR rows of a block
   would stall on it while the others find it in L1, so the next block (the next 16 KB, contiguous:
   also across tiles) is prefetched a line at a time, spread over the calls (the gain at 8 and 16
   rows: docs/benchmarks.md). Into L2 (T1), not L1: a batch-1 step streamed its weights faster so
   (the core's own L1 prefetcher brings the lines on), and more rows lost nothing. */
static void rows_f32(int M, const float *x, int64_t ldx, const float *w, int kn, float *y, int64_t ldy, int first) {
    rows_pf(M, x, ldx, w, kn, y, ldy, first, (const char *)(w + (int64_t)kn * NC), KB * NC * 4);
}

/* A few rows (DIRECT_ROWS): the weight is widened into registers and used at once. Within a group of 32 input
   values w = q * d + m, so sum x * w = d * sum x * q + m * sum x: the products take the nibbles as they
   are (no per-value dequantization), each group's sums are scaled once, and sx holds each row's sum of
   x over each group (computed once per call). Two steps run interleaved into separate accumulators
   (UN) where the registers hold them, one row at any width and two with one vector a tile row
   (AVX-512): with fewer chains of dependent FMAs their latency set the pace (docs/kernels.md). */
#define UN(mr) ((mr) == 1 || (NV == 1 && (mr) == 2) ? 2 : 1)
/* How far ahead of what they read the register rows (direct4, direct8) prefetch the weight, in bytes.
   A tile's groups follow each other and tiles follow each other, so the hardware prefetcher should
   find this stream, but a thread's chunks of tiles interleave with its peer's and each product of a
   decode step is small (0.2-1 MB), so it kept restarting. How far ahead pays depends on the
   machine's memory and on the model's shapes (docs/benchmarks.md), so it can be set
   (pd_qgemm_prefetch); PF_BYTES, the best of a Zen 4's batch-1 steps, unless set. */
#define PF_BYTES 2048
#define PF_MIN 512
#define PF_MAX 32768
static int pf_bytes = PF_BYTES;

int pd_qgemm_prefetch(int bytes) {
    if (bytes < 0) return __atomic_load_n(&pf_bytes, __ATOMIC_ACQUIRE);
    bytes = bytes < PF_MIN ? PF_MIN : bytes > PF_MAX ? PF_MAX : bytes;
    __atomic_store_n(&pf_bytes, bytes, __ATOMIC_RELEASE);
    return bytes;
}
/* The distance in units of `unit` bytes (an int4 group's nibbles, an int8 k's bytes, a byte). */
static inline int pf_ahead(int unit) { return __atomic_load_n(&pf_bytes, __ATOMIC_RELAXED) / unit; }
/* An int4 group's lines into L2 (T1), as the float32 rows' (rows_f32); int8's (direct8) keep T0, where
   T1 streamed slower. */
static inline void prefetch_group(const uint8_t *nib, const uint16_t *d, const uint16_t *m, int64_t g) {
    for (int b = 0; b < 16 * NC; b += 64) __builtin_prefetch(nib + g * 16 * NC + b, 0, 2);
    if ((g & 1) == 0) __builtin_prefetch(d + g * NC, 0, 2), __builtin_prefetch(m + g * NC, 0, 2);  /* 2 groups a line */
}
/* The same for group g (32 input values) of an int8 tile. */
static inline void prefetch_group8(const int8_t *q, int64_t g) {
    for (int b = 0; b < 32 * NC; b += 64) __builtin_prefetch(q + g * 32 * NC + b, 0, 2);
}
/* Rows that skip the buffer. With one vector a tile row (AVX-512) up to 8 rows' accumulators fit the
   32 registers (2 a row and its output, one chain: the rows interleave instead). With two (AVX2's
   16 registers) each row's output stays in y, read and written once a group, and beyond 2 rows a
   row's low and high nibbles share one chain a vector: 4 rows then hold 8 accumulators, 4 nibble
   vectors and the broadcasts, where keeping outputs in registers had spilled at 2 rows already.
   Past these rows the dequantized buffer wins: its cost per weight is spread over more rows. */
#ifndef DIRECT_ROWS
#define DIRECT_ROWS (NV == 1 ? 8 : 4)
#endif
static inline __attribute__((always_inline)) void direct4(int mr, const uint8_t *nib, const uint16_t *d,
                                                          const uint16_t *m, const float *x, int64_t ldx, int K,
                                                          const float *sx, float *y, int64_t ldy, int64_t left,
                                                          int lut) {
    const int un = UN(mr), split = NV == 1 || mr <= 2;
    vf out[NV == 1 ? DIRECT_ROWS : 1][NV], a[DIRECT_ROWS][2][2][NV], lo[NV], hi[NV], dg[NV], mg[NV];
    const int ahead = pf_ahead(16 * NC); /* never past `left` groups (the chunk's end): its peer's to read */
    if (NV == 1)
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < NV; j++) out[i][j] = (vf){0};
    for (int g = 0; g < K / 32; g++) {
        if (g + ahead < left) prefetch_group(nib, d, m, g + ahead); /* past the tile's end: the next tile's start */
        for (int i = 0; i < mr; i++)
            for (int u = 0; u < un; u++)
                for (int j = 0; j < NV; j++) a[i][u][0][j] = a[i][u][1][j] = (vf){0};
        for (int kp = 0; kp < 16; kp += un)
            for (int u = 0; u < un; u++) {
                const int k = g * 32 + 2 * (kp + u);
                if (lut)
                    nibbles_lut(nib + ((int64_t)g * 16 + kp + u) * NC, lo, hi);
                else
                    nibbles(nib + ((int64_t)g * 16 + kp + u) * NC, lo, hi);
                for (int i = 0; i < mr; i++) {
                    const vf xa = splat(x + i * ldx + k), xb = splat(x + i * ldx + k + 1);
                    for (int j = 0; j < NV; j++) {
                        a[i][u][0][j] += xa * lo[j];
                        if (split) a[i][u][1][j] += xb * hi[j];
                        else a[i][u][0][j] += xb * hi[j];
                    }
                }
            }
        halfs(d + g * NC, dg), halfs(m + g * NC, mg);
        for (int i = 0; i < mr; i++) {
            const vf s = splat(sx + i * (K / 32) + g);
            for (int j = 0; j < NV; j++) {
                vf t = a[i][0][0][j] + a[i][0][1][j];
                for (int u = 1; u < un; u++) t += a[i][u][0][j] + a[i][u][1][j];
                if (NV == 1) {
                    out[i][j] += t * dg[j] + s * mg[j];
                } else {
                    vfu *o = (vfu *)(y + i * ldy + j * VW);
                    *o = (g ? *o : (vf){0}) + t * dg[j] + s * mg[j];
                }
            }
        }
    }
    if (NV == 1)
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < NV; j++) *(vfu *)(y + i * ldy + j * VW) = out[i][j];
}

/* int8 rows that skip the buffer: a byte widens to a float and meets each row's broadcast in one FMA, so
   with a few rows one chain of dependent FMAs a row would set the pace (a whole FMA latency per 16
   weights: the output head of a batch-1 step ran at half the memory's rate): a few rows split k over
   CH8 interleaved accumulators each, summed pairwise at the end. With AVX-512's 32 registers about 8
   chains in all (8, 4, 2, 2 for 1-4 rows); with AVX2's 16, where a row's 16 channels take two
   registers, 8 and 2 for 1 and 2 rows (4 chains for 2 rows spilled and ran slower than one). */
#if VW == 16
#define CH8(mr) ((mr) == 1 ? 8 : (mr) == 2 ? 4 : (mr) <= 4 ? 2 : 1)
#else
#define CH8(mr) ((mr) == 1 ? 8 : (mr) == 2 ? 2 : 1)
#endif
static inline __attribute__((always_inline)) void direct8(int mr, const int8_t *q, const float *d, const float *x,
                                                          int64_t ldx, int K, float *y, int64_t ldy, int64_t left) {
    const int ch = CH8(mr), ahead = pf_ahead(NC); /* ch: 1, 2, 4 or 8 */
    vf acc[DIRECT_ROWS][8][NV], w[NV];
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < ch; c++)
            for (int j = 0; j < NV; j++) acc[i][c][j] = (vf){0};
    for (int k = 0; k < K; k += ch)
        for (int c = 0; c < ch; c++) {
            if (((k + c) & 3) == 0 && k + c + ahead < left) /* a line: 4 k; `left` k in the chunk */
                __builtin_prefetch(q + (int64_t)(k + c + ahead) * NC, 0, 3);
            bytes(q + (int64_t)(k + c) * NC, w);
            for (int i = 0; i < mr; i++) {
                const vf xb = splat(x + i * ldx + k + c);
                for (int j = 0; j < NV; j++) acc[i][c][j] += xb * w[j];
            }
        }
    for (int i = 0; i < mr; i++)
        for (int h = ch / 2; h > 0; h /= 2) /* the chains summed pairwise */
            for (int c = 0; c < h; c++)
                for (int j = 0; j < NV; j++) acc[i][c][j] += acc[i][c + h][j];
    for (int i = 0; i < mr; i++) /* the channel's scale once, at the end */
        for (int j = 0; j < NV; j++) *(vfu *)(y + i * ldy + j * VW) = acc[i][0][j] * LOAD(d + j * VW);
}

/* From how many rows int4's register rows look their nibbles up (nibbles_lut): the same floats either
   way; NO_LUT (off) until kernels/tuning.py measures it on this machine. */
#define NO_LUT (DIRECT_ROWS + 1)
static int lut_from = NO_LUT;

int pd_qgemm_lut_from(int rows) {
    if (!NIBBLE_LUT) return 0;
    if (rows < 0) return __atomic_load_n(&lut_from, __ATOMIC_ACQUIRE);
    rows = rows < 1 ? 1 : rows > NO_LUT ? NO_LUT : rows;
    __atomic_store_n(&lut_from, rows, __ATOMIC_RELEASE);
    return rows;
}

/* Up to DIRECT_ROWS rows of int4 or int8, each row count its own unrolled copy (and int4's with each
   way of widening its nibbles). Not inlined into pd_qgemm_tiles: there the register allocator, sizing
   the whole function with its 16 KB buffer, spilled a nibble vector and the mask of AVX2's one row to
   the stack inside the loop. */
static __attribute__((noinline)) void direct(int bits, int M, const uint8_t *t4, const int8_t *t8,
                                             const uint16_t *td, const uint16_t *tm, const float *ts,
                                             const float *x, int64_t ldx, int K, const float *sx, float *y,
                                             int64_t ldy, int tiles_left) {
    const int lut = NIBBLE_LUT && M >= __atomic_load_n(&lut_from, __ATOMIC_RELAXED);
#define ROWS(r) case r: if (bits == 4 && lut) direct4(r, t4, td, tm, x, ldx, K, sx, y, ldy, (int64_t)tiles_left * (K / 32), 1); \
                        else if (bits == 4) direct4(r, t4, td, tm, x, ldx, K, sx, y, ldy, (int64_t)tiles_left * (K / 32), 0); \
                        else direct8(r, t8, ts, x, ldx, K, y, ldy, (int64_t)tiles_left * K); break;
    switch (M) {
        ROWS(1) ROWS(2)
#if DIRECT_ROWS > 2
        ROWS(3) ROWS(4)
#endif
#if DIRECT_ROWS > 4
        ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#endif
        default: break;
    }
#undef ROWS
}

/* model.batch_invariant's bound (qgemm.h): products of up to this many rows skip the register rows
   above, whose sums run in another order than the dequantized block's (and than each other's: one
   chain or two a row), so a row's result does not depend on how many rows share its product. A
   speculative verify step needs that: its rows must compute what a plain decode step computes. */
#define INVARIANT_MAX 4096
static int invariant_rows;

int pd_qgemm_invariant(int rows) {
    if (rows < 0) return __atomic_load_n(&invariant_rows, __ATOMIC_ACQUIRE);
    rows = rows > INVARIANT_MAX ? INVARIANT_MAX : rows;
    __atomic_store_n(&invariant_rows, rows, __ATOMIC_RELEASE);
    return rows;
}

int pd_qgemm_invariant_at(int M) { return M <= __atomic_load_n(&invariant_rows, __ATOMIC_ACQUIRE); }

/* Up to INVARIANT_DIRECT rows of `nt` tiles (1 or 2, adjacent) under the bound, where a tile row is two
   vectors (AVX2, the portable build): the dequantized block's sums exactly (each weight rounded once as
   dequant4 or dequant8 rounds it, each output's chain over a block of KB input values in order from
   zero, the blocks added to y in order), the weight widened in registers instead of through the
   buffer. At one row the block's micro-kernel holds two chains of dependent FMAs and waits on their
   latency; one row here runs two tiles' chains interleaved, and no element's order changes. */
#define INVARIANT_DIRECT 4
static inline __attribute__((always_inline)) void invariant_rows4(int mr, int nt, int bits, const uint8_t *t4,
                                                                  const int8_t *t8, const uint16_t *td,
                                                                  const uint16_t *tm, const float *ts, const float *x,
                                                                  int64_t ldx, int K, float *y, int64_t ldy,
                                                                  int64_t left) {
    const int64_t n4 = (int64_t)(K / 2) * NC, n8 = (int64_t)K * NC, ng = (int64_t)(K / 32) * NC; /* a tile's */
    const int ahead = bits == 4 ? pf_ahead(16 * NC) : pf_ahead(32 * NC);   /* in groups of 32 values */
    vf dc[2][NV];
    if (bits == 8)
        for (int t = 0; t < nt; t++)
            for (int j = 0; j < NV; j++) dc[t][j] = LOAD(ts + t * NC + j * VW);
    for (int k0 = 0; k0 < K; k0 += KB) {
        const int k1 = k0 + KB < K ? k0 + KB : K;
        vf acc[4][2][NV];
        for (int i = 0; i < mr; i++)
            for (int t = 0; t < nt; t++)
                for (int j = 0; j < NV; j++) acc[i][t][j] = (vf){0};
        for (int g = k0 / 32; g < k1 / 32; g++) {
            const int64_t p = (int64_t)(nt - 1) * (K / 32) + g + ahead;  /* the last tile's group ahead */
            if (p < left && bits == 4) prefetch_group(t4, td, tm, p);
            else if (p < left) prefetch_group8(t8, p);
            if (bits == 4) {
                vf dg[2][NV], mg[2][NV];
                for (int t = 0; t < nt; t++) halfs(td + t * ng + g * NC, dg[t]), halfs(tm + t * ng + g * NC, mg[t]);
                for (int kp = 0; kp < 16; kp++) {
                    const int k = g * 32 + 2 * kp;
                    for (int t = 0; t < nt; t++) {
                        vf lo[NV], hi[NV], wl[NV], wh[NV];
                        nibbles(t4 + t * n4 + ((int64_t)g * 16 + kp) * NC, lo, hi);
                        for (int j = 0; j < NV; j++) wl[j] = weight4(lo[j], dg[t][j], mg[t][j]);
                        for (int j = 0; j < NV; j++) wh[j] = weight4(hi[j], dg[t][j], mg[t][j]);
                        for (int i = 0; i < mr; i++) {
                            const vf xa = splat(x + i * ldx + k);
                            for (int j = 0; j < NV; j++) acc[i][t][j] += xa * wl[j];
                        }
                        for (int i = 0; i < mr; i++) {
                            const vf xb = splat(x + i * ldx + k + 1);
                            for (int j = 0; j < NV; j++) acc[i][t][j] += xb * wh[j];
                        }
                    }
                }
            } else {
                for (int k = g * 32; k < g * 32 + 32; k++)
                    for (int t = 0; t < nt; t++) {
                        vf q[NV], w[NV];
                        bytes(t8 + t * n8 + (int64_t)k * NC, q);
                        for (int j = 0; j < NV; j++) w[j] = q[j] * dc[t][j];
                        for (int i = 0; i < mr; i++) {
                            const vf xk = splat(x + i * ldx + k);
                            for (int j = 0; j < NV; j++) acc[i][t][j] += xk * w[j];
                        }
                    }
            }
        }
        for (int i = 0; i < mr; i++)
            for (int t = 0; t < nt; t++)
                for (int j = 0; j < NV; j++) {
                    vfu *o = (vfu *)(y + i * ldy + t * NC + j * VW);
                    *o = k0 == 0 ? acc[i][t][j] : *o + acc[i][t][j];
                }
    }
}

/* Up to DIRECT_ROWS rows through int4: each row's sum over each group of 32 input values, sx [M][K/32]
   (callers size sx for 8 rows). */
void pd_qgemm_sums(int bits, const float *x, int64_t ldx, int M, int K, float *sx) {
    if (bits == 4 && M <= DIRECT_ROWS)
        for (int i = 0; i < M; i++)
            for (int g = 0; g < K / 32; g++) {
                float s = 0.0f;
                for (int k = g * 32; k < g * 32 + 32; k++) s += x[i * ldx + k];
                sx[i * (K / 32) + g] = s;
            }
}

/* Output tiles [t0, t1) (16 channels each) of the product; sx from pd_qgemm_sums. A tile's result
   does not depend on which thread computes it or with which others. */
void pd_qgemm_tiles(int bits, const void *w, const void *d, const void *m, const float *x, int64_t ldx, float *y,
                    int64_t ldy, int M, int K, const float *sx, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        float *yt = y + t * NC;
        const uint8_t *t4 = (const uint8_t *)w + (int64_t)t * (K / 2) * NC;
        const int8_t *t8 = (const int8_t *)w + (int64_t)t * K * NC;
        const uint16_t *td = (const uint16_t *)d + (int64_t)t * (K / 32) * NC, *tm = (const uint16_t *)m + (int64_t)t * (K / 32) * NC;
        const float *ts = (const float *)d + t * NC;
        if (bits == 32) {   /* float32: the tile is its own buffer */
            const float *tf = (const float *)w + (int64_t)t * K * NC;
            for (int k0 = 0; k0 < K; k0 += KB)
                rows_f32(M, x + k0, ldx, tf + (int64_t)k0 * NC, (k0 + KB < K ? KB : K - k0), yt, ldy, k0 == 0);
            continue;
        }
        if (M <= DIRECT_ROWS && !pd_qgemm_invariant_at(M)) {
            if (t == t0 && bits == 4) /* a chunk's first bytes: no earlier tile prefetched them */
                for (int g = 0, n = pf_ahead(16 * NC); g < n && g < K / 32; g++) prefetch_group(t4, td, tm, g);
            else if (t == t0)
                for (int b = 0, n = pf_ahead(1); b < n && b < K * NC; b += 64) __builtin_prefetch(t8 + b, 0, 3);
            direct(bits, M, t4, t8, td, tm, ts, x, ldx, K, sx, yt, ldy, t1 - t);
            continue;
        }
        if (NV == 2 && M <= INVARIANT_DIRECT) {   /* invariant: the register rows above took the rest */
            const int64_t left = (int64_t)(t1 - t) * (K / 32);
#define INV(r, n) invariant_rows4(r, n, bits, t4, t8, td, tm, ts, x, ldx, K, yt, ldy, left)
            if (M == 1 && t + 1 < t1) INV(1, 2), t++;
            else if (M == 1) INV(1, 1);
            else if (M == 2) INV(2, 1);
            else if (M == 3) INV(3, 1);
            else INV(4, 1);
#undef INV
            continue;
        }
        float buf[KB * NC] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < K; k0 += KB) {
            const int k1 = k0 + KB < K ? k0 + KB : K;
            pd_dequant_tile(bits, w, d, m, K, t, k0, k1, buf);
            rows(M, x + k0, ldx, buf, k1 - k0, yt, ldy, k0 == 0);
        }
    }
}

/* Rows ids [n] of an int8 weight in its tile layout (q [N/16][K][16], d [N] floats) as floats, q * d
   (an embedding lookup from the tied head): the tile layout keeps a row's values 16 apart, a gather
   that torch's advanced indexing ran through its generic index kernel. Returns 0, or -1 where an id
   is not a row (nothing written). */
int pd_qgemm_rows8(const int8_t *w, const float *d, const int64_t *ids, int n, int N, int K, float *out) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    for (int i = 0; i < n; i++) {
        const int64_t o = ids[i];
        const int8_t *t = w + (o / NC) * (int64_t)K * NC + o % NC;
        const float s = d[o];
        for (int k = 0; k < K; k++) out[(int64_t)i * K + k] = (float)t[(int64_t)k * NC] * s;
    }
    return 0;
}

/* bits: 4, 8 or 32 (the layouts above; d and m float16 for 4, d float for 8), or 4 | PD_AQ8 (qgemm_q8.c). A small product (one row
   through a small matrix) runs on the calling thread: waking the pool costs more than the work. */
void pd_qgemm(int bits, const void *w, const void *d, const void *m, const float *x, int64_t ldx, float *y,
              int64_t ldy, int M, int N, int K, int threads) {
    const int64_t work = (int64_t)M * N * K;
    void *xq = pd_qgemm_q8_x(bits, x, ldx, M, K);     /* qgemm_q8.c: int4 with int8 activations */
    if (xq) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work >= (1 << 17))
        for (int t = 0; t < N / NC; t++) pd_qgemm_q8_tiles(bits, w, d, m, xq, y, ldy, M, K, t, t + 1);
        pd_qgemm_q8_free(xq);
        return;
    }
    uint16_t *xb = pd_qgemm_bf16_x(bits, x, ldx, M, K);     /* qgemm_bf16.c: NULL below its rows */
    if (xb) {
#pragma omp parallel num_threads(threads) if (threads > 1)
        {   /* one call per thread with its share of the tiles: a call configures AMX's tiles once */
            const int nt = N / NC, th = omp_get_num_threads(), id = omp_get_thread_num();
            pd_qgemm_bf16_tiles(bits, w, d, m, xb, y, ldy, M, K, (int)((int64_t)nt * id / th),
                                (int)((int64_t)nt * (id + 1) / th));
        }
        pd_qgemm_bf16_free(xb);
        return;
    }
    float sx[8 * (K / 32) + 1];
    pd_qgemm_sums(bits, x, ldx, M, K, sx);
#pragma omp parallel num_threads(threads) if (threads > 1 && work >= (1 << 17))
    {   /* one call per thread with its share of the tiles: its prefetch runs on from tile to tile */
        const int nt = N / NC, th = omp_get_num_threads(), id = omp_get_thread_num();
        pd_qgemm_tiles(bits, w, d, m, x, ldx, y, ldy, M, K, sx, (int)((int64_t)nt * id / th),
                       (int)((int64_t)nt * (id + 1) / th));
    }
}
