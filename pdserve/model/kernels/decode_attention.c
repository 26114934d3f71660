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

/* Scores of G heads against one key row, for D % 8 == 0: two chains of FMAs, a over the even
   eights of the row and b over the odd ones, summed as hsum(a + b). With AVX-512 (D % 16 == 0) one
   16-float chain holds a in its low half and b in its high half: the same sums, half the
   instructions. */
static inline void scores8(const float *qh, const float *k, int G, int D, float scale, float *s, int64_t stride) {
#ifdef __AVX512F__
    if (D % 16 == 0) {
        for (int g = 0; g < G; g++) {
            const float *qg = qh + g * D;
            v16f c = (v16f){0};
            for (int d = 0; d < D; d += 16) c += LD16(qg + d) * LD16(k + d);
            const v8f a = __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7);
            const v8f b = __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15);
            s[g * stride] = hsum(a + b) * scale;
        }
        return;
    }
#endif
    for (int g = 0; g < G; g++) {
        const float *qg = qh + g * D;
        v8f a = (v8f){0}, b = (v8f){0};
        for (int d = 0; d < D; d += 16) {
            a += LD(qg + d) * LD(k + d);
            if (d + 8 < D) b += LD(qg + d + 8) * LD(k + d + 8);
        }
        s[g * stride] = hsum(a + b) * scale;
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

/* The cache row of `pos` (its block from the table): slot * KVH * D floats into a layer's cache. */
static inline int64_t row_of(const int64_t *table, int64_t pos, int bs) { return table[pos / bs] * bs + pos % bs; }

/* Prefetches heads [h0, h1) of cache row r (every line of them) into the cache; es: bytes a value. */
static inline void fetch_row(const void *c, int es, int64_t r, int KVH, int D, int h0, int h1) {
    const char *p = (const char *)c + (r * KVH + h0) * (int64_t)D * es, *e = p + (int64_t)(h1 - h0) * D * es;
    for (; p < e; p += 64) __builtin_prefetch(p, 0, 3);
}

/* Rows [0, n) of a bfloat16 cache (rs apart), w values from each, as float32 rows w apart (the
   compiler vectorizes the loop at the build's width; written out eight-wide it ran slower). */
static void widen_rows(const uint16_t *src, int64_t rs, int64_t n, int w, float *dst) {
    for (int64_t r = 0; r < n; r++)
        for (int j = 0; j < w; j++) dst[r * w + j] = pd_from_bf16(src[r * rs + j]);
}

/* Sequence i's KV heads [h0, h1): their G query heads' outputs. The context is walked a block at a
   time, and every head of the range reads the same rows, so a task reads a block's keys (values)
   as one contiguous stretch (KVH = h1 - h0) or one head's slice of it; the next block's rows are
   prefetched meanwhile (the blocks are scattered, so the hardware cannot guess them). Each head's
   arithmetic is the same whatever range it is computed in and whichever thread runs it: its
   outputs depend on its own inputs only. */
static void attend(const float *q, int64_t q_row, const void *kc, const void *vc, int kvb, const int64_t *table,
                   int64_t lo, int64_t hi, float *out, int i, int H, int KVH, int D, int bs, float scale, int h0, int h1) {
    const int G = H / KVH, vec = D % 8 == 0, nh = h1 - h0, es = kvb ? 2 : 4;
    const int64_t len = hi - lo, rs = (int64_t)KVH * D;
    float *ob = out + ((int64_t)i * H + h0 * G) * D;
    if (len <= 0) {
        for (int d = 0; d < nh * G * D; d++) ob[d] = 0.0f;
        return;
    }
    /* scores [nh][G][len], acc [nh][G][D], then (bfloat16) one block's rows of heads [h0, h1) widened */
    float *s = scratch((size_t)(len * G * nh + nh * G * D + (kvb ? (int64_t)bs * nh * D : 0)));
    float *acc = s + len * G * nh, *wide = acc + nh * G * D;
    const float *qb = q + i * q_row + (int64_t)h0 * G * D;
    /* Where a block's rows are read: the cache itself (rs apart, heads at h * D), or their widened
       copy (nh * D apart, heads at (h - h0) * D). */
    const int64_t ws = kvb ? (int64_t)nh * D : rs;
    const int hb = kvb ? h0 : 0;
    for (int64_t pos = lo; pos < hi;) {
        const int64_t off = pos % bs, stop = pos - off + bs < hi ? pos - off + bs : hi;
        /* the rows of this block from pos on, and the same rows of the next block (-1: none) */
        const int64_t row = row_of(table, pos, bs), next = stop < hi ? table[stop / bs] * bs + off : -1;
        if (kvb) widen_rows((const uint16_t *)kc + row * rs + (int64_t)h0 * D, rs, stop - pos, nh * D, wide);
        const float *k = kvb ? wide : (const float *)kc + row * rs;
        for (int64_t r = 0; pos < stop; pos++, r++, k += ws) {
            if (next >= 0) fetch_row(kc, es, next + r, KVH, D, h0, h1);
            for (int h = h0; h < h1; h++) {
                const float *qh = qb + (int64_t)(h - h0) * G * D, *kh = k + (int64_t)(h - hb) * D;
                float *sh = s + (int64_t)(h - h0) * G * len + (pos - lo);
                if (vec) {
                    scores8(qh, kh, G, D, scale, sh, len);
                    continue;
                }
                for (int g = 0; g < G; g++) {
                    const float *qg = qh + g * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < D; d++) dot += qg[d] * kh[d];
                    sh[g * len] = dot * scale;
                }
            }
        }
    }
    for (int hg = 0; hg < nh * G; hg++) {
        float *sg = s + hg * len, m = sg[0], sum = 0.0f;
        for (int64_t t = 1; t < len; t++) m = sg[t] > m ? sg[t] : m;
        int64_t t = 0;
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
        for (int d = 0; d < D; d++) acc[hg * D + d] = 0.0f;
    }
    fetch_row(vc, es, row_of(table, lo, bs), KVH, D, h0, h1);
    for (int64_t pos = lo; pos < hi;) {
        const int64_t off = pos % bs, stop = pos - off + bs < hi ? pos - off + bs : hi;
        const int64_t row = row_of(table, pos, bs);
        if (kvb) widen_rows((const uint16_t *)vc + row * rs + (int64_t)h0 * D, rs, stop - pos, nh * D, wide);
        const float *v = kvb ? wide : (const float *)vc + row * rs;
        if (stop < hi)   /* the next block's rows, while this one's are summed */
            for (int64_t r = 0, nb = table[stop / bs] * bs; r < bs && stop + r < hi; r++) fetch_row(vc, es, nb + r, KVH, D, h0, h1);
        for (int hg = 0; hg < nh * G; hg++) {
            const float *p = s + hg * len + (pos - lo), *vh = v + (int64_t)(h0 - hb + hg / G) * D;
            float *a = acc + hg * D;
            if (D == 64) {
                pv64(p, stop - pos, vh, ws, a);
                continue;
            }
            for (int64_t u = 0; u < stop - pos; u++, vh += ws) {
                if (vec) {
                    for (int d = 0; d < D; d += 8) *(v8fu *)(a + d) += p[u] * LD(vh + d);
                    continue;
                }
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] += p[u] * vh[d];
            }
        }
        pos = stop;
    }
    for (int d = 0; d < nh * G * D; d++) ob[d] = acc[d];
}

