/* One decoder layer of a decode-only step in a single call: RMSNorm, the fused QKV product (+ bias),
   rotary embedding, the KV cache write, paged decode attention, the output product and residual,
   RMSNorm, the gate/up product, SiLU * up, the down product and residual.

   The Python layer (model/llama.py) runs each of these as its own op: about 15 torch ops and native
   calls a layer, 450 a step, whose dispatch cost as much as a fifth of a decode step at 8 streams.
   Here the same kernels run back to back from C (qgemm.c, norm.c, decode_attention.c are linked in),
   so a step's outputs are those of the op-by-op path bit for bit: the rotary embedding rounds each
   product as torch's separate multiply and add do (no FMA contraction there), and the op-by-op path
   takes its SiLU * up from pd_silu_mul below too.

   x [n, hidden] is updated in place. kc, vc: the layer's cache [slots, KVH, D]. */
#include <stdint.h>
#include <string.h>
#include "vec.h"

void pd_qgemm(int bits, const void *w, const void *d, const void *m, const float *x, int64_t ldx, float *y,
              int64_t ldy, int M, int N, int K, int threads);
void pd_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo, int rows, int n, float eps,
                 int threads);
void pd_decode_attention(const float *q, int64_t q_row, const float *kc, const float *vc, const int64_t *tables,
                         int64_t tstride, const int64_t *first, const int64_t *ctx, float *out, int n, int H, int KVH,
                         int D, int bs, float scale, int threads);

typedef struct {              /* a weight in qgemm.c's tile layout: bits 32, 8 or 4 */
    int bits, n, k;
    const void *w, *d, *m;
} pd_weight;

typedef struct {              /* one layer, fixed at load */
    pd_weight qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *qkv_bias;   /* qkv_bias may be NULL */
    float eps, scale;
    int hidden, heads, kv_heads, head_dim, inter;
} pd_layer;

typedef struct {              /* decodes [start, start + n) with their block tables (attention.DecodeGroup) */
    int start, n;
    int64_t tstride;
    const int64_t *table, *first, *ctx;
} pd_group;

#define MAX_GROUPS 4
typedef struct {              /* one step, shared by every layer */
    int n, block_size, ngroups, threads;
    const float *cos, *sin;   /* [n, D/2] */
    const int64_t *slots;     /* [n]: the cache slot each token's key and value go to */
    float *scratch;           /* n rows of h [hidden], qkv, attention [H * D], o [hidden], gu [2 inter], act [inter] */
    pd_group groups[MAX_GROUPS];
} pd_step;

/* silu(g) * u for gu = [g | u] rows of 2 * inter: out [rows, inter]. silu(g) = g * sigmoid(g), with
   e^-|g| so the exponential's argument is never positive. */
void pd_silu_mul(const float *gu, int64_t ld, float *out, int64_t ldo, int rows, int inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (int64_t)rows * inter >= (1 << 16))
    for (int r = 0; r < rows; r++) {
        const float *g = gu + r * ld, *u = g + inter;
        float *o = out + r * ldo;
        int j = 0;
        const v8f one = (v8f){0} + 1.0f;
        for (; j + 8 <= inter; j += 8) {
            const v8f x = LD(g + j);
            const v8i neg = x < (v8f){0};
            const v8f t = vexp((v8f)((v8i)x | (int)0x80000000));           /* e^-|x|: the sign bit set */
            const v8f p = one / (one + t);                                  /* sigmoid(|x|) */
            const v8f sig = (v8f)((neg & (v8i)(t * p)) | (~neg & (v8i)p));  /* sigmoid(-|x|) = t * p */
            *(v8fu *)(o + j) = (x * sig) * LD(u + j);
        }
        for (; j < inter; j++) {
            const float x = g[j];
            const float t[8] = {x < 0 ? x : -x};
            const float e = vexp(LD(t))[0], p = 1.0f / (1.0f + e);
            o[j] = (x * (x < 0 ? e * p : p)) * u[j];
        }
    }
}

/* The rotary embedding of one head's halves, each product rounded on its own as torch's ops do. */
__attribute__((optimize("fp-contract=off"))) static void rope(float *h, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        const float x1 = h[i], x2 = h[i + half];
        const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
        h[i] = a - b;
        h[i + half] = c + d;
    }
}

static void product(const pd_weight *w, const float *x, int64_t ldx, float *y, int M, int threads) {
    pd_qgemm(w->bits, w->w, w->d, w->m, x, ldx, y, w->n, M, w->n, w->k, threads);
}

void pd_decode_layer(const pd_layer *L, const pd_step *s, float *x, float *kc, float *vc) {
    const int n = s->n, hd = L->hidden, D = L->head_dim, H = L->heads, KVH = L->kv_heads, nq = L->qkv.n;
    float *h = s->scratch, *qkv = h + (int64_t)n * hd, *att = qkv + (int64_t)n * nq, *o = att + (int64_t)n * H * D;
    float *gu = o + (int64_t)n * hd, *act = gu + (int64_t)n * 2 * L->inter;

    pd_rms_norm(x, hd, L->input_norm, h, hd, n, hd, L->eps, s->threads);
    product(&L->qkv, h, hd, qkv, n, s->threads);
    for (int r = 0; r < n; r++) {
        float *row = qkv + (int64_t)r * nq;
        if (L->qkv_bias)
            for (int j = 0; j < nq; j++) row[j] = row[j] + L->qkv_bias[j];
        for (int j = 0; j < H + KVH; j++) rope(row + j * D, s->cos + (int64_t)r * D / 2, s->sin + (int64_t)r * D / 2, D / 2);
        const int64_t slot = s->slots[r] * KVH * D;
        memcpy(kc + slot, row + H * D, sizeof(float) * KVH * D);
        memcpy(vc + slot, row + (H + KVH) * D, sizeof(float) * KVH * D);
    }
    for (int g = 0; g < s->ngroups; g++) {
        const pd_group *G = &s->groups[g];
        pd_decode_attention(qkv + (int64_t)G->start * nq, nq, kc, vc, G->table, G->tstride, G->first, G->ctx,
                            att + (int64_t)G->start * H * D, G->n, H, KVH, D, s->block_size, L->scale, s->threads);
    }
    product(&L->o, att, H * D, o, n, s->threads);
    for (int64_t i = 0; i < (int64_t)n * hd; i++) x[i] = x[i] + o[i];

    pd_rms_norm(x, hd, L->post_norm, h, hd, n, hd, L->eps, s->threads);
    product(&L->gate_up, h, hd, gu, n, s->threads);
    pd_silu_mul(gu, 2 * L->inter, act, L->inter, n, L->inter, s->threads);
    product(&L->down, act, L->inter, o, n, s->threads);
    for (int64_t i = 0; i < (int64_t)n * hd; i++) x[i] = x[i] + o[i];
}
