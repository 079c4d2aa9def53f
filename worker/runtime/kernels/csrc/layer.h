// The descriptors of the layer kernel (layer.cpp), shared with worker/runtime/kernels/layer.py,
// which mirrors them with ctypes and checks the sizes against LP_FN(layer_abi) at load.  Plain C
// structs of pointers, int32 and float fields (int64 where noted), no padding surprises: keep
// the Python mirror in the same order when a field changes.
#pragma once

#include <stdint.h>

// One packed matmul (worker/runtime/kernels/linear.py QuantLinear; the qmm exports' arguments).
struct LpMatmul {
  const uint8_t* qw;
  const float* sc;
  const float* bias;  // the weight form's stored offsets c, or NULL (c = off * s)
  float off;
  int d, k, bs, is_signed;
  int act;            // 0 int16 activations, 1 int8, 2 bf16 (the amx library's qmmbf16.cpp)
};

// One logical weight's share of a projection's output: columns col..col+d-1, its LoRA branch
// over the adapter slot pool (lora_a NULL: none on this weight in this ubatch) and its bias.
struct LpLora {
  int col, d;
  const float* lora_a;       // (S, R, k)
  const float* lora_bt;      // (S, R, d)
  int lora_R;
  int lora_nthreads;         // threads for this branch (worker/runtime/kernels/lora.py's rule)
  const int32_t* lora_rank;  // (S,)
  const float* lora_factor;  // (S,)
  const float* add_bias;     // (d,) or NULL
};

// A projection: up to 3 packed matmuls reading one input, outputs side by side (d = their sum),
// and up to 3 logical weights over those columns.
struct LpProj {
  LpMatmul mm[3];
  int n_mm, d;
  LpLora part[3];
  int n_part, pad_;
};

// The ubatch's LoRA routing (worker/runtime/kernels/lora.py LoraPairs).
struct LpPairs {
  const int32_t* slot;
  const float* scale;
  const int32_t* row_ptr;  // (n + 1,), or NULL: no LoRA in this ubatch
};

// One slot's LoRA on a mixture's expert weight (worker/lora/pool.py SideBranch), f32 contiguous:
// a (n_expert, r, k), b (n_expert, d, r); row r of the ubatch scales it by row_slot[r, slot] * factor.
struct LpSide {
  const float* a;
  const float* b;
  int r, slot;
  float factor;
  int pad_;
};

struct LpLayer {
  int n_embd, n_head, n_head_kv, dk, dv, n_ff;
  float eps;
  int n_rot, neox, n_swa, act, kv_dtype;  // act: 0 silu, 1 gelu (tanh); kv_dtype: 0 f32, 1 f16, 2 bf16
  float q_scale, kq_scale, softcap;
  int pad_;
  const float* attn_norm;
  const float* q_norm;          // (dk,) or NULL
  const float* k_norm;          // (dk,) or NULL
  const float* post_attn_norm;  // (n_embd,) or NULL
  const float* ffn_norm;
  const float* post_ffw_norm;   // (n_embd,) or NULL
  void* k_cache;
  void* v_cache;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;  // element strides (row, pos, kv head)
  int64_t norm_min_parallel, attn_min_parallel_work;
  LpProj qkv, wo, ffn_in, down;  // ffn_in: [gate | up], 2 * n_ff columns
  // A mixture of experts in place of the dense FFN when n_expert > 0 (ffn_in / down then hold no
  // matmul): router logits cur @ gate_inp.T, softmax, the n_expert_used most probable experts
  // (ties: the lower index), their weights renormalised to sum 1 when moe_norm_w; each chosen
  // expert's gated FFN (n_ff columns) on the rows routed to it, summed with those weights.
  int n_expert, n_expert_used, moe_norm_w, pad2_;
  const float* gate_inp;   // (n_expert, n_embd) f32 row-major
  const LpProj* exp_in;    // (n_expert,) each expert's [gate | up], 2 * n_ff columns, no LoRA
  const LpProj* exp_down;  // (n_expert,) each expert's down projection, n_embd columns, no LoRA
  // this ubatch's LoRA on the experts: per expert weight (0 gate, 1 up, 2 down) n_side[w] branches
  // (NULL when none), and the per-row slot scales they read, (n, n_slot_cols) f32
  const LpSide* side[3];
  const float* row_slot;
  int n_side[3], n_slot_cols;
  // the router's LoRA (a pool weight, as a projection's part): n_mm 0, d = n_expert, one part
  LpProj router;
};
