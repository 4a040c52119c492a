// The integer-exact linear (contract.h, 5): x's rows quantized by the row alone, exact integer sums, one
// float epilogue per (row, column). Here: the activation quantizer, the scalar reference every path must
// equal, and the threads' split (panels and rows, never k). Which path runs: linear_paths.cpp.
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>

#include "int8_layout.h"
#include "kernels.h"

namespace mg {
namespace {

// One block of n values (contract.h, 5a; n a multiple of 16) into q, its scale returned. Eight lanes at a
// time: every step is elementwise (|v|, the FLT_MIN test, v * r, the rounding set in the instruction, the
// clamp) or a max, whose order changes nothing, so these are the bits of the contract's scalar statement
// (tests/test_int8_linear.py holds it in numpy).
float quantize_block(const float* v, int64_t n, int8_t* q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), tiny = _mm256_set1_ps(FLT_MIN);
  __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(v + j), abs_mask);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));  // NaN, inf: false
    amax = _mm256_max_ps(amax, _mm256_and_ps(a, _mm256_cmp_ps(a, tiny, _CMP_GE_OQ)));        // below FLT_MIN: 0
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = 0.0f;
  for (const float l : lanes) m = l > m ? l : m;
  const bool all_finite = _mm256_movemask_ps(finite) == 0xff;
  if (!all_finite || m == 0.0f) {
    std::memset(q, 0, n);
    return all_finite ? 0.0f : NAN;
  }
  const __m256 r = _mm256_set1_ps(127.0f / m), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  for (int64_t j = 0; j < n; j += 16) {
    __m256i w[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 x = _mm256_loadu_ps(v + j + 8 * h);
      const __m256 big = _mm256_cmp_ps(_mm256_and_ps(x, abs_mask), tiny, _CMP_GE_OQ);
      const __m256 t = _mm256_round_ps(_mm256_mul_ps(x, r), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      w[h] = _mm256_cvtps_epi32(_mm256_and_ps(big, _mm256_min_ps(_mm256_max_ps(t, lo), hi)));
    }
    const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(w[0], w[1]), 0xD8);  // 16 int16 in order
    const __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), p8);
  }
  const float scale = m / 127.0f;
  return scale < FLT_MIN ? 0.0f : scale;
}

inline void widen(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen(const bf16* src, int64_t n, float* dst) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, load8(src + j));
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

template <typename X>
void quantize_row(const X* src, int64_t k, int64_t kp, int64_t block, int8_t* q, float* scale, int32_t* sum16) {
  static thread_local std::vector<float> v;
  v.resize(block);
  for (int64_t b = 0; b < kp / block; ++b) {
    const int64_t have = std::max<int64_t>(0, std::min(block, k - b * block));  // the rest are k's zero padding
    widen(src + b * block, have, v.data());
    std::fill(v.begin() + have, v.end(), 0.0f);
    scale[b] = quantize_block(v.data(), block, q + b * block);
  }
  const __m128i ones8 = _mm_set1_epi8(1), ones16 = _mm_set1_epi16(1);
  for (int64_t g = 0; g < kp / 16; ++g) {  // exact: pairs in int16 (|sum| <= 254), then int32
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * g));
    __m128i s = _mm_madd_epi16(_mm_maddubs_epi16(ones8, b), ones16);
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    sum16[g] = _mm_cvtsi128_si32(s);
  }
}

Int8Acts quantize(const at::Tensor& x, int64_t kp, int64_t block) {
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(kp % block == 0 && block % 16 == 0, "int8 activations: blocks of ", block, " in ", kp);
  Int8Acts a{at::empty({m, kp}, at::kChar), at::empty({m, kp / block}, at::kFloat), at::empty({m, kp / 16}, at::kInt)};
  at::parallel_for(0, m, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int8_t* q = a.q.data_ptr<int8_t>() + i * kp;
      float* s = a.scale.data_ptr<float>() + i * (kp / block);
      int32_t* s16 = a.sum16.data_ptr<int32_t>() + i * (kp / 16);
      if (x.scalar_type() == at::kFloat) quantize_row(x.data_ptr<float>() + i * k, k, kp, block, q, s, s16);
      else quantize_row(x.data_ptr<bf16>() + i * k, k, kp, block, q, s, s16);
    }
  });
  return a;
}

constexpr int64_t kInt8RowBlock = 64;  // rows whose q stay in L2 while a job's panels pass

}  // namespace

