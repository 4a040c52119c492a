// The integer-exact contract's code layout (contract.h, 5; kernels/quant_pack.py writes it), read one
// code at a time (the scalar reference) or a quad of 4 k for 16 columns at once (AVX2). Per panel and
// quad, code i = 4 * column + k % 4 (i in 0..63): 4 to 6 bits: low 4 bits in byte i % 32, nibble i / 32
// (32 bytes); 2 and 3 bits: low 2 bits in bits 2 (i / 16) of byte i % 16 (16 bytes); 8-bit codes: 64
// signed bytes, byte i. The bits above: 3 and 5 bits: bit i / 8 of byte i % 8 (8 bytes); 6 bits: bits
// 2 (i / 16) of byte i % 16 (16 bytes). A part with a table (3 or 4 bits) reads code c as table[c], a
// signed value (times the table's power of two, which the epilogue applies to d). Internal linkage (contract.h).
//
// The codes' integer values, per GGUF type (value - zero, times the group's s):
//   Q4_0 [-8, 7]; Q4_1, Q4_K [0, 15]; Q5_0 [-16, 15]; Q5_1, Q5_K [0, 31]; Q6_K [-32, 31]; Q8_0 [-128, 127];
//   Q2_K [0, 3], s and s_off in [0, 15]; Q3_K [-4, 3] (codes 0..7, zero 4), s in [-32, 31];
//   IQ4_NL, IQ4_XS: kvalues_iq4nl, [-127, 113]; IQ4_XS's s in [-32, 31]. Q4_K/Q5_K's s, s_off in [0, 63].
//   The IQ grids re-coded (3- or 4-bit codes into a table, quant_codes.h): IQ2_XXS/XS/S +-{8, 25, 43}, IQ3_XXS
//   [-62, 62], IQ3_S [-15, 15], s = 2 ls + 1 in [1, 31]; IQ1_S/M {+-1, +-7, +-9}, s in [1, 15]. All within
//   the table bound (|value| <= 127) and |s| <= 128 below.
// Saturation bounds (VPMADDUBSW adds two u8 x s8 products into int16, max 32767): unsigned codes of 2,
// 3, 4, 5 and 6 bits (<= 3, 7, 15, 31, 63) against q in [-127, 127] make a pair of at most 762, 1778,
// 3810, 7874, 16002; signed codes (8 bits, maybe -128; a table's, |value| <= 127) go in as |code| (<=
// 128) against q carrying the code's sign, a pair at most 2 * 128 * 127 = 32512. So 8 (2 to 4 bits; a
// group has at most 8 quads), 4, 2 and 1 (signed) such int16 results may be added in int16 before
// VPMADDWD by 1 widens them. int32 block sums: a block of at most 256 k with |code - zero| <= 128, |q| <=
// 127 and |s| <= 128 sums at most 256 x 128 x 127 x 128 < 2^29 in magnitude (the offsets' M likewise).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.h"
#include "quant_codes.h"

