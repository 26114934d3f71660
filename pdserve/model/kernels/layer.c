/* The decoder layers of a step in a single call (one parallel region, see `team`), each:
   RMSNorm, the fused QKV product (+ bias),
   rotary embedding, the KV cache write, paged decode attention (and the prefill chunks' causal
   attention, prefill_attention.c), the output product and residual,
   RMSNorm, the gate/up product, SiLU * up, the down product and residual.

   The Python layer (model/llama.py) runs each of these as its own op: about 15 torch ops and native
   calls a layer, 450 a step, whose dispatch was a large share of a decode step at 8 streams.
   Here the same kernels run back to back from C (qgemm.c, norm.c, decode_attention.c and
   prefill_attention.c are linked in),
   so a step's outputs are those of the op-by-op path bit for bit: the rotary embedding rounds each
   product as torch's separate multiply and add do (no FMA contraction there), and the op-by-op path
   takes its SiLU * up from pd_silu_mul below too.

   x [n, hidden] is updated in place. A layer's cache: keys and values [slots, KVH, D] each. */
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "qgemm.h"
#include "vec.h"

void pd_qgemm_sums(int bits, const float *x, int64_t ldx, int M, int K, float *sx);
void pd_qgemm_tiles(int bits, const void *w, const void *d, const void *m, const float *x, int64_t ldx, float *y,
                    int64_t ldy, int M, int K, const float *sx, int t0, int t1);
void pd_rms_norm_row(const float *xr, const float *w, float *o, int n, float eps);
int pd_attend_heads(int n, int KVH, int threads);
int pd_attend_run(int n, int per, int threads);
void *pd_prefill_tasks(const int64_t *desc, int nc, int H, int KVH, int64_t window, int *count, int64_t *work);
void pd_prefill_task(const void *tasks, int i, const float *q, int64_t q_row, const float *k, const float *v,
                     int64_t kv_row, const void *kc, const void *vc, int kvb, const int64_t *tables,
                     const int64_t *desc, int bs, int H, int KVH, int D, float scale, int64_t window, float *out,
                     int64_t o_row);
void pd_attend_task(const float *q, int64_t q_row, const void *kc, const void *vc, const int64_t *tables,
                    int64_t tstride, const int64_t *first, const int64_t *ctx, float *out, int n, int H, int KVH,
                    int D, int bs, float scale, int hp, int run, int task, int kvb);

typedef struct {              /* a weight in qgemm.c's tile layout: bits 32, 8 or 4 (| PD_AQ8: qgemm_q8.c) */
    int bits, n, k;
    const void *w, *d, *m;
} pd_weight;

typedef struct {              /* one layer, fixed at load; inter 0: no MLP (gate_up, down unused) */
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
    int kv_bf16;              /* the cache holds bfloat16 (cache.kv_dtype), else float32 */
    const float *cos, *sin;   /* [n, D/2] */
    const int64_t *slots;     /* [n]: the cache slot each token's key and value go to */
    float *scratch;           /* n rows of qkv, attention [H * D], o [hidden], gu [2 inter]; then each thread's
                                 n rows of max(hidden, inter) (layer.py's FusedStep sizes it) */
    pd_group groups[MAX_GROUPS];
    /* the prefill chunks (rows after the decodes), as prefill_attention.c takes them: desc [nchunks][4],
       their block tables; window: the model's sliding window (0: none) */
    const int64_t *pf_desc, *pf_tables;
    int nchunks;
    int64_t window;
} pd_step;

typedef struct {              /* a step's prefill attention tasks (pd_prefill_tasks), the same every layer */
    const void *tasks;
    int n;
} pd_prefill;

/* silu(g) * u over one row of `inter` values. silu(g) = g * sigmoid(g), with e^-|g| so the
   exponential's argument is never positive. */
