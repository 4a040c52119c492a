// Batch-invariant CPU kernels: every reduction has an order fixed by the row alone.
//
// Each output element is reduced by the same arithmetic whatever the number of rows,
// the row's place among them, the thread count, or the call it arrives in (prefill,
// chunk, decode step, verifier replay). Threads split output tiles, never a
// reduction. The code uses AVX2 + FMA intrinsics (no CPU-dependent library
// dispatch), and AVX512-BF16 only where it computes the very same bits, so results
// are also the same on every x86 CPU with AVX2 and FMA.
//
// Reduction orders, in one place:
// - linear with bf16 activations: the order of AVX512-BF16's vdpbf16ps on 16 fp32
//   lanes (see `linear_bf16` below); CPUs with that instruction run it, the others
//   emulate it exactly with AVX2 FMAs.
// - other dot products (fp32 linear, q.k): 8 fp32 lanes; lane l accumulates the
//   products of a fixed set of k (one FMA chain, k ascending); then `hsum` adds the
//   lanes in a fixed tree.
// - attention: keys in fixed chunks of kChunk positions counted from the row's first key
//   (position 0, or the start of its sliding window; batched `fast` rows: aligned to their
//   batch's padded length instead, on purpose);
//   online softmax merges the chunks in ascending order.
// - rmsnorm: sum of squares as for dot products.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <string>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kChunk = 32;  // attention key chunk (positions); part of the numerics

inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 -> 8 fp32, exact
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline __m256 load8(const uint16_t* p) { return bf16x8(p); }
inline __m256 load8(const bf16* p) { return bf16x8(reinterpret_cast<const uint16_t*>(p)); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// fp32 -> bf16, round to nearest even, NaN -> 0x7fc0: the same bits as c10::BFloat16(float).
inline __m128i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store8(bf16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits8(v)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Round to bf16 and back: what a bf16 intermediate holds.
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
}

inline float hsum(__m256 v) {  // fixed tree: (lo + hi), then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of 8 vectors at once, with hsum's pairings exactly (additions are commutative, and each
// pairs the same two values): out[j] = hsum(f[j]). Used where many outputs end together.
inline void hsum_x8(const __m256* f, float* out) {
  __m256 p[4];
  for (int j = 0; j < 4; ++j)  // lo128 + hi128 of f[j] and f[j + 4]
    p[j] = _mm256_add_ps(_mm256_permute2f128_ps(f[j], f[j + 4], 0x20), _mm256_permute2f128_ps(f[j], f[j + 4], 0x31));
  __m256 t[2];
  for (int j = 0; j < 2; ++j)  // lanes (0 + 2), (1 + 3)
    t[j] = _mm256_add_ps(_mm256_shuffle_ps(p[2 * j], p[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(p[2 * j], p[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),  // lane 0 + lane 1
                                 _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  _mm256_storeu_ps(out, u);  // f[0..3] in the low half, f[4..7] in the high half
}

// out[i * ldo + j] = hsum(f[i * NR + j]) for an MR x NR tile, 8 at a time.
template <int MR, int NR>
inline void hsum_tile(const __m256* f, float* out, int64_t ldo) {
  constexpr int kN = MR * NR;
  alignas(32) float sums[kN + 8];
  int q = 0;
  for (; q + 8 <= kN; q += 8) hsum_x8(f + q, sums + q);
  for (; q < kN; ++q) sums[q] = hsum(f[q]);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = sums[i * NR + j];
}

// exp on 8 lanes: Cody-Waite reduction and a degree-6 polynomial; our own code, so its
// bits do not depend on a math library. Inputs are clamped to [-87, 88]; below -87 -> 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float exp1(float x) {  // the same arithmetic for one value
  float buf[8];
  _mm256_storeu_ps(buf, exp8(_mm256_set1_ps(x)));
  return buf[0];
}

inline float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

const uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Rows of x as fp32, each padded with zeros to kp (a multiple of 8) columns.
std::vector<float> rows_fp32(const at::Tensor& x, int64_t kp) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<float> out(m * kp, 0.0f);
  if (x.scalar_type() == at::kFloat) {
    const float* src = x.data_ptr<float>();
    for (int64_t i = 0; i < m; ++i) std::memcpy(&out[i * kp], src + i * k, k * sizeof(float));
  } else {
    const bf16* src = x.data_ptr<bf16>();
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < k; ++j) out[i * kp + j] = static_cast<float>(src[i * k + j]);
  }
  return out;
}

// ---- linear: y = x W^T + b ----------------------------------------------------
// One tile: MR rows of x against NR rows of W. Every (row, column) pair has its own
// accumulator, so neither MR nor NR changes any element's reduction.
template <int MR, int NR, typename W>
void tile(const float* x, int64_t kp, const W* w, int64_t ldw, int64_t k, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t kfull = k & ~int64_t(7);
  for (int64_t c = 0; c < kfull; c += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * ldw + c);
    for (int i = 0; i < MR; ++i) {
      __m256 xv = _mm256_loadu_ps(x + i * kp + c);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (kfull < k) {  // tail of the reduction: zero-padded W, x is already padded
    alignas(32) W pad[8];
    for (int j = 0; j < NR; ++j) {
      std::memset(pad, 0, sizeof(pad));
      std::memcpy(pad, w + j * ldw + kfull, (k - kfull) * sizeof(W));
      __m256 wv = load8(pad);
      for (int i = 0; i < MR; ++i)
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * kp + kfull), wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = hsum(acc[i][j]);
}

template <int MR, int NR, typename W>
void columns(const float* x, int64_t kp, const W* w, int64_t ldw, int64_t k, float* out, int64_t ldo,
             int64_t ncols) {
  int64_t n = 0;
  for (; n + NR <= ncols; n += NR) tile<MR, NR>(x, kp, w + n * ldw, ldw, k, out + n, ldo);
  for (; n < ncols; ++n) tile<MR, 1>(x, kp, w + n * ldw, ldw, k, out + n, ldo);
}

// Columns [0, ncols) of W (row stride ldw) against every row of x.
template <typename W>
void sweep_rows(const float* x, int64_t m, int64_t kp, const W* w, int64_t ldw, int64_t k, float* out,
                int64_t ldo, int64_t ncols) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) columns<4, 3>(x + i * kp, kp, w, ldw, k, out + i * ldo, ldo, ncols);
  const float* xt = x + i * kp;
  float* ot = out + i * ldo;
  switch (m - i) {
    case 3: columns<3, 4>(xt, kp, w, ldw, k, ot, ldo, ncols); break;
    case 2: columns<2, 6>(xt, kp, w, ldw, k, ot, ldo, ncols); break;
    case 1: columns<1, 12>(xt, kp, w, ldw, k, ot, ldo, ncols); break;
    default: break;
  }
}

constexpr int64_t kNB = 12;  // columns per sweep over the row tiles

// Columns [n0, n1) for rows [0, m): a block of W's rows stays in cache while the row tiles
// pass. (Widening the block to fp32 once per sweep was measured slower here.)
void linear_block(const float* x, int64_t m, int64_t kp, const uint16_t* w, int64_t k, float* out,
                  int64_t ldo, int64_t n0, int64_t n1) {
  for (int64_t nb = n0; nb < n1; nb += kNB)
    sweep_rows(x, m, kp, w + nb * k, k, k, out + nb, ldo, std::min(kNB, n1 - nb));
}

// ---- linear with bf16 activations -----------------------------------------------
// The reduction order is vdpbf16ps's on a 16-lane fp32 accumulator. k is padded with
// zeros to a multiple of 32. For every chunk of 32 k (ascending), lane l adds the product
// of pair element 2l+1, then of element 2l: acc = fma(x[2l], w[2l], fma(x[2l+1], w[2l+1], acc)).
// Products of two bf16 are exact in fp32, so each step is one rounding; denormal inputs
// and results are flushed to zero (vdpbf16ps's rule; AVX2 gets it from MXCSR FTZ|DAZ).
// At the end lanes l and l + 8 are added and `hsum` adds the 8 sums. Checked bitwise
// against the instruction (tests/test_kernels.py runs both paths where it exists).
constexpr int64_t kK = 32;  // k per chunk

int g_isa = -1;  // 1: vdpbf16ps, 0: AVX2 emulation; -1: not chosen yet

bool has_avx512_bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

int isa() {
  if (g_isa < 0) g_isa = has_avx512_bf16() ? 1 : 0;
  return g_isa;
}

struct FlushDenormals {  // FTZ | DAZ for this thread while in scope
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// One column's 32-k tail chunk, zero padded (k % 32 != 0).
inline void padded_tail(const uint16_t* w, int64_t kfull, int64_t k, uint16_t* pad) {
  std::memset(pad, 0, kK * sizeof(uint16_t));
  std::memcpy(pad, w + kfull, (k - kfull) * sizeof(uint16_t));
}

// AVX2: x is pre-split per 16-block into [x[2l+1] for l < 8][x[2l] for l < 8] as fp32, so a
// tile only splits W. Each 16-block feeds lanes 0-7 (first half of a chunk) or 8-15.
struct Avx2Pairs {
  static constexpr int kNR[5] = {0, 12, 6, 4, 3};  // columns per tile for a tile of 1..4 rows
  template <int MR, int NR>
  static void tile(const float* xs, int64_t kp, const uint16_t* w, int64_t ldw, int64_t k, float* out,
                   int64_t ldo) {
    const int64_t kfull = k & ~(kK - 1);
    alignas(32) uint16_t pad[NR][kK];  // the tail chunk, padded before the loop: no call inside it
    if (kfull < k)
      for (int j = 0; j < NR; ++j) padded_tail(w + j * ldw, kfull, k, pad[j]);
    alignas(32) float lo[MR][NR][8];
    for (int h = 0; h < 2; ++h) {  // lanes 0-7, then lanes 8-15: independent accumulators
      __m256 acc[MR][NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < kp; c += kK) {
        const int64_t b = c + 16 * h;
        for (int j = 0; j < NR; ++j) {
          const uint16_t* src = c < kfull ? w + j * ldw + b : pad[j] + 16 * h;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
          const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))));
          for (int i = 0; i < MR; ++i) {
            acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + i * kp + b), wo, acc[i][j]);
            acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + i * kp + b + 8), we, acc[i][j]);
          }
        }
      }
      if (h == 0) {
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) _mm256_store_ps(lo[i][j], acc[i][j]);
      } else {
        __m256 f[MR * NR];
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) f[i * NR + j] = _mm256_add_ps(_mm256_load_ps(lo[i][j]), acc[i][j]);
        hsum_tile<MR, NR>(f, out, ldo);
      }
    }
  }
  static std::vector<float> prepare(const at::Tensor& x, int64_t kp) {
    const int64_t m = x.size(0), k = x.size(1);
    const uint16_t* src = u16(x);
    std::vector<float> xs(m * kp, 0.0f);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < k; ++j) {  // element j of block b: odd ones first, then even ones
        const int64_t b = j & ~int64_t(15), l = (j & 15) >> 1;
        xs[r * kp + b + ((j & 1) ? l : 8 + l)] = bf16_value(src[r * k + j]);
      }
    return xs;
  }
};

