/* AVX512-VNNI quantized kernels (AVX512F/BW/VL + AVX512_VNNI: Ice Lake and later, Zen 4,
 * Zen 5). 512-bit kernels for q8_0, the 32-block nibble formats and the K-quants (see the
 * zmm sections of quant_x86.h): on Zen 5, with full 512-bit datapaths, a zmm vpdpbusd does
 * twice the work of a ymm one; on Zen 4 (512-bit ops split in two 256-bit halves) it still
 * halves the instruction count per weight. Prefill runs register tiles of rows x tokens
 * (the row's unpacking shared by the tokens, x's loads by the rows); decode runs the same
 * per-(row, token) chains one row at a time, so both give the same bits (q5_k: 16 tokens
 * per zmm in prefill, each lane running decode's chain). Measured on Zen 5
 * (bench/results/cpu_quant_epyc_zen5.md) and Zen 4 (cpu_quant_epyc_zen4.md). Compiled alone with the AVX2 flags +
 * -mavx512f -mavx512bw -mavx512vl -mavx512vnni (setup.py); entered only after
 * quant_dispatch.c has seen those features and the OS's zmm/opmask state support. */
#define QX_VNNI 2
#define QX_NAME "avx512vnni"
#define QX_TABLE cyllm_qkernels_avx512vnni
#include "quant_x86.h"
