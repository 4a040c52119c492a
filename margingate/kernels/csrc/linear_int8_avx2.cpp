// The integer-exact linear (contract.h, 5) on AVX2: 16 columns of a panel in two vectors of 8 lanes,
// each 32-bit lane a column's 4 k against the row's 4 q broadcast; VPMADDUBSW gives int16 pair sums,
// a run of quads adds them in int16 within int8_layout.h's bounds, and VPMADDWD by 1 widens them: exact.
// Group sums scale into block sums in int32, and the float epilogue runs per block across the columns'
// lanes, never across k.
#include "int8_layout.h"
#include "quant_codes.h"

namespace mg {
namespace {

constexpr int kRows = 4;  // rows per tile: 8 int32 accumulators, the codes, a broadcast and constants

// A column's 4 codes times the row's 4 q, in two int16 pair sums (exact: int8_layout.h's bounds).
// Signed codes (8 bits, a table's): |code| against q with the code's sign.
template <class F>
inline __m256i dot4_16(__m256i w, __m256i w_abs, __m256i xb) {
  if constexpr (F::kSigned) return _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xb, w));
  else return _mm256_maddubs_epi16(w, xb);
}

// Quads whose int16 pair sums may be added before widening: a pair is at most 2 x 15 x 127 = 3810 (2 to 4
// bits), 7874 (5), 16002 (6), 32512 (signed), so 8, 4, 2 and 1 of them stay below 32767. Exact, like VPMADDWD.
template <class F>
constexpr int kRun = F::kSigned ? 1 : F::kBits <= 4 ? 8 : F::kBits == 5 ? 4 : 2;

inline __m256i int8x8(const int8_t* p) {  // 8 int8 -> 8 int32
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// The group's int32 sums `a` of R rows folded into the block sums: S += s * (a - zero * xsum), M += s_off * xsum.
template <bool Offset, int R>
inline void fold_group(const QuantPart& q, int64_t at_s, const int32_t* xsum, const __m256i (&a)[R][2],
                       __m256i (&S)[R][2], __m256i (&M)[R][2]) {
  for (int h = 0; h < 2; ++h) {
    const __m256i s = q.s ? int8x8(q.s + at_s + 8 * h) : _mm256_set1_epi32(1);
    const __m256i so = Offset && q.s_off ? int8x8(q.s_off + at_s + 8 * h) : _mm256_set1_epi32(1);
    for (int r = 0; r < R; ++r) {
      const __m256i xs = _mm256_set1_epi32(xsum[r]);
      const __m256i t = _mm256_sub_epi32(a[r][h], _mm256_set1_epi32(xsum[r] * q.zero));
      S[r][h] = _mm256_add_epi32(S[r][h], _mm256_mullo_epi32(t, s));
      if constexpr (Offset) M[r][h] = _mm256_add_epi32(M[r][h], _mm256_mullo_epi32(xs, so));
    }
  }
}

// acc = acc + float(S) * (scale * d) [then + float(M) * (scale * d_off)] for R rows, 16 columns.
template <bool Offset, int R>
inline void epilogue_block(const QuantPart& q, int64_t at_d, const float* scale, const __m256i (&S)[R][2],
                           const __m256i (&M)[R][2], float* acc, int64_t ldacc) {
  for (int h = 0; h < 2; ++h) {
    const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.d + at_d + 8 * h))),
                                   _mm256_set1_ps(q.unit));  // the table's power of two: exact
    __m256 doff = d;
    if constexpr (Offset) doff = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.d_off + at_d + 8 * h)));
    for (int r = 0; r < R; ++r) {
      float* a = acc + r * ldacc + 8 * h;
      const __m256 sc = _mm256_set1_ps(scale[r]);
      __m256 v = _mm256_add_ps(_mm256_loadu_ps(a), _mm256_mul_ps(_mm256_cvtepi32_ps(S[r][h]), _mm256_mul_ps(sc, d)));
      if constexpr (Offset)
        v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(M[r][h]), _mm256_mul_ps(sc, doff)));
      _mm256_storeu_ps(a, v);
    }
  }
}

