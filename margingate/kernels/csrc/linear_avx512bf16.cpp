// The linear on AVX512-BF16 (VDPBF16PS), two steps of one chain per instruction. Its own translation
// unit, the only one compiled for AVX512-BF16 (the target pragma). The caller sets FTZ | DAZ for
// the adds that close each block.
//
// VDPBF16PS computes, per fp32 lane, acc = fma(a.lo * b.lo, fma(a.hi * b.hi, acc)): two FMAs in a
// row, each rounded, denormals flushed (its fixed FTZ | DAZ). So a lane whose pair holds two
// consecutive steps of the contract's even chain (hi: step p, lo: step p + 1) advances that chain
// by two steps exactly as two FMAs would (contract.h, 1). Weights stay in the AMX panels (pair p =
// one even and one odd element): two panel rows p, p + 1 are regrouped into (even p + 1 | even p)
// and (odd p + 1 | odd p), in registers by each row tile up to kRegisterRows rows, else once per k
// slice into an L1 scratch that every row tile then reads (the regrouping moves bits only).
// x arrives regrouped the same way, in tiles of kRows rows (linear.cpp, lay_out).
//
// Blocking (none of it changes a bit: every output element still takes its blocks in ascending
// order into its own acc): k slices of kSliceBlocks blocks, outermost, so the task's x rows of a
// slice stay in L2 while its panels pass; then NR panels, whose slice stays in L1 while the row
// tiles pass (the next panels' slice fetched meanwhile); then MR x NR register tiles. A task of one
// row tile has no slices: it reads each weight once, so its panels stream whole.
// A register tile's sums stay in registers over its blocks: acc + (e + o) per block, stored once.
#pragma GCC target("avx512f,avx512bw,avx512bf16,f16c")
#include "contract.h"
#include "isa.h"
#include "quant_codes.h"

#include <algorithm>

namespace mg {
namespace {

constexpr int MR = kBf16Rows, NR = 2;      // register tile: 4 rows x 2 panels, e and o: 16 zmm
constexpr int kWide = 4, kWideRows = 2;    // panels per tile for up to kWideRows rows
constexpr int64_t kRegisterRows = 16;      // up to here each tile regroups the weights itself (dp_slice)
constexpr __mmask32 kHi = 0xAAAAAAAAu;     // the high bf16 of every 32-bit lane
constexpr int64_t kWords = 2 * kPanel * 2;  // bf16 per regrouped step: the even and the odd vector
constexpr int64_t kPanelSlice = kSliceBlocks * 8 * kWords;  // one panel's regrouped slice

// acc = vdpbf16ps(acc, broadcast(one 32-bit word of x), w), the broadcast embedded in the
// instruction ({1to16}): a separate broadcast takes a vector-pipe slot on some CPUs (Zen 4).
inline __m512 dp_word(__m512 acc, const uint16_t* x, __m512bh w) {
  asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*reinterpret_cast<const int32_t*>(x)), "v"(w));
  return acc;
}

// Two consecutive panel rows (pair rows 2s, 2s + 1: 32 bf16 each) as the (even, odd) vectors of step s.
inline void regroup(__m512i r0, __m512i r1, __m512i& we, __m512i& wo) {
  we = _mm512_mask_blend_epi16(kHi, r1, _mm512_slli_epi32(r0, 16));
  wo = _mm512_mask_blend_epi16(kHi, _mm512_srli_epi32(r1, 16), r0);
}

