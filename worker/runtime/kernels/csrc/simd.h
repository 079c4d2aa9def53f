// The f32 vector vocabulary of the kernels that are plain vector code (attn.cpp, lora.cpp,
// norm.cpp, sample.cpp), written once for both vector widths: `vf` is __m512 (W = 16 lanes) in the
// avx512/amx libraries (-DLP_AVX512) and __m256 (W = 8) in the avx2 library, in the manner of
// ggml's GGML_F32_VEC macros (ggml-cpu/simd-mappings.h).  Operations whose intrinsic differs only
// in its width prefix come from one definition through LP_MM; the few whose instructions differ
// (masks, reductions, half-width loads) have one small definition per width below.  Every
// function is the exact instruction sequence the kernels used before they shared it, so results
// are unchanged bit for bit; reductions go in one fixed order (the tests' "alone = batched").
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace {

// The 4- and 8-lane horizontal sums, fixed trees: 8 -> 4 -> 2 -> 1.
inline float hsum4(__m128 b) {
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
inline float hsum8(__m256 a) { return hsum4(_mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1))); }

#if defined(LP_AVX512)
#define LP_MM(op) _mm512_##op
constexpr int W = 16;
using vf = __m512;   // f32 x 16
using vh = __m256;   // half of a vf: f32 x 8
using vi = __m512i;  // i32 x 16
using vd = __m512d;  // f64 x 8: half of a vf's lanes widened
using vhi16 = __m256i;  // 16 x 16-bit (f16 / bf16) values, one per lane of a vf
inline vh vlow(vf x) { return _mm512_castps512_ps256(x); }
inline vh vhigh(vf x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }
inline vh vhload(const float* p) { return _mm256_loadu_ps(p); }
inline vhi16 vload16(const uint16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline vf vcast(vi x) { return _mm512_castsi512_ps(x); }
inline float hsum(vf x) { return hsum8(_mm256_add_ps(vlow(x), vhigh(x))); }
inline float hmax(vf a) { return _mm512_reduce_max_ps(a); }
inline unsigned vgt(vf a, vf b) { return (unsigned)_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// val where x >= lo, else 0.
inline vf vkeep_ge(vf x, float lo, vf val) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), val);
}
// a where x >= lo, else b.
inline vf vselect_ge(vf x, float lo, vf a, vf b) {
  return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), a);
}
#else
#define LP_MM(op) _mm256_##op
constexpr int W = 8;
using vf = __m256;
using vh = __m128;
using vi = __m256i;
using vd = __m256d;
using vhi16 = __m128i;
inline vh vlow(vf x) { return _mm256_castps256_ps128(x); }
inline vh vhigh(vf x) { return _mm256_extractf128_ps(x, 1); }
inline vh vhload(const float* p) { return _mm_loadu_ps(p); }
inline vhi16 vload16(const uint16_t* p) { return _mm_loadu_si128((const __m128i*)p); }
inline vf vcast(vi x) { return _mm256_castsi256_ps(x); }
inline float hsum(vf x) { return hsum8(x); }
inline float hmax(vf a) {
  float t[W];
  _mm256_storeu_ps(t, a);
  float m = t[0];
  for (int i = 1; i < W; ++i) m = t[i] > m ? t[i] : m;
  return m;
}
inline unsigned vgt(vf a, vf b) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vkeep_ge(vf x, float lo, vf val) { return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ), val); }
inline vf vselect_ge(vf x, float lo, vf a, vf b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ));
}
#endif

inline vf vzero() { return LP_MM(setzero_ps)(); }
inline vf vset1(float x) { return LP_MM(set1_ps)(x); }
inline vf vload(const float* p) { return LP_MM(loadu_ps)(p); }
inline void vstore(float* p, vf x) { LP_MM(storeu_ps)(p, x); }
inline vf vadd(vf a, vf b) { return LP_MM(add_ps)(a, b); }
inline vf vsub(vf a, vf b) { return LP_MM(sub_ps)(a, b); }
inline vf vmul(vf a, vf b) { return LP_MM(mul_ps)(a, b); }
inline vf vmax(vf a, vf b) { return LP_MM(max_ps)(a, b); }
inline vf vmin(vf a, vf b) { return LP_MM(min_ps)(a, b); }
inline vf vdiv(vf a, vf b) { return LP_MM(div_ps)(a, b); }
inline vf vfma(vf a, vf b, vf c) { return LP_MM(fmadd_ps)(a, b, c); }    // a*b + c
inline vf vfnma(vf a, vf b, vf c) { return LP_MM(fnmadd_ps)(a, b, c); }  // c - a*b
// 2^n for n a vector of integral floats (by the exponent bits; n in -126..127).
inline vf vpow2(vf n) {
  return vcast(LP_MM(slli_epi32)(LP_MM(add_epi32)(LP_MM(cvtps_epi32)(n), LP_MM(set1_epi32)(127)), 23));
}
// W f16 / bf16 values (raw 16-bit) as f32.
inline vf vload_f16(const uint16_t* p) { return LP_MM(cvtph_ps)(vload16(p)); }
inline vf vload_bf16(const uint16_t* p) { return vcast(LP_MM(slli_epi32)(LP_MM(cvtepu16_epi32)(vload16(p)), 16)); }

