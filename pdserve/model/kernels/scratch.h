/* A thread's scratch buffer, kept between calls: a fresh malloc of a long context's scores or tiles
   is an mmap and its page faults on every call. 64-byte aligned; grows by half again when outgrown
   (its contents are not kept). */
#ifndef PD_SCRATCH_H
#define PD_SCRATCH_H
#include <stdlib.h>

static float *scratch(size_t floats) {
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        free(buf);
        cap = floats + floats / 2;
        buf = (float *)aligned_alloc(64, ((sizeof(float) * cap + 63) / 64) * 64);
    }
    return buf;
}

#endif
