// The linear on AMX tiles: TDPBF16PS *is* the contract's order (contract.h, 1), so the tiles run
// it natively. Its own translation unit, the only one compiled for AMX (the target pragma); it is
// called only where the CPU has AMX-BF16 and the OS granted the tile state (amx_granted).
//
// Tiles: C 0-3 (2 x 2 blocks of 16 rows x 16 fp32 columns), A 4-5 (16 rows x 32 bf16 of x),
// B 6-7 (16 pairs x 16 columns of one packed panel: the panel layout is AMX's VNNI layout).
#pragma GCC target("amx-tile,amx-bf16,avx512f")
#include "contract.h"
#include "isa.h"

namespace mg {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

// Rows [r, r + 16 * RT) against panels [p, p + PT): every k block, one TDPBF16PS per C tile.
// Tile numbers are immediates, hence the constants.
template <int RT, int PT>
void amx_block(const LinearTask& t, int64_t r, int64_t p) {
  const int64_t lda = t.kp * 2, panel = t.kp * kPanel;  // bytes per x row; bf16 per panel
  const uint16_t* x = t.xb + r * t.kp;
  const uint16_t* w = t.w + p * panel;
  _tile_zero(0);
  if constexpr (PT == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && PT == 2) _tile_zero(3);
  for (int64_t b = 0; b < t.kp / kBlock; ++b) {
    _tile_loadd(4, x + b * kBlock, lda);
    _tile_loadd(6, w + b * kBlock * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PT == 2) {
      _tile_loadd(7, w + panel + b * kBlock * kPanel, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, x + 16 * t.kp + b * kBlock, lda);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (PT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* acc = t.acc + r * t.ldacc + (p - t.p0) * kPanel;
  const int64_t ldc = t.ldacc * 4, down = 16 * t.ldacc;
  _tile_stored(0, acc, ldc);
  if constexpr (PT == 2) _tile_stored(1, acc + kPanel, ldc);
  if constexpr (RT == 2) _tile_stored(2, acc + down, ldc);
  if constexpr (RT == 2 && PT == 2) _tile_stored(3, acc + down + kPanel, ldc);
}

template <int PT>
void amx_rows(const LinearTask& t, int64_t p) {
  const int64_t mp = round_up(t.m, 16);
  int64_t r = 0;
  for (; r + 32 <= mp; r += 32) amx_block<2, PT>(t, r, p);
  if (r < mp) amx_block<1, PT>(t, r, p);
}

}  // namespace

void linear_amx(const LinearTask& t) {
  configure_tiles();  // tile state is per thread
  int64_t p = t.p0;
  for (; p + 2 <= t.p1; p += 2) amx_rows<2>(t, p);
  if (p < t.p1) amx_rows<1>(t, p);
  _tile_release();
}

}  // namespace mg
