// The integer-exact linear (contract.h, 5) on AVX-512 VNNI: a quad of a panel (4 k of 16 columns, 64
// codes) is one zmm whose 32-bit lane l is column l's 4 codes, so one VPDPBUSD per row and quad adds the
// column's 4 products into its int32 lane. Its own translation unit, the only one compiled for AVX-512
// VNNI (the target pragma); it runs only where the CPU has it and its load-time proof passed.
//
// Bounds: VPDPBUSD multiplies u8 by s8 and adds the four products to the int32 lane without saturating
// (never VPDPBUSDS). Codes of 2 to 6 bits are the u8 operand, q in [-127, 127] the s8 one; 8-bit codes
// (signed, maybe -128) go in as |code| (<= 128, a valid u8) against q carrying the code's sign (|q| <= 127);
// a table's values (|value| <= 127; VPSHUFB looks the 4-bit codes up) go in plus 128 (1 to 255, u8), and
// the fold takes 128 x the group's q sum (at most 32 x 127) off with the zero point: exact, as the
// contract's sum of value x q. A group of at most 32 k sums at most 32 x 255 x 127 in magnitude, far below
// 2^31; block sums as in int8_layout.h. The fold into block sums and the float epilogue (int8_layout512.h) are the AVX2 path's,
// on 16 lanes.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include "int8_layout512.h"
#include "quant_codes.h"

namespace mg {
namespace {

constexpr int kRows = 8;  // rows per tile: 8 group sums, 8 block sums (and 8 offset sums) in zmm registers
constexpr int64_t kAhead = 4096;  // bytes of codes fetched ahead (speed only): one core's stream then nears the bus's

// The codes (and bits above) of the group kAhead bytes of codes ahead of `qd`, toward L1: a thread's panels lie
// one after another, so past a panel's end this fetches its next one. At B = 1 the hardware prefetchers alone
// leave a core's stream well below what the bus gives it (a decode step is this stream).
template <int Bits, int Group>
inline void prefetch_group(const uint8_t* codes, const uint8_t* high, int64_t qd) {
  const char* c = reinterpret_cast<const char*>(codes + qd * kQuadBytes<Bits>) + kAhead;
  for (int64_t o = 0; o < Group / 4 * kQuadBytes<Bits>; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
  if constexpr (kHighBytes<Bits> > 0) {
    const char* h = reinterpret_cast<const char*>(high + qd * kHighBytes<Bits>) + kAhead * kHighBytes<Bits> / kQuadBytes<Bits>;
    for (int64_t o = 0; o < Group / 4 * kHighBytes<Bits>; o += 64) _mm_prefetch(h + o, _MM_HINT_T0);
  }
}

// The int32 sums of one group (Group k) for R rows from r0: one VPDPBUSD per row and quad.
template <class F, int Group, int R>
inline void group_sums(const Int8Rows& x, int64_t r0, const uint8_t* codes, const uint8_t* high, const __m512i& table,
                       int64_t qd0, __m512i (&a)[R]) {
  constexpr int Bits = F::kBits;
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_si512();
  for (int64_t qd = qd0; qd < qd0 + Group / 4; ++qd) {
    __m512i w = quad_codes512<Bits>(codes + qd * kQuadBytes<Bits>, high ? high + qd * kHighBytes<Bits> : nullptr);
    if constexpr (F::kTable) w = _mm512_shuffle_epi8(table, w);  // value + 128, unsigned
    const __m512i u = Bits == 8 ? _mm512_abs_epi8(w) : w;
    const __mmask64 neg = Bits == 8 ? _mm512_movepi8_mask(w) : 0;
    for (int r = 0; r < R; ++r) {
      __m512i xb = _mm512_set1_epi32(load4(x.q + (r0 + r) * x.kp + 4 * qd));
      if constexpr (Bits == 8) xb = _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb);
      a[r] = _mm512_dpbusd_epi32(a[r], u, xb);
    }
  }
}

// R rows from r0 against one panel, every block: fold each group into S (and M), then the block's epilogue.
template <class F, int Group, int R>
void tile(const Int8Rows& x, int64_t r0, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  constexpr int Bits = F::kBits;
  constexpr bool Offset = F::kOffset;
  const __m512i table = table512_u8(q);
  const int zero = F::kTable ? q.zero + 128 : q.zero;  // the table's values went in plus 128
  const int64_t kp = x.kp, groups = q.block / Group, blocks = kp / q.block;
  const uint8_t* codes = q.codes + panel * (kp / 4) * kQuadBytes<Bits>;
  const uint8_t* high = kHighBytes<Bits> ? q.high + panel * (kp / 4) * kHighBytes<Bits> : nullptr;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i S[R], M[R];
    for (int r = 0; r < R; ++r) S[r] = M[r] = _mm512_setzero_si512();
    for (int64_t g = b * groups; g < (b + 1) * groups; ++g) {
      __m512i a[R];
      prefetch_group<Bits, Group>(codes, high, g * (Group / 4));
      group_sums<F, Group, R>(x, r0, codes, high, table, g * (Group / 4), a);
      const GroupScales gs = group_scales512<Offset>(q, (panel * (kp / Group) + g) * 16);
      for (int r = 0; r < R; ++r) {
        const int32_t* s16 = x.sum16 + (r0 + r) * (kp / 16) + g * Group / 16;
        fold_row<Offset>(gs, a[r], Group == 32 ? s16[0] + s16[1] : s16[0], zero, S[r], M[r]);
      }
    }
    const BlockScales bs = block_scales512<Offset>(q, (panel * blocks + b) * 16);
    for (int r = 0; r < R; ++r)
      epilogue_row<Offset>(bs, x.scale[(r0 + r) * blocks + b], S[r], M[r], acc + (r0 + r) * ldacc);
  }
}

}  // namespace

void linear_int8_vnni(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  by_layout(q, [&](auto f, auto group) {
    row_tiles<kRows>(x.m, [&](auto n, int64_t r0) {
      tile<decltype(f), decltype(group)::value, decltype(n)::value>(x, r0, q, panel, acc, ldacc);
    });
  });
}

}  // namespace mg
