/* Thread pool: a generation counter announces each job; workers spin on it for a while and
 * then block on a condition variable; a countdown tells the caller when all have finished. */
#include "common/pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

struct pool {
    int n;                      /* threads including the caller */
    pthread_t *threads;         /* n - 1 workers */
    pthread_mutex_t mu;         /* guards sleeping on cv */
    pthread_cond_t cv;          /* wakes sleeping workers on a new job */
    atomic_uint gen;            /* incremented once per job */
    atomic_int pending;         /* workers still running the current job */
    atomic_int quit;            /* set by pool_free */
    atomic_int spin;            /* polls before an idle worker sleeps (pool_set_spin) */
    pool_fn fn;                 /* current job */
    void *arg;                  /* its argument */
};

struct worker_arg {
    struct pool *p; /* owning pool */
    int ith;        /* this worker's index (>= 1) */
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *worker_main(void *v)
{
    struct worker_arg wa = *(struct worker_arg *)v;
    free(v);
    struct pool *p = wa.p;
    unsigned seen = 0;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen &&
               !atomic_load(&p->quit)) {
            if (++spins < atomic_load_explicit(&p->spin, memory_order_relaxed)) {
                cpu_relax();
                if (spins % 1024 == 0)
                    sched_yield(); /* be polite when the machine is oversubscribed */
                continue;
            }
            pthread_mutex_lock(&p->mu);
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->quit))
                pthread_cond_wait(&p->cv, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->quit))
            return NULL;
        seen = g;
        p->fn(p->arg, wa.ith, p->n);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_acq_rel);
    }
}

enum status pool_init(struct pool **out, int n_threads, struct err_detail *err)
{
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024)
        return err_set(err, ST_ERR_INVALID_ARG, "thread count %d not in 1..1024", n_threads);
    struct pool *p = calloc(1, sizeof(*p));
    if (!p)
        return err_set(err, ST_ERR_NOMEM, "no memory for thread pool");
    p->n = n_threads;
    atomic_init(&p->spin, POOL_SPIN_DEFAULT);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = calloc((size_t)n_threads, sizeof(*p->threads));
    if (!p->threads) {
        pool_free(p);
        return err_set(err, ST_ERR_NOMEM, "no memory for thread pool");
    }
    /* the kernels keep tiles of up to 256 KiB on the stack: 8 MiB, whatever `ulimit -s` said
     * when the process started (glibc's default for threads) */
    pthread_attr_t attr;
    const int attr_ok = !pthread_attr_init(&attr) && !pthread_attr_setstacksize(&attr, 8 << 20);
    for (int i = 1; i < n_threads; i++) {
        struct worker_arg *wa = malloc(sizeof(*wa));
        if (wa) {
            wa->p = p;
            wa->ith = i;
        }
        int rc = wa ? pthread_create(&p->threads[i - 1], attr_ok ? &attr : NULL, worker_main, wa)
                    : ENOMEM;
        if (rc) {
            free(wa);
            p->n = i; /* only i - 1 workers exist */
            pool_free(p);
            if (attr_ok)
                pthread_attr_destroy(&attr);
            return err_set(err, ST_ERR_INTERNAL, "cannot start worker thread %d: %s", i,
                           strerror(rc));
        }
    }
    if (attr_ok)
        pthread_attr_destroy(&attr);
    *out = p;
    return ST_OK;
}

void pool_free(struct pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++)
        pthread_join(p->threads[i - 1], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->threads);
    free(p);
}

int pool_size(const struct pool *p) { return p->n; }

void pool_set_spin(struct pool *p, int polls)
{
    atomic_store_explicit(&p->spin, polls < 0 ? 0 : polls, memory_order_relaxed);
}

void pool_run(struct pool *p, pool_fn fn, void *arg)
{
    if (p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->pending, p->n - 1, memory_order_relaxed);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    fn(arg, 0, p->n);
    for (unsigned spins = 1; atomic_load_explicit(&p->pending, memory_order_acquire) > 0; spins++) {
        cpu_relax();
        if (spins % 1024 == 0)
            sched_yield();
    }
}
