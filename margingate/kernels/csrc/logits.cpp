// Per-row statistics of fp32 logits for logprobs and nucleus sampling, the greedy argmax, and the Gumbel noise of
// seeded sampling (Philox uniforms keyed by seed, position and token), in an order fixed by the row alone: one thread per row, exp is contract.h's exp8, the sum goes through 8 fp64 lanes
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

// The first index of a row's largest value, as torch.argmax: a NaN counts as larger than any number
// (the first NaN wins) and equal values (+0 and -0 among them) keep the lowest index. Eight lanes,
// each keeping its largest value and the first index of it, then the lanes in index order.
int64_t row_argmax(const float* x, int64_t v) {
  int64_t j = 0, at = 0;
  float top = -INFINITY;
  if (v >= 16) {
    __m256 tops = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(tops, tops, _CMP_UNORD_Q);
    __m256i ats = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = ats;
    for (j = 8; j + 8 <= v; j += 8) {
      idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
      const __m256 y = _mm256_loadu_ps(x + j), gt = _mm256_cmp_ps(y, tops, _CMP_GT_OQ);
      tops = _mm256_blendv_ps(tops, y, gt);
      ats = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ats), _mm256_castsi256_ps(idx), gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) j = 0;  // a NaN: the scalar pass below finds the first
    else {
      alignas(32) float tv[8];
      alignas(32) int32_t ti[8];
      _mm256_store_ps(tv, tops), _mm256_store_si256(reinterpret_cast<__m256i*>(ti), ats);
      top = tv[0], at = ti[0];
      for (int l = 1; l < 8; ++l)
        if (tv[l] > top || (tv[l] == top && ti[l] < at)) top = tv[l], at = ti[l];
    }
  }
  if (j == 0) {  // a short row, or a NaN found above: plain scan from the first element
    if (std::isnan(x[0])) return 0;
    top = x[0], j = 1;
  }
  for (; j < v; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > top) top = x[j], at = j;
  }
  return at;
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

std::vector<int64_t> argmax_rows(const at::Tensor& x) {
  check_rows(x);
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: the rows are empty");
  std::vector<int64_t> out(x.size(0));
  for (int64_t r = 0; r < x.size(0); ++r) out[r] = row_argmax(x.data_ptr<float>() + r * x.size(1), x.size(1));
  return out;
}

at::Tensor sum_exp_rows(const at::Tensor& x) {
  check_rows(x);
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kDouble));
  const float* px = x.data_ptr<float>();
  double* po = out.data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) po[r] = sum_exp_row(px + r * v, v, row_max(px + r * v, v));
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

namespace {

// Philox4x32-10 (Salmon et al., SC 2011, as Random123 defines it) on 4 counters at once: word w of
// counter l in the low half of 64-bit lane l of c[w], AVX2's 32x32 -> 64 multiply doing 4 lanes.
// A counter-based generator is a pure function of (key, counter): no state, no library, no version.
void philox4(__m256i c[4], uint32_t k0, uint32_t k1) {
  const __m256i m0 = _mm256_set1_epi64x(0xD2511F53), m1 = _mm256_set1_epi64x(0xCD9E8D57);
  const __m256i low = _mm256_set1_epi64x(0xFFFFFFFFLL);
  for (int round = 0; round < 10; ++round) {
    const __m256i p0 = _mm256_mul_epu32(c[0], m0), p1 = _mm256_mul_epu32(c[2], m1);
    const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c[1]), _mm256_set1_epi64x(k0));
    const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), c[3]), _mm256_set1_epi64x(k1));
    c[0] = n0;
    c[1] = _mm256_and_si256(p1, low);
    c[2] = n2;
    c[3] = _mm256_and_si256(p0, low);
    k0 += 0x9E3779B9u;  // the Weyl key schedule
    k1 += 0xBB67AE85u;
  }
}

// Uniforms in (0, 1) of tokens j..j+7 at one (seed, position). Token t takes half of the block at
// counter (t / 2, position lo, position hi, 0) with key (seed lo, seed hi): words 0 and 1 if t is even,
// 2 and 3 if odd. 52 of their bits, m, give u = (2m + 1) / 2^53, exact in fp64, never 0 or 1.
void uniforms8(int64_t j, uint64_t position, uint64_t seed, __m256d& even, __m256d& odd) {
  const int64_t b = j / 2;
  __m256i c[4] = {_mm256_setr_epi64x(b, b + 1, b + 2, b + 3), _mm256_set1_epi64x(position & 0xFFFFFFFFu),
                  _mm256_set1_epi64x(position >> 32), _mm256_setzero_si256()};
  philox4(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const __m256i exponent = _mm256_set1_epi64x(0x3FF0000000000000LL);
  const __m256d one = _mm256_set1_pd(1.0), half_ulp = _mm256_set1_pd(0x1p-53);
  for (int half = 0; half < 2; ++half) {
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi64(c[2 * half], 32), c[2 * half + 1]);
    const __m256d one_to_two = _mm256_castsi256_pd(_mm256_or_si256(_mm256_srli_epi64(bits, 12), exponent));
    (half ? odd : even) = _mm256_add_pd(_mm256_sub_pd(one_to_two, one), half_ulp);
  }
}

}  // namespace

at::Tensor philox4x32(const at::Tensor& counter, const at::Tensor& key) {
  check_cpu(counter, "counter");
  check_cpu(key, "key");
  TORCH_CHECK(counter.scalar_type() == at::kLong && counter.numel() == 4 && key.scalar_type() == at::kLong &&
              key.numel() == 2, "one counter (4 words) and one key (2 words), as int64");
  const int64_t* pc = counter.data_ptr<int64_t>();
  __m256i c[4];
  for (int w = 0; w < 4; ++w) c[w] = _mm256_set1_epi64x(pc[w] & 0xFFFFFFFFLL);
  philox4(c, static_cast<uint32_t>(key.data_ptr<int64_t>()[0]), static_cast<uint32_t>(key.data_ptr<int64_t>()[1]));
  at::Tensor out = at::empty({4}, counter.options());
  for (int w = 0; w < 4; ++w) out.data_ptr<int64_t>()[w] = _mm256_extract_epi64(c[w], 0);
  return out;
}

void add_gumbel_(at::Tensor& rows, int64_t seed, int64_t first_position) {
  check_rows(rows);
  const int64_t n = rows.size(0), v = rows.size(1);
  float* px = rows.data_ptr<float>();
  const __m256d zero = _mm256_setzero_pd();
  // elementwise, keyed by (seed, position, token): no order to fix, so rows may split over threads
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = px + r * v;
      const uint64_t position = static_cast<uint64_t>(first_position + r);
      for (int64_t j = 0; j < v; j += 8) {
        __m256d u[2];
        double g[2][4];
        uniforms8(j, position, static_cast<uint64_t>(seed), u[0], u[1]);
        for (int h = 0; h < 2; ++h) _mm256_storeu_pd(g[h], _mm256_sub_pd(zero, log4(_mm256_sub_pd(zero, log4(u[h])))));
        for (int l = 0; l < 8 && j + l < v; ++l) row[j + l] += static_cast<float>(g[l % 2][l / 2]);  // even, odd tokens
      }
    }
  });
}

}  // namespace mg
