/* NCCL for the device communicator (kernels/cuda/comm_nccl.c): the library loaded at run time
 * (dlopen QUERN_NCCL_LIB, else libnccl.so.2 from the loader's path), so a binary built here runs
 * where NCCL is missing (tensor parallelism then stages through the host); the calls the
 * communicator makes (point-to-point chunk exchange, all-gather); and the kernel that adds the
 * ranks' chunks in rank order. NCCL is asked to move bytes only, never to add: its reductions
 * add in an order of its own (ring or tree), and the communicator promises rank order.
 *
 * On the emulator (KCU_EMU) NCCL is replaced by an in-process stand-in with the same calls: the
 * ranks (threads, one communicator each, on distinct emulated devices) meet at a barrier, copy
 * their peers' buffers with device-to-device copies on their own streams, and meet again. What it
 * checks: devices distinct at init, every buffer on its communicator's device, sends and
 * receives matched in order and size. A collective on a stream being captured goes into the
 * graph, as NCCL's kernels do, and meets its peers when the graph is launched; every rank must
 * run a collective alike, all from graphs or none (NCCL's rule), or the run stops. What it cannot:
 * NCCL's own asynchrony (the emulator's streams run at once). It requires every rank of a
 * communicator to take part in each grouped call, which the communicator's exchange does. */
#ifdef KCU_EMU
#include "kernels/cuda/emu/kemu.h"

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>
#else
#include <cuda_runtime.h>
#include <dlfcn.h>
#define KCU_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_launch.h"

/* ---- the pieces of NCCL used, as its ABI has them (nccl.h), resolved by dlsym ---- */
enum { NCCL_OK = 0, NCCL_INVALID_ARGUMENT = 4, NCCL_INVALID_USAGE = 5 }; /* ncclResult_t */
enum { NCCL_UINT8 = 1 };                                                 /* ncclDataType_t */

struct kcu_nccl {
    int version;   /* major * 10000 + minor * 100 + patch */
    char name[32]; /* "NCCL 2.28.9" */
    int (*get_version)(int *);
    int (*init_all)(void **comms, int n, const int *devs);
    int (*destroy)(void *comm);
    const char *(*error_string)(int rc);
    int (*group_start)(void);
    int (*group_end)(void);
    int (*send)(const void *buf, size_t count, int type, int peer, void *comm, void *stream);
    int (*recv)(void *buf, size_t count, int type, int peer, void *comm, void *stream);
    int (*all_gather)(const void *in, void *out, size_t count, int type, void *comm, void *stream);
};