// AVX512-BF16: the instruction itself, on x rows kept as zero-padded bf16.
struct Avx512Pairs {
  static constexpr int kNR[5] = {0, 12, 12, 6, 6};
  template <int MR, int NR>
  __attribute__((target("avx512f,avx512bf16"))) static void tile(
      const uint16_t* xb, int64_t kp, const uint16_t* w, int64_t ldw, int64_t k, float* out, int64_t ldo) {
    const int64_t kfull = k & ~(kK - 1);
    alignas(64) uint16_t pad[NR][kK];  // the tail chunk, padded before the loop: no call inside it
    if (kfull < k)
      for (int j = 0; j < NR; ++j) padded_tail(w + j * ldw, kfull, k, pad[j]);
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < kp; c += kK) {
      __m512bh xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(xb + i * kp + c);
      for (int j = 0; j < NR; ++j) {
        const uint16_t* src = c < kfull ? w + j * ldw + c : pad[j];
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(src);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
      }
    }
    __m256 f[MR * NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        const __m256 lo = _mm512_castps512_ps256(acc[i][j]);
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i][j]), 1));
        f[i * NR + j] = _mm256_add_ps(lo, hi);
      }
    hsum_tile<MR, NR>(f, out, ldo);
  }
  static std::vector<uint16_t> prepare(const at::Tensor& x, int64_t kp) {
    const int64_t m = x.size(0), k = x.size(1);
    std::vector<uint16_t> xb(m * kp, 0);
    for (int64_t r = 0; r < m; ++r) std::memcpy(&xb[r * kp], u16(x) + r * k, k * sizeof(uint16_t));
    return xb;
  }
};