// Panel rows 2s, 2s + 1 of block b as the (even, odd) vectors of step s.
inline void regroup_step(const uint16_t* panel, int64_t b, int64_t s, __m512i& we, __m512i& wo) {
  const uint16_t* row = panel + (b * 16 + 2 * s) * 2 * kPanel;
  regroup(_mm512_loadu_si512(row), _mm512_loadu_si512(row + 2 * kPanel), we, wo);
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

// The slice of the panels that come next, fetched toward L2 one line every `every` steps of the row
// tiles that read this one: a slice is a few KB at a panel's stride, too short for the hardware
// prefetchers, and fetched in one burst it overflows the queue of misses. Spread over the tiles'
// steps, M = 16 on weights streamed from memory: +15-30 % against the burst. Speed only.
struct SlicePrefetch {
  const char* next[NR] = {};  // each next panel's slice, or null
  int64_t panels = 0, lines = 0, every = 1, at = 0, tick = 0;

  // Panels [p + P, p + 2P) of the task, blocks [b0, b1), over the steps of the task's P-panel tiles.
  template <int P>
  void aim(const LinearTask& t, int64_t p, int64_t b0, int64_t b1) {
    static_assert(P <= NR);
    for (int j = 0; j < P; ++j)
      if (p + P + j < t.p1) next[j] = reinterpret_cast<const char*>(t.w + ((p + P + j) * t.kp + b0 * kBlock) * kPanel);
    panels = P, lines = (b1 - b0) * kBlock * kPanel * 2 / 64;
    const int64_t steps = (t.m + MR - 1) / MR * (b1 - b0) * 8 * P;
    every = std::max<int64_t>(1, steps / (panels * lines));
  }
  void step() {
    if (++tick < every || at >= panels * lines) return;
    tick = 0;
    if (const char* p = next[at / lines]) _mm_prefetch(p + at % lines * 64, _MM_HINT_T1);
    ++at;
  }
};

// Where dp_tile's weights come from: each hands step s of block b of its panel j as the (even, odd)
// vectors, after begin(b), and moves the prefetch on. Packed: panel j at pair 0, regrouped in
// registers. Regrouped: panel j's slice of blocks from b0, regrouped once into an L1 scratch.
template <int P>
struct Packed {
  const uint16_t* w[P];
  SlicePrefetch* prefetch;
  void begin(int64_t) {}
  void step(int j, int64_t b, int64_t s, __m512i& we, __m512i& wo) const {
    prefetch->step();
    regroup_step(w[j], b, s, we, wo);
  }
};

template <int P>
struct Regrouped {
  const uint16_t* w[P];
  int64_t b0;
  SlicePrefetch* prefetch;
  void begin(int64_t) {}
  void step(int j, int64_t b, int64_t s, __m512i& we, __m512i& wo) const {
    prefetch->step();
    const uint16_t* g = w[j] + ((b - b0) * 8 + s) * kWords;
    we = _mm512_loadu_si512(g), wo = _mm512_loadu_si512(g + 2 * kPanel);
  }
};

// R rows (one x tile: per block, R rows of 32 words) x P panels over blocks [b0, b1), the weights from
// `w` (above). A row's block holds 8 words of the even chain (lo = x[4j + 2], hi = x[4j]) then 8 of
// the odd one (lo = x[4j + 3], hi = x[4j + 1]).
template <int R, int P, class W>
void dp_tile(const uint16_t* xt, W& w, float* acc, int64_t ldacc, int64_t b0, int64_t b1) {
  __m512 a[R][P];  // the tile's acc, kept in registers over the blocks (1.06-1.12x at >= 16 rows)
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < P; ++j) a[i][j] = _mm512_loadu_ps(acc + i * ldacc + j * kPanel);
  for (int64_t b = b0; b < b1; ++b) {
    __m512 e[R][P], o[R][P];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < P; ++j) e[i][j] = o[i][j] = _mm512_setzero_ps();
    w.begin(b);
#pragma GCC unroll 8
    for (int64_t s = 0; s < 8; ++s) {  // steps 2s and 2s + 1 of both chains
      __m512bh we[P], wo[P];
      for (int j = 0; j < P; ++j) {
        __m512i ve, vo;
        w.step(j, b, s, ve, vo);
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
      for (int j = 0; j < P; ++j) a[i][j] = _mm512_add_ps(a[i][j], _mm512_add_ps(e[i][j], o[i][j]));  // acc + (e + o)
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < P; ++j) _mm512_storeu_ps(acc + i * ldacc + j * kPanel, a[i][j]);
}

// The rows [i, i + left) of the task as one tile of exactly `left` (<= R) rows.
template <int R, int P, class W>
void dp_last_tile(const LinearTask& t, W& w, int64_t i, int64_t c, int64_t left, int64_t b0, int64_t b1) {
  if constexpr (R >= 1) {
    if (left == R) dp_tile<R, P>(t.xb + i * t.kp, w, t.acc + i * t.ldacc + c, t.ldacc, b0, b1);
    else dp_last_tile<R - 1, P>(t, w, i, c, left, b0, b1);
  }
}

// Every row tile of the task over P panels (acc column c) of blocks [b0, b1), the weights from `w`.
template <int P, class W>
void all_tiles(const LinearTask& t, W& w, int64_t c, int64_t b0, int64_t b1) {
  int64_t i = 0;
  for (; i + MR <= t.m; i += MR) dp_tile<MR, P>(t.xb + i * t.kp, w, t.acc + i * t.ldacc + c, t.ldacc, b0, b1);
  if (i < t.m) dp_last_tile<MR - 1, P>(t, w, i, c, t.m - i, b0, b1);
}

// Every row tile over P panels' slices regrouped in scratch (kPanelSlice apart), read from L1.
template <int P>
void scratch_tiles(const LinearTask& t, int64_t c, int64_t b0, int64_t b1, const uint16_t* scratch,
                   SlicePrefetch& prefetch) {
  Regrouped<P> w{{}, b0, &prefetch};
  for (int j = 0; j < P; ++j) w.w[j] = scratch + j * kPanelSlice;
  all_tiles<P>(t, w, c, b0, b1);
}

// Panels [p, p + P) of blocks [b0, b1) for every row of the task, while the next panels' slice is
// fetched. Up to kRegisterRows rows every tile regroups the weights in registers (the shifts and
// blends share no port with VDPBF16PS); with more tiles the slice is regrouped once, into scratch,
// and every tile reads it from L1 (measured at 8, 16 and 32 rows: 1.14x, 1.07x, 0.96x the scratch).
// kWide panels come only with one row tile (linear_avx512bf16), so only P <= NR reaches the rest.
template <int P>
void dp_slice(const LinearTask& t, int64_t p, int64_t b0, int64_t b1, uint16_t* scratch) {
  const int64_t c = (p - t.p0) * kPanel;
  SlicePrefetch next;
  Packed<P> w{{}, &next};
  for (int j = 0; j < P; ++j) w.w[j] = t.w + (p + j) * t.kp * kPanel;
  constexpr int kMost = P > NR ? kWideRows : MR;  // no wider tile than ever runs is built
  if (t.m <= MR) return dp_last_tile<kMost, P>(t, w, 0, c, t.m, b0, b1);  // streams each panel whole
  if constexpr (P <= NR) {
    next.aim<P>(t, p, b0, b1);
    if (t.m <= kRegisterRows) return all_tiles<P>(t, w, c, b0, b1);
    for (int j = 0; j < P; ++j) regroup_slice(w.w[j], b0, b1, scratch + j * kPanelSlice);
    scratch_tiles<P>(t, c, b0, b1, scratch, next);
  }
}

// 16 columns' d * s (s null: d) in fp32, as `column_scales`, for the lanes of the two halves of a pair row:
// columns 0-7, then 8-15, each twice.
inline void column_scales_paired(const uint16_t* d, const int8_t* s, __m512 out[2]) {
  __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
  if (s) v = _mm512_mul_ps(v, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)))));
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  out[0] = _mm512_permutexvar_ps(lo, v), out[1] = _mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(8)), v);
}

