// The int8-activation kernel of qmm.cpp in every library (the amx library runs it for the rows
// AMX tiles do not pay off on, qmm8_amx.h): the activation
// quantizer (llama.cpp's quantize_row_q8_0 per row and per 32), the Act struct and the
// vpdpbusd / vpmaddubsw tiles with their gemm_vnni driver.  Weight form and the rule: see the
// comment at the top of qmm.cpp.  Everything is in an anonymous namespace (one copy per
// library, never bound across ISAs).
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

// ---- activation quantization (per row, per 32; ggml-quants.c quantize_row_q8_0) ----------
// int8 a_q in -127..127 (lp::quantize_rows_by32 says what each output holds).
void quantize_rows(const float* x, int64_t ldx, int n, int k, int8_t* aq, float* ad, float* as16, float* as32,
                   int nthreads) {
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  lp::quantize_rows_by32<127>(x, ldx, n, k, aq, ad, as16, as32, nthreads, [&](const __m256i* q, int8_t* dst) {
    const __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
    _mm256_storeu_si256((__m256i*)dst, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), perm));
  });
}

struct Act {                      // quantized activations of one call
  const int8_t* q;                // (n, k)
  const float* d;                 // (n, k/32)
  const float* s16;               // (n, k/16)
  const float* s32;               // (n, k/32)
  int k;
  const int32_t* qsum = nullptr;  // (n, k/32) sum of a_q per 32: Q8_0's exact product (MODE 1); else unused
  // the activations from row r0 on
  Act from_row(int64_t r0) const {
    return {q + r0 * k, d + r0 * (k / 32), s16 + r0 * (k / 16), s32 + r0 * (k / 32), k,
            qsum ? qsum + r0 * (k / 32) : nullptr};
  }
};

#if defined(LP_AVX512)
// ---- AVX-512 VNNI: vpdpbusd (u8 x s8 -> s32), one zmm = 16 weight rows x 4 bytes ---------
// MODE 0: unsigned u with a stored bias c.  MODE 2: unsigned u with c = off * s (symmetric
// types: Q4_0, Q5_0, Q6_K; nothing stored).  MODE 1: SIGNED v (Q8_0): u = v ^ 0x80 = v + 128
// on the fly, and the integer sum(u * a_q) - 128 * sum(a_q) (Act::qsum) is the exact
// sum(v * a_q), scaled once (acc = fma(float(isum), s * d_a, acc), no bias term): the integer
// and the operation the AMX tile (TDPBSSD) and the AVX2 sign trick form too.
template <int NX, int BS, int MODE>
inline void tile(const uint8_t* W, const float* S, const float* C, float off, int nb, const Act& a,
                 int i0, float* y, int64_t ldy, int nvalid) {
  __m512 acc[NX];
  for (int t = 0; t < NX; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i x80 = _mm512_set1_epi8((char)0x80);
  const int nb32 = a.k / 32, nb16 = a.k / 16;
  for (int b = 0; b < nb; ++b) {
    if (i0 == 0) lp::prefetch_weights(W, S, b, BS * R, 1, true);  // the group's first tile streams it
    const uint8_t* wb = W + (int64_t)b * BS * R;
    __m512i ia[NX];
    for (int t = 0; t < NX; ++t) ia[t] = _mm512_setzero_si512();
    const int8_t* ab = a.q + (int64_t)i0 * a.k + b * BS;
#pragma GCC unroll 8
    for (int c = 0; c < BS / 4; ++c) {
      __m512i w = _mm512_loadu_si512((const void*)(wb + c * 64));
      if (MODE == 1) w = _mm512_xor_si512(w, x80);
      for (int t = 0; t < NX; ++t) {
        int32_t a4;
        memcpy(&a4, ab + (int64_t)t * a.k + c * 4, 4);
        ia[t] = _mm512_dpbusd_epi32(ia[t], w, _mm512_set1_epi32(a4));
      }
    }
    const __m512 s = _mm512_loadu_ps(S + b * R);
    const __m512 cb = MODE == 0 ? _mm512_loadu_ps(C + b * R) : _mm512_mul_ps(s, _mm512_set1_ps(off));
    for (int t = 0; t < NX; ++t) {
      const int64_t row = i0 + t;
      const float da = a.d[row * nb32 + (b * BS) / 32];
      if (MODE == 1) ia[t] = _mm512_sub_epi32(ia[t], _mm512_set1_epi32(128 * a.qsum[row * nb32 + b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), _mm512_mul_ps(s, _mm512_set1_ps(da)), acc[t]);
      if (MODE != 1) {
        const float sa = BS == 32 ? a.s32[row * nb32 + b] : a.s16[row * nb16 + b];
        acc[t] = _mm512_fmadd_ps(cb, _mm512_set1_ps(sa), acc[t]);
      }
    }
  }
  const __mmask16 m = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
  for (int t = 0; t < NX; ++t) _mm512_mask_storeu_ps(y + (int64_t)(i0 + t) * ldy, m, acc[t]);
}
#else
// ---- AVX2: maddubs (u8 x s8 -> s16 pairs) + madd(ones) -> s32; two ymm halves of 8 rows ----
// Unsigned types have u <= 63, so a pair sum is at most 2*63*127 = 16002: no saturation.
// MODE 0 / 2 (stored / implicit bias) as in the AVX-512 variant.
// MODE 1 (Q8_0, signed v in -128..127): llama.cpp's sign trick, |v| x sign(a, v), max pair
// 2*128*127 = 32512 < 32767.
inline __m256i dot4(__m256i w_u, __m256i a_s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_u, a_s), _mm256_set1_epi16(1));
}

