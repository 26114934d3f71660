/* Decode attention over the paged KV cache, read in place.

   The torch path (model/attention.py) gathers each sequence's blocks into a padded copy before
   scaled_dot_product_attention; at 32 streams that copy and the padded kernel cost more than the
   layer's GEMMs. Here each (sequence, KV head) pair walks its block table and reads keys and values
   where they lie: one read of the context, no copy, no padding. Softmax in two passes (scores, then
   weights), float32 throughout. Parallel over (sequence, KV head) pairs with OpenMP; built and loaded
   by native.py, which links the OpenMP runtime torch already loaded.

   q:      [n, H, D] floats, row stride q_row (elements), heads contiguous (stride D)
   kc, vc: one layer's cache [slots, KVH, D] contiguous; slot = block * bs + offset; float32, or
           bfloat16 (kvb: cache.kv_dtype), each block's rows widened to float32 as they are read
   tables: [n, tstride] int64 block ids; first, ctx: [n] int64, the attended positions [first, ctx)
   out:    [n, H, D] contiguous */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "scratch.h"

/* Head dimensions that are a multiple of 8 take the vector paths (vec.h); others the scalar loops. */
#include "vec.h"

/* Dot products of one query head with a run of key rows, `W` rows at a time (W = 16 with AVX-512 where
   D % 16 == 0, else 8). A row's D products are summed in order into one W-lane vector, then its W lanes
   are added pairwise in levels (lane j with j + W/2, then + W/4, ...). A horizontal sum per row spent
   most of the scores' time in shuffles and scalar adds; here the levels fold two vectors into one, so
   W rows share each shuffle, and the folds leave row r in lane bitreverse(r), put back in row order by
   one permute. Each fold adds lanes of one row only: a row's score is the same whichever rows share
   its vectors (a short run's missing rows are zeros) and whichever thread computes it. Each chain of
   products starts from zero: `x * y + z * w` may be contracted around either product, so a first
   product as the chain's start would leave its rounding to the compiler (and differ between builds). */
