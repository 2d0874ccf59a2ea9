/* CPU feature detection for the quantized kernel tables (baseline ISA, runs anywhere).
 *
 * avx2:       cpuid.1 ECX FMA(12) OSXSAVE(27) AVX(28) F16C(29), XCR0 & 6 == 6, cpuid.7.0 EBX AVX2(5)
 * avxvnni:    the avx2 set + cpuid.7.1 EAX AVX-VNNI(4)
 * avx512vnni: the avx2 set + cpuid.7.0 EBX AVX512F(16) AVX512BW(30) AVX512VL(31),
 *             ECX AVX512_VNNI(11), XCR0 & 0xe6 == 0xe6 (opmask + zmm state saved by the OS)
 */
#include <string.h>
#include "quant.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

static unsigned long long qxgetbv0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

static int qdetect(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    unsigned int max_leaf = a;
    if (max_leaf < 7 || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!((c >> 27) & 1)) return 0;                        /* no OSXSAVE: xgetbv would fault */
    const int fma = (c >> 12) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    unsigned long long xcr0 = qxgetbv0();
    if ((xcr0 & 6) != 6 || !fma || !avx || !f16c) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned int max_sub = a;
    if (!((b >> 5) & 1)) return 0;                         /* AVX2 */
    int f = CYLLM_QCPU_AVX2;
    const int avx512 = ((b >> 16) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1) && ((c >> 11) & 1)
                       && (xcr0 & 0xe6) == 0xe6;
    if (avx512) f |= CYLLM_QCPU_AVX512VNNI;
    if (max_sub >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        if ((a >> 4) & 1) f |= CYLLM_QCPU_AVXVNNI;
    }
    return f;
}
#else
static int qdetect(void) { return 0; }
#endif

static int qfeatures = -1;

int cyllm_qcpu_features(void) {
    if (qfeatures < 0) qfeatures = qdetect();     /* idempotent: a race only recomputes it */
    return qfeatures;
}

const cyllm_qkernels *cyllm_qkernels_by_name(const char *name) {
    const int f = cyllm_qcpu_features();
    (void)f;
    if (strcmp(name, "generic") == 0) return &cyllm_qkernels_generic;
#ifdef CYLLM_HAVE_AVX2
    if (strcmp(name, "avx2") == 0 && (f & CYLLM_QCPU_AVX2)) return &cyllm_qkernels_avx2;
#endif
#ifdef CYLLM_HAVE_AVXVNNI
    if (strcmp(name, "avxvnni") == 0 && (f & CYLLM_QCPU_AVX2) && (f & CYLLM_QCPU_AVXVNNI))
        return &cyllm_qkernels_avxvnni;
#endif
#ifdef CYLLM_HAVE_AVX512VNNI
    if (strcmp(name, "avx512vnni") == 0 && (f & CYLLM_QCPU_AVX2) && (f & CYLLM_QCPU_AVX512VNNI))
        return &cyllm_qkernels_avx512vnni;
#endif
    return 0;
}

const cyllm_qkernels *cyllm_qkernels_for_variant(const char *variant) {
    static const char *const wide[] = {"avx512vnni", "avxvnni", "avx2", 0};
    int start;
    if (strcmp(variant, "avx512") == 0) start = 0;
    else if (strcmp(variant, "avx2") == 0) start = 1;
    else return &cyllm_qkernels_generic;
    for (int i = start; wide[i]; i++) {
        const cyllm_qkernels *k = cyllm_qkernels_by_name(wide[i]);
        if (k) return k;
    }
    return &cyllm_qkernels_generic;
}
