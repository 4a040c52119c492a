// The linear on AVX2 + FMA (the baseline every supported CPU has): linear_fma.h on 8 lanes.
#include "linear_fma.h"
#include "isa.h"

namespace mg {
namespace {

struct V256 {
  using T = __m256;
  static constexpr int kLanes = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static void pairs(const uint16_t* w, T& even, T& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
};

}  // namespace

// 16 ymm registers: 4 rows x 1 vector keeps e, o, the widened pair and two broadcasts in them.
void linear_avx2(const LinearTask& t) { fma_linear<V256, 4, 1>(t); }

}  // namespace mg