// Columns [n0, n1) of W for every row of x, in blocks of kNB columns; the tile shape (MR x NR)
// only decides which accumulators live in registers together, never an element's order.
template <typename P, typename X>
void pairs_block(const X* x, int64_t m, int64_t kp, const uint16_t* w, int64_t k, float* out, int64_t ldo,
                 int64_t n0, int64_t n1) {
  for (int64_t nb = n0; nb < n1; nb += kNB) {
    const int64_t ncols = std::min(kNB, n1 - nb);
    auto sweep = [&](auto mr, auto nr, int64_t i) {
      constexpr int MR = decltype(mr)::value, NR = decltype(nr)::value;
      int64_t j = 0;
      for (; j + NR <= ncols; j += NR)
        P::template tile<MR, NR>(x + i * kp, kp, w + (nb + j) * k, k, k, out + i * ldo + nb + j, ldo);
      for (; j < ncols; ++j)
        P::template tile<MR, 1>(x + i * kp, kp, w + (nb + j) * k, k, k, out + i * ldo + nb + j, ldo);
    };
    using std::integral_constant;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) sweep(integral_constant<int, 4>{}, integral_constant<int, P::kNR[4]>{}, i);
    switch (m - i) {  // the last 1-3 rows
      case 3: sweep(integral_constant<int, 3>{}, integral_constant<int, P::kNR[3]>{}, i); break;
      case 2: sweep(integral_constant<int, 2>{}, integral_constant<int, P::kNR[2]>{}, i); break;
      case 1: sweep(integral_constant<int, 1>{}, integral_constant<int, P::kNR[1]>{}, i); break;
      default: break;
    }
  }
}

