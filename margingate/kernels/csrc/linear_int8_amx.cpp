// The integer-exact linear (contract.h, 5) on AMX-INT8 tiles, for 16 rows at a time: a group's q of 16
// rows is tile A (16 rows x Group int8), its codes tile B (Group / 4 quads x 64 bytes: a quad is AMX's VNNI
// row, int8_layout.h), and one TDPBSUD (u8 codes) or TDPBSSD (8-bit signed codes) gives the group's exact
// int32 sums of 16 rows x 16 columns; the fold and the float epilogue are int8_layout512.h's, as on VNNI.
// The rows left over (m mod 16) run on the VNNI kernel: the same bits by the contract, and both are proven.
// Its own translation unit, the only one compiled for AMX-INT8 (the target pragma).
//
// Bounds: the tile instructions add the four u8 x s8 (or s8 x s8) products of a lane into int32 without
// saturating; a group of at most 32 k sums at most 32 x 255 x 128 in magnitude.
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include "int8_layout512.h"
#include "quant_codes.h"

namespace mg {
namespace {

constexpr int kTileRows = 16;
// Tiles (their numbers are immediates in the intrinsics): 0 the int32 sums C, 1 the q rows A, 2 the codes B.

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int group) {
  TileConfig c;
  c.colsb[0] = 64, c.rows[0] = kTileRows;     // int32 sums, 16 rows x 16 columns
  c.colsb[1] = group, c.rows[1] = kTileRows;  // q, 16 rows x group
  c.colsb[2] = 64, c.rows[2] = group / 4;     // codes, a quad per row
  _tile_loadconfig(&c);
}

// Group g's int32 sums of rows [r0, r0 + 16) into sums (16 x 16, row stride 16).
template <int Bits, int Group>
void group_tile(const Int8Rows& x, int64_t r0, const uint8_t* codes, const uint8_t* high, int64_t g, int32_t* sums) {
  alignas(64) uint8_t b[Group / 4][64];
  const int64_t qd0 = g * (Group / 4);
  if constexpr (Bits == 8) {
    _tile_loadd(2, codes + qd0 * 64, 64);  // the packed quads are B's rows already
  } else {
    for (int i = 0; i < Group / 4; ++i)
      _mm512_store_si512(b[i], quad_codes512<Bits>(codes + (qd0 + i) * kQuadBytes<Bits>,
                                                   high ? high + (qd0 + i) * kHighBytes<Bits> : nullptr));
    _tile_loadd(2, b, 64);
  }
  _tile_loadd(1, x.q + r0 * x.kp + g * Group, x.kp);
  _tile_zero(0);
  if constexpr (Bits == 8) _tile_dpbssd(0, 1, 2);
  else _tile_dpbsud(0, 1, 2);
  _tile_stored(0, sums, 64);
}

// Rows [r0, r0 + 16) against one panel, every block: first every group's tile of sums (at most 16 groups
// of 1 KB, in L1), then per row its block sums in registers and the epilogue.
template <int Bits, bool Offset, int Group>
void tile16(const Int8Rows& x, int64_t r0, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  const int64_t kp = x.kp, groups = q.block / Group, blocks = kp / q.block;
  const uint8_t* codes = q.codes + panel * (kp / 4) * kQuadBytes<Bits>;
  const uint8_t* high = kHighBytes<Bits> ? q.high + panel * (kp / 4) * kHighBytes<Bits> : nullptr;
  alignas(64) int32_t sums[256 / Group][kTileRows][16];
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t g = 0; g < groups; ++g) group_tile<Bits, Group>(x, r0, codes, high, b * groups + g, &sums[g][0][0]);
    const BlockScales bs = block_scales512<Offset>(q, (panel * blocks + b) * 16);
    for (int r = 0; r < kTileRows; ++r) {
      __m512i S = _mm512_setzero_si512(), M = _mm512_setzero_si512();
      const int32_t* s16 = x.sum16 + (r0 + r) * (kp / 16) + b * groups * Group / 16;
      for (int64_t g = 0; g < groups; ++g) {
        const GroupScales gs = group_scales512<Offset>(q, (panel * (kp / Group) + b * groups + g) * 16);
        const int32_t xsum = Group == 32 ? s16[2 * g] + s16[2 * g + 1] : s16[g];
        fold_row<Offset>(gs, _mm512_load_si512(sums[g][r]), xsum, q.zero, S, M);
      }
      epilogue_row<Offset>(bs, x.scale[(r0 + r) * blocks + b], S, M, acc + (r0 + r) * ldacc);
    }
  }
}

}  // namespace

void linear_int8_amx(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  // Tiles only where they measured faster than VNNI (an Intel Xeon, 2 cores, 16-512 rows): 8-bit codes
  // without group scales (Q8_0), whose packed quads are tile B as they lie. Where codes must be unpacked
  // first (Q4_0 0.4-0.7x) or a group of 16 or 32 k has its own scale (K-quants: Q6_K 0.7-0.9x), the tile
  // saves less than its stores and the fold cost; those, and a block over 256 k (no GGUF format: tile16's
  // sums would not fit), run on the VNNI kernel, the same bits by the contract.
  const int64_t whole = q.bits == 8 && !q.s && q.block <= 256 ? x.m / kTileRows * kTileRows : 0;
  if (whole) {
    configure(int(q.group));  // tile state is per thread
    by_layout(q, [&](auto f, auto group) {
      if constexpr (decltype(f)::kBits == 8)  // whole > 0 only there: no tile code for the other layouts
        for (int64_t r0 = 0; r0 < whole; r0 += kTileRows)
          tile16<8, decltype(f)::kOffset, decltype(group)::value>(x, r0, q, panel, acc, ldacc);
    });
    _tile_release();
  }
  if (whole < x.m) {
    Int8Rows rest = x;
    rest.q += whole * x.kp, rest.scale += whole * (x.kp / x.block), rest.sum16 += whole * (x.kp / 16);
    rest.m = x.m - whole;
    linear_int8_vnni(rest, q, panel, acc + whole * ldacc, ldacc);
  }
}

}  // namespace mg
