// The linear on AVX512-BF16 (VDPBF16PS), two steps of one chain per instruction. Its own translation
// unit, the only one compiled for AVX512-BF16 (the target pragma). The caller sets FTZ | DAZ for
// the adds that close each block.
//
// VDPBF16PS computes, per fp32 lane, acc = fma(a.lo * b.lo, fma(a.hi * b.hi, acc)): two FMAs in a
// row, each rounded, denormals flushed (its fixed FTZ | DAZ). So a lane whose pair holds two
// consecutive steps of the contract's even chain (hi: step p, lo: step p + 1) advances that chain
// by two steps exactly as two FMAs would (contract.h, 1). Weights stay in the AMX panels (pair p =
// one even and one odd element): two panel rows p, p + 1 are regrouped into (even p + 1 | even p)
// and (odd p + 1 | odd p), in registers when one row tile reads them, else once per k slice into
// an L1 scratch that every row tile then reads (the regrouping moves bits, it computes nothing).
// x arrives regrouped the same way, in tiles of kRows rows (linear.cpp, lay_out).
//
// Blocking (none of it changes a bit: every output element still takes its blocks in ascending
// order into its own acc): k slices of kSliceBlocks blocks, outermost, so the task's x rows of a
// slice stay in L2 while its panels pass; then NR panels, whose slice stays in L1 while the row
// tiles pass; then MR x NR register tiles.
#pragma GCC target("avx512f,avx512bw,avx512bf16,f16c")
#include "contract.h"
#include "isa.h"
#include "quant_codes.h"

namespace mg {
namespace {

constexpr int MR = kBf16Rows, NR = 2;      // register tile: 4 rows x 2 panels, e and o: 16 zmm
constexpr __mmask32 kHi = 0xAAAAAAAAu;     // the high bf16 of every 32-bit lane
constexpr int64_t kWords = 2 * kPanel * 2;  // bf16 per regrouped step: the even and the odd vector
constexpr int64_t kPanelSlice = kSliceBlocks * 8 * kWords;  // one panel's regrouped slice

// acc = vdpbf16ps(acc, broadcast(one 32-bit word of x), w), the broadcast embedded in the
// instruction ({1to16}): a separate broadcast takes a vector-pipe slot on some CPUs (Zen 4).
inline __m512 dp_word(__m512 acc, const uint16_t* x, __m512bh w) {
  asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*reinterpret_cast<const int32_t*>(x)), "v"(w));
  return acc;
}

// Panel rows 2s, 2s + 1 of block b as the (even, odd) vectors of step s.
inline void regroup_step(const uint16_t* panel, int64_t b, int64_t s, __m512i& we, __m512i& wo) {
  const uint16_t* row = panel + (b * 16 + 2 * s) * 2 * kPanel;
  const __m512i r0 = _mm512_loadu_si512(row), r1 = _mm512_loadu_si512(row + 2 * kPanel);
  we = _mm512_mask_blend_epi16(kHi, r1, _mm512_slli_epi32(r0, 16));
  wo = _mm512_mask_blend_epi16(kHi, _mm512_srli_epi32(r1, 16), r0);
}

// Blocks [b0, b1) of one panel, regrouped: step (b - b0) * 8 + s at dst + that * kWords.
void regroup_slice(const uint16_t* panel, int64_t b0, int64_t b1, uint16_t* dst) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t s = 0; s < 8; ++s, dst += kWords) {
      __m512i we, wo;
      regroup_step(panel, b, s, we, wo);
      _mm512_storeu_si512(dst, we);
      _mm512_storeu_si512(dst + 2 * kPanel, wo);
    }
}

// R rows (one x tile: per block, R rows of 32 words) x P panels over blocks [b0, b1). w[j]: panel
// j at pair 0 (Scratch false) or its regrouped slice (Scratch true). A row's block holds 8 words of
// the even chain (lo = x[4j + 2], hi = x[4j]) then 8 of the odd one (lo = x[4j + 3], hi = x[4j + 1]).
template <int R, int P, bool Scratch>
void dp_tile(const uint16_t* xt, const uint16_t* const* w, float* acc, int64_t ldacc, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    __m512 e[R][P], o[R][P];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < P; ++j) e[i][j] = o[i][j] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int64_t s = 0; s < 8; ++s) {  // steps 2s and 2s + 1 of both chains
      __m512bh we[P], wo[P];
      for (int j = 0; j < P; ++j) {
        __m512i ve, vo;
        if constexpr (Scratch) {
          const uint16_t* g = w[j] + ((b - b0) * 8 + s) * kWords;
          ve = _mm512_loadu_si512(g), vo = _mm512_loadu_si512(g + 2 * kPanel);
        } else {
          regroup_step(w[j], b, s, ve, vo);
        }
        we[j] = (__m512bh)ve, wo[j] = (__m512bh)vo;
      }
      for (int i = 0; i < R; ++i) {
        const uint16_t* xr = xt + (b * R + i) * kBlock;
        for (int j = 0; j < P; ++j) {
          e[i][j] = dp_word(e[i][j], xr + 2 * s, we[j]);
          o[i][j] = dp_word(o[i][j], xr + 16 + 2 * s, wo[j]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < P; ++j) {  // acc = acc + (e + o)
        float* a = acc + i * ldacc + j * kPanel;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_add_ps(e[i][j], o[i][j])));
      }
  }
}

