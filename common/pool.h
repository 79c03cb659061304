/* A small fixed thread pool for data-parallel kernels: pool_run() calls fn on every thread
 * (the caller is thread 0) and returns when all are done. Workers spin briefly between jobs
 * (kernels are dispatched hundreds of times per forward pass), then sleep; pool_set_spin
 * changes how long. */
#ifndef COMMON_POOL_H
#define COMMON_POOL_H

#include "common/err.h"

struct pool;

#define POOL_SPIN_DEFAULT 200000 /* polls before an idle worker sleeps */

/* fn(arg, ith, nth): ith in [0, nth). Must not call pool_run itself. */
typedef void (*pool_fn)(void *arg, int ith, int nth);

/* n_threads >= 1 (1 = no workers, everything runs in the caller). Caller frees with pool_free. */
enum status pool_init(struct pool **out, int n_threads, struct err_detail *err);
void pool_free(struct pool *p); /* NULL ok; joins workers */
int pool_size(const struct pool *p);
/* Polls an idle worker makes before it sleeps (default POOL_SPIN_DEFAULT). 0 = sleep as soon as
 * a job is done: for pools whose jobs come milliseconds apart, so that idle workers leave the
 * CPUs to other threads; a job then costs a wake-up (tens of microseconds). */
void pool_set_spin(struct pool *p, int polls);
void pool_run(struct pool *p, pool_fn fn, void *arg);

/* Split [0, n) evenly: the range thread ith of nth owns. */
static inline void pool_range(long n, int ith, int nth, long *lo, long *hi)
{
    long per = n / nth, rem = n % nth;
    *lo = ith * per + (ith < rem ? ith : rem);
    *hi = *lo + per + (ith < rem);
}

#endif
