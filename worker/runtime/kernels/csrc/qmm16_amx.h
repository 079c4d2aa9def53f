// int16-activation matmul on AMX tiles (AMX-TILE + AMX-INT8): the Amx16 tiles for gemm_amx
// (qmm_amx.h), included by qmm16.cpp in the `amx` library.  Same inputs and outputs as the avx512
// int16 kernel (qmm16.h) (quantize_rows16: int16 per row and per 32) and the same f32 results bit
// for bit.
//
// AMX has no int16 product, so each activation q (|q| <= 32767) is split into bytes:
//   q = 256 * hi + lo,   hi = q >> 8 (arithmetic: signed int8),   lo = q & 0xFF (unsigned)
// and sum q*w = 256 * sum hi*w + sum lo*w exactly.  AMX-INT8 has every sign pair: unsigned
// weights u: TDPBSUD (hi signed x u) + TDPBUUD (lo x u); Q8_0's signed v: TDPBSSD + TDPBUSD.
// Two A planes per block (hi, lo), two C tiles, and per block and output row
// isum = (C_hi << 8) + C_lo in int32 (|isum| < 32 * 32768 * 255 < 2^28: exact) — the very
// integer the avx512 kernel folds its pair-layout vpdpwssd lanes into.  The f32 operations then
// repeat that kernel's element by element (acc = fma(float(isum), s * d_a, acc);
// acc = fma(c, d_a * sum(q), acc)), so the rows below amx16_min_rows run it (gemm_vnni16) without
// a row's result depending on the batch.
//
// Weights: the packed block is already the VNNI "B" layout (see qmm8_amx.h).  Tiles:
//   tmm0..3 C (hi and lo of two blocks), tmm4/5 A (hi, lo: 16 rows x BS bytes), tmm6 B
//   (BS/4 x 64 bytes).  Blocks go in pairs; one pair in flight: the tile unit works on pair p
//   while pair p-1's four stored C tiles are scaled.
#pragma once

#include "qmm16.h"
#include "qmm_amx.h"

namespace {

// Where tiles pay (measured, README "AMX": bench.kernels --amx, avx512 vpdpwssd vs tiles, one
// process): two tile products and two tile stores per block where the int8 kernel needs one.  For
// bs 32 a zero-padded tile of 12 rows matches 12 vpdpwssd rows (0.98-1.46x), at 8 it loses
// (0.74x), from 16 it wins (1.26-1.49x); bs 16 (Q6_K) tiles lose at every size (0.78-0.98x: a
// 16-byte tile row does a quarter of a product's work), so Q6_K runs gemm_vnni16 throughout.
// Fewer rows than amx16_min_rows (a small call, or the n % 16 rows after the whole tiles) run
// gemm_vnni16.  Same bits either way: a speed choice only (tested bit-identical on tiles for bs 16
// as well, with pays forced).
constexpr bool amx16_pays(int bs) { return bs == 32; }
constexpr int amx16_min_rows(int bs) { return bs == 32 ? 12 : 16; }

// Block product into C tiles ch (hi) and cl (lo): the two planes at ab (hi, lo, each 16 x BS
// bytes, contiguous) against the weight block wb.
#define LP_AMX16_BLOCK(ch, cl, ab, wb) \
  do {                                 \
    _tile_loadd(6, wb, 64);            \
    _tile_loadd(4, ab, BS);            \
    _tile_loadd(5, (ab) + 16 * BS, BS); \
    _tile_zero(ch);                    \
    _tile_zero(cl);                    \
    if (MODE == 1) {                   \
      _tile_dpbssd(ch, 4, 6);          \
      _tile_dpbusd(cl, 5, 6);          \
    } else {                           \
      _tile_dpbsud(ch, 4, 6);          \
      _tile_dpbuud(cl, 5, 6);          \
    }                                  \
  } while (0)

// Scale block b's two stored C tiles (cb: hi, lo, 256 int32 each) into the accumulators:
// qmm16.h tile's per-block f32 operations, element by element.
// dT (nb32, 16) = d_a and hT (nb, 16) = d_a * sum(q) per BS, transposed per row tile.
template <int BS, int MODE>
inline void scale_block16(const int32_t* cb, const float* S, const float* C, float off, int b, const float* dT,
                          const float* hT, __m512* acc) {
  const __m512 s = _mm512_loadu_ps(S + b * R);
  __m512 c = _mm512_setzero_ps();
  if (MODE == 0) c = _mm512_loadu_ps(C + b * R);
  if (MODE == 2) c = _mm512_mul_ps(s, _mm512_set1_ps(off));
  const float* da = dT + ((b * BS) / 32) * 16;
  const float* ha = hT + b * 16;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void*)(cb + 16 * t)), 8),
                                         _mm512_load_si512((const void*)(cb + 256 + 16 * t)));
    const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(da[t]));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, acc[t]);
    if (MODE != 1) acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(ha[t]), acc[t]);
  }
}