// One panel of a quantized part, a block (32 k, 16 pair rows) at a time: quant.cpp's
// dequant_panel_avx2 on 16 lanes, rounded by VCVTNE2PS2BF16 (nearest even: the same bits as c10's
// rounding for every value a quantized weight holds, finite and never an fp32 denormal).
template <int Bits, bool Offset>
class QuantPanel {
 public:
  QuantPanel(const QuantPart& q, int64_t panel, int64_t kp)
      : q_(q), zero_(_mm_set1_epi8(int8_t(q.zero))), c_(q.codes + panel * (kp / 2) * kRowBytes),
        hi_(Bits > 4 ? q.high + panel * (kp / 2 / kRun) * 32 : nullptr), groups_(kBlock / q.group),
        d_shift_(__builtin_ctzll(q.block / kBlock)) {  // the divisions once per panel, not per block
    const int64_t at_d = panel * (kp / q.block) * 16, at_s = panel * (kp / q.group) * 16;
    d_[0] = q.d + at_d, s_at_[0] = q.s ? q.s + at_s : nullptr;
    d_[1] = Offset ? q.d_off + at_d : nullptr, s_at_[1] = q.s_off ? q.s_off + at_s : nullptr;
  }

  // The scales of block b: one group of 32 (pair rows 8-15 share it), or two of 16 (group_scales).
  void block(int64_t b) {
    b_ = b;
    const int64_t at_d = (b >> d_shift_) * 16;
    for (int h = 0; h < groups_; ++h) {
      const int64_t at_s = (b * groups_ + h) * 16;
      column_scales_paired(d_[0] + at_d, s_at_[0] ? s_at_[0] + at_s : nullptr, s_[h]);
      if constexpr (Offset) column_scales_paired(d_[1] + at_d, s_at_[1] ? s_at_[1] + at_s : nullptr, o_[h]);
    }
    if (groups_ == 1) {
      s_[1][0] = s_[0][0], s_[1][1] = s_[0][1];
      if constexpr (Offset) o_[1][0] = o_[0][0], o_[1][1] = o_[0][1];
    }
  }