#ifdef KCU_EMU
namespace
{

struct emu_op {
    int recv; /* 0: a send */
    void *buf;
    size_t bytes;
    int peer;
};

struct emu_clique {
    int n, live;
    std::mutex m;
    std::condition_variable cv;
    unsigned long gen;
    int arrived;
    std::vector<emu_op> posted[8]; /* each rank's grouped operations */
    const void *gather_in[8];      /* each rank's all-gather input */
    int from_graph[8];             /* each rank's collective is a graph's (else run directly) */
};

struct emu_comm {
    emu_clique *c;
    int rank, device;
    std::atomic<int> graphs; /* graphs (captures) holding its collectives */
};

/* A captured collective's hold on its communicator, for as long as a graph keeps it. */
struct emu_graph_ref {
    emu_comm *cm;
    explicit emu_graph_ref(emu_comm *c) : cm(c)
    {
        cm->graphs++;
    }
    ~emu_graph_ref()
    {
        cm->graphs--;
    }
    emu_graph_ref(const emu_graph_ref &) = delete;
    emu_graph_ref &operator=(const emu_graph_ref &) = delete;
};

void emu_barrier(emu_clique *c)
{
    std::unique_lock<std::mutex> lk(c->m);
    const unsigned long g = c->gen;
    if (++c->arrived == c->n) {
        c->arrived = 0;
        c->gen++;
        c->cv.notify_all();
    } else {
        c->cv.wait(lk, [&] { return c->gen != g; });
    }
}

/* Is [p, p + bytes) device memory of device `device`? (0 bytes: anything goes.) */
bool emu_on(const void *p, size_t bytes, int device)
{
    if (!bytes)
        return true;
    cudaPointerAttributes a, b;
    if (cudaPointerGetAttributes(&a, p) ||
        cudaPointerGetAttributes(&b, static_cast<const char *>(p) + bytes - 1))
        return false;
    return a.type == cudaMemoryTypeDevice && a.device == device && b.type == cudaMemoryTypeDevice &&
           b.device == device;
}

thread_local int t_depth;               /* ncclGroupStart nesting */
thread_local std::vector<emu_op> t_ops; /* the group's operations so far */
thread_local emu_comm *t_comm;
thread_local void *t_stream;

int emu_fail(const char *what)
{
    fprintf(stderr, "NCCL emulator: %s\n", what);
    return NCCL_INVALID_USAGE;
}

[[noreturn]] void die_replay(void)
{
    fprintf(stderr, "NCCL emulator: a collective of a CUDA graph failed\n");
    abort();
}

/* The group's operations: posted, matched with the peers' (the k-th receive from a peer takes
 * the k-th send from it to this rank) and copied. */
/* Work a collective puts on a stream: done now, or, when the stream is being captured, recorded
 * into its graph and done at each launch of the graph (as NCCL's kernels are; a failure then
 * stops the run, as a kernel's fault would). */
int emu_on_stream(emu_comm *cm, void *stream, std::function<int(int)> work)
{
    const std::shared_ptr<emu_graph_ref> ref = std::make_shared<emu_graph_ref>(cm);
    const int rec = kemu_capture_record((cudaStream_t)stream, [work, ref] {
        if (work(1))
            die_replay();
    });
    return rec < 0 ? emu_fail("a collective in an invalidated stream capture")
           : rec   ? NCCL_OK
                   : work(0);
}

/* After the first barrier of a collective: NCCL requires all ranks to run it captured in a graph
 * or all outside one (its graph notes); the stand-in would not care, so it checks. */
int emu_uniform(emu_clique *c, int from_graph)
{
    for (int q = 0; q < c->n; q++)
        if (c->from_graph[q] != from_graph)
            return emu_fail("ranks mix a collective in a CUDA graph with one outside a graph "
                            "(NCCL requires every rank to capture alike)");
    return NCCL_OK;
}

int emu_exchange(emu_comm *cm, void *stream, const std::vector<emu_op> &ops, int from_graph)
{
    emu_clique *c = cm->c;
    {
        std::lock_guard<std::mutex> hold(c->m);
        c->posted[cm->rank] = ops;
        c->from_graph[cm->rank] = from_graph;
    }
    emu_barrier(c);
    int rc = emu_uniform(c, from_graph), seen[8] = {0};
    for (const emu_op &o : ops) {
        if (rc)
            break;
        if (!o.recv)
            continue;
        const emu_op *match = nullptr;
        int k = seen[o.peer]++;
        for (const emu_op &p : c->posted[o.peer])
            if (!p.recv && p.peer == cm->rank && k-- == 0) {
                match = &p;
                break;
            }
        if (!match || match->bytes != o.bytes) {
            rc = emu_fail("a receive without a matching send of its size");
            break;
        }
        if (cudaMemcpyAsync(o.buf, match->buf, o.bytes, cudaMemcpyDeviceToDevice,
                            (cudaStream_t)stream)) {
            rc = emu_fail("a receive's copy failed");
            break;
        }
    }
    emu_barrier(c); /* nobody reuses a buffer a peer still reads */
    return rc;
}

int emu_run_group(void)
{
    std::vector<emu_op> ops;
    ops.swap(t_ops);
    emu_comm *cm = t_comm;
    void *stream = t_stream;
    if (ops.empty())
        return NCCL_OK;
    return emu_on_stream(cm, stream,
                         [cm, stream, ops](int g) { return emu_exchange(cm, stream, ops, g); });
}

int emu_get_version(int *v)
{
    *v = 22800;
    return NCCL_OK;
}

int emu_init_all(void **comms, int n, const int *devs)
{
    int count = 0;
    cudaGetDeviceCount(&count);
    if (getenv("QUERN_CUDA_EMU_NCCL_FAIL")) /* tests: a start that fails, as in a container */
        return emu_fail("ncclCommInitAll failed (QUERN_CUDA_EMU_NCCL_FAIL is set)");
    if (n < 1 || n > 8)
        return NCCL_INVALID_ARGUMENT;
    for (int r = 0; r < n; r++) {
        const int d = devs ? devs[r] : r;
        if (d < 0 || d >= count)
            return NCCL_INVALID_ARGUMENT;
        for (int q = 0; q < r; q++)
            if ((devs ? devs[q] : q) == d)
                return emu_fail("two ranks on one device (NCCL: duplicate GPU)");
    }
    emu_clique *c = new emu_clique();
    c->n = c->live = n;
    for (int r = 0; r < n; r++)
        comms[r] = new emu_comm{c, r, devs ? devs[r] : r, {0}};
    return NCCL_OK;
}

int emu_destroy(void *comm)
{
    emu_comm *cm = static_cast<emu_comm *>(comm);
    if (cm->graphs.load()) { /* NCCL 2.26 and later would wait for them forever */
        fprintf(stderr,
                "NCCL emulator: a communicator destroyed while %d CUDA graph "
                "collective(s) still use it\n",
                cm->graphs.load());
        abort();
    }
    bool last;
    {
        std::lock_guard<std::mutex> hold(cm->c->m);
        last = --cm->c->live == 0;
    }
    if (last)
        delete cm->c;
    delete cm;
    return NCCL_OK;
}

const char *emu_error_string(int rc)
{
    return rc == NCCL_OK                 ? "no error"
           : rc == NCCL_INVALID_ARGUMENT ? "invalid argument"
                                         : "invalid usage";
}

int emu_group_start(void)
{
    t_depth++;
    return NCCL_OK;
}

int emu_group_end(void)
{
    if (t_depth < 1)
        return emu_fail("ncclGroupEnd without ncclGroupStart");
    return --t_depth ? NCCL_OK : emu_run_group();
}

int emu_p2p(int recv, const void *buf, size_t count, int type, int peer, void *comm, void *stream)
{
    emu_comm *cm = static_cast<emu_comm *>(comm);
    if (type != NCCL_UINT8 || peer < 0 || peer >= cm->c->n || peer == cm->rank)
        return NCCL_INVALID_ARGUMENT;
    if (!emu_on(buf, count, cm->device))
        return emu_fail("a buffer not on its communicator's device");
    if ((t_comm && t_comm != cm && !t_ops.empty()) || (t_stream != stream && !t_ops.empty()))
        return emu_fail("one group over two communicators or streams (not emulated)");
    t_comm = cm;
    t_stream = stream;
    t_ops.push_back(emu_op{recv, const_cast<void *>(buf), count, peer});
    return t_depth ? NCCL_OK : emu_run_group();
}

int emu_send(const void *buf, size_t count, int type, int peer, void *comm, void *stream)
{
    return emu_p2p(0, buf, count, type, peer, comm, stream);
}

int emu_recv(void *buf, size_t count, int type, int peer, void *comm, void *stream)
{
    return emu_p2p(1, buf, count, type, peer, comm, stream);
}

int emu_gather(emu_comm *cm, const void *in, char *o, size_t count, void *stream, int from_graph);

int emu_all_gather(const void *in, void *out, size_t count, int type, void *comm, void *stream)
{
    emu_comm *cm = static_cast<emu_comm *>(comm);
    emu_clique *c = cm->c;
    char *o = static_cast<char *>(out);
    if (type != NCCL_UINT8)
        return NCCL_INVALID_ARGUMENT;
    if (t_depth)
        return emu_fail("an all-gather inside a group (not emulated)");
    if (!emu_on(in, count, cm->device) || !emu_on(out, count * (size_t)c->n, cm->device))
        return emu_fail("a buffer not on its communicator's device");
    return emu_on_stream(cm, stream, [cm, in, o, count, stream](int g) {
        return emu_gather(cm, in, o, count, stream, g);
    });
}

int emu_gather(emu_comm *cm, const void *in, char *o, size_t count, void *stream, int from_graph)
{
    emu_clique *c = cm->c;
    {
        std::lock_guard<std::mutex> hold(c->m);
        c->gather_in[cm->rank] = in;
        c->from_graph[cm->rank] = from_graph;
    }
    emu_barrier(c);
    int rc = emu_uniform(c, from_graph);
    for (int q = 0; q < c->n && !rc; q++) {
        char *dst = o + (size_t)q * count;
        if (c->gather_in[q] != dst &&
            cudaMemcpyAsync(dst, c->gather_in[q], count, cudaMemcpyDeviceToDevice,
                            (cudaStream_t)stream))
            rc = emu_fail("an all-gather's copy failed");
    }
    emu_barrier(c);
    return rc;
}

} // namespace
#endif

