// int16-activation variant of qmm.cpp (same weight form, same build, same ISA split).
//
// Why: int8 activations per 32 (llama.cpp's quantize_row_q8_0) lose the small elements of a
// block that holds an outlier (Gemma's hidden states reach |x| ~ 250 beside values ~ 1), and
// that noise, added to llama.cpp's own, pushed a teacher-forced fixture case past the 0.10
// nats bound.  Here each row is quantized per 32 to int16 (d = amax / 32767): relative error
// ~1.5e-5 per element, i.e. the product is as good as f32 for the model, still read from the
// packed int8 weights.  Products use i16 x i16 -> i32 pair sums (vpmaddwd; vpdpwssd with
// AVX-512 VNNI), the weights widened u8/s8 -> i16 once per chunk and shared by the tile's rows.
//
// Pair layout: a chunk holds 16 rows x 4 inputs (see qmm.cpp).  Widened, 8 rows x 4 inputs
// fill 32 i16; one pair-multiply against the row's 4 activations gives lane 2r = a0 w0 + a1 w1
// and lane 2r+1 = a2 w2 + a3 w3 for row r.  The int32 accumulators stay in this pair layout
// through a block; at its end a row's two lanes are added in int32 (exact) and the block's sum is
// scaled into one f32 accumulator per output row (qmm16.h).  Integer bounds: |w| <= 128,
// |a| <= 32767, 32 products per row per block: < 2^28.
//
// Compiled into every ISA's library like qmm.cpp; the amx library multiplies on AMX tiles by a
// byte split (qmm16_amx.h) where a call has enough rows.
#include "qmm16.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

namespace {

constexpr int TOP_SPAN = 256;  // columns per span of top_columns' first pass

// The K largest entries of y[0, d) into ids (descending value, ties: the lower column first;
// NaN never enters), returning how many (min(K, d)).
//
// Two passes: the maximum of every span of TOP_SPAN columns, then a sorted-insert scan (a vector
// compare against the K-th value so far, inserts on the rare hits) of only the spans whose
// maximum reaches g, the K-th largest span maximum.  The same entries as a scan of the whole row: at least K entries are
// >= g (one per span of the K largest maxima), so the K-th largest entry is >= g and every
// entry of the answer lies in a span whose maximum is >= g; those spans are scanned in column
// order, so ties keep the lower column.  For an LM head row that is ~32 spans of 1024.  A row
// holding a NaN is scanned whole.
int top_columns(const float* y, int d, int K, float* val, int32_t* ids) {
  int cnt = 0;
  auto push = [&](float v, int32_t i) {  // i exceeds every id held: an equal value goes after
    if (cnt == K && !(v > val[K - 1])) return;
    int p = cnt == K ? K - 1 : cnt;
    for (; p > 0 && val[p - 1] < v; --p) val[p] = val[p - 1], ids[p] = ids[p - 1];
    val[p] = v, ids[p] = i;
    if (cnt < K) ++cnt;
  };
  __m256 thr = _mm256_set1_ps(-INFINITY);
  auto scan = [&](int j, int end) {
    for (; j + 8 <= end; j += 8) {
      const __m256 v = _mm256_loadu_ps(y + j);
      unsigned m = cnt < K ? 0xFFu : (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_GT_OQ));
      if (!m) continue;
      for (; m; m &= m - 1) push(y[j + __builtin_ctz(m)], j + __builtin_ctz(m));
      if (cnt == K) thr = _mm256_set1_ps(val[K - 1]);
    }
    for (; j < end; ++j) push(y[j], j);
  };
  const int nspan = d / TOP_SPAN;
  if (nspan <= 2 * K) {
    scan(0, d);
    return cnt;
  }
  float* smax = (float*)malloc(sizeof(float) * 2 * (size_t)nspan);
  if (!smax) {
    scan(0, d);
    return cnt;
  }
  for (int s = 0; s < nspan; ++s) {
    const float* p = y + (int64_t)s * TOP_SPAN;
    __m256 m = _mm256_loadu_ps(p), bad = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
    for (int j = 8; j < TOP_SPAN; j += 8) {
      const __m256 v = _mm256_loadu_ps(p + j);
      m = _mm256_max_ps(m, v);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    if (_mm256_movemask_ps(bad)) {
      free(smax);
      cnt = 0;
      scan(0, d);
      return cnt;
    }
    smax[s] = _mm_cvtss_f32(m4);
  }
  float* sel = smax + nspan;
  memcpy(sel, smax, sizeof(float) * nspan);
  std::nth_element(sel, sel + (K - 1), sel + nspan, [](float a, float b) { return a > b; });
  const float g = sel[K - 1];
  for (int s = 0; s < nspan; ++s)
    if (smax[s] >= g) scan(s * TOP_SPAN, (s + 1) * TOP_SPAN);
  scan(nspan * TOP_SPAN, d);  // the columns after the last whole span
  free(smax);
  return cnt;
}

// One row: its top K columns recomputed by the int16 tile (qmm16.h tile<1>) on each 16-row
// weight group that holds one of them.
template <int BS, int MODE>
void rescore_row(const uint8_t* qw, const float* sc, const float* bias, float off, int d, int k, const Act16& a,
                 int K, float* yr) {
  float val[128];
  int32_t ids[128];
  const int cnt = top_columns(yr, d, K, val, ids);
  std::sort(ids, ids + cnt);
  const int nb = k / BS;
  const int64_t wstride = (int64_t)nb * BS * R, sstride = (int64_t)nb * R;
  float out[R];
  for (int i = 0; i < cnt;) {
    const int g = ids[i] / R;
    const int nvalid = d - g * R < R ? d - g * R : R;
    tile<1, BS, MODE>(qw + g * wstride, sc + g * sstride, bias ? bias + g * sstride : nullptr, off, nb, a, 0, out, R,
                      nvalid);
    for (; i < cnt && ids[i] / R == g; ++i) yr[ids[i]] = out[ids[i] % R];
  }
}

}  // namespace

