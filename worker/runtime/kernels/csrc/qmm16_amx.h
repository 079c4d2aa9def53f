// int16-activation matmul on AMX tiles (AMX-TILE + AMX-INT8): the Amx16 tiles for gemm_amx
// (qmm_amx.h), included by qmm16.cpp in the `amx` library.  Same inputs and outputs as the avx512
// int16 kernel (qmm16.h) (quantize_rows16: int16 per
// row and per 32) and the same f32 results bit for bit.
//
// AMX has no int16 product, so each activation q (|q| <= 32767) is split into bytes:
//   q = 256 * hi + lo,   hi = q >> 8 (arithmetic: signed int8),   lo = q & 0xFF (unsigned)
// and sum q*w = 256 * sum hi*w + sum lo*w exactly.  AMX-INT8 has every sign pair: unsigned
// weights u: TDPBSUD (hi signed x u) + TDPBUUD (lo x u); Q8_0's signed v: TDPBSSD + TDPBUSD.
//
// What the avx512 kernel accumulates (qmm16.h tile): per block and output row two int32
// half-sums, lane 2r over the inputs j with j % 4 in {0, 1} (even pair of each 4) and lane
// 2r+1 over j % 4 in {2, 3}, each scaled into its own f32 accumulator
//   acc_h = fma(float(isum_h), s * d_a, acc_h);  acc_h = fma(c, 0.5 * d_a * sum(q), acc_h)
// (no second term for Q8_0), the two added once at the end: y = acc_0 + acc_1.  A tile product
// sums all 4 bytes of a dword, so the halves come from activation copies with the other pair
// zeroed: four A planes per block, hiE / hiO / loE / loO (E: bytes 2, 3 of every 4 zeroed,
// O: bytes 0, 1), four C tiles, and per half isum = (C_hi << 8) + C_lo in int32 (|isum| <
// 16 * 32768 * 255 < 2^27: exact) — the very integers of the vpdpwssd lanes.  The f32 operations
// then repeat the avx512 kernel's element by element (its pair layout only permutes lanes), so
// the rows below amx16_min_rows run that kernel (gemm_vnni16) without a row's result depending
// on the batch.
//
// Weights: the packed block is already the VNNI "B" layout (see qmm8_amx.h).  Tiles:
//   tmm0..3 C (16 x 16 int32: hiE, hiO, loE, loO), tmm4/5/7 A (16 rows x BS bytes), tmm6 B
//   (BS/4 x 64 bytes).  One block in flight: the tile unit works on block b while block b-1's
//   four stored C tiles are scaled.
#pragma once

#include "qmm16.h"
#include "qmm_amx.h"

namespace {

// Where tiles pay (measured, README "AMX"): the split costs 4 tile products and 4 tile stores
// per block where the int8 kernel needs 1, so a tile of 16 rows costs about what 14 vpdpwssd
// rows cost for bs 32 and more than 16 for bs 16 (Q6_K: 0.8x).  bs 16 therefore runs
// gemm_vnni16 throughout, and for bs 32 fewer rows than amx16_min_rows (a small call, or the
// n % 16 rows after the whole tiles) do; more take a tile (the last one zero-padded).  Same
// bits either way: a speed choice only.  (Tested bit-identical on tiles for bs 16 as well.)
constexpr bool amx16_pays(int bs) { return bs == 32; }
constexpr int amx16_min_rows(int bs) { return bs == 32 ? 15 : 16; }

// Block product: the four planes at ab (hiE, hiO, loE, loO, each 16 x BS bytes, contiguous)
// against the weight block wb.
#define LP_AMX16_BLOCK(ab, wb)                  \
  do {                                          \
    _tile_loadd(6, wb, 64);                     \
    _tile_loadd(4, ab, BS);                     \
    _tile_loadd(5, (ab) + 16 * BS, BS);         \
    _tile_loadd(7, (ab) + 32 * BS, BS);         \
    _tile_zero(0);                              \
    _tile_zero(1);                              \
    _tile_zero(2);                              \
    _tile_zero(3);                              \
    if (MODE == 1) {                            \
      _tile_dpbssd(0, 4, 6);                    \
      _tile_dpbssd(1, 5, 6);                    \
      _tile_dpbusd(2, 7, 6);                    \
      _tile_loadd(4, (ab) + 48 * BS, BS);       \
      _tile_dpbusd(3, 4, 6);                    \
    } else {                                    \
      _tile_dpbsud(0, 4, 6);                    \
      _tile_dpbsud(1, 5, 6);                    \
      _tile_dpbuud(2, 7, 6);                    \
      _tile_loadd(4, (ab) + 48 * BS, BS);       \
      _tile_dpbuud(3, 4, 6);                    \
    }                                           \
  } while (0)

// Scale block b's four stored C tiles (cb: hiE, hiO, loE, loO, 256 int32 each) into the even /
// odd half accumulators: qmm16.h tile's per-block f32 operations, element by element.
// dT (nb32, 16) = d_a and hT (nb, 16) = 0.5 * d_a * sum(q) per BS, transposed per row tile.
template <int BS, int MODE>
inline void scale_block16(const int32_t* cb, const float* S, const float* C, float off, int b, const float* dT,
                          const float* hT, __m512* accE, __m512* accO) {
  const __m512 s = _mm512_loadu_ps(S + b * R);
  __m512 c = _mm512_setzero_ps();
  if (MODE == 0) c = _mm512_loadu_ps(C + b * R);
  if (MODE == 2) c = _mm512_mul_ps(s, _mm512_set1_ps(off));
  const float* da = dT + ((b * BS) / 32) * 16;
  const float* ha = hT + b * 16;
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const __m512i e = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void*)(cb + 16 * t)), 8),
                                       _mm512_load_si512((const void*)(cb + 512 + 16 * t)));
    const __m512i o = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void*)(cb + 256 + 16 * t)), 8),
                                       _mm512_load_si512((const void*)(cb + 768 + 16 * t)));
    const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(da[t]));
    accE[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), sd, accE[t]);
    accO[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o), sd, accO[t]);
    if (MODE != 1) {
      const __m512 h = _mm512_set1_ps(ha[t]);
      accE[t] = _mm512_fmadd_ps(c, h, accE[t]);
      accO[t] = _mm512_fmadd_ps(c, h, accO[t]);
    }
  }
}

