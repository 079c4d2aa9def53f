// One decoder layer of a ubatch in one call (the CPU engine's layer kernel).
//
// The layer of llama.cpp's dense decoders (src/models/{llama,qwen2,qwen3,gemma2,gemma3,phi3}.cpp)
// with each architecture's distinctive rules as parameters (LpLayer below):
//   cur = rms_norm(x, attn_norm)
//   [q|k|v] = cur @ Wqkv.T (one or several packed matmuls) + each part's LoRA (BGMV) + bias
//   q, k = rms_norm per head (q_norm / k_norm, optional); rope (NEOX or NORM, the caller's
//   cos/sin tables: frequency factors and attention factor already in them); q *= q_scale
//   K/V rows written into the cache at (cache_row, pos); attention per row and query head over
//   the keys lo..pos of its cache row (attn.cpp: causal, sliding window, soft-cap)
//   o = attn @ Wo.T + LoRA;  o = rms_norm(o, post_attn_norm) (optional);  x += o
//   cur = rms_norm(x, ffn_norm); [g|u] = cur @ W.T + LoRA; h = act(g) * u  (silu or tanh-gelu)
//   f = h @ Wdown.T + LoRA;  f = rms_norm(f, post_ffw_norm) (optional);  x += f
// or, with experts (n_expert > 0; src/llama-graph.cpp build_moe_ffn, softmax gating):
//   p = softmax(cur @ gate_inp.T); the top n_expert_used experts of each row, weights w (renormalised
//   when moe_norm_w); f = sum_j w_j * FFN_{e_j}(cur), each expert's gated FFN on its rows only
// Everything runs here through the library's own kernels (qmm*, lora_bgmv, rms_norm,
// attn_decode): one ctypes crossing per layer instead of ~20 torch ops.  The torch path
// (worker/runtime/layer.py, reference_layer) stays the reference the tests compare with.
//
// Rows are independent (every kernel used computes a row by a fixed sequence of operations), so
// a row's result is bit-identical alone or batched, with any thread count.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "api.h"
#include "parallel.h"
#include "simd.h"

namespace {

constexpr int64_t ELEM_MIN_PARALLEL = 1 << 16;  // elements of an elementwise pass worth a 2nd thread
constexpr int MAX_SIDE_RANK = 256;  // largest expert LoRA rank (worker/runtime/kernels/layer.py MAX_SIDE_RANK)

// A byte arena per calling thread, grown on demand and kept between calls (no allocation per
// layer once a ubatch size has been seen).
struct Arena {
  std::vector<char> buf;
  size_t used = 0;
  void reset(size_t need) {
    if (buf.size() < need) buf.resize(need);
    used = 0;
  }
  template <class T>
  T* take(int64_t count) {
    T* p = (T*)(buf.data() + used);
    used += ((size_t)count * sizeof(T) + 63) & ~(size_t)63;
    return p;
  }
};
thread_local Arena g_arena;

inline size_t bytes_for(int64_t count, size_t es) { return ((size_t)count * es + 63) & ~(size_t)63; }

// Activations of one input quantized once per precision and shared by the matmuls that read it.
struct Quantized {
  const float* x = nullptr;
  int64_t ldx = 0;
  int n = 0, k = 0;
  bool have[2] = {false, false};  // [act]: 0 i16, 1 i8
  int16_t* q16 = nullptr;
  int8_t* q8 = nullptr;
  float *ad = nullptr, *as16 = nullptr, *as32 = nullptr;      // i16 scales
  float *ad8 = nullptr, *as16_8 = nullptr, *as32_8 = nullptr;  // i8 scales
};

void quantize(Quantized& qa, int act, int nthreads) {
  if (qa.have[act]) return;
  const int n = qa.n, k = qa.k;
  if (act == 0) {
    LP_FN(quantize_act16)(qa.x, qa.ldx, n, k, qa.q16, qa.ad, qa.as16, qa.as32, nthreads);
  } else {
    LP_FN(quantize_act)(qa.x, qa.ldx, n, k, qa.q8, qa.ad8, qa.as16_8, qa.as32_8, nthreads);
  }
  qa.have[act] = true;
}

Quantized make_quantized(const float* x, int64_t ldx, int n, int k) {
  Quantized qa;
  qa.x = x;
  qa.ldx = ldx;
  qa.n = n;
  qa.k = k;
  qa.q16 = g_arena.take<int16_t>((int64_t)n * k);
  qa.q8 = g_arena.take<int8_t>((int64_t)n * k);
  qa.ad = g_arena.take<float>((int64_t)n * k / 32);
  qa.as16 = g_arena.take<float>((int64_t)n * k / 16);
  qa.as32 = g_arena.take<float>((int64_t)n * k / 32);
  qa.ad8 = g_arena.take<float>((int64_t)n * k / 32);
  qa.as16_8 = g_arena.take<float>((int64_t)n * k / 16);
  qa.as32_8 = g_arena.take<float>((int64_t)n * k / 32);
  return qa;
}

size_t quantized_bytes(int n, int k) {
  const int64_t nk = (int64_t)n * k;
  return bytes_for(nk, 2) + bytes_for(nk, 1) + 2 * (bytes_for(nk / 32, 4) * 2 + bytes_for(nk / 16, 4));
}

}  // namespace