__attribute__((noinline)) static void silu_mul_row(const float *g, const float *u, float *o, int inter) {
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

/* silu(g) * u for gu = [g | u] rows of 2 * inter: out [rows, inter]. */
void pd_silu_mul(const float *gu, int64_t ld, float *out, int64_t ldo, int rows, int inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (int64_t)rows * inter >= (1 << 16))
    for (int r = 0; r < rows; r++) silu_mul_row(gu + r * ld, gu + r * ld + inter, out + r * ldo, inter);
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

/* heads [0, heads) of one row (D apart), with that row's cos and sin halves. */
static void rope_heads(float *row, int heads, int D, const float *cos, const float *sin) {
    for (int h = 0; h < heads; h++) rope(row + (int64_t)h * D, cos, sin, D / 2);
}

/* Rotary embedding of heads [0, heads) of each row of x (q's heads then k's, side by side as the qkv
   product lays them out), in place; row r's cos and sin halves at r * D / 2. The op-by-op layers'
   pass (a prefill's rows): torch's seven small ops a layer, each a pass over the rows and a wake-up
   of the thread pool, cost more than the arithmetic; this is rope() as the fused step runs it. */
void pd_rope_rows(float *x, int64_t ldx, int rows, int heads, int D, const float *cos, const float *sin,
                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (int64_t)rows * heads * D >= (1 << 18))
    for (int r = 0; r < rows; r++) rope_heads(x + r * ldx, heads, D, cos + (int64_t)r * D / 2, sin + (int64_t)r * D / 2);
}

/* The threads of one parallel region, working through a step's phases (norm, product, attention ...)
   with a barrier between phases. Under OMP_WAIT_POLICY=PASSIVE (cli.py: workers share their cores)
   every OpenMP region and barrier puts the idle thread to sleep and wakes it again; a decode step
   ran ~150 regions, each paying a wake-up, which spinning threads avoid. Here a step is one region. Its barriers spin, yielding the core every few
   pauses: a thread whose peer was descheduled by another process gives way to it. Work is handed
   out from a shared counter, so a thread that ran late takes fewer pieces instead of holding the
   others up. Yielding less often, or sleeping on a futex after a short spin, ran slower beside a
   busy process (figures: docs/benchmarks.md). */
#define RANGES 64   /* a product's ranges: one a thread, up to this many (more threads share them) */
typedef struct {
    atomic_int arrived, gen, next[2];
    struct {
        _Alignas(64) atomic_int taken;   /* a line each: a thread's own takes never bounce between cores */
    } range[2][RANGES];
} team;

typedef struct {
    team *tm;
    int T, id, phase;
} member;

#define YIELD_EVERY 32

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Waits for every member; the last to arrive readies the next phase's counter and releases them. */
static void sync_phase(member *me) {
    team *tm = me->tm;
    const int g = atomic_load(&tm->gen);
    if (atomic_fetch_add(&tm->arrived, 1) == me->T - 1) {
        atomic_store_explicit(&tm->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&tm->next[(me->phase + 1) & 1], 0, memory_order_relaxed);
        for (int r = 0; r < me->T && r < RANGES; r++)
            atomic_store_explicit(&tm->range[(me->phase + 1) & 1][r].taken, 0, memory_order_relaxed);
        atomic_store(&tm->gen, g + 1);
    } else {
        for (int spins = 0; atomic_load(&tm->gen) == g;)
            if (++spins % YIELD_EVERY == 0) sched_yield(); else relax();
    }
    me->phase++;
}

/* The next `chunk` pieces of this phase's work: its first index (>= the total when none is left). */
static inline int grab(member *me, int chunk) {
    return atomic_fetch_add_explicit(&me->tm->next[me->phase & 1], chunk, memory_order_relaxed);
}

/* A product's pieces: its columns are cut into one contiguous range a thread, each range into PIECES
   pieces. A thread takes its own range's pieces in order, then what is left of the others' (a thread
   that ran late has its last pieces taken by the others instead of holding them up). A thread then
   streams one run of the weight, where pieces handed out from one counter interleaved the threads
   every sixteenth of the product: each piece's start paid a cold stream and the kernel's setup again
   (decode steps of 1-32 rows and 512-row prompt steps ran faster this way, docs/benchmarks.md). */