// Bias (fp32, after the sum), then the output rounding, for columns [n0, n1).
void epilogue(float* acc, const std::vector<float>& bias_f, at::Tensor& out, int64_t m, int64_t n, int64_t n0,
              int64_t n1, bool fp32_out) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = acc + i * n;
    if (!bias_f.empty())
      for (int64_t j = n0; j < n1; ++j) row[j] += bias_f[j];
    if (!fp32_out) {
      bf16* o = out.data_ptr<bf16>() + i * n;
      int64_t j = n0;
      for (; j + 8 <= n1; j += 8) store8(o + j, _mm256_loadu_ps(row + j));
      for (; j < n1; ++j) o[j] = static_cast<bf16>(row[j]);
    }
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  bool fp32_out) {
  check_cpu(x, "x");
  check_cpu(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x [M, K], weight [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "linear: weight must be bf16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear: x bf16 or fp32");
  const bool pairs = x.scalar_type() == at::kBFloat16;  // bf16 activations: the vdpbf16ps order
  TORCH_CHECK(pairs != fp32_out, "linear: the result has x's dtype");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const int64_t kp = pairs ? (k + kK - 1) & ~(kK - 1) : (k + 7) & ~int64_t(7);
  std::vector<float> bias_f;
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "linear: bias size");
    at::Tensor b = bias->to(at::kFloat).contiguous();
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + n);
  }
  const bool native = pairs && isa() == 1;
  std::vector<float> xf = !pairs ? rows_fp32(x, kp) : native ? std::vector<float>() : Avx2Pairs::prepare(x, kp);
  std::vector<uint16_t> xb = native ? Avx512Pairs::prepare(x, kp) : std::vector<uint16_t>();
  at::Tensor out = at::empty({m, n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  std::vector<float> scratch(fp32_out ? 0 : m * n);
  float* acc = fp32_out ? out.data_ptr<float>() : scratch.data();
  const uint16_t* wp = u16(w);
  // Grain: enough columns that a task is worth a thread, whatever m is.
  const int64_t grain = std::max<int64_t>(kNB, (int64_t(1) << 14) / std::max<int64_t>(1, m * k / 8));
  at::parallel_for(0, (n + kNB - 1) / kNB, std::max<int64_t>(1, grain / kNB), [&](int64_t b, int64_t e) {
    const int64_t n0 = b * kNB, n1 = std::min(e * kNB, n);
    if (!pairs) {
      linear_block(xf.data(), m, kp, wp, k, acc, n, n0, n1);
      epilogue(acc, bias_f, out, m, n, n0, n1, fp32_out);
      return;
    }
    FlushDenormals ftz;  // the sums and the epilogue too, on both paths
    if (native) pairs_block<Avx512Pairs>(xb.data(), m, kp, wp, k, acc, n, n0, n1);
    else pairs_block<Avx2Pairs>(xf.data(), m, kp, wp, k, acc, n, n0, n1);
    epilogue(acc, bias_f, out, m, n, n0, n1, fp32_out);
  });
  return out;
}

// Which path the bf16 linear takes: "avx512_bf16" or "avx2" (the same bits either way).
std::string linear_isa() { return isa() == 1 ? "avx512_bf16" : "avx2"; }

// Tests force the AVX2 emulation on a CPU with AVX512-BF16 to compare the two paths.
void force_avx2(bool on) { g_isa = on ? 0 : (has_avx512_bf16() ? 1 : 0); }

// ---- attention --------------------------------------------------------------------
// Row r (query heads q[r], at position lengths[r] - 1 of cache slot slots[r]) attends
// over keys [0, lengths[r]) of that slot. k_cache, v_cache: [S, Hkv, L, D], bf16 (the
// engine's) or fp32 (tests against an fp32 oracle); C is their storage type.
//
// The keys go in chunks of kChunk, merged by online softmax in ascending order. Where the
// chunks start is the row's `align`: 0 lays them from position 0 (exact rows: the row's
// bits are its own); align = A > 0 lays them so that one ends at position A, as a kernel
// walking a batch padded to A keys (left padding) does. `fast` passes its batch's longest
// row, so its bits depend on its neighbours, as a padded batched decode's do.
//
// A score is q . k with hsum's order; eight keys go through one hsum_x8 (the same pairings).
template <typename T, typename C>
void attend_row(const T* q, const C* kc, const C* vc, int64_t len, int64_t align, int64_t g, int64_t d,
                float scale, T* out) {
  constexpr int kMaxG = 16, kMaxD = 256;
  alignas(32) float qf[kMaxG][kMaxD], acc[kMaxG][kMaxD];
  float mx[kMaxG], den[kMaxG];
  for (int64_t h = 0; h < g; ++h) {
    for (int64_t i = 0; i < d; ++i) { qf[h][i] = static_cast<float>(q[h * d + i]); acc[h][i] = 0.0f; }
    mx[h] = -INFINITY;
    den[h] = 0.0f;
  }
  alignas(32) float s[kMaxG][kChunk];
  const int64_t first = align > 0 && align % kChunk ? align % kChunk : kChunk;
  for (int64_t c0 = 0, cn = std::min(first, len); c0 < len; c0 += cn, cn = std::min(kChunk, len - c0)) {
    for (int64_t h = 0; h < g; ++h) {
      int64_t j = 0;
      for (; j + 8 <= cn; j += 8) {  // eight keys' dot products, then their eight tree sums at once
        __m256 a[8];
        for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
          const __m256 qv = _mm256_load_ps(&qf[h][i]);
          for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, load8(kc + (c0 + j + u) * d + i), a[u]);
        }
        hsum_x8(a, &s[h][j]);
        for (int u = 0; u < 8; ++u) s[h][j + u] *= scale;
      }
      for (; j < cn; ++j) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_load_ps(&qf[h][i]), load8(kc + (c0 + j) * d + i), a);
        s[h][j] = hsum(a) * scale;
      }
    }
    for (int64_t h = 0; h < g; ++h) {
      float cmax = -INFINITY;
      for (int64_t j = 0; j < cn; ++j) cmax = std::max(cmax, s[h][j]);
      const float m_new = std::max(mx[h], cmax);
      const float alpha = mx[h] == -INFINITY ? 0.0f : exp1(mx[h] - m_new);
      for (int64_t j = cn; j < kChunk; ++j) s[h][j] = -INFINITY;
      for (int64_t j = 0; j < kChunk; j += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(&s[h][j]), _mm256_set1_ps(m_new)));
        _mm256_store_ps(&s[h][j], p);  // masked keys: exp(-inf) -> 0
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < cn; ++j) sum += s[h][j];
      den[h] = den[h] * alpha + sum;
      mx[h] = m_new;
      const __m256 av = _mm256_set1_ps(alpha);
      for (int64_t i0 = 0; i0 < d; i0 += 64) {  // 8 blocks of the output in registers, keys ascending
        const int64_t nb = std::min<int64_t>(8, (d - i0) / 8);
        __m256 o[8];
        for (int64_t b = 0; b < nb; ++b) o[b] = _mm256_mul_ps(_mm256_load_ps(&acc[h][i0 + 8 * b]), av);
        for (int64_t j = 0; j < cn; ++j) {
          const __m256 p = _mm256_set1_ps(s[h][j]);
          const C* vr = vc + (c0 + j) * d + i0;
          for (int64_t b = 0; b < nb; ++b) o[b] = _mm256_fmadd_ps(p, load8(vr + 8 * b), o[b]);
        }
        for (int64_t b = 0; b < nb; ++b) _mm256_store_ps(&acc[h][i0 + 8 * b], o[b]);
      }
    }
  }
  for (int64_t h = 0; h < g; ++h)
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = static_cast<T>(acc[h][i] / den[h]);
}

