// Gathered multi-LoRA products (punica / S-LoRA BGMV: per row, only the adapter slots it uses).
//
// For each (row i, slot s) pair with a nonzero scale c (the row's adapter_scale of the slot
// times the slot's alpha / r on this weight, worker.runtime.graph ``build_lora_mm``):
//   shrink:  xa[p, :r_s] = c · (A_s x_i)            A_s = a[s, :r_s, :]   (r_s, k)
//   expand:  y_i        += Σ_{p of row i} Σ_r xa[p, r] · bt[s_p, r, :]     bt[s] = B_sᵀ (R, d)
// Only the slots a row's adapter set holds are read: the work grows with the rows' pairs, not
// with the used slot prefix (the dense masked product multiplies every row by every slot).
//
// Determinism: a pair's dot products and a row's output columns are each computed by one fixed
// sequence of operations (k in vector chunks, then the fixed horizontal sum, then the scalar
// tail; pairs in row order, ranks ascending), whatever the batch or the thread split, so a row's
// result is bit-identical alone or batched and with 1 or 2 threads.
#include <immintrin.h>
#include <stdint.h>

#include "parallel.h"
#include "qmm_common.h"

namespace {

#if defined(LP_AVX512)
using vf = __m512;
constexpr int VW = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vset1(float f) { return _mm512_set1_ps(f); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float hsum(vf v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
#else
using vf = __m256;
constexpr int VW = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vset1(float f) { return _mm256_set1_ps(f); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float hsum(vf v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
#endif

// out[j] = dot(x, a + j*k) for j < NR: NR independent accumulator chains sharing each x load.
template <int NR>
inline void dots(const float* x, const float* a, int k, float* out) {
  vf acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = vzero();
  int t = 0;
  for (; t + VW <= k; t += VW) {
    const vf xv = vload(x + t);
    for (int j = 0; j < NR; ++j) acc[j] = vfma(xv, vload(a + (int64_t)j * k + t), acc[j]);
  }
  for (int j = 0; j < NR; ++j) {
    float s = hsum(acc[j]);
    const float* aj = a + (int64_t)j * k;
    for (int u = t; u < k; ++u) s += x[u] * aj[u];
    out[j] = s;
  }
}

constexpr int CB = 8 * VW;  // output columns per expand task (8 accumulators)

}  // namespace

// x (n, ldx) f32; a (S, R, k), bt (S, R, d) f32 contiguous (the pool's slot buffers);
// rank (S,) int32 r_s; factor (S,) f32 alpha / r_s (0: no branch on this weight);
// pairs sorted by row: pair_row / pair_slot (P,) int32, pair_scale (P,) f32 adapter_scale,
// row_ptr (n+1,) int32 (row i's pairs are row_ptr[i]..row_ptr[i+1]-1);
// xa (P, R) f32 scratch; y (n, ldy) f32, added to in place. Returns 0.
LP_EXPORT int LP_FN(lora_bgmv)(const float* x, int64_t ldx, int n, int k, const float* a, const float* bt, int R,
                               int d, const int32_t* rank, const float* factor, int P, const int32_t* pair_row,
                               const int32_t* pair_slot, const float* pair_scale, const int32_t* row_ptr, float* xa,
                               float* y, int64_t ldy, int nthreads) {
  lp::parallel_for(P, nthreads, [&](int p) {
    const int s = pair_slot[p];
    const int r = rank[s];
    const float c = pair_scale[p] * factor[s];
    if (r == 0 || c == 0.0f) return;
    const float* xi = x + (int64_t)pair_row[p] * ldx;
    const float* as = a + (int64_t)s * R * k;
    float* o = xa + (int64_t)p * R;
    int j = 0;
    for (; j + 8 <= r; j += 8) dots<8>(xi, as + (int64_t)j * k, k, o + j);
    for (; j + 4 <= r; j += 4) dots<4>(xi, as + (int64_t)j * k, k, o + j);
    for (; j < r; ++j) dots<1>(xi, as + (int64_t)j * k, k, o + j);
    for (j = 0; j < r; ++j) o[j] *= c;
  });
  const int nb = (d + CB - 1) / CB;
  lp::parallel_for(n * nb, nthreads, [&](int task) {
    const int i = task / nb, c0 = (task % nb) * CB;
    const int p0 = row_ptr[i], p1 = row_ptr[i + 1];
    float* yi = y + (int64_t)i * ldy;
    if (c0 + CB <= d) {
      vf acc[8];
      for (int v = 0; v < 8; ++v) acc[v] = vzero();
      for (int p = p0; p < p1; ++p) {
        const int s = pair_slot[p], r = rank[s];
        if (r == 0 || pair_scale[p] * factor[s] == 0.0f) continue;
        const float* b = bt + (int64_t)s * R * d + c0;
        for (int j = 0; j < r; ++j) {
          const vf cv = vset1(xa[(int64_t)p * R + j]);
          const float* bj = b + (int64_t)j * d;
          for (int v = 0; v < 8; ++v) acc[v] = vfma(cv, vload(bj + v * VW), acc[v]);
        }
      }
      for (int v = 0; v < 8; ++v) vstore(yi + c0 + v * VW, vadd(vload(yi + c0 + v * VW), acc[v]));
    } else {  // the last, partial column block: scalar, same (p, r) order
      for (int col = c0; col < d; ++col) {
        float acc = 0.0f;
        for (int p = p0; p < p1; ++p) {
          const int s = pair_slot[p], r = rank[s];
          if (r == 0 || pair_scale[p] * factor[s] == 0.0f) continue;
          const float* b = bt + (int64_t)s * R * d + col;
          for (int j = 0; j < r; ++j) acc += xa[(int64_t)p * R + j] * b[(int64_t)j * d];
        }
        yi[col] += acc;
      }
    }
  });
  return 0;
}
