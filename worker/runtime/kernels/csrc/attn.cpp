// Decode attention over the unified KV cache, read in place (no gather, no f64 copy).
//
// One query row per sequence (a decode step): for sequence b at position p_b in cache row
// cache_rows[b], query head h attends the keys at positions lo_b..p_b of that row, where
// lo_b = max(0, p_b - n_swa + 1) with a sliding window (n_swa > 0) and 0 otherwise
// (llama.cpp is_masked_swa, LLAMA_SWA_TYPE_STANDARD: key visible iff p_q - p_k < n_swa);
// GQA: head h reads KV head h / (H / Hkv).
//
// The idea is llama.cpp's CPU flash attention (ggml-cpu ops.cpp
// ggml_compute_forward_flash_attn_ext_f16_one_chunk): an online softmax with a running
// maximum M and sum S, the value accumulator rescaled by exp(M_old - M_new) when M grows.
// Here the keys go in tiles of TILE positions counted from lo_b: a tile's scores
// s = kq_scale * q.k (then softcap * tanh(s / softcap) when softcap > 0) are computed first,
// M moves once per tile, then the tile's V rows are accumulated with weights exp(s - M).
// f32 vectors for the dot products and the accumulator, expf/tanhf from libm, S in double.
//
// Determinism: a head's result depends only on its own query, its row's keys/values and
// (p_b, n_swa, kq_scale, softcap): the keys go in one fixed order, the tiles start at lo_b,
// each head has its own accumulators and the same instruction sequence whichever heads share
// its task.  So a row is bit-identical alone or batched, and with any thread count (tasks
// are (row, block of query heads of one KV head); the block size only splits work).
//
// The two builds differ in vector width (AVX-512: 16 lanes, AVX2: 8 lanes), so their results
// differ in the last bits; each process uses one.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "parallel.h"
#include "qmm_common.h"
#include "simd.h"

