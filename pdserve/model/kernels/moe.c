/* The routed experts of one MoE layer in one call: every choice of every token that lands in this
   rank's slots, computed as the op-by-op path (model/moe.py `routed_experts_loop`) computes it.

   The Python path sorts the choices by slot, then runs two products per active slot and a dozen
   small ops around them: at a decode step of 8 rows and top-8 of 64 experts that is ~50 slots, each
   a couple of native calls and torch ops, whose dispatch costs more than the products' weight reads.
   Here the whole layer is one parallel region:

   1. (serial, O(choices)) a stable counting sort of the choices by slot, in [lo, hi): row r of the
      sorted order is token tok[r]'s choice with weight wr[r]; each token's rows are listed in order;
   2. the rows gathered (x[tok[r]]), and per active slot qgemm.c's preparation of its rows (int4's
      group sums, the bfloat16 rows where qgemm_bf16.c takes the product);
   3. gate/up: work items (slot, a chunk of its 16-channel output tiles) over the threads, each one
      qgemm.c tile call on that slot's rows (a slot's weights are read once whatever its rows);
   4. SiLU(gate) * up per row (layer.c's, as the Python path's), then the down product's preparation;
   5. down: work items (slot, tiles) again;
   6. each token's output: the sum of weight * row over its rows, in sorted order (as index_add adds
      them), so no two threads write one token.

   A tile's result does not depend on which thread computes it or with which others, so the output
   is that of the slot-by-slot path bit for bit (same qgemm.c calls with the same rows).

   Weights in qgemm.c's tile layout (bits 32, 8 or 4; int4 | PD_AQ8 quantizes each slot's rows to int8
   as qgemm_q8.c does for every other int4 product), slot s at a fixed byte stride from slot 0. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "qgemm.h"

void pd_qgemm_sums(int bits, const float *x, int64_t ldx, int M, int K, float *sx);
void pd_qgemm_tiles(int bits, const void *w, const void *d, const void *m, const float *x, int64_t ldx, float *y,
                    int64_t ldy, int M, int K, const float *sx, int t0, int t1);
void pd_silu_mul(const float *gu, int64_t ld, float *out, int64_t ldo, int rows, int inter, int threads);

typedef struct {              /* one matrix of every slot: slot s's tensors at w + s * sw etc. */
    int bits, n, k;
    const char *w, *d, *m;
    int64_t sw, sd, sm;
} pd_experts;

typedef struct { int slot, t0; } item;

/* The product of slot a's rows through tiles [t0, t0 + chunk). */
static void tile_item(const pd_experts *E, int s, const float *x, int M, const float *sx, const uint16_t *xb,
                      const void *xq, float *y, int t0, int chunk) {
    const int tiles = E->n / NC, t1 = t0 + chunk < tiles ? t0 + chunk : tiles;
    const void *w = E->w + E->sw * s, *d = E->d + E->sd * s, *m = E->m + E->sm * s;
    if (xq) pd_qgemm_q8_tiles(E->bits, w, d, m, xq, y, E->n, M, E->k, t0, t1);
    else if (xb) pd_qgemm_bf16_tiles(E->bits, w, d, m, xb, y, E->n, M, E->k, t0, t1);
    else pd_qgemm_tiles(E->bits, w, d, m, x, E->k, y, E->n, M, E->k, sx, t0, t1);
}

/* Work items of one product: every active slot's tiles in chunks, enough items for every thread to
   take several (a decode step's slots hold a row or two, so a slot's tiles are split). */
static int items_of(const pd_experts *E, const int *active, int na, int threads, item *out, int *chunk) {
    const int tiles = E->n / NC;
    int c = (int)((int64_t)na * tiles / (4 * threads));
    c = c < 1 ? 1 : c > tiles ? tiles : c;
    int ni = 0;
    for (int a = 0; a < na; a++)
        for (int t = 0; t < tiles; t += c) out[ni++] = (item){a, t};
    *chunk = c;
    return ni;
}

/* out [T, H] (ldo apart) := sum over the choices (slots [T, k], weights [T, k]) in [lo, hi) of
   weight * down(silu(gate(x)) * up(x)), the other tokens' rows zero. x [T, H] rows ldx apart. */