static struct kcu_nccl g_nccl;
static char g_why[256];
static int g_loaded; /* 0: not tried; 1: usable; -1: not (g_why says why) */
static pthread_mutex_t g_load_lock = PTHREAD_MUTEX_INITIALIZER;

static int load(void)
{
    struct kcu_nccl *l = &g_nccl;
#ifdef KCU_EMU
    l->get_version = emu_get_version;
    l->init_all = emu_init_all;
    l->destroy = emu_destroy;
    l->error_string = emu_error_string;
    l->group_start = emu_group_start;
    l->group_end = emu_group_end;
    l->send = emu_send;
    l->recv = emu_recv;
    l->all_gather = emu_all_gather;
#else
    const char *path = getenv("QUERN_NCCL_LIB");
    if (!path || !*path)
        path = "libnccl.so.2";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL); /* kept for the process's life */
    if (!lib) {
        snprintf(g_why, sizeof(g_why), "%s", dlerror());
        return -1;
    }
    static const char *const names[] = {"ncclGetVersion",     "ncclCommInitAll", "ncclCommDestroy",
                                        "ncclGetErrorString", "ncclGroupStart",  "ncclGroupEnd",
                                        "ncclSend",           "ncclRecv",        "ncclAllGather"};
    void **slots[] = {(void **)&l->get_version,  (void **)&l->init_all,    (void **)&l->destroy,
                      (void **)&l->error_string, (void **)&l->group_start, (void **)&l->group_end,
                      (void **)&l->send,         (void **)&l->recv,        (void **)&l->all_gather};
    for (int i = 0; i < 9; i++)
        if (!(*slots[i] = dlsym(lib, names[i]))) {
            snprintf(g_why, sizeof(g_why), "%s lacks %s", path, names[i]);
            dlclose(lib);
            return -1;
        }
