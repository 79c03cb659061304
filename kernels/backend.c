/* The backend factory: kern_backend_open picks a backend by device name, so nothing above
 * kernels/ names one. */
#include <string.h>

#include "kernels/cpu/backend_cpu.h"
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