  // Pair row r (0-15) of the block as 32 bf16, in the packed layout (column l: even, odd).
  __m512i row(int64_t r) const {
    __m128i b[2];
    codes(r, b);
    return bf16x32(b, r >= 8);
  }

  // Pair rows 2s, 2s + 1 as the (even, odd) vectors of step s (`regroup`'s layout). 4-bit codes are
  // put in that layout as bytes (lane 2c: row 2s + 1's byte c, lane 2c + 1: row 2s's), widened to
  // 32-bit lanes whose low nibble is the even code and bits 4-7 the odd one, and looked up: VPERMPS
  // reads only the low 4 bits of each index, so no masking and no regrouping pass. Other widths regroup.
  void step(int64_t s, __m512i& we, __m512i& wo) const {
    if constexpr (Bits != 4) {
      regroup(row(2 * s), row(2 * s + 1), we, wo);
    } else {
      const uint8_t* c = c_ + (b_ * 16 + 2 * s) * kRowBytes;
      const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)),
                    v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kRowBytes));
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v1, v0)), hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(v1, v0));
      const int h = s >= 4 ? 1 : 0;
      we = scaled(_mm512_permutexvar_ps(lo, table_), _mm512_permutexvar_ps(hi, table_), h);
      wo = scaled(_mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), table_),
                  _mm512_permutexvar_ps(_mm512_srli_epi32(hi, 4), table_), h);
    }
  }

 private:
  // 32 codes (two halves of 16 bytes; byte 2c, 2c + 1 of half i: column 8i + c) as bf16, with the
  // scales of group `high` (pair rows 8-15).
  __m512i bf16x32(const __m128i b[2], bool high) const {
    return scaled(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b[0])), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b[1])), high ? 1 : 0);
  }

  // Pair row r's codes minus the zero point, as signed bytes (every format's fit) in code_bytes' order.
  void codes(int64_t r, __m128i b[2]) const {
    const int64_t at = b_ * 16 + r;
    code_bytes<Bits>(c_ + at * kRowBytes, Bits > 4 ? hi_ + at / kRun * 32 : nullptr, int((Bits - 4) * (r % kRun)), b);
    if (q_.zero) b[0] = _mm_sub_epi8(b[0], zero_), b[1] = _mm_sub_epi8(b[1], zero_);  // most formats have none
  }

  // Codes q - zero as fp32 (columns 0-7, then 8-15, each twice) to bf16 with group h's scales: scale *
  // q [+ offset], rounded once to fp32 and once to bf16. The offset formats (Q4_1, Q5_1: an fp16
  // times a 5-bit code; Q4_K, Q5_K: times a 6-bit scale too) have products of at most 22 bits, exact
  // in fp32, so one FMA rounds as the multiply and add did. (No format has an offset and wider codes.)
  __m512i scaled(__m512 f0, __m512 f1, int h) const {
    if constexpr (Offset && Bits <= 5) {
      f0 = _mm512_fmadd_ps(s_[h][0], f0, o_[h][0]), f1 = _mm512_fmadd_ps(s_[h][1], f1, o_[h][1]);
    } else {
      f0 = _mm512_mul_ps(s_[h][0], f0), f1 = _mm512_mul_ps(s_[h][1], f1);
      if constexpr (Offset) f0 = _mm512_add_ps(f0, o_[h][0]), f1 = _mm512_add_ps(f1, o_[h][1]);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
  }

  static constexpr int64_t kRowBytes = Bits == 8 ? 32 : 16, kRun = high_run(Bits);
  const QuantPart& q_;
  const __m128i zero_;
  const __m512 table_ = _mm512_sub_ps(  // q - zero for every 4-bit code q
      _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_ps(float(q_.zero)));
  const uint8_t* c_;
  const uint8_t* hi_;
  const int groups_, d_shift_;  // groups per block of 32; log2 of the blocks per d
  const uint16_t* d_[2];        // this panel's d and d_off
  const int8_t* s_at_[2];       // its s and s_off, or null
  int64_t b_ = 0;
  __m512 s_[2][2], o_[2][2];
};

