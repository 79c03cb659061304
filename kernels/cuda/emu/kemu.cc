/* The CPU emulator of the CUDA kernels (kemu.h says what it is and what it checks): the fiber
 * scheduler that runs a launch, and the part of the CUDA runtime API the backend calls
 * (kernels/cuda/backend_cuda.c), over host memory. Streams are executed at once, in order, on
 * the calling thread. Device allocations are recorded so that a copy or memset reaching outside
 * one, or a copy whose direction does not match its pointers, fails as cudaErrorInvalidValue
 * (the GPU would fault or corrupt memory); new allocations are filled with 0xFF bytes (NaN
 * floats, -1 ids), as cudaMalloc gives no zeroed memory. Devices: QUERN_CUDA_EMU_DEVICES of them
 * (1 to 8, default 1) of QUERN_CUDA_EMU_MEM bytes each (a number with an optional K, M, G or T
 * suffix; default 1G; an allocation beyond it fails as cudaErrorMemoryAllocation), each with
 * its own allocations and streams; as in CUDA, a launch on a
 * stream of a device other than the calling thread's current one fails (invalid resource
 * handle), and, stricter than CUDA, so does a host copy or memset on a stream whose device does
 * not hold the device memory it touches (CUDA would copy across devices; quern's rule is that
 * each rank touches its own device only, collectives aside). x86-64 only (the context switch). */
#include "kernels/cuda/emu/kemu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#if !defined(__x86_64__)
#error "the CUDA emulator's context switch is written for x86-64"
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define KEMU_ASAN 1
#else
#define KEMU_ASAN 0
#endif

struct kemu_thread *kemu_cur;
dim3 kemu_block_idx, kemu_block_dim, kemu_grid_dim;

/* kemu_swap(save, to): saves the callee-saved registers on the current stack, stores its pointer
 * in *save and continues on stack `to` (a stack kemu_swap saved, or a new one laid out by
 * fiber_start). */
extern "C" void kemu_swap(void **save, void *to);
__asm__(".text\n"
        ".globl kemu_swap\n"
        ".type kemu_swap,@function\n"
        "kemu_swap:\n"
        "    pushq %rbp\n"
        "    pushq %rbx\n"
        "    pushq %r12\n"
        "    pushq %r13\n"
        "    pushq %r14\n"
        "    pushq %r15\n"
        "    movq %rsp, (%rdi)\n"
        "    movq %rsi, %rsp\n"
        "    popq %r15\n"
        "    popq %r14\n"
        "    popq %r13\n"
        "    popq %r12\n"
        "    popq %rbx\n"
        "    popq %rbp\n"
        "    ret\n"
        ".size kemu_swap, .-kemu_swap\n");

namespace
{

const size_t STACK_BYTES = KEMU_ASAN ? 512 * 1024 : 128 * 1024;

enum { ST_RUN, ST_WAIT, ST_DONE };

struct fiber {
    kemu_thread t;
    void *sp;
    int state;
    char *stack;
};

struct sched {
    std::vector<fiber> f;
    void *sp;                          /* the scheduler's stack while a fiber runs */
    const std::function<void()> *body; /* the launch's kernel call */
    const char *name;
    int nthreads;             /* of the running block */
    int reverse;              /* QUERN_CUDA_EMU_ORDER=reverse: the last warp first, alone */
    const void *sched_bottom; /* the scheduler's (calling thread's) stack, for ASan */
    size_t sched_size;
};

sched S;

#if !KEMU_ASAN
/* the kernels' __shared__ arrays (kemu.h), bounds from the linker */
extern "C" char __start_kemu_shared[] __attribute__((weak));
extern "C" char __stop_kemu_shared[] __attribute__((weak));
#endif
thread_local int g_last_error; /* per host thread, as in CUDA */

/* cp.async landings not visible to the whole block yet: 16-byte shared chunk -> the landing
 * thread (linear index) and the warp it is visible to (-1: none). CUDA makes a thread's landed
 * copies visible to others only through a barrier after its wait: its warp's next __syncwarp
 * shows them to that warp, the next __syncthreads to all (the entries go); ldmatrix (which hands
 * each row to the whole warp) reading one its warp cannot see stops the run. */
struct landing {
    int owner, warp;
};
std::unordered_map<uintptr_t, landing> g_unpublished;

/* template kernels' __shared__ arrays (KCU_SHARED), which the section cannot hold, each with the
 * block (g_block, counting from 1) that last filled it */
struct extent {
    char *p;
    size_t n;
    unsigned long block;
};
std::vector<extent> g_shared_extents;
unsigned long g_block;

/* Whether [p, p + n) lies in the kernels' shared memory (not known under ASan: yes). */
bool in_shared(const void *p, size_t n)
{
    const char *c = static_cast<const char *>(p);
    for (const auto &e : g_shared_extents)
        if (c >= e.p && c + n <= e.p + e.n)
            return true;
#if KEMU_ASAN
    return true;
#else
    return __start_kemu_shared && c >= __start_kemu_shared && c + n <= __stop_kemu_shared;
#endif
}

void die(const char *what)
{
    fprintf(stderr, "CUDA emulator: kernel %s, block (%u,%u,%u): %s\n", S.name ? S.name : "?",
            kemu_block_idx.x, kemu_block_idx.y, kemu_block_idx.z, what);
    abort();
}

/* From the running fiber f to fiber `to`, or to the scheduler (to NULL); returns when f is
 * resumed. A fiber that has finished is never resumed. */
void switch_from(fiber *f, fiber *to)
{
#if KEMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(f->state == ST_DONE ? nullptr : &fake,
                                   to ? to->stack : S.sched_bottom,
                                   to ? STACK_BYTES : S.sched_size);
#endif
    if (to) {
        kemu_cur = &to->t;
        kemu_swap(&f->sp, to->sp);
    } else {
        kemu_swap(&f->sp, S.sp);
    }
#if KEMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    kemu_cur = &f->t;
}

