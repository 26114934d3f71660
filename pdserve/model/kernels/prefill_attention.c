/* Causal attention of a step's prefill chunks in one call, each over its keys and values where they
   lie: its context in the paged cache (through its block table), its own in the step's rows.

   torch's CPU flash attention (one call a chunk, its output copied back) ran far below the FMA
   peak, and a prompt's attention grows with the square of its length: for long prompts it was most
   of the prefill. Here the work is products near that peak:

   - A task is one KV head and QB rows of one chunk: its nq = QB * G query vectors (G query heads
     a KV head), scaled and transposed once into qt[D][nq], so that the queries lie along a vector's
     lanes.
   - Keys are taken KS at a time (a superblock, at absolute positions, multiples of KS). Scores
     s[j][u] = sum_d k[j][d] * qt[d][u]: each key value is broadcast from its cache row, KT keys
     against NC query vectors at once, so no key is transposed (a bfloat16 cache's rows are widened).
   - The softmax runs down the columns, vectorized over queries: a lane's running maximum and sum
     are rescaled once per superblock (flash attention's online softmax), and a key a query must
     not see (its future, or past a sliding window) weighs exactly zero.
   - Values: acc[u][D] += p[j][u] * v[j][D], QT queries' accumulators in registers over a row.

   A query's result depends only on its own vector and the keys it sees: superblocks sit at
   absolute positions and every sum runs in key order, so a prompt computed in one chunk or several,
   or after a prefix-cache hit, attends with the same arithmetic.

   q:     [T, H, D] rows q_row apart (heads D apart): the step's queries; chunk c's rows from q0
   k, v:  [T, KVH, D] rows kv_row apart: the step's own keys and values (float32; a bfloat16 cache's
          rounded values), which a chunk reads for its own positions
   kc, vc: one layer's cache [slots, KVH, D] contiguous, float32 or bfloat16 (kvb), which a chunk
          reads for the positions before it
   desc:  [nc][4] int64: q0, L (rows), P (positions before the chunk), toff (the chunk's block table
          at tables + toff, covering [0, P); -1 where P == 0)
   out:   [T, H, D] rows o_row apart */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "scratch.h"
#include "vec.h"

#ifdef __AVX512F__
typedef v16f VF;
typedef v16fu VFU;
typedef v16i VI;
#define VW 16
#define LDV(p) LD16(p)
#define VEXP(x) vexp16(x)
#define KT 8 /* keys a score tile */
#define NC 3 /* query vectors a score tile */
#define QT 4 /* queries a value tile */
#else
typedef v8f VF;
typedef v8fu VFU;
typedef v8i VI;
#define VW 8
#define LDV(p) LD(p)
#define VEXP(x) vexp(x)
#define KT 4
#define NC 3
#define QT 2
#endif
#define KS 128 /* keys a superblock */
/* a where the mask's lanes are set, else b */
#define SEL(mask, a, b) ((VF)(((VI)(a) & (VI)(mask)) | ((VI)(b) & ~(VI)(mask))))
#define NQ 96  /* query vectors a task aims at: the more, the more each key read is reused */

/* The vector width the build computes in: a head dimension must be a multiple of it. */
int pd_prefill_attention_width(void) { return VW; }

typedef struct {
    const float *k, *v;   /* the chunk's own rows: position P + i at k + i * kv_row */
    const void *kc, *vc;  /* positions before P: the cache, through the table */
    const int64_t *table;
    int64_t kv_row, P;
    int kvb, bs, KVH, D;
} Keys;

/* Row `pos` of head h: a pointer to D floats (a bfloat16 cache's row widened into `wide`). */
static inline const float *key_row(const Keys *s, int which, int64_t pos, int h, float *wide) {
    if (pos >= s->P) return (which ? s->v : s->k) + (pos - s->P) * s->kv_row + (int64_t)h * s->D;
    const int64_t slot = s->table[pos / s->bs] * s->bs + pos % s->bs;
    const int64_t at = (slot * s->KVH + h) * (int64_t)s->D;
    if (!s->kvb) return (const float *)(which ? s->vc : s->kc) + at;
    const uint16_t *src = (const uint16_t *)(which ? s->vc : s->kc) + at;
    for (int d = 0; d < s->D; d++) wide[d] = pd_from_bf16(src[d]);
    return wide;
}

