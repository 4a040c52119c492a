// The linear on AVX512-BF16 (VDPBF16PS), two steps of one chain per instruction. Its own translation
// unit, the only one compiled for AVX512-BF16 (the target pragma). The caller sets FTZ | DAZ for
// the adds that close each block.
//
// VDPBF16PS computes, per fp32 lane, acc = fma(a.lo * b.lo, fma(a.hi * b.hi, acc)): two FMAs in a
// row, each rounded, denormals flushed (its fixed FTZ | DAZ). So a lane whose pair holds two
// consecutive steps of the contract's even chain (hi: step p, lo: step p + 1) advances that chain
// by two steps exactly as two FMAs would (contract.h, 1). Weights stay in the AMX panels (pair p =
// one even and one odd element): two panel rows p, p + 1 are regrouped in registers into
// (even p + 1 | even p) and (odd p + 1 | odd p); x arrives regrouped the same way (linear.cpp).
#pragma GCC target("avx512f,avx512bw,avx512bf16")
#include "contract.h"
#include "isa.h"

namespace mg {
namespace {

constexpr __mmask32 kHi = 0xAAAAAAAAu;  // the high bf16 of every 32-bit lane

// MR rows x NR panels. w[j]: panel j at pair 0. xw: per block, 8 words of the even chain
// (lo = x[4j + 2], hi = x[4j]) then 8 of the odd one (lo = x[4j + 3], hi = x[4j + 1]).
template <int MR, int NR>
void dp_tile(const uint16_t* xw, int64_t kp, const uint16_t* const* w, float* acc, int64_t ldacc, int64_t b0,
             int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    __m512 e[MR][NR], o[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) e[i][j] = o[i][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < 8; ++s) {  // steps 2s and 2s + 1 of both chains
      __m512bh we[NR], wo[NR];
      for (int j = 0; j < NR; ++j) {
        const uint16_t* row = w[j] + (b * 16 + 2 * s) * 2 * kPanel;
        const __m512i r0 = _mm512_loadu_si512(row), r1 = _mm512_loadu_si512(row + 2 * kPanel);
        we[j] = (__m512bh)_mm512_mask_blend_epi16(kHi, r1, _mm512_slli_epi32(r0, 16));
        wo[j] = (__m512bh)_mm512_mask_blend_epi16(kHi, _mm512_srli_epi32(r1, 16), r0);
      }
      for (int i = 0; i < MR; ++i) {
        const uint16_t* xr = xw + i * kp + b * kBlock;
        const __m512bh xe = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 2 * s));
        const __m512bh xo = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 16 + 2 * s));
        for (int j = 0; j < NR; ++j) {
          e[i][j] = _mm512_dpbf16_ps(e[i][j], xe, we[j]);
          o[i][j] = _mm512_dpbf16_ps(o[i][j], xo, wo[j]);
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {  // acc = acc + (e + o)
        float* a = acc + i * ldacc + j * kPanel;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_add_ps(e[i][j], o[i][j])));
      }
  }
}

template <int R, int NR>
void dp_tail_rows(const LinearTask& t, const uint16_t* const* w, int64_t i, int64_t c, int64_t left, int64_t b0,
                  int64_t b1) {
  if constexpr (R >= 1) {
    if (left == R) dp_tile<R, NR>(t.xb + i * t.kp, t.kp, w, t.acc + i * t.ldacc + c, t.ldacc, b0, b1);
    else dp_tail_rows<R - 1, NR>(t, w, i, c, left, b0, b1);
  }
}

// Panels [p, p + NR) for every row: a slice of kSliceBlocks blocks stays in L1 while the row tiles
// pass (each tile adds its blocks to acc in ascending order, so the slicing changes no bit).
template <int MR, int NR>
void dp_rows(const LinearTask& t, int64_t p) {
  const uint16_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = t.w + (p + j) * t.kp * kPanel;
  const int64_t blocks = t.kp / kBlock;
  for (int64_t b0 = 0; b0 < blocks; b0 += kSliceBlocks) {
    const int64_t b1 = min64(blocks, b0 + kSliceBlocks);
    int64_t i = 0;
    for (; i + MR <= t.m; i += MR)
      dp_tile<MR, NR>(t.xb + i * t.kp, t.kp, w, t.acc + i * t.ldacc + p * kPanel, t.ldacc, b0, b1);
    if (i < t.m) dp_tail_rows<MR - 1, NR>(t, w, i, p * kPanel, t.m - i, b0, b1);
  }
}

}  // namespace

void linear_avx512bf16(const LinearTask& t) {
  int64_t p = t.p0;
  for (; p + 2 <= t.p1; p += 2) dp_rows<4, 2>(t, p);
  if (p < t.p1) dp_rows<4, 1>(t, p);
}

}  // namespace mg
