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
#include <stdlib.h>

#include "parallel.h"
#include "qmm_common.h"
#include "simd.h"

namespace {


// Dot products of NX activation rows with NR consecutive rank rows of one slot's A:
// out[x * ldo + j] = dot(xs[x], a + j*k). NX*NR independent accumulator chains share every
// load (A rows across activation rows: the SGMV case of rows with the same slot). Each chain
// is the same sequence (vector chunks of k in order, fixed horizontal sum, scalar tail)
// whatever NX and NR, so tiling never changes a value.
template <int NX, int NR>
inline void dots(const float* const* xs, const float* a, int k, float* out, int ldo) {
  vf acc[NX][NR];
  for (int x = 0; x < NX; ++x)
    for (int j = 0; j < NR; ++j) acc[x][j] = vzero();
  int t = 0;
  for (; t + W <= k; t += W) {
    vf av[NR];
    for (int j = 0; j < NR; ++j) av[j] = vload(a + (int64_t)j * k + t);
    for (int x = 0; x < NX; ++x) {
      const vf xv = vload(xs[x] + t);
      for (int j = 0; j < NR; ++j) acc[x][j] = vfma(xv, av[j], acc[x][j]);
    }
  }
  for (int x = 0; x < NX; ++x)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[x][j]);
      const float* aj = a + (int64_t)j * k;
      for (int u = t; u < k; ++u) s += xs[x][u] * aj[u];
      out[x * ldo + j] = s;
    }
}

// Ranks 0..r-1 of slot buffer a for NX rows (out row stride ldo).
template <int NX>
inline void shrink_rows(const float* const* xs, const float* a, int k, int r, float* out, int ldo) {
  int j = 0;
  if (NX == 1)
    for (; j + 8 <= r; j += 8) dots<1, 8>(xs, a + (int64_t)j * k, k, out + j, ldo);
  for (; j + 4 <= r; j += 4) dots<NX, 4>(xs, a + (int64_t)j * k, k, out + j, ldo);
  for (; j < r; ++j) dots<NX, 1>(xs, a + (int64_t)j * k, k, out + j, ldo);
}

constexpr int TR = 4;       // rows per task (a tile shares A loads between its rows' same-slot pairs)
constexpr int MAXP = 64;    // pairs of one tile handled with a stack scratch (more: heap)

}  // namespace