#define PIECES 4

/* The next `piece` units of range r of this phase's product, relative to the range's start. */
static inline int take(member *me, int r, int piece) {
    return atomic_fetch_add_explicit(&me->tm->range[me->phase & 1][r].taken, piece, memory_order_relaxed);
}

/* What a product's thread does with the columns it has just computed, every row, before the phase's
   barrier (columns no other thread touches, so no phase of their own): add them into the residual
   (x + o), or for the QKV product finish their heads (finish_heads). */
typedef struct {
    float *residual;          /* [M, n]: residual += y over the columns; or NULL */
    const pd_layer *L;        /* the QKV product's heads, or NULL */
    const pd_step *s;
    const pd_prefill *pf;
    void *kc, *vc;
} after_product;

/* Heads [h0, h1) of the QKV product's rows (q's H heads, then k's and v's KVH each): the bias, the
   rotary embedding of q's and k's, and k's and v's rows into the cache at each row's slot. A head's
   values depend on that head's columns only, so heads finish apart, in any order, with the bits of
   a whole row's pass. */
static void finish_heads(const after_product *a, float *qkv, int h0, int h1) {
    const pd_layer *L = a->L;
    const pd_step *s = a->s;
    const int H = L->heads, KVH = L->kv_heads, D = L->head_dim, nq = L->qkv.n;
    for (int r = 0; r < s->n; r++) {
        float *row = qkv + (int64_t)r * nq;
        if (L->qkv_bias)
            for (int j = h0 * D; j < h1 * D; j++) row[j] = row[j] + L->qkv_bias[j];
        const float *cos = s->cos + (int64_t)r * D / 2, *sin = s->sin + (int64_t)r * D / 2;
        const int rotated = (h1 < H + KVH ? h1 : H + KVH) - h0;   /* q's and k's heads among them */
        if (rotated > 0) rope_heads(row + (int64_t)h0 * D, rotated, D, cos, sin);
        const int64_t slot = s->slots[r] * KVH * D;
        for (int h = h0 > H ? h0 : H; h < h1; h++) {   /* k's heads, then v's */
            const int v = h >= H + KVH;
            const int64_t at = slot + (int64_t)(h - H - v * KVH) * D;
            float *src = row + (int64_t)h * D;
            if (s->kv_bf16) {   /* rounded as torch rounds: attention then reads what the op-by-op path keeps */
                uint16_t *dst = (uint16_t *)(v ? a->vc : a->kc) + at;
                for (int j = 0; j < D; j++) dst[j] = pd_to_bf16(src[j]);
                if (a->pf->n)   /* a prefill chunk reads the step's own keys and values from these rows, rounded */
                    for (int j = 0; j < D; j++) src[j] = pd_from_bf16(dst[j]);
            } else {
                memcpy((float *)(v ? a->vc : a->kc) + at, src, sizeof(float) * D);
            }
        }
    }
}