// x f32 (n, k), row stride ldx: the input of an int8-activation matmul of this weight whose
// results are y f32 (n, d), row stride ldy.  Per row (rows in parallel, each independent): its K
// largest entries (1 <= K <= 128; ties: the lower column) are replaced in place by the int16
// kernel's values for those columns, bit-equal to a full qmm16 of x.  The weight arguments as
// qmm16_f32's.  Returns 0, -1 (bad arguments or weight form), -2 (no memory).
LP_EXPORT int LP_FN(qmm16_rescore)(const float* x, int64_t ldx, int n, int k, const uint8_t* qw, const float* sc,
                                   const float* bias, float off, int d, int bs, int is_signed, int K, float* y,
                                   int64_t ldy, int nthreads) {
  if (n < 0 || K < 1 || K > 128 || k % 32 || (bs != 16 && bs != 32) || ldy < d || (is_signed && bs != 32)) return -1;
  if (n == 0) return 0;
  const int64_t nk = (int64_t)n * k;
  char* buf = (char*)malloc(nk * sizeof(int16_t) + (nk / 32) * 4 * 2 + (nk / 16) * 4 + 64);
  if (!buf) return -2;
  int16_t* aq = (int16_t*)buf;
  float* ad = (float*)(buf + ((nk * (int64_t)sizeof(int16_t) + 63) & ~(int64_t)63));
  float* as32 = ad + nk / 32;
  float* as16 = as32 + nk / 32;
  quantize_rows16(x, ldx, n, k, aq, ad, as16, as32, nthreads);
  const Act16 all{aq, ad, as16, as32, k};
  lp::parallel_for(n, nthreads, [&](int r) {
    const Act16 a = all.from_row(r);
    float* yr = y + (int64_t)r * ldy;
    if (bs == 32 && is_signed) rescore_row<32, 1>(qw, sc, nullptr, 0.f, d, k, a, K, yr);
    else if (bs == 32 && bias) rescore_row<32, 0>(qw, sc, bias, 0.f, d, k, a, K, yr);
    else if (bs == 32) rescore_row<32, 2>(qw, sc, nullptr, off, d, k, a, K, yr);
    else if (bias) rescore_row<16, 0>(qw, sc, bias, 0.f, d, k, a, K, yr);
    else rescore_row<16, 2>(qw, sc, nullptr, off, d, k, a, K, yr);
  });
  free(buf);
  return 0;
}

#if defined(LP_AMX)
#include "qmm16_amx.h"

namespace {
template <int BS, int MODE, class... Args>
inline void gemm_tiles(const Args&... args) {
  gemm_amx<Amx16, BS, MODE>(args...);
}
}  // namespace

LP_DEFINE_QMM(qmm16, quantize_act16, Act16, int16_t, quantize_rows16, gemm_tiles)
#else
LP_DEFINE_QMM(qmm16, quantize_act16, Act16, int16_t, quantize_rows16, gemm_vnni16)
#endif
