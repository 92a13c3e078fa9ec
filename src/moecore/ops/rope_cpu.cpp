// CPU RoPE: a [S, D/2] cos/sin table in double (rounded to the compute type), then the
// rotation over all (b, s, n) rows in parallel.
#include <cmath>
#include <vector>

#include "moecore/ops/common.h"
#include "moecore/ops/rope.h"

namespace moecore::ops::cpu {

void rope(const Tensor& in, Tensor& out, const RopeFrequencies& f, int64_t position_offset, bool inverse) {
  const int64_t B = in.size(0), S = in.size(1), N = in.size(2), D = in.size(3), h = D / 2;
  dispatch_floating(in.dtype(), "rope", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    std::vector<C> cos_t(static_cast<size_t>(S * h)), sin_t(static_cast<size_t>(S * h));
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < S; ++s) {
      const double pos = static_cast<double>(s + position_offset);
      for (int64_t i = 0; i < h; ++i) {
        const double angle = pos * rope_inv_freq(f, i);
        double c = std::cos(angle), sn = std::sin(angle);
        if (f.yarn) c *= f.attention, sn *= f.attention;  // YaRN's magnitude (plain RoPE: untouched)
        cos_t[static_cast<size_t>(s * h + i)] = static_cast<C>(c);
        sin_t[static_cast<size_t>(s * h + i)] = static_cast<C>(inverse ? -sn : sn);
      }
    }
    const T* pin = in.data<T>();
    T* pout = out.data<T>();
    const int64_t rows = B * S * N;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = (r / N) % S;
      const C* cr = cos_t.data() + s * h;
      const C* sr = sin_t.data() + s * h;
      const T* xr = pin + r * D;
      T* yr = pout + r * D;
      for (int64_t i = 0; i < h; ++i) {
        const C a = load(xr[i]), b = load(xr[i + h]);  // read both before writing (in place)
        yr[i] = store<T>(a * cr[i] - b * sr[i]);
        yr[i + h] = store<T>(b * cr[i] + a * sr[i]);
      }
    }
  });
}

}  // namespace moecore::ops::cpu
