// The exported C ABI names of every kernel source: each ISA's library exports its functions as
// lp_<isa>_<name> (build.py binds them with ctypes), so the libraries of two ISAs never clash
// when both are loaded in one process. Everything else in a source stays hidden
// (-fvisibility=hidden) or in an anonymous namespace.
#pragma once

#if defined(LP_AMX)
#define LP_FN(name) lp_amx_##name
#elif defined(LP_AVX512)
#define LP_FN(name) lp_avx512_##name
#else
#define LP_FN(name) lp_avx2_##name
#endif
#define LP_EXPORT extern "C" __attribute__((visibility("default")))
