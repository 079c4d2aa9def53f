// Fused logits summary for sampling: per row of f32 logits, in two streaming passes over each
// L1-sized chunk, the row's max, its log-sum-exp parts and its top-k (ids + logits).
//
//   logits_summary(x, ldx, rows, n, v, k, mx, logsum, top_ids, top_vals, nthreads)
//     x f32 row-major (row stride ldx floats, v entries per row); the n rows summarized are
//     rows[0..n) (NULL: rows 0..n-1), read in place; 1 <= k <= LP_TOPK_MAX, k <= v.
//     mx[n]                     max of the row
//     logsum[n]                 log(sum_j exp(x_j - mx))  -> log_softmax(x)_j = (x_j - mx) - logsum
//     top_ids[n*k], top_vals[n*k]  the k largest logits, descending, ties by ascending id
//                               (top_ids[r*k] is the argmax: the lowest id among equal maxima)
//   Returns 0, -1 (bad arguments), -2 (no memory).
//
// Work items are (row, chunk of CHUNK entries); each computes its chunk's max m_c, the sum
// s_c = sum exp(x - m_c) (f32 blocks into f64 lanes, fixed order) and the chunk's top-k.  A second
// loop merges each row's chunks in chunk order: M = max m_c, S = sum_c s_c exp(m_c - M) in
// double, top lists merged with earlier chunks winning ties (their ids are lower).  The chunk
// boundaries depend only on v, so a row's result is bit-identical alone or in any batch and
// with any thread count.  -inf entries (masked tokens) contribute exp = 0; a row that is -inf
// everywhere gives mx = -inf, logsum = -inf.  NaN entries are not supported (unspecified).
//
// exp: our own vectorized exp for x <= 0 (Cody-Waite range reduction x = n ln2 + r,
// |r| <= ln2/2, degree-7 minimax-style polynomial in r as in Cephes' expf, 2^n by exponent
// bits; x < -87 gives 0).  The idea is the one of ggml's ggml_v_expf (ggml-cpu/vec.h).  The
// reference semantics are torch's log_softmax / argmax / topk and llama.cpp's sampler
// (llama-sampling.cpp llama_sampler_softmax_impl: max, then sum of exp(x - max)).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "parallel.h"
#include "simd.h"

namespace {

constexpr int CHUNK = 16384;       // entries per work item (64 KiB: pass 2 reads it from L2)
constexpr int LP_TOPK_MAX = 128;   // largest k

// Sorted (descending value, ascending id among equals) list of at most k entries.
struct Top {
  float* val;
  int32_t* id;
  int cnt, k;
  // Insert (x, i); i is larger than every id already held, so an equal value goes after them.
  inline void push(float x, int32_t i) {
    if (cnt == k && !(x > val[k - 1])) return;
    int p = cnt == k ? k - 1 : cnt;
    while (p > 0 && val[p - 1] < x) {
      val[p] = val[p - 1];
      id[p] = id[p - 1];
      --p;
    }
    val[p] = x;
    id[p] = i;
    if (cnt < k) ++cnt;
  }
};

// One chunk x[0, len) whose first entry has id `base`: max, sum of exp(x - max), top-k.
void chunk_pass(const float* x, int len, int32_t base, int k, float* m_out, double* s_out, int* cnt_out, float* tv,
                int32_t* ti) {
  Top top{tv, ti, 0, k};
  const float NEG_INF = -INFINITY;
  vf vm = vset1(NEG_INF);
  vf thr = vset1(NEG_INF);
  const int nv = len / W * W;
  // pass 1: max and top-k (a vector compare against the k-th value; rare scalar inserts)
  for (int i = 0; i < nv; i += W) {
    const vf a = vload(x + i);
    vm = vmax(vm, a);
    unsigned mask = top.cnt < k ? (1u << W) - 1 : vgt(a, thr);
    if (mask) {
      while (mask) {
        const int j = __builtin_ctz(mask);
        mask &= mask - 1;
        top.push(x[i + j], base + i + j);
      }
      thr = vset1(top.cnt == k ? top.val[k - 1] : NEG_INF);
    }
  }
  float m = hmax(vm);
  for (int i = nv; i < len; ++i) {
    m = x[i] > m ? x[i] : m;
    top.push(x[i], base + i);
  }
  // pass 2: sum of exp(x - m).  f32 partial sums of at most 8 terms per lane (blocks of
  // 2 x 8 vectors), each block added into f64 lanes: near-uniform rows (all terms ~1) would
  // otherwise drift by ~1e-5 relative from f32 rounding that always goes the same way.
  double s = 0.0;
  if (m != NEG_INF) {
    const vf vmx = vset1(m);
    vd d0 = vdzero(), d1 = vdzero();
    int i = 0;
    while (i < nv) {
      vf s0 = vset1(0.f), s1 = vset1(0.f);
      const int end = nv - i < 16 * W ? nv : i + 16 * W;
      for (; i + 2 * W <= end; i += 2 * W) {
        s0 = vadd(s0, vexp(vsub(vload(x + i), vmx)));
        s1 = vadd(s1, vexp(vsub(vload(x + i + W), vmx)));
      }
      if (i < end) {
        s0 = vadd(s0, vexp(vsub(vload(x + i), vmx)));
        i += W;
      }
      vdacc(d0, d1, vadd(s0, s1));
    }
    if (nv < len) {
      float t[W];
      for (int j = 0; j < W; ++j) t[j] = nv + j < len ? x[nv + j] : NEG_INF;
      vdacc(d0, d1, vexp(vsub(vload(t), vmx)));
    }
    double u[W];
    vdstore(u, d0);
    vdstore(u + W / 2, d1);
    // fixed pairwise order over the lanes
    for (int w = W / 2; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) u[j] += u[j + w];
    s = u[0];
  }
  *m_out = m;
  *s_out = s;
  *cnt_out = top.cnt;
}

}  // namespace

