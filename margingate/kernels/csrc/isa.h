// The linear's instruction-set paths (contract.h, 1), one translation unit each, and what they
// are handed. Plain declarations only: this header is included under every target.
#pragma once

#include <cstdint>

namespace mg {

// Rows [0, m) of x against panels [p0, p1) of the packed weights, summed into acc (fp32, zeroed
// by the caller; row stride ldacc; column 0 is panel 0's first), under FTZ | DAZ set by the caller.
// FMA paths read xf (fp32 rows of kp values); AMX reads xb (bf16 rows of kp values, m rounded up
// to 16 rows, the extra ones zero; acc has as many rows); AVX512-BF16 reads xb regrouped by chain, in
// tiles of kBf16Rows rows (row i of the task at xb + i * kp when i is a multiple of kBf16Rows).
// AVX512-BF16 reads x in tiles of kBf16Rows rows: per block of 32 k, the tile's rows one after the
// other (the last tile of x holds the rows left, R < kBf16Rows, as R rows per block).
constexpr int64_t kBf16Rows = 4;

struct LinearTask {
  const float* xf;
  const uint16_t* xb;
  int64_t m, kp;
  const uint16_t* w;  // packed: [panels][kp / 2][16][2]
  int64_t p0, p1;
  float* acc;
  int64_t ldacc;
};

// Every path of the linear, slowest to fastest within its family: the bf16 contract's (contract.h, 1), then
// the integer-exact contract's (contract.h, 5). linear_paths.cpp holds their one table.
enum class Path { kAvx2, kAvx512, kAvx512Bf16, kAmx, kInt8Avx2, kInt8Vnni, kInt8Amx };
constexpr int kNumPaths = 7;
inline bool reads_bf16(Path p) { return p == Path::kAmx || p == Path::kAvx512Bf16; }  // else fp32 rows (bf16 family)

void linear_avx2(const LinearTask& t);    // linear_avx2.cpp
void linear_avx512(const LinearTask& t);  // linear_avx512.cpp
void linear_avx512bf16(const LinearTask& t);  // linear_avx512bf16.cpp (bf16 x only, xb regrouped)
void linear_amx(const LinearTask& t);     // linear_amx.cpp (bf16 x only)
bool amx_granted();                       // asks the OS for the AMX tile state once; true if granted

// A run of panels of a quantized weight (quant.cpp; kernels/quant_pack.py writes them). Element
// (column l, k) of a panel dequantizes to bf16(scale * (q - zero) [+ offset]): scale = d * s, the fp32
// product of an fp16 d per block of k and an int8 s per group (none: 1), exact; the offset likewise
// from d_off and s_off; the fp32 multiply, the fp32 add where the format has an offset, one rounding
// to nearest even. codes: the low 4 bits of a pair in a byte ([panel][kp / 2][16], k even in the low
// nibble), or 8-bit signed ([panel][kp / 2][16][2]); high (5 and 6 bits): the bits above 4,
// [panel][kp / 2 / R][16][2] with R = 8 / (bits - 4) pair rows a byte; d, d_off: [panel][kp / block][16]
// fp16 bits; s, s_off: [panel][kp / group][16]. The integer-exact contract's layout (int8_layout.h) orders
// the codes by quads of 4 k instead and adds 2- and 3-bit codes and codes that index a table.
struct QuantPart {
  const uint8_t* codes;
  const uint8_t* high;    // null for 2, 4 and 8 bits
  const uint16_t* d;
  const int8_t* s;        // null: 1 (block == group)
  const uint16_t* d_off;  // null: no offset
  const int8_t* s_off;
  int64_t panels, group, block;
  int bits, zero;
  bool int8 = false;      // the integer-exact contract's code order (contract.h, 5), else the bf16 one's
  const int8_t* table = nullptr;  // 3- or 4-bit codes index these values (quant_codes.h), else a code is its value
  float unit = 1.0f;              // the table's power of two: d is widened to fp32, then times unit (exact)
};

// Rows of x under the integer-exact contract (contract.h, 5), quantized by linear_int8.cpp for one
// activation block size: q [m][kp] int8 in [-127, 127], scale [m][kp / block] fp32 (the block's
// amax / 127), sum16 [m][kp / 16] int32 (each 16 q's sum, for the formats' zero points and offsets).
struct Int8Rows {
  const int8_t* q;
  const float* scale;
  const int32_t* sum16;
  int64_t m, kp, block;
};

// Panel `panel` of part q against every row of x, added into acc (16 columns from acc's column 0, row
// stride ldacc), under FTZ | DAZ set by the caller; x.block == q.block. The same bits on every path.
void linear_int8_avx2(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc);
void linear_int8_scalar(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc);
void linear_int8_vnni(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc);  // AVX-512 VNNI
void linear_int8_amx(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc);   // AMX-INT8

// One panel of a part, all kp k, into the packed bf16 layout [kp / 2][16][2]; the same bits on every ISA.
void dequant_panel_avx2(const QuantPart& q, int64_t panel, int64_t kp, uint16_t* dst);        // quant.cpp
void dequant_panel_avx512bf16(const QuantPart& q, int64_t panel, int64_t kp, uint16_t* dst);  // linear_avx512bf16.cpp

// The AVX512-BF16 linear over panels [t.p0, t.p1) of a task (t.w unused), which are the part's
// panels from `panel` on: dequant_panel_avx512bf16's bits, then linear_avx512bf16's order. Dequantized
// as the kernel reads them, never into a whole-panel scratch: in registers for at most kBf16Rows rows,
// else a k slice of two panels at a time into L1, read there by every row tile.
void linear_avx512bf16_quant(const LinearTask& t, const QuantPart& q, int64_t panel);

}  // namespace mg