namespace {

constexpr int TILE = 32;      // key positions per softmax update (a multiple of 8 and of W)
constexpr int MAX_HB = 8;  // query heads per task (kept in registers together; each K/V load serves them all)
constexpr int MAX_D = 512;    // largest head dim (K or V) supported

// DT: 0 f32, 1 f16, 2 bf16
template <int DT>
inline vf vload_kv(const void* base, int64_t i) {
  if constexpr (DT == 0) {
    return vload((const float*)base + i);
  } else if constexpr (DT == 1) {
    return vload_f16((const uint16_t*)base + i);
  } else {
    return vload_bf16((const uint16_t*)base + i);
  }
}

// exp(x) for x <= 0, 0 below -60: a weight under e^-60 (~1e-26) of the row's largest (which is
// 1, so S >= 1) is far below f32 rounding of any output, and flushing it keeps denormals
// (slow microcode assists in the FMAs) out of the accumulators.
inline float wexp(float x) { return x > -60.0f ? expf(x) : 0.0f; }

struct Args {
  const float* q;  // (B, H, dk) f32, row stride q_ld (elements), heads contiguous
  int64_t q_ld;
  const void* k;   // cache: element (row, pos, g, i) at k + row*ks0 + pos*ks1 + g*ks2 + i
  const void* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const int64_t* cache_rows;  // (B,)
  const int64_t* pos;         // (B,)
  int H, Hkv, dk, dv;
  float scale, softcap;
  int n_swa;
  float* out;  // (B, H, dv) f32 contiguous
};

// Heads h0..h0+NH-1 (one KV head g) of sequence b.
template <int DT, int NH>
void attend(const Args& a, int b, int g, int h0) {
  const int dk = a.dk, dv = a.dv, nck = dk / W, ncv = dv / W;
  const int64_t p = a.pos[b];
  const int64_t lo = a.n_swa > 0 && p - a.n_swa + 1 > 0 ? p - a.n_swa + 1 : 0;
  const int64_t row = a.cache_rows[b];
  const char* kbase = (const char*)a.k;
  const char* vbase = (const char*)a.v;
  constexpr int es = DT == 0 ? 4 : 2;
  const void* krow = kbase + (row * a.ks0 + g * a.ks2) * es;
  const void* vrow = vbase + (row * a.vs0 + g * a.vs2) * es;

  const float* q[NH];
  for (int r = 0; r < NH; ++r) q[r] = a.q + b * a.q_ld + (int64_t)(h0 + r) * dk;
  alignas(64) float acc[NH][MAX_D];
  alignas(64) float s[NH][TILE];
  float M[NH];
  double S[NH];
  for (int r = 0; r < NH; ++r) {
    M[r] = -INFINITY;
    S[r] = 0.0;
    for (int i = 0; i < dv; ++i) acc[r][i] = 0.0f;
  }
  const float scale = a.scale, softcap = a.softcap;
  alignas(64) float dd[NH][8][W];  // a group of 8 keys' per-lane partial dot products, per head
  for (int64_t t0 = lo; t0 <= p; t0 += TILE) {
    const int nt = (int)(p + 1 - t0 < TILE ? p + 1 - t0 : TILE);
    // scores of the tile: per key the W-lane partial products of q.k (two keys at a time, so
    // each q vector loaded serves both and 2 x NH independent FMA chains hide the latency),
    // then 8 keys' sums at once
    for (int j0 = 0; j0 < TILE; j0 += 8) {
      const int nj = nt - j0 < 8 ? (nt - j0 > 0 ? nt - j0 : 0) : 8;
      for (int j = 0; j < 8; j += 2) {
        vf d0[NH], d1[NH];
        for (int r = 0; r < NH; ++r) d0[r] = d1[r] = vzero();
        if (j + 1 < nj) {
          const int64_t ko0 = (t0 + j0 + j) * a.ks1, ko1 = ko0 + a.ks1;
          for (int c = 0; c < nck; ++c) {
            const vf k0 = vload_kv<DT>(krow, ko0 + c * W), k1 = vload_kv<DT>(krow, ko1 + c * W);
            for (int r = 0; r < NH; ++r) {
              const vf qv = vload(q[r] + c * W);
              d0[r] = vfma(qv, k0, d0[r]);
              d1[r] = vfma(qv, k1, d1[r]);
            }
          }
        } else if (j < nj) {
          const int64_t ko0 = (t0 + j0 + j) * a.ks1;
          for (int c = 0; c < nck; ++c) {
            const vf k0 = vload_kv<DT>(krow, ko0 + c * W);
            for (int r = 0; r < NH; ++r) d0[r] = vfma(vload(q[r] + c * W), k0, d0[r]);
          }
        }
        for (int r = 0; r < NH; ++r) {
          vstore(dd[r][j], d0[r]);
          vstore(dd[r][j + 1], d1[r]);
        }
      }
      for (int r = 0; r < NH; ++r) hsum_x8(&dd[r][0][0], s[r] + j0);
      if (nj < 8) break;
    }
    // scale, soft-cap, the keys past the tile's end masked out
    for (int r = 0; r < NH; ++r) {
      for (int j = 0; j < TILE; j += W) vstore(s[r] + j, vmul(vload(s[r] + j), vset1(scale)));
      if (softcap > 0.0f)
        for (int j = 0; j < nt; ++j) s[r][j] = softcap * tanhf(s[r][j] / softcap);
      for (int j = nt; j < TILE; ++j) s[r][j] = -INFINITY;
    }
    // online softmax update: new maximum, rescale factor, weights (vector e^x, 0 below -60)
    float alpha[NH];
    for (int r = 0; r < NH; ++r) {
      vf mv = vload(s[r]);
      for (int j = W; j < TILE; j += W) mv = vmax(mv, vload(s[r] + j));
      const float mt = hmax(mv);
      const float m = mt > M[r] ? mt : M[r];
      alpha[r] = M[r] == -INFINITY ? 0.0f : wexp(M[r] - m);
      M[r] = m;
      vf sum = vzero();
      for (int j = 0; j < TILE; j += W) {
        const vf x = vsub(vload(s[r] + j), vset1(m));
        const vf w = vkeep_ge(x, -60.0f, vexp(x));
        vstore(s[r] + j, w);
        sum = vadd(sum, w);
      }
      S[r] = S[r] * (double)alpha[r] + (double)hsum(sum);
    }
    // acc = acc * alpha + sum_j w_j v_j, keys in order, two vectors of dv at a time (2 x NH
    // independent FMA chains; each weight broadcast serves both)
    int c = 0;
    for (; c + 1 < ncv; c += 2) {
      vf o0[NH], o1[NH];
      for (int r = 0; r < NH; ++r) {
        o0[r] = vmul(vload(acc[r] + c * W), vset1(alpha[r]));
        o1[r] = vmul(vload(acc[r] + (c + 1) * W), vset1(alpha[r]));
      }
      for (int j = 0; j < nt; ++j) {
        const int64_t vo = (t0 + j) * a.vs1 + c * W;
        const vf v0 = vload_kv<DT>(vrow, vo), v1 = vload_kv<DT>(vrow, vo + W);
        for (int r = 0; r < NH; ++r) {
          const vf w = vset1(s[r][j]);
          o0[r] = vfma(w, v0, o0[r]);
          o1[r] = vfma(w, v1, o1[r]);
        }
      }
      for (int r = 0; r < NH; ++r) {
        vstore(acc[r] + c * W, o0[r]);
        vstore(acc[r] + (c + 1) * W, o1[r]);
      }
    }
    if (c < ncv) {  // an odd count of vectors (AVX-512 with dv an odd multiple of 16)
      vf o[NH];
      for (int r = 0; r < NH; ++r) o[r] = vmul(vload(acc[r] + c * W), vset1(alpha[r]));
      for (int j = 0; j < nt; ++j) {
        const vf vv = vload_kv<DT>(vrow, (t0 + j) * a.vs1 + c * W);
        for (int r = 0; r < NH; ++r) o[r] = vfma(vset1(s[r][j]), vv, o[r]);
      }
      for (int r = 0; r < NH; ++r) vstore(acc[r] + c * W, o[r]);
    }
  }
  for (int r = 0; r < NH; ++r) {
    const vf inv = vset1((float)(1.0 / S[r]));
    float* o = a.out + ((int64_t)b * a.H + h0 + r) * dv;
    for (int c = 0; c < ncv; ++c) vstore(o + c * W, vmul(vload(acc[r] + c * W), inv));
  }
}

template <int DT>
void attend_heads(const Args& a, int b, int g, int h0, int nh) {
  // blocks of at most MAX_HB heads; a head's arithmetic is the same in every block size
  while (nh > 0) {
    const int n = nh < MAX_HB ? nh : MAX_HB;
    switch (n) {
      case 1: attend<DT, 1>(a, b, g, h0); break;
      case 2: attend<DT, 2>(a, b, g, h0); break;
      case 3: attend<DT, 3>(a, b, g, h0); break;
      case 4: attend<DT, 4>(a, b, g, h0); break;
      case 5: attend<DT, 5>(a, b, g, h0); break;
      case 6: attend<DT, 6>(a, b, g, h0); break;
      case 7: attend<DT, 7>(a, b, g, h0); break;
      default: attend<DT, 8>(a, b, g, h0); break;
    }
    h0 += n;
    nh -= n;
  }
}

}  // namespace

