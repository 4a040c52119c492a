// Quantized weights that stay quantized (contract.h, 1: dequantization belongs to the weight, not to
// the reduction). A quantized matrix is one uint8 tensor (kernels/quant_pack.py writes it): a header,
// then its parts, each a run of panels in one format (QuantPart, isa.h). Each element dequantizes to
// the bf16 value the bf16 loader stores (gguf-py's fp32 arithmetic, one rounding), so the linear over
// dequantized panels reduces the same bf16 products in the same order: the same bits as the bf16
// weights. Here: the checked view, the scalar reference, the AVX2 dequantizer, rows for lookups.
#include <ATen/Parallel.h>

#include "kernels.h"

namespace mg {
namespace {

constexpr int64_t kMagic = 0x3151474D;  // "MGQ1"
constexpr int64_t kHead = 4, kPartWords = 8;

const int64_t* words(const at::Tensor& blob) { return reinterpret_cast<const int64_t*>(blob.data_ptr()); }

// Element (l, 2q + e) of a panel, scalar: the reference every dequantizer must equal.
float element(const QuantPart& q, int64_t panel, int64_t kp, int64_t pair, int64_t l, int e) {
  const int64_t pairs = kp / 2;
  int code;
  if (q.bits == 4) {
    const uint8_t b = q.codes[(panel * pairs + pair) * kPanel + l];
    code = (e ? b >> 4 : b & 15) - q.zero;
  } else {
    code = int8_t(q.codes[((panel * pairs + pair) * kPanel + l) * 2 + e]);
  }
  const int64_t g = (panel * (kp / q.group) + 2 * pair / q.group) * kPanel + l;
  const float v = q.scale[g] * float(code);
  return q.offset ? v + q.offset[g] : v;
}

uint16_t bf16_rne(float v) { return c10::BFloat16(v).x; }

// The scale (or offset) of 16 columns for 8 lanes of one pair row: lanes (l, even), (l, odd) for
// columns [c, c + 4).
inline __m256 dup4(const float* v, int64_t c) {
  const __m128 s = _mm_loadu_ps(v + c);
  return _mm256_set_m128(_mm_unpackhi_ps(s, s), _mm_unpacklo_ps(s, s));
}

// A pair row's 32 codes as 4 x 8 int32, lanes in the packed order (column l: even, odd).
inline void codes_row(const QuantPart& q, const uint8_t* c, __m256i out[4]) {
  __m128i lo, hi;  // the 32 codes as bytes, in the packed order
  if (q.bits == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), m = _mm_set1_epi8(15);
    const __m128i ev = _mm_and_si128(b, m), od = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    lo = _mm_unpacklo_epi8(ev, od), hi = _mm_unpackhi_epi8(ev, od);
  } else {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16));
  }
  const __m256i zero = _mm256_set1_epi32(q.bits == 4 ? q.zero : 0);
  out[0] = _mm256_sub_epi32(_mm256_cvtepi8_epi32(lo), zero);
  out[1] = _mm256_sub_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)), zero);
  out[2] = _mm256_sub_epi32(_mm256_cvtepi8_epi32(hi), zero);
  out[3] = _mm256_sub_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)), zero);
}

}  // namespace

bool is_quantized(const at::Tensor& w) { return w.scalar_type() == at::kByte && w.dim() == 1; }

QuantMatrix quant_matrix(const at::Tensor& blob) {
  check_cpu(blob, "quantized weight");
  const int64_t size = blob.numel();
  TORCH_CHECK(is_quantized(blob) && size >= kHead * 8 && words(blob)[0] == kMagic,
              "linear: not a quantized weight (kernels.quant_pack writes them)");
  const int64_t* h = words(blob);
  QuantMatrix m{h[1], h[2], 0, {}};
  TORCH_CHECK(m.n > 0 && m.k > 0 && m.k % kBlock == 0 && h[3] > 0 && size >= (kHead + h[3] * kPartWords) * 8,
              "quantized weight: bad header");
  const uint8_t* base = blob.data_ptr<uint8_t>();
  for (int64_t i = 0; i < h[3]; ++i) {
    const int64_t* p = h + kHead + i * kPartWords;
    const int64_t panels = p[0], group = p[1], bits = p[2];
    TORCH_CHECK(panels > 0 && (group == 16 || group == 32) && (bits == 4 || bits == 8) && p[3] >= 0 && p[3] < 16,
                "quantized weight: part ", i, " has a bad format");
    const int64_t codes = panels * m.k * kPanel * bits / 8, scales = panels * (m.k / group) * kPanel * 4;
    auto fits = [&](int64_t at, int64_t bytes) { return at >= 0 && at % 4 == 0 && at + bytes <= size; };
    TORCH_CHECK(fits(p[4], codes) && fits(p[5], scales) && (p[6] == -1 || fits(p[6], scales)),
                "quantized weight: part ", i, " lies outside the tensor");
    m.parts.push_back({base + p[4], reinterpret_cast<const float*>(base + p[5]),
                       p[6] == -1 ? nullptr : reinterpret_cast<const float*>(base + p[6]), panels, group, int(bits),
                       int(p[3])});
    m.panels += panels;
  }
  TORCH_CHECK(m.panels == (m.n + kPanel - 1) / kPanel, "quantized weight: ", m.panels, " panels for ", m.n, " rows");
  return m;
}

