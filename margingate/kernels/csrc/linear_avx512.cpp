// The linear on AVX-512 FMAs: linear_fma.h on 16 lanes. Its own translation unit, the only one
// compiled for AVX-512 (the target pragma), so no AVX-512 code reaches a CPU without it.
#pragma GCC target("avx512f")
#include "linear_fma.h"
#include "isa.h"

namespace mg {
namespace {

struct V512 {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T bcast(const float* p) { return _mm512_set1_ps(*p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static void pairs(const uint16_t* w, T& even, T& odd) {
    const __m512i v = _mm512_loadu_si512(w);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
};

}  // namespace

// 32 zmm registers: 4 rows x 2 vectors (32 columns) of e and o, the widened pairs, two broadcasts.
void linear_avx512(const LinearTask& t) { fma_linear<V512, 4, 2>(t); }

}  // namespace mg