// y rows 0 .. mrows-1 of one tile of 16 activation rows (planes: nb blocks x 4 x 16 x BS bytes)
// x the nvalid rows of one weight group.
template <int BS, int MODE>
void rows16x16(const uint8_t* W, const float* S, const float* C, float off, int nb, const int8_t* planes,
               const float* dT, const float* hT, int mrows, float* y, int64_t ldy, int nvalid,
               int32_t* cbuf /* 2 x 1024 */) {
  __m512 accE[16], accO[16];
  for (int t = 0; t < 16; ++t) accE[t] = accO[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const int8_t* ab = planes + (int64_t)b * 64 * BS;
    {  // the weights 4 blocks ahead (the next group's first ones at the end): streamed from memory
      const char* pf = (const char*)(W + (int64_t)(b + 4) * BS * R);
      for (int l = 0; l < BS * R; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
    }
    LP_AMX16_BLOCK(ab, W + (int64_t)b * BS * R);
    if (b > 0) scale_block16<BS, MODE>(cbuf + ((b - 1) & 1) * 1024, S, C, off, b - 1, dT, hT, accE, accO);
    int32_t* cp = cbuf + (b & 1) * 1024;
    LP_TILE_STORED(0, cp);
    LP_TILE_STORED(1, cp + 256);
    LP_TILE_STORED(2, cp + 512);
    LP_TILE_STORED(3, cp + 768);
  }
  scale_block16<BS, MODE>(cbuf + ((nb - 1) & 1) * 1024, S, C, off, nb - 1, dT, hT, accE, accO);
  const __mmask16 m = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
  for (int t = 0; t < 16; ++t)
    if (t < mrows) _mm512_mask_storeu_ps(y + t * ldy, m, _mm512_add_ps(accE[t], accO[t]));
}
#undef LP_AMX16_BLOCK

// The int16 tiles for gemm_amx (the interface: qmm_amx.h).  tmm0..3: C (hiE, hiO, loE, loO);
// tmm4, 5, 7: A (16 rows x BS bytes); tmm6: B (BS/4 x 64 bytes).
struct Amx16 {
  using Act = Act16;
  static constexpr bool pays(int bs) { return amx16_pays(bs); }
  static constexpr int min_rows(int bs) { return amx16_min_rows(bs); }
  static constexpr float kSumScale = 0.5f;  // each of a row's two lanes takes half of c * d * sum(q)
  static constexpr int kCbuf = 2 * 1024;     // two blocks' four stored C tiles
  template <int BS, int MODE, class... Args>
  static void vnni(const Args&... args) {
    gemm_vnni16<BS, MODE>(args...);
  }
  // Every tile's activations split into the four byte planes: nb blocks x 4 x 16 rows x BS bytes.
  static size_t input_bytes(int ntiles, int, int k) { return (size_t)ntiles * 64 * k; }
  template <int BS>
  static void stage(int8_t* planes, const Act16& a, int nfull, int mtail, int nb) {
    const __mmask16 even = 0x3333;  // i16 lanes j with j % 4 in {0, 1}
    const __m256i lomask = _mm256_set1_epi16(0xFF);
    for (int i = 0; i < nfull * 16 + mtail; ++i) {
      const int tile = i / 16, t = i % 16;
      const int16_t* qr = a.q + (int64_t)i * a.k;
      for (int b = 0; b < nb; ++b) {
        int8_t* pb = planes + ((size_t)tile * nb + b) * 64 * BS + t * BS;
        for (int j = 0; j < BS; j += 16) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(qr + b * BS + j));
          const __m256i hi = _mm256_srai_epi16(v, 8), lo = _mm256_and_si256(v, lomask);
          _mm_storeu_si128((__m128i*)(pb + j), _mm256_cvtepi16_epi8(_mm256_maskz_mov_epi16(even, hi)));
          _mm_storeu_si128((__m128i*)(pb + 16 * BS + j), _mm256_cvtepi16_epi8(_mm256_maskz_mov_epi16(~even, hi)));
          _mm_storeu_si128((__m128i*)(pb + 32 * BS + j), _mm256_cvtepi16_epi8(_mm256_maskz_mov_epi16(even, lo)));
          _mm_storeu_si128((__m128i*)(pb + 48 * BS + j), _mm256_cvtepi16_epi8(_mm256_maskz_mov_epi16(~even, lo)));
        }
      }
    }
  }
  template <int BS>
  static const int8_t* input(const int8_t* planes, const Act16&, int it, int, int nb) {
    return planes + (size_t)it * nb * 64 * BS;
  }
  template <int BS, int MODE>
  static void configure() {
    load_tile_config(0x0F, 0xB0, 0x40, BS);  // C: tmm0..3; A: tmm4, 5, 7; B: tmm6
  }
  template <int BS, int MODE>
  static void rows(const uint8_t* W, const float* S, const float* C, float off, int nb, const int8_t* planes, long,
                   const float* dT, const float* hT, int mrows, float* y, int64_t ldy, int nvalid, int32_t* cbuf) {
    rows16x16<BS, MODE>(W, S, C, off, nb, planes, dT, hT, mrows, y, ldy, nvalid, cbuf);
  }
};

}  // namespace
