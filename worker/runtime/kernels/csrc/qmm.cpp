// Quantized matmul kernels for loraplane: y = x @ W.T with W in the "interleaved int8" form
// built by worker/runtime/kernels/pack.py.  Plain C ABI (called through ctypes), no torch
// headers, so the build takes seconds.
//
// This one file is compiled twice, once per instruction set, into two shared libraries:
//   -DLP_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512vnni ...  -> liblp_avx512.so
//   -mavx2 -mfma -mf16c                                            -> liblp_avx2.so
// Python picks one at run time from the CPU's flags; the AVX2 library never contains an
// AVX-512 instruction, so it runs on an AVX2-only CPU.  Everything except the exported
// functions is in an anonymous namespace and the libraries are built -fvisibility=hidden, so
// no inline function compiled for one ISA can be bound to a caller of the other.
//
// Weight form (torch order; symbols: d = output rows, k = input width, BS = block 16 or 32,
// nb = k / BS, G = ceil(d / 16) groups of R = 16 rows):
//   qw    uint8  (G, nb, BS/4, R, 4)  element j of block b of row g*16+r lives at
//                                     qw[g, b, j/4, r, j%4]; value u (0..63) for the
//                                     unsigned types, a signed int8 v for Q8_0 (SIGNED)
//   scale f32    (G, nb, R)           s
//   bias  f32    (G, nb, R)           c, stored only for Q4_K/Q5_K/Q4_1/Q5_1; the symmetric
//                                     types have c = off * s (off = -8, -16, -32)
//   W[row, b*BS + j] = s * u + c        (unsigned types)
//   W[row, b*BS + j] = s * v            (SIGNED: Q8_0)
// Activations are quantized per row and per block of 32 like llama.cpp's quantize_row_q8_0
// (ggml/src/ggml-quants.c): d_a = amax/127, a_q = round(x / d_a) in -127..127.  Then per
// weight block  sum_j W*x ~= s*d_a*sum(u*a_q) + c*d_a*sum(a_q): integer dot products as in
// ggml-cpu/arch/x86/quants.c ggml_vec_dot_q8_0_q8_0 / ggml_vec_dot_q4_K_q8_K, but with the
// activation scale per 32 (llama.cpp's q8_K uses one per 256) and 16 weight rows per vector
// as in ggml-cpu/repack.cpp's interleaved layouts, so no horizontal sums are needed.
//
// The quantizer and the tiles live in qmm8.h (shared with qmm_amx.cpp); this file holds the
// exports of the avx2 and avx512 libraries.
#include "qmm8.h"

namespace {
// The name LP_DEFINE_QMM calls.
template <int BS, int MODE, class... Args>
inline void gemm(const Args&... args) {
  gemm_vnni<BS, MODE>(args...);
}
}  // namespace

// Quantize x (n, k) f32 (row stride ldx) into the caller's buffers (see quantize_rows).
LP_EXPORT void LP_FN(quantize_act)(const float* x, int64_t ldx, int n, int k, int8_t* aq,
                                   float* ad, float* as16, float* as32, int nthreads) {
  quantize_rows(x, ldx, n, k, aq, ad, as16, as32, nthreads);
}

LP_DEFINE_QMM(qmm, Act, int8_t, quantize_rows)
