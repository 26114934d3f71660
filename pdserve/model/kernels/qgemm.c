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
   same tiled layout runs the same micro-kernel (MKL's small-M paths read it 2-3x slower here). Written with GCC vector
   extensions: the vector width and FMA come from the build's -m flags (native.py), so the same
   source builds anywhere; the AVX2 intrinsics only widen bytes and broadcast.

   Weight layouts, prepared once at load (quant.py), per tile t of 16 output channels:
     int4: nib[t][k/2][c] uint8 (value k of channel c in the low nibble, k+1 in the high nibble),
           d[t][k/32][c], m[t][k/32][c] float16 (as GGUF stores them): w = q * d + m
     int8: q[t][k][c] int8, d[t][c] float: w = q * d (m unused)
     float32: w[t][k][c] (d, m unused): the same micro-kernel, reading the weight where it lies
   x: [M, K] rows ldx floats apart; y: [M, N] rows ldy floats apart. K % 32 == 0, N % 16 == 0. */
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));

#define NC 16   /* output channels per tile: two 8-float vectors */
#define KB 256  /* input values per buffered block: 16 KB of floats, in L1 */
#define MR 6    /* rows per micro-kernel call: 12 accumulators + 2 weight vectors + 1 broadcast */

#ifdef __AVX2__
#include <immintrin.h>
/* 8 nibbles (the low or high halves of 8 bytes) as floats. */
static inline v8f nibbles(const uint8_t *b, int high) {
    __m128i v = _mm_loadl_epi64((const __m128i *)b);
    if (high) v = _mm_srli_epi16(v, 4);
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(15))));
}
static inline v8f bytes(const int8_t *b) {
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)b)));
}
static inline v8f splat(const float *p) { return (v8f)_mm256_broadcast_ss(p); }
#else
static inline v8f splat(const float *p) { return (v8f){*p, *p, *p, *p, *p, *p, *p, *p}; }
static inline v8f nibbles(const uint8_t *b, int high) {
    v8f o;
    for (int j = 0; j < 8; j++) o[j] = (float)(high ? b[j] >> 4 : b[j] & 15);
    return o;
}
static inline v8f bytes(const int8_t *b) {
    v8f o;
    for (int j = 0; j < 8; j++) o[j] = (float)b[j];
    return o;
}
#endif