/* s[j][c0 .. c0 + nc) for keys j in [j0, j0 + nk) (nk <= KT): KT * nc accumulators over D. */
static inline void score_tile(const float *const *kr, int nk, const float *qt, int nqp, int c0, int nc, int D,
                              float *s) {
    VF a[KT][NC];
    for (int t = 0; t < KT; t++)
        for (int c = 0; c < NC; c++) a[t][c] = (VF){0};
    for (int d = 0; d < D; d++) {
        VF qv[NC];
        for (int c = 0; c < NC; c++) qv[c] = c < nc ? LDV(qt + (int64_t)d * nqp + (c0 + c) * VW) : (VF){0};
        for (int t = 0; t < KT; t++) {
            const float kd = kr[t < nk ? t : 0][d];
            for (int c = 0; c < NC; c++) a[t][c] += kd * qv[c];
        }
    }
    for (int t = 0; t < nk; t++)
        for (int c = 0; c < nc; c++) *(VFU *)(s + (int64_t)t * nqp + (c0 + c) * VW) = a[t][c];
}

/* acc[u][D] += sum over keys j < nk of p[j][u] * v[j] for the QT (or fewer) queries from u0. */
static inline void value_tile(const float *const *vr, int nk, const float *p, int nqp, int u0, int nu, int D,
                              float *acc) {
    for (int d0 = 0; d0 < D; d0 += 4 * VW) {
        const int ne = (D - d0) / VW < 4 ? (D - d0) / VW : 4;
        VF a[QT][4];
        for (int u = 0; u < QT; u++)
            for (int e = 0; e < 4; e++)
                a[u][e] = u < nu && e < ne ? LDV(acc + (int64_t)(u0 + u) * D + d0 + e * VW) : (VF){0};
        for (int j = 0; j < nk; j++) {
            const float *w = p + (int64_t)j * nqp + u0;
            for (int e = 0; e < 4; e++) {
                if (e >= ne) break;
                const VF x = LDV(vr[j] + d0 + e * VW);
                for (int u = 0; u < QT; u++) a[u][e] += w[u] * x;
            }
        }
        for (int u = 0; u < nu; u++)
            for (int e = 0; e < ne; e++) *(VFU *)(acc + (int64_t)(u0 + u) * D + d0 + e * VW) = a[u][e];
    }
}