// The scalar reference (contract.h, 5b and 5c), one code at a time.
void linear_int8_scalar(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  const int64_t kp = x.kp, blocks = kp / q.block;
  auto half = [](uint16_t h) { return float(c10::Half(h, c10::Half::from_bits())); };
  for (int64_t r = 0; r < x.m; ++r)
    for (int64_t l = 0; l < kPanel; ++l) {
      float a = acc[r * ldacc + l];
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t S = 0, M = 0;
        for (int64_t g = b * q.block / q.group; g < (b + 1) * q.block / q.group; ++g) {
          int32_t isum = 0, xsum = 0;
          for (int64_t k = g * q.group; k < (g + 1) * q.group; ++k) {
            isum += (int8_code(q, panel, kp, k, l) - q.zero) * x.q[r * kp + k];
            xsum += x.q[r * kp + k];
          }
          const int64_t at_s = (panel * (kp / q.group) + g) * kPanel + l;
          S += (q.s ? q.s[at_s] : 1) * isum;
          M += (q.s_off ? q.s_off[at_s] : 1) * xsum;
        }
        const int64_t at_d = (panel * blocks + b) * kPanel + l;
        const float scale = x.scale[r * blocks + b];
        a = a + float(S) * (scale * (half(q.d[at_d]) * q.unit));
        if (q.d_off) a = a + float(M) * (scale * half(q.d_off[at_d]));
      }
      acc[r * ldacc + l] = a;
    }
}

Int8Rows Int8Acts::rows(int64_t r0, int64_t m) const {
  const int64_t kp = q.size(1), block = kp / scale.size(1);
  return {q.data_ptr<int8_t>() + r0 * kp, scale.data_ptr<float>() + r0 * (kp / block),
          sum16.data_ptr<int32_t>() + r0 * (kp / 16), m, kp, block};
}

Int8Input Int8Input::select(const at::Tensor& index) const {
  Int8Input out{blocks, {}};
  for (const Int8Acts& a : acts)
    out.acts.push_back({a.q.index_select(0, index), a.scale.index_select(0, index), a.sum16.index_select(0, index)});
  return out;
}

std::vector<int64_t> int8_blocks(const std::vector<const QuantMatrix*>& ms) {
  std::vector<int64_t> blocks;
  for (const QuantMatrix* m : ms)
    for (const QuantPart& q : m->parts)
      if (std::find(blocks.begin(), blocks.end(), q.block) == blocks.end()) blocks.push_back(q.block);
  return blocks;
}

Int8Input int8_input(const at::Tensor& x, const std::vector<int64_t>& blocks) {
  Int8Input in{blocks, {}};
  for (const int64_t block : blocks) in.acts.push_back(quantize(x, x.size(1), block));
  return in;
}

void int8_panels(const Int8Input& in, const QuantMatrix& m, const std::vector<float>& bias, Int8Kernel kernel,
                 at::Tensor& out, int64_t p0, int64_t p1) {
  FlushDenormals ftz;
  static thread_local std::vector<float> acc;
  const int64_t rows = out.size(0), ldacc = (p1 - p0) * kPanel;
  for (int64_t r0 = 0; r0 < rows; r0 += kInt8RowBlock) {
    const int64_t rn = std::min(kInt8RowBlock, rows - r0);
    acc.assign(rn * ldacc, 0.0f);
    for (int64_t p = p0; p < p1; ++p) {
      const auto [q, at] = m.locate(p);
      const size_t which = std::find(in.blocks.begin(), in.blocks.end(), q->block) - in.blocks.begin();
      TORCH_CHECK(which < in.blocks.size(), "int8 linear: x was not quantized in blocks of ", q->block);
      kernel(in.acts[which].rows(r0, rn), *q, at, acc.data() + (p - p0) * kPanel, ldacc);
    }
    linear_epilogue(acc.data(), ldacc, bias, out, r0, rn, p0 * kPanel, std::min(p1 * kPanel, m.n));
  }
}

at::Tensor linear_int8_on(Int8Kernel kernel, const at::Tensor& x, const QuantMatrix& m,
                          const std::vector<float>& bias) {
  const Int8Input in = int8_input(x, int8_blocks({&m}));
  at::Tensor out = at::empty({x.size(0), m.n}, x.options());
  const int64_t work = x.size(0) * m.k * m.panels * kPanel;
  const int64_t grain = work < (int64_t(1) << 18) ? m.panels : std::max<int64_t>(1, m.panels / (8 * at::get_num_threads()));
  at::parallel_for(0, m.panels, grain, [&](int64_t p0, int64_t p1) { int8_panels(in, m, bias, kernel, out, p0, p1); });
  return out;
}

at::Tensor linear_int8(const at::Tensor& x, const QuantMatrix& m, const std::vector<float>& bias, bool reference) {
  return linear_int8_on(int8_kernel(reference), x, m, bias);
}

std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x, int64_t block) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows_int8: x [M, K] bf16 or fp32");
  TORCH_CHECK(block > 0 && block % 16 == 0, "quantize_rows_int8: block a multiple of 16");
  const Int8Acts a = quantize(x, round_up(x.size(1), block), block);
  return {a.q, a.scale, a.sum16};
}

}  // namespace mg