bool warp_release(int w0, int n);

/* Where the running fiber f goes when it waits or finishes: straight on to the next thread
 * of its warp when that one can run; the warp's last lane to arrive completes the warp
 * operation and goes back to the warp's first lane; otherwise the scheduler decides. */
void yield_from(fiber *f)
{
    const int i = (int)(f - S.f.data());
    if (S.reverse) {
        switch_from(f, nullptr);
        return;
    }
    if (i + 1 < S.nthreads && (i + 1) % 32 && S.f[(size_t)(i + 1)].state == ST_RUN) {
        switch_from(f, &S.f[(size_t)(i + 1)]);
        return;
    }
    const int w0 = i - i % 32, n = S.nthreads - w0 < 32 ? S.nthreads - w0 : 32;
    if (f->state == ST_WAIT && i == w0 + n - 1 && S.f[(size_t)w0].state == ST_WAIT &&
        warp_release(w0, n)) {
        if (w0 == i)
            return; /* a one-thread warp: carry on */
        switch_from(f, &S.f[(size_t)w0]);
        return;
    }
    switch_from(f, nullptr);
}

extern "C" void fiber_main(void)
{
    fiber *f = reinterpret_cast<fiber *>(kemu_cur);
#if KEMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    (*S.body)();
    if (f->t.cp_n)
        die("a thread returned with cp.async copies it never waited for");
    f->state = ST_DONE;
    yield_from(f);
    die("a finished thread was resumed");
}

/* Lay out a new stack so that kemu_swap "returns" into fiber_main with the ABI's alignment. */
void fiber_start(fiber *f)
{
#if KEMU_ASAN
    /* the frames a finished fiber left behind never returned: clear their redzones (a fiber
     * uses a few KiB at the top; 64 KiB of stack is 8 KiB of shadow per start) */
    __asan_unpoison_memory_region(f->stack + STACK_BYTES - 65536, 65536);
#endif
    uintptr_t top = (reinterpret_cast<uintptr_t>(f->stack) + STACK_BYTES) & ~(uintptr_t)15;
    void **sp = reinterpret_cast<void **>(top - 16); /* at fiber_main's entry, rsp % 16 == 8 */
    sp[0] = reinterpret_cast<void *>(&fiber_main);
    sp[1] = nullptr;
    sp -= 6; /* r15 r14 r13 r12 rbx rbp */
    for (int i = 0; i < 6; i++)
        sp[i] = nullptr;
    f->sp = sp;
    f->state = ST_RUN;
    f->t.cp_n = f->t.cp_groups = 0;
}

/* From the scheduler into fiber f, until some fiber switches back. */
void resume(fiber *f)
{
    kemu_cur = &f->t;
#if KEMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f->stack, STACK_BYTES);
    kemu_swap(&S.sp, f->sp);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    kemu_swap(&S.sp, f->sp);
#endif
}

