// Shared by qmm.cpp (int8 activations) and qmm16.cpp (int16 activations): the row chunking, the
// (bs, is_signed, bias) -> gemm<BS, MODE> dispatch, the one-call "quantize, then multiply"
// wrapper and LP_DEFINE_QMM, which writes a precision's three exports.  Each source keeps only
// what differs: its activation struct, its quantizer and its tiles (qmm8.h / qmm16.h, and on
// AMX qmm8_amx.h / qmm16_amx.h).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include <type_traits>

#include "api.h"
#include "parallel.h"

namespace lp {

constexpr int R = 16;  // weight rows per interleaved group

constexpr int XCHUNK = 64;  // activation rows kept hot while a thread walks its weight groups
// Rows per call of a gemm in the exports: XCHUNK, or 256 on AMX, where each weight group is
// reused by 16 tiles of 16 rows.
#if defined(LP_AMX)
#define LP_QMM_CHUNK 256
#else
#define LP_QMM_CHUNK lp::XCHUNK
#endif

// Activation quantization per row and per block of 32 (ggml-quants.c quantize_row_q8_0, with
// QMAX = 127 for int8 and 32767 for int16): d_a = amax / QMAX, a_q = round(x / d_a) (nearest
// even).  x: f32 (n, k) row stride ldx.  aq: Q (n, k), each block's four vectors of 8 int32
// written by pack(q, dst).  ad: f32 (n, k/32) = d_a.  as16: f32 (n, k/16) = d_a * sum of a_q over
// each 16.  as32: f32 (n, k/32), the same per 32.
template <int QMAX, class Q, class Pack>
inline void quantize_rows_by32(const float* x, int64_t ldx, int n, int k, Q* aq, float* ad, float* as16,
                               float* as32, int nthreads, Pack&& pack) {
  const int nb = k / 32;
  const __m256 signbit = _mm256_set1_ps(-0.0f);
  const int nt = nthreads > 1 && (int64_t)n * k >= (1 << 16) ? nthreads : 1;
  lp::parallel_for(n, nt, [&](int i) {
    const float* xr = x + (int64_t)i * ldx;
    for (int b = 0; b < nb; ++b) {
      const float* p = xr + b * 32;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(p + 8 * j);
      __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(signbit, v[0]), _mm256_andnot_ps(signbit, v[1])),
                               _mm256_max_ps(_mm256_andnot_ps(signbit, v[2]), _mm256_andnot_ps(signbit, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / (float)QMAX;
      const __m256 vid = _mm256_set1_ps(amax != 0.0f ? (float)QMAX / amax : 0.0f);
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // block sums of the quantized values (exact integers)
      __m256i s01 = _mm256_add_epi32(q[0], q[1]), s23 = _mm256_add_epi32(q[2], q[3]);
      __m128i h01 = _mm_add_epi32(_mm256_castsi256_si128(s01), _mm256_extracti128_si256(s01, 1));
      __m128i h23 = _mm_add_epi32(_mm256_castsi256_si128(s23), _mm256_extracti128_si256(s23, 1));
      h01 = _mm_hadd_epi32(h01, h23);  // [a0+a1, a2+a3, b0+b1, b2+b3]
      h01 = _mm_hadd_epi32(h01, h01);  // [sum01, sum23, ...]
      const int sum_lo = _mm_cvtsi128_si32(h01), sum_hi = _mm_extract_epi32(h01, 1);
      pack(q, aq + (int64_t)i * k + b * 32);
      ad[(int64_t)i * nb + b] = d;
      as16[(int64_t)i * 2 * nb + 2 * b] = d * (float)sum_lo;
      as16[(int64_t)i * 2 * nb + 2 * b + 1] = d * (float)sum_hi;
      as32[(int64_t)i * nb + b] = d * (float)(sum_lo + sum_hi);
    }
  });
}

// Streaming the weights from memory: called at block b of a group (W its packed bytes, S its
// scales, bb bytes per block), it asks for the nblk blocks from b + 4 on into L1 and, when far,
// from b + 32 on (16 KiB ahead at 32-blocks) into L2 with their scales.  The addresses run on into
// the following groups, which the same thread walks next (its share of the groups is contiguous);
// a prefetch past the weight's end never faults.  Measured on LM heads (old and new library
// alternated in one process): at 1 row 30-33 % faster on avx2 and avx512; at 16 rows the AMX int8
// tiles 17-30 % on Qwen2.5's 151936 x 896, the int16 tiles 0-3 % (compute-bound).
// always_inline: out of line, GCC finds the function free of side effects and drops the call.
__attribute__((always_inline)) inline void prefetch_weights(const uint8_t* W, const float* S, int b, int bb,
                                                            int nblk, bool far) {
  const char* l1 = (const char*)(W + (int64_t)(b + 4) * bb);
  for (int l = 0; l < nblk * bb; l += 64) _mm_prefetch(l1 + l, _MM_HINT_T0);
  if (!far) return;
  const char* l2 = (const char*)(W + (int64_t)(b + 32) * bb);
  for (int l = 0; l < nblk * bb; l += 64) _mm_prefetch(l2 + l, _MM_HINT_T1);
  for (int j = 0; j < nblk; ++j) _mm_prefetch((const char*)(S + (int64_t)(b + 32 + j) * R), _MM_HINT_T1);
}

// The vnni kernels' walk over the weight: the groups of R rows split over threads, and per group
// rows(W, S, C, nvalid, yg) multiplies every activation row by it (W its packed bytes, S its
// scales, C its stored biases or NULL, nvalid its rows below d, yg its first output column).
template <class Rows>
inline void for_each_group(const uint8_t* qw, const float* sc, const float* bias, int d, int k, int bs, float* y,
                           int nthreads, Rows&& rows) {
  const int nb = k / bs;
  const int G = (d + R - 1) / R;
  const int64_t wstride = (int64_t)nb * bs * R;  // bytes per group
  const int64_t sstride = (int64_t)nb * R;       // scales per group
  const int nt = nthreads > 1 && G > 1 ? nthreads : 1;
  lp::parallel_for(G, nt, [&](int g) {
    const float* C = bias ? bias + g * sstride : nullptr;
    const int nvalid = d - g * R < R ? d - g * R : R;
    rows(qw + g * wstride, sc + g * sstride, C, nvalid, y + (int64_t)g * R);
  });
}

// Rows 0..n-1 in tiles, widest first: as many tiles of NX[0] rows as fit, then of NX[1], ...;
// tile(std::integral_constant<int, nx>, i0) does rows i0..i0+nx-1.
template <int... NX, class Tile>
inline void tile_rows(int n, Tile&& tile) {
  int i0 = 0;
  (
      [&] {
        for (; i0 + NX <= n; i0 += NX) tile(std::integral_constant<int, NX>{}, i0);
      }(),
      ...);
}

// out (m) int32 = the sum of each run of 32 int8 values at q (m * 32 bytes): per 32 bytes,
// vpsadbw of (q + 128) as unsigned bytes against zero, less 32 * 128.
inline void block_sums32(const int8_t* q, int64_t m, int32_t* out) {
  const __m256i x80 = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
  for (int64_t i = 0; i < m; ++i) {
    const __m256i s = _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(q + i * 32)), x80), zero);
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    out[i] = (int32_t)(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 32 * 128;
  }
}

