/* AVX-VNNI quantized kernels (VEX vpdpbusd / vpdpwssd on ymm: Alder Lake and later, Zen 5).
 * Compiled alone with the AVX2 flags + -mavxvnni (setup.py); entered only after
 * quant_dispatch.c has seen AVX-VNNI besides the AVX2 set. */
#define QX_VNNI 1
#define QX_NAME "avxvnni"
#define QX_TABLE cyllm_qkernels_avxvnni
#include "quant_x86.h"