#ifdef __F16C__
static inline v8f halfs(const uint16_t *p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline float half(uint16_t h) {  /* IEEE binary16 -> float, subnormals included */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, f = h & 1023;
    union { uint32_t u; float f; } v;
    if (e == 31) v.u = sign | 0x7f800000u | (f << 13);
    else if (e) v.u = sign | ((e + 112) << 23) | (f << 13);
    else { v.f = (float)f * (1.0f / 16777216.0f); v.u |= sign; }
    return v.f;
}
static inline v8f halfs(const uint16_t *p) {
    v8f o;
    for (int j = 0; j < 8; j++) o[j] = half(p[j]);
    return o;
}
#endif

#define LOAD(p) (*(const v8fu *)(p))

/* The weight of one tile: its input values [k0, k1) into buf [k1 - k0][16]. */
static void dequant4(const uint8_t *nib, const uint16_t *d, const uint16_t *m, int k0, int k1, float *buf) {
    for (int g = k0 / 32; g < k1 / 32; g++) {
        const v8f d0 = halfs(d + g * NC), d1 = halfs(d + g * NC + 8), m0 = halfs(m + g * NC), m1 = halfs(m + g * NC + 8);
        for (int kp = 0; kp < 16; kp++) {
            const uint8_t *b = nib + ((int64_t)g * 16 + kp) * NC;
            float *o = buf + (g * 32 - k0 + 2 * kp) * NC;
            *(v8f *)o = nibbles(b, 0) * d0 + m0;
            *(v8f *)(o + 8) = nibbles(b + 8, 0) * d1 + m1;
            *(v8f *)(o + NC) = nibbles(b, 1) * d0 + m0;
            *(v8f *)(o + NC + 8) = nibbles(b + 8, 1) * d1 + m1;
        }
    }
}

static void dequant8(const int8_t *q, const float *d, int k0, int k1, float *buf) {
    const v8f d0 = LOAD(d), d1 = LOAD(d + 8);
    for (int k = k0; k < k1; k++) {
        float *o = buf + (k - k0) * NC;
        *(v8f *)o = bytes(q + (int64_t)k * NC) * d0;
        *(v8f *)(o + 8) = bytes(q + (int64_t)k * NC + 8) * d1;
    }
}

/* rows x [mr, kn] (ldx apart) times buf [kn][16] into y [mr, 16] (ldy apart), added unless first. With
   pf, one cache line of it is prefetched every 2^sh steps (see rows_f32). */
static inline __attribute__((always_inline)) void micro(int mr, const float *x, int64_t ldx, const float *buf, int kn,
                                                        float *y, int64_t ldy, int first, const char *pf, int sh) {
    v8f acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = (v8f){0};
    for (int k = 0; k < kn; k++) {
        if (pf && (k & ((1 << sh) - 1)) == 0) __builtin_prefetch(pf + (k >> sh) * 64, 0, 3);
        const v8f w0 = *(const v8f *)(buf + k * NC), w1 = *(const v8f *)(buf + k * NC + 8);
        for (int i = 0; i < mr; i++) {
            const v8f xb = splat(x + i * ldx + k);
            acc[i][0] += xb * w0;
            acc[i][1] += xb * w1;
        }
    }
    for (int i = 0; i < mr; i++) {
        v8fu *o0 = (v8fu *)(y + i * ldy), *o1 = (v8fu *)(y + i * ldy + 8);
        *o0 = first ? acc[i][0] : *o0 + acc[i][0];
        *o1 = first ? acc[i][1] : *o1 + acc[i][1];
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
    switch (M - i) {  /* constant row counts, so each call unrolls */
        case 5: micro(5, x + i * ldx, ldx, buf, kn, y + i * ldy, ldy, first, pf, sh); break;
        case 4: micro(4, x + i * ldx, ldx, buf, kn, y + i * ldy, ldy, first, pf, sh); break;
        case 3: micro(3, x + i * ldx, ldx, buf, kn, y + i * ldy, ldy, first, pf, sh); break;
        case 2: micro(2, x + i * ldx, ldx, buf, kn, y + i * ldy, ldy, first, pf, sh); break;
        case 1: micro(1, x + i * ldx, ldx, buf, kn, y + i * ldy, ldy, first, pf, sh); break;
        default: break;
    }
}

/* Quantized weights: buf is the dequantized tile in L1, nothing to prefetch (a branch in the loop
   measured slower there). */
static void rows(int M, const float *x, int64_t ldx, const float *buf, int kn, float *y, int64_t ldy, int first) {
    rows_pf(M, x, ldx, buf, kn, y, ldy, first, 0, 0);
}

/* Float32 weights stream from memory into the micro-kernel as they lie: the first MR rows of a block
   would stall on it while the others find it in L1, so the next block (the next 16 KB, contiguous:
   also across tiles) is prefetched a line at a time, spread over the calls. Measured in C over the
   model's 120 GEMMs on 2 threads: 8 rows 39 -> 32 ms, 16 rows 56 -> 40 ms. */
static void rows_f32(int M, const float *x, int64_t ldx, const float *w, int kn, float *y, int64_t ldy, int first) {
    rows_pf(M, x, ldx, w, kn, y, ldy, first, (const char *)(w + (int64_t)kn * NC), KB * NC * 4);
}

/* One or two rows: the weight is dequantized into registers and used at once. */
static inline __attribute__((always_inline)) void direct4(int mr, const uint8_t *nib, const uint16_t *d,
                                                          const uint16_t *m, const float *x, int64_t ldx, int K,
                                                          float *y, int64_t ldy) {
    v8f acc[2][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = (v8f){0};
    for (int g = 0; g < K / 32; g++) {
        const v8f d0 = halfs(d + g * NC), d1 = halfs(d + g * NC + 8), m0 = halfs(m + g * NC), m1 = halfs(m + g * NC + 8);
        for (int kp = 0; kp < 16; kp++) {
            const uint8_t *b = nib + ((int64_t)g * 16 + kp) * NC;
            const int k = g * 32 + 2 * kp;
            const v8f a0 = nibbles(b, 0) * d0 + m0, a1 = nibbles(b + 8, 0) * d1 + m1;
            const v8f b0 = nibbles(b, 1) * d0 + m0, b1 = nibbles(b + 8, 1) * d1 + m1;
            for (int i = 0; i < mr; i++) {
                const v8f xa = splat(x + i * ldx + k), xb = splat(x + i * ldx + k + 1);
                acc[i][0] += xa * a0 + xb * b0;
                acc[i][1] += xa * a1 + xb * b1;
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        *(v8fu *)(y + i * ldy) = acc[i][0];
        *(v8fu *)(y + i * ldy + 8) = acc[i][1];
    }
}

static inline __attribute__((always_inline)) void direct8(int mr, const int8_t *q, const float *d, const float *x,
                                                          int64_t ldx, int K, float *y, int64_t ldy) {
    v8f acc[2][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = (v8f){0};
    for (int k = 0; k < K; k++) {
        const v8f w0 = bytes(q + (int64_t)k * NC), w1 = bytes(q + (int64_t)k * NC + 8);
        for (int i = 0; i < mr; i++) {
            const v8f xb = splat(x + i * ldx + k);
            acc[i][0] += xb * w0;
            acc[i][1] += xb * w1;
        }
    }
    const v8f d0 = LOAD(d), d1 = LOAD(d + 8);  /* the channel's scale once, at the end */
    for (int i = 0; i < mr; i++) {
        *(v8fu *)(y + i * ldy) = acc[i][0] * d0;
        *(v8fu *)(y + i * ldy + 8) = acc[i][1] * d1;
    }
}

/* bits: 4, 8 or 32 (the layouts above; d and m float16 for 4, d float for 8). A small product (one row
   through a small matrix) runs on the calling thread: waking the pool costs more than the work. */
void pd_qgemm(int bits, const void *w, const void *d, const void *m, const float *x, int64_t ldx, float *y,
              int64_t ldy, int M, int N, int K, int threads) {
    const int64_t work = (int64_t)M * N * K;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work >= (1 << 17))
    for (int t = 0; t < N / NC; t++) {
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
        if (M <= 2) {
            if (bits == 4 && M == 1) direct4(1, t4, td, tm, x, ldx, K, yt, ldy);
            else if (bits == 4) direct4(2, t4, td, tm, x, ldx, K, yt, ldy);
            else if (M == 1) direct8(1, t8, ts, x, ldx, K, yt, ldy);
            else direct8(2, t8, ts, x, ldx, K, yt, ldy);
            continue;
        }
        float buf[KB * NC] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < K; k0 += KB) {
            const int k1 = k0 + KB < K ? k0 + KB : K;
            if (bits == 4) dequant4(t4, td, tm, k0, k1, buf);
            else dequant8(t8, ts, k0, k1, buf);
            rows(M, x + k0, ldx, buf, k1 - k0, yt, ldy, k0 == 0);
        }
    }
}