__attribute__((optimize("fp-contract=off")))
void pd_moe(const pd_experts *gu, const pd_experts *dn, int T, int k, const int64_t *slots, const float *weights,
            int lo, int hi, const float *x, int64_t ldx, float *out, int64_t ldo, int threads) {
    const int H = gu->k, I2 = gu->n, I = dn->k, nl = hi - lo, TK = T * k;
    for (int t = 0; t < T; t++) memset(out + (int64_t)t * ldo, 0, sizeof(float) * H);
    /* 1. the counting sort (stable: a slot's rows in token order, as torch's stable argsort) */
    int *ints = calloc((size_t)2 * (nl + 1) + 3 * (size_t)TK + T, sizeof(int));
    if (!ints) abort();
    int *off = ints, *cur = off + nl + 1, *tok = cur + nl + 1, *trow = tok + TK, *tcnt = trow + TK, *act = tcnt + T;
    for (int p = 0; p < TK; p++)
        if (slots[p] >= lo && slots[p] < hi) off[slots[p] - lo + 1]++;
    for (int s = 0; s < nl; s++) off[s + 1] += off[s];
    const int R = off[nl];
    if (R == 0) {
        free(ints);
        return;
    }
    float *wr = malloc(sizeof(float) * R);
    memcpy(cur, off, sizeof(int) * nl);
    for (int p = 0; p < TK; p++)
        if (slots[p] >= lo && slots[p] < hi) {
            const int r = cur[slots[p] - lo]++;
            tok[r] = p / k, wr[r] = weights[p];
        }
    for (int r = 0; r < R; r++) trow[tok[r] * k + tcnt[tok[r]]++] = r;   /* each token's rows, ascending */
    int na = 0;
    for (int s = 0; s < nl; s++)
        if (off[s + 1] > off[s]) act[na++] = s;
    /* scratch: gathered rows, gate/up, act, outputs, and the group sums of x and act */
    const int64_t gx = H / 32, ga = I / 32;
    float *xs = malloc(sizeof(float) * (size_t)R * (H + I2 + I + H + gx + ga));
    float *g = xs + (int64_t)R * H, *a = g + (int64_t)R * I2, *ys = a + (int64_t)R * I, *sxx = ys + (int64_t)R * H,
          *sxa = sxx + R * gx;
    const int tiles_max = (I2 > H ? I2 : H) / NC;
    item *items = malloc(sizeof(item) * ((size_t)na * tiles_max + 1));
    uint16_t **xb = calloc((size_t)na, sizeof(uint16_t *));
    void **xq = calloc((size_t)na, sizeof(void *));
    if (!wr || !xs || !items || !xb || !xq) abort();
    int cg, cd, ni;

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* 2. gather and prepare the gate/up product */
#pragma omp for schedule(static)
        for (int r = 0; r < R; r++) memcpy(xs + (int64_t)r * H, x + (int64_t)tok[r] * ldx, sizeof(float) * H);
#pragma omp for schedule(dynamic)
        for (int j = 0; j < na; j++) {
            const int s = act[j], r0 = off[s], M = off[s + 1] - r0;
            xq[j] = pd_qgemm_q8_x(gu->bits, xs + (int64_t)r0 * H, H, M, H);
            xb[j] = xq[j] ? NULL : pd_qgemm_bf16_x(gu->bits, xs + (int64_t)r0 * H, H, M, H);
            if (!xq[j] && !xb[j]) pd_qgemm_sums(gu->bits, xs + (int64_t)r0 * H, H, M, H, sxx + r0 * gx);
        }
#pragma omp single
        ni = items_of(gu, act, na, omp_get_num_threads(), items, &cg);
        /* 3. gate/up */
#pragma omp for schedule(dynamic)
        for (int i = 0; i < ni; i++) {
            const int j = items[i].slot, s = act[j], r0 = off[s];
            tile_item(gu, s, xs + (int64_t)r0 * H, off[s + 1] - r0, sxx + r0 * gx, xb[j], xq[j], g + (int64_t)r0 * I2,
                      items[i].t0, cg);
        }
        /* 4. SiLU * up, and the down product's preparation */
#pragma omp for schedule(static)
        for (int r = 0; r < R; r++) pd_silu_mul(g + (int64_t)r * I2, I2, a + (int64_t)r * I, I, 1, I, 1);
#pragma omp for schedule(dynamic)
        for (int j = 0; j < na; j++) {
            const int s = act[j], r0 = off[s], M = off[s + 1] - r0;
            pd_qgemm_bf16_free(xb[j]);
            pd_qgemm_q8_free(xq[j]);
            xq[j] = pd_qgemm_q8_x(dn->bits, a + (int64_t)r0 * I, I, M, I);
            xb[j] = xq[j] ? NULL : pd_qgemm_bf16_x(dn->bits, a + (int64_t)r0 * I, I, M, I);
            if (!xq[j] && !xb[j]) pd_qgemm_sums(dn->bits, a + (int64_t)r0 * I, I, M, I, sxa + r0 * ga);
        }
#pragma omp single
        ni = items_of(dn, act, na, omp_get_num_threads(), items, &cd);
        /* 5. down */
#pragma omp for schedule(dynamic)
        for (int i = 0; i < ni; i++) {
            const int j = items[i].slot, s = act[j], r0 = off[s];
            tile_item(dn, s, a + (int64_t)r0 * I, off[s + 1] - r0, sxa + r0 * ga, xb[j], xq[j], ys + (int64_t)r0 * H,
                      items[i].t0, cd);
        }
#pragma omp for schedule(static)
        for (int j = 0; j < na; j++) pd_qgemm_bf16_free(xb[j]), pd_qgemm_q8_free(xq[j]);
        /* 6. each token's weighted sum, its rows in sorted order; each product rounded on its own */
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            float *o = out + (int64_t)t * ldo;
            for (int c = 0; c < tcnt[t]; c++) {
                const int r = trow[t * k + c];
                const float w = wr[r], *y = ys + (int64_t)r * H;
                for (int h = 0; h < H; h++) o[h] = o[h] + y[h] * w;
            }
        }
    }
    free(xq), free(xb), free(items), free(xs), free(wr), free(ints);
}
