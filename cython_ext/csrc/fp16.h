/* Portable float16 <-> float32 conversions (no intrinsics), bit-exact with IEEE
 * round-to-nearest-even, i.e. with numpy's astype and with F16C vcvtps2ph. */
#ifndef CYLLM_FP16_H
#define CYLLM_FP16_H

#include <stdint.h>
#include <string.h>

static inline uint32_t cyllm_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float cyllm_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float cyllm_h2f(uint16_t h) {
    /* Move exponent+mantissa into float position and rescale by 2^(127-15):
     * exact for normals and subnormals alike (a power-of-two multiply). */
    uint32_t em = (uint32_t)(h & 0x7fffu);
    float f = cyllm_u2f(em << 13) * 0x1p112f;
    uint32_t u = cyllm_f2u(f);
    if (em >= 0x7c00u) u |= 0x7f800000u;            /* inf / nan keep their payload */
    return cyllm_u2f(u | ((uint32_t)(h & 0x8000u) << 16));
}

static inline uint16_t cyllm_f2h(float f) {
    uint32_t x = cyllm_f2u(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)                          /* inf, nan (nan made quiet) */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0u));
    if (ax >= 0x477ff000u)                          /* >= 65520 rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {                         /* below 2^-14: half subnormal (or zero) */
        /* adding 0.5 lines the half-subnormal ulp up with the float ulp; the FPU rounds (RNE) */
        float r = cyllm_u2f(ax) + 0.5f;
        return (uint16_t)(sign | (cyllm_f2u(r) - 0x3f000000u));
    }
    /* normal: rebias exponent by -112, round to nearest even on the 13 dropped bits */
    ax += 0xc8000fffu + ((ax >> 13) & 1u);
    return (uint16_t)(sign | (ax >> 13));
}

#endif
