/* What qgemm.c and qgemm_bf16.c share, and what layer.c calls of them: the tile shape, the
   bfloat16 products' and the int8-activation products' entry points. */
#ifndef PD_QGEMM_H
#define PD_QGEMM_H
#include <stdint.h>

#define NC 16   /* output channels per tile */
#define KB 256  /* input values per buffered block: 16 KB of floats, in L1 */

/* qgemm.c: input values [k0, k1) of tile t of a quantized weight (bits 4 or 8), as floats in buf [k1 - k0][16]. */
void pd_dequant_tile(int bits, const void *w, const void *d, const void *m, int K, int t, int k0, int k1, float *buf);

/* qgemm_bf16.c: x as bfloat16 rows where a product of M rows runs on bfloat16 pairs (free it with
   pd_qgemm_bf16_free), else NULL; then its output tiles [t0, t1). */
uint16_t *pd_qgemm_bf16_x(int bits, const float *x, int64_t ldx, int M, int K);
void pd_qgemm_bf16_free(uint16_t *xb);
void pd_qgemm_bf16_tiles(int bits, const void *w, const void *d, const void *m, const uint16_t *xb, float *y,
                         int64_t ldy, int M, int K, int t0, int t1);
/* 1 where those products take Intel AMX's tiles (built in and granted by the kernel); want 0 turns them
   off (the vector paths run), 1 asks for them again. */
int pd_qgemm_amx(int want);
int pd_qgemm_amx_rows(int bits); /* from how many rows (bits 4 or 8) they take the tiles; 0: they do not */
int pd_qgemm_amx_from(int rows); /* int4's rounded tile: set where measured (clamped 9-32; returned) */
int pd_qgemm_amx_exact_from(int rows); /* int4's exact tiles: set where measured (clamped 1-9; returned) */
int pd_qgemm_amx8_from(int rows); /* int8's tiles: set where measured (clamped 1-9; returned) */
/* Products of fewer rows that would take the tiles (int4's exact tiles; int8's) compute the tiles' bits
   on vector FMAs instead: set where measured (clamped 1-9, 1: the tiles at every row count; returned;
   below 0 only returns it). Only where pd_qgemm_amx_vectors_agree: 1 where the vectors gave this CPU's
   tiles' bits in a check run once a process. */
int pd_qgemm_amx_vectors4_below(int rows);
int pd_qgemm_amx_vectors8_below(int rows);
int pd_qgemm_amx_vectors_agree(void);
int pd_qgemm_amx_pairs_from_k(int K); /* from 48 rows, two tiles a block from depth K: set where measured
                                        (returned; below 0 only returns it) */
int pd_qgemm_bf16_rows(int bits); /* from how many rows (bits 4 or 8) pd_qgemm_bf16_x rounds; 0: never */
/* int4 on the vector pairs (no AMX): the rounded tile's start, set where measured (clamped 9-64;
   returned; below 0 only returns it). */
int pd_qgemm_pairs_rounded_from(int rows);

/* qgemm.c: products of up to `rows` rows (0: none, the default; at most 4096; returned; below 0 only
   returns the bound) compute
   each row the same way whatever their row count (model.batch_invariant): int4 and int8 take their
   exact path from 1 row, the one a product of every such size can take (qgemm_bf16.c's exact tiles
   or pairs where built in, else the dequantized block here); pd_qgemm_invariant_at(M): whether a
   product of M rows is one of them. */
int pd_qgemm_invariant(int rows);
/* qgemm.c: how far ahead (bytes) the float-activation register rows prefetch the weight (clamped to
   [512, 32768]; returned; below 0 only returns it). */
int pd_qgemm_prefetch(int bytes);
/* qgemm.c: from how many rows int4's register rows look their nibbles up instead of converting them
   (the same floats; set where measured, clamped 1-DIRECT_ROWS + 1, the last: never; returned; below 0
   only returns it). 0: this build has one way only. */
int pd_qgemm_lut_from(int rows);
int pd_qgemm_invariant_at(int M);

/* qgemm_q8.c: int4 or int8 with the activations quantized to int8 per row in blocks of 32 (bits 4 or 8,
   | PD_AQ8).
   pd_qgemm_q8_x prepares the rows (NULL for any other bits: the kernels above run), then the
   output tiles [t0, t1); free the rows with pd_qgemm_q8_free. */
#define PD_AQ8 256
void *pd_qgemm_q8_x(int bits, const float *x, int64_t ldx, int M, int K);
void pd_qgemm_q8_free(void *xq);
void pd_qgemm_q8_tiles(int bits, const void *w, const void *d, const void *m, const void *xq, float *y,
                       int64_t ldy, int M, int K, int t0, int t1);
#endif
