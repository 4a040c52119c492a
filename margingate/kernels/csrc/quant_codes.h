// A quantized matrix's layout (quant.cpp), shared by every unit that reads or writes one: the header's
// magic, a group's scales, and per pair row of a panel its 32 codes as bytes. Internal linkage, like
// contract.h: each ISA unit includes it under its own target (AVX2 and F16C at least).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "isa.h"

namespace mg {
namespace {

constexpr int64_t kQuantMagic = 0x3251474D;  // "MGQ2", the first header word (kernels/quant_pack.py)
constexpr int64_t kInt8Magic = 0x3849474D;   // "MGI8": the same header, codes in int8_layout.h's order

// A code layout: Bits per code, an offset or none, and (4 bits only) codes that index a table of values.
template <int Bits, bool Offset, bool Table = false>
struct QuantFormat {
  static constexpr int kBits = Bits;
  static constexpr bool kOffset = Offset;
  static constexpr bool kTable = Table;
  static constexpr bool kSigned = Bits == 8 || Table;  // codes are signed bytes (else unsigned, < 2^Bits)
};

// The code tables a part's last header word names (kernels/quant_pack.py, TABLES, and why): 0 none, 1
// llama.cpp's kvalues_iq4nl (ggml-common.h), the 16 int8 values of IQ4_NL and IQ4_XS (|value| <= 127); 2 to
// 5 the IQ grids' values with their signs (models/gguf_iq.py): IQ2 +-{8, 25, 43}, IQ3_XXS +-{4, ..., 62},
// IQ3_S +-{1, ..., 15}, IQ1 8 g +- 1 (|value| <= 62); 6 MXFP4's E2M1 values doubled (gguf-py's convention: the
// scale 2^(e - 128) halved), +-{0, 1, 2, 3, 4, 6, 8, 12}. Code c means table[c] x 2^-e: the power of two
// (code_unit) multiplies d once it is widened to fp32, exactly (d's fp16 range times 2^-3 stays normal).
alignas(16) constexpr int8_t kCodeTables[7][16] = {
    {},
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {8, 25, 43, 0, -8, -25, -43, 0},
    {4, 12, 20, 28, 36, 44, 52, 62, -4, -12, -20, -28, -36, -44, -52, -62},
    {1, 3, 5, 7, 9, 11, 13, 15, -1, -3, -5, -7, -9, -11, -13, -15},
    {-7, 1, 9, 0, -9, -1, 7, 0},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}};
constexpr float kCodeUnits[7] = {1.0f, 1.0f, 0.125f, 0.25f, 1.0f, 0.125f, 1.0f};
inline const int8_t* code_table(int64_t id) { return id >= 1 && id <= 6 ? kCodeTables[id] : nullptr; }
inline float code_unit(int64_t id) { return id >= 1 && id <= 6 ? kCodeUnits[id] : 1.0f; }

// f(QuantFormat<bits, has offset>{}) for the part's format: one instantiation per code layout of the bf16
// contract (4, 5, 6 and 8 bits; the integer-exact contract's are int8_layout.h's by_int8_format).
template <class F>
inline void by_format(const QuantPart& q, F f) {
  const bool off = q.d_off != nullptr;
  switch (q.bits) {
    case 4: return off ? f(QuantFormat<4, true>{}) : f(QuantFormat<4, false>{});
    case 5: return off ? f(QuantFormat<5, true>{}) : f(QuantFormat<5, false>{});
    case 6: return off ? f(QuantFormat<6, true>{}) : f(QuantFormat<6, false>{});
    default: return off ? f(QuantFormat<8, true>{}) : f(QuantFormat<8, false>{});
  }
}

// 16 lanes of d * s in fp32 (s null: d). VCVTPH2PS is exact for every fp16, subnormals included.
inline void column_scales(const uint16_t* d, const int8_t* s, float out[16]) {
  for (int h = 0; h < 2; ++h) {
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 8 * h)));
    if (s) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8 * h));
      v = _mm256_mul_ps(v, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
    _mm256_storeu_ps(out + 8 * h, v);
  }
}

// The scales (and offsets) of group g of a panel's 16 columns.
inline void group_scales(const QuantPart& q, int64_t panel, int64_t kp, int64_t g, float scale[16], float offset[16]) {
  const int64_t at_d = (panel * (kp / q.block) + g * q.group / q.block) * 16, at_s = (panel * (kp / q.group) + g) * 16;
  column_scales(q.d + at_d, q.s ? q.s + at_s : nullptr, scale);
  if (q.d_off) column_scales(q.d_off + at_d, q.s_off ? q.s_off + at_s : nullptr, offset);
}

// Pair rows per byte of the high bits.
constexpr int64_t high_run(int bits) { return bits > 4 ? 8 / (bits - 4) : 1; }

// One pair row's 32 codes as bytes in the packed order: columns 0-7 (even, odd each), then 8-15.
// 4-bit codes are one byte per pair (even in the low nibble), with the bits above 4 at `shift` in the
// 32 bytes at `hi` for 5 and 6 bits; 8-bit ones are signed bytes already so.
template <int Bits>
inline void code_bytes(const uint8_t* c, const uint8_t* hi, int shift, __m128i b[2]) {
  if constexpr (Bits == 8) {
    b[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    b[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), m = _mm_set1_epi8(15);
    const __m128i ev = _mm_and_si128(v, m), od = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    b[0] = _mm_unpacklo_epi8(ev, od), b[1] = _mm_unpackhi_epi8(ev, od);
    if constexpr (Bits > 4) {
      const __m128i mask = _mm_set1_epi8((1 << (Bits - 4)) - 1), count = _mm_cvtsi32_si128(shift);
      for (int i = 0; i < 2; ++i) {
        const __m128i h = _mm_srl_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + 16 * i)), count);
        b[i] = _mm_or_si128(b[i], _mm_slli_epi16(_mm_and_si128(h, mask), 4));
      }
    }
  }
}

}  // namespace
}  // namespace mg