// dp_tile's weights from one quantized panel, dequantized in registers: no scratch, no second pass.
template <int Bits, bool Offset>
struct Dequantized {
  QuantPanel<Bits, Offset> panel;
  void begin(int64_t b) { panel.block(b); }
  void step(int, int64_t, int64_t s, __m512i& we, __m512i& wo) const { panel.step(s, we, wo); }
};

// Blocks [b0, b1) of one quantized panel, dequantized and regrouped straight into scratch (as
// regroup_slice lays a packed panel's): the packed bf16 panel is never written.
template <class Panel>
void dequant_slice(Panel& w, int64_t b0, int64_t b1, uint16_t* dst) {
  for (int64_t b = b0; b < b1; ++b) {
    w.block(b);
    for (int64_t s = 0; s < 8; ++s, dst += kWords) {
      __m512i we, wo;
      w.step(s, we, wo);
      _mm512_storeu_si512(dst, we);
      _mm512_storeu_si512(dst + 2 * kPanel, wo);
    }
  }
}

}  // namespace

void dequant_panel_avx512bf16(const QuantPart& q, int64_t panel, int64_t kp, uint16_t* dst) {
  by_format(q, [&](auto f) {
    QuantPanel<decltype(f)::kBits, decltype(f)::kOffset> w(q, panel, kp);
    for (int64_t b = 0; b < kp / kBlock; ++b) {
      w.block(b);
      for (int64_t r = 0; r < 16; ++r, dst += 2 * kPanel) _mm512_storeu_si512(dst, w.row(r));
    }
  });
}

void linear_avx512bf16_quant(const LinearTask& t, const QuantPart& q, int64_t panel) {
  alignas(64) static thread_local uint16_t scratch[NR * kPanelSlice];
  by_format(q, [&](auto f) {
    using Panel = QuantPanel<decltype(f)::kBits, decltype(f)::kOffset>;
    const int64_t blocks = t.kp / kBlock;
    if (t.m <= MR) {  // one row tile: each weight is read once, dequantized in registers
      for (int64_t p = t.p0; p < t.p1; ++p) {
        Dequantized<decltype(f)::kBits, decltype(f)::kOffset> w{Panel(q, panel + p - t.p0, t.kp)};
        dp_last_tile<MR, 1>(t, w, 0, (p - t.p0) * kPanel, t.m, 0, blocks);
      }
      return;
    }
    for (int64_t b0 = 0; b0 < blocks; b0 += kSliceBlocks) {  // as linear_avx512bf16, but dequantized into L1
      const int64_t b1 = min64(blocks, b0 + kSliceBlocks);
      for (int64_t p = t.p0; p < t.p1; p += NR) {
        const int64_t np = min64(NR, t.p1 - p);
        for (int64_t j = 0; j < np; ++j) {
          Panel w(q, panel + p - t.p0 + j, t.kp);
          dequant_slice(w, b0, b1, scratch + j * kPanelSlice);
        }
        SlicePrefetch none;  // the dequantization, not memory, bounds these
        if (np == NR) scratch_tiles<NR>(t, (p - t.p0) * kPanel, b0, b1, scratch, none);
        else scratch_tiles<1>(t, (p - t.p0) * kPanel, b0, b1, scratch, none);
      }
    }
  });
}

void linear_avx512bf16(const LinearTask& t) {
  alignas(64) static thread_local uint16_t scratch[kWide * kPanelSlice];
  // One row tile reads each weight once: no slices, so each panel streams whole, as the prefetchers like.
  const int64_t blocks = t.kp / kBlock, slice = t.m <= MR ? blocks : kSliceBlocks;
  for (int64_t b0 = 0; b0 < blocks; b0 += slice) {
    const int64_t b1 = min64(blocks, b0 + slice);
    int64_t p = t.p0;
    if (t.m <= kWideRows)  // memory-bound: four panels streaming at once keep more of memory's bandwidth busy
      for (; p + kWide <= t.p1; p += kWide) dp_slice<kWide>(t, p, b0, b1, scratch);
    for (; p + NR <= t.p1; p += NR) dp_slice<NR>(t, p, b0, b1, scratch);
    if (p < t.p1) dp_slice<1>(t, p, b0, b1, scratch);
  }
}

}  // namespace mg
