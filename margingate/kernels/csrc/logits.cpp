// Per-row statistics of fp32 logits for logprobs and nucleus sampling, and the Gumbel noise of
// seeded sampling, in an order fixed by the row alone: one thread per row, exp is contract.h's exp8, the sum goes through 8 fp64 lanes
// (element j into lane j mod 8) added in a fixed tree, and log is our own series below. No
// libm call, so no bit depends on the CPU, the thread count or the math library's dispatch.
#include <ATen/Parallel.h>

#include <cmath>

#include "kernels.h"

namespace mg {
namespace {

// log(s) for s >= 1: s = m * 2^e (frexp is exact), m in [sqrt(1/2), sqrt(2)), then
// log(m) = 2 atanh(t), t = (m - 1) / (m + 1), |t| < 0.172: 11 odd terms reach fp64 precision.
double log_series(double s) {
  int e = 0;
  double m = std::frexp(s, &e);  // m in [0.5, 1)
  if (m < 0.70710678118654752) {
    m *= 2.0;
    e -= 1;
  }
  const double t = (m - 1.0) / (m + 1.0), t2 = t * t;
  double term = t, sum = 0.0;
  for (int k = 1; k <= 21; k += 2) {
    sum += term / k;
    term *= t2;
  }
  return e * 0.69314718055994531 + 2.0 * sum;
}

// sum of exp(x[j] - shift) over the row; tail lanes take exp(-inf) = 0
double sum_exp_row(const float* x, int64_t v, float shift) {
  __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
  const __m256 s = _mm256_set1_ps(shift);
  for (int64_t j = 0; j < v; j += 8) {
    float buf[8];
    for (int l = 0; l < 8; ++l) buf[l] = j + l < v ? x[j + l] : -INFINITY;
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf), s));
    acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    acc_hi = _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  double lanes[8];
  _mm256_storeu_pd(lanes, acc_lo);
  _mm256_storeu_pd(lanes + 4, acc_hi);
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

float row_max(const float* x, int64_t v) {
  float m = -INFINITY;
  for (int64_t j = 0; j < v; ++j) m = x[j] > m ? x[j] : m;  // max is exact in any order
  return m;
}

// log on 4 fp64 lanes, for the Gumbel noise: the same reduction as log_series (the exponent and
// mantissa from the bits, exact; m moved into [sqrt(1/2), sqrt(2))), but 2 atanh(t) as a Horner
// polynomial in t^2, where log_series sums its terms in ascending order: the two may differ in the
// last bit, and each is used for one purpose only. For normal positive inputs (the noise's only ones).
__m256d log4(__m256d s) {
  const __m256i bits = _mm256_castpd_si256(s);
  const __m256i mant = _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi64x(0x000FFFFFFFFFFFFFLL)),
                                       _mm256_set1_epi64x(0x3FE0000000000000LL));  // m in [0.5, 1)
  const __m256i e64 = _mm256_sub_epi64(_mm256_srli_epi64(bits, 52), _mm256_set1_epi64x(1022));
  const __m128i e32 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(e64, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
  __m256d e = _mm256_cvtepi32_pd(e32), m = _mm256_castsi256_pd(mant);
  const __m256d low = _mm256_cmp_pd(m, _mm256_set1_pd(0.70710678118654752), _CMP_LT_OQ);
  m = _mm256_blendv_pd(m, _mm256_add_pd(m, m), low);
  e = _mm256_sub_pd(e, _mm256_and_pd(low, _mm256_set1_pd(1.0)));
  const __m256d one = _mm256_set1_pd(1.0);
  const __m256d t = _mm256_div_pd(_mm256_sub_pd(m, one), _mm256_add_pd(m, one)), t2 = _mm256_mul_pd(t, t);
  __m256d p = _mm256_set1_pd(1.0 / 21);
  for (int k = 19; k >= 1; k -= 2) p = _mm256_add_pd(_mm256_mul_pd(p, t2), _mm256_set1_pd(1.0 / k));
  return _mm256_add_pd(_mm256_mul_pd(e, _mm256_set1_pd(0.69314718055994531)),
                       _mm256_mul_pd(_mm256_set1_pd(2.0), _mm256_mul_pd(t, p)));
}

void check_rows(const at::Tensor& x) {
  check_cpu(x, "logits");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "logits must be a 2-D fp32 tensor");
}

}  // namespace

at::Tensor logsumexp_rows(const at::Tensor& x) {
  check_rows(x);
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor out = at::empty({rows}, x.options());
  const float* px = x.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = px + r * v;
      const float m = row_max(row, v);
      po[r] = std::isfinite(m) ? static_cast<float>(m + log_series(sum_exp_row(row, v, m))) : m;
    }
  });
  return out;
}

at::Tensor exp_shifted(const at::Tensor& x, const at::Tensor& shift) {
  check_rows(x);
  check_cpu(shift, "shift");
  TORCH_CHECK(shift.scalar_type() == at::kFloat && shift.numel() == x.size(0), "one fp32 shift per row");
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float *px = x.data_ptr<float>(), *ps = shift.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const __m256 s = _mm256_set1_ps(ps[r]);
      for (int64_t j = 0; j < v; j += 8) {
        float buf[8];
        const int64_t n = min64(8, v - j);
        for (int l = 0; l < 8; ++l) buf[l] = l < n ? px[r * v + j + l] : -INFINITY;
        _mm256_storeu_ps(buf, exp8(_mm256_sub_ps(_mm256_loadu_ps(buf), s)));
        for (int l = 0; l < n; ++l) po[r * v + j + l] = buf[l];
      }
    }
  });
  return out;
}

at::Tensor gumbel_from_uniform(const at::Tensor& u) {
  check_cpu(u, "u");
  TORCH_CHECK(u.scalar_type() == at::kDouble, "u must be fp64 uniforms in (0, 1)");
  const int64_t n = u.numel();
  at::Tensor out = at::empty(u.sizes(), u.options().dtype(at::kFloat));
  const double* pu = u.data_ptr<double>();
  float* po = out.data_ptr<float>();
  const __m256d zero = _mm256_setzero_pd();
  for (int64_t j = 0; j < n; j += 4) {  // -log(-log(u)), elementwise: no order to fix, one thread is plenty
    double buf[4];
    for (int l = 0; l < 4; ++l) buf[l] = j + l < n ? pu[j + l] : 0.5;
    const __m256d g = _mm256_sub_pd(zero, log4(_mm256_sub_pd(zero, log4(_mm256_loadu_pd(buf)))));
    _mm256_storeu_pd(buf, g);
    for (int l = 0; l < 4 && j + l < n; ++l) po[j + l] = static_cast<float>(buf[l]);
  }
  return out;
}

}  // namespace mg