/* Rows [r0, r1) of a chunk (positions P + r), KV head h. */
static void task(const float *q, int64_t q_row, const Keys *ks, float *out, int64_t o_row, int r0, int r1,
                 int h, int G, float scale, int64_t window) {
    const int64_t P = ks->P;
    const int D = ks->D, nq = (r1 - r0) * G, nqp = (nq + VW - 1) / VW * VW, nv = nqp / VW;
    /* qt [D][nqp] | s [KS][nqp] | acc [nqp][D] | m, l [nqp] | lim, lo [nqp] ints | wide [2][KS][D] */
    float *qt = scratch((size_t)nqp * (D + KS + D + 4) + 2 * (size_t)KS * D);
    float *s = qt + (int64_t)D * nqp, *acc = s + (int64_t)KS * nqp, *m = acc + (int64_t)nqp * D, *l = m + nqp;
    int32_t *lim = (int32_t *)(l + nqp), *lo = lim + nqp;
    float *wide = (float *)(lo + nqp);
    for (int u = 0; u < nqp; u++) {
        const int r = r0 + u / G, g = u % G;
        const float *qu = q + (int64_t)r * q_row + (int64_t)(h * G + g) * D;
        for (int d = 0; d < D; d++) qt[(int64_t)d * nqp + u] = u < nq ? qu[d] * scale : 0.0f;
        lim[u] = u < nq ? (int32_t)(P + r) : -1;  /* the last key it sees */
        lo[u] = u < nq && window > 0 ? (int32_t)(P + r - window + 1) : 0;
        m[u] = -INFINITY, l[u] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)nqp * D);
    const int64_t first = window > 0 && P + r0 - window + 1 > 0 ? P + r0 - window + 1 : 0, end = P + r1;
    const float *kr[KS], *vr[KS];
    for (int64_t k0 = first / KS * KS; k0 < end; k0 += KS) {
        const int nk = end - k0 < KS ? (int)(end - k0) : KS;
        for (int j = 0; j < nk; j++) kr[j] = key_row(ks, 0, k0 + j, h, wide + (int64_t)j * D);
        /* scores, skipping tiles every query of which sees none of the keys */
        for (int c0 = 0; c0 < nv; c0 += NC) {
            const int nc = nv - c0 < NC ? nv - c0 : NC;
            int hi = -1, lw = 1 << 30;
            for (int u = c0 * VW; u < (c0 + nc) * VW; u++) {
                hi = lim[u] > hi ? lim[u] : hi;
                if (lim[u] >= 0) lw = lo[u] < lw ? lo[u] : lw;
            }
            for (int j0 = 0; j0 < nk; j0 += KT) {
                const int n = nk - j0 < KT ? nk - j0 : KT;
                if (k0 + j0 > hi || k0 + j0 + n - 1 < lw) continue;
                score_tile(kr + j0, n, qt, nqp, c0, nc, D, s + (int64_t)j0 * nqp);
            }
        }
        /* the online softmax, down the columns: lanes are queries */
        /* keys [0, jmax) of the superblock weigh in for some query (the rows' last sees the most) */
        const int64_t top = lim[nq - 1] - k0 + 1;
        const int jmax = top < nk ? (int)top : nk;
        for (int c = 0; c < nv; c++) {
            const VI lm = *(const VI *)(lim + c * VW), lwv = *(const VI *)(lo + c * VW);
            const VF ninf = (VF){0} - INFINITY, one = (VF){0} + 1.0f;
            VF bm = ninf;
            for (int j = 0; j < jmax; j++) {
                const VI pos = (VI){0} + (int32_t)(k0 + j);
                const VI see = (pos <= lm) & (pos >= lwv);
                const VF x = SEL(see, LDV(s + (int64_t)j * nqp + c * VW), ninf);
                *(VFU *)(s + (int64_t)j * nqp + c * VW) = x;
                bm = SEL(x > bm, x, bm);
            }
            const VF mo = LDV(m + c * VW), mn = SEL(bm > mo, bm, mo);
            /* a lane that has seen no key yet has the maximum -inf: its reference is 0, its weights 0 */
            const VF ref = SEL(mn == ninf, (VF){0}, mn);
            const VI before = mo != ninf;  /* else nothing to rescale: the factor is 1 */
            const VF cr = SEL(before, VEXP(SEL(before, mo - ref, (VF){0})), one);
            VF sum = (VF){0};
            for (int j = 0; j < jmax; j++) {
                const VF x = LDV(s + (int64_t)j * nqp + c * VW);
                const VF p = SEL(x != ninf, VEXP(x - ref), (VF){0});
                *(VFU *)(s + (int64_t)j * nqp + c * VW) = p;
                sum += p;
            }
            /* a lane with no key in this superblock: the factor exp(0) = 1 and a sum of zeros */
            *(VFU *)(l + c * VW) = LDV(l + c * VW) * cr + sum;
            *(VFU *)(m + c * VW) = mn;
            for (int e = 0; e < VW; e++)
                if (cr[e] != 1.0f)
                    for (int d = 0; d < D; d++) acc[(int64_t)(c * VW + e) * D + d] *= cr[e];
        }
        if (jmax == 0) continue;
        for (int j = 0; j < jmax; j++) vr[j] = key_row(ks, 1, k0 + j, h, wide + (int64_t)(KS + j) * D);
        for (int u0 = 0; u0 < nq; u0 += QT) {
            const int nu = nq - u0 < QT ? nq - u0 : QT;
            /* keys past the tile's last query weigh zero: stop there */
            const int64_t top = lim[u0 + nu - 1] - k0 + 1;
            const int n = top < jmax ? (int)top : jmax;
            if (n > 0) value_tile(vr, n, s, nqp, u0, nu, D, acc);
        }
    }
    for (int u = 0; u < nq; u++) {
        const int r = r0 + u / G, g = u % G;
        float *o = out + (int64_t)r * o_row + (int64_t)(h * G + g) * D;
        const float inv = 1.0f / l[u];
        for (int d = 0; d < D; d++) o[d] = acc[(int64_t)u * D + d] * inv;
    }
}

