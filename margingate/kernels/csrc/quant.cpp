// Quantized weights that stay quantized (contract.h, 1: dequantization belongs to the weight, not to
// the reduction). A quantized matrix is one uint8 tensor (kernels/quant_pack.py writes it): a header,
// then its parts, each a run of panels in one format (QuantPart, isa.h). Each element dequantizes to
// the bf16 value the bf16 loader stores (gguf-py's fp32 arithmetic, one rounding), so the linear over
// dequantized panels reduces the same bf16 products in the same order: the same bits as the bf16
// weights. Here: the checked view, the scalar reference, the AVX2 dequantizer, rows for lookups.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "int8_layout.h"
#include "quant_codes.h"

namespace mg {
namespace {

constexpr int64_t kHead = 4, kPartWords = 12;

const int64_t* words(const at::Tensor& blob) { return reinterpret_cast<const int64_t*>(blob.data_ptr()); }

float half(uint16_t bits) { return float(c10::Half(bits, c10::Half::from_bits())); }

// Code (l, k = 2 pair + e) of a panel, scalar, zero point not yet taken.
int code_at(const QuantPart& q, int64_t panel, int64_t pairs, int64_t pair, int64_t l, int e) {
  if (q.int8) return int8_code(q, panel, 2 * pairs, 2 * pair + e, l);
  const int64_t at = (panel * pairs + pair) * kPanel + l;
  if (q.bits == 8) return int8_t(q.codes[at * 2 + e]);
  const uint8_t b = q.codes[at];
  int code = e ? b >> 4 : b & 15;
  if (q.bits > 4) {
    const int64_t run = high_run(q.bits), width = q.bits - 4;
    const uint8_t h = q.high[((panel * (pairs / run) + pair / run) * kPanel + l) * 2 + e];
    code |= ((h >> (width * (pair % run))) & ((1 << width) - 1)) << 4;
  }
  return code;
}

// Element (l, 2 pair + e) of a panel, scalar: the reference every dequantizer must equal.
float element(const QuantPart& q, int64_t panel, int64_t kp, int64_t pair, int64_t l, int e) {
  const int64_t j = 2 * pair + e, at_d = (panel * (kp / q.block) + j / q.block) * kPanel + l;
  const int64_t at_s = (panel * (kp / q.group) + j / q.group) * kPanel + l;
  const float scale = half(q.d[at_d]) * q.unit * (q.s ? float(q.s[at_s]) : 1.0f);  // each product exact
  const float v = scale * float(code_at(q, panel, kp / 2, pair, l, e) - q.zero);
  return q.d_off ? v + half(q.d_off[at_d]) * (q.s_off ? float(q.s_off[at_s]) : 1.0f) : v;
}

uint16_t bf16_rne(float v) { return c10::BFloat16(v).x; }

// The scale (or offset) of 16 columns for 8 lanes of one pair row: lanes (l, even), (l, odd) for
// columns [c, c + 4).
inline __m256 four_columns_paired(const float* v, int64_t c) {
  const __m128 s = _mm_loadu_ps(v + c);
  return _mm256_set_m128(_mm_unpackhi_ps(s, s), _mm_unpacklo_ps(s, s));
}

// dequant_panel_avx2 for one format, a group at a time (the format's branches hoisted): per pair row
// 4 x 8 lanes (column l: even, odd), rounded as c10 rounds (bf16_bits8).
template <int Bits, bool Offset>
void dequant_groups(const QuantPart& q, int64_t panel, int64_t kp, uint16_t* dst) {
  constexpr int64_t kRowBytes = Bits == 8 ? 32 : 16, kRun = high_run(Bits);
  const int64_t groups = kp / q.group, rows = q.group / 2;
  const uint8_t* c = q.codes + panel * (kp / 2) * kRowBytes;
  const uint8_t* hi = Bits > 4 ? q.high + panel * (kp / 2 / kRun) * 32 : nullptr;
  const __m256i zero = _mm256_set1_epi32(q.zero);
  for (int64_t g = 0; g < groups; ++g) {
    alignas(32) float scale[16], offset[16];
    group_scales(q, panel, kp, g, scale, offset);
    __m256 s[4], o[4];
    for (int j = 0; j < 4; ++j)
      s[j] = four_columns_paired(scale, 4 * j), o[j] = Offset ? four_columns_paired(offset, 4 * j) : s[j];
    for (int64_t r = 0; r < rows; ++r, c += kRowBytes, dst += 2 * kPanel) {
      __m128i b[2];
      code_bytes<Bits>(c, hi, int((Bits - 4) * (r % kRun)), b);
      if (Bits > 4 && r % kRun == kRun - 1) hi += 32;
      for (int j = 0; j < 4; ++j) {
        const __m128i bytes = j % 2 ? _mm_srli_si128(b[j / 2], 8) : b[j / 2];
        __m256 f = _mm256_mul_ps(s[j], _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepi8_epi32(bytes), zero)));
        if constexpr (Offset) f = _mm256_add_ps(f, o[j]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * j), bf16_bits8(f));
      }
    }
  }
}