// out (B, H, dv) f32 = softmax(cap(kq_scale * q K^T)) V per sequence and query head, keys
// lo_b..pos[b] of cache row cache_rows[b] read in place (see the top of this file).
//   q: (B, H, dk) f32, row stride q_ld elements, each row's heads contiguous.
//   k, v: the layer's cache tensors, element strides (row, pos, kv head) ks*/vs*, innermost
//     dim contiguous; dtype 0 f32, 1 f16, 2 bf16 (both the same).
//   cache_rows, pos: int64 (B,).
//   head_block: query heads per task (1..H/Hkv; 0: chosen here from B, Hkv and the threads);
//     only the split of work, never the result.
//   min_parallel_work: multiply-adds (sum of keys x H x (dk + dv)) each thread must get (0: all threads).
// Returns 0; -1 for an unsupported shape (dk or dv not a multiple of 16 or > 512, H not a
// multiple of Hkv, unknown dtype), nothing written then.
LP_EXPORT int LP_FN(attn_decode)(const float* q, int64_t q_ld, const void* k, const void* v, int dtype, int64_t ks0,
                                 int64_t ks1, int64_t ks2, int64_t vs0, int64_t vs1, int64_t vs2,
                                 const int64_t* cache_rows, const int64_t* pos, int B, int H, int Hkv, int dk, int dv,
                                 float kq_scale, float softcap, int n_swa, int head_block, int64_t min_parallel_work,
                                 float* out, int nthreads) {
  if (B <= 0) return 0;
  if (Hkv <= 0 || H % Hkv || dk % 16 || dv % 16 || dk <= 0 || dv <= 0 || dk > MAX_D || dv > MAX_D) return -1;
  if (dtype < 0 || dtype > 2) return -1;
  const int rep = H / Hkv;
  // threads by work: each thread gets at least min_parallel_work multiply-adds (the caller
  // passes 256 K, worker/runtime/kernels/attn.py MIN_PARALLEL_WORK; 0: every thread), so a
  // short context's attention stays on the calling thread and a long one uses them all.  The
  // results do not depend on it.
  int64_t work = 0;
  for (int b = 0; b < B; ++b) {
    const int64_t p = pos[b], lo = n_swa > 0 && p - n_swa + 1 > 0 ? p - n_swa + 1 : 0;
    work += (p + 1 - lo) * (int64_t)H * (dk + dv);
  }
  int nt = 1;
  if (min_parallel_work <= 0) {
    nt = nthreads;
  } else {
    const int64_t by_work = work / min_parallel_work;
    nt = by_work >= nthreads ? nthreads : (by_work < 1 ? 1 : (int)by_work);
  }
  // auto head block: a KV head's query heads together (K/V read once), split only when there
  // are fewer (row, KV head) pairs than threads
  int hb = head_block;
  if (hb < 1) {
    const int pairs = B * Hkv, per = pairs >= nt ? 1 : (nt + pairs - 1) / pairs;
    hb = (rep + per - 1) / per;
  }
  if (hb > rep) hb = rep;
  const int nblk = (rep + hb - 1) / hb;
  const Args a{q, q_ld, k, v, ks0, ks1, ks2, vs0, vs1, vs2, cache_rows, pos, H, Hkv, dk, dv, kq_scale, softcap, n_swa, out};
  const int ntask = B * Hkv * nblk;
  lp::parallel_for(ntask, nt, [&](int t) {
    const int b = t / (Hkv * nblk), rest = t % (Hkv * nblk), g = rest / nblk, blk = rest % nblk;
    const int h0 = g * rep + blk * hb, nh = (blk + 1) * hb <= rep ? hb : rep - blk * hb;
    if (dtype == 0) attend_heads<0>(a, b, g, h0, nh);
    else if (dtype == 1) attend_heads<1>(a, b, g, h0, nh);
    else attend_heads<2>(a, b, g, h0, nh);
  });
  return 0;
}
