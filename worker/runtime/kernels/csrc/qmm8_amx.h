// int8-activation matmul on AMX tiles (Intel AMX-TILE + AMX-INT8: Sapphire Rapids and later):
// the Amx8 tiles for gemm_amx (qmm_amx.h), included by qmm.cpp in the `amx` library.  Same
// inputs, outputs and activation quantization as the int8 vnni kernel (qmm8.h, llama.cpp's
// quantize_row_q8_0 per row and per 32), and the same float
// results bit for bit: every block's integer dot product is exact in both kernels, and the
// f32 accumulation below repeats the vpdpbusd tile's operations in the same order
//   acc = fma(float(isum), s * d_a, acc);  acc = fma(c, d_a * sum(a_q), acc)      per block
// (Q8_0, MODE 1: the first only; its isum is the exact signed sum(v * a_q)).
// Hence rows below amx_min_rows(BS) can run the vpdpbusd kernel (qmm8.h gemm_vnni) and the rest
// AMX without a row's result depending on the batch.
//
// Why the packed weights need no repacking: a block of the interleaved form is BS/4 lines of
// 64 bytes, line c = 16 output rows x 4 consecutive k — exactly the "B" operand layout of
// TDPB*D (K/4 rows of N=16 dwords, each dword 4 k values).  So per 16-row weight group g,
// 16 activation rows i0.. and block b:
//   A tile (tmm4/5): 16 rows x BS bytes of int8 activations, stride k      (row-major x_q)
//   B tile (tmm6/7): BS/4 rows x 64 bytes of weights, stride 64            (qw[g, b])
//   C tile (tmm0/1): 16 x 16 int32 = sum_j a_q[i, j] * w[r, j] over the block
// TDPBSUD (signed A x unsigned B) for the unsigned types.  Q8_0's signed weights: TDPBSSD,
// C = sum v a_q — the integer the vpdpbusd kernel forms as sum (v ^ 0x80) a_q - 128 sum a_q.
// Each block needs its own C tile (the scales change per block): the tile is stored to a
// 1 KiB buffer and its 16 rows scaled into 16 zmm accumulators, which is where most of the
// time goes (see the README's measurements).  Blocks go in pairs (tmm0/tmm1), software
// pipelined: the tile unit works on pair p while pair p-1 is scaled.
#pragma once

#include "qmm8.h"
#include "qmm_amx.h"

namespace {

// A tile always does the work of 16 rows, and costs about what 11 (bs 32) to 14 (bs 16) rows
// cost in the vpdpbusd kernel (measured, see the README): fewer rows than this (a small call,
// or the n % 16 rows after the whole tiles) go to the vpdpbusd kernel, more to a tile (the
// last one zero-padded).  Both give the same bits, so this is a speed choice only.
constexpr int amx_min_rows(int bs) { return bs == 32 ? 12 : 14; }

// Per tile of 16 activation rows, the rows' scales transposed so that block b's 16 values are
// contiguous: dT (nb32, 16) = d_a, sT (nb, 16) = d_a * sum(a_q) per BS (zero for pad rows).
// Scale one stored C tile (16 rows x 16 int32, row t at cb + 16 t) of block b into acc[16]:
// the vpdpbusd tile's per-block float operations, in its order (qmm8.h tile).
template <int BS, int MODE>
inline void scale_block(const int32_t* cb, const float* S, const float* C, float off, int b, const float* dT,
                        const float* sT, __m512* acc) {
  const __m512 s = _mm512_loadu_ps(S + b * R);
  const __m512 c = MODE == 0 ? _mm512_loadu_ps(C + b * R) : _mm512_mul_ps(s, _mm512_set1_ps(off));
  const float* da = dT + ((b * BS) / 32) * 16;
  const float* sa = sT + b * 16;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const __m512i isum = _mm512_load_si512((const void*)(cb + 16 * t));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, _mm512_set1_ps(da[t])), acc[t]);
    if (MODE != 1) acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(sa[t]), acc[t]);
  }
}

// C tile `ct` = the block product of A (16 activation rows at q, stride k) and B (weights wb).
#define LP_AMX_BLOCK(ct, at, bt, q, k, wb)                  \
  do {                                                      \
    _tile_loadd(at, q, k);                                  \
    _tile_loadd(bt, wb, 64);                                \
    _tile_zero(ct);                                         \
    if (MODE == 1) {                                        \
      _tile_dpbssd(ct, at, bt);                             \
    } else {                                                \
      _tile_dpbsud(ct, at, bt);                             \
    }                                                       \
  } while (0)

