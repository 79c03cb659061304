/* Run-time choice of CPU kernels: detects once which SIMD instruction sets the CPU and OS support
 * (cpuid + xgetbv) and hands out only tables whose instructions will run here. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "common/log.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_kernels_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* XCR0: which register state the OS saves on context switch. Only valid when CPUID reports
 * OSXSAVE; the raw opcode avoids needing -mxsave for the intrinsic. */
static uint64_t read_xcr0(void)
{
    uint32_t lo, hi;
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}

/* Linux hands out the 8 KiB of tile data state only to processes that ask for it
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the grant covers every thread. */
static int amx_permit(void)
{
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}

/* AMX tile support enabled by the OS (XCR0 tile state) and granted to us: bit 0 AMX-INT8,
 * bit 1 AMX-BF16 (with the AVX-512 BF16 conversions the bf16 kernels also use). */
static int detect_amx(void)
{
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, 0) < 7 || !__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1))
        return 0; /* no leaf 7, or no OSXSAVE (then xgetbv faults) */
    __cpuid_count(7, 0, a, b, c, d);
    int tile = (d >> 24) & 1, int8 = (d >> 25) & 1, bf16 = (d >> 22) & 1;
    __cpuid_count(7, 1, a, b, c, d);
    bf16 &= (a >> 5) & 1; /* AVX512_BF16 */
    if (!tile || (read_xcr0() & 0x60000) != 0x60000 || !amx_permit())
        return 0;
    return int8 | bf16 << 1;
}

/* The best of SCALAR, AVX2, AVX512; *vnni = AVX-VNNI (VEX vpdpbusd) on top of AVX2. */
static enum kern_isa detect_x86(int *vnni)
{
    unsigned a, b, c, d;
    *vnni = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return KERN_ISA_SCALAR;
    int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx)
        return KERN_ISA_SCALAR;
    uint64_t xcr0 = read_xcr0();
    int os_ymm = (xcr0 & 0x6) == 0x6;   /* XMM and upper YMM state */
    int os_zmm = (xcr0 & 0xE0) == 0xE0; /* opmask, upper ZMM0-15, ZMM16-31 */

    if (__get_cpuid_max(0, 0) < 7)
        return KERN_ISA_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    int avx2 = (b >> 5) & 1;
    int avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
        avx512vl = (b >> 31) & 1, avx512vnni = (c >> 11) & 1;

    if (!(os_ymm && avx2 && fma && f16c))
        return KERN_ISA_SCALAR;
    if (a >= 1) { /* leaf 7 subleaf 1: EAX bit 4 = AVX-VNNI */
        unsigned a1, b1, c1, d1;
        __cpuid_count(7, 1, a1, b1, c1, d1);
        *vnni = (a1 >> 4) & 1;
    }
    /* dot_avx512.c is compiled with -mavx512dq too, so DQ is required (every VNNI CPU has it). */
    if (os_zmm && avx512f && avx512dq && avx512bw && avx512vl && avx512vnni)
        return KERN_ISA_AVX512;
    return KERN_ISA_AVX2;
}
#else
static enum kern_isa detect_x86(int *vnni)
{
    *vnni = 0;
    return KERN_ISA_SCALAR;
}

static int detect_amx(void)
{
    return 0;
}
#endif

static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
static enum kern_isa detected_isa; /* written once under detect_once */
static int detected_amx;           /* detect_amx() on an AVX-512 VNNI CPU, else 0 */
static int detected_avxvnni;       /* AVX2 level and AVX-VNNI */

/* The AMX table is the AVX-512 one with the tile kernels added (gemm_avx512.c); filled once,
 * and only handed out when the CPU and OS allow bf16 tiles. */
static struct kern_cpu_fns amx_table = {.isa = KERN_ISA_AMX, .name = "amx"};

static void detect_run(void)
{
    detected_isa = detect_x86(&detected_avxvnni);
    if (detected_isa == KERN_ISA_AVX2 && detected_avxvnni)
        detected_isa = KERN_ISA_AVXVNNI;
    detected_amx = detected_isa == KERN_ISA_AVX512 ? detect_amx() : 0;
    if (detected_amx & 2) {
        amx_table = kern_cpu_fns_avx512;
        amx_table.isa = KERN_ISA_AMX;
        amx_table.name = "amx";
        kern_amx_patch(&amx_table);
        detected_isa = KERN_ISA_AMX;
    }
}