std::pair<const QuantPart*, int64_t> QuantMatrix::locate(int64_t panel) const {
  for (const QuantPart& q : parts) {
    if (panel < q.panels) return {&q, panel};
    panel -= q.panels;
  }
  TORCH_CHECK(false, "quantized weight: no panel ", panel);
}

void dequant_panel_avx2(const QuantPart& q, int64_t panel, int64_t kp, uint16_t* dst) {
  const int64_t pairs = kp / 2, row_bytes = kPanel * q.bits / 4;  // code bytes per pair row
  const uint8_t* c = q.codes + panel * pairs * row_bytes;
  __m256 s[4], o[4];
  for (int64_t pair = 0; pair < pairs; ++pair, c += row_bytes, dst += 2 * kPanel) {
    if (2 * pair % q.group == 0) {  // a new group: its scales (and offsets), duplicated per pair
      const int64_t g = (panel * (kp / q.group) + 2 * pair / q.group) * kPanel;
      for (int j = 0; j < 4; ++j) {
        s[j] = dup4(q.scale + g, 4 * j);
        if (q.offset) o[j] = dup4(q.offset + g, 4 * j);
      }
    }
    __m256i v[4];
    codes_row(q, c, v);
    for (int j = 0; j < 4; ++j) {
      __m256 f = _mm256_mul_ps(s[j], _mm256_cvtepi32_ps(v[j]));
      if (q.offset) f = _mm256_add_ps(f, o[j]);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * j), bf16_bits8(f));
    }
  }
}

void dequant_panel_reference(const QuantMatrix& m, int64_t panel, uint16_t* dst) {
  const auto [q, p] = m.locate(panel);
  for (int64_t pair = 0; pair < m.k / 2; ++pair)
    for (int64_t l = 0; l < kPanel; ++l)
      for (int e = 0; e < 2; ++e) *dst++ = bf16_rne(element(*q, p, m.k, pair, l, e));
}

// The whole matrix dequantized, packed ([panels, k / 2, 16, 2] bf16), by the scalar reference.
at::Tensor dequantize_packed(const at::Tensor& blob) {
  const QuantMatrix m = quant_matrix(blob);
  at::Tensor out = at::empty({m.panels, m.k / 2, kPanel, 2}, at::dtype(at::kBFloat16));
  at::parallel_for(0, m.panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      dequant_panel_reference(m, p, reinterpret_cast<uint16_t*>(out.data_ptr()) + p * m.k * kPanel);
  });
  return out;
}

// Rows `index` ([T] int64) of the matrix, dequantized ([T, k] bf16): an embedding lookup.
at::Tensor dequantize_rows(const at::Tensor& blob, const at::Tensor& index) {
  const QuantMatrix m = quant_matrix(blob);
  const at::Tensor idx = index.to(at::kLong).contiguous();
  at::Tensor out = at::empty({idx.numel(), m.k}, at::dtype(at::kBFloat16));
  for (int64_t t = 0; t < idx.numel(); ++t) {
    const int64_t r = idx.data_ptr<int64_t>()[t];
    TORCH_CHECK(r >= 0 && r < m.n, "row ", r, " outside a quantized matrix of ", m.n, " rows");
    const auto [q, p] = m.locate(r / kPanel);
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + t * m.k;
    for (int64_t j = 0; j < m.k; ++j) o[j] = bf16_rne(element(*q, p, m.k, j / 2, r % kPanel, int(j % 2)));
  }
  return out;
}

}  // namespace mg
