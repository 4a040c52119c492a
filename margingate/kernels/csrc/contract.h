// margingate's reduction contract: every reduction's order, stated once, and the primitives that
// implement it. A change here changes output bits: bump kernels.VERSION.
//
// A position's K/V and logits are a function of its tokens and the weights alone: never of the
// number of rows in a call, a row's place among them, the thread count, the call the row arrives
// in (prefill, chunk, decode step, verifier replay), or the CPU. Threads split output elements,
// never a reduction. The CPU's instruction set only picks how fast an order runs, never which.
//
// 1. linear (y = x W^T + b; W bf16, x bf16 or fp32), the AMX order (TDPBF16PS's, measured bit for
//    bit on an Intel Xeon). k is zero-padded to a multiple of kBlock = 32. Every output element
//    starts from acc = +0, then for each block of 32 k, ascending:
//        e = +0; for p in 0..15: e = fma(x[2p], w[2p], e)      (the block's even elements)
//        o = +0; for p in 0..15: o = fma(x[2p+1], w[2p+1], o)  (the block's odd elements)
//        acc = acc + (e + o)
//    in fp32, round to nearest even, denormal inputs and results flushed to zero (FTZ | DAZ).
//    Then + bias (fp32), then one rounding to x's dtype. A bf16 x bf16 product is exact in fp32, so
//    every step is one ordinary FMA or add: AMX tiles run it natively, AVX-512 and AVX2 FMAs run it
//    with the output columns in the vector lanes (linear_fma.h). For fp32 x the same steps (AMX has
//    no fp32 path: AVX-512 or AVX2).
//    Weights are packed once at load, in AMX's VNNI panels: panel p holds columns [16p, 16p + 16);
//    its pair q is 32 bf16, (W[16p + l][2q], W[16p + l][2q + 1]) for l = 0..15 (packing.py).
//    Dequantization is part of the weight, not of the reduction: a quantized weight (quant.cpp) is
//    its bf16 values, each bf16(scale * (q - zero) [+ offset]) in fp32 then rounded once, exactly as
//    the bf16 loader stores them; the linear reduces those bf16 values in this order. So a GGUF kept
//    quantized gives its dequantized model's bits. x is never quantized.
// 2. other dot products (q.k, RMSNorm's sum of squares): 8 fp32 lanes, lane l accumulates the
//    products of k = l mod 8 in ascending k (one FMA chain), then `hsum` adds the lanes in a fixed tree.
// 3. attention: keys in chunks of kChunk positions counted from the row's first key (position 0,
//    or the start of its sliding window; `fast`'s batched rows: aligned to the padded batch, on
//    purpose); online softmax, chunks merged in ascending order; exp is `exp8` below. Attention sinks
//    (gpt-oss: a logit s per query head in the denominator, no value) join after the last chunk, as one
//    more chunk of one key with a zero value: m' = max(m, s), a = exp(m - m'), den = den * a + exp(s - m'),
//    out = (acc * a) / den, each step fp32, rounded once.
// 4. elementwise ops (RoPE, residual adds, activations): fp32, rounded as PyTorch's bf16 ops round.
// 5. linear on a quantized weight under the integer-exact contract (`--weights auto`; 1 is `exact`):
//    a. x's row is quantized by the row alone, per block of the part's `block` k (32, or 256 for the
//       K-quants and IQ4_XS): each value v (bf16 or fp32) with |v| < FLT_MIN counts as 0; amax = max |v|; a block
//       holding an infinity or a NaN gets q = 0 and scale NaN (its outputs are NaN); amax = 0 gives
//       q = 0, scale 0; else r = 127 / amax (an IEEE division, no reciprocal estimate), q = clamp(
//       rne(v * r), -127, 127) (v * r rounded to fp32 first; rne set in the instruction, not by MXCSR),
//       scale = amax / 127 (below FLT_MIN: 0). sum16: each 16 q's sum.
//    b. integer sums are exact: per group g of the part (16 or 32 k) isum_g = sum (code - zero) * q,
//       a code being its value (2 to 8 bits) or the entry of the part's table it indexes (IQ4_NL,
//       IQ4_XS: kvalues_iq4nl; the IQ1/IQ2/IQ3 grids, re-coded at load as 3- or 4-bit codes into their own
//       signed tables: quant_codes.h), then per block S = sum_g s_g * isum_g and M = sum_g s_off_g * xsum_g (s absent: 1; xsum_g the
//       group's q sum), in int32; their order is free. No intermediate saturates (int8_layout.h bounds).
//    c. one float epilogue per (row, column), blocks ascending, no FMA, each step rounded (fp32, RNE,
//       FTZ | DAZ): acc = +0; per block: acc = acc + float(S) * (scale * d); where the format has an
//       offset, then acc = acc + float(M) * (scale * d_off). Then + bias, then one rounding, as in 1.
//       d is the block's fp16 widened to fp32, times the part's table's power of two (2^-3 for the IQ2
//       and IQ1 tables, 2^-2 for IQ3_XXS's, else 1): exact, as fp16's range times 2^-3 is normal in fp32.
//    Vectorized across columns and rows only, never across k; threads split columns and rows. So a
//    row's outputs are the same bits at any batch size, thread count and ISA, the scalar reference's.
// 6. the KV cache (paged_kv.cpp): K/V live in blocks of positions; a row reads its keys through its
//    request's block table in logical position order, so where its blocks lie, who shares them and what
//    else is in the pool change no bit (3's chunks are counted in positions, not blocks). A quantized
//    cache (int8, int4) stores each (position, KV head)'s D values by themselves (paged_kv.cpp):
//    a. widened to fp32, then rotated (`hadamard` below): Walsh-Hadamard butterflies over each block of
//       R = the largest power of two dividing D (D = 64: one block of 64), unnormalized (H H = R I).
//    b. per group of G = gcd(D, 32) consecutive values, each group by itself:
//       int8: amax = max |v|, scale = amax / 127, code = clamp(rne(v / scale), -127, 127);
//       int4: m = the value of largest |v| (the first among equals), scale = m / -8, code = clamp(
//       rne(v / scale), -8, 7), stored as code + 8 in a nibble: byte j of a group holds its values j (low)
//       and j + G / 2 (high).
//       IEEE divisions; amax = 0: scale 0, codes 0; a NaN or an infinity in the group: scale NaN, codes 0.
//    c. read back as code * scale (one fp32 rounding): the rotated values, gathered as above, then as 3
//       with the query rotated the same way: each query head widened to fp32, `hadamard`, times 1 / R
//       (a power of two: exact); the scores and the online softmax as 2 and 3 against the rotated keys;
//       each head's output acc / den, then `hadamard`, times 1 / R, then one rounding to q's dtype.
//       (Hq / R) . (Hk) = q . k and H (sum p_j H v_j) / R = sum p_j v_j, so only rounding separates this
//       from attention in the plain basis; the bits are this order's.
//    Every step is elementwise or in a fixed order per (position, head): the same bits at any batch,
//    thread count and ISA. bf16 and fp32 caches store the values as they are, unrotated.
//
// Everything below has internal linkage: the ISA translation units (linear_avx512.cpp,
// linear_amx.cpp) include this header under their own target pragma, and no copy compiled for one
// instruction set may be picked by the linker for another.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mg {
namespace {

constexpr int64_t kChunk = 32;  // attention key chunk (positions)
constexpr int64_t kBlock = 32;  // linear: k per block (16 pairs, one AMX tile row of bf16)
constexpr int64_t kPanel = 16;  // linear: output columns per packed weight panel
constexpr int64_t kSliceBlocks = 8;  // linear: k blocks per cache slice (speed only: no bit depends on it)

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Blocks [b0, b1) of one packed panel (a 64-byte pair row per k pair) fetched toward L2: speed only.
inline void prefetch_slice(const uint16_t* panel, int64_t b0, int64_t b1) {
  const char* row = reinterpret_cast<const char*>(panel + b0 * kBlock * kPanel);
  for (int64_t r = 0; r < (b1 - b0) * (kBlock / 2); ++r, row += 64) _mm_prefetch(row, _MM_HINT_T1);
}

struct FlushDenormals {  // FTZ | DAZ for this thread while in scope
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

inline float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline __m256 bf16x8(const uint16_t* p) {  // 8 bf16 -> 8 fp32, exact
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// fp32 -> bf16, round to nearest even, NaN -> 0x7fc0: the same bits as c10::BFloat16(float).
inline __m128i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Round to bf16 and back: what a bf16 intermediate holds.
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
}

inline float hsum(__m256 v) {  // fixed tree: (lo + hi), then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of 8 vectors at once, with hsum's pairings exactly (each addition pairs the same two
// values): lane j of the result is hsum(f[j]). Used where many sums end together.
inline __m256 hsum_x8(const __m256* f) {
  __m256 p[4];
  for (int j = 0; j < 4; ++j)  // lo128 + hi128 of f[j] and f[j + 4]
    p[j] = _mm256_add_ps(_mm256_permute2f128_ps(f[j], f[j + 4], 0x20), _mm256_permute2f128_ps(f[j], f[j + 4], 0x31));
  __m256 t[2];
  for (int j = 0; j < 2; ++j)  // lanes (0 + 2), (1 + 3)
    t[j] = _mm256_add_ps(_mm256_shuffle_ps(p[2 * j], p[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(p[2 * j], p[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),  // lane 0 + lane 1
                       _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));  // f[0..3] low, f[4..7] high
}

// exp on 8 lanes: Cody-Waite reduction and a degree-6 polynomial; our own code, so its bits do
// not depend on a math library. Inputs are clamped to [-87, 88]; below -87 -> 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float exp1(float x) {  // the same arithmetic for one value
  float buf[8];
  _mm256_storeu_ps(buf, exp8(_mm256_set1_ps(x)));
  return buf[0];
}

// 6a's rotation block: the largest power of two dividing d.
inline int64_t hadamard_block(int64_t d) { return d & -d; }

// 6a's rotation of d fp32 values in place: for len = 1, 2, ..., R / 2, each pair (j, j + len) with
// j mod 2 len < len, ascending j: (a, b) -> (a + b, a - b), each one fp32 rounding. Elementwise within
// a stage, so vector lanes change no bit; the scalar loop is the order.
inline void hadamard(float* x, int64_t d) {
  const int64_t r = hadamard_block(d);
  for (int64_t len = 1; len < r; len <<= 1)
    for (int64_t i = 0; i < d; i += 2 * len)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
}

}  // namespace
}  // namespace mg
