/* AVX2 quantized kernels (vpmaddubsw + vpmaddwd). Compiled alone with -mavx2 -mfma -mf16c
 * -ffp-contract=off (setup.py); entered only after quant_dispatch.c has seen AVX2/FMA/F16C. */
#define QX_VNNI 0
#define QX_NAME "avx2"
#define QX_TABLE cyllm_qkernels_avx2
#include "quant_x86.h"
