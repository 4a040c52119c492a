// One chunk of keys for one query row's g heads (contract.h, 3): the scores, the online softmax's step and the
// weighted values, in the contract's order. Every (row, head, key) dot product is one FMA chain over d ascending
// closed by hsum's tree, every output accumulator takes its FMAs over the keys ascending, every denominator its
// adds over the keys ascending: the layout only chooses which of these independent chains run side by side. The
// scores are laid heads in the lanes (each key loaded once for 8 heads; the softmax's per-head steps 8 heads to
// a vector).
// Internal linkage (as contract.h): included by attention.cpp under the baseline target.
#pragma once

#include <algorithm>

#include "contract.h"

namespace mg {
namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head (checked in `attention`)

// The running state of one query row's g heads (online softmax): q widened to fp32, the output accumulators
// (head h at h * d of each), the running max and denominator (kMaxGroup lanes each: the heads' vectors read
// and write 8 at a time). Views into a group's buffer (attend_group), 64-byte aligned.
struct RowState {
  float *qf, *acc, *mx, *den;
};

// A row's scores, then its weights, for one chunk: s[j][h] for key j and head h (heads in the lanes, so the
// softmax's per-head steps run 8 heads to a vector).
using ChunkScores = float[kChunk][kMaxGroup];

// Scores of keys [0, cn) against NH (<= 8) query heads (qf: head u at qf + u d): s[j][u] = (q_u . k_j) * scale.
// Each dot product is one FMA chain over d ascending from +0, closed by hsum's tree (hsum_x8 runs it for the 8
// heads' chains of a key at once); each key's 8 lanes of values feed NH chains from one load.
template <int NH>
void scores_of(const float* qf, const float* kc, int64_t cn, int64_t d, __m256 scale, float (*s)[kMaxGroup]) {
  for (int64_t j = 0; j < cn; ++j) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    const float* k = kc + j * d;
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 x = _mm256_loadu_ps(k + i);
      for (int u = 0; u < NH; ++u) a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + u * d + i), x, a[u]);
    }
    _mm256_store_ps(s[j], _mm256_mul_ps(hsum_x8(a), scale));
  }
}

void chunk_scores(const float* qf, const float* kc, int64_t cn, int64_t g, int64_t d, float scale, ChunkScores& s) {
  using Heads = void (*)(const float*, const float*, int64_t, int64_t, __m256, float (*)[kMaxGroup]);
  static constexpr Heads kHeads[9] = {nullptr, scores_of<1>, scores_of<2>, scores_of<3>, scores_of<4>,
                                      scores_of<5>, scores_of<6>, scores_of<7>, scores_of<8>};
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t h0 = 0; h0 < g; h0 += 8)
    kHeads[std::min<int64_t>(8, g - h0)](qf + h0 * d, kc, cn, d, sc, reinterpret_cast<float (*)[kMaxGroup]>(&s[0][h0]));
}

// acc[0, 8 NB) = acc * alpha + sum over keys j ascending of p[j][0] * v_j[0, 8 NB): NB chains in registers (a
// compile-time count, so they stay there). One head at a time: wider tiles (several heads sharing each value
// load) measured slower on AVX2's 16 registers and no faster with AVX-512VL's 32 (Zen 4).
template <int NB>
void weigh_blocks(float* acc, const float (*p)[kMaxGroup], const float* vc, int64_t cn, int64_t d, __m256 alpha) {
  __m256 o[NB];
  for (int b = 0; b < NB; ++b) o[b] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * b), alpha);
  for (int64_t j = 0; j < cn; ++j) {
    const __m256 pj = _mm256_broadcast_ss(&p[j][0]);
    for (int b = 0; b < NB; ++b) o[b] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vc + j * d + 8 * b), o[b]);
  }
  for (int b = 0; b < NB; ++b) _mm256_storeu_ps(acc + 8 * b, o[b]);
}

// acc (g heads of d values) = acc * alpha + sum over keys j ascending of p[j][h] * v_j, per head h, 64 values at a
// time.
void weigh_values(float* acc, const ChunkScores& p, const float* vc, int64_t cn, int64_t g, int64_t d, const float* alpha) {
  using Blocks = void (*)(float*, const float (*)[kMaxGroup], const float*, int64_t, int64_t, __m256);
  static constexpr Blocks kTail[8] = {nullptr, weigh_blocks<1>, weigh_blocks<2>, weigh_blocks<3>,
                                      weigh_blocks<4>, weigh_blocks<5>, weigh_blocks<6>, weigh_blocks<7>};
  for (int64_t h = 0; h < g; ++h) {
    const auto* ph = reinterpret_cast<const float (*)[kMaxGroup]>(&p[0][h]);
    const __m256 a = _mm256_set1_ps(alpha[h]);
    int64_t i0 = 0;
    for (; i0 + 64 <= d; i0 += 64) weigh_blocks<8>(acc + h * d + i0, ph, vc + i0, cn, d, a);
    if (i0 < d) kTail[(d - i0) / 8](acc + h * d + i0, ph, vc + i0, cn, d, a);
  }
}

// One chunk of cn keys (fp32, widened from the cache once per group, 64-byte aligned) for one row's g heads:
// the scores; per head, the chunk's max (NaN ignored, as the scalar max: a NaN score never wins; max is exact, so
// the order of its comparisons changes no value, at most a zero's sign, and exp of either zero is 1), the new
// running max, alpha = exp(old max - new max) (0 while the old max is -inf) and exp8 of the shifted scores (masked
// keys: exp(-inf) -> 0); the denominators (each head's sum over the keys ascending from +0, then den * alpha +
// sum); then the output rescaled by alpha and accumulated over the keys ascending.
void row_chunk(RowState& r, const float* kc, const float* vc, int64_t cn, int64_t g, int64_t d, float scale) {
  alignas(64) ChunkScores s;
  alignas(64) float alpha[kMaxGroup];
  chunk_scores(r.qf, kc, cn, g, d, scale, s);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t j = cn; j < kChunk; ++j) _mm256_store_ps(s[j], ninf), _mm256_store_ps(s[j] + 8, ninf);
  for (int64_t h0 = 0; h0 < g; h0 += 8) {
    __m256 m = ninf;
    for (int64_t j = 0; j < kChunk; ++j) m = _mm256_max_ps(_mm256_load_ps(s[j] + h0), m);  // NaN in s: keeps m
    const __m256 mx = _mm256_loadu_ps(r.mx + h0), m_new = _mm256_max_ps(m, mx);
    const __m256 a = _mm256_andnot_ps(_mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(mx, m_new)));
    _mm256_store_ps(alpha + h0, a);
    _mm256_storeu_ps(r.mx + h0, m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < kChunk; ++j) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(s[j] + h0), m_new));
      _mm256_store_ps(s[j] + h0, e);
      if (j < cn) sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(r.den + h0, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(r.den + h0), a), sum));
  }
  weigh_values(r.acc, s, vc, cn, g, d, alpha);
}

}  // namespace
}  // namespace mg
