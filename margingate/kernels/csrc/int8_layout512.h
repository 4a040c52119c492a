// The integer-exact contract (contract.h, 5) on 16 columns in one zmm, shared by the AVX-512 VNNI and the
// AMX-INT8 units (each includes it under its own target pragma; internal linkage, like contract.h): a
// quad's codes as 64 bytes, the fold of a group's int32 sums into block sums, and the float epilogue.
#pragma once

#include "int8_layout.h"

namespace mg {
namespace {

// One quad's 64 codes as bytes, byte 4 * l + k % 4 for column l (int8_layout.h's order; a table's
// indices, not yet looked up): AMX's VNNI row.
template <int Bits>
inline __m512i quad_codes512(const uint8_t* c, const uint8_t* h) {
  if constexpr (Bits == 8) return _mm512_loadu_si512(c);
  if constexpr (Bits <= 3) {  // code i's low two: bits 2 (i / 16) of byte i % 16, so 128-bit lane L by 2L
    const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    __m512i codes = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0)), _mm512_set1_epi8(3));
    if constexpr (Bits == 3) {  // the third: bit i / 8 of byte i % 8, so qword L rotates bit L of each byte to 2
      int64_t w;
      std::memcpy(&w, h, 8);
      const __m512i H = _mm512_rolv_epi64(_mm512_set1_epi64(w), _mm512_set_epi64(59, 60, 61, 62, 63, 0, 1, 2));
      codes = _mm512_ternarylogic_epi64(codes, H, _mm512_set1_epi8(4), 0xF8);  // codes | (H & 4)
    }
    return codes;
  }
  // Codes 0-31 are the low nibbles of the 32 bytes, 32-63 the high ones: the upper half shifted by 4.
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
  __m512i codes = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), _mm512_set1_epi8(15));
  // The bits above 4 rotate into place (each stays in its byte) and join in one ternary-logic op: codes | (H & m).
  if constexpr (Bits == 5) {  // code i's fifth bit: bit i / 8 of byte i % 8, so qword L rotates bit L to 4
    int64_t w;
    std::memcpy(&w, h, 8);
    const __m512i H = _mm512_rolv_epi64(_mm512_set1_epi64(w), _mm512_set_epi64(61, 62, 63, 0, 1, 2, 3, 4));
    codes = _mm512_ternarylogic_epi64(codes, H, _mm512_set1_epi8(0x10), 0xF8);
  } else if constexpr (Bits == 6) {  // the top two: bits 2 (i / 16) of byte i % 16, so 128-bit lane L rotates them to 4
    const __m512i H = _mm512_rolv_epi64(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))),
                                        _mm512_set_epi64(62, 62, 0, 0, 2, 2, 4, 4));
    codes = _mm512_ternarylogic_epi64(codes, H, _mm512_set1_epi8(0x30), 0xF8);
  }
  return codes;
}

// The part's table plus 128 (unsigned bytes, 1 to 241 for kvalues_iq4nl) in every 128-bit lane, for VPSHUFB
// (none: unused): the VNNI path's codes are then unsigned, and 128 joins the zero point.
inline __m512i table512_u8(const QuantPart& q) {
  const __m128i t = q.table ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q.table)) : _mm_setzero_si128();
  return _mm512_broadcast_i32x4(_mm_xor_si128(t, _mm_set1_epi8(-128)));
}

struct GroupScales {
  __m512i s, s_off;  // the group's int8 scales of 16 columns (absent: 1)
};

inline __m512i widen_s(const int8_t* p) {  // 16 int8 scales as int32 (absent: 1)
  return p ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))) : _mm512_set1_epi32(1);
}

template <bool Offset>
inline GroupScales group_scales512(const QuantPart& q, int64_t at_s) {
  return {widen_s(q.s ? q.s + at_s : nullptr), Offset ? widen_s(q.s_off ? q.s_off + at_s : nullptr) : _mm512_setzero_si512()};
}

// One row's group sums `a` folded into its block sums, exactly: S += s * (a - zero * xsum), M += s_off * xsum.
template <bool Offset>
inline void fold_row(const GroupScales& g, __m512i a, int32_t xsum, int zero, __m512i& S, __m512i& M) {
  S = _mm512_add_epi32(S, _mm512_mullo_epi32(_mm512_sub_epi32(a, _mm512_set1_epi32(xsum * zero)), g.s));
  if constexpr (Offset) M = _mm512_add_epi32(M, _mm512_mullo_epi32(_mm512_set1_epi32(xsum), g.s_off));
}

struct BlockScales {
  __m512 d, d_off;  // the block's fp16 scales of 16 columns, exact in fp32
};

inline __m512 widen_d(const uint16_t* p) {  // 16 fp16 scales as fp32, exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <bool Offset>
inline BlockScales block_scales512(const QuantPart& q, int64_t at_d) {
  const __m512 d = _mm512_mul_ps(widen_d(q.d + at_d), _mm512_set1_ps(q.unit));  // the table's power of two: exact
  return {d, Offset ? widen_d(q.d_off + at_d) : _mm512_setzero_ps()};
}

// acc = acc + float(S) * (scale * d) [then + float(M) * (scale * d_off)]: no FMA, each step rounded.
template <bool Offset>
inline void epilogue_row(const BlockScales& b, float scale, __m512i S, __m512i M, float* acc) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc), _mm512_mul_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(sc, b.d)));
  if constexpr (Offset) v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(sc, b.d_off)));
  _mm512_storeu_ps(acc, v);
}

}  // namespace
}  // namespace mg
