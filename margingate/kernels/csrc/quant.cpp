// Quantized weights that stay quantized (contract.h, 1: dequantization belongs to the weight, not to
// the reduction). A quantized matrix is one uint8 tensor (kernels/quant_pack.py writes it): a header,
// then its parts, each a run of panels in one format (QuantPart, isa.h). Each element dequantizes to
// the bf16 value the bf16 loader stores (gguf-py's fp32 arithmetic, one rounding), so the linear over
// dequantized panels reduces the same bf16 products in the same order: the same bits as the bf16
// weights. Here: the checked view, the scalar reference, the AVX2 dequantizer, rows for lookups.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "quant_codes.h"

namespace mg {
namespace {

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

// dequant_panel_avx2 for one format, a group at a time (the format's branches hoisted): per pair row
// 4 x 8 lanes (column l: even, odd), rounded as c10 rounds (bf16_bits8).
template <int Bits, bool Offset>
void dequant_groups(const QuantPart& q, int64_t panel, int64_t kp, uint16_t* dst) {
  constexpr int64_t kRowBytes = kPanel * Bits / 4;
  const int64_t groups = kp / q.group, rows = q.group / 2;
  const uint8_t* c = q.codes + panel * (kp / 2) * kRowBytes;
  const __m256i zero = _mm256_set1_epi32(Bits == 4 ? q.zero : 0);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = (panel * groups + g) * kPanel;
    __m256 s[4], o[4];
    for (int j = 0; j < 4; ++j) s[j] = dup4(q.scale + at, 4 * j), o[j] = Offset ? dup4(q.offset + at, 4 * j) : s[j];
    for (int64_t r = 0; r < rows; ++r, c += kRowBytes, dst += 2 * kPanel) {
      __m128i b[2];
      code_bytes<Bits>(c, b);
      for (int j = 0; j < 4; ++j) {
        const __m128i bytes = j % 2 ? _mm_srli_si128(b[j / 2], 8) : b[j / 2];
        __m256 f = _mm256_mul_ps(s[j], _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepi8_epi32(bytes), zero)));
        if constexpr (Offset) f = _mm256_add_ps(f, o[j]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * j), bf16_bits8(f));
      }
    }
  }
}

}  // namespace

bool is_quantized(const at::Tensor& w) { return w.scalar_type() == at::kByte && w.dim() == 1; }

QuantMatrix quant_matrix(const at::Tensor& blob) {
  check_cpu(blob, "quantized weight");
  const int64_t size = blob.numel();
  TORCH_CHECK(is_quantized(blob) && size >= kHead * 8 && words(blob)[0] == kQuantMagic,
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
  if (q.bits == 4) {
    if (q.offset) return dequant_groups<4, true>(q, panel, kp, dst);
    return dequant_groups<4, false>(q, panel, kp, dst);
  }
  if (q.offset) return dequant_groups<8, true>(q, panel, kp, dst);
  return dequant_groups<8, false>(q, panel, kp, dst);
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