// y (n, ld_y) columns [0, proj.d) = x @ W.T for each packed matmul (outputs side by side), then
// each part's LoRA and bias.  Returns 0 or the failing kernel's code.
static int run_proj(const LpProj& proj, Quantized& qa, const LpPairs& pairs, float* y, int64_t ldy, float* tmp,
                    int nthreads) {
  const int n = qa.n;
  int col = 0;
  for (int m = 0; m < proj.n_mm; ++m) {
    const LpMatmul& w = proj.mm[m];
    const bool direct = proj.n_mm == 1 && ldy == w.d;
    float* out = direct ? y : tmp;
    int rc;
    if (w.act == 2) {  // bf16 on AMX-BF16 tiles, read from the f32 input (nothing to quantize)
#if defined(LP_AMX)
      rc = LP_FN(qmmbf16_f32)(qa.x, qa.ldx, n, w.k, w.qw, w.sc, w.bias, w.off, w.d, w.bs, w.is_signed, out, nthreads);
#else
      rc = -1;
#endif
    } else if (w.act == 0) {
      quantize(qa, 0, nthreads);
      rc = LP_FN(qmm16)(w.qw, w.sc, w.bias, w.off, w.d, w.k, w.bs, w.is_signed, qa.q16, qa.ad, qa.as16, qa.as32, n,
                        out, nthreads);
    } else {
      quantize(qa, 1, nthreads);
      rc = LP_FN(qmm)(w.qw, w.sc, w.bias, w.off, w.d, w.k, w.bs, w.is_signed, qa.q8, qa.ad8, qa.as16_8, qa.as32_8, n,
                      out, nthreads);
    }
    if (rc != 0) return rc;
    if (!direct)
      for (int i = 0; i < n; ++i) memcpy(y + (int64_t)i * ldy + col, out + (int64_t)i * w.d, sizeof(float) * w.d);
    col += w.d;
  }
  for (int p = 0; p < proj.n_part; ++p) {
    const LpLora& part = proj.part[p];
    if (part.lora_a && pairs.row_ptr) {
      const int rc = LP_FN(lora_bgmv)(qa.x, qa.ldx, n, qa.k, part.lora_a, part.lora_bt, part.lora_R, part.d,
                                      part.lora_rank, part.lora_factor, pairs.slot, pairs.scale, pairs.row_ptr,
                                      y + part.col, ldy, part.lora_nthreads);
      if (rc != 0) return rc;
    }
    if (part.add_bias) {
      for (int i = 0; i < n; ++i) {
        float* yr = y + (int64_t)i * ldy + part.col;
        for (int j = 0; j < part.d; ++j) yr[j] = yr[j] + part.add_bias[j];
      }
    }
  }
  return 0;
}