/* A warp whose every lane waits in the same warp operation completes it. */
bool warp_release(int w0, int n)
{
    fiber *f = &S.f[(size_t)w0];
    const int op = f[0].t.op;
    if (op == KEMU_OP_SYNCTHREADS)
        return false;
    for (int i = 0; i < n; i++) {
        if (f[i].state == ST_DONE)
            die("a warp operation (shuffle, __syncwarp, mma) with a lane that has returned");
        if (f[i].state != ST_WAIT)
            return false;
        if (f[i].t.op != op)
            return false; /* a deadlock unless someone else moves; judged by the caller */
    }
    if (op == KEMU_OP_SYNCWARP) /* the warp's landed copies are visible to it now */
        for (auto &e : g_unpublished)
            if (e.second.owner >= w0 && e.second.owner < w0 + n)
                e.second.warp = w0 / 32;
    if (op == KEMU_OP_SHFL) {
        for (int i = 0; i < n; i++) {
            if (f[i].t.src >= n)
                die("a shuffle reads a lane past the block's last thread");
            f[i].t.res = f[f[i].t.src].t.val;
        }
    } else if (op == KEMU_OP_MMA) {
        if (n != 32)
            die("mma.sync in a partial warp");
        uint32_t a[32][4], b[32][2];
        float c[32][4];
        for (int i = 0; i < 32; i++) {
            if (f[i].t.mma_f16 != f[0].t.mma_f16)
                die("mma.sync with lanes of different input types");
            memcpy(a[i], f[i].t.mma_a, sizeof(a[i]));
            memcpy(b[i], f[i].t.mma_b, sizeof(b[i]));
            memcpy(c[i], f[i].t.mma_c, sizeof(c[i]));
        }
        if (f[0].t.mma_f16 == 2) { /* int32 sums, carried in the float slots' bits */
            int32_t ci[32][4];
            memcpy(ci, c, sizeof(ci));
            kcu_mma_ref_s8(a, b, ci);
            memcpy(c, ci, sizeof(ci));
        } else
            kcu_mma_ref(a, b, c, f[0].t.mma_f16);
        for (int i = 0; i < 32; i++)
            memcpy(f[i].t.mma_c, c[i], sizeof(c[i]));
    } else if (op == KEMU_OP_LDSM) {
        if (n != 32)
            die("ldmatrix in a partial warp");
        const int nmat = f[0].t.ldsm & 15;
        const uint16_t *addr[32];
        uint32_t out[32][4];
        for (int i = 0; i < 32; i++) {
            if (f[i].t.ldsm != f[0].t.ldsm)
                die("ldmatrix with lanes of different shapes");
            addr[i] = reinterpret_cast<const uint16_t *>(static_cast<uintptr_t>(f[i].t.val));
            if (i < 8 * nmat && (f[i].t.val % 16 || !in_shared(addr[i], 16)))
                die("ldmatrix row not 16-byte aligned in shared memory");
            const auto e = g_unpublished.find(static_cast<uintptr_t>(f[i].t.val));
            if (i < 8 * nmat && e != g_unpublished.end() && e->second.warp != w0 / 32)
                die("ldmatrix reads a cp.async copy no barrier has shown its warp since the "
                    "wait (__syncwarp in the landing warp, or __syncthreads)");
        }
        kcu_ldmatrix_ref(addr, nmat, f[0].t.ldsm & 16, out);
        for (int i = 0; i < 32; i++)
            memcpy(f[i].t.mma_a, out[i], sizeof(out[i]));
    }
    for (int i = 0; i < n; i++)
        f[i].state = ST_RUN;
    return true;
}