// The int32 sums of one group (Group k) for R rows from row r0: runs of kRun quads summed in int16,
// then widened (VPMADDWD by 1) into a.
template <class F, int Group, int R>
inline void group_sums(const Int8Rows& x, int64_t r0, const uint8_t* codes, const uint8_t* high, const __m256i& table,
                       int64_t qd0, __m256i (&a)[R][2]) {
  constexpr int Bits = F::kBits, kQuads = Group / 4, kStep = kRun<F> < kQuads ? kRun<F> : kQuads;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
  for (int run = 0; run < kQuads; run += kStep) {
    __m256i a16[R][2];
    for (int r = 0; r < R; ++r) a16[r][0] = a16[r][1] = _mm256_setzero_si256();
    for (int64_t qd = qd0 + run; qd < qd0 + run + kStep; ++qd) {
      __m256i lo, hi;
      quad_codes<Bits>(codes + qd * kQuadBytes<Bits>, high ? high + qd * kHighBytes<Bits> : nullptr, lo, hi);
      if constexpr (F::kTable) lo = _mm256_shuffle_epi8(table, lo), hi = _mm256_shuffle_epi8(table, hi);
      const __m256i lo_abs = F::kSigned ? _mm256_abs_epi8(lo) : lo, hi_abs = F::kSigned ? _mm256_abs_epi8(hi) : hi;
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(load4(x.q + (r0 + r) * x.kp + 4 * qd));
        a16[r][0] = _mm256_add_epi16(a16[r][0], dot4_16<F>(lo, lo_abs, xb));
        a16[r][1] = _mm256_add_epi16(a16[r][1], dot4_16<F>(hi, hi_abs, xb));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(a16[r][h], ones));
  }
}

// The part's table in both 128-bit lanes, for VPSHUFB (none: zeros, unused).
inline __m256i table256(const QuantPart& q) {
  return q.table ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.table)))
                 : _mm256_setzero_si256();
}

// R rows from row r0 of x against one panel, every block.
template <class F, int Group, int R>
void tile(const Int8Rows& x, int64_t r0, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  constexpr int Bits = F::kBits;
  constexpr bool Offset = F::kOffset;
  const int64_t kp = x.kp, groups = q.block / Group, blocks = kp / q.block;
  const uint8_t* codes = q.codes + panel * (kp / 4) * kQuadBytes<Bits>;
  const uint8_t* high = kHighBytes<Bits> ? q.high + panel * (kp / 4) * kHighBytes<Bits> : nullptr;
  const __m256i table = table256(q);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i S[R][2], M[R][2];
    for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = M[r][0] = M[r][1] = _mm256_setzero_si256();
    for (int64_t g = b * groups; g < (b + 1) * groups; ++g) {
      __m256i a[R][2];
      group_sums<F, Group, R>(x, r0, codes, high, table, g * (Group / 4), a);
      int32_t xsum[R];
      for (int r = 0; r < R; ++r) {
        const int32_t* s16 = x.sum16 + (r0 + r) * (kp / 16) + g * Group / 16;
        xsum[r] = Group == 32 ? s16[0] + s16[1] : s16[0];
      }
      fold_group<Offset, R>(q, (panel * (kp / Group) + g) * 16, xsum, a, S, M);
    }
    float scale[R];
    for (int r = 0; r < R; ++r) scale[r] = x.scale[(r0 + r) * blocks + b];
    epilogue_block<Offset, R>(q, (panel * blocks + b) * 16, scale, S, M, acc + r0 * ldacc, ldacc);
  }
}

}  // namespace

void linear_int8_avx2(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  by_layout(q, [&](auto f, auto group) {
    row_tiles<kRows>(x.m, [&](auto n, int64_t r0) {
      tile<decltype(f), decltype(group)::value, decltype(n)::value>(x, r0, q, panel, acc, ldacc);
    });
  });
}

}  // namespace mg