// y (n, d) f32 = x @ W.T from activations already quantized, K::kChunk rows at a time.
//   bs 16 or 32; is_signed: the signed (Q8_0) form, which has no bias; bias: stored offsets
//   or NULL for c = off * s.  On AVX-512, int8 activations against the signed form also need
//   each block's integer sum (Act::qsum, qmm8.h), formed here per chunk.  Returns 0, -1 for an unsupported
//   (bs, is_signed) pair, -2 when the block sums find no memory.
template <class K, class Q>
inline int qmm_chunks(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, int bs,
                      int is_signed, const Q* aq, const float* ad, const float* as16, const float* as32, int n,
                      float* y, int nthreads) {
#if defined(LP_AVX512)
  constexpr bool kSums = std::is_same<Q, int8_t>::value;
#else
  constexpr bool kSums = false;  // the AVX2 tile forms sum(v * a_q) by llama.cpp's sign trick
#endif
  int32_t* qsum = nullptr;
  if (kSums && bs == 32 && is_signed && n > 0) {
    qsum = (int32_t*)malloc(sizeof(int32_t) * (size_t)(n < K::kChunk ? n : K::kChunk) * (k / 32));
    if (!qsum) return -2;
  }
  for (int r0 = 0; r0 < n; r0 += K::kChunk) {
    const int nr = n - r0 < K::kChunk ? n - r0 : K::kChunk;
    typename K::Activations a{aq + (int64_t)r0 * k, ad + (int64_t)r0 * (k / 32), as16 + (int64_t)r0 * (k / 16),
                      as32 + (int64_t)r0 * (k / 32), k};
    if constexpr (kSums) {
      if (qsum) {
        block_sums32((const int8_t*)(aq + (int64_t)r0 * k), (int64_t)nr * (k / 32), qsum);
        a.qsum = qsum;
      }
    }
    float* yc = y + (int64_t)r0 * d;
    if (bs == 32 && is_signed) K::template run<32, 1>(qw, sc, nullptr, 0.f, d, k, a, nr, yc, nthreads);
    else if (bs == 32 && bias) K::template run<32, 0>(qw, sc, bias, 0.f, d, k, a, nr, yc, nthreads);
    else if (bs == 32) K::template run<32, 2>(qw, sc, nullptr, off, d, k, a, nr, yc, nthreads);
    else if (bs == 16 && !is_signed && bias) K::template run<16, 0>(qw, sc, bias, 0.f, d, k, a, nr, yc, nthreads);
    else if (bs == 16 && !is_signed) K::template run<16, 2>(qw, sc, nullptr, off, d, k, a, nr, yc, nthreads);
    else {
      free(qsum);
      return -1;
    }
  }
  free(qsum);
  return 0;
}