// The rows [i, i + left) of the task as one tile of exactly `left` (<= R) rows.
template <int R, int P, bool Scratch>
void dp_last_tile(const LinearTask& t, const uint16_t* const* w, int64_t i, int64_t c, int64_t left, int64_t b0,
                  int64_t b1) {
  if constexpr (R >= 1) {
    if (left == R) dp_tile<R, P, Scratch>(t.xb + i * t.kp, w, t.acc + i * t.ldacc + c, t.ldacc, b0, b1);
    else dp_last_tile<R - 1, P, Scratch>(t, w, i, c, left, b0, b1);
  }
}

// Panels [p, p + P) of blocks [b0, b1) for every row of the task. With more than one row tile
// the slice is regrouped once, into scratch, and every tile reads it from L1.
template <int P>
void dp_slice(const LinearTask& t, int64_t p, int64_t b0, int64_t b1, uint16_t* scratch) {
  const int64_t c = (p - t.p0) * kPanel;
  const uint16_t* w[P];
  if (t.m <= MR) {
    for (int j = 0; j < P; ++j) w[j] = t.w + (p + j) * t.kp * kPanel;
    return dp_last_tile<MR, P, false>(t, w, 0, c, t.m, b0, b1);
  }
  for (int j = 0; j < P; ++j) {
    regroup_slice(t.w + (p + j) * t.kp * kPanel, b0, b1, scratch + j * kPanelSlice);
    w[j] = scratch + j * kPanelSlice;
  }
  int64_t i = 0;
  for (; i + MR <= t.m; i += MR) dp_tile<MR, P, true>(t.xb + i * t.kp, w, t.acc + i * t.ldacc + c, t.ldacc, b0, b1);
  if (i < t.m) dp_last_tile<MR - 1, P, true>(t, w, i, c, t.m - i, b0, b1);
}

// 16 columns' scales (or offsets) for the 16 lanes of half a pair row: columns [c, c + 8), each twice.
inline __m512 dup8(const float* v, int64_t c) {
  const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_loadu_ps(v + c)));
}

// quant.cpp's dequant_panel_avx2 on 16 lanes, a group at a time (the format's branches hoisted),
// rounded by VCVTNE2PS2BF16: nearest even, the same bits as c10's rounding for every value a
// quantized weight holds (finite, never an fp32 denormal: an fp16 scale times small integers).
template <int Bits, bool Offset>
void dequant_groups(const QuantPart& q, int64_t panel, int64_t kp, uint16_t* dst) {
  constexpr int64_t kRowBytes = Bits == 8 ? 32 : 16, kRun = high_run(Bits);
  const int64_t groups = kp / q.group, rows = q.group / 2;
  const uint8_t* c = q.codes + panel * (kp / 2) * kRowBytes;
  const uint8_t* hi = Bits > 4 ? q.high + panel * (kp / 2 / kRun) * 32 : nullptr;
  const __m512i zero = _mm512_set1_epi32(q.zero);
  for (int64_t g = 0; g < groups; ++g) {
    alignas(64) float scale[16], offset[16];
    group_scales(q, panel, kp, g, scale, offset);
    const __m512 s0 = dup8(scale, 0), s1 = dup8(scale, 8);
    const __m512 o0 = Offset ? dup8(offset, 0) : s0, o1 = Offset ? dup8(offset, 8) : s1;
    for (int64_t r = 0; r < rows; ++r, c += kRowBytes, dst += 2 * kPanel) {
      __m128i b[2];
      code_bytes<Bits>(c, hi, int((Bits - 4) * (r % kRun)), b);
      if (Bits > 4 && r % kRun == kRun - 1) hi += 32;
      __m512 f0 = _mm512_mul_ps(s0, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepi8_epi32(b[0]), zero)));
      __m512 f1 = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepi8_epi32(b[1]), zero)));
      if constexpr (Offset) f0 = _mm512_add_ps(f0, o0), f1 = _mm512_add_ps(f1, o1);
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
    }
  }
}

}  // namespace

void dequant_panel_avx512bf16(const QuantPart& q, int64_t panel, int64_t kp, uint16_t* dst) {
  by_format(q, [&](auto f) { dequant_groups<decltype(f)::kBits, decltype(f)::kOffset>(q, panel, kp, dst); });
}

void linear_avx512bf16(const LinearTask& t) {
  alignas(64) static thread_local uint16_t scratch[NR * kPanelSlice];
  const int64_t blocks = t.kp / kBlock;
  for (int64_t b0 = 0; b0 < blocks; b0 += kSliceBlocks) {
    const int64_t b1 = min64(blocks, b0 + kSliceBlocks);
    int64_t p = t.p0;
    for (; p + NR <= t.p1; p += NR) dp_slice<NR>(t, p, b0, b1, scratch);
    if (p < t.p1) dp_slice<1>(t, p, b0, b1, scratch);
  }
}

}  // namespace mg