template <int NX, int BS, int MODE>
inline void tile(const uint8_t* W, const float* S, const float* C, float off, int nb, const Act& a,
                 int i0, float* y, int64_t ldy, int nvalid) {
  const int nb32 = a.k / 32, nb16 = a.k / 16;
  for (int h = 0; h < 2; ++h) {
    if (h * 8 >= nvalid) break;
    __m256 acc[NX];
    for (int t = 0; t < NX; ++t) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      if (i0 == 0 && h == 0) lp::prefetch_weights(W, S, b, BS * R, 1, true);  // the group's first pass streams it
      const uint8_t* wb = W + (int64_t)b * BS * R + h * 32;
      __m256i ia[NX];
      for (int t = 0; t < NX; ++t) ia[t] = _mm256_setzero_si256();
      const int8_t* ab = a.q + (int64_t)i0 * a.k + b * BS;
#pragma GCC unroll 8
      for (int c = 0; c < BS / 4; ++c) {  // BS/4 is even: MODE 0 takes chunks in pairs
        const __m256i w = _mm256_loadu_si256((const __m256i*)(wb + c * 64));
        if (MODE == 1) {
          const __m256i wa = _mm256_sign_epi8(w, w);  // |v| (-128 -> 128 as u8)
          for (int t = 0; t < NX; ++t) {
            int32_t a4;
            memcpy(&a4, ab + (int64_t)t * a.k + c * 4, 4);
            ia[t] = _mm256_add_epi32(ia[t], dot4(wa, _mm256_sign_epi8(_mm256_set1_epi32(a4), w)));
          }
        } else {
          // u <= 63: two maddubs results add in int16 without overflow (2 * 16002 < 32767),
          // so widen once per pair of chunks (one vpmaddwd fewer per pair).
          const __m256i w2 = _mm256_loadu_si256((const __m256i*)(wb + (c + 1) * 64));
          for (int t = 0; t < NX; ++t) {
            int32_t a4, b4;
            memcpy(&a4, ab + (int64_t)t * a.k + c * 4, 4);
            memcpy(&b4, ab + (int64_t)t * a.k + c * 4 + 4, 4);
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(a4)),
                                               _mm256_maddubs_epi16(w2, _mm256_set1_epi32(b4)));
            ia[t] = _mm256_add_epi32(ia[t], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
          }
          ++c;  // consumed chunk c + 1
        }
      }
      const __m256 s = _mm256_loadu_ps(S + b * R + h * 8);
      const __m256 cb = MODE == 0 ? _mm256_loadu_ps(C + b * R + h * 8) : _mm256_mul_ps(s, _mm256_set1_ps(off));
      for (int t = 0; t < NX; ++t) {
        const int64_t row = i0 + t;
        const float da = a.d[row * nb32 + (b * BS) / 32];
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t]), _mm256_mul_ps(s, _mm256_set1_ps(da)), acc[t]);
        if (MODE != 1) {
          const float sa = BS == 32 ? a.s32[row * nb32 + b] : a.s16[row * nb16 + b];
          acc[t] = _mm256_fmadd_ps(cb, _mm256_set1_ps(sa), acc[t]);
        }
      }
    }
    const int nv = nvalid - h * 8;
    for (int t = 0; t < NX; ++t) {
      float* yp = y + (int64_t)(i0 + t) * ldy + h * 8;
      if (nv >= 8) {
        _mm256_storeu_ps(yp, acc[t]);
      } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, acc[t]);
        for (int r = 0; r < nv; ++r) yp[r] = tmp[r];
      }
    }
  }
}
#endif

#if defined(LP_AVX512)
constexpr int NXMAX = 8;   // 8 independent vpdpbusd chains cover its 5-cycle latency
#else
constexpr int NXMAX = 3;
#endif

template <int BS, int MODE>
void gemm_vnni(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, const Act& a,
               int n, float* y, int nthreads) {
  const int nb = k / BS;
  lp::for_each_group(qw, sc, bias, d, k, BS, y, nthreads, [&](auto W, auto S, auto C, int nvalid, float* yg) {
    // NXMAX rows at a time, then a tile of 4 (the avx512 kernel), then 3, 2 or 1 for the rest
    lp::tile_rows<NXMAX, 4, 3, 2, 1>(n, [&](auto nx, int i0) {
      tile<decltype(nx)::value, BS, MODE>(W, S, C, off, nb, a, i0, yg, d, nvalid);
    });
  });
}

}  // namespace