void run_block(int nthreads)
{
    S.nthreads = nthreads;
    g_unpublished.clear();
#if !KEMU_ASAN
    if (__start_kemu_shared) /* shared memory starts a block as garbage, here NaN */
        memset(__start_kemu_shared, 0xFF, (size_t)(__stop_kemu_shared - __start_kemu_shared));
#endif
    g_block++; /* template kernels' arrays are filled when first named in the block */
    for (int i = 0; i < nthreads; i++)
        fiber_start(&S.f[(size_t)i]);
    for (;;) {
        if (S.reverse) /* the last warp first, each to its next barrier (or end) before the next
                          one starts: a warp runs ahead of the others, as one may on a GPU */
            for (int w0 = (nthreads - 1) / 32 * 32; w0 >= 0; w0 -= 32) {
                const int n = nthreads - w0 < 32 ? nthreads - w0 : 32;
                for (bool moved = true; moved;) {
                    moved = false;
                    for (int i = w0 + n - 1; i >= w0; i--)
                        if (S.f[(size_t)i].state == ST_RUN) {
                            resume(&S.f[(size_t)i]);
                            moved = true;
                        }
                    if (S.f[(size_t)w0].state == ST_WAIT)
                        warp_release(w0, n);
                }
            }
        else
            for (int i = 0; i < nthreads; i++)
                if (S.f[(size_t)i].state == ST_RUN)
                    resume(&S.f[(size_t)i]);
        for (int w0 = 0; w0 < nthreads; w0 += 32)
            if (S.f[(size_t)w0].state == ST_WAIT)
                warp_release(w0, nthreads - w0 < 32 ? nthreads - w0 : 32);
        int running = 0, waiting = 0, done = 0, at_bar = 0;
        for (int i = 0; i < nthreads; i++) {
            const fiber *f = &S.f[(size_t)i];
            running += f->state == ST_RUN;
            done += f->state == ST_DONE;
            waiting += f->state == ST_WAIT;
            at_bar += f->state == ST_WAIT && f->t.op == KEMU_OP_SYNCTHREADS;
        }
        if (done == nthreads)
            return;
        if (running)
            continue;
        if (at_bar != waiting)
            die("the block's threads wait in different barriers or warp operations "
                "(divergence)");
        if (done)
            die("__syncthreads after some of the block's threads returned");
        g_unpublished.clear();             /* every landed copy is visible to the block now */
        for (int i = 0; i < nthreads; i++) /* everyone is at the barrier */
            S.f[(size_t)i].state = ST_RUN;
    }
}

void cp_land(const kemu_thread &t, int i)
{
    const uintptr_t d = reinterpret_cast<uintptr_t>(t.cp[i].dst);
    for (uintptr_t c = d & ~(uintptr_t)15; c < d + (uintptr_t)t.cp[i].bytes; c += 16)
        g_unpublished[c] = landing{t.warp * 32 + t.lane, -1};
    memcpy(t.cp[i].dst, t.cp[i].src, (size_t)t.cp[i].src_bytes);
    memset(static_cast<char *>(t.cp[i].dst) + t.cp[i].src_bytes, 0,
           (size_t)(t.cp[i].bytes - t.cp[i].src_bytes));
}

void set_error(int e) /* the last error, as cudaGetLastError reports it */
{
    if (e)
        g_last_error = e;
}

} // namespace

