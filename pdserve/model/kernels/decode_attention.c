/* Decode attention over the paged KV cache, read in place.

   The torch path (model/attention.py) gathers each sequence's blocks into a padded copy before
   scaled_dot_product_attention; at 32 streams that copy and the padded kernel cost more than the
   layer's GEMMs. Here each (sequence, KV head) pair walks its block table and reads keys and values
   where they lie: one read of the context, no copy, no padding. Softmax in two passes (scores, then
   weights), float32 throughout. Parallel over (sequence, KV head) pairs with OpenMP; built and loaded
   by native.py, which links the OpenMP runtime torch already loaded.

   q:      [n, H, D] floats, row stride q_row (elements), heads contiguous (stride D)
   kc, vc: one layer's cache [slots, KVH, D] contiguous; slot = block * bs + offset
   tables: [n, tstride] int64 block ids; first, ctx: [n] int64, the attended positions [first, ctx)
   out:    [n, H, D] contiguous */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Head dimensions that are a multiple of 8 take the vector paths (vec.h); others the scalar loops. */
#include "vec.h"

/* Scores of G heads against one key row, for D % 8 == 0. */
static inline void scores8(const float *qh, const float *k, int G, int D, float scale, float *s, int64_t stride) {
    for (int g = 0; g < G; g++) {
        const float *qg = qh + g * D;
        v8f a = (v8f){0}, b = (v8f){0};   /* two chains of FMAs */
        for (int d = 0; d < D; d += 16) {
            a += LD(qg + d) * LD(k + d);
            if (d + 8 < D) b += LD(qg + d + 8) * LD(k + d + 8);
        }
        s[g * stride] = hsum(a + b) * scale;
    }
}

/* out[0:64] = sum over positions [lo, hi) of p[pos - lo] * v[pos] for head h of a 64-wide cache. */
static void pv64(const float *p, const int64_t *table, int64_t lo, int64_t hi, const float *vc, int KVH, int h, int bs,
                 float *out) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    for (int64_t pos = lo; pos < hi;) {
        const int64_t blk = table[pos / bs], off = pos % bs;
        const int64_t stop = pos - off + bs < hi ? pos - off + bs : hi;
        const float *v = vc + ((blk * bs + off) * KVH + h) * (int64_t)64;
        for (; pos < stop; pos++, v += (int64_t)KVH * 64) {
            const float w = p[pos - lo];
            a0 += w * LD(v), a1 += w * LD(v + 8), a2 += w * LD(v + 16), a3 += w * LD(v + 24);
            a4 += w * LD(v + 32), a5 += w * LD(v + 40), a6 += w * LD(v + 48), a7 += w * LD(v + 56);
        }
    }
    v8fu *o = (v8fu *)out;
    o[0] = a0, o[1] = a1, o[2] = a2, o[3] = a3, o[4] = a4, o[5] = a5, o[6] = a6, o[7] = a7;
}

/* One (sequence i, KV head h) pair of the step, task = i * KVH + h: its G query heads' outputs. Each
   task's result depends on nothing but its own inputs, whichever thread runs it. */
__attribute__((noinline)) void pd_attend_task(const float *q, int64_t q_row, const float *kc, const float *vc, const int64_t *tables,
                    int64_t tstride, const int64_t *first, const int64_t *ctx, float *out, int H, int KVH, int D,
                    int bs, float scale, int task) {
    const int G = H / KVH, vec = D % 8 == 0;
    const int i = task / KVH, h = task % KVH;
    const int64_t lo = first[i], len = ctx[i] - first[i];
    if (len <= 0) {
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++) out[((int64_t)i * H + h * G + g) * D + d] = 0.0f;
        return;
    }
    float *s = (float *)malloc(sizeof(float) * (size_t)(len * G + G * D));
    float *acc = s + len * G;
    const float *qh = q + i * q_row + (int64_t)h * G * D;
    const int64_t *table = tables + i * tstride;
    /* Walk the table block by block (no division per position); each key row is read once for
       the G query heads that share it. */
    for (int64_t pos = lo; pos < ctx[i];) {
        const int64_t blk = table[pos / bs], off = pos % bs;
        const int64_t stop = pos - off + bs < ctx[i] ? pos - off + bs : ctx[i];
        const float *k = kc + ((blk * bs + off) * KVH + h) * (int64_t)D;
        for (; pos < stop; pos++, k += (int64_t)KVH * D) {
            if (vec) {
                scores8(qh, k, G, D, scale, s + (pos - lo), len);
                continue;
            }
            for (int g = 0; g < G; g++) {
                const float *qg = qh + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qg[d] * k[d];
                s[g * len + (pos - lo)] = dot * scale;
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = s + g * len, m = sg[0], sum = 0.0f;
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
        for (int d = 0; d < D; d++) acc[g * D + d] = 0.0f;
    }
    if (D == 64) {   /* a head's output in eight registers over the whole context */
        for (int g = 0; g < G; g++)
            pv64(s + g * len, table, lo, ctx[i], vc, KVH, h, bs, out + ((int64_t)i * H + h * G + g) * D);
        free(s);
        return;
    }
    for (int64_t pos = lo; pos < ctx[i];) {
        const int64_t blk = table[pos / bs], off = pos % bs;
        const int64_t stop = pos - off + bs < ctx[i] ? pos - off + bs : ctx[i];
        const float *v = vc + ((blk * bs + off) * KVH + h) * (int64_t)D;
        for (; pos < stop; pos++, v += (int64_t)KVH * D) {
            for (int g = 0; g < G; g++) {
                const float p = s[g * len + (pos - lo)];
                float *a = acc + g * D;
                if (vec) {
                    for (int d = 0; d < D; d += 8) *(v8fu *)(a + d) += p * LD(v + d);
                    continue;
                }
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] += p * v[d];
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) out[((int64_t)i * H + h * G + g) * D + d] = acc[g * D + d];
    free(s);
}

void pd_decode_attention(const float *q, int64_t q_row, const float *kc, const float *vc,
                         const int64_t *tables, int64_t tstride, const int64_t *first, const int64_t *ctx,
                         float *out, int n, int H, int KVH, int D, int bs, float scale, int threads) {
    /* A small step (batch 1, short contexts) runs on the calling thread: waking the pool costs more
       than the work. */
    int64_t work = 0;
    for (int i = 0; i < n; i++) work += (ctx[i] - first[i]) * (int64_t)H;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && work >= 4096)
    for (int task = 0; task < n * KVH; task++)
        pd_attend_task(q, q_row, kc, vc, tables, tstride, first, ctx, out, H, KVH, D, bs, scale, task);
}