// f64 halves: a vf's low / high W/2 lanes, or W/2 floats from memory, widened.
inline vd vdzero() { return LP_MM(setzero_pd)(); }
inline vd vdadd(vd a, vd b) { return LP_MM(add_pd)(a, b); }
inline vd vdfma(vd a, vd b, vd c) { return LP_MM(fmadd_pd)(a, b, c); }
inline vd vdload(const float* p) { return LP_MM(cvtps_pd)(vhload(p)); }
inline void vdstore(double* p, vd x) { LP_MM(storeu_pd)(p, x); }
// lo += the low W/2 lanes of a, hi += the high W/2 lanes, in f64.
inline void vdacc(vd& lo, vd& hi, vf a) {
  lo = vdadd(lo, LP_MM(cvtps_pd)(vlow(a)));
  hi = vdadd(hi, LP_MM(cvtps_pd)(vhigh(a)));
}
#undef LP_MM

// The horizontal sums of 8 vectors at once: v holds 8 consecutive vf (8 x W floats), out[i] = the
// sum of the W lanes of vector i (i = 0..7).  A fixed tree (AVX-512: each vector's two halves
// added first; then pairwise hadds and one cross-lane add), 7 adds for 8 sums where hsum takes
// 3 per sum; the attention kernel's scores go through it 8 keys at a time.
inline void hsum_x8(const float* v, float* out) {
  __m256 h[8];
  for (int i = 0; i < 8; ++i) {
#if defined(LP_AVX512)
    const vf x = vload(v + i * W);
    h[i] = _mm256_add_ps(vlow(x), vhigh(x));
#else
    h[i] = _mm256_loadu_ps(v + i * W);
#endif
  }
  const __m256 h01 = _mm256_hadd_ps(h[0], h[1]), h23 = _mm256_hadd_ps(h[2], h[3]);
  const __m256 h45 = _mm256_hadd_ps(h[4], h[5]), h67 = _mm256_hadd_ps(h[6], h[7]);
  // [sums of lanes 0-3 of v0..v3 | sums of lanes 4-7 of v0..v3], the same for v4..v7
  const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}

// Cephes expf constants (public domain): ln2 split for the reduction, polynomial for e^r.
constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;
constexpr float EXP_LO = -87.0f;   // below: exp is 0 (e^-87 < 1.7e-38; 2^n stays a normal float)

// e^x for x <= 0 (x < EXP_LO, -inf included, gives 0).
inline vf vexp(vf x) {
  const vf x0 = x;
  x = vmax(x, vset1(EXP_LO));
  const vf n = vround(vmul(x, vset1(LOG2E)));
  vf r = vfnma(n, vset1(LN2_HI), x);
  r = vfnma(n, vset1(LN2_LO), r);
  vf p = vfma(vset1(P0), r, vset1(P1));
  p = vfma(p, r, vset1(P2));
  p = vfma(p, r, vset1(P3));
  p = vfma(p, r, vset1(P4));
  p = vfma(p, r, vset1(P5));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vkeep_ge(x0, EXP_LO, vmul(p, vpow2(n)));
}

// 1 / (1 + e^-z) for any z, through e = e^-|z| (never overflows): 1/(1+e) for z >= 0, e/(1+e) below.
inline vf vsigmoid(vf z) {
  const vf e = vexp(vmin(z, vsub(vzero(), z)));
  const vf inv = vdiv(vset1(1.0f), vadd(vset1(1.0f), e));
  return vselect_ge(z, 0.0f, inv, vmul(e, inv));
}

}  // namespace
