// Row-wise kernels (contract.h, 2 and 4): RMSNorm, gated activations, RoPE, residual adds.
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace mg {
namespace {

// rmsnorm as Hugging Face's Llama: h = x * rsqrt(mean(x^2) + eps) in fp32, cast to x's
// dtype, times the weight (mode kLlamaNorm). kUnitOffsetNorm (Gemma): h times (1 + weight) in fp32, cast once;
// kFp32ProductNorm (gpt-oss): h times the weight in fp32, cast once.
template <typename T>
void rmsnorm_rows(const T* x, const uint16_t* w, T* out, int64_t rows, int64_t d, float eps, int64_t mode) {
  const bool unit_offset = mode == kUnitOffsetNorm;
  std::vector<float> xf(d + 8, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < d; ++i) xf[i] = static_cast<float>(x[r * d + i]);
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      __m256 v = _mm256_loadu_ps(&xf[i]);  // zero-padded tail
      a = _mm256_fmadd_ps(v, v, a);
    }
    const float inv = 1.0f / std::sqrt(hsum(a) / static_cast<float>(d) + eps);
    int64_t i = 0;
    if (mode != kLlamaNorm) {  // vector and tail: the same two fp32 products, one rounding
      const __m256 iv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= d; i += 8) {
        const __m256 wv = unit_offset ? _mm256_add_ps(one, load8(w + i)) : load8(w + i);
        store8(out + r * d + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(&xf[i]), iv), wv));
      }
      for (; i < d; ++i)
        out[r * d + i] = static_cast<T>((xf[i] * inv) * (unit_offset ? 1.0f + bf16_value(w[i]) : bf16_value(w[i])));
      continue;
    }
    if constexpr (std::is_same<T, bf16>::value) {  // the same roundings, 8 at a time
      const __m256 iv = _mm256_set1_ps(inv);
      for (; i + 8 <= d; i += 8)
        store8(out + r * d + i, _mm256_mul_ps(load8(w + i), round_bf16(_mm256_mul_ps(_mm256_loadu_ps(&xf[i]), iv))));
    }
    for (; i < d; ++i) {
      const float wi = bf16_value(w[i]);
      out[r * d + i] = static_cast<T>(wi * static_cast<float>(static_cast<T>(xf[i] * inv)));
    }
  }
}

// gate_up: [N, 2I] (gate | up) -> act(gate) * up, [N, I]; act rounded to the dtype first
// (as Hugging Face's act_fn(gate) * up). Every element goes through the same vector code.
inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// GELU, tanh approximation (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3),
// computed as g / (1 + exp(-2u)) (the same function: (1 + tanh(u)) / 2 = sigmoid(2u)), which keeps its
// relative accuracy where tanh(u) is near -1.
inline __m256 gelu_tanh8(__m256 g) {
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 u2 = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f),  // -2 sqrt(2/pi)
                                  _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g3)));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(u2)));
}

// Exact GELU, x * Phi(x) (BERT's erf form), the steps and roundings of kernels/encoder.py's definition (each an
// fp32 operation rounded once, exp the contract's exp8): z = |x| / sqrt 2 (a multiply by its fp32 value),
// t = 1 / (z * 0.5 + 1), erfc(z) / 2 = exp(P(t) - z * z) * t * 0.5 (P: Numerical Recipes' Chebyshev fit, by
// Horner), Phi = 1 - that for x >= 0, else that; then Phi * x.
constexpr float kErfc[10] = {-1.26551223f, 1.00002368f, 0.37409196f, 0.09678418f, -0.18628806f,
                             0.27886807f,  -1.13520398f, 1.48851587f, -0.82215223f, 0.17087277f};