static void product(member *me, const pd_weight *w, const float *x, int64_t ldx, float *y, int M,
                    const after_product *after) {
    float sx[8 * (w->k / 32) + 1];    /* qgemm.c's direct rows: at most 8 */
    /* Each thread rounds its own copy of the rows (M x K, a few microseconds): no phase for it. */
    void *xq = pd_qgemm_q8_x(w->bits, x, ldx, M, w->k);    /* int8 activations: every path the same */
    uint16_t *xb = xq ? NULL : pd_qgemm_bf16_x(w->bits, x, ldx, M, w->k);
    if (!xq && !xb) pd_qgemm_sums(w->bits, x, ldx, M, w->k, sx);
    /* the pieces handed out: tiles of 16 columns, or the QKV product's whole heads */
    const int unit = after && after->L ? after->L->head_dim / 16 : 1, units = w->n / 16 / unit;
    const int R = me->T < RANGES ? me->T : RANGES;
    for (int k = 0; k < R; k++) {   /* this thread's range first, then the others' */
        const int r = (me->id + k) % R, lo = (int)((int64_t)units * r / R), hi = (int)((int64_t)units * (r + 1) / R);
        const int piece = (hi - lo) / PIECES > 1 ? (hi - lo) / PIECES : 1;
        for (int u; (u = lo + take(me, r, piece)) < hi;) {
            const int t = u * unit, t1 = (u + piece < hi ? u + piece : hi) * unit;
            if (xq) pd_qgemm_q8_tiles(w->bits, w->w, w->d, w->m, xq, y, w->n, M, w->k, t, t1);
            else if (xb) pd_qgemm_bf16_tiles(w->bits, w->w, w->d, w->m, xb, y, w->n, M, w->k, t, t1);
            else pd_qgemm_tiles(w->bits, w->w, w->d, w->m, x, ldx, y, w->n, M, w->k, sx, t, t1);
            if (after && after->L) finish_heads(after, y, t / unit, t1 / unit);
            else if (after)
                for (int i = 0; i < M; i++) {
                    float *xr = after->residual + (int64_t)i * w->n;
                    const float *yr = y + (int64_t)i * w->n;
                    for (int c = t * 16; c < t1 * 16; c++) xr[c] = xr[c] + yr[c];
                }
        }
    }
    pd_qgemm_q8_free(xq);
    pd_qgemm_bf16_free(xb);
    sync_phase(me);
}

/* A step's RMS norms and SiLU * up, row by row into the rows a product reads next. Below SHARED_ROWS
   rows (a decode step's few: a few microseconds) each thread computes every row into rows of its own
   and goes straight on to its share of the product, where a phase of their own cost a barrier (three
   a layer); from SHARED_ROWS (a prefill chunk's hundreds) every thread repeating every row costs
   more than the barrier, and the rows are shared out into one buffer, a phase each. The same
   function on each row either way: the same bits. */
#define SHARED_ROWS 16

/* The first row this thread computes of such a pass over [0, n), then the one after r (>= n: none left). */
static inline int first_row(member *me, int n) { return n < SHARED_ROWS ? 0 : grab(me, 1); }
static inline int next_row(member *me, int r, int n) { return n < SHARED_ROWS ? r + 1 : grab(me, 1); }

/* The end of such a pass: shared rows are read by every thread after it. */
static inline void rows_done(member *me, int n) {
    if (n >= SHARED_ROWS) sync_phase(me);
}

/* rows [0, n) of x RMS-normed into `own` */
static void norm_rows(member *me, const float *x, const float *w, float *own, int n, int hd, float eps) {
    for (int r = first_row(me, n); r < n; r = next_row(me, r, n))
        pd_rms_norm_row(x + (int64_t)r * hd, w, own + (int64_t)r * hd, hd, eps);
    rows_done(me, n);
}