#endif
    int code = 0;
    const int rc = l->get_version(&code);
    /* NCCL_VERSION_CODE: major * 1000 + minor * 100 + patch before 2.9, major * 10000 + ... since
     */
    l->version = code < 10000 ? code / 1000 * 10000 + code / 100 % 10 * 100 + code % 100 : code;
    snprintf(l->name, sizeof(l->name), "NCCL %d.%d.%d", l->version / 10000, l->version / 100 % 100,
             l->version % 100);
    if (rc || l->version < 20700) {
        snprintf(g_why, sizeof(g_why), "%s is older than 2.7 (point-to-point calls)", l->name);
#ifndef KCU_EMU
        dlclose(lib);
#endif
        return -1;
    }
    return 1;
}

extern "C" const struct kcu_nccl *kcu_nccl_open(char *why, size_t why_size)
{
    pthread_mutex_lock(&g_load_lock);
    if (!g_loaded)
        g_loaded = load();
    const int ok = g_loaded > 0;
    pthread_mutex_unlock(&g_load_lock);
    if (!ok && why && why_size)
        snprintf(why, why_size, "%s", g_why);
    return ok ? &g_nccl : NULL;
}

extern "C" const char *kcu_nccl_name(const struct kcu_nccl *l)
{
    return l->name;
}