inline __m256 gelu_erf8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
  const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(0.70710678118654752f));
  const __m256 t = _mm256_div_ps(one, _mm256_add_ps(_mm256_mul_ps(z, half), one));
  __m256 p = _mm256_mul_ps(t, _mm256_set1_ps(kErfc[9]));
  for (int i = 8; i >= 1; --i) p = _mm256_mul_ps(_mm256_add_ps(p, _mm256_set1_ps(kErfc[i])), t);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_add_ps(p, _mm256_set1_ps(kErfc[0])), _mm256_mul_ps(z, z)));
  const __m256 tail = _mm256_mul_ps(_mm256_mul_ps(e, t), half);
  const __m256 phi = _mm256_blendv_ps(tail, _mm256_sub_ps(one, tail), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_mul_ps(phi, x);
}

template <typename T>
void gelu_span(const T* x, T* out, int64_t n) {  // the tail through the same vector code, zero-padded
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, gelu_erf8(load8(x + i)));
  if (i < n) {
    alignas(32) T in[8] = {}, res[8];
    std::memcpy(in, x + i, (n - i) * sizeof(T));
    store8(res, gelu_erf8(load8(in)));
    std::memcpy(out + i, res, (n - i) * sizeof(T));
  }
}

template <typename T, __m256 (*Act)(__m256)>
void act_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  constexpr bool kBf16 = std::is_same<T, bf16>::value;
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gu + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
    for (int64_t i = 0; i < inter; i += 8) {
      alignas(32) T g[8] = {}, u[8] = {}, res[8];
      const int64_t c = std::min<int64_t>(8, inter - i);
      const bool full = c == 8;
      if (!full) {  // the tail goes through the same vector code, zero-padded
        std::memcpy(g, gate + i, c * sizeof(T));
        std::memcpy(u, up + i, c * sizeof(T));
      }
      __m256 s = Act(load8(full ? gate + i : g));
      if (kBf16) s = round_bf16(s);
      const __m256 prod = _mm256_mul_ps(s, load8(full ? up + i : u));
      if (full) {
        store8(o + i, prod);
      } else {
        store8(res, prod);
        std::memcpy(o + i, res, c * sizeof(T));
      }
    }
  }
}

template <__m256 (*Act)(__m256)>
at::Tensor act_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "act_mul: gate_up must be [N, 2I]");
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    if (gate_up.scalar_type() == at::kFloat)
      act_mul_rows<float, Act>(gate_up.data_ptr<float>() + b * 2 * inter, out.data_ptr<float>() + b * inter, e - b, inter);
    else
      act_mul_rows<bf16, Act>(gate_up.data_ptr<bf16>() + b * 2 * inter, out.data_ptr<bf16>() + b * inter, e - b, inter);
  });
  return out;
}
}  // namespace

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t mode) {
  TORCH_CHECK(mode == kLlamaNorm || mode == kUnitOffsetNorm || mode == kFp32ProductNorm, "rmsnorm: mode 0, 1 or 2");
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "rmsnorm: weight must be bf16");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(weight.numel() == d, "rmsnorm: weight size");
  at::Tensor out = at::empty_like(x);
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    if (x.scalar_type() == at::kFloat)
      rmsnorm_rows(x.data_ptr<float>() + b * d, u16(weight), out.data_ptr<float>() + b * d, e - b, d, eps, mode);
    else
      rmsnorm_rows(x.data_ptr<bf16>() + b * d, u16(weight), out.data_ptr<bf16>() + b * d, e - b, d, eps, mode);
  });
  return out;
}