// Quantize x (n, k) f32 (row stride ldx) with `quantize` into buffers malloc'd here, multiply
// with qmm_chunks, free.  One ctypes crossing per matmul.  Returns 0, -1 (unsupported form),
// -2 (no memory).
template <class K, class Q, class Quantize>
inline int qmm_from_f32(Quantize quantize, const float* x, int64_t ldx, int n, int k, const uint8_t* qw,
                        const float* sc, const float* bias, float off, int d, int bs, int is_signed, float* y,
                        int nthreads) {
  const int64_t nk = (int64_t)n * k;
  const int64_t qbytes = nk * (int64_t)sizeof(Q);
  char* buf = (char*)malloc(qbytes + (nk / 32) * 4 * 2 + (nk / 16) * 4 + 64);
  if (!buf) return -2;
  Q* aq = (Q*)buf;
  float* ad = (float*)(buf + ((qbytes + 63) & ~(int64_t)63));
  float* as32 = ad + nk / 32;
  float* as16 = as32 + nk / 32;
  quantize(x, ldx, n, k, aq, ad, as16, as32, nthreads);
  const int rc = qmm_chunks<K, Q>(qw, sc, bias, off, d, k, bs, is_signed, aq, ad, as16, as32, n, y, nthreads);
  free(buf);
  return rc;
}

}  // namespace lp

// The three exports of one activation precision (declared in api.h):
//   QUANTIZE_EXPORT(x, ldx, n, k, aq, ad, as16, as32, nthreads)
//     quantize x (n, k) f32 (row stride ldx) with QUANTIZE into the caller's buffers.
//   QMM(qw, sc, bias, off, d, k, bs, is_signed, aq, ad, as16, as32, n, y, nthreads)
//     y (n, d) f32 row-major = x @ W.T for the packed W, from activations quantized by
//     QUANTIZE_EXPORT; 0, or -1 for an unsupported (bs, is_signed) pair.
//   QMM_f32(x, ldx, n, k, qw, sc, bias, off, d, bs, is_signed, y, nthreads)
//     quantize + QMM in one call; 0, -1 (unsupported form), -2 (no memory).
// ACT is the activation struct (element type Q), GEMM the template gemm<BS, MODE> over it: the
// vnni kernel, or on AMX the tiles' gemm_amx.
#define LP_DEFINE_QMM(QMM, QUANTIZE_EXPORT, ACT, Q, QUANTIZE, GEMM)                                         \
  namespace {                                                                                                 \
  struct QMM##_kernel {                                                                                       \
    using Activations = ACT;                                                                                  \
    static constexpr int kChunk = LP_QMM_CHUNK;                                                               \
    template <int BS, int MODE>                                                                               \
    static void run(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k,           \
                    const Activations& a, int n, float* y, int nthreads) {                                    \
      GEMM<BS, MODE>(qw, sc, bias, off, d, k, a, n, y, nthreads);                                             \
    }                                                                                                         \
  };                                                                                                          \
  }                                                                                                           \
  LP_EXPORT void LP_FN(QUANTIZE_EXPORT)(const float* x, int64_t ldx, int n, int k, Q* aq, float* ad,          \
                                        float* as16, float* as32, int nthreads) {                             \
    QUANTIZE(x, ldx, n, k, aq, ad, as16, as32, nthreads);                                                     \
  }                                                                                                           \
  LP_EXPORT int LP_FN(QMM)(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k,    \
                           int bs, int is_signed, const Q* aq, const float* ad, const float* as16,            \
                           const float* as32, int n, float* y, int nthreads) {                                \
    return lp::qmm_chunks<QMM##_kernel, Q>(qw, sc, bias, off, d, k, bs, is_signed, aq, ad, as16, as32, n, y,  \
                                           nthreads);                                                         \
  }                                                                                                           \
  LP_EXPORT int LP_FN(QMM##_f32)(const float* x, int64_t ldx, int n, int k, const uint8_t* qw,                \
                                 const float* sc, const float* bias, float off, int d, int bs, int is_signed, \
                                 float* y, int nthreads) {                                                    \
    return lp::qmm_from_f32<QMM##_kernel, Q>(QUANTIZE, x, ldx, n, k, qw, sc, bias, off, d, bs, is_signed, y, \
                                             nthreads);                                                       \
  }