namespace
{

/* Device memory. Without ASan: one reserved range, allocated by whole pages from the bottom
 * up and never reused (a freed range faults), tagged with a memory protection key (x86 PKU)
 * that host threads keep closed: only while the emulator itself works on device memory (a
 * kernel, a copy, a memset) does its thread open the key, so host code that dereferences a
 * device pointer faults, as it would on a GPU machine. Where the CPU has no protection keys the
 * range is plain memory. With ASan: the heap, so that ASan sees a kernel's out-of-bounds access
 * (host dereferences go unseen). */
std::recursive_mutex g_dev; /* held by whoever works on device memory */
#if !KEMU_ASAN
const size_t ARENA_BYTES = (size_t)32 << 30;
char *g_arena;
size_t g_top;    /* bytes handed out */
int g_pkey = -1; /* the arena's protection key, or -1 */
int g_depth;     /* nested access scopes of the holder of g_dev */
#endif

struct dev_access {
    dev_access()
    {
        g_dev.lock();
#if !KEMU_ASAN
        if (g_depth++ == 0 && g_pkey >= 0)
            pkey_set(g_pkey, 0);
#endif
    }
    ~dev_access()
    {
#if !KEMU_ASAN
        if (--g_depth == 0 && g_pkey >= 0)
            pkey_set(g_pkey, PKEY_DISABLE_ACCESS);
#endif
        g_dev.unlock();
    }
    dev_access(const dev_access &) = delete;
    dev_access &operator=(const dev_access &) = delete;
};

/* New device memory, or NULL. */
void *dev_alloc(size_t size)
{
#if KEMU_ASAN
    void *p = nullptr; /* the exact size, so ASan sees the first byte past the end */
    return posix_memalign(&p, 256, size ? size : 1) ? nullptr : p;
#else
    std::lock_guard<std::recursive_mutex> hold(g_dev);
    if (!g_arena) { /* reserved, not committed: pages become usable as they are handed out */
        void *a = mmap(nullptr, ARENA_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (a == MAP_FAILED)
            return nullptr;
        g_arena = static_cast<char *>(a);
        /* closed in this thread by pkey_alloc; threads that exist already have every key but
         * 0 closed (Linux's initial PKRU); later ones inherit their creator's PKRU, which is
         * closed outside the emulator's own scopes (which create no threads) */
        g_pkey = pkey_alloc(0, PKEY_DISABLE_ACCESS);
    }
    const size_t bytes = ((size ? size : 1) + 4095) & ~(size_t)4095;
    if (bytes > ARENA_BYTES - g_top)
        return nullptr;
    char *p = g_arena + g_top;
    if (g_pkey >= 0 ? pkey_mprotect(p, bytes, PROT_READ | PROT_WRITE, g_pkey)
                    : mprotect(p, bytes, PROT_READ | PROT_WRITE))
        return nullptr;
    g_top += bytes;
    return p;
#endif
}

void dev_free(void *p, size_t size)
{
#if KEMU_ASAN
    (void)size;
    free(p);
#else
    /* never reused: any later access, by a kernel too, faults */
    const size_t bytes = ((size ? size : 1) + 4095) & ~(size_t)4095;
    madvise(p, bytes, MADV_DONTNEED);
    mprotect(p, bytes, PROT_NONE);
#endif
}

} // namespace

void kemu_full_mask(unsigned mask)
{
    if (mask != 0xffffffffu)
        die("a warp operation with a partial mask (the emulator knows the full mask only)");
}

void kemu_shared_extent(void *p, size_t n)
{
    char *c = static_cast<char *>(p);
    extent *e = nullptr;
    for (auto &x : g_shared_extents)
        if (x.p == c)
            e = &x;
    if (!e) {
        g_shared_extents.push_back(extent{c, n, 0});
        e = &g_shared_extents.back();
    }
    if (e->block != g_block) { /* named first by the block's first thread, before any use */
        memset(c, 0xFF, n);
        e->block = g_block;
    }
}

void kemu_cp_async(void *dst, const void *src, int bytes, int src_bytes)
{
    kemu_thread &t = *kemu_cur;
    if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes < 0 || src_bytes > bytes)
        die("cp.async of other than 4, 8 or 16 bytes, or src-size past cp-size");
    if (reinterpret_cast<uintptr_t>(dst) % (unsigned)bytes ||
        reinterpret_cast<uintptr_t>(src) % (unsigned)bytes || !in_shared(dst, (size_t)bytes))
        die("cp.async to or from a misaligned address, or not into shared memory");
    if (t.cp_n == (int)(sizeof(t.cp) / sizeof(t.cp[0])))
        die("more cp.async copies in flight than the emulator keeps");
    t.cp[t.cp_n].dst = dst;
    t.cp[t.cp_n].src = src;
    t.cp[t.cp_n].bytes = bytes;
    t.cp[t.cp_n].src_bytes = src_bytes;
    t.cp[t.cp_n].group = -1;
    if (S.reverse)
        cp_land(t, t.cp_n); /* at once, and waited for below as if in flight */
    t.cp_n++;
}

void kemu_cp_commit(void)
{
    kemu_thread &t = *kemu_cur;
    for (int i = 0; i < t.cp_n; i++)
        if (t.cp[i].group < 0)
            t.cp[i].group = t.cp_groups;
    t.cp_groups++;
}

void kemu_cp_wait(int n)
{
    kemu_thread &t = *kemu_cur;
    int kept = 0;
    for (int i = 0; i < t.cp_n; i++) {
        if (t.cp[i].group >= 0 && t.cp[i].group < t.cp_groups - n) {
            if (!S.reverse)
                cp_land(t, i);
        } else {
            t.cp[kept++] = t.cp[i];
        }
    }
    t.cp_n = kept;
}

void kemu_wait(int op)
{
    fiber *f = reinterpret_cast<fiber *>(kemu_cur);
    f->t.op = op;
    f->state = ST_WAIT;
    yield_from(f);
}

/* ---- stream capture (CUDA graphs): a captured stream records its work instead of running it;
 * a graph launch runs the records in order. As in CUDA (thread-local capture mode): host
 * transfers and synchronisation of a capturing stream, and allocations by a capturing thread,
 * are not capturable and invalidate the capture, whose end then fails. ---- */

namespace
{

struct graph {
    std::vector<std::function<void()>> ops;
};

struct capture {
    graph *g;
    bool invalid;
    pthread_t thread;
};

std::mutex g_cap_lock;
std::map<cudaStream_t, capture> g_caps;

/* The capture of stream s (nullptr: none). */
capture *capture_of(cudaStream_t s)
{
    std::lock_guard<std::mutex> hold(g_cap_lock);
    auto it = g_caps.find(s);
    return it == g_caps.end() ? nullptr : &it->second;
}

/* Does the calling thread capture a stream? Invalidates its captures when it does. */
bool thread_captures_invalidate(void)
{
    std::lock_guard<std::mutex> hold(g_cap_lock);
    bool any = false;
    for (auto &c : g_caps)
        if (pthread_equal(c.second.thread, pthread_self())) {
            c.second.invalid = true;
            any = true;
        }
    return any;
}

} // namespace