namespace {

// Rotate each head of row i in place: pairs (j, j + n_rot/2) (NEOX) or (2j, 2j + 1) (NORM) by
// cos/sin (n, n_rot/2); dims past n_rot pass through (ggml_rope_ext).
inline void rope_row(float* x, int nh, int dh, int n_rot, int neox, const float* cs, const float* sn) {
  const int half = n_rot / 2;
  for (int h = 0; h < nh; ++h) {
    float* v = x + (int64_t)h * dh;
    if (neox) {
      for (int j = 0; j < half; ++j) {
        const float x1 = v[j], x2 = v[j + half];
        const float a = x1 * cs[j], b = x2 * sn[j], c = x2 * cs[j], d = x1 * sn[j];
        v[j] = a - b;
        v[j + half] = c + d;
      }
    } else {
      for (int j = 0; j < half; ++j) {
        const float x1 = v[2 * j], x2 = v[2 * j + 1];
        const float a = x1 * cs[j], b = x2 * sn[j], c = x2 * cs[j], d = x1 * sn[j];
        v[2 * j] = a - b;
        v[2 * j + 1] = c + d;
      }
    }
  }
}

inline uint16_t to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
inline uint16_t to_bf16(float f) {  // round to nearest even, NaN kept quiet (torch's conversion)
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// Write nh * dh floats into the cache (dtype 0 f32, 1 f16, 2 bf16) at element offset off.
inline void store_kv(void* cache, int dtype, int64_t off, const float* src, int nh, int dh, int64_t head_stride) {
  for (int h = 0; h < nh; ++h) {
    const float* s = src + (int64_t)h * dh;
    const int64_t o = off + (int64_t)h * head_stride;
    if (dtype == 0) {
      memcpy((float*)cache + o, s, sizeof(float) * dh);
    } else if (dtype == 1) {
      uint16_t* d = (uint16_t*)cache + o;
      for (int j = 0; j < dh; ++j) d[j] = to_f16(s[j]);
    } else {
      uint16_t* d = (uint16_t*)cache + o;
      for (int j = 0; j < dh; ++j) d[j] = to_bf16(s[j]);
    }
  }
}

// The gated activation of one row: h = act(g) * u over nff columns (a multiple of 32).
// SiLU(x) = x * sigmoid(x); ggml_gelu's tanh form 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
// is x * sigmoid(2u) (the same function, never overflowing); sigmoid by the vector e^x of simd.h
// (Cephes), within a few ulp of torch's F.silu / F.gelu(approximate="tanh").
inline void gated_act(const float* g, const float* u, float* h, int nff, int act) {
  const vf two_beta = vset1(2.0f * 0.7978845608028654f), kappa = vset1(0.044715f);
  for (int j = 0; j < nff; j += W) {
    const vf x = vload(g + j);
    vf z = x;
    if (act == 1) z = vmul(two_beta, vfma(vmul(kappa, vmul(x, x)), x, x));
    vstore(h + j, vmul(vmul(x, vsigmoid(z)), vload(u + j)));
  }
}

void rms_rows(const float* x, int64_t ldx, const float* w, int n, int d, float eps, float* y, int64_t ldy,
              int64_t min_parallel, int nthreads) {
  LP_FN(rms_norm)(x, ldx, w, n, d, eps, y, ldy, min_parallel, nthreads);
}

}  // namespace

// Expert e's LoRA branches (layer.h LpSide) added to its output rows: for each of the m rows routed
// to it (who[t] / K is the ubatch row), y[t] (ldy, columns col..col+dout-1) += B_e (s * A_e x[t]),
// s = row_slot[row, slot] * factor, branches in order; the rank-r product in double.  Per row a
// fixed sequence of operations, as the graph's side branches (graph.py build_lora_mm_id).
static void expert_lora(const LpLayer* L, int w, int e, const float* x, int k, const std::vector<int>& who, int K,
                        float* y, int64_t ldy, int col, int dout, int nthreads) {
  const int m = (int)who.size();
  for (int j = 0; j < L->n_side[w]; ++j) {
    const LpSide& br = L->side[w][j];
    const int r = br.r;
    const float* A = br.a + (int64_t)e * r * k;
    const float* B = br.b + (int64_t)e * dout * r;
    lp::parallel_for(m, (int64_t)m * r * (k + dout) >= ELEM_MIN_PARALLEL ? nthreads : 1, [&](int t) {
      const float s = L->row_slot[(int64_t)(who[t] / K) * L->n_slot_cols + br.slot] * br.factor;
      if (s == 0.0f) return;
      const float* xr = x + (int64_t)t * k;
      float u[MAX_SIDE_RANK];
      for (int q = 0; q < r; ++q) {
        double acc = 0.0;
        for (int c = 0; c < k; ++c) acc += (double)A[(int64_t)q * k + c] * (double)xr[c];
        u[q] = (float)acc * s;
      }
      float* yr = y + (int64_t)t * ldy + col;
      for (int c = 0; c < dout; ++c) {
        double acc = 0.0;
        for (int q = 0; q < r; ++q) acc += (double)B[(int64_t)c * r + q] * (double)u[q];
        yr[c] = yr[c] + (float)acc;
      }
    });
  }
}

// The mixture of experts of one layer on cur (n, n_embd) -> out (n, n_embd) (see layer.h LpLayer).
// Per row: router logits in double over n_embd in order (rounded to f32, plus the router's LoRA
// when a slot in use has one), softmax over the experts in double, the top
// n_expert_used picked one by one (largest first, ties to the lower index).  Per expert, the rows
// routed to it (in row order) are gathered and run through its packed matmuls, whose results
// per row do not depend on the other rows; each row then sums its experts' outputs in its own
// top-k order.  So a row's result is bit-identical alone or batched.  gu (n, 2 n_ff), h (n, n_ff)
// and tmp (n, max matmul width) are the caller's buffers; the arena past qmark is free.
// Returns 0, or the failing kernel's code.
static int moe_ffn(const LpLayer* L, const float* cur, int n, const LpPairs& pr, float* out, float* gu, float* h,
                   float* tmp, size_t qmark, int nthreads) {
  const int d = L->n_embd, E = L->n_expert, K = L->n_expert_used, nff = L->n_ff;
  // kept per calling thread between calls; the workers below reach them through these pointers
  // (a thread_local named inside the lambda would be the worker's own)
  thread_local std::vector<int> sel_buf;
  thread_local std::vector<float> lg_buf, w_buf, y_buf, xe_buf;
  lg_buf.resize((size_t)n * E);
  sel_buf.resize((size_t)n * K);
  w_buf.resize((size_t)n * K);
  y_buf.resize((size_t)n * K * d);
  xe_buf.resize((size_t)n * d);
  int* const sel = sel_buf.data();      // (n, K) each row's chosen experts, most probable first
  float* const wsel = w_buf.data();     // (n, K) their weights
  float* const y = y_buf.data();        // (n, K, d) each (row, choice)'s expert output
  float* const xe = xe_buf.data();      // (m, d) the rows routed to one expert
  float* const lg = lg_buf.data();      // (n, E) router logits
  const int par = (int64_t)n * E * d >= ELEM_MIN_PARALLEL ? nthreads : 1;
  lp::parallel_for(n, par, [&](int i) {  // router logits, each a double sum over n_embd in order
    const float* xr = cur + (int64_t)i * d;
    for (int e = 0; e < E; ++e) {
      const float* wr = L->gate_inp + (int64_t)e * d;
      double acc = 0.0;
      for (int j = 0; j < d; ++j) acc += (double)xr[j] * (double)wr[j];
      lg[(int64_t)i * E + e] = (float)acc;
    }
  });
  if (L->router.n_part > 0) {  // the router's LoRA (BGMV over the ubatch's (row, slot) pairs)
    g_arena.used = qmark;
    Quantized qa = make_quantized(cur, d, n, d);
    if (int rc = run_proj(L->router, qa, pr, lg, E, tmp, nthreads)) return rc;
  }
  lp::parallel_for(n, par, [&](int i) {
    std::vector<double> p(E);
    std::vector<char> taken(E, 0);
    double mx = -INFINITY;
    for (int e = 0; e < E; ++e) {
      p[e] = (double)lg[(int64_t)i * E + e];
      mx = p[e] > mx ? p[e] : mx;
    }
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += (p[e] = exp(p[e] - mx));
    double wsum = 0.0;
    for (int j = 0; j < K; ++j) {  // a NaN never wins a comparison: the first expert not taken stands
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      sel[(size_t)i * K + j] = best;
      wsel[(size_t)i * K + j] = (float)(p[best] / sum);
      wsum += p[best] / sum;
    }
    if (L->moe_norm_w)
      for (int j = 0; j < K; ++j) wsel[(size_t)i * K + j] = (float)((double)wsel[(size_t)i * K + j] / wsum);
  });
  std::vector<int> who;  // the (row * K + choice) entries routed to the current expert
  who.reserve(n);
  const LpPairs none{nullptr, nullptr, nullptr};
  for (int e = 0; e < E; ++e) {
    who.clear();
    for (int64_t r = 0; r < (int64_t)n * K; ++r)
      if (sel[r] == e) who.push_back((int)r);
    const int m = (int)who.size();
    if (m == 0) continue;
    for (int t = 0; t < m; ++t) memcpy(xe + (int64_t)t * d, cur + (int64_t)(who[t] / K) * d, sizeof(float) * d);
    g_arena.used = qmark;
    {
      Quantized qa = make_quantized(xe, d, m, d);
      if (int rc = run_proj(L->exp_in[e], qa, none, gu, 2 * nff, tmp, nthreads)) return rc;
    }
    expert_lora(L, 0, e, xe, d, who, K, gu, 2 * nff, 0, nff, nthreads);
    expert_lora(L, 1, e, xe, d, who, K, gu, 2 * nff, nff, nff, nthreads);
    lp::parallel_for(m, (int64_t)m * nff >= ELEM_MIN_PARALLEL ? nthreads : 1, [&](int t) {
      const float* g = gu + (int64_t)t * 2 * nff;
      gated_act(g, g + nff, h + (int64_t)t * nff, nff, L->act);
    });
    g_arena.used = qmark;
    {
      Quantized qa = make_quantized(h, nff, m, nff);
      if (int rc = run_proj(L->exp_down[e], qa, none, tmp, d, gu, nthreads)) return rc;
    }
    expert_lora(L, 2, e, h, nff, who, K, tmp, d, 0, d, nthreads);
    for (int t = 0; t < m; ++t) memcpy(y + (int64_t)who[t] * d, tmp + (int64_t)t * d, sizeof(float) * d);
  }
  for (int i = 0; i < n; ++i) {
    float* o = out + (int64_t)i * d;
    for (int c = 0; c < d; ++c) o[c] = 0.0f;
    for (int j = 0; j < K; ++j) {
      const float w = wsel[(size_t)i * K + j];
      const float* yr = y + ((int64_t)i * K + j) * d;
      for (int c = 0; c < d; ++c) o[c] = o[c] + w * yr[c];
    }
  }
  return 0;
}

// One decoder layer over the n rows of a ubatch (see the top of this file): x (n, n_embd) f32
// row-major, the residual stream, updated in place.  cache_rows / pos: int64 (n,), each row's
// KV-cache row and position; cos / sin: f32 (n, n_rot/2) (NULL when n_rot is 0); pairs: the
// ubatch's LoRA (row, slot) pairs (row_ptr NULL: no LoRA).  Returns 0; -1 an unsupported shape
// (the attention kernel's rules: head dims multiples of 16 and <= 512, H a multiple of Hkv);
// -2 a matmul or LoRA kernel refused its form (nothing is guaranteed written then).
LP_EXPORT int LP_FN(layer_forward)(const LpLayer* L, float* x, int n, const int64_t* cache_rows, const int64_t* pos,
                                   const float* cos_t, const float* sin_t, const LpPairs* pairs, int nthreads) {
  if (n <= 0) return 0;
  lp::BurstScope burst;  // the layer's dispatches follow each other within microseconds
  const int d = L->n_embd, H = L->n_head, Hkv = L->n_head_kv, dk = L->dk, dv = L->dv;
  if (Hkv <= 0 || H % Hkv || dk % 16 || dv % 16 || dk > 512 || dv > 512 || d % 32) return -1;
  const int dq = H * dk, dkv = Hkv * dk, dvv = Hkv * dv, dqkv = dq + dkv + dvv;
  const int nff = L->n_ff, d_ffn_in = 2 * nff;
  const int E = L->n_expert;  // with experts, ffn_in / down are unused (the experts' projections are checked below)
  if (L->qkv.d != dqkv || L->wo.d != d || nff % 32 || (H * dv) % 32) return -1;
  if (E == 0 && (L->ffn_in.d != d_ffn_in || L->down.d != d)) return -1;
  if (E > 0 && (!L->gate_inp || !L->exp_in || !L->exp_down || L->n_expert_used < 1 || L->n_expert_used > E ||
                L->router.n_mm != 0 || (L->router.n_part > 0 && L->router.d != E)))
    return -1;
  for (int w = 0; w < 3; ++w)
    for (int j = 0; j < (E > 0 ? L->n_side[w] : 0); ++j)
      if (!L->row_slot || L->side[w][j].r < 1 || L->side[w][j].r > MAX_SIDE_RANK || L->side[w][j].slot < 0 ||
          L->side[w][j].slot >= L->n_slot_cols)
        return -1;
  int max_mm = 0;
  for (const LpProj* p : {&L->qkv, &L->wo, &L->ffn_in, &L->down})
    for (int m = 0; m < p->n_mm; ++m) max_mm = p->mm[m].d > max_mm ? p->mm[m].d : max_mm;
  for (int e = 0; e < E; ++e) {
    if (L->exp_in[e].d != d_ffn_in || L->exp_down[e].d != d) return -1;
    for (const LpProj* p : {&L->exp_in[e], &L->exp_down[e]})
      for (int m = 0; m < p->n_mm; ++m) max_mm = p->mm[m].d > max_mm ? p->mm[m].d : max_mm;
  }
  const int kmax = nff > d ? (nff > H * dv ? nff : H * dv) : (d > H * dv ? d : H * dv);
  const size_t need = bytes_for((int64_t)n * d, 4) * 2 + bytes_for((int64_t)n * dqkv, 4) +
                      bytes_for((int64_t)n * H * dv, 4) + bytes_for((int64_t)n * d_ffn_in, 4) +
                      bytes_for((int64_t)n * nff, 4) + bytes_for((int64_t)n * max_mm, 4) + quantized_bytes(n, kmax) +
                      4096;
  g_arena.reset(need);
  float* cur = g_arena.take<float>((int64_t)n * d);
  float* qkv = g_arena.take<float>((int64_t)n * dqkv);
  float* att = g_arena.take<float>((int64_t)n * H * dv);
  float* o = g_arena.take<float>((int64_t)n * d);
  float* gu = g_arena.take<float>((int64_t)n * d_ffn_in);
  float* h = g_arena.take<float>((int64_t)n * nff);
  float* tmp = g_arena.take<float>((int64_t)n * max_mm);
  const size_t qmark = g_arena.used;
  const LpPairs& pr = *pairs;
  const float eps = L->eps;
  const int64_t nmin = L->norm_min_parallel;

  // --- attention block
  rms_rows(x, d, L->attn_norm, n, d, eps, cur, d, nmin, nthreads);
  {
    Quantized qa = make_quantized(cur, d, n, d);
    if (run_proj(L->qkv, qa, pr, qkv, dqkv, tmp, nthreads)) return -2;
  }
  g_arena.used = qmark;
  const int half = L->n_rot / 2;
  const int64_t ks0 = L->ks0, ks1 = L->ks1, ks2 = L->ks2, vs0 = L->vs0, vs1 = L->vs1, vs2 = L->vs2;
  const int elem_par = (int64_t)n * dqkv >= ELEM_MIN_PARALLEL ? nthreads : 1;
  lp::parallel_for(n, elem_par, [&](int i) {
    float* q = qkv + (int64_t)i * dqkv;
    float* k = q + dq;
    const float* v = k + dkv;
    if (L->q_norm) rms_rows(q, dk, L->q_norm, H, dk, eps, q, dk, INT64_MAX, 1);
    if (L->k_norm) rms_rows(k, dk, L->k_norm, Hkv, dk, eps, k, dk, INT64_MAX, 1);
    if (half > 0) {
      rope_row(q, H, dk, L->n_rot, L->neox, cos_t + (int64_t)i * half, sin_t + (int64_t)i * half);
      rope_row(k, Hkv, dk, L->n_rot, L->neox, cos_t + (int64_t)i * half, sin_t + (int64_t)i * half);
    }
    if (L->q_scale != 1.0f)
      for (int j = 0; j < dq; ++j) q[j] = q[j] * L->q_scale;
    store_kv(L->k_cache, L->kv_dtype, cache_rows[i] * ks0 + pos[i] * ks1, k, Hkv, dk, ks2);
    store_kv(L->v_cache, L->kv_dtype, cache_rows[i] * vs0 + pos[i] * vs1, v, Hkv, dv, vs2);
  });
  if (LP_FN(attn_decode)(qkv, dqkv, L->k_cache, L->v_cache, L->kv_dtype, ks0, ks1, ks2, vs0, vs1, vs2, cache_rows,
                         pos, n, H, Hkv, dk, dv, L->kq_scale, L->softcap, L->n_swa, 0, L->attn_min_parallel_work,
                         att, nthreads))
    return -1;
  {
    Quantized qa = make_quantized(att, (int64_t)H * dv, n, H * dv);
    if (run_proj(L->wo, qa, pr, o, d, tmp, nthreads)) return -2;
  }
  g_arena.used = qmark;
  if (L->post_attn_norm) rms_rows(o, d, L->post_attn_norm, n, d, eps, o, d, nmin, nthreads);
  for (int64_t j = 0; j < (int64_t)n * d; ++j) x[j] = o[j] + x[j];

  // --- feed-forward block
  rms_rows(x, d, L->ffn_norm, n, d, eps, cur, d, nmin, nthreads);
  if (E > 0) {
    if (moe_ffn(L, cur, n, pr, o, gu, h, tmp, qmark, nthreads)) return -2;
    if (L->post_ffw_norm) rms_rows(o, d, L->post_ffw_norm, n, d, eps, o, d, nmin, nthreads);
    for (int64_t j = 0; j < (int64_t)n * d; ++j) x[j] = o[j] + x[j];
    return 0;
  }
  {
    Quantized qa = make_quantized(cur, d, n, d);
    if (run_proj(L->ffn_in, qa, pr, gu, d_ffn_in, tmp, nthreads)) return -2;
  }
  g_arena.used = qmark;
  const int act = L->act;
  lp::parallel_for(n, (int64_t)n * nff >= ELEM_MIN_PARALLEL ? nthreads : 1, [&](int i) {
    const float* g = gu + (int64_t)i * d_ffn_in;
    const float* u = g + nff;
    gated_act(g, u, h + (int64_t)i * nff, nff, act);
  });
  {
    Quantized qa = make_quantized(h, nff, n, nff);
    if (run_proj(L->down, qa, pr, o, d, tmp, nthreads)) return -2;
  }
  if (L->post_ffw_norm) rms_rows(o, d, L->post_ffw_norm, n, d, eps, o, d, nmin, nthreads);
  for (int64_t j = 0; j < (int64_t)n * d; ++j) x[j] = o[j] + x[j];
  return 0;
}

LP_EXPORT void LP_FN(layer_abi)(int64_t* sizes) {
  sizes[0] = sizeof(LpMatmul);
  sizes[1] = sizeof(LpLora);
  sizes[2] = sizeof(LpProj);
  sizes[3] = sizeof(LpPairs);
  sizes[4] = sizeof(LpLayer);
  sizes[5] = sizeof(LpSide);
}
