// The int16-activation kernel shared by qmm16.cpp (the avx2 / avx512 libraries) and
// qmm16_amx.h (the amx library, which runs it for the rows AMX tiles do not pay off on):
// the quantizer quantize_rows16, the Act16 struct and the vpdpwssd / vpmaddwd tiles with their
// gemm_vnni16 driver.  Why int16 and the pair layout: see the comment at the top of qmm16.cpp.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "qmm_common.h"

namespace {

using lp::R;
using lp::XCHUNK;

// int16 a_q in -32767..32767, d = amax / 32767 (lp::quantize_rows_by32 says what each output holds).
void quantize_rows16(const float* x, int64_t ldx, int n, int k, int16_t* aq, float* ad, float* as16, float* as32,
                     int nthreads) {
  lp::quantize_rows_by32<32767>(x, ldx, n, k, aq, ad, as16, as32, nthreads, [](const __m256i* q, int16_t* dst) {
    // packs_epi32 interleaves 128-bit lanes; permute 64-bit quarters back into order
    _mm256_storeu_si256((__m256i*)dst, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
    _mm256_storeu_si256((__m256i*)(dst + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
  });
}

struct Act16 {
  const int16_t* q;
  const float* d;
  const float* s16;
  const float* s32;
  int k;
  // the activations from row r0 on
  Act16 from_row(int64_t r0) const {
    return {q + r0 * k, d + r0 * (k / 32), s16 + r0 * (k / 16), s32 + r0 * (k / 32), k};
  }
};

// MODE: 0 stored bias, 1 signed (Q8_0, no bias), 2 implicit bias c = off * s.
#if defined(LP_AVX512)
// AVX-512: per activation row two int32 accumulators in the pair layout (iA: weight rows 0-7,
// iB: rows 8-15, a row's pair sums in lanes 2r and 2r+1).  At a block's end two permutes and an
// add fold them, exactly in int32, to one lane per weight row in order, so the block's float
// work is one vector per activation row: acc = fma(float(dot), s * d_a, acc), then
// acc = fma(c, d_a * sum(a_q), acc) (no second term for Q8_0).  qmm16_amx.h repeats these
// operations on its tiles' integers, so a row's result does not depend on which of the two
// kernels took it.
template <int NX, int BS, int MODE>
inline void tile(const uint8_t* W, const float* S, const float* C, float off, int nb, const Act16& a,
                 int i0, float* y, int64_t ldy, int nvalid) {
  __m512 acc[NX];
  for (int t = 0; t < NX; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  const int nb32 = a.k / 32, nb16 = a.k / 16;
  for (int b = 0; b < nb; ++b) {
    if (i0 == 0) lp::prefetch_weights(W, S, b, BS * R, 1, true);  // the group's first tile streams it
    const uint8_t* wb = W + (int64_t)b * BS * R;
    __m512i iA[NX], iB[NX];
    for (int t = 0; t < NX; ++t) iA[t] = iB[t] = _mm512_setzero_si512();
    const int16_t* ab = a.q + (int64_t)i0 * a.k + b * BS;
#pragma GCC unroll 8
    for (int c = 0; c < BS / 4; ++c) {
      const __m256i lo = _mm256_loadu_si256((const __m256i*)(wb + c * 64));
      const __m256i hi = _mm256_loadu_si256((const __m256i*)(wb + c * 64 + 32));
      const __m512i wA = MODE == 1 ? _mm512_cvtepi8_epi16(lo) : _mm512_cvtepu8_epi16(lo);
      const __m512i wB = MODE == 1 ? _mm512_cvtepi8_epi16(hi) : _mm512_cvtepu8_epi16(hi);
      for (int t = 0; t < NX; ++t) {
        int64_t a8;
        memcpy(&a8, ab + (int64_t)t * a.k + c * 4, 8);
        const __m512i av = _mm512_set1_epi64(a8);
        iA[t] = _mm512_dpwssd_epi32(iA[t], wA, av);
        iB[t] = _mm512_dpwssd_epi32(iB[t], wB, av);
      }
    }
    const __m512 s = _mm512_loadu_ps(S + b * R);
    __m512 cb = _mm512_setzero_ps();
    if (MODE == 0) cb = _mm512_loadu_ps(C + b * R);
    if (MODE == 2) cb = _mm512_mul_ps(s, _mm512_set1_ps(off));
    for (int t = 0; t < NX; ++t) {
      const int64_t row = i0 + t;
      const __m512i dot = _mm512_add_epi32(_mm512_permutex2var_epi32(iA[t], ev, iB[t]),
                                           _mm512_permutex2var_epi32(iA[t], od, iB[t]));
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(a.d[row * nb32 + (b * BS) / 32]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, acc[t]);
      if (MODE != 1) {
        const float sq = BS == 32 ? a.s32[row * nb32 + b] : a.s16[row * nb16 + b];  // d_a * sum(a_q)
        acc[t] = _mm512_fmadd_ps(cb, _mm512_set1_ps(sq), acc[t]);
      }
    }
  }
  const __mmask16 m = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
  for (int t = 0; t < NX; ++t) _mm512_mask_storeu_ps(y + (int64_t)(i0 + t) * ldy, m, acc[t]);
}
constexpr int NXMAX = 4;
#else
// AVX2: per half h of the group (8 weight rows) and activation row, two int32 accumulators in
// the pair layout (iA: rows 0-3, iB: rows 4-7, a row's pair sums in two lanes).  At a block's
// end one vphaddd folds them to one lane per row, in the order [r0 r1 r4 r5 | r2 r3 r6 r7]
// (HADD_ORDER, its own inverse: the block's scales are permuted into it once per block and the
// result back out once per tile), so the block's float work is one vector per row:
// acc += s * (d_a * dot + off * d_a * sum(a_q)) (MODE 2), s * d_a * dot (MODE 1),
// s * d_a * dot + c * d_a * sum(a_q) (MODE 0).  Half the float operations of scaling both
// pair-layout vectors.  With the unroll below: 9.1 -> 11.5 multiply-adds per cycle on one Zen 2
// core (Gemma's ffn_gate, Q4_K, 48 rows; the unroll alone 9.1 -> 11.1).
template <int NX, int BS, int MODE>
inline void tile(const uint8_t* W, const float* S, const float* C, float off, int nb, const Act16& a,
                 int i0, float* y, int64_t ldy, int nvalid) {
  const int nb32 = a.k / 32, nb16 = a.k / 16;
  const __m256i HADD_ORDER = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int h = 0; h < 2; ++h) {
    if (h * 8 >= nvalid) break;
    __m256 acc[NX];
    for (int t = 0; t < NX; ++t) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      if (i0 == 0 && h == 0) lp::prefetch_weights(W, S, b, BS * R, 1, true);  // the group's first pass streams it
      const uint8_t* wb = W + (int64_t)b * BS * R + h * 32;
      __m256i iA[NX], iB[NX];
      for (int t = 0; t < NX; ++t) iA[t] = iB[t] = _mm256_setzero_si256();
      const int16_t* ab = a.q + (int64_t)i0 * a.k + b * BS;
#pragma GCC unroll 2  // 8 (as the AVX-512 tile) made GCC spill accumulators: 9.1 vs 11.1 MAC/cycle
      for (int c = 0; c < BS / 4; ++c) {
        const __m128i lo = _mm_loadu_si128((const __m128i*)(wb + c * 64));
        const __m128i hi = _mm_loadu_si128((const __m128i*)(wb + c * 64 + 16));
        const __m256i wA = MODE == 1 ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
        const __m256i wB = MODE == 1 ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
        for (int t = 0; t < NX; ++t) {
          int64_t a8;
          memcpy(&a8, ab + (int64_t)t * a.k + c * 4, 8);
          const __m256i av = _mm256_set1_epi64x(a8);
          iA[t] = _mm256_add_epi32(iA[t], _mm256_madd_epi16(wA, av));
          iB[t] = _mm256_add_epi32(iB[t], _mm256_madd_epi16(wB, av));
        }
      }
      const __m256 s = _mm256_permutevar8x32_ps(_mm256_loadu_ps(S + b * R + h * 8), HADD_ORDER);
      __m256 cb = _mm256_setzero_ps();
      if (MODE == 0) cb = _mm256_permutevar8x32_ps(_mm256_loadu_ps(C + b * R + h * 8), HADD_ORDER);
      for (int t = 0; t < NX; ++t) {
        const int64_t row = i0 + t;
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_hadd_epi32(iA[t], iB[t]));
        const __m256 da = _mm256_set1_ps(a.d[row * nb32 + (b * BS) / 32]);
        if (MODE == 1) {
          acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dot, da), s, acc[t]);
        } else {
          const float sq = BS == 32 ? a.s32[row * nb32 + b] : a.s16[row * nb16 + b];  // d_a * sum(a_q)
          if (MODE == 2) {
            acc[t] = _mm256_fmadd_ps(_mm256_fmadd_ps(dot, da, _mm256_set1_ps(off * sq)), s, acc[t]);
          } else {
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dot, da), s, _mm256_fmadd_ps(cb, _mm256_set1_ps(sq), acc[t]));
          }
        }
      }
    }
    const int nv = nvalid - h * 8;
    for (int t = 0; t < NX; ++t) {
      const __m256 out = _mm256_permutevar8x32_ps(acc[t], HADD_ORDER);
      float* yp = y + (int64_t)(i0 + t) * ldy + h * 8;
      if (nv >= 8) {
        _mm256_storeu_ps(yp, out);
      } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, out);
        for (int r = 0; r < nv; ++r) yp[r] = tmp[r];
      }
    }
  }
}
constexpr int NXMAX = 4;  // 4 rows x (iA, iB, acc) + the two weight vectors and a broadcast: 15 ymm
#endif

template <int BS, int MODE>
void gemm_vnni16(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, const Act16& a,
                 int n, float* y, int nthreads) {
  const int nb = k / BS;
  lp::for_each_group(qw, sc, bias, d, k, BS, y, nthreads, [&](auto W, auto S, auto C, int nvalid, float* yg) {
    lp::tile_rows<NXMAX, 3, 2, 1>(n, [&](auto nx, int i0) {
      tile<decltype(nx)::value, BS, MODE>(W, S, C, off, nb, a, i0, yg, d, nvalid);
    });
  });
}

}  // namespace