extern "C" int kcu_nccl_version(const struct kcu_nccl *l)
{
    return l->version;
}

extern "C" int kcu_nccl_init(const struct kcu_nccl *l, void **comms, int n, const int *devs)
{
    return l->init_all(comms, n, devs);
}

extern "C" void kcu_nccl_close(const struct kcu_nccl *l, void *comm)
{
    if (comm)
        l->destroy(comm);
}

extern "C" const char *kcu_nccl_error(const struct kcu_nccl *l, int rc)
{
    return l->error_string(rc);
}

extern "C" int kcu_nccl_exchange(const struct kcu_nccl *l, void *comm, void *stream, int rank,
                                 int size, const void *x, void *slots, size_t n_bytes,
                                 size_t chunk_bytes)
{
    /* the bytes of rank q's chunk: [q * chunk_bytes, min(n_bytes, (q + 1) * chunk_bytes)) */
#define CHUNK_LEN(q)                                                                               \
    ((size_t)(q)*chunk_bytes >= n_bytes                ? 0                                         \
     : n_bytes - (size_t)(q)*chunk_bytes < chunk_bytes ? n_bytes - (size_t)(q)*chunk_bytes         \
                                                       : chunk_bytes)
    int rc = l->group_start();
    for (int q = 0; q < size && !rc; q++) {
        if (q == rank)
            continue;
        const size_t give = CHUNK_LEN(q), take = CHUNK_LEN(rank);
        if (give)
            rc = l->send((const char *)x + (size_t)q * chunk_bytes, give, NCCL_UINT8, q, comm,
                         stream);
        if (!rc && take)
            rc =
                l->recv((char *)slots + (size_t)q * chunk_bytes, take, NCCL_UINT8, q, comm, stream);
    }
#undef CHUNK_LEN
    const int end = l->group_end();
    return rc ? rc : end;
}

extern "C" int kcu_nccl_gather(const struct kcu_nccl *l, void *comm, void *stream, const void *in,
                               void *out, size_t bytes)
{
    return l->all_gather(in, out, bytes, NCCL_UINT8, comm, stream);
}

/* ---- the rank-order sum ---- */

static __device__ __forceinline__ float rs_bf16_f32(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

/* kern_f32_to_bf16's rounding: nearest even; a NaN truncated and made quiet, its sign kept. */
static __device__ __forceinline__ uint16_t rs_f32_bf16(float f)
{
    const uint32_t x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

template <class T>
__global__ void k_rank_sum(const T *x, T *slots, size_t len, size_t chunk, int rank, int size)
{
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len)
        return;
    float acc = 0.0f;
    for (int q = 0; q < size; q++) {
        const T v = q == rank ? x[(size_t)rank * chunk + i] : slots[(size_t)q * chunk + i];
        float f;
        if constexpr (sizeof(T) == 2)
            f = rs_bf16_f32(v);
        else
            f = v;
        acc = q ? __fadd_rn(acc, f) : f;
    }
    if constexpr (sizeof(T) == 2)
        slots[(size_t)rank * chunk + i] = rs_f32_bf16(acc);
    else
        slots[(size_t)rank * chunk + i] = acc;
}

extern "C" int kcu_rank_sum(void *stream, const void *x, void *slots, size_t n, size_t chunk,
                            int rank, int size, int bf16)
{
    const size_t lo = (size_t)rank * chunk;
    const size_t len = lo >= n ? 0 : n - lo < chunk ? n - lo : chunk;
    if (!len)
        return 0;
    const unsigned blocks = (unsigned)((len + 255) / 256);
    if (bf16)
        KCU_LAUNCH(k_rank_sum<uint16_t>, blocks, 256, (cudaStream_t)stream)
    ((const uint16_t *)x, (uint16_t *)slots, len, chunk, rank, size);
    else KCU_LAUNCH(k_rank_sum<float>, blocks, 256,
                    (cudaStream_t)stream)((const float *)x, (float *)slots, len, chunk, rank, size);
    return (int)cudaGetLastError();
}