enum kern_isa kern_cpu_detect(void)
{
    pthread_once(&detect_once, detect_run);
    return detected_isa;
}

static const struct kern_cpu_fns *const tables[KERN_ISA_COUNT] = {
    [KERN_ISA_SCALAR] = &kern_cpu_fns_scalar,
    [KERN_ISA_AVX2] = &kern_cpu_fns_avx2,
    [KERN_ISA_AVXVNNI] = &kern_cpu_fns_avxvnni,
    [KERN_ISA_AVX512] = &kern_cpu_fns_avx512,
    [KERN_ISA_AMX] = &amx_table,
};

/* Whether this CPU runs isa's table. The ISAs are ordered by what they need, except that
 * AVX-512 VNNI does not imply AVX-VNNI (Ice Lake and Zen 4 have only the former). */
static int supported(enum kern_isa isa)
{
    enum kern_isa best = kern_cpu_detect();
    if (isa == KERN_ISA_AVXVNNI)
        return detected_avxvnni;
    if (best == KERN_ISA_AVXVNNI)
        return isa <= KERN_ISA_AVX2;
    return isa <= best;
}

const struct kern_cpu_fns *kern_cpu_fns_get(enum kern_isa isa)
{
    if ((int)isa < 0 || isa >= KERN_ISA_COUNT || !supported(isa))
        return NULL;
    return tables[isa];
}

const char *kern_isa_name(enum kern_isa isa)
{
    if ((int)isa < 0 || isa >= KERN_ISA_COUNT)
        return "?";
    return tables[isa]->name;
}

static int isa_warned; /* a bad QUERN_ISA was told (kern_cpu_fns_best runs more than once) */

const struct kern_cpu_fns *kern_cpu_fns_best(void)
{
    enum kern_isa best = kern_cpu_detect();
    const char *want = getenv("QUERN_ISA");
    if (!want || !*want)
        return tables[best];

    enum kern_isa isa;
    if (!strcmp(want, "scalar"))
        isa = KERN_ISA_SCALAR;
    else if (!strcmp(want, "avx2"))
        isa = KERN_ISA_AVX2;
    else if (!strcmp(want, "avxvnni") || !strcmp(want, "avx-vnni"))
        isa = KERN_ISA_AVXVNNI;
    else if (!strcmp(want, "avx512") || !strcmp(want, "avx512-vnni"))
        isa = KERN_ISA_AVX512;
    else if (!strcmp(want, "amx"))
        isa = KERN_ISA_AMX;
    else {
        if (!__atomic_exchange_n(&isa_warned, 1, __ATOMIC_RELAXED)) /* once, though asked often */
            LOG_WARN("QUERN_ISA=%s is not one of scalar|avx2|avxvnni|avx512|amx; using %s", want,
                     tables[best]->name);
        return tables[best];
    }
    if (!supported(isa)) {
        if (!__atomic_exchange_n(&isa_warned, 1, __ATOMIC_RELAXED))
            LOG_WARN("QUERN_ISA=%s is not supported by this CPU; using %s", want,
                     tables[best]->name);
        return tables[best];
    }
    return tables[isa];
}

double kern_cpu_amx_bf16_peak(double seconds)
{
    return kern_cpu_detect() == KERN_ISA_AMX ? kern_amx_peak(1, seconds) : 0.0;
}

int kern_cpu_has_amx(void)
{
    pthread_once(&detect_once, detect_run);
    return detected_amx & 1;
}

double kern_cpu_amx_int8_peak(double seconds)
{
    return kern_cpu_has_amx() ? kern_amx_peak(0, seconds) : 0.0;
}

double kern_cpu_int8_peak(const struct kern_cpu_fns *f, double seconds)
{
    switch (f->isa) {
    case KERN_ISA_AMX: /* its int8 kernels are the AVX-512 ones */
    case KERN_ISA_AVX512:
        return kern_avx512_int8_peak(seconds);
    case KERN_ISA_AVX2:
        return kern_avx2_int8_peak(seconds);
    case KERN_ISA_AVXVNNI:
        return kern_avxvnni_int8_peak(seconds);
    default:
        return kern_ref_int8_peak(seconds);
    }
}
