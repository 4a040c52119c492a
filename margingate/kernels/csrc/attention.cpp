// Attention of query rows over their own cached prefix (contract.h, 3).
#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels.h"

namespace mg {
namespace {

// Scores of one query head (fp32, d values) against n keys: s[j] = (q . k_j) * scale, each dot
// product in hsum's order; eight keys go through one hsum_x8 (the same pairings).
template <typename C>
void chunk_scores(const float* qf, const C* keys, int64_t n, int64_t d, float scale, float* s) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {  // eight keys' dot products, then their eight tree sums at once
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_load_ps(qf + i);
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, load8(keys + (j + u) * d + i), a[u]);
    }
    hsum_x8(a, s + j);
    for (int u = 0; u < 8; ++u) s[j + u] *= scale;
  }
  for (; j < n; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_load_ps(qf + i), load8(keys + j * d + i), a);
    s[j] = hsum(a) * scale;
  }
}

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
// A score is q . k with hsum's order (chunk_scores).
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
    for (int64_t h = 0; h < g; ++h) chunk_scores(qf[h], kc + c0 * d, cn, d, scale, s[h]);
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

}  // namespace

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

}  // namespace mg
