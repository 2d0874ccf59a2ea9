/* CPU feature detection and kernel-table lookup (compiled at the baseline ISA, so
 * this file runs on any CPU; it decides whether the AVX2 code may ever be entered).
 *
 * AVX2 variant needs: cpuid leaf 1 ECX FMA (bit 12), OSXSAVE (27), AVX (28), F16C (29);
 * XCR0 & 6 == 6 (the OS saves XMM+YMM state); leaf 7 EBX AVX2 (bit 5).
 * avx512 variant (the avx2 kernels + an AVX-512F GEMM) also needs leaf 7 EBX AVX512F
 * (bit 16) and XCR0 & 0xe6 == 0xe6 (the OS saves opmask + zmm state).
 */
#include <string.h>
#include "kernels.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define CYLLM_X86 1

static unsigned long long xgetbv0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

static int detect(void) {
    unsigned int a, b, c, d;
    int f = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    unsigned int max_leaf = a;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1;
    if (!osxsave) return 0;                /* xgetbv would fault; no AVX of any kind */
    unsigned long long xcr0 = xgetbv0();
    int ymm_ok = (xcr0 & 6) == 6;
    int zmm_ok = (xcr0 & 0xe6) == 0xe6;
    if (ymm_ok && ((c >> 28) & 1)) f |= CYLLM_CPU_AVX;
    if (ymm_ok && ((c >> 12) & 1)) f |= CYLLM_CPU_FMA;
    if (ymm_ok && ((c >> 29) & 1)) f |= CYLLM_CPU_F16C;
    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        if (ymm_ok && ((b >> 5) & 1)) f |= CYLLM_CPU_AVX2;
        if (zmm_ok && ((b >> 16) & 1)) f |= CYLLM_CPU_AVX512F;
    }
    return f;
}
#else
static int detect(void) { return 0; }
#endif

static int features = -1;

int cyllm_cpu_features(void) {
    if (features < 0) features = detect();    /* idempotent: a race only recomputes it */
    return features;
}

int cyllm_avx512_compiled(void) {
#ifdef CYLLM_HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}

#ifdef CYLLM_HAVE_AVX512
/* The avx512 table: the avx2 kernels with the AVX-512 GEMM. Built on first use;
 * a racing second builder writes the same bytes. */
static cyllm_kernels avx512_table;
static int avx512_ready = 0;
static const cyllm_kernels *avx512_kernels(void) {
    if (!avx512_ready) {
        avx512_table = cyllm_avx2_kernels;
        avx512_table.name = "avx512";
        avx512_table.gemm_rows = cyllm_gemm_rows_avx512;
        avx512_table.gemm_nr = 32;
        avx512_table.attention_rows = cyllm_attention_rows_avx512;
        avx512_table.attention_rows_work = cyllm_attention_rows_work_avx512;
        avx512_table.attention_rows_max = 12;

        avx512_ready = 1;
    }
    return &avx512_table;
}
#endif

int cyllm_avx2_compiled(void) {
#ifdef CYLLM_HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

const cyllm_kernels *cyllm_kernels_by_name(const char *name) {
    if (strcmp(name, "generic") == 0) return &cyllm_generic_kernels;
#ifdef CYLLM_HAVE_AVX2
    if (strcmp(name, "avx2") == 0) {
        const int need = CYLLM_CPU_AVX | CYLLM_CPU_AVX2 | CYLLM_CPU_FMA | CYLLM_CPU_F16C;
        if ((cyllm_cpu_features() & need) == need) return &cyllm_avx2_kernels;
    }
#endif
#if defined(CYLLM_HAVE_AVX2) && defined(CYLLM_HAVE_AVX512)
    if (strcmp(name, "avx512") == 0) {
        const int need = CYLLM_CPU_AVX | CYLLM_CPU_AVX2 | CYLLM_CPU_FMA | CYLLM_CPU_F16C
                         | CYLLM_CPU_AVX512F;
        if ((cyllm_cpu_features() & need) == need) return avx512_kernels();
    }
#endif
    return NULL;
}
