/* The backend factory: kern_backend_open picks a backend by device name, so nothing above
 * kernels/ names one. */
#include <stdlib.h>
#include <string.h>

#include "kernels/comm.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/comm_cpu.h"
#include "kernels/kernels.h"

enum status kern_backend_open(struct kern_backend **out, const struct kern_backend_opts *o,
                              struct err_detail *err)
{
    *out = NULL;
    const char *dev = o->device;
    if (!dev || !strcmp(dev, "auto") || !strcmp(dev, "cpu")) {
        struct kern_cpu_opts co = {o->n_threads, o->isa, o->act, o->as_device};
        return kern_cpu_backend_init(out, &co, err);
    }
    if (!strcmp(dev, "cuda"))
        return err_set(err, ST_ERR_UNSUPPORTED,
                       "--device cuda: this build has no CUDA backend (only 'cpu')");
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
    if (!st && size > 1) {
        struct kern_cpu_comm_group *cg;
        if (!(st = kern_cpu_comm_group_init(&cg, size, err))) {
            g->impl = cg;
            for (int r = 0; r < size; r++)
                g->comm[r] = kern_cpu_comm_get(cg, r);
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
    kern_cpu_comm_group_free(g->impl);
    free(g->be);
    free(g->comm);
    free(g);
}