typedef struct {
    int64_t cost;
    int c, h, r0, r1;
} Task;

static int by_cost(const void *a, const void *b) {
    const int64_t x = ((const Task *)a)->cost, y = ((const Task *)b)->cost;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* A step's tasks: every chunk's rows in blocks of a task's queries, every KV head, the costliest first,
   in a malloc'd array (the caller frees it); *count their number, *work (where given) their score products. */
void *pd_prefill_tasks(const int64_t *desc, int nc, int H, int KVH, int64_t window, int *count, int64_t *work) {
    const int G = H / KVH, qb = NQ / G > 0 ? NQ / G : 1;
    int n = 0;
    for (int c = 0; c < nc; c++) n += (int)((desc[4 * c + 1] + qb - 1) / qb) * KVH;
    Task *tasks = (Task *)malloc(sizeof(Task) * (size_t)(n > 0 ? n : 1));
    int64_t w = 0;
    n = 0;
    for (int c = 0; c < nc; c++) {
        const int64_t L = desc[4 * c + 1], P = desc[4 * c + 2];
        for (int r0 = 0; r0 < L; r0 += qb) {
            const int r1 = r0 + qb < L ? r0 + qb : (int)L;
            int64_t keys = P + r1;
            if (window > 0 && keys > window + (r1 - r0)) keys = window + (r1 - r0);
            for (int h = 0; h < KVH; h++) {
                tasks[n] = (Task){keys * (r1 - r0), c, h, r0, r1};
                w += tasks[n++].cost;
            }
        }
    }
    qsort(tasks, (size_t)n, sizeof(Task), by_cost);
    *count = n;
    if (work) *work = w * G;
    return tasks;
}

/* Task i of pd_prefill_tasks' array (the arguments as pd_prefill_attention's). */
void pd_prefill_task(const void *tasks, int i, const float *q, int64_t q_row, const float *k, const float *v,
                     int64_t kv_row, const void *kc, const void *vc, int kvb, const int64_t *tables,
                     const int64_t *desc, int bs, int H, int KVH, int D, float scale, int64_t window, float *out,
                     int64_t o_row) {
    const Task *t = (const Task *)tasks + i;
    const int64_t *dc = desc + 4 * t->c;
    const Keys ks = {k + dc[0] * kv_row, v + dc[0] * kv_row, kc, vc, dc[3] < 0 ? NULL : tables + dc[3],
                     kv_row, dc[2], kvb, bs, KVH, D};
    task(q + dc[0] * q_row, q_row, &ks, out + dc[0] * o_row, o_row, t->r0, t->r1, t->h, H / KVH, scale, window);
}

/* Every chunk's rows, every KV head; threads take tasks, the costliest first. window: a sliding
   window's width (0: none), query p seeing keys (p - window, p]. */
void pd_prefill_attention(const float *q, int64_t q_row, const float *k, const float *v, int64_t kv_row,
                          const void *kc, const void *vc, int kvb, const int64_t *tables, const int64_t *desc,
                          int nc, int bs, int H, int KVH, int D, float scale, int64_t window, float *out,
                          int64_t o_row, int threads) {
    int n;
    int64_t work;
    void *tasks = pd_prefill_tasks(desc, nc, H, KVH, window, &n, &work);
    work *= D;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && work >= (1 << 20))
    for (int i = 0; i < n; i++)
        pd_prefill_task(tasks, i, q, q_row, k, v, kv_row, kc, vc, kvb, tables, desc, bs, H, KVH, D, scale, window,
                        out, o_row);
    free(tasks);
}
