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
constexpr int64_t kAhead = 16384;  // bytes of codes fetched ahead into L2 (speed only)

// The codes (and bits above) of the group kAhead bytes of codes ahead of `qd`, toward L2: a thread's panels lie
// one after another, so past a panel's end this fetches its next one. At B = 1 a decode step is this stream, and
// the hardware prefetchers alone leave a core's share well below the bus's. Into L2, 16 KiB ahead, rather than
// into L1 4 KiB ahead: L1 holds few misses in flight, and the farther fetch covers the memory's latency at the
// bus's rate (results/roofline: the 1B Q4_K_M's B = 1 step and the Q8_0's).
template <int Bits, int Group>
inline void prefetch_group(const uint8_t* codes, const uint8_t* high, int64_t qd) {
  const char* c = reinterpret_cast<const char*>(codes + qd * kQuadBytes<Bits>) + kAhead;
  for (int64_t o = 0; o < Group / 4 * kQuadBytes<Bits>; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
  if constexpr (kHighBytes<Bits> > 0) {
    const char* h = reinterpret_cast<const char*>(high + qd * kHighBytes<Bits>) + kAhead * kHighBytes<Bits> / kQuadBytes<Bits>;
    for (int64_t o = 0; o < Group / 4 * kHighBytes<Bits>; o += 64) _mm_prefetch(h + o, _MM_HINT_T1);
  }
}

// The int32 sums of one group (Group k) for R rows from r0: one VPDPBUSD per row and quad. The quads count to a
// constant so that the compiler unrolls them and keeps a[] in registers (a bound of qd0 + Group / 4 made it spill
// them, and tiles of 4 to 6 rows ran at half speed).
template <class F, int Group, int R>
inline void group_sums(const Int8Rows& x, int64_t r0, const uint8_t* codes, const uint8_t* high, const __m512i& table,
                       int64_t qd0, __m512i (&a)[R]) {
  constexpr int Bits = F::kBits;
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_si512();
  for (int i = 0; i < Group / 4; ++i) {
    const int64_t qd = qd0 + i;
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

// Two groups' int8 scales of 16 columns as int16 pairs, lane l = (lo[l], hi[l]) (a null lo or hi: 1; hi_zero:
// no second group, 0), for VPDPWSSD.
inline __m512i scale_pairs(const int8_t* lo, const int8_t* hi, bool hi_zero) {
  const __m512i a = widen_s(lo), b = hi_zero ? _mm512_setzero_si512() : widen_s(hi);
  return _mm512_mask_blend_epi16(0xAAAAAAAA, a, _mm512_slli_epi32(b, 16));
}

// A row's q sums of groups g and g + 1 as one int16 pair (each |sum| <= 32 x 127), broadcast.
template <int Group>
inline __m512i xsum_pair(const int32_t* s16, bool second) {
  const int32_t lo = Group == 32 ? s16[0] + s16[1] : s16[0];
  const int32_t hi = !second ? 0 : Group == 32 ? s16[2] + s16[3] : s16[1];
  return _mm512_set1_epi32(int32_t(uint32_t(lo) & 0xffff) | int32_t(uint32_t(hi) << 16));
}

// R rows from r0 against one panel, every block: the block sums S = sum_g s_g (isum_g - zero xsum_g) and M =
// sum_g s_off_g xsum_g (contract.h, 5b), then the block's epilogue. Integer identities, so the same S and M: S
// gathers s_g a_g (a the VPDPBUSD sums; no multiply where the part has no s), and the xsum terms, zero x sum_g s_g
// xsum_g or M, come two groups at a time from one VPDPWSSD per row (int16 pairs: exact, no saturation). The
// largest true S fits int32 (int8_layout.h), and int32 adds and multiplies wrap exactly, so no order of these
// steps changes S.
template <class F, int Group, int R>
void tile(const Int8Rows& x, int64_t r0, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  constexpr int Bits = F::kBits;
  constexpr bool Offset = F::kOffset;
  const __m512i table = table512_u8(q);
  const int zero = F::kTable ? q.zero + 128 : q.zero;  // the table's values went in plus 128
  const int64_t kp = x.kp, groups = q.block / Group, blocks = kp / q.block, step = groups > 1 ? 2 : 1;
  const uint8_t* codes = q.codes + panel * (kp / 4) * kQuadBytes<Bits>;
  const uint8_t* high = kHighBytes<Bits> ? q.high + panel * (kp / 4) * kHighBytes<Bits> : nullptr;
  const int8_t* xs_scales = Offset ? q.s_off : q.s;  // the scales of the xsum term
  const bool xs_term = Offset || zero != 0;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i S[R], M[R];  // M: sum_g s_off_g xsum_g (Offset), else sum_g s_g xsum_g (zero != 0)
    for (int r = 0; r < R; ++r) S[r] = M[r] = _mm512_setzero_si512();
    for (int64_t g = b * groups; g < (b + 1) * groups; g += step) {
      for (int64_t h = g; h < g + step; ++h) {
        __m512i a[R];
        prefetch_group<Bits, Group>(codes, high, h * (Group / 4));
        group_sums<F, Group, R>(x, r0, codes, high, table, h * (Group / 4), a);
        const int64_t at_s = (panel * (kp / Group) + h) * 16;
        if (Offset && zero != 0) {  // no GGUF type has both; the terms as the contract states them
          const __m512i sub = widen_s(q.s ? q.s + at_s : nullptr);
          for (int r = 0; r < R; ++r) {
            const int32_t* s16 = x.sum16 + (r0 + r) * (kp / 16) + h * Group / 16;
            const int32_t xsum = Group == 32 ? s16[0] + s16[1] : s16[0];
            a[r] = _mm512_mullo_epi32(_mm512_sub_epi32(a[r], _mm512_set1_epi32(xsum * zero)), sub);
            S[r] = _mm512_add_epi32(S[r], a[r]);
          }
          continue;
        }
        if (q.s) {
          const __m512i sg = widen_s(q.s + at_s);
          for (int r = 0; r < R; ++r) S[r] = _mm512_add_epi32(S[r], _mm512_mullo_epi32(a[r], sg));
        } else {
          for (int r = 0; r < R; ++r) S[r] = _mm512_add_epi32(S[r], a[r]);
        }
      }
      if (!xs_term) continue;
      const int64_t at_s = (panel * (kp / Group) + g) * 16;
      const __m512i pairs = scale_pairs(xs_scales ? xs_scales + at_s : nullptr,
                                        xs_scales ? xs_scales + at_s + 16 : nullptr, step == 1);
      for (int r = 0; r < R; ++r)
        M[r] = _mm512_dpwssd_epi32(M[r], pairs, xsum_pair<Group>(x.sum16 + (r0 + r) * (kp / 16) + g * Group / 16, step == 2));
    }
    if (!Offset && zero != 0)
      for (int r = 0; r < R; ++r) S[r] = _mm512_sub_epi32(S[r], _mm512_mullo_epi32(M[r], _mm512_set1_epi32(zero)));
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
