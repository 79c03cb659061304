/* The backend factory: kern_backend_open picks a backend by device name, so nothing above
 * kernels/ names one. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#include "kernels/comm.h"
#include "kernels/comm_staged.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/comm_cpu.h"
#include "kernels/kernels.h"
#ifdef QUERN_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

/* Whether --device auto takes a CUDA device when one is present. It stays 0 until the CUDA
 * backend has passed scripts/gpu-check.sh on a GPU (docs/CUDA_NOTES.md): until then a user's job
 * runs on the CPU unless they ask for --device cuda. */
#define KERN_CUDA_AUTO 0

/* The device `auto` resolves to, logged once per process. */
static const char *auto_device(void)
{
#ifdef QUERN_CUDA
    static int logged;
    char why[128] = "";
    const int n = kern_cuda_device_count(why, sizeof(why));
    if (n > 0 && KERN_CUDA_AUTO)
        return "cuda";
    if (!__atomic_exchange_n(&logged, 1, __ATOMIC_RELAXED)) {
        if (n > 0)
            LOG_INFO("%d CUDA device(s) found, but the CUDA backend is not yet checked on a GPU: "
                     "running on the CPU (--device cuda to use it anyway)", n);
        else
            LOG_INFO("no CUDA device usable (%s): running on the CPU", why);
    }
#endif
    return "cpu";
}

const char *kern_device_resolve(const char *device)
{
    return !device || !strcmp(device, "auto") ? auto_device() : device;
}

enum status kern_backend_open(struct kern_backend **out, const struct kern_backend_opts *o,
                              struct err_detail *err)
{
    *out = NULL;
    const char *dev = kern_device_resolve(o->device);
    if (!strcmp(dev, "cpu")) {
        struct kern_cpu_opts co = {o->n_threads, o->isa, o->act, o->as_device};
        return kern_cpu_backend_init(out, &co, err);
    }
    if (!strcmp(dev, "cuda")) {
#ifdef QUERN_CUDA
        struct kern_cuda_opts cu = {0, o->act};
        return kern_cuda_backend_init(out, &cu, err);
#else
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "--device cuda: this build has no CUDA backend (nvcc was not found at "
                       "build time; `make CUDA=1` requires it)");
#endif
    }
    return err_set(err, ST_ERR_INVALID_ARG, "unknown device '%s' (auto|cpu|cuda)", dev);
}

void kern_backend_free(struct kern_backend *b)
{
    if (b)
        b->ops->free(b);
}

const char *kern_backend_describe(const struct kern_backend *b)
{
    return b->ops->describe(b);
}

void kern_backends_print(FILE *f)
{
    kern_cpu_print(f);
#ifdef QUERN_CUDA
    kern_cuda_print(f);
#else
    fprintf(f, "cuda: not built in (nvcc not found at build time)\n");
#endif
}

enum status kern_group_open(struct kern_group **out, const struct kern_backend_opts *o,
                            struct err_detail *err)
{
    *out = NULL;
    const int size = o->tp > 1 ? o->tp : 1;
    if (size > KERN_CPU_COMM_MAX_RANKS)
        return err_set(err, ST_ERR_INVALID_ARG, "--tp %d: want 1..%d ranks", size,
                       KERN_CPU_COMM_MAX_RANKS);
    struct kern_group *g = calloc(1, sizeof(*g));
    if (!g)
        return err_set(err, ST_ERR_NOMEM, "no memory");
    g->size = size;
    g->be = calloc((size_t)size, sizeof(*g->be));
    g->comm = calloc((size_t)size, sizeof(*g->comm));
    if (!g->be || !g->comm) {
        kern_group_free(g);
        return err_set(err, ST_ERR_NOMEM, "no memory");
    }
    struct kern_backend_opts ro = *o;
    ro.n_threads = o->n_threads / size > 1 ? o->n_threads / size : 1;
    enum status st = ST_OK;
    for (int r = 0; r < size && !st; r++)
        st = kern_backend_open(&g->be[r], &ro, err);
    if (!st && size > 1 && g->be[0]->host_memory) { /* ranks reduce through shared memory */
        struct kern_cpu_comm_group *cg;
        if (!(st = kern_cpu_comm_group_init(&cg, size, err))) {
            g->impl = cg;
            g->impl_free = (void (*)(void *))kern_cpu_comm_group_free;
            for (int r = 0; r < size; r++)
                g->comm[r] = kern_cpu_comm_get(cg, r);
        }
    } else if (!st && size > 1) { /* device memory, no device collectives yet: host staging */
        struct kern_staged_comm_group *sg;
        if (!(st = kern_staged_comm_group_init(&sg, g->be, size, err))) {
            g->impl = sg;
            g->impl_free = (void (*)(void *))kern_staged_comm_group_free;
            for (int r = 0; r < size; r++)
                g->comm[r] = kern_staged_comm_get(sg, r);
        }
    }
    if (st) {
        kern_group_free(g);
        return st;
    }
    *out = g;
    return ST_OK;
}

void kern_group_free(struct kern_group *g)
{
    if (!g)
        return;
    for (int r = 0; g->be && r < g->size; r++)
        kern_backend_free(g->be[r]);
    if (g->impl)
        g->impl_free(g->impl);
    free(g->be);
    free(g->comm);
    free(g);
}