namespace mg {
namespace {

constexpr int64_t quad_bytes(int bits) { return bits == 8 ? 64 : bits <= 3 ? 16 : 32; }  // code bytes per quad
constexpr int64_t high_bytes(int bits) { return bits == 3 || bits == 5 ? 8 : bits == 6 ? 16 : 0; }
template <int Bits>
constexpr int64_t kQuadBytes = quad_bytes(Bits);
template <int Bits>
constexpr int64_t kHighBytes = high_bytes(Bits);

// Code (column l, k) of a panel, zero point not taken: its value (8 bits or a table's: signed).
inline int int8_code(const QuantPart& q, int64_t panel, int64_t kp, int64_t k, int64_t l) {
  const int64_t quad = panel * (kp / 4) + k / 4, i = 4 * l + k % 4;
  if (q.bits == 8) return int8_t(q.codes[quad * 64 + i]);
  if (q.bits <= 3) {
    int c = (q.codes[quad * 16 + i % 16] >> (2 * (i / 16))) & 3;
    if (q.bits == 3) c |= ((q.high[quad * 8 + i % 8] >> (i / 8)) & 1) << 2;
    return q.table ? q.table[c] : c;
  }
  int c = (q.codes[quad * 32 + i % 32] >> (4 * (i / 32))) & 15;
  if (q.bits == 5) c |= ((q.high[quad * 8 + i % 8] >> (i / 8)) & 1) << 4;
  if (q.bits == 6) c |= ((q.high[quad * 16 + i % 16] >> (2 * (i / 16))) & 3) << 4;
  return q.table ? q.table[c] : c;
}

inline int32_t load4(const int8_t* p) {  // a row's 4 q of one quad
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// m rows in tiles of R, then one tile of the rows left: tile(std::integral_constant<int, n>{}, first row).
template <int R, class F>
inline void row_tail(int64_t left, int64_t r0, F& tile) {
  if constexpr (R >= 1) {
    if (left == R) tile(std::integral_constant<int, R>{}, r0);
    else row_tail<R - 1>(left, r0, tile);
  }
}

template <int R, class F>
inline void row_tiles(int64_t m, F tile) {
  int64_t r = 0;
  for (; r + R <= m; r += R) tile(std::integral_constant<int, R>{}, r);
  if (r < m) row_tail<R - 1>(m - r, r, tile);
}

// f(QuantFormat<bits, offset, table>{}) for an integer-exact part: one instantiation per code layout.
template <class F>
inline void by_int8_format(const QuantPart& q, F f) {
  const bool off = q.d_off != nullptr;
  switch (q.bits) {
    case 2: return off ? f(QuantFormat<2, true>{}) : f(QuantFormat<2, false>{});
    case 3:
      if (q.table) return off ? f(QuantFormat<3, true, true>{}) : f(QuantFormat<3, false, true>{});
      return off ? f(QuantFormat<3, true>{}) : f(QuantFormat<3, false>{});
    case 4:
      if (q.table) return off ? f(QuantFormat<4, true, true>{}) : f(QuantFormat<4, false, true>{});
      return off ? f(QuantFormat<4, true>{}) : f(QuantFormat<4, false>{});
    default: return by_format(q, f);
  }
}

// A kernel's tiles for q's layout: tile(QuantFormat<bits, offset, table>{}, std::integral_constant<int,
// group>{}), groups being 16 or 32 k (quant.cpp checks).
template <class F>
inline void by_layout(const QuantPart& q, F tile) {
  by_int8_format(q, [&](auto f) {
    if (q.group == 16) tile(f, std::integral_constant<int, 16>{});
    else tile(f, std::integral_constant<int, 32>{});
  });
}

// One quad's 64 codes (a table's indices, not yet looked up): lo = columns 0-7, hi = columns 8-15, each
// 32-bit lane a column's 4 k.
template <int Bits>
inline void quad_codes(const uint8_t* c, const uint8_t* h, __m256i& lo, __m256i& hi) {
  if constexpr (Bits == 8) {
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
    return;
  } else if constexpr (Bits <= 3) {  // 128-bit lane 0 / 1 of lo: field 0 / 1; of hi: field 2 / 3
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    const __m256i m = _mm256_set1_epi8(3);
    lo = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0)), m);
    hi = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set_epi32(6, 6, 6, 6, 4, 4, 4, 4)), m);
    if constexpr (Bits == 3) {  // qword lane l of lo wants bit l of each byte at bit 2, of hi bit 4 + l
      int64_t w;
      std::memcpy(&w, h, 8);
      const __m256i H = _mm256_set1_epi64x(w), one = _mm256_set1_epi8(1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi64(H, _mm256_set_epi64x(3, 2, 1, 0)), one), 2));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srlv_epi64(H, _mm256_set_epi64x(7, 6, 5, 4)), one), 2));
    }
    return;
  }
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), m = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
  if constexpr (Bits == 5) {  // qword lane l of lo wants bit l of each byte at bit 4, of hi bit 4 + l
    int64_t w;
    std::memcpy(&w, h, 8);
    const __m256i H = _mm256_set1_epi64x(w), b = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sllv_epi64(H, _mm256_set_epi64x(1, 2, 3, 4)), b));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi64(H, _mm256_set_epi64x(3, 2, 1, 0)), b));
  } else if constexpr (Bits == 6) {  // 128-bit lane 0 / 1 of lo: field 0 / 1; of hi: field 2 / 3
    const __m256i H = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    const __m256i b = _mm256_set1_epi8(0x30);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sllv_epi32(H, _mm256_set_epi32(2, 2, 2, 2, 4, 4, 4, 4)), b));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi32(H, _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0)), b));
  }
}

}  // namespace
}  // namespace mg
