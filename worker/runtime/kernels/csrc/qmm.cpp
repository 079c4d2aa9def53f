// Quantized matmul kernels for loraplane: y = x @ W.T with W in the "interleaved int8" form
// built by worker/runtime/kernels/repack.py.  Plain C ABI (called through ctypes), no torch
// headers, so the build takes seconds.
//
// Compiled into every ISA's library with that ISA's flags (worker/runtime/kernels/build.py):
// the avx2 and avx512 libraries multiply with qmm8.h's vpmaddubsw / vpdpbusd tiles, the amx
// library with AMX tiles (qmm8_amx.h) where a call has enough rows.  Python picks a library at
// run time from the CPU's flags; the AVX2 library never contains an AVX-512 instruction, so it
// runs on an AVX2-only CPU.  Everything except the exported functions is in an anonymous
// namespace and the libraries are built -fvisibility=hidden, so no inline function compiled for
// one ISA can be bound to a caller of the other.
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
// The quantizer and the tiles live in qmm8.h; this file holds the exports.
#include "qmm8.h"

#if defined(LP_AMX)
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "qmm8_amx.h"

namespace {
template <int BS, int MODE, class... Args>
inline void gemm_tiles(const Args&... args) {
  gemm_amx<Amx8, BS, MODE>(args...);
}
}  // namespace

// Ask Linux for the AMX tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
// Linux >= 5.16; the state is then enabled for every thread of the process).  Returns 0 when
// granted, else the errno (EINVAL: kernel too old or no AMX; EPERM/ENOSPC: refused).
LP_EXPORT int LP_FN(request_tile_perm)(void) {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
}

LP_DEFINE_QMM(qmm, quantize_act, Act, int8_t, quantize_rows, gemm_tiles)
#else
LP_DEFINE_QMM(qmm, quantize_act, Act, int8_t, quantize_rows, gemm_vnni)
#endif