// y rows 0 .. mrows-1 (mrows <= 16) of one tile of 16 activation rows (q: 16 rows of k bytes,
// all readable; dT/sT its transposed scales) x the nvalid rows of one weight group.
template <int BS, int MODE>
void rows16(const uint8_t* W, const float* S, const float* C, float off, int nb, const int8_t* q, long k,
            const float* dT, const float* sT, int mrows, float* y, int64_t ldy, int nvalid,
            int32_t* cbuf /* 4 x 256 */, bool stream) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  // Software pipeline over pairs of blocks: pair p's tile products are issued, then pair
  // p-1 (stored to the other half of cbuf an iteration earlier) is scaled while the tile unit
  // works, and only then pair p is stored (its tilestored waits for the products; vector
  // loads issued after a pending tile store wait for it too, so the scaling must come first).
  // Blocks are still scaled in order 0, 1, 2, ... (the f32 sum's order).
  const int npairs = nb / 2;
  for (int p = 0; p < npairs; ++p) {
    const int b = 2 * p;
    lp::prefetch_weights(W, S, b, BS * R, 2, stream);
    LP_AMX_BLOCK(0, 4, 6, q + b * BS, k, W + (int64_t)b * BS * R);
    LP_AMX_BLOCK(1, 5, 7, q + (b + 1) * BS, k, W + (int64_t)(b + 1) * BS * R);
    if (p > 0) {
      const int32_t* cq = cbuf + ((p - 1) & 1) * 512;
      scale_block<BS, MODE>(cq, S, C, off, b - 2, dT, sT, acc);
      scale_block<BS, MODE>(cq + 256, S, C, off, b - 1, dT, sT, acc);
    }
    int32_t* cp = cbuf + (p & 1) * 512;
    LP_TILE_STORED(0, cp);
    LP_TILE_STORED(1, cp + 256);
  }
  if (nb & 1) {
    const int b = nb - 1;
    LP_AMX_BLOCK(0, 4, 6, q + b * BS, k, W + (int64_t)b * BS * R);
  }
  if (npairs > 0) {
    const int32_t* cq = cbuf + ((npairs - 1) & 1) * 512;
    scale_block<BS, MODE>(cq, S, C, off, 2 * npairs - 2, dT, sT, acc);
    scale_block<BS, MODE>(cq + 256, S, C, off, 2 * npairs - 1, dT, sT, acc);
  }
  if (nb & 1) {
    LP_TILE_STORED(0, cbuf);
    scale_block<BS, MODE>(cbuf, S, C, off, nb - 1, dT, sT, acc);
  }
  const __mmask16 m = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
  for (int t = 0; t < 16; ++t)
    if (t < mrows) _mm512_mask_storeu_ps(y + t * ldy, m, acc[t]);
}
#undef LP_AMX_BLOCK

// The int8 tiles for gemm_amx (the interface: qmm_amx.h).  tmm0, tmm1: C (16 x 16 int32);
// tmm4, tmm5: A (16 x BS int8); tmm6, tmm7: B (BS/4 x 64).
struct Amx8 {
  using Act = ::Act;
  static constexpr bool pays(int) { return true; }
  static constexpr int min_rows(int bs) { return amx_min_rows(bs); }
  static constexpr float kSumScale = 1.0f;
  static constexpr int kCbuf = 4 * 256;  // two pairs of stored C tiles
  template <int BS, int MODE, class... Args>
  static void vnni(const Args&... args) {
    gemm_vnni<BS, MODE>(args...);
  }
  // Whole tiles are read in place from the activations; only the padded tail tile is copied.
  static size_t input_bytes(int, int mtail, int k) { return mtail ? (size_t)16 * k : 0; }
  template <int BS>
  static void stage(int8_t* in, const Act& a, int nfull, int mtail, int) {
    if (mtail) memcpy(in, a.q + (int64_t)nfull * 16 * a.k, (size_t)mtail * a.k);
  }
  template <int BS>
  static const int8_t* input(const int8_t* in, const Act& a, int it, int nfull, int) {
    return it < nfull ? a.q + (int64_t)it * 16 * a.k : in;
  }
  template <int BS, int MODE>
  static void configure() {
    load_tile_config(0x3, 0x30, 0xC0, BS);  // C: tmm0, 1; A: tmm4, 5; B: tmm6, 7
  }
  template <int BS, int MODE>
  static void rows(const uint8_t* W, const float* S, const float* C, float off, int nb, const int8_t* q, long k,
                   const float* dT, const float* sT, int mrows, float* y, int64_t ldy, int nvalid, int32_t* cbuf,
                   bool stream) {
    rows16<BS, MODE>(W, S, C, off, nb, q, k, dT, sT, mrows, y, ldy, nvalid, cbuf, stream);
  }
};

}  // namespace