LP_EXPORT int LP_FN(logits_summary)(const float* x, int64_t ldx, const int64_t* rows, int n, int v, int k, float* mx,
                                    float* logsum, int32_t* top_ids, float* top_vals, int nthreads) {
  if (n < 0 || v < 1 || k < 1 || k > LP_TOPK_MAX || k > v || ldx < v) return -1;
  if (n == 0) return 0;
  const int nch = (v + CHUNK - 1) / CHUNK;
  const int64_t items = (int64_t)n * nch;
  const size_t per_item = sizeof(double) + sizeof(float) + sizeof(int) + k * (sizeof(float) + sizeof(int32_t));
  char* buf = (char*)malloc(items * per_item);
  if (!buf) return -2;
  double* cs = (double*)buf;
  float* cm = (float*)(cs + items);
  int* cc = (int*)(cm + items);
  float* cv = (float*)(cc + items);
  int32_t* ci = (int32_t*)(cv + items * k);
  lp::parallel_for((int)items, nthreads, [&](int it) {
    const int r = it / nch, c = it % nch;
    const int lo = c * CHUNK, len = v - lo < CHUNK ? v - lo : CHUNK;
    chunk_pass(x + (rows ? rows[r] : (int64_t)r) * ldx + lo, len, lo, k < len ? k : len, cm + it, cs + it, cc + it,
               cv + (int64_t)it * k, ci + (int64_t)it * k);
  });
  lp::parallel_for(n, nthreads, [&](int r) {
    const int64_t b = (int64_t)r * nch;
    float M = -INFINITY;
    for (int c = 0; c < nch; ++c) M = cm[b + c] > M ? cm[b + c] : M;
    double S = 0.0;
    if (M != -INFINITY)
      for (int c = 0; c < nch; ++c)
        if (cm[b + c] != -INFINITY) S += cs[b + c] * exp((double)cm[b + c] - (double)M);
    mx[r] = M;
    logsum[r] = M == -INFINITY ? -INFINITY : (float)log(S);
    // merge the chunks' lists in chunk order (earlier chunk wins a tie: lower ids)
    float* ov = top_vals + (int64_t)r * k;
    int32_t* oi = top_ids + (int64_t)r * k;
    float tv[LP_TOPK_MAX];
    int32_t ti[LP_TOPK_MAX];
    int cnt = cc[b];
    memcpy(ov, cv + b * k, cnt * sizeof(float));
    memcpy(oi, ci + b * k, cnt * sizeof(int32_t));
    for (int c = 1; c < nch; ++c) {
      const float* bv = cv + (b + c) * k;
      const int32_t* bi = ci + (b + c) * k;
      const int bn = cc[b + c];
      int i = 0, j = 0, o = 0;
      while (o < k && (i < cnt || j < bn)) {
        if (j >= bn || (i < cnt && !(bv[j] > ov[i]))) {
          tv[o] = ov[i];
          ti[o++] = oi[i++];
        } else {
          tv[o] = bv[j];
          ti[o++] = bi[j++];
        }
      }
      cnt = o;
      memcpy(ov, tv, cnt * sizeof(float));
      memcpy(oi, ti, cnt * sizeof(int32_t));
    }
  });
  free(buf);
  return 0;
}
