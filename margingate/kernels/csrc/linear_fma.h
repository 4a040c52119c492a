// The linear's reduction order (contract.h, 1) on FMA units: output columns in the vector lanes,
// one broadcast activation per k, one packed weight pair per column vector: an outer product with
// no horizontal sums. Written once for any vector width `V` (linear_avx2.cpp: 8 lanes,
// linear_avx512.cpp: 16); each includes this file under its own target.
//
// V provides: T (the vector), kLanes, zero(), load(const float*), store(float*, T), bcast(const
// float*), fma(a, b, c) = a * b + c, add(a, b), and pairs(w, even, odd): kLanes columns of one
// packed pair, widened exactly to fp32 (the even element is the low half of each 32-bit lane).
#pragma once

#include "contract.h"
#include "isa.h"

namespace mg {
namespace {

// MR rows x NR column vectors. w[j]: column vector j at pair 0; a pair is 2 * kPanel bf16 further.
// Every (row, column) has its own e, o and acc: MR and NR only decide which share registers.
template <class V, int MR, int NR>
void fma_tile(const float* x, int64_t kp, const uint16_t* const* w, float* acc, int64_t ldacc, int64_t b0,
              int64_t b1) {
  using T = typename V::T;
  for (int64_t b = b0; b < b1; ++b) {
    T e[MR][NR], o[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) e[i][j] = o[i][j] = V::zero();
    for (int64_t q = b * (kBlock / 2); q < (b + 1) * (kBlock / 2); ++q) {  // the block's 16 pairs
      T we[NR], wo[NR];
      for (int j = 0; j < NR; ++j) V::pairs(w[j] + q * 2 * kPanel, we[j], wo[j]);
      for (int i = 0; i < MR; ++i) {
        const T xe = V::bcast(x + i * kp + 2 * q), xo = V::bcast(x + i * kp + 2 * q + 1);
        for (int j = 0; j < NR; ++j) {
          e[i][j] = V::fma(xe, we[j], e[i][j]);
          o[i][j] = V::fma(xo, wo[j], o[i][j]);
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {  // acc = acc + (e + o)
        float* a = acc + i * ldacc + j * V::kLanes;
        V::store(a, V::add(V::load(a), V::add(e[i][j], o[i][j])));
      }
  }
}

// The last `left` (< R + 1) rows, one tile of exactly that many rows.
template <class V, int R, int NR>
void fma_tail_rows(const LinearTask& t, const uint16_t* const* w, int64_t i, int64_t col, int64_t left, int64_t b0,
                   int64_t b1) {
  if constexpr (R >= 1) {
    if (left == R) fma_tile<V, R, NR>(t.xf + i * t.kp, t.kp, w, t.acc + i * t.ldacc + col, t.ldacc, b0, b1);
    else fma_tail_rows<V, R - 1, NR>(t, w, i, col, left, b0, b1);
  }
}

// Columns [c, c + NR * kLanes) of blocks [b0, b1) for every row, MR rows at a time: the slice of
// W's columns stays in L1 while the row tiles pass, and the next columns' slice is fetched meanwhile
// (a slice is a few KB at a panel's stride, too short for the hardware prefetchers to follow).
template <class V, int MR, int NR>
void fma_slice(const LinearTask& t, int64_t c, int64_t b0, int64_t b1) {
  const uint16_t* w[NR];
  for (int j = 0; j < NR; ++j) {  // where column c + j * kLanes sits in its panel
    const int64_t col = c + j * V::kLanes;
    w[j] = t.w + (col / kPanel) * t.kp * kPanel + (col % kPanel) * 2;
  }
  const int64_t next = c + NR * V::kLanes;
  if (t.m > MR && next < t.p1 * kPanel && next % kPanel == 0)
    for (int64_t p = next / kPanel; p < min64(t.p1, (next + NR * V::kLanes + kPanel - 1) / kPanel); ++p)
      prefetch_slice(t.w + p * t.kp * kPanel, b0, b1);
  const int64_t a = c - t.p0 * kPanel;  // the columns' place in acc
  int64_t i = 0;
  for (; i + MR <= t.m; i += MR) fma_tile<V, MR, NR>(t.xf + i * t.kp, t.kp, w, t.acc + i * t.ldacc + a, t.ldacc, b0, b1);
  if (i < t.m) fma_tail_rows<V, MR - 1, NR>(t, w, i, a, t.m - i, b0, b1);
}

// One k slice at a time for every column and row (the task's x rows of a slice stay in L2 while
// the columns pass), NR column vectors at a time, then single vectors; a task of one row tile reads
// each weight once, in one slice, so its panels stream whole. Blocks still reach each acc element
// in ascending order: no blocking choice changes a bit.
// The caller (linear.cpp) sets FTZ | DAZ: this code must see the contract's flushing.
template <class V, int MR, int NR>
void fma_linear(const LinearTask& t) {
  const int64_t c1 = t.p1 * kPanel, blocks = t.kp / kBlock, slice = t.m <= MR ? blocks : kSliceBlocks;
  for (int64_t b0 = 0; b0 < blocks; b0 += slice) {
    const int64_t b1 = min64(blocks, b0 + slice);
    int64_t c = t.p0 * kPanel;
    for (; c + NR * V::kLanes <= c1; c += NR * V::kLanes) fma_slice<V, MR, NR>(t, c, b0, b1);
    for (; c < c1; c += V::kLanes) fma_slice<V, MR, 1>(t, c, b0, b1);
  }
}

}  // namespace
}  // namespace mg