// One part's header words (panels, group, block, bits, zero, then where its arrays lie), checked.
QuantPart read_part(const uint8_t* base, int64_t size, int64_t k, const int64_t* p, int64_t i, bool int8) {
  const int64_t panels = p[0], group = p[1], block = p[2], bits = p[3], zero = p[4], table = p[11];
  const bool high = bits == 5 || bits == 6 || bits == 3;
  const bool blocks = (group == 16 || group == 32) && block > 0 && block % group == 0 && k % block == 0;
  const bool layout = bits == 4 || bits == 5 || bits == 6 || bits == 8 || (int8 && (bits == 2 || bits == 3));
  const bool tabled = table == 0 || (int8 && (bits == 3 || bits == 4) && zero == 0 && code_table(table));  // int8's
  TORCH_CHECK(panels > 0 && (group == 16 || group == 32) && blocks && layout && tabled && zero >= 0 &&
                  zero < (bits == 8 ? 1 : 1 << bits),
              "quantized weight: part ", i, " has a bad format");
  const bool s_ok = p[8] >= 0 || block == group, off_ok = p[9] >= 0 ? p[10] >= 0 || block == group : p[10] == -1;
  TORCH_CHECK(p[5] >= 0 && (p[6] >= 0) == high && p[7] >= 0 && s_ok && off_ok,
              "quantized weight: part ", i, " lacks codes or scales its format needs");
  const int64_t per_block = panels * (k / block) * kPanel, per_group = panels * (k / group) * kPanel;
  const int64_t code_size = int8 ? panels * (k / 4) * quad_bytes(int(bits)) : panels * k * kPanel / (bits == 8 ? 1 : 2);
  const int64_t high_size = int8 ? panels * (k / 4) * high_bytes(int(bits)) : panels * k / high_run(int(bits)) * kPanel;
  const int64_t sizes[6] = {code_size, high_size, 2 * per_block, per_group, 2 * per_block, per_group};
  for (int a = 0; a < 6; ++a)
    TORCH_CHECK(p[5 + a] == -1 || (p[5 + a] >= 0 && p[5 + a] % 2 == 0 && p[5 + a] + sizes[a] <= size),
                "quantized weight: part ", i, " lies outside the tensor");
  auto at = [&](int a) { return p[5 + a] >= 0 ? base + p[5 + a] : nullptr; };
  return {at(0), at(1), reinterpret_cast<const uint16_t*>(at(2)), reinterpret_cast<const int8_t*>(at(3)),
          reinterpret_cast<const uint16_t*>(at(4)), reinterpret_cast<const int8_t*>(at(5)), panels, group, block,
          int(bits), int(zero), int8, code_table(table), code_unit(table)};
}

}  // namespace

bool is_quantized(const at::Tensor& w) { return w.scalar_type() == at::kByte && w.dim() == 1; }

QuantMatrix quant_matrix(const at::Tensor& blob) {
  check_cpu(blob, "quantized weight");
  const int64_t size = blob.numel();
  TORCH_CHECK(is_quantized(blob) && size >= kHead * 8 && (words(blob)[0] == kQuantMagic || words(blob)[0] == kInt8Magic),
              "linear: not a quantized weight (kernels.quant_pack writes them)");
  const int64_t* h = words(blob);
  QuantMatrix m{h[1], h[2], 0, {}, h[0] == kInt8Magic};
  TORCH_CHECK(m.n > 0 && m.k > 0 && m.k % kBlock == 0 && h[3] > 0 && size >= (kHead + h[3] * kPartWords) * 8,
              "quantized weight: bad header");
  const uint8_t* base = blob.data_ptr<uint8_t>();
  for (int64_t i = 0; i < h[3]; ++i) {
    m.parts.push_back(read_part(base, size, m.k, h + kHead + i * kPartWords, i, m.int8));
    m.panels += m.parts.back().panels;
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
  by_format(q, [&](auto f) { dequant_groups<decltype(f)::kBits, decltype(f)::kOffset>(q, panel, kp, dst); });
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
