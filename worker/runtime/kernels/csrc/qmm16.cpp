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