static inline v8f dot8(const float *q, const float *k, int D) {
    /* the even eights in one chain and the odd in another, as dot16's lanes 0-7 and 8-15 */
    v8f a = (v8f){0}, b = (v8f){0};
    int d = 0;
    for (; d + 16 <= D; d += 16) a += LD(q + d) * LD(k + d), b += LD(q + d + 8) * LD(k + d + 8);
    if (d < D) a += LD(q + d) * LD(k + d);
    return a + b;
}
static inline v8f fold8a(v8f a, v8f b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline v8f fold8b(v8f a, v8f b) {
    return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
static inline v8f fold8c(v8f a, v8f b) {
    return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}
/* q's dot products with m <= 8 rows (ks apart), lane r for row r (lanes from m on 0). */
static inline v8f dots8(const float *q, const float *k, int64_t ks, int m, int D) {
    v8f w[8];
    for (int r = 0; r < 8; r++) w[r] = r < m ? dot8(q, k + r * ks, D) : (v8f){0};
    const v8f x = fold8c(fold8b(fold8a(w[0], w[1]), fold8a(w[2], w[3])), fold8b(fold8a(w[4], w[5]), fold8a(w[6], w[7])));
    return __builtin_shufflevector(x, x, 0, 4, 2, 6, 1, 5, 3, 7);
}

/* Prefetches every line of nbytes from p into L1, or into L2 only (l2). */
static inline void fetch_lines(const void *p, int64_t nbytes, int l2) {
    for (const char *b = (const char *)p, *e = b + nbytes; b < e; b += 64)
        l2 ? __builtin_prefetch(b, 0, 1) : __builtin_prefetch(b, 0, 3);
}

/* Row r (nbytes of a bfloat16 cache row, rows rs values apart) of the next block's nn rows from `next`
   into L1 and of the block after it (na rows from `after`) into L2; a count of 0: none. A walk over a
   block prefetches a row of each as it reads a row: a block's prefetches issued all at once filled
   the core's line buffers and stalled it on them. */
static inline void fetch_ahead(const uint16_t *next, int64_t nn, const uint16_t *after, int64_t na, int64_t r,
                               int64_t rs, int64_t nbytes) {
    if (r < nn) fetch_lines(next + r * rs, nbytes, 0);
    if (r < na) fetch_lines(after + r * rs, nbytes, 1);
}

#ifdef __AVX512F__
/* The most query heads a KV head's in-place bfloat16 passes take at once (scores64_bf16, pv64_bf16):
   their partial sums in registers. */
#define PV_GROUP 4
static inline v16f dot16(const float *q, const float *k, int D) {
    v16f c = (v16f){0};
    for (int d = 0; d < D; d += 16) c += LD16(q + d) * LD16(k + d);
    return c;
}
static inline v16f fold16a(v16f a, v16f b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline v16f fold16b(v16f a, v16f b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
static inline v16f fold16c(v16f a, v16f b) {
    return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
static inline v16f fold16d(v16f a, v16f b) {
    return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
/* Eight pairs of rows, each pair folded once (fold16a), to sixteen sums in row order. */
static inline v16f fold16(v16f w0, v16f w1, v16f w2, v16f w3, v16f w4, v16f w5, v16f w6, v16f w7) {
    const v16f x = fold16d(fold16c(fold16b(w0, w1), fold16b(w2, w3)), fold16c(fold16b(w4, w5), fold16b(w6, w7)));
    return __builtin_shufflevector(x, x, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
/* q's dot products with m <= 16 rows (ks apart), lane r for row r (lanes from m on 0). A whole run
   has no test per row, so its vectors stay in registers. */
#define PD_PAIR(p) fold16a(dot16(q, k + (2 * (p)) * ks, D), dot16(q, k + (2 * (p) + 1) * ks, D))
static inline v16f dots16(const float *q, const float *k, int64_t ks, int m, int D) {
    if (m == 16) return fold16(PD_PAIR(0), PD_PAIR(1), PD_PAIR(2), PD_PAIR(3), PD_PAIR(4), PD_PAIR(5), PD_PAIR(6), PD_PAIR(7));
    v16f w[16];
    for (int r = 0; r < 16; r++) w[r] = r < m ? dot16(q, k + r * ks, D) : (v16f){0};
    return fold16(fold16a(w[0], w[1]), fold16a(w[2], w[3]), fold16a(w[4], w[5]), fold16a(w[6], w[7]),
                  fold16a(w[8], w[9]), fold16a(w[10], w[11]), fold16a(w[12], w[13]), fold16a(w[14], w[15]));
}
#undef PD_PAIR

/* The scores (times `scale`) of G query heads of one KV head (G <= PV_GROUP; head g's query at
   q + 64 g) against n rows of a bfloat16 cache read in place (ks apart), head g's stored from
   s + g * ls: each 16-value run of a row is widened once in registers (zero-extended, shifted to a
   float's upper half: exact) for all G heads, where a widened copy cost a store and a load of every
   value besides. Each head's products and folds are dots16's, in its order, so a score has the bits
   it has from a float32 cache holding the same values. Rows of the next and the following block are
   prefetched meanwhile, as pv64_bf16 does. */
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef int32_t v16iu __attribute__((vector_size(64), aligned(2)));   /* a cache row's pairs: no alignment assumed */
static inline v16f widen16(const uint16_t *p) {
    return (v16f)(__builtin_convertvector(*(const v16h *)p, v16i) << 16);
}
static inline __attribute__((always_inline)) void scores64_bf16(const int G, const float *q, const uint16_t *k,
                                                                int64_t ks, int64_t n, float scale, float *s,
                                                                int64_t ls, const uint16_t *next, int64_t nn,
                                                                const uint16_t *after, int64_t na) {
    for (int64_t c = 0; c < n; c += 16) {
        const int m = n - c < 16 ? (int)(n - c) : 16;
        v16f quad[PV_GROUP], half[PV_GROUP], pair[PV_GROUP];
        for (int pr = 0; pr < 8; pr++) {
            for (int64_t u = c + 2 * pr; u < c + 2 * pr + 2; u++) fetch_ahead(next, nn, after, na, u, ks, 128);
            const uint16_t *k0 = k + (c + 2 * pr) * ks, *k1 = k0 + ks;
            v16f x[4], y[4];
            for (int d = 0; d < 4; d++) {
                x[d] = 2 * pr < m ? widen16(k0 + 16 * d) : (v16f){0};
                y[d] = 2 * pr + 1 < m ? widen16(k1 + 16 * d) : (v16f){0};
            }
            for (int g = 0; g < G; g++) {
                v16f a = (v16f){0}, b = (v16f){0};
                if (2 * pr < m)
                    for (int d = 0; d < 4; d++) a += LD16(q + g * 64 + 16 * d) * x[d];
                if (2 * pr + 1 < m)
                    for (int d = 0; d < 4; d++) b += LD16(q + g * 64 + 16 * d) * y[d];
                const v16f w = fold16a(a, b);
                if (pr % 2 == 0) {
                    pair[g] = w;
                    continue;
                }
                const v16f t = fold16b(pair[g], w);
                if (pr == 1 || pr == 5) {
                    half[g] = t;
                } else if (pr == 3) {
                    quad[g] = fold16c(half[g], t);
                } else {
                    const v16f f = fold16d(quad[g], fold16c(half[g], t));
                    const v16f sc = __builtin_shufflevector(f, f, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15) * scale;
                    float *sh = s + g * ls + c;
                    if (m == 16)
                        *(v16fu *)sh = sc;
                    else
                        for (int r = 0; r < m; r++) sh[r] = sc[r];
                }
            }
        }
    }
}
/* scores64_bf16 for any G: more heads than PV_GROUP in groups, each reading the rows again (from L1),
   the first prefetching. */
static void scores64_bf16_heads(int G, const float *q, const uint16_t *k, int64_t ks, int64_t n, float scale, float *s,
                                int64_t ls, const uint16_t *next, int64_t nn, const uint16_t *after, int64_t na) {
    for (int g0 = 0; g0 < G; g0 += PV_GROUP, nn = 0, na = 0) {
        const float *qg = q + g0 * 64;
        float *sg = s + g0 * ls;
        switch (G - g0) {   /* the group's size as a constant: the partial folds stay in registers */
        case 1: scores64_bf16(1, qg, k, ks, n, scale, sg, ls, next, nn, after, na); break;
        case 2: scores64_bf16(2, qg, k, ks, n, scale, sg, ls, next, nn, after, na); break;
        case 3: scores64_bf16(3, qg, k, ks, n, scale, sg, ls, next, nn, after, na); break;
        default: scores64_bf16(4, qg, k, ks, n, scale, sg, ls, next, nn, after, na); break;
        }
    }
}
#endif

/* Scores (times `scale`) of the query heads [0, nhg) at qb (D apart) against rows [0, n) of a block,
   ws apart (head hg's keys at k + (hoff + hg / G) * D in each), head hg's stored from s + hg * len. */
static inline void scores(const float *qb, const float *k, int64_t ws, int64_t n, int nhg, int G, int hoff, int D,
                          float scale, float *s, int64_t len) {
#ifdef __AVX512F__
    if (D % 16 == 0) {
        for (int64_t c = 0; c < n; c += 16) {
            const int m = n - c < 16 ? (int)(n - c) : 16;
            for (int hg = 0; hg < nhg; hg++) {
                const float *qg = qb + (int64_t)hg * D, *kg = k + c * ws + (int64_t)(hoff + hg / G) * D;
                /* D = 64 (SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B) as a constant: its loops unrolled */
                const v16f sc = (D == 64 ? dots16(qg, kg, ws, m, 64) : dots16(qg, kg, ws, m, D)) * scale;
                float *sh = s + hg * len + c;
                if (m == 16)
                    *(v16fu *)sh = sc;
                else
                    for (int r = 0; r < m; r++) sh[r] = sc[r];
            }
        }
        return;
    }
#endif
    for (int64_t c = 0; c < n; c += 8) {
        const int m = n - c < 8 ? (int)(n - c) : 8;
        for (int hg = 0; hg < nhg; hg++) {
            const float *qg = qb + (int64_t)hg * D, *kg = k + c * ws + (int64_t)(hoff + hg / G) * D;
            const v8f sc = dots8(qg, kg, ws, m, D) * scale;
            float *sh = s + hg * len + c;
            if (m == 8)
                *(v8fu *)sh = sc;
            else
                for (int r = 0; r < m; r++) sh[r] = sc[r];
        }
    }
}

/* acc[0:64] += sum over the n rows v (vstride apart) of p[u] * v[u] (rows of one block), acc
   held in eight registers meanwhile: the context's sum is built a block at a time, in position order,
   so it is the same sum as one pass over the context would give. */
static inline void pv64(const float *p, int64_t n, const float *v, int64_t vstride, float *acc) {
#ifdef __AVX512F__   /* the same sums per element, four 16-float registers */
    v16fu *o = (v16fu *)acc;
    v16f a0 = o[0], a1 = o[1], a2 = o[2], a3 = o[3];
    for (int64_t u = 0; u < n; u++, v += vstride) {
        const float w = p[u];
        a0 += w * LD16(v), a1 += w * LD16(v + 16), a2 += w * LD16(v + 32), a3 += w * LD16(v + 48);
    }
    o[0] = a0, o[1] = a1, o[2] = a2, o[3] = a3;
#else
    v8fu *o = (v8fu *)acc;
    v8f a0 = o[0], a1 = o[1], a2 = o[2], a3 = o[3], a4 = o[4], a5 = o[5], a6 = o[6], a7 = o[7];
    for (int64_t u = 0; u < n; u++, v += vstride) {
        const float w = p[u];
        a0 += w * LD(v), a1 += w * LD(v + 8), a2 += w * LD(v + 16), a3 += w * LD(v + 24);
        a4 += w * LD(v + 32), a5 += w * LD(v + 40), a6 += w * LD(v + 48), a7 += w * LD(v + 56);
    }
    o[0] = a0, o[1] = a1, o[2] = a2, o[3] = a3, o[4] = a4, o[5] = a5, o[6] = a6, o[7] = a7;
#endif
}

#ifdef __AVX512F__
/* pv64 for two heads in one pass over the rows: eight independent chains where one head's four each
   waited on the FMA before it. Each head's sums are pv64's, element by element in position order. */
static inline void pv64x2(const float *pa, const float *va, float *acca, const float *pb, const float *vb, float *accb,
                          int64_t n, int64_t vstride) {
    v16fu *oa = (v16fu *)acca, *ob = (v16fu *)accb;
    v16f a0 = oa[0], a1 = oa[1], a2 = oa[2], a3 = oa[3], b0 = ob[0], b1 = ob[1], b2 = ob[2], b3 = ob[3];
    for (int64_t u = 0; u < n; u++, va += vstride, vb += vstride) {
        const float x = pa[u], y = pb[u];
        a0 += x * LD16(va), a1 += x * LD16(va + 16), a2 += x * LD16(va + 32), a3 += x * LD16(va + 48);
        b0 += y * LD16(vb), b1 += y * LD16(vb + 16), b2 += y * LD16(vb + 32), b3 += y * LD16(vb + 48);
    }
    oa[0] = a0, oa[1] = a1, oa[2] = a2, oa[3] = a3, ob[0] = b0, ob[1] = b1, ob[2] = b2, ob[3] = b3;
}

/* The value sums of G query heads of one KV head (G <= PV_GROUP) over n rows of a bfloat16 cache,
   read in place (vs apart): each row's 64 values are widened once in registers for all G heads, where
   a widened copy cost a store and a load of every value besides. A 32-value load holds pairs: shifted
   left 16 bits, its 32-bit lanes are the even values; masked to the upper half, the odd ones. So
   acc_g holds its head's 64 sums as [evens 0-31, odds 0-31, evens 32-63, odds 32-63] (pv_order puts
   them back); each element's sum is pv64's, in position order. Meanwhile row u of the next block
   (`next`, nn rows) is prefetched into L1 and of the block after (`after`, na rows) into L2: the
   blocks are scattered, so the hardware cannot guess them, and a block's prefetches issued at once
   filled the core's line buffers. p: head g's weights at p + g * ps. */
static inline __attribute__((always_inline)) void pv64_bf16(const int G, const float *p, int64_t ps, float *acc,
                                                            const uint16_t *v, int64_t vs, int64_t n,
                                                            const uint16_t *next, int64_t nn, const uint16_t *after,
                                                            int64_t na) {
    const v16i hi = (v16i){0} + (int32_t)0xffff0000;
    v16f a[PV_GROUP][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) a[g][c] = LD16(acc + g * 64 + c * 16);
    for (int64_t u = 0; u < n || u < nn || u < na; u++) {
        fetch_ahead(next, nn, after, na, u, vs, 128);
        if (u >= n) continue;
        const v16i x0 = *(const v16iu *)(const void *)(v + u * vs), x1 = *(const v16iu *)(const void *)(v + u * vs + 32);
        const v16f e0 = (v16f)(x0 << 16), o0 = (v16f)(x0 & hi), e1 = (v16f)(x1 << 16), o1 = (v16f)(x1 & hi);
        for (int g = 0; g < G; g++) {
            const float w = p[g * ps + u];
            a[g][0] += w * e0, a[g][1] += w * o0, a[g][2] += w * e1, a[g][3] += w * o1;
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) *(v16fu *)(acc + g * 64 + c * 16) = a[g][c];
}
/* pv64_bf16 for any G, as scores64_bf16_heads. */
static void pv64_bf16_heads(int G, const float *p, int64_t ps, float *acc, const uint16_t *v, int64_t vs, int64_t n,
                            const uint16_t *next, int64_t nn, const uint16_t *after, int64_t na) {
    for (int g0 = 0; g0 < G; g0 += PV_GROUP, nn = 0, na = 0) {
        const float *pg = p + g0 * ps;
        float *ag = acc + g0 * 64;
        switch (G - g0) {   /* the group's size as a constant: the accumulators stay in registers */
        case 1: pv64_bf16(1, pg, ps, ag, v, vs, n, next, nn, after, na); break;
        case 2: pv64_bf16(2, pg, ps, ag, v, vs, n, next, nn, after, na); break;
        case 3: pv64_bf16(3, pg, ps, ag, v, vs, n, next, nn, after, na); break;
        default: pv64_bf16(4, pg, ps, ag, v, vs, n, next, nn, after, na); break;
        }
    }
}
/* pv64_bf16's order of a head's 64 sums back to positions: out[32c + 2i] = acc[32c + i], out[32c + 2i +
   1] = acc[32c + 16 + i]. */
static inline void pv_order(const float *acc, float *out) {
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 16; i++) out[32 * c + 2 * i] = acc[32 * c + i], out[32 * c + 2 * i + 1] = acc[32 * c + 16 + i];
}
#endif

/* The cache row of `pos` (its block from the table): slot * KVH * D floats into a layer's cache. */
static inline int64_t row_of(const int64_t *table, int64_t pos, int bs) { return table[pos / bs] * bs + pos % bs; }

/* Prefetches heads [h0, h1) of cache row r (every line of them) into L1; es: bytes a value. */
static inline void fetch_row(const void *c, int es, int64_t r, int KVH, int D, int h0, int h1) {
    fetch_lines((const char *)c + (r * KVH + h0) * (int64_t)D * es, (int64_t)(h1 - h0) * D * es, 0);
}

/* Rows [0, n) of a bfloat16 cache (rs apart), w values from each, as float32 rows w apart (the
   compiler vectorizes the loop at the build's width; written out eight-wide it ran slower). Meanwhile
   the rows the walk reads next are prefetched, a row of each as a row is widened (fetch_ahead). */
static void widen_rows(const uint16_t *src, int64_t rs, int64_t n, int w, float *dst, const uint16_t *next,
                       int64_t nn, const uint16_t *after, int64_t na) {
    for (int64_t r = 0; r < n || r < nn || r < na; r++) {
        fetch_ahead(next, nn, after, na, r, rs, (int64_t)w * 2);
        if (r < n)
            for (int j = 0; j < w; j++) dst[r * w + j] = pd_from_bf16(src[r * rs + j]);
    }
}

/* The rows [pos, hi) a walk of blocks reads in the block after the one holding pos, and in the one
   after that: their first cache rows and counts (each block from its row 0; past hi, row 0 and none). */
static inline void blocks_ahead(const int64_t *table, int64_t pos, int64_t hi, int bs, int64_t *rows, int64_t *counts) {
    const int64_t b1 = pos - pos % bs + bs, b2 = b1 + bs;
    rows[0] = b1 < hi ? table[b1 / bs] * bs : 0, counts[0] = b1 < hi ? (hi - b1 < bs ? hi - b1 : bs) : 0;
    rows[1] = b2 < hi ? table[b2 / bs] * bs : 0, counts[1] = b2 < hi ? (hi - b2 < bs ? hi - b2 : bs) : 0;
}

/* widen_rows over a block of the cache c (heads from h0, w values a row) from cache row `row`, with
   the blocks_ahead of pos prefetched. */
static void widen_block(const void *c, int64_t rs, int64_t h0d, int64_t row, int64_t n, int w, float *dst,
                        const int64_t *table, int64_t pos, int64_t hi, int bs) {
    int64_t ahead[2], counts[2];
    blocks_ahead(table, pos, hi, bs, ahead, counts);
    const uint16_t *base = (const uint16_t *)c + h0d;
    widen_rows(base + row * rs, rs, n, w, dst, base + ahead[0] * rs, counts[0], base + ahead[1] * rs, counts[1]);
}

/* The most rows of one sequence a task attends in one walk (a verify step's rows of a request: its
   last token and up to 16 drafts). */
#define RUN_MAX 17

/* Rows [i, i + r) of one sequence, KV heads [h0, h1): their G query heads' outputs. Row i + j attends
   the positions [lo, his[j]) (his ascending) through `table`, which maps every row's positions as its
   own table does (pd_attend_task's runs). The context is walked a block at a time, and every head of
   the range and every row reads the same rows, so a task reads a block's keys (values) as one
   contiguous stretch (KVH = h1 - h0) or one head's slice of it, and widens a bfloat16 block once for
   all its rows (into a copy, or in registers as it is read: scores64_bf16, pv64_bf16); the next
   block's rows are prefetched meanwhile (the blocks are scattered, so the
   hardware cannot guess them). Each row's and head's arithmetic is the same whatever range and rows it
   is computed with and whichever thread runs it (its scores, softmax and sums over its own positions
   in position order): its outputs depend on its own inputs only. */
static void attend(const float *q, int64_t q_row, const void *kc, const void *vc, int kvb, const int64_t *table,
                   int64_t lo, const int64_t *his, int r, float *out, int i, int H, int KVH, int D, int bs,
                   float scale, int h0, int h1) {
    const int G = H / KVH, vec = D % 8 == 0, nh = h1 - h0, nhg = nh * G, es = kvb ? 2 : 4;
#ifdef __AVX512F__
    /* a bfloat16 cache read in place, a KV head's query heads at once (scores64_bf16, pv64_bf16) */
    const int vgroup = kvb && D == 64;
#else
    const int vgroup = 0;
#endif
    const int64_t rs = (int64_t)KVH * D, hi = his[r - 1];
    /* row j's scores [nhg][len j] at s + soff[j], a head's lds[j] apart (len j rounded up to a
       multiple of 16: every head's scores, the sums after them and the widened rows start on a cache
       line, where vectors split across lines cost two accesses each), its sums [nhg][D] at
       acc + j * nhg * D */
    int64_t lens[RUN_MAX], lds[RUN_MAX], soff[RUN_MAX + 1];
    soff[0] = 0;
    for (int j = 0; j < r; j++) {
        lens[j] = his[j] > lo ? his[j] - lo : 0;
        lds[j] = (lens[j] + 15) & ~(int64_t)15;
        soff[j + 1] = soff[j] + lds[j] * nhg;
        if (!lens[j])
            for (int d = 0; d < nhg * D; d++) out[((int64_t)(i + j) * H + h0 * G) * D + d] = 0.0f;
    }
    if (hi <= lo) return;
    /* then (a bfloat16 cache not read in place) one block's rows of heads [h0, h1) widened */
    float *s = scratch((size_t)(soff[r] + (int64_t)r * nhg * D + (kvb && !vgroup ? (int64_t)bs * nh * D : 0)));
    float *acc = s + soff[r], *wide = acc + (int64_t)r * nhg * D;
    /* Where a block's rows are read: the cache itself (rs apart, heads at h * D), or their widened
       copy (nh * D apart, heads at (h - h0) * D). */
    const int64_t ws = kvb ? (int64_t)nh * D : rs;
    const int hb = kvb ? h0 : 0;
    for (int64_t pos = lo; pos < hi;) {
        const int64_t off = pos % bs, stop = pos - off + bs < hi ? pos - off + bs : hi;
        /* the rows of this block from pos on, and the same rows of the next block (-1: none) */
        const int64_t row = row_of(table, pos, bs), next = stop < hi ? table[stop / bs] * bs + off : -1;
#ifdef __AVX512F__
        if (vgroup) {
            int64_t ahead[2], counts[2];
            blocks_ahead(table, pos, hi, bs, ahead, counts);
            const uint16_t *kb = (const uint16_t *)kc;
            for (int j = 0; j < r; j++) {
                const int64_t end = his[j] < stop ? his[j] : stop, pf = j == r - 1;   /* the longest row */
                const float *qj = q + (i + j) * q_row + (int64_t)h0 * G * D;
                for (int h = h0; h < h1 && end > pos; h++) {
                    const int64_t hd = (int64_t)h * D, hg = (int64_t)(h - h0) * G;
                    scores64_bf16_heads(G, qj + hg * D, kb + row * rs + hd, rs, end - pos, scale,
                                        s + soff[j] + hg * lds[j] + (pos - lo), lds[j], kb + ahead[0] * rs + hd,
                                        pf ? counts[0] : 0, kb + ahead[1] * rs + hd, pf ? counts[1] : 0);
                }
            }
            pos = stop;
            continue;
        }
#endif
        if (kvb) widen_block(kc, rs, (int64_t)h0 * D, row, stop - pos, nh * D, wide, table, pos, hi, bs);
        const float *k = kvb ? wide : (const float *)kc + row * rs;
        if (vec) {
            if (next >= 0 && !kvb)   /* (a bfloat16 block's were prefetched as it was widened) */
                for (int64_t u = 0; u < stop - pos; u++) fetch_row(kc, es, next + u, KVH, D, h0, h1);
            for (int j = 0; j < r; j++) {
                const int64_t end = his[j] < stop ? his[j] : stop;
                if (end > pos)
                    scores(q + (i + j) * q_row + (int64_t)h0 * G * D, k, ws, end - pos, nhg, G, h0 - hb, D, scale,
                           s + soff[j] + (pos - lo), lds[j]);
            }
            pos = stop;
            continue;
        }
        for (int64_t u = 0; pos < stop; pos++, u++, k += ws) {
            if (next >= 0 && !kvb) fetch_row(kc, es, next + u, KVH, D, h0, h1);
            for (int j = 0; j < r; j++) {
                if (pos >= his[j]) continue;
                const float *qb = q + (i + j) * q_row + (int64_t)h0 * G * D;
                for (int h = h0; h < h1; h++) {
                    const float *qh = qb + (int64_t)(h - h0) * G * D, *kh = k + (int64_t)(h - hb) * D;
                    float *sh = s + soff[j] + (int64_t)(h - h0) * G * lds[j] + (pos - lo);
                    for (int g = 0; g < G; g++) {
                        const float *qg = qh + g * D;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int d = 0; d < D; d++) dot += qg[d] * kh[d];
                        sh[g * lds[j]] = dot * scale;
                    }
                }
            }
        }
    }
    for (int j = 0; j < r; j++) {
        const int64_t len = lens[j];
        for (int hg = 0; hg < nhg && len; hg++) {
            float *sg = s + soff[j] + hg * lds[j], m = sg[0], sum = 0.0f;
            int64_t t = 0;
            if (len >= 8) {   /* the maximum over eight lanes, where one chain of scalar maxima waited on each */
                v8f mv = LD(sg);
                for (t = 8; t + 8 <= len; t += 8) {
                    const v8f x = LD(sg + t);
                    const v8i gt = x > mv;
                    mv = (v8f)(((v8i)x & gt) | ((v8i)mv & ~gt));
                }
                for (int e = 0; e < 8; e++) m = mv[e] > m ? mv[e] : m;
            }
            for (; t < len; t++) m = sg[t] > m ? sg[t] : m;
            t = 0;
            v8f vs = (v8f){0};
            for (; t + 8 <= len; t += 8) {
                const v8f e = vexp(LD(sg + t) - m);
                *(v8fu *)(sg + t) = e;
                vs += e;
            }
            sum = hsum(vs);
            for (; t < len; t++) {
                sg[t] = expf(sg[t] - m);
                sum += sg[t];
            }
            const float inv = 1.0f / sum;
            for (int64_t u = 0; u < len; u++) sg[u] *= inv;
            for (int d = 0; d < D; d++) acc[((int64_t)j * nhg + hg) * D + d] = 0.0f;
        }
    }
    {   /* the first block's values, while the weights are computed */
        const int64_t r0 = row_of(table, lo, bs), nr = bs - lo % bs < hi - lo ? bs - lo % bs : hi - lo;
        for (int64_t u = 0; u < nr; u++) fetch_row(vc, es, r0 + u, KVH, D, h0, h1);
    }
    for (int64_t pos = lo; pos < hi;) {
        const int64_t off = pos % bs, stop = pos - off + bs < hi ? pos - off + bs : hi;
        const int64_t row = row_of(table, pos, bs);
#ifdef __AVX512F__
        if (vgroup) {
            int64_t ahead[2], counts[2];
            blocks_ahead(table, pos, hi, bs, ahead, counts);
            const uint16_t *vb = (const uint16_t *)vc;
            for (int j = 0; j < r; j++) {
                const int64_t n = (his[j] < stop ? his[j] : stop) - pos, pf = j == r - 1;   /* the longest row */
                for (int h = h0; h < h1 && n > 0; h++) {
                    const int64_t hd = (int64_t)h * D, hg = (int64_t)(h - h0) * G;
                    pv64_bf16_heads(G, s + soff[j] + hg * lds[j] + (pos - lo), lds[j], acc + ((int64_t)j * nhg + hg) * D,
                                    vb + row * rs + hd, rs, n, vb + ahead[0] * rs + hd, pf ? counts[0] : 0,
                                    vb + ahead[1] * rs + hd, pf ? counts[1] : 0);
                }
            }
            pos = stop;
            continue;
        }
#endif
        if (kvb) widen_block(vc, rs, (int64_t)h0 * D, row, stop - pos, nh * D, wide, table, pos, hi, bs);
        const float *v = kvb ? wide : (const float *)vc + row * rs;
        if (stop < hi && !kvb)   /* the next block's rows, while this one's are summed */
            for (int64_t u = 0, nb = table[stop / bs] * bs; u < bs && stop + u < hi; u++) fetch_row(vc, es, nb + u, KVH, D, h0, h1);
        for (int j = 0; j < r; j++) {
            const int64_t n = (his[j] < stop ? his[j] : stop) - pos, len = lds[j];
            for (int hg = 0; hg < nhg && n > 0; hg++) {
                const float *p = s + soff[j] + hg * len + (pos - lo), *vh = v + (int64_t)(h0 - hb + hg / G) * D;
                float *a = acc + ((int64_t)j * nhg + hg) * D;
                if (D == 64) {
#ifdef __AVX512F__
                    if (hg + 1 < nhg) {   /* and the next head, in the same pass over the rows */
                        pv64x2(p, vh, a, p + len, v + (int64_t)(h0 - hb + (hg + 1) / G) * D, a + D, n, ws);
                        hg++;
                        continue;
                    }
#endif
                    pv64(p, n, vh, ws, a);
                    continue;
                }
                for (int64_t u = 0; u < n; u++, vh += ws) {
                    if (vec) {
                        for (int d = 0; d < D; d += 8) *(v8fu *)(a + d) += p[u] * LD(vh + d);
                        continue;
                    }
#pragma omp simd
                    for (int d = 0; d < D; d++) a[d] += p[u] * vh[d];
                }
            }
        }
        pos = stop;
    }
    for (int j = 0; j < r; j++)
        if (lens[j]) {
#ifdef __AVX512F__
            if (vgroup) {
                for (int hg = 0; hg < nhg; hg++)
                    pv_order(acc + ((int64_t)j * nhg + hg) * D, out + ((int64_t)(i + j) * H + h0 * G + hg) * D);
                continue;
            }
#endif
            for (int d = 0; d < nhg * D; d++)
                out[((int64_t)(i + j) * H + h0 * G) * D + d] = acc[(int64_t)j * nhg * D + d];
        }
}

/* How many KV heads a task covers: every head of a sequence when there are sequences enough to keep
   `threads` busy (a task then reads each cache row whole), else one (a batch of one is still split
   across threads). */
int pd_attend_heads(int n, int KVH, int threads) {
    return n >= 4 * threads ? KVH : 1;
}

/* The most rows of a chain one walk takes: all of it (up to RUN_MAX) where the step has tasks enough
   for every thread, else fewer, so that a few long chains still spread over the threads (two tasks a
   thread of a step's n * per row tasks). */
int pd_attend_run(int n, int per, int threads) {
    const int run = n * per / (2 * threads);
    return run < 1 ? 1 : run > RUN_MAX ? RUN_MAX : run;
}

/* Whether decode b continues decode a: the next position of a sequence (one more token of context
   from the same first position) through the same blocks under a's context. A verify step's rows of
   one request are such a chain (engine/runner.py keeps them adjacent). */
static int continues(const int64_t *tables, int64_t tstride, const int64_t *first, const int64_t *ctx, int a, int b,
                     int bs) {
    if (first[b] != first[a] || ctx[b] != ctx[a] + 1) return 0;
    const int64_t *ta = tables + (int64_t)a * tstride, *tb = tables + (int64_t)b * tstride;
    for (int64_t k = first[a] / bs; k < (ctx[a] + bs - 1) / bs; k++)
        if (ta[k] != tb[k]) return 0;
    return 1;
}

/* Task `task` of a step's n * KVH / hp tasks: decode task / (KVH / hp), heads from (task % (KVH / hp)) *
   hp, hp of them (pd_attend_heads). A chain of decodes (continues) is attended in walks of up to `run`
   rows (pd_attend_run), each by its first row's task: a request's verify rows read and widen its
   context once a walk, not once a row; the chain's other tasks have nothing to do. Each row's outputs
   are what it alone would give (attend), so which rows share a walk does not change them. */
__attribute__((noinline)) void pd_attend_task(const float *q, int64_t q_row, const void *kc, const void *vc,
                                              const int64_t *tables, int64_t tstride, const int64_t *first,
                                              const int64_t *ctx, float *out, int n, int H, int KVH, int D, int bs,
                                              float scale, int hp, int run, int task, int kvb) {
    const int per = KVH / hp, i = task / per, h0 = (task % per) * hp;
    int back = 0;   /* decodes before i in its chain */
    while (i - back > 0 && continues(tables, tstride, first, ctx, i - back - 1, i - back, bs)) back++;
    if (back % run) return;
    int r = 1;
    while (r < run && i + r < n && continues(tables, tstride, first, ctx, i + r - 1, i + r, bs)) r++;
    attend(q, q_row, kc, vc, kvb, tables + (int64_t)(i + r - 1) * tstride, first[i], ctx + i, r, out, i, H, KVH, D,
           bs, scale, h0, h0 + hp);
}

/* kvb: the cache holds bfloat16 (else float32). */
void pd_decode_attention(const float *q, int64_t q_row, const void *kc, const void *vc,
                         const int64_t *tables, int64_t tstride, const int64_t *first, const int64_t *ctx,
                         float *out, int n, int H, int KVH, int D, int bs, float scale, int threads, int kvb) {
    /* A small step (batch 1, short contexts) runs on the calling thread: waking the pool costs more
       than the work. */
    int64_t work = 0;
    for (int i = 0; i < n; i++) work += (ctx[i] - first[i]) * (int64_t)H;
    const int hp = pd_attend_heads(n, KVH, threads), run = pd_attend_run(n, KVH / hp, threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && work >= 4096)
    for (int task = 0; task < n * (KVH / hp); task++)
        pd_attend_task(q, q_row, kc, vc, tables, tstride, first, ctx, out, n, H, KVH, D, bs, scale, hp, run, task, kvb);
}