/* ---- devices and streams ---- */

namespace
{

thread_local int g_cur_dev; /* the calling thread's current device (cudaSetDevice) */

/* QUERN_CUDA_EMU_DEVICES, read once. */
int n_devices(void)
{
    static const int n = [] {
        const char *e = getenv("QUERN_CUDA_EMU_DEVICES");
        if (!e || !*e)
            return 1;
        char *end;
        const long v = strtol(e, &end, 10);
        if (*end || v < 1 || v > 8) {
            fprintf(stderr, "CUDA emulator: QUERN_CUDA_EMU_DEVICES=%s: want 1 to 8\n", e);
            abort();
        }
        return (int)v;
    }();
    return n;
}

/* QUERN_CUDA_EMU_MEM, read once: each device's memory. */
size_t device_bytes(void)
{
    static const size_t n = [] {
        const char *e = getenv("QUERN_CUDA_EMU_MEM");
        if (!e || !*e)
            return (size_t)1 << 30;
        char *end;
        const unsigned long long v = strtoull(e, &end, 10);
        const int shift = *end == 'K'   ? 10
                          : *end == 'M' ? 20
                          : *end == 'G' ? 30
                          : *end == 'T' ? 40
                                        : 0;
        if (shift)
            end++;
        if (*end || *e == '-' || v < 1 || v > ((1ULL << 40) >> shift)) {
            fprintf(stderr, "CUDA emulator: QUERN_CUDA_EMU_MEM=%s: want 1 byte to 1T\n", e);
            abort();
        }
        return (size_t)(v << shift);
    }();
    return n;
}

struct emu_stream {
    int device; /* the device current when it was made */
};

/* The device of stream s (the default stream: the current device's). */
int stream_device(cudaStream_t s)
{
    return s ? reinterpret_cast<emu_stream *>(s)->device : g_cur_dev;
}

} // namespace

static void run_launch(const char *name, dim3 grid, dim3 block, const std::function<void()> &body);

int kemu_run(const char *name, dim3 grid, dim3 block, cudaStream_t stream,
             const std::function<void()> &body)
{
    const unsigned long nthreads = (unsigned long)block.x * block.y * block.z;
    if (!nthreads || nthreads > 1024 || block.z > 64 || !grid.x || !grid.y || !grid.z ||
        grid.y > 65535 || grid.z > 65535) {
        set_error(cudaErrorInvalidConfiguration);
        return cudaErrorInvalidConfiguration;
    }
    if (stream_device(stream) != g_cur_dev) { /* CUDA's rule: the stream's device is current */
        set_error(cudaErrorInvalidResourceHandle);
        return cudaErrorInvalidResourceHandle;
    }
    if (capture *c = capture_of(stream)) {
        if (c->invalid) {
            set_error(cudaErrorStreamCaptureInvalidated);
            return cudaErrorStreamCaptureInvalidated;
        }
        const std::function<void()> keep = body;
        c->g->ops.push_back([name, grid, block, keep] { run_launch(name, grid, block, keep); });
        return cudaSuccess;
    }
    run_launch(name, grid, block, body);
    return cudaSuccess;
}

static void run_launch(const char *name, dim3 grid, dim3 block, const std::function<void()> &body)
{
    const unsigned long nthreads = (unsigned long)block.x * block.y * block.z;
    const dev_access hold; /* also keeps the scheduler's global state to one launch */
    if (S.f.size() < nthreads) {
        const size_t old = S.f.size();
        S.f.resize(nthreads);
        for (size_t i = old; i < nthreads; i++) {
            void *p = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED)
                die("out of memory for thread stacks");
            S.f[i].stack = static_cast<char *>(p);
        }
    }
    for (unsigned long i = 0; i < nthreads; i++) {
        kemu_thread &t = S.f[i].t;
        t.tid = make_uint3((unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                           (unsigned)(i / block.x / block.y));
        t.lane = (int)(i % 32);
        t.warp = (int)(i / 32);
    }
    S.body = &body;
    S.name = name;
    const char *order = getenv("QUERN_CUDA_EMU_ORDER");
    S.reverse = order && !strcmp(order, "reverse");
#if KEMU_ASAN
    pthread_attr_t attr;
    void *lo = nullptr;
    size_t sz = 0;
    if (!pthread_getattr_np(pthread_self(), &attr)) {
        pthread_attr_getstack(&attr, &lo, &sz);
        pthread_attr_destroy(&attr);
    }
    S.sched_bottom = lo;
    S.sched_size = sz;
#endif
    kemu_grid_dim = grid;
    kemu_block_dim = block;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                kemu_block_idx = dim3(x, y, z);
                run_block((int)nthreads);
            }
    kemu_cur = nullptr;
    S.name = nullptr;
}