static void layer(member *me, const pd_layer *L, const pd_step *s, const pd_prefill *pf, float *x, void *kc,
                  void *vc) {
    const int n = s->n, hd = L->hidden, D = L->head_dim, H = L->heads, KVH = L->kv_heads, nq = L->qkv.n;
    float *qkv = s->scratch, *att = qkv + (int64_t)n * nq, *o = att + (int64_t)n * H * D, *gu = o + (int64_t)n * hd;
    const int64_t width = hd > L->inter ? hd : L->inter; /* each thread's own rows, after the shared ones */
    /* this thread's rows, or from SHARED_ROWS the first thread's, which every thread fills and reads */
    float *own = gu + (int64_t)n * 2 * L->inter + (int64_t)(n < SHARED_ROWS ? me->id : 0) * n * width;

    norm_rows(me, x, L->input_norm, own, n, hd, L->eps);
    const after_product heads = {NULL, L, s, pf, kc, vc};
    if (D % 16 == 0) {   /* heads of whole tiles: each finished by the thread that computed it */
        product(me, &L->qkv, own, hd, qkv, n, &heads);
    } else {
        product(me, &L->qkv, own, hd, qkv, n, NULL);
        for (int r; (r = grab(me, 1)) < H + 2 * KVH;) finish_heads(&heads, qkv, r, r + 1);
        sync_phase(me);
    }
    /* the prefill chunks' tasks (the costliest first), then every group's (sequence, KV heads), one counter */
    const int hp = pd_attend_heads(n, KVH, me->T), per = KVH / hp, run = pd_attend_run(n, per, me->T);
    int tasks = pf->n;
    for (int g = 0; g < s->ngroups; g++) tasks += s->groups[g].n * per;
    for (int t; (t = grab(me, 1)) < tasks;) {
        if (t < pf->n) {
            pd_prefill_task(pf->tasks, t, qkv, nq, qkv + H * D, qkv + (H + KVH) * D, nq, kc, vc, s->kv_bf16,
                            s->pf_tables, s->pf_desc, s->block_size, H, KVH, D, L->scale, s->window, att,
                            (int64_t)H * D);
            continue;
        }
        int g = 0, local = t - pf->n;
        while (local >= s->groups[g].n * per) local -= s->groups[g++].n * per;
        const pd_group *G = &s->groups[g];
        pd_attend_task(qkv + (int64_t)G->start * nq, nq, kc, vc, G->table, G->tstride, G->first, G->ctx,
                       att + (int64_t)G->start * H * D, G->n, H, KVH, D, s->block_size, L->scale, hp, run, local,
                       s->kv_bf16);
    }
    sync_phase(me);
    const after_product residual = {x, NULL, NULL, NULL, NULL, NULL};
    product(me, &L->o, att, H * D, o, n, &residual);
    if (L->inter == 0) return;   /* the attention half only: a MoE block follows in Python */

    norm_rows(me, x, L->post_norm, own, n, hd, L->eps);
    product(me, &L->gate_up, own, hd, gu, n, NULL);
    for (int r = first_row(me, n); r < n; r = next_row(me, r, n))
        silu_mul_row(gu + (int64_t)r * 2 * L->inter, gu + (int64_t)r * 2 * L->inter + L->inter,
                     own + (int64_t)r * L->inter, L->inter);
    rows_done(me, n);
    product(me, &L->down, own, L->inter, o, n, &residual);
}

/* Layers [0, nl) of a decode-only step in one parallel region; layer l's cache is kv + l * layer_stride
   (keys) and that + v_offset (values), in values of the cache's type. x [n, hidden] is updated in place. */
void pd_decode_layers(const pd_layer *L, int nl, const pd_step *s, float *x, void *kv, int64_t layer_stride,
                      int64_t v_offset) {
    team tm = {0};
    const int64_t es = s->kv_bf16 ? 2 : 4;
    pd_prefill pf = {NULL, 0};
    if (s->nchunks && nl > 0)
        pf.tasks = pd_prefill_tasks(s->pf_desc, s->nchunks, L[0].heads, L[0].kv_heads, s->window, &pf.n, NULL);
#pragma omp parallel num_threads(s->threads) if (s->threads > 1)
    {
        member me = {&tm, omp_get_num_threads(), omp_get_thread_num(), 0};
        for (int l = 0; l < nl; l++) {
            char *kc = (char *)kv + l * layer_stride * es;
            layer(&me, &L[l], s, &pf, x, kc, kc + v_offset * es);
        }
    }
    free((void *)pf.tasks);
}

/* One layer (the step's layers one call each, where the caller acts between layers). */
void pd_decode_layer(const pd_layer *L, const pd_step *s, float *x, void *kc, void *vc) {
    pd_decode_layers(L, 1, s, x, kc, 0, ((char *)vc - (char *)kc) / (s->kv_bf16 ? 2 : 4));
}
