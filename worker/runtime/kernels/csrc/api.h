// Every function the kernel libraries export, declared once.  Each ISA's library exports them as
// lp_<isa>_<name> (LP_FN), so the libraries of two ISAs never clash when both are loaded in one
// process; everything else in a source stays hidden (-fvisibility=hidden) or in an anonymous
// namespace.  Every source includes this header, so the compiler rejects a definition whose
// parameters differ from its declaration here ("conflicting declaration of C function").
//
// worker/runtime/kernels/library.py reads this file (shipped beside the libraries) to bind the
// exports with ctypes: keep each declaration in the form
//   LP_EXPORT <void|int> LP_FN(<name>)(<type> <name>, ...);
// with parameter types among int, int64_t, float and pointers (any `T*`), one declaration per
// statement; a block between `#if defined(LP_AMX)` and `#endif` is exported by the amx library only.
// Shapes and units: at each definition.
#pragma once

#include <stdint.h>

#include "layer.h"

#if defined(LP_AMX)
#define LP_FN(name) lp_amx_##name
#elif defined(LP_AVX512)
#define LP_FN(name) lp_avx512_##name
#else
#define LP_FN(name) lp_avx2_##name
#endif
#define LP_EXPORT extern "C" __attribute__((visibility("default")))

// qmm.cpp: int8 activations (qmm8.h; the amx library: tiles, qmm_amx.h)
LP_EXPORT void LP_FN(quantize_act)(const float* x, int64_t ldx, int n, int k, int8_t* aq, float* ad, float* as16,
                                   float* as32, int nthreads);
LP_EXPORT int LP_FN(qmm)(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, int bs,
                         int is_signed, const int8_t* aq, const float* ad, const float* as16, const float* as32,
                         int n, float* y, int nthreads);
LP_EXPORT int LP_FN(qmm_f32)(const float* x, int64_t ldx, int n, int k, const uint8_t* qw, const float* sc,
                             const float* bias, float off, int d, int bs, int is_signed, float* y, int nthreads);

// qmm16.cpp: int16 activations (qmm16.h; the amx library: tiles by a byte split, qmm_amx.h)
LP_EXPORT void LP_FN(quantize_act16)(const float* x, int64_t ldx, int n, int k, int16_t* aq, float* ad,
                                     float* as16, float* as32, int nthreads);
LP_EXPORT int LP_FN(qmm16)(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, int bs,
                           int is_signed, const int16_t* aq, const float* ad, const float* as16, const float* as32,
                           int n, float* y, int nthreads);
LP_EXPORT int LP_FN(qmm16_f32)(const float* x, int64_t ldx, int n, int k, const uint8_t* qw, const float* sc,
                               const float* bias, float off, int d, int bs, int is_signed, float* y, int nthreads);
// qmm16.cpp: y (n, d), row stride ldy, the int8-activation results of the same weight for x (n, k):
// each row's K (<= 128) largest entries replaced by the int16 kernel's values for them
LP_EXPORT int LP_FN(qmm16_rescore)(const float* x, int64_t ldx, int n, int k, const uint8_t* qw, const float* sc,
                                   const float* bias, float off, int d, int bs, int is_signed, int K, float* y,
                                   int64_t ldy, int nthreads);

// norm.cpp: RMS norm rows, the sum of squares in double in a fixed order
LP_EXPORT void LP_FN(rms_norm)(const float* x, int64_t ldx, const float* w, int n, int d, float eps, float* y,
                               int64_t ldy, int64_t min_parallel, int nthreads);

// lora.cpp: gathered multi-LoRA (BGMV), f32
LP_EXPORT int LP_FN(lora_bgmv)(const float* x, int64_t ldx, int n, int k, const float* a, const float* bt, int R,
                               int d, const int32_t* rank, const float* factor, const int32_t* pair_slot,
                               const float* pair_scale, const int32_t* row_ptr, float* y, int64_t ldy,
                               int nthreads);

// attn.cpp: decode attention over the KV cache, read in place
LP_EXPORT int LP_FN(attn_decode)(const float* q, int64_t q_ld, const void* k, const void* v, int dtype, int64_t ks0,
                                 int64_t ks1, int64_t ks2, int64_t vs0, int64_t vs1, int64_t vs2,
                                 const int64_t* cache_rows, const int64_t* pos, int B, int H, int Hkv, int dk, int dv,
                                 float kq_scale, float softcap, int n_swa, int head_block, int64_t min_parallel_work,
                                 float* out, int nthreads);

// sample.cpp: fused max / log-sum-exp / top-k of logits rows
LP_EXPORT int LP_FN(logits_summary)(const float* x, int64_t ldx, const int64_t* rows, int n, int v, int k, float* mx,
                                    float* logsum, int32_t* top_ids, float* top_vals, int nthreads);

// layer.cpp: one decoder layer of a ubatch in one call (descriptors in layer.h)
LP_EXPORT int LP_FN(layer_forward)(const LpLayer* L, float* x, int n, const int64_t* cache_rows, const int64_t* pos,
                                   const float* cos_t, const float* sin_t, const LpPairs* pairs, int nthreads);
// sizes[0..4] = sizeof LpMatmul, LpLora, LpProj, LpPairs, LpLayer (the ctypes mirror checks them)
LP_EXPORT void LP_FN(layer_abi)(int64_t* sizes);

// threadpool.cpp: the threading backend of lp::parallel_for
LP_EXPORT void LP_FN(threads_config)(int backend, int spin_us, int backoff_ms, int burst_us);
LP_EXPORT int LP_FN(pool_size)(void);

#if defined(LP_AMX)
// qmm.cpp (amx library): arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) -> 0 or errno
LP_EXPORT int LP_FN(request_tile_perm)(void);
// qmmbf16.cpp (amx library): y (n, d) = bf16(x) @ W.T on AMX-BF16 tiles, unsigned bs-32 weights
LP_EXPORT int LP_FN(qmmbf16_f32)(const float* x, int64_t ldx, int n, int k, const uint8_t* qw, const float* sc,
                                 const float* bias, float off, int d, int bs, int is_signed, float* y, int nthreads);
#endif
