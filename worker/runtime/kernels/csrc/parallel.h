// The one place the C kernels go parallel: lp::parallel_for(n, nthreads, f) runs f(i) for
// i in [0, n) split into nthreads contiguous static chunks (chunk t gets
// [t*n/nthreads, (t+1)*n/nthreads)), so which thread computes which index never depends on
// timing, and every index is computed by the same code whatever the thread count (rows and
// output groups stay bit-identical with 1 or 2 threads).
//
// Implementation: OpenMP (torch's libgomp, see build.py). Every kernel calls this and nothing
// else, so the threading backend can change here without touching a kernel.
#pragma once

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace lp {

template <class F>
inline void parallel_for(int n, int nthreads, F&& f) {
  if (nthreads > n) nthreads = n;
  if (nthreads <= 1) {
    for (int i = 0; i < n; ++i) f(i);
    return;
  }
#pragma omp parallel num_threads(nthreads)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    const int lo = (int)((int64_t)n * t / nt), hi = (int)((int64_t)n * (t + 1) / nt);
    for (int i = lo; i < hi; ++i) f(i);
  }
}

}  // namespace lp