// x (n, ldx) f32; a (S, R, k), bt (S, R, d) f32 contiguous (the pool's slot buffers);
// rank (S,) int32 r_s; factor (S,) f32 alpha / r_s (0: no branch on this weight);
// pairs sorted by row: pair_slot (P,) int32, pair_scale (P,) f32 adapter_scale,
// row_ptr (n+1,) int32 (row i's pairs are row_ptr[i]..row_ptr[i+1]-1);
// y (n, ldy) f32, added to in place. Tasks = tiles of TR rows, one parallel region.
// Returns 0, or -1 when R exceeds the scratch bound (R > 256).
LP_EXPORT int LP_FN(lora_bgmv)(const float* x, int64_t ldx, int n, int k, const float* a, const float* bt, int R,
                               int d, const int32_t* rank, const float* factor, const int32_t* pair_slot,
                               const float* pair_scale, const int32_t* row_ptr, float* y, int64_t ldy,
                               int nthreads) {
  if (R > 256) return -1;
  const int ntile = (n + TR - 1) / TR;
  lp::parallel_for(ntile, nthreads, [&](int tile) {
    const int i0 = tile * TR, i1 = i0 + TR < n ? i0 + TR : n;
    const int p0 = row_ptr[i0], p1 = row_ptr[i1];
    const int np = p1 - p0;
    float stack_buf[MAXP * 16];
    float* heap = nullptr;
    float* xa = stack_buf;
    if ((int64_t)np * R > MAXP * 16) xa = heap = (float*)malloc(sizeof(float) * (size_t)np * R);
    int32_t row_of[MAXP];
    uint8_t done[MAXP] = {0};
    // --- shrink: xa[p - p0, :r] = c * A_s x_row; same-slot pairs of different rows tiled
    for (int i = i0; i < i1; ++i)
      for (int p = row_ptr[i]; p < row_ptr[i + 1]; ++p)
        if (p - p0 < MAXP) row_of[p - p0] = i;
    for (int p = p0; p < p1; ++p) {
      const int q = p - p0;
      if (q < MAXP && done[q]) continue;
      const int s = pair_slot[p], r = rank[s];
      if (r == 0 || pair_scale[p] * factor[s] == 0.0f) continue;
      const float* as = a + (int64_t)s * R * k;
      int row = q < MAXP ? row_of[q] : -1;
      if (row < 0) {  // beyond the tile's row table: find the row by row_ptr
        for (row = i0; row_ptr[row + 1] <= p; ++row) {
        }
      }
      int grp[TR] = {p};
      const float* xs[TR] = {x + (int64_t)row * ldx};
      int ng = 1;
      for (int p2 = p + 1; p2 < p1 && p2 - p0 < MAXP && ng < TR; ++p2)
        if (pair_slot[p2] == s && row_of[p2 - p0] != row_of[grp[ng - 1] - p0] &&
            pair_scale[p2] * factor[s] != 0.0f) {
          grp[ng] = p2;
          xs[ng++] = x + (int64_t)row_of[p2 - p0] * ldx;
        }
      const int ldo = (ng > 1 ? grp[1] - grp[0] : 1) * R;
      bool strided = true;  // the group's pairs equally spaced (one pair per row): one out stride
      for (int g = 2; g < ng; ++g) strided = strided && (grp[g] - grp[g - 1]) * R == ldo;
      if (!strided) ng = 1;
      float* o = xa + (int64_t)q * R;
      switch (ng) {
        case 4: shrink_rows<4>(xs, as, k, r, o, ldo); break;
        case 3: shrink_rows<3>(xs, as, k, r, o, ldo); break;
        case 2: shrink_rows<2>(xs, as, k, r, o, ldo); break;
        default: shrink_rows<1>(xs, as, k, r, o, R); ng = 1; break;
      }
      for (int g = 0; g < ng; ++g) {
        const float c = pair_scale[grp[g]] * factor[s];
        float* og = xa + (int64_t)(grp[g] - p0) * R;
        for (int j = 0; j < r; ++j) og[j] *= c;
        if (grp[g] - p0 < MAXP) done[grp[g] - p0] = 1;
      }
    }
    // --- expand: y_i += sum over row i's pairs (in order) and ranks (ascending) of xa * B row
    for (int i = i0; i < i1; ++i) {
      float* yi = y + (int64_t)i * ldy;
      int c0 = 0;
      for (; c0 + 4 * W <= d; c0 += 4 * W) {
        vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
        for (int p = row_ptr[i]; p < row_ptr[i + 1]; ++p) {
          const int s = pair_slot[p], r = rank[s];
          if (r == 0 || pair_scale[p] * factor[s] == 0.0f) continue;
          const float* b = bt + (int64_t)s * R * d + c0;
          const float* c = xa + (int64_t)(p - p0) * R;
          for (int j = 0; j < r; ++j) {
            const vf cv = vset1(c[j]);
            const float* bj = b + (int64_t)j * d;
            for (int v = 0; v < 4; ++v) acc[v] = vfma(cv, vload(bj + v * W), acc[v]);
          }
        }
        for (int v = 0; v < 4; ++v) vstore(yi + c0 + v * W, vadd(vload(yi + c0 + v * W), acc[v]));
      }
      for (; c0 + W <= d; c0 += W) {
        vf acc = vzero();
        for (int p = row_ptr[i]; p < row_ptr[i + 1]; ++p) {
          const int s = pair_slot[p], r = rank[s];
          if (r == 0 || pair_scale[p] * factor[s] == 0.0f) continue;
          const float* b = bt + (int64_t)s * R * d + c0;
          const float* c = xa + (int64_t)(p - p0) * R;
          for (int j = 0; j < r; ++j) acc = vfma(vset1(c[j]), vload(b + (int64_t)j * d), acc);
        }
        vstore(yi + c0, vadd(vload(yi + c0), acc));
      }
      for (int col = c0; col < d; ++col) {  // columns past the last full vector: scalar, same order
        float acc = 0.0f;
        for (int p = row_ptr[i]; p < row_ptr[i + 1]; ++p) {
          const int s = pair_slot[p], r = rank[s];
          if (r == 0 || pair_scale[p] * factor[s] == 0.0f) continue;
          const float* b = bt + (int64_t)s * R * d + col;
          const float* c = xa + (int64_t)(p - p0) * R;
          for (int j = 0; j < r; ++j) acc += c[j] * b[(int64_t)j * d];
        }
        yi[col] += acc;
      }
    }
    free(heap);
  });
  return 0;
}