/* ---- the runtime API ---- */

namespace
{

std::mutex g_mem_lock;
struct dev_block {
    size_t size;
    int device;
};
std::map<uintptr_t, dev_block> g_allocs; /* device allocations by start */

/* The device whose allocation [p, p + n) lies in, or -1 when it lies in none. */
int device_of(const void *p, size_t n)
{
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> hold(g_mem_lock);
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin())
        return -1;
    --it;
    const size_t size = it->second.size;
    return a >= it->first && n <= size && a - it->first <= size - n ? it->second.device : -1;
}

bool touches_device(const void *p, size_t n)
{
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> hold(g_mem_lock);
    auto it = g_allocs.upper_bound(a + (n ? n - 1 : 0));
    if (it == g_allocs.begin())
        return false;
    --it;
    return it->first + it->second.size > a;
}

cudaError_t fail(cudaError_t e)
{
    set_error(e);
    return e;
}

} // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int *count)
{
    *count = n_devices();
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    if (device < 0 || device >= n_devices())
        return fail(cudaErrorInvalidDevice);
    g_cur_dev = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    *device = g_cur_dev;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device)
{
    if (device < 0 || device >= n_devices())
        return fail(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof(*prop));
    snprintf(prop->name, sizeof(prop->name), "quern CUDA emulator (CPU)");
    prop->totalGlobalMem = device_bytes();
    prop->major = 9;
    prop->minor = 0;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->multiProcessorCount = 1;
    return cudaSuccess;
}

/* Bytes of the current device's live allocations (g_mem_lock held). */
size_t device_used(void)
{
    size_t used = 0;
    for (const auto &a : g_allocs)
        if (a.second.device == g_cur_dev)
            used += a.second.size;
    return used;
}

cudaError_t cudaMalloc(void **p, size_t size)
{
    *p = nullptr;
    if (thread_captures_invalidate())
        return fail(cudaErrorStreamCaptureUnsupported);
    if (size > device_bytes()) /* (never asks the host for more than a device holds) */
        return fail(cudaErrorMemoryAllocation);
    void *m = dev_alloc(size);
    if (!m)
        return fail(cudaErrorMemoryAllocation);
    { /* the capacity check and the record in one section: two threads' allocations (the
       * ranks') cannot both pass it with room for one */
        std::lock_guard<std::mutex> hold(g_mem_lock);
        const size_t used = device_used();
        const int full = used >= device_bytes() || size > device_bytes() - used;
        if (!full)
            g_allocs[reinterpret_cast<uintptr_t>(m)] = dev_block{size, g_cur_dev};
        if (full) {
            dev_free(m, size);
            return fail(cudaErrorMemoryAllocation); /* the device is full */
        }
    }
    {
        const dev_access hold;
        memset(m, 0xFF, size);
    }
    *p = m;
    return cudaSuccess;
}

