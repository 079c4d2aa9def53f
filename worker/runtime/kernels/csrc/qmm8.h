// The int8-activation kernel shared by qmm.cpp (the avx2 / avx512 libraries) and qmm_amx.cpp
// (the amx library, which runs it for the rows AMX tiles do not pay off on): the activation
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

constexpr int R = 16;        // weight rows per interleaved group
using lp::XCHUNK;

// ---- activation quantization (per row, per 32; ggml-quants.c quantize_row_q8_0) ----------
// x: f32 (n, k) row stride ldx.  aq: int8 (n, k).  ad: f32 (n, k/32) = d_a.
// as16: f32 (n, k/16) = d_a * sum of a_q over each 16.  as32: f32 (n, k/32), same per 32.
void quantize_rows(const float* x, int64_t ldx, int n, int k, int8_t* aq, float* ad,
                   float* as16, float* as32, int nthreads) {
  const int nb = k / 32;
  const __m256 signbit = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int nt = nthreads > 1 && (int64_t)n * k >= (1 << 16) ? nthreads : 1;
  lp::parallel_for(n, nt, [&](int i) {
    const float* xr = x + (int64_t)i * ldx;
    for (int b = 0; b < nb; ++b) {
      const float* p = xr + b * 32;
      __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
      __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
      __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(signbit, v0), _mm256_andnot_ps(signbit, v1)),
                               _mm256_max_ps(_mm256_andnot_ps(signbit, v2), _mm256_andnot_ps(signbit, v3)));
      __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.f;
      const float id = amax != 0.0f ? 127.f / amax : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, vid), rnd));
      __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, vid), rnd));
      __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, vid), rnd));
      __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, vid), rnd));
      // block sums of the quantized values (exact integers)
      __m256i s01 = _mm256_add_epi32(i0, i1), s23 = _mm256_add_epi32(i2, i3);
      __m128i h01 = _mm_add_epi32(_mm256_castsi256_si128(s01), _mm256_extracti128_si256(s01, 1));
      __m128i h23 = _mm_add_epi32(_mm256_castsi256_si128(s23), _mm256_extracti128_si256(s23, 1));
      h01 = _mm_hadd_epi32(h01, h23);  // [a0+a1, a2+a3, b0+b1, b2+b3]
      h01 = _mm_hadd_epi32(h01, h01);  // [sum01, sum23, ...]
      const int sum_lo = _mm_cvtsi128_si32(h01), sum_hi = _mm_extract_epi32(h01, 1);
      __m256i q01 = _mm256_packs_epi32(i0, i1), q23 = _mm256_packs_epi32(i2, i3);
      __m256i q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), perm);
      _mm256_storeu_si256((__m256i*)(aq + (int64_t)i * k + b * 32), q);
      ad[(int64_t)i * nb + b] = d;
      as16[(int64_t)i * 2 * nb + 2 * b] = d * (float)sum_lo;
      as16[(int64_t)i * 2 * nb + 2 * b + 1] = d * (float)sum_hi;
      as32[(int64_t)i * nb + b] = d * (float)(sum_lo + sum_hi);
    }
  });
}

struct Act {          // quantized activations of one call
  const int8_t* q;    // (n, k)
  const float* d;     // (n, k/32)
  const float* s16;   // (n, k/16)
  const float* s32;   // (n, k/32)
  int k;
};

#if defined(LP_AVX512)
// ---- AVX-512 VNNI: vpdpbusd (u8 x s8 -> s32), one zmm = 16 weight rows x 4 bytes ---------
// MODE 0: unsigned u with a stored bias c.  MODE 2: unsigned u with c = off * s (symmetric
// types: Q4_0, Q5_0, Q6_K; nothing stored).  MODE 1: SIGNED v (Q8_0): u = v ^ 0x80 = v + 128
// on the fly, and the -128*s term is the bias (c = -128 s), so Q8_0 needs no sign trick here.
template <int NX, int BS, int MODE>
inline void tile(const uint8_t* W, const float* S, const float* C, float off, int nb, const Act& a,
                 int i0, float* y, int64_t ldy, int nvalid) {
  __m512 acc[NX];
  for (int t = 0; t < NX; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i x80 = _mm512_set1_epi8((char)0x80);
  const int nb32 = a.k / 32, nb16 = a.k / 16;
  for (int b = 0; b < nb; ++b) {
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
    const __m512 cb = MODE == 0 ? _mm512_loadu_ps(C + b * R)
                                : _mm512_mul_ps(s, _mm512_set1_ps(MODE == 1 ? -128.f : off));
    for (int t = 0; t < NX; ++t) {
      const int64_t row = i0 + t;
      const float da = a.d[row * nb32 + (b * BS) / 32];
      const float sa = BS == 32 ? a.s32[row * nb32 + b] : a.s16[row * nb16 + b];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), _mm512_mul_ps(s, _mm512_set1_ps(da)), acc[t]);
      acc[t] = _mm512_fmadd_ps(cb, _mm512_set1_ps(sa), acc[t]);
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
  const int G = (d + R - 1) / R;
  const int64_t wstride = (int64_t)nb * BS * R;  // bytes per group
  const int64_t sstride = (int64_t)nb * R;       // scales per group
  const int nt = nthreads > 1 && G > 1 ? nthreads : 1;
  lp::parallel_for(G, nt, [&](int g) {
    const uint8_t* W = qw + g * wstride;
    const float* S = sc + g * sstride;
    const float* C = bias ? bias + g * sstride : nullptr;
    const int nvalid = d - g * R < R ? d - g * R : R;
    float* yg = y + (int64_t)g * R;
    int i0 = 0;
    for (; i0 + NXMAX <= n; i0 += NXMAX) tile<NXMAX, BS, MODE>(W, S, C, off, nb, a, i0, yg, d, nvalid);
    if (NXMAX > 4 && n - i0 >= 4) {
      tile<4, BS, MODE>(W, S, C, off, nb, a, i0, yg, d, nvalid);
      i0 += 4;
    }
    switch (n - i0) {
      case 3: tile<3, BS, MODE>(W, S, C, off, nb, a, i0, yg, d, nvalid); break;
      case 2: tile<2, BS, MODE>(W, S, C, off, nb, a, i0, yg, d, nvalid); break;
      case 1: tile<1, BS, MODE>(W, S, C, off, nb, a, i0, yg, d, nvalid); break;
      default: break;
    }
  });
}

}  // namespace
