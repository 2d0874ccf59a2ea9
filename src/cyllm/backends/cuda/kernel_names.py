"""Every kernel of cuda/*.cu the F16 backend launches, named whole so grep finds each one
(tests/test_cuda_kernel_table.py checks that each name here is defined in the sources).

The quantized kernels are named in quant.py (``_PREFIX``/``_GLU_PREFIX`` + format, the
whole names listed in cuda/quant_matvec.cu)."""

# matvec-like kernels by (op, rows per warp, 8 loads in flight, rmsnorm folded in)
MATVEC_KERNELS = {
    ("matvec", 1, False, False): "matvec_r1", ("matvec", 1, True, False): "matvec_r1_u8",
    ("matvec", 1, False, True): "matvec_r1_norm", ("matvec", 1, True, True): "matvec_r1_u8_norm",
    ("matvec", 2, False, False): "matvec_r2", ("matvec", 2, True, False): "matvec_r2_u8",
    ("matvec", 2, False, True): "matvec_r2_norm", ("matvec", 2, True, True): "matvec_r2_u8_norm",
    ("matvec", 4, False, False): "matvec_r4", ("matvec", 4, True, False): "matvec_r4_u8",
    ("matvec", 4, False, True): "matvec_r4_norm", ("matvec", 4, True, True): "matvec_r4_u8_norm",
    ("matvec_add", 1, False, False): "matvec_add_r1", ("matvec_add", 1, True, False): "matvec_add_r1_u8",
    ("matvec_add", 1, False, True): "matvec_add_r1_norm", ("matvec_add", 1, True, True): "matvec_add_r1_u8_norm",
    ("matvec_add", 2, False, False): "matvec_add_r2", ("matvec_add", 2, True, False): "matvec_add_r2_u8",
    ("matvec_add", 2, False, True): "matvec_add_r2_norm", ("matvec_add", 2, True, True): "matvec_add_r2_u8_norm",
    ("matvec_add", 4, False, False): "matvec_add_r4", ("matvec_add", 4, True, False): "matvec_add_r4_u8",
    ("matvec_add", 4, False, True): "matvec_add_r4_norm", ("matvec_add", 4, True, True): "matvec_add_r4_u8_norm",
    ("gate_up_silu", 1, False, False): "gate_up_silu_r1", ("gate_up_silu", 1, True, False): "gate_up_silu_r1_u8",
    ("gate_up_silu", 1, False, True): "gate_up_silu_r1_norm",
    ("gate_up_silu", 1, True, True): "gate_up_silu_r1_u8_norm",
    ("gate_up_silu", 2, False, False): "gate_up_silu_r2", ("gate_up_silu", 2, True, False): "gate_up_silu_r2_u8",
    ("gate_up_silu", 2, False, True): "gate_up_silu_r2_norm",
    ("gate_up_silu", 2, True, True): "gate_up_silu_r2_u8_norm",
    ("gate_up_gelu", 1, False, False): "gate_up_gelu_r1", ("gate_up_gelu", 1, True, False): "gate_up_gelu_r1_u8",
    ("gate_up_gelu", 1, False, True): "gate_up_gelu_r1_norm",
    ("gate_up_gelu", 1, True, True): "gate_up_gelu_r1_u8_norm",
    ("gate_up_gelu", 2, False, False): "gate_up_gelu_r2", ("gate_up_gelu", 2, True, False): "gate_up_gelu_r2_u8",
    ("gate_up_gelu", 2, False, True): "gate_up_gelu_r2_norm",
    ("gate_up_gelu", 2, True, True): "gate_up_gelu_r2_u8_norm",
}
# any n, any alignment
MATVEC_SCALAR_KERNELS = {"matvec": "matvec_scalar", "matvec_add": "matvec_add_scalar",
                          "gate_up_silu": "gate_up_silu_scalar", "gate_up_gelu": "gate_up_gelu_scalar"}
# decode attention by (query heads per tile, V loaded with K)
ATTN_SPLIT_KERNELS = {(1, False): "attn_split_g1", (1, True): "attn_split_g1_ve",
                       (2, False): "attn_split_g2", (2, True): "attn_split_g2_ve",
                       (4, False): "attn_split_g4", (4, True): "attn_split_g4_ve",
                       (8, False): "attn_split_g8", (8, True): "attn_split_g8_ve"}
# the staged decode attention with a fold a score instead of the batch's butterfly (measurements)
ATTN_FOLD_KERNELS = {1: "attn_split_g1_fold", 2: "attn_split_g2_fold", 4: "attn_split_g4_fold", 8: "attn_split_g8_fold"}
# the staged decode attention with its first K rows loaded before pdl_wait, its first V rows
# before the softmax (CudaBackend.attn_staged_early)
ATTN_EARLY_KERNELS = {1: "attn_split_g1_ek", 2: "attn_split_g2_ek", 4: "attn_split_g4_ek", 8: "attn_split_g8_ek"}
# prefill attention by (columns per lane, float4 rows)
ATTN_BATCH_KERNELS = {(1, False): "attn_batch_c1", (1, True): "attn_batch_c1_v4",
                       (2, False): "attn_batch_c2", (2, True): "attn_batch_c2_v4",
                       (4, False): "attn_batch_c4", (4, True): "attn_batch_c4_v4",
                       (8, False): "attn_batch_c8", (8, True): "attn_batch_c8_v4"}
# the matvec-like op of each GLU activation, and the product pass of the batched one
GATE_UP_OPS = {"silu": "gate_up_silu", "gelu_tanh": "gate_up_gelu"}
GLU_KERNELS = {"silu": "swiglu_f32", "gelu_tanh": "geglu_f32"}
# a mixture of experts on the device (experts.py): decode's router and choice and weighted sum;
# prefill's choice of each row (after the router's GEMM), grouping by expert, and sums of rows;
# and the chosen FP16 experts by activation (None: the plain product, for down)
MOE_KERNELS = {"route": "moe_route_f32", "combine": "moe_combine_f32", "route_rows": "moe_route_rows",
               "group": "moe_group", "combine_rows": "moe_combine_rows"}
EXPERTS_F16_KERNELS = {None: "matvec_experts_f16", "silu": "gate_up_silu_experts_f16",
                       "gelu_tanh": "gate_up_gelu_experts_f16"}
# decode's per-head q/k norms folded into rope_store (qk_norm_fold.py), by head_dim
QKNORM_ROPE_STORE_KERNELS = {64: "qknorm_rope_store_64", 128: "qknorm_rope_store_128",
                             256: "qknorm_rope_store_256"}
