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
#include "kernels/cuda/comm_nccl.h"
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

enum kern_act kern_default_act(const char *device, const char *isa)
{
    if (!strcmp(kern_device_resolve(device), "cuda"))
        return KERN_ACT_F32;
    return kern_cpu_isa_bf16(isa) ? KERN_ACT_BF16 : KERN_ACT_Q8;
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
        struct kern_cuda_opts cu = {o->ordinal, o->act};
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
    char why[256] = "";
    const int devs = kern_cuda_device_count(NULL, 0);
    if (devs > 1 && kern_nccl_usable(devs, why, sizeof(why)))
        fprintf(f, "nccl: %s: --tp up to %d on CUDA puts one rank on each GPU\n",
                kern_nccl_describe(), devs);
    else if (devs == 1 && kern_nccl_usable(1, why, sizeof(why)))
        fprintf(f, "nccl: %s, but one GPU: --tp on CUDA stages through host memory\n",
                kern_nccl_describe());
    else if (devs > 0)
        fprintf(f, "nccl: not usable (%s): --tp on CUDA stages through host memory\n", why);
#else
    fprintf(f, "cuda: not built in (nvcc not found at build time)\n");
#endif
}

/* How `size` ranks on o's device are joined (kern_group_open says): *nccl 1 for NCCL, rank r on
 * device r; 0 for the device's own way (shared memory on the CPU, host staging on CUDA).
 * *fallback 1: NCCL was not insisted on, so a failed NCCL start falls back to staging. */
static enum status tp_comm_choice(const struct kern_backend_opts *o, int size, int *nccl,
                                  int *fallback, struct err_detail *err)
{
    *nccl = 0;
    *fallback = 0;
    const char *how = getenv("QUERN_TP_COMM");
    if (!how || !*how)
        how = "auto";
    if (strcmp(how, "auto") && strcmp(how, "nccl") && strcmp(how, "staged"))
        return err_set(err, ST_ERR_INVALID_ARG, "QUERN_TP_COMM=%s: want auto, nccl or staged", how);
    if (strcmp(kern_device_resolve(o->device), "cuda"))
        return ST_OK;
#ifdef QUERN_CUDA
    char why[256] = "QUERN_TP_COMM=staged";
    if (strcmp(how, "staged"))
        *nccl = kern_nccl_usable(size, why, sizeof(why));
    *fallback = !strcmp(how, "auto");
    if (!*nccl && !strcmp(how, "nccl"))
        return err_set(err, ST_ERR_UNSUPPORTED, "QUERN_TP_COMM=nccl: %s", why);
    if (*nccl)
        LOG_INFO("tensor parallelism: %d ranks on CUDA devices 0-%d, joined by %s", size, size - 1,
                 kern_nccl_describe());
    else
        LOG_INFO("tensor parallelism: %d ranks on CUDA device %d, joined through host memory "
                 "(%s)",
                 size, o->ordinal, why);
#else
    (void)size;
#endif
    return ST_OK;
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
    int nccl = 0, fallback = 0;
    enum status st = size > 1 ? tp_comm_choice(o, size, &nccl, &fallback, err) : ST_OK;
    for (int r = 0; r < size && !st; r++) {
        ro.ordinal = nccl ? r : o->ordinal;
        st = kern_backend_open(&g->be[r], &ro, err);
    }
#ifdef QUERN_CUDA
    if (!st && nccl) {
        struct kern_nccl_comm_group *ng;
        if (!(st = kern_nccl_comm_group_init(&ng, g->be, size, err))) {
            g->impl = ng;
            g->impl_free = (void (*)(void *))kern_nccl_comm_group_free;
            for (int r = 0; r < size; r++)
                g->comm[r] = kern_nccl_comm_get(ng, r);
        } else if (fallback) { /* the ranks again, all on the one device, staged below */
            LOG_WARN("tensor parallelism: %s; the %d ranks run on CUDA device %d instead, joined "
                     "through host memory",
                     err->msg, size, o->ordinal);
            st = ST_OK;
            ro.ordinal = o->ordinal;
            for (int r = 0; r < size && !st; r++) {
                kern_backend_free(g->be[r]);
                g->be[r] = NULL;
                st = kern_backend_open(&g->be[r], &ro, err);
            }
            nccl = 0;
        }
    }
#endif
    if (!st && size > 1 && g->be[0]->host_memory) { /* ranks reduce through shared memory */
        struct kern_cpu_comm_group *cg;
        if (!(st = kern_cpu_comm_group_init(&cg, size, err))) {
            g->impl = cg;
            g->impl_free = (void (*)(void *))kern_cpu_comm_group_free;
            for (int r = 0; r < size; r++)
                g->comm[r] = kern_cpu_comm_get(cg, r);
        }
    } else if (!st && size > 1 && !nccl) { /* device memory without a device communicator */
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
    if (g->impl) /* first: a device communicator gives its buffers back through the backends */
        g->impl_free(g->impl);
    for (int r = 0; g->be && r < g->size; r++)
        kern_backend_free(g->be[r]);
    free(g->be);
    free(g->comm);
    free(g);
}

const char *kern_act_name(enum kern_act act)
{
    return act == KERN_ACT_Q8     ? "q8"
           : act == KERN_ACT_Q16  ? "q16"
           : act == KERN_ACT_BF16 ? "bf16"
                                  : "exact";
}

const char *kern_kv_dtype_name(enum kern_kv_dtype dtype)
{
    return dtype == KERN_KV_Q8 ? "q8" : dtype == KERN_KV_BF16T ? "bf16" : "f16";
}