// gpt-oss's experts' clamped SwiGLU, gate_up [N, 2I] (gate | up: the checkpoint's interleaved columns
// split at load) -> [N, I]: g = min(gate, limit), u = clamp(up, -limit, limit), out = (u + 1) * (g *
// sigmoid(alpha * g)), sigmoid(z) = 1 / (1 + exp(-z)) with the contract's exp; each op rounded to T as
// transformers' bf16 ops round (alpha * g, the sigmoid, g * it, u + 1, the product), one element at a time.
template <typename T>
void swiglu_clamped_rows(const T* gu, T* out, int64_t rows, int64_t inter, float alpha, float limit) {
  constexpr bool kBf16 = std::is_same<T, bf16>::value;
  const auto r = [](float v) { return kBf16 ? rnd(v) : v; };
  for (int64_t row = 0; row < rows; ++row) {
    const T* gate = gu + row * 2 * inter;
    const T* up = gate + inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = std::min(static_cast<float>(gate[i]), limit);
      const float u = std::max(std::min(static_cast<float>(up[i]), limit), -limit);
      const float sig = r(1.0f / (1.0f + exp1(-r(alpha * g))));
      out[row * inter + i] = static_cast<T>(r(u + 1.0f) * r(g * sig));
    }
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return act_mul<silu8>(gate_up); }
at::Tensor swiglu_clamped(const at::Tensor& gate_up, double alpha, double limit) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "swiglu_clamped: gate_up must be [N, 2I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    if (gate_up.scalar_type() == at::kFloat)
      swiglu_clamped_rows(gate_up.data_ptr<float>() + b * 2 * inter, out.data_ptr<float>() + b * inter, e - b, inter, a, l);
    else
      swiglu_clamped_rows(gate_up.data_ptr<bf16>() + b * 2 * inter, out.data_ptr<bf16>() + b * inter, e - b, inter, a, l);
  });
  return out;
}
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return act_mul<gelu_tanh8>(gate_up); }

at::Tensor gelu_erf(const at::Tensor& x) {  // elementwise: how threads split the elements changes no bit
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous(), "gelu_erf: x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gelu_erf: x must be fp32 or bf16");
  at::Tensor out = at::empty_like(x);
  at::parallel_for(0, x.numel(), 1 << 14, [&](int64_t b, int64_t e) {
    if (x.scalar_type() == at::kFloat)
      gelu_span(x.data_ptr<float>() + b, out.data_ptr<float>() + b, e - b);
    else
      gelu_span(x.data_ptr<bf16>() + b, out.data_ptr<bf16>() + b, e - b);
  });
  return out;
}


// Rotates `heads` heads of one row (HF layout: x * cos + cat(-x2, x1) * sin, each op rounded),
// 8 lanes at a time where the half head allows, else one by one: the same bits.
void rope_row(const bf16* x, const bf16* cs, const bf16* sn, int64_t heads, int64_t d, bf16* out) {
  const int64_t half = d / 2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    const bf16* xh = x + h * d;
    bf16* oh = out + h * d;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 x1 = load8(xh + i), x2 = load8(xh + half + i);
      const __m256 lo = _mm256_add_ps(round_bf16(_mm256_mul_ps(x1, load8(cs + i))),
                                      round_bf16(_mm256_mul_ps(_mm256_xor_ps(x2, sign), load8(sn + i))));
      const __m256 hi = _mm256_add_ps(round_bf16(_mm256_mul_ps(x2, load8(cs + half + i))),
                                      round_bf16(_mm256_mul_ps(x1, load8(sn + half + i))));
      store8(oh + i, lo);
      store8(oh + half + i, hi);
    }
    for (; i < half; ++i)
      for (const int64_t j : {i, i + half}) {
        const float xi = static_cast<float>(xh[j]);
        const float rot = j < half ? -static_cast<float>(xh[j + half]) : static_cast<float>(xh[j - half]);
        const float a = rnd(xi * static_cast<float>(cs[j])), b = rnd(rot * static_cast<float>(sn[j]));
        oh[j] = static_cast<bf16>(a + b);
      }
  }
}

void add_into(at::Tensor& h, const at::Tensor& y) {  // h = bf16(h + y), element by element
  bf16* hp = h.data_ptr<bf16>();
  const bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, h.numel(), 1 << 15, [&](int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + 8 <= e; i += 8) store8(hp + i, _mm256_add_ps(load8(hp + i), load8(yp + i)));
    for (; i < e; ++i) hp[i] = static_cast<bf16>(static_cast<float>(hp[i]) + static_cast<float>(yp[i]));
  });
}

}  // namespace mg
