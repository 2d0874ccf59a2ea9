/* The gate activations of a GLU (out = act(Wg x) * (Wu x)), shared by the FP16 and the
 * quantized kernels. */
#ifndef CYLLM_ACT_H
#define CYLLM_ACT_H
enum { CYLLM_ACT_SILU = 0, CYLLM_ACT_GELU_TANH = 1 };
#endif
