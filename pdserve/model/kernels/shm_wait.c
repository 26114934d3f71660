/* Flags in shared memory for the expert-parallel ranks of one host (model/ep_shm.py): a release store
   after a message is written, an acquire wait before it is read, so the message's bytes are visible
   once its flag is, on any CPU. The wait spins a little (a peer on another core answers within
   microseconds), then yields, then sleeps in short steps, and gives up at its deadline or when the
   peer's process is gone. */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() __asm__ __volatile__("" ::: "memory")
#endif

#define SPINS 4096
#define YIELDS 2000

void pd_shm_store(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Whether process pid has exited: gone, or a zombie not reaped yet (a killed child of rank 0 stays one
   until rank 0 waits for it, and kill(pid, 0) still succeeds on it). */
static int gone(int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (f) {
        const size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        const char *close = strrchr(buf, ')');
        return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
    }
    return kill(pid, 0) != 0 && errno == ESRCH;
}

/* Waits until *p >= want. Returns 0 then, 1 past timeout_s, 2 when process `pid` (> 0) is gone. */
int pd_shm_wait(const int64_t *p, int64_t want, double timeout_s, int pid) {
    for (int i = 0; i < SPINS; i++) {
        if (__atomic_load_n(p, __ATOMIC_ACQUIRE) >= want) return 0;
        RELAX();
    }
    const double end = now_s() + timeout_s;
    const struct timespec nap = {0, 20000};
    for (long i = 0;; i++) {
        if (__atomic_load_n(p, __ATOMIC_ACQUIRE) >= want) return 0;
        if ((i & 255) == 0) {
            if (now_s() > end) return 1;
            if (pid > 0 && gone(pid)) return 2;
        }
        if (i < YIELDS)
            sched_yield();
        else
            nanosleep(&nap, 0);
    }
}
