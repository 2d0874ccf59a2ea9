/* AVX512-VNNI quantized kernels: EVEX vpdpbusd / vpdpwssd on 256-bit registers
 * (AVX512_VNNI + AVX512VL; Ice Lake and later, Zen 4). ymm rather than zmm: the decode
 * matvec is bound by memory, and 256-bit EVEX ops avoid the zmm frequency penalty of
 * older Intel parts; the gain over AVX2 is the fused multiply-add of bytes (one uop
 * instead of vpmaddubsw + vpmaddwd + vpaddd). Compiled alone with the AVX2 flags +
 * -mavx512f -mavx512bw -mavx512vl -mavx512vnni (setup.py); entered only after
 * quant_dispatch.c has seen those features and the OS's zmm/opmask state support. */
#define QX_VNNI 2
#define QX_NAME "avx512vnni"
#define QX_TABLE cyllm_qkernels_avx512vnni
#include "quant_x86.h"
