// A quantized matrix's layout (quant.cpp), shared by every unit that reads or writes one: the header's
// magic and, per pair row of a panel, its 32 codes as bytes. Internal linkage, like contract.h: each
// ISA unit includes it under its own target.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace mg {
namespace {

constexpr int64_t kQuantMagic = 0x3151474D;  // "MGQ1", the first header word (kernels/quant_pack.py)

// One pair row's 32 codes as bytes in the packed order: columns 0-7 (even, odd each), then 8-15.
// 4-bit codes are one byte per pair (even in the low nibble); 8-bit ones are signed bytes already so.
template <int Bits>
inline void code_bytes(const uint8_t* c, __m128i b[2]) {
  if constexpr (Bits == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), m = _mm_set1_epi8(15);
    const __m128i ev = _mm_and_si128(v, m), od = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    b[0] = _mm_unpacklo_epi8(ev, od), b[1] = _mm_unpackhi_epi8(ev, od);
  } else {
    b[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    b[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16));
  }
}

}  // namespace
}  // namespace mg