// `aligns`: per row, 0 (exact) or the padded length its chunks align to (see attend_row).
// `window` > 0: a row sees only its last `window` keys (sliding-window layers) and lays its
// chunks from the first of them, so its bits stay a function of its own position.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slots, const at::Tensor& lengths, const at::Tensor& aligns, double scale,
                     int64_t window) {
  check_cpu(q, "q");
  check_cpu(k_cache, "k_cache");
  check_cpu(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "attention: q [N, H, D], caches [S, Hkv, L, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
              (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kFloat),
              "attention: the KV cache must be bf16 or fp32");
  const int64_t n = q.size(0), h = q.size(1), d = q.size(2), hkv = k_cache.size(1), lmax = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % 8 == 0 && d <= 256, "attention: head dim must be a multiple of 8, <= 256");
  TORCH_CHECK(h % hkv == 0 && h / hkv <= 16, "attention: query heads must be a multiple of KV heads (<= 16x)");
  at::Tensor sl = slots.to(at::kLong).contiguous(), ln = lengths.to(at::kLong).contiguous();
  at::Tensor al = aligns.to(at::kLong).contiguous();
  TORCH_CHECK(sl.numel() == n && ln.numel() == n && al.numel() == n, "attention: one slot, length, align per row");
  TORCH_CHECK(window >= 0, "attention: window must be >= 0");
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* lp = ln.data_ptr<int64_t>();
  const int64_t* ap = al.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < k_cache.size(0) && lp[r] >= 1 && lp[r] <= lmax && ap[r] >= 0,
                "attention: slot, length or align out of range");
  at::Tensor out = at::empty_like(q);
  const int64_t g = h / hkv;
  const bool fp32_cache = k_cache.scalar_type() == at::kFloat;
  at::parallel_for(0, n * hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t r = t / hkv, kvh = t % hkv, qo = (r * h + kvh * g) * d;
      // the row's keys are [lo, len): attend_row sees them as a prefix starting at lo
      const int64_t lo = window > 0 ? std::max<int64_t>(0, lp[r] - window) : 0;
      const int64_t off = ((sp[r] * hkv + kvh) * lmax + lo) * d, len = lp[r] - lo, align = ap[r] ? ap[r] - lo : 0;
      const float sc = static_cast<float>(scale);
      if (q.scalar_type() == at::kFloat && fp32_cache)
        attend_row(q.data_ptr<float>() + qo, k_cache.data_ptr<float>() + off, v_cache.data_ptr<float>() + off,
                   len, align, g, d, sc, out.data_ptr<float>() + qo);
      else if (q.scalar_type() == at::kFloat)
        attend_row(q.data_ptr<float>() + qo, u16(k_cache) + off, u16(v_cache) + off, len, align, g, d, sc,
                   out.data_ptr<float>() + qo);
      else
        attend_row(q.data_ptr<bf16>() + qo, u16(k_cache) + off, u16(v_cache) + off, len, align, g, d, sc,
                   out.data_ptr<bf16>() + qo);
    }
  });
  return out;
}

// ---- rmsnorm, gated activations ------------------------------------------------------
// rmsnorm as Hugging Face's Llama: h = x * rsqrt(mean(x^2) + eps) in fp32, cast to x's
// dtype, times the weight. `unit_offset` (Gemma): h times (1 + weight) in fp32, cast once.
template <typename T>
void rmsnorm_rows(const T* x, const uint16_t* w, T* out, int64_t rows, int64_t d, float eps, bool unit_offset) {
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
    if (unit_offset) {  // vector and tail: the same two fp32 products, one rounding
      const __m256 iv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= d; i += 8)
        store8(out + r * d + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(&xf[i]), iv), _mm256_add_ps(one, load8(w + i))));
      for (; i < d; ++i) out[r * d + i] = static_cast<T>((xf[i] * inv) * (1.0f + bf16_value(w[i])));
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

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "rmsnorm: weight must be bf16");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(weight.numel() == d, "rmsnorm: weight size");
  at::Tensor out = at::empty_like(x);
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    if (x.scalar_type() == at::kFloat)
      rmsnorm_rows(x.data_ptr<float>() + b * d, u16(weight), out.data_ptr<float>() + b * d, e - b, d, eps, unit_offset);
    else
      rmsnorm_rows(x.data_ptr<bf16>() + b * d, u16(weight), out.data_ptr<bf16>() + b * d, e - b, d, eps, unit_offset);
  });
  return out;
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
at::Tensor silu_mul(const at::Tensor& gate_up) { return act_mul<silu8>(gate_up); }
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return act_mul<gelu_tanh8>(gate_up); }