// y rows 0 .. mrows-1 of one tile of 16 activation rows (planes: nb blocks x 2 x 16 x BS bytes)
// x the nvalid rows of one weight group.
template <int BS, int MODE>
void rows16x16(const uint8_t* W, const float* S, const float* C, float off, int nb, const int8_t* planes,
               const float* dT, const float* hT, int mrows, float* y, int64_t ldy, int nvalid,
               int32_t* cbuf /* 2 x 1024 */, bool stream) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  const int np = (nb + 1) / 2;  // block pairs (the last one may hold one block)
  for (int p = 0; p < np; ++p) {
    const int b = 2 * p;
    const int8_t* ab = planes + (int64_t)b * 32 * BS;
    lp::prefetch_weights(W, S, b, BS * R, 2, stream);
    LP_AMX16_BLOCK(0, 1, ab, W + (int64_t)b * BS * R);
    if (b + 1 < nb) LP_AMX16_BLOCK(2, 3, ab + 32 * BS, W + (int64_t)(b + 1) * BS * R);
    if (p > 0) {
      const int32_t* prev = cbuf + ((p - 1) & 1) * 1024;
      scale_block16<BS, MODE>(prev, S, C, off, b - 2, dT, hT, acc);
      scale_block16<BS, MODE>(prev + 512, S, C, off, b - 1, dT, hT, acc);
    }
    int32_t* cp = cbuf + (p & 1) * 1024;
    LP_TILE_STORED(0, cp);
    LP_TILE_STORED(1, cp + 256);
    if (b + 1 < nb) {
      LP_TILE_STORED(2, cp + 512);
      LP_TILE_STORED(3, cp + 768);
    }
  }
  {
    const int b = 2 * (np - 1);
    const int32_t* last = cbuf + ((np - 1) & 1) * 1024;
    scale_block16<BS, MODE>(last, S, C, off, b, dT, hT, acc);
    if (b + 1 < nb) scale_block16<BS, MODE>(last + 512, S, C, off, b + 1, dT, hT, acc);
  }
  const __mmask16 m = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
  for (int t = 0; t < 16; ++t)
    if (t < mrows) _mm512_mask_storeu_ps(y + t * ldy, m, acc[t]);
}
#undef LP_AMX16_BLOCK

// The int16 tiles for gemm_amx (the interface: qmm_amx.h).  tmm0..3: C (hi, lo of two blocks);
// tmm4, 5: A (hi, lo: 16 rows x BS bytes); tmm6: B (BS/4 x 64 bytes).
struct Amx16 {
  using Act = Act16;
  static constexpr bool pays(int bs) { return amx16_pays(bs); }
  static constexpr int min_rows(int bs) { return amx16_min_rows(bs); }
  static constexpr float kSumScale = 1.0f;  // one lane per row takes the whole c * d * sum(q)
  static constexpr int kCbuf = 2 * 1024;    // two block pairs' four stored C tiles
  template <int BS, int MODE, class... Args>
  static void vnni(const Args&... args) {
    gemm_vnni16<BS, MODE>(args...);
  }
  // Every tile's activations split into the two byte planes: nb blocks x 2 x 16 rows x BS bytes.
  static size_t input_bytes(int ntiles, int, int k) { return (size_t)ntiles * 32 * k; }
  template <int BS>
  static void stage(int8_t* planes, const Act16& a, int nfull, int mtail, int nb) {
    const __m256i lomask = _mm256_set1_epi16(0xFF);
    for (int i = 0; i < nfull * 16 + mtail; ++i) {
      const int tile = i / 16, t = i % 16;
      const int16_t* qr = a.q + (int64_t)i * a.k;
      for (int b = 0; b < nb; ++b) {
        int8_t* pb = planes + ((size_t)tile * nb + b) * 32 * BS + t * BS;
        for (int j = 0; j < BS; j += 16) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(qr + b * BS + j));
          _mm_storeu_si128((__m128i*)(pb + j), _mm256_cvtepi16_epi8(_mm256_srai_epi16(v, 8)));
          _mm_storeu_si128((__m128i*)(pb + 16 * BS + j), _mm256_cvtepi16_epi8(_mm256_and_si256(v, lomask)));
        }
      }
    }
  }
  template <int BS>
  static const int8_t* input(const int8_t* planes, const Act16&, int it, int, int nb) {
    return planes + (size_t)it * nb * 32 * BS;
  }
  template <int BS, int MODE>
  static void configure() {
    load_tile_config(0x0F, 0x30, 0x40, BS);  // C: tmm0..3; A: tmm4, 5; B: tmm6
  }
  template <int BS, int MODE>
  static void rows(const uint8_t* W, const float* S, const float* C, float off, int nb, const int8_t* planes, long,
                   const float* dT, const float* hT, int mrows, float* y, int64_t ldy, int nvalid, int32_t* cbuf,
                   bool stream) {
    rows16x16<BS, MODE>(W, S, C, off, nb, planes, dT, hT, mrows, y, ldy, nvalid, cbuf, stream);
  }
};

}  // namespace
