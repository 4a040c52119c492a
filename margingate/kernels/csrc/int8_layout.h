// The integer-exact contract's code layout (contract.h, 5; kernels/quant_pack.py writes it), read one
// code at a time (the scalar reference) or a quad of 4 k for 16 columns at once (AVX2). Per panel and
// quad, code i = 4 * column + k % 4 (i in 0..63): low 4 bits in byte i % 32, nibble i / 32 (32 bytes;
// 8-bit codes: 64 signed bytes, byte i); 5 bits: the fifth in bit i / 8 of byte i % 8 (8 bytes);
// 6 bits: the top two in bits 2 (i / 16) of byte i % 16 (16 bytes). Internal linkage (contract.h).
//
// Saturation bounds (VPMADDUBSW adds two u8 x s8 products into int16, max 32767): codes of 4, 5 and 6
// bits are unsigned (<= 15, 31, 63) and q in [-127, 127], so a pair is at most 2 * 63 * 127 = 16002;
// 8-bit codes (signed, maybe -128) go in as |code| (<= 128) against q carrying the code's sign, so a
// pair is at most 2 * 128 * 127 = 32512. So 8, 4, 2 and 1 such int16 results (4, 5, 6, 8 bits: 8 x
// 3810, 4 x 7874, 2 x 16002, 32512) may be added in int16 before VPMADDWD by 1 widens them. int32 block sums: at most 16 groups x 128 x 65024 (6 bits, zero 32,
// |s| <= 128) < 2^31; K-quants with 6-bit s: 8 x 63 x 126k < 2^31.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.h"
#include "quant_codes.h"

namespace mg {
namespace {

template <int Bits>
constexpr int64_t kQuadBytes = Bits == 8 ? 64 : 32;  // code bytes per quad of a panel
template <int Bits>
constexpr int64_t kHighBytes = Bits == 5 ? 8 : Bits == 6 ? 16 : 0;

// Code (column l, k) of a panel, zero point not taken (8 bits: signed).
inline int int8_code(const QuantPart& q, int64_t panel, int64_t kp, int64_t k, int64_t l) {
  const int64_t quad = panel * (kp / 4) + k / 4, i = 4 * l + k % 4;
  if (q.bits == 8) return int8_t(q.codes[quad * 64 + i]);
  int c = (q.codes[quad * 32 + i % 32] >> (4 * (i / 32))) & 15;
  if (q.bits == 5) c |= ((q.high[quad * 8 + i % 8] >> (i / 8)) & 1) << 4;
  if (q.bits == 6) c |= ((q.high[quad * 16 + i % 16] >> (2 * (i / 16))) & 3) << 4;
  return c;
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

// A kernel's tiles for q's layout: tile(QuantFormat<bits, offset>{}, std::integral_constant<int, group>{}),
// groups being 16 or 32 k (quant.cpp checks).
template <class F>
inline void by_layout(const QuantPart& q, F tile) {
  by_format(q, [&](auto f) {
    if (q.group == 16) tile(f, std::integral_constant<int, 16>{});
    else tile(f, std::integral_constant<int, 32>{});
  });
}

// One quad's 64 codes: lo = columns 0-7, hi = columns 8-15, each 32-bit lane a column's 4 k.
template <int Bits>
inline void quad_codes(const uint8_t* c, const uint8_t* h, __m256i& lo, __m256i& hi) {
  if constexpr (Bits == 8) {
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
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
