// Shared by qmm.cpp (int8 activations) and qmm16.cpp (int16 activations): the exported-symbol
// macros, the row chunking, the (bs, is_signed, bias) -> gemm<BS, MODE> dispatch and the
// one-call "quantize, then multiply" wrapper.  Each source keeps only what differs: its
// activation struct, its quantizer and its tiles.
//
// A source includes this header, defines (inside its anonymous namespace)
//   struct ActT { const Q* q; const float* d; const float* s16; const float* s32; int k; };
//   template <int BS, int MODE> void gemm(qw, sc, bias, off, d, k, const ActT&, n, y, nthreads);
//   void QUANTIZE(x, ldx, n, k, Q* aq, ad, as16, as32, nthreads);
// and then, at file scope, LP_DEFINE_QMM(QMM, ActT, Q, QUANTIZE): the exported QMM and QMM_f32.
#pragma once

#include <stdint.h>
#include <stdlib.h>

#include "export.h"

namespace lp {

constexpr int XCHUNK = 64;  // activation rows kept hot while a thread walks its weight groups
// A source may define LP_QMM_CHUNK before including this header to use another chunk in its
// exports (qmm_amx.cpp: 256, its weight group is reused by 16 tiles of 16 rows).
#ifndef LP_QMM_CHUNK
#define LP_QMM_CHUNK lp::XCHUNK
#endif

// y (n, d) f32 = x @ W.T from activations already quantized, K::kChunk rows at a time.
//   bs 16 or 32; is_signed: the signed (Q8_0) form, which has no bias; bias: stored offsets
//   or NULL for c = off * s.  Returns 0, or -1 for an unsupported (bs, is_signed) pair.
template <class K, class Q>
inline int qmm_chunks(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, int bs,
                      int is_signed, const Q* aq, const float* ad, const float* as16, const float* as32, int n,
                      float* y, int nthreads) {
  for (int r0 = 0; r0 < n; r0 += K::kChunk) {
    const int nr = n - r0 < K::kChunk ? n - r0 : K::kChunk;
    typename K::Activations a{aq + (int64_t)r0 * k, ad + (int64_t)r0 * (k / 32), as16 + (int64_t)r0 * (k / 16),
                      as32 + (int64_t)r0 * (k / 32), k};
    float* yc = y + (int64_t)r0 * d;
    if (bs == 32 && is_signed) K::template run<32, 1>(qw, sc, nullptr, 0.f, d, k, a, nr, yc, nthreads);
    else if (bs == 32 && bias) K::template run<32, 0>(qw, sc, bias, 0.f, d, k, a, nr, yc, nthreads);
    else if (bs == 32) K::template run<32, 2>(qw, sc, nullptr, off, d, k, a, nr, yc, nthreads);
    else if (bs == 16 && !is_signed && bias) K::template run<16, 0>(qw, sc, bias, 0.f, d, k, a, nr, yc, nthreads);
    else if (bs == 16 && !is_signed) K::template run<16, 2>(qw, sc, nullptr, off, d, k, a, nr, yc, nthreads);
    else return -1;
  }
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

// The kernel type the templates above call (gemm<BS, MODE> over ACT), and the two exports:
//   QMM(qw, sc, bias, off, d, k, bs, is_signed, aq, ad, as16, as32, n, y, nthreads)
//     y (n, d) f32 row-major = x @ W.T for the packed W, from activations quantized by the
//     source's quantize export; 0, or -1 for an unsupported (bs, is_signed) pair.
//   QMM_f32(x, ldx, n, k, qw, sc, bias, off, d, bs, is_signed, y, nthreads)
//     quantize + QMM in one call; 0, -1 (unsupported form), -2 (no memory).
#define LP_DEFINE_QMM(QMM, ACT, Q, QUANTIZE)                                                                  \
  namespace {                                                                                                 \
  struct QMM##_kernel {                                                                                       \
    using Activations = ACT;                                                                                  \
    static constexpr int kChunk = LP_QMM_CHUNK;                                                               \
    template <int BS, int MODE>                                                                               \
    static void run(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k,           \
                    const Activations& a, int n, float* y, int nthreads) {                                    \
      gemm<BS, MODE>(qw, sc, bias, off, d, k, a, n, y, nthreads);                                             \
    }                                                                                                         \
  };                                                                                                          \
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