/* The current device: device_bytes(), of which its live allocations are in use (no context). */
cudaError_t cudaMemGetInfo(size_t *avail, size_t *total)
{
    size_t used;
    {
        std::lock_guard<std::mutex> hold(g_mem_lock);
        used = device_used();
    }
    *total = device_bytes();
    *avail = used < *total ? *total - used : 0;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    if (!p)
        return cudaSuccess;
    if (thread_captures_invalidate())
        return fail(cudaErrorStreamCaptureUnsupported);
    size_t size;
    {
        std::lock_guard<std::mutex> hold(g_mem_lock);
        auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
        if (it == g_allocs.end())
            return fail(cudaErrorInvalidValue);
        size = it->second.size;
        g_allocs.erase(it);
    }
    dev_free(p, size);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                            cudaStream_t stream)
{
    if (!n)
        return cudaSuccess;
    const int sd = stream_device(stream);
    bool ok;
    switch (kind) {
    case cudaMemcpyHostToDevice:
        ok = device_of(dst, n) == sd && !touches_device(src, n);
        break;
    case cudaMemcpyDeviceToHost:
        ok = device_of(src, n) == sd && !touches_device(dst, n);
        break;
    case cudaMemcpyDeviceToDevice: /* between devices too (a peer copy, as collectives make) */
        ok = device_of(src, n) >= 0 && device_of(dst, n) >= 0;
        break;
    default:
        ok = false;
    }
    if (!ok) {
        fprintf(stderr,
                "CUDA emulator: cudaMemcpyAsync(%p, %p, %zu, kind %d) on a stream of device %d "
                "does not match that device's allocations\n",
                dst, src, n, (int)kind, sd);
        return fail(cudaErrorInvalidValue);
    }
    if (capture *c = capture_of(stream)) {
        if (c->invalid)
            return fail(cudaErrorStreamCaptureInvalidated);
        if (kind != cudaMemcpyDeviceToDevice) { /* host memory: not capturable */
            c->invalid = true;
            return fail(cudaErrorStreamCaptureUnsupported);
        }
        c->g->ops.push_back([dst, src, n] {
            const dev_access hold;
            memmove(dst, src, n);
        });
        return cudaSuccess;
    }
    const dev_access hold;
    memmove(dst, src, n);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t stream)
{
    if (!n)
        return cudaSuccess;
    if (device_of(p, n) != stream_device(stream)) {
        fprintf(stderr,
                "CUDA emulator: cudaMemsetAsync(%p, %zu) outside the allocations of the stream's "
                "device %d\n",
                p, n, stream_device(stream));
        return fail(cudaErrorInvalidValue);
    }
    if (capture *c = capture_of(stream)) {
        if (c->invalid)
            return fail(cudaErrorStreamCaptureInvalidated);
        c->g->ops.push_back([p, value, n] {
            const dev_access hold;
            memset(p, value, n);
        });
        return cudaSuccess;
    }
    const dev_access hold;
    memset(p, value, n);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags)
{
    (void)flags;
    *s = reinterpret_cast<cudaStream_t>(new emu_stream{g_cur_dev});
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    delete reinterpret_cast<emu_stream *>(s);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p)
{
    memset(a, 0, sizeof(*a));
    const int d = device_of(p, 1);
    a->type = d >= 0 ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
    a->device = d >= 0 ? d : -2; /* as CUDA reports host memory */
    a->devicePointer = d >= 0 ? const_cast<void *>(p) : nullptr;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    if (capture *c = capture_of(s)) {
        c->invalid = true;
        return fail(cudaErrorStreamCaptureUnsupported);
    }
    return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode)
{
    (void)mode; /* thread-local semantics whatever the mode */
    std::lock_guard<std::mutex> hold(g_cap_lock);
    if (g_caps.count(s))
        return fail(cudaErrorIllegalState);
    g_caps[s] = capture{new graph, false, pthread_self()};
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status)
{
    capture *c = capture_of(s);
    *status = !c           ? cudaStreamCaptureStatusNone
              : c->invalid ? cudaStreamCaptureStatusInvalidated
                           : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *out)
{
    *out = nullptr;
    capture c;
    {
        std::lock_guard<std::mutex> hold(g_cap_lock);
        auto it = g_caps.find(s);
        if (it == g_caps.end())
            return fail(cudaErrorIllegalState);
        c = it->second;
        g_caps.erase(it);
    }
    if (c.invalid) {
        delete c.g;
        return fail(cudaErrorStreamCaptureInvalidated);
    }
    *out = reinterpret_cast<cudaGraph_t>(c.g);
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long flags)
{
    (void)flags;
    *exec = reinterpret_cast<cudaGraphExec_t>(new graph(*reinterpret_cast<graph *>(g)));
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s)
{
    if (capture_of(s))
        return fail(cudaErrorStreamCaptureUnsupported);
    for (const auto &op : reinterpret_cast<graph *>(exec)->ops)
        op();
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t g)
{
    delete reinterpret_cast<graph *>(g);
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec)
{
    delete reinterpret_cast<graph *>(exec);
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void)
{
    const int e = g_last_error;
    g_last_error = 0;
    return (cudaError_t)e;
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInvalidConfiguration:
        return "invalid configuration argument";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
        return "operation failed due to a previous error during capture";
    case cudaErrorIllegalState:
        return "the operation is not permitted in the current state";
    case cudaErrorInvalidResourceHandle:
        return "invalid resource handle";
    default:
        return "unknown error (CUDA emulator)";
    }
}

} // extern "C"

int kemu_capture_record(cudaStream_t s, const std::function<void()> &op)
{
    capture *c = capture_of(s);
    if (!c)
        return 0;
    if (c->invalid)
        return -1;
    c->g->ops.push_back(op);
    return 1;
}
