/* The stand-in CUDA driver, part 2 of 13: failing chosen calls.
 * One translation unit with fake_cuda.c, which includes it (its types and state are
 * there and in the parts before it); never compiled alone. */

/* ------------------------------------------------------------------ failing chosen calls */

typedef struct { char name[64]; long countdown; CUresult code; } FailPoint;
static FailPoint failpoints[8];

/* Whether this call of ``name`` is the one a test asked to fail (lock held). */
static CUresult failpoint(const char *name) {
    for (int i = 0; i < 8; i++) {
        FailPoint *f = &failpoints[i];
        if (f->countdown > 0 && strcmp(f->name, name) == 0 && --f->countdown == 0) return f->code;
    }
    return OK;
}

#define ENTER() pthread_mutex_lock(&lock); do { CUresult fp_ = failpoint(__func__); \
    if (fp_ != OK) { pthread_mutex_unlock(&lock); return fp_; } } while (0)
#define LEAVE(r) do { CUresult r_ = (r); pthread_mutex_unlock(&lock); return r_; } while (0)
/* The same failure point, for entry points that take the lock for nothing else. */
#define FAIL_IF_ASKED() do { pthread_mutex_lock(&lock); CUresult fp_ = failpoint(__func__); \
    pthread_mutex_unlock(&lock); if (fp_ != OK) return fp_; } while (0)
