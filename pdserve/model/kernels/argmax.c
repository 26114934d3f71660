/* Each row's argmax over float32 logits, as torch.argmax answers it: the first of tied largest
   values, or the first NaN where a row has one. torch's CPU argmax walks a row of 49152 logits in
   ~45 us (one thread, not vectorized), 1.3 ms of a 32-stream decode step. Here a vectorized pass
   finds the largest value, a second finds where it first occurs, and rows run across threads. */
#include <math.h>
#include <stdint.h>
#include "vec.h"

static int64_t first_index(const float *x, int64_t n, float m, int nan) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {        /* a whole 32-value block is tested before any branch */
        v8i hit = (v8i){0};
        for (int j = 0; j < 32; j += 8) {
            const v8f v = LD(x + i + j);
            hit |= nan ? (v8i)(v != v) : (v8i)(v == m);
        }
        int any = 0;
        for (int j = 0; j < 8; j++) any |= hit[j];
        if (any) break;
    }
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return 0;
}

static int64_t row_argmax(const float *x, int64_t n) {
    v8f mx = (v8f){0} - INFINITY;
    v8i nan = (v8i){0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f v = LD(x + i);
        const v8i gt = (v8i)(v > mx);            /* C has no vector ?: */
        mx = (v8f)((gt & (v8i)v) | (~gt & (v8i)mx));
        nan |= (v8i)(v != v);
    }
    float m = -INFINITY;
    int anynan = 0;
    for (int j = 0; j < 8; j++) m = mx[j] > m ? mx[j] : m, anynan |= nan[j];
    for (; i < n; i++) m = x[i] > m ? x[i] : m, anynan |= x[i] != x[i];
    return first_index(x, n, m, anynan);
}

void pd_argmax(const float *x, int64_t ldx, int rows, int64_t n, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 4)
    for (int r = 0; r < rows; r++) out[r] = row_argmax(x + r * ldx, n);
}