// ---- the decoder stack in one call ---------------------------------------------------
// models/llama.py's layer for a forward with bf16 activations and a bf16 cache (each row's
// attention chunks aligned as `aligns` says, see attend_row): the same kernels in the same order, called from here
// instead of ~14 Python dispatches per layer. RoPE and the residual adds round each op
// to bf16 as PyTorch's elementwise bf16 ops do (compute in fp32, round to nearest even),
// so every bit equals the Python path's (tests/test_kernels.py compares them).
inline float rnd(float v) { return static_cast<float>(static_cast<bf16>(v)); }

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

c10::optional<at::Tensor> maybe(const at::Tensor& t) {  // an empty tensor stands for "no bias"
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// Where the stack's time goes, by phase, for the step profile (scripts/profile_step.py);
// off unless asked for, and never part of any value.
const char* const kPhaseNames[] = {"norms", "gemm", "rope, kv write", "attention", "residual, silu"};
constexpr int kPhases = 5;
bool g_profiling = false;
double g_phase_ms[kPhases] = {};

struct Phase {
  int id;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~Phase() {
    if (g_profiling) g_phase_ms[id] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};

// Turns the phase timers on or off; returns the milliseconds gathered since the last call.
std::vector<std::pair<std::string, double>> stack_profile(bool on) {
  std::vector<std::pair<std::string, double>> out;
  for (int i = 0; i < kPhases; ++i) out.emplace_back(kPhaseNames[i], g_phase_ms[i]), g_phase_ms[i] = 0.0;
  g_profiling = on;
  return out;
}

// Per layer: ln1, qkv, qkv_bias, o, o_bias, ln2, gate_up, down, then Gemma's q_norm, k_norm,
// pre_ffn_norm, post_ffn_norm (empty tensors for the Llama family).
constexpr int kPerLayer = 12;
constexpr int64_t kMaxKV = 16 * 256;  // KV heads x head dim of one row, on the stack

// h [N, hidden] bf16, updated in place through every layer. cos, sin [N, D] bf16 (the rows'
// positions; cos_local, sin_local: the sliding layers' tables); caches [layers, S, Hkv, L, D]
// bf16; weights: kPerLayer tensors per layer; windows: per layer, 0 or its sliding window.
// `gemma`: Gemma 3's layer (models/gemma3.py): (1 + w) norms, q/k norms before RoPE, the
// attention and MLP outputs normed before their residual adds (ln2 is the post-attention norm,
// the MLP's input norm is pre_ffn_norm), GELU-tanh.
void decoder_stack(at::Tensor h, const std::vector<at::Tensor>& weights, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& cos_local, const at::Tensor& sin_local,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                   const at::Tensor& positions, const at::Tensor& aligns, int64_t heads, int64_t kv_heads, double eps,
                   double scale, const std::vector<int64_t>& windows, bool gemma) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kBFloat16, "decoder_stack: h [N, hidden] bf16");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 5,
              "decoder_stack: contiguous bf16 caches [layers, S, Hkv, L, D]");
  TORCH_CHECK(weights.size() % kPerLayer == 0 && int64_t(weights.size() / kPerLayer) == k_cache.size(0),
              "decoder_stack: 12 tensors per layer, one cache layer each");
  for (const at::Tensor* t : {&cos, &sin, &cos_local, &sin_local})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kBFloat16 && t->sizes() == cos.sizes(),
                "decoder_stack: cos, sin (global and local) [N, D] bf16");
  TORCH_CHECK(int64_t(windows.size()) == k_cache.size(0), "decoder_stack: one window per layer");
  const int64_t n = h.size(0), d = k_cache.size(4), lmax = k_cache.size(3), nslots = k_cache.size(1);
  const int64_t qs = heads * d, kvs = kv_heads * d, layer_stride = nslots * kv_heads * lmax * d;
  TORCH_CHECK(k_cache.size(2) == kv_heads && cos.size(0) == n && cos.size(1) == d, "decoder_stack: shapes");
  TORCH_CHECK(kvs <= kMaxKV, "decoder_stack: KV heads x head dim above ", kMaxKV);
  at::Tensor sl = slots.to(at::kLong).contiguous(), ps = positions.to(at::kLong).contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < nslots && pp[r] >= 0 && pp[r] < lmax, "decoder_stack: slot or position out of range");
  const at::Tensor lengths = ps + 1;
  at::Tensor q = at::empty({n, heads, d}, h.options());
  for (int64_t li = 0; li < k_cache.size(0); ++li) {
    const at::Tensor* W = &weights[li * kPerLayer];
    const int64_t window = windows[li];
    at::Tensor x, qkv, attn, y, gu, act, qn, kn;
    { Phase p{0}; x = rmsnorm(h, W[0], eps, gemma); }
    { Phase p{1}; qkv = linear(x, W[1], maybe(W[2]), false); }
    if (gemma) {  // q and k normed per head before RoPE
      Phase p{0};
      qn = rmsnorm(qkv.slice(1, 0, qs).contiguous().view({n * heads, d}), W[8], eps, true);
      kn = rmsnorm(qkv.slice(1, qs, qs + kvs).contiguous().view({n * kv_heads, d}), W[9], eps, true);
    }
    {
      Phase p{2};
      const bf16* qkvp = qkv.data_ptr<bf16>();
      bf16* kl = k_cache.data_ptr<bf16>() + li * layer_stride;
      bf16* vl = v_cache.data_ptr<bf16>() + li * layer_stride;
      const bf16* cos_p = (window ? cos_local : cos).data_ptr<bf16>();
      const bf16* sin_p = (window ? sin_local : sin).data_ptr<bf16>();
      at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {  // q rotated; k rotated and v copied into the cache
          const bf16* row = qkvp + r * (qs + 2 * kvs);
          const bf16* q_in = gemma ? qn.data_ptr<bf16>() + r * qs : row;
          const bf16* k_in = gemma ? kn.data_ptr<bf16>() + r * kvs : row + qs;
          const bf16 *cs = cos_p + r * d, *sn = sin_p + r * d;
          rope_row(q_in, cs, sn, heads, d, q.data_ptr<bf16>() + r * qs);
          alignas(64) bf16 k_rot[kMaxKV];
          rope_row(k_in, cs, sn, kv_heads, d, k_rot);
          for (int64_t g = 0; g < kv_heads; ++g) {
            const int64_t off = ((sp[r] * kv_heads + g) * lmax + pp[r]) * d;
            std::memcpy(kl + off, k_rot + g * d, d * sizeof(bf16));
            std::memcpy(vl + off, row + qs + kvs + g * d, d * sizeof(bf16));
          }
        }
      });
    }
    { Phase p{3}; attn = attention(q, k_cache[li], v_cache[li], sl, lengths, aligns, scale, window); }
    { Phase p{1}; y = linear(attn.view({n, qs}), W[3], maybe(W[4]), false); }
    if (gemma) { Phase p{0}; y = rmsnorm(y, W[5], eps, true); }
    { Phase p{4}; add_into(h, y); }
    { Phase p{0}; x = rmsnorm(h, gemma ? W[10] : W[5], eps, gemma); }
    { Phase p{1}; gu = linear(x, W[6], c10::nullopt, false); }
    { Phase p{4}; act = gemma ? gelu_tanh_mul(gu) : silu_mul(gu); }
    { Phase p{1}; y = linear(act, W[7], c10::nullopt, false); }
    if (gemma) { Phase p{0}; y = rmsnorm(y, W[11], eps, true); }
    { Phase p{4}; add_into(h, y); }
  }
}

bool cpu_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "batch-invariant x @ W^T + b (bf16 W, fp32 accumulation)");
  m.def("attention", &attention, "batch-invariant attention of query rows over their own cached prefix");
  m.def("rmsnorm", &rmsnorm, "per-row RMSNorm, fixed order (unit_offset: Gemma's 1 + weight)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up");
  m.def("decoder_stack", &decoder_stack, "every decoder layer for rows that all attend exactly (bf16)");
  m.def("stack_profile", &stack_profile, "ms per phase of decoder_stack since the last call; turns timing on/off");
  m.def("cpu_supported", &cpu_supported, "AVX2 and FMA present");
  m.def("linear_isa", &linear_isa, "the bf16 linear's path on this CPU: avx512_bf16 or avx2");
  m.def("force_avx2", &force_avx2, "tests: run the AVX2 emulation of vdpbf16ps even where the instruction exists");
  m.attr("CHUNK") = kChunk;
}