/* How many KV heads a task covers: every head of a sequence when there are sequences enough to keep
   `threads` busy (a task then reads each cache row whole), else one (a batch of one is still split
   across threads). */
int pd_attend_heads(int n, int KVH, int threads) {
    return n >= 4 * threads ? KVH : 1;
}

/* Task `task` of a step's n * KVH / hp tasks: sequence task / (KVH / hp), heads from (task % (KVH /
   hp)) * hp, hp of them (pd_attend_heads). */
__attribute__((noinline)) void pd_attend_task(const float *q, int64_t q_row, const void *kc, const void *vc,
                                              const int64_t *tables, int64_t tstride, const int64_t *first,
                                              const int64_t *ctx, float *out, int H, int KVH, int D, int bs,
                                              float scale, int hp, int task, int kvb) {
    const int per = KVH / hp, i = task / per, h0 = (task % per) * hp;
    attend(q, q_row, kc, vc, kvb, tables + i * tstride, first[i], ctx[i], out, i, H, KVH, D, bs, scale, h0, h0 + hp);
}

/* kvb: the cache holds bfloat16 (else float32). */
void pd_decode_attention(const float *q, int64_t q_row, const void *kc, const void *vc,
                         const int64_t *tables, int64_t tstride, const int64_t *first, const int64_t *ctx,
                         float *out, int n, int H, int KVH, int D, int bs, float scale, int threads, int kvb) {
    /* A small step (batch 1, short contexts) runs on the calling thread: waking the pool costs more
       than the work. */
    int64_t work = 0;
    for (int i = 0; i < n; i++) work += (ctx[i] - first[i]) * (int64_t)H;
    const int hp = pd_attend_heads(n, KVH, threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && work >= 4096)
    for (int task = 0; task < n * (KVH / hp); task++)
        pd_attend_task(q, q_row, kc, vc, tables, tstride, first, ctx, out, H, KVH, D, bs, scale, hp, task, kvb);
}
