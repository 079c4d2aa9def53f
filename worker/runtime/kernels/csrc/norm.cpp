// RMS norm rows in a fixed order: y[i, j] = (x[i, j] * s_i) * w[j], s_i = (float)(1 / sqrt(ms_i + eps))
// with ms_i = (sum_j x[i, j]^2) / d accumulated in double (llama.cpp ggml_compute_forward_rms_norm_f32
// also sums the squares in ggml_float = double, then scales by 1/sqrt(mean + eps)).
//
// Determinism: a row's sum runs over j in one fixed order (W double lanes over j mod W, then the lanes
// in a fixed order, then the scalar tail), whatever the number of rows or threads, so a row's result
// is bit-identical alone or batched (torch's reductions split differently with the row count).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "parallel.h"
#include "qmm_common.h"
#include "simd.h"

namespace {

double sum_squares(const float* x, int d) {
  vd acc0 = vdzero(), acc1 = vdzero();
  int j = 0;
  for (; j + W <= d; j += W) {
    const vd a = vdload(x + j), b = vdload(x + j + W / 2);
    acc0 = vdfma(a, a, acc0);
    acc1 = vdfma(b, b, acc1);
  }
  double lanes[W / 2];
  vdstore(lanes, vdadd(acc0, acc1));
  double s = 0.0;
  for (double l : lanes) s += l;
  for (; j < d; ++j) s += (double)x[j] * (double)x[j];
  return s;
}

}  // namespace

// x: f32 (n, d) rows at stride ldx; w: f32 (d,) or NULL (no weight); y: f32 (n, d) rows at stride ldy.
// Rows are split over threads only for n * d >= min_parallel (a wake-up costs more than a short norm).
LP_EXPORT void LP_FN(rms_norm)(const float* x, int64_t ldx, const float* w, int n, int d, float eps, float* y,
                               int64_t ldy, int64_t min_parallel, int nthreads) {
  const int nt = (int64_t)n * d >= min_parallel ? nthreads : 1;
  lp::parallel_for(n, nt, [&](int i) {
    const float* xr = x + (int64_t)i * ldx;
    float* yr = y + (int64_t)i * ldy;
    const float s = (float)(1.0 / sqrt(sum_squares(xr, d) / (double)d + (double)eps));
    if (w) {
      for (int j = 0; j < d; ++j) yr[j] = (xr[j] * s) * w[j];
    } else {
      for (int j = 0; j < d; ++j) yr[j] = xr[j] * s;
    }
  });
}
