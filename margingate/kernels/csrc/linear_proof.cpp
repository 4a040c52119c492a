// The load-time proof of a linear path. Before a path serves its first call in a process, it
// computes a fixed set of small products and must give the scalar reference's bits (contract.h, 1;
// linear_reference) on every one, or it is refused. The cases cover the tile edges in M (the 4-row
// tiles, AMX's 16 and 32), N (16-column panels, 2-panel tiles) and K (32-k blocks, padding, more
// than one k slice), both regroupings of the weights (one row tile, several), zeros of both signs,
// bf16 denormals, denormal products and results, and exponents far from 1; then quantized weights in
// every code layout (4, 5, 6 and 8 bits, scales per block and per group, offsets), dequantized by
// the path's ISA; the int8 paths also on the integer-exact contract's own layouts (2 and 3 bits, a
// table's 4-bit codes). A few ms in all.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "int8_layout.h"
#include "kernels.h"
#include "quant_codes.h"

namespace mg {
namespace {

// Tests make a proof fail: MARGINGATE_PROOF_FAULT names paths (comma-separated) whose proof sees one bit flipped.
bool faulted(const std::string& path) {
  const char* fault = std::getenv("MARGINGATE_PROOF_FAULT");
  return fault && ("," + std::string(fault) + ",").find("," + path + ",") != std::string::npos;
}

struct Case {
  int64_t m, n, k;
  int spread;  // exponents in [-spread, spread] around 1
};

constexpr Case kCases[] = {{1, 16, 32, 8},    {3, 17, 33, 8},     {4, 31, 64, 60},  {5, 48, 96, 8},
                           {16, 33, 70, 60},  {17, 48, 300, 8},   {33, 24, 288, 60}, {70, 20, 40, 8},
                           {6, 50, 260, 30},  {200, 16, 40, 8}};  // m > 192: two row jobs

struct Rng {  // xorshift64: the same cases on every machine
  uint64_t s;
  uint32_t next() {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return uint32_t(s >> 32);
  }
};

// A bf16 bit pattern: +0, -0, a denormal of either sign, or a normal value of random sign and
// mantissa with an exponent within `spread` of 1's.
uint16_t bf16_bits(Rng& r, int spread) {
  const uint32_t u = r.next();
  switch (u % 16) {
    case 0: return 0x0000;
    case 1: return 0x8000;
    case 2: return uint16_t(((u >> 8) & 0x807f) | 1);
    default: {
      const uint32_t e = 127 + (u >> 4) % (2 * spread + 1) - spread;
      return uint16_t(((u >> 31) << 15) | (e << 7) | ((u >> 16) & 0x7f));
    }
  }
}

// x [m, k]: bf16 values, or fp32 ones that are not bf16 (16 more mantissa bits; fp32 denormals).
at::Tensor make_x(Rng& r, const Case& c, bool fp32) {
  at::Tensor x = at::empty({c.m, c.k}, at::dtype(fp32 ? at::kFloat : at::kBFloat16));
  for (int64_t i = 0; i < c.m * c.k; ++i) {
    const uint16_t hi = bf16_bits(r, c.spread);
    if (fp32) reinterpret_cast<uint32_t*>(x.data_ptr())[i] = (uint32_t(hi) << 16) | (r.next() & 0xffff);
    else reinterpret_cast<uint16_t*>(x.data_ptr())[i] = hi;
  }
  return x;
}

// A packed weight [panels, kp / 2, 16, 2], zero where a real packing pads (columns >= n, k >= k).
at::Tensor make_packed(Rng& r, const Case& c) {
  const int64_t panels = (c.n + kPanel - 1) / kPanel, kp = round_up(c.k, kBlock);
  at::Tensor w = at::zeros({panels, kp / 2, kPanel, 2}, at::dtype(at::kBFloat16));
  uint16_t* d = reinterpret_cast<uint16_t*>(w.data_ptr());
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t q = 0; q < kp / 2; ++q)
      for (int64_t l = 0; l < kPanel; ++l)
        for (int64_t e = 0; e < 2; ++e)
          if (p * kPanel + l < c.n && 2 * q + e < c.k) d[((p * kp / 2 + q) * kPanel + l) * 2 + e] = bf16_bits(r, c.spread);
  return w;
}

// Quantized weights (quant.cpp) in two parts: the first panel in format f, the rest in the next one.
// Each format is one code layout (4, 5, 6 and 8 bits; the int8 contract's 2 and 3 bits and tables too)
// with its scale arrays (d alone, d * s per group, an offset or none), as the GGUF types have them.
struct Format {
  int bits, zero;
  int64_t group, block;
  bool s, off, s_off;
  int table;  // quant_codes.h's code_table id, 0: none
};
constexpr Format kFormats[] = {{4, 3, 32, 64, true, true, true, 0},     // Q4_K's (with a zero point)
                               {5, 16, 32, 32, false, false, false, 0},  // Q5_0's
                               {6, 32, 16, 32, true, false, false, 0},   // Q6_K's
                               {8, 0, 32, 32, false, true, false, 0},    // Q8_0's, with Q4_1's offset
                               {8, 0, 32, 32, false, false, false, 0},   // Q8_0's (AMX tiles run it)
                               // the integer-exact contract's alone:
                               {2, 1, 16, 64, true, true, true, 0},      // Q2_K's (with a zero point)
                               {3, 4, 16, 32, true, false, false, 0},    // Q3_K's
                               {4, 0, 32, 32, false, false, false, 1},   // IQ4_NL's
                               {4, 0, 32, 64, true, false, false, 1},    // IQ4_XS's
                               {4, 0, 16, 32, true, true, true, 1},      // a table with an offset
                               {3, 0, 16, 64, true, false, false, 2},    // IQ2_XS's, IQ2_S's (3 bits, d / 8)
                               {4, 0, 32, 64, true, false, false, 3}};   // IQ3_XXS's (d / 4)
constexpr int kExactFormats = 5, kInt8Formats = 12;
// Case f holds format f's first panel and the next format's rest: k a multiple of both blocks.
constexpr Case kQuantCases[] = {{1, 40, 64, 8},  {6, 48, 288, 8}, {37, 20, 96, 8}, {200, 17, 64, 8},
                                {33, 24, 64, 8}, {1, 33, 128, 8}, {9, 40, 192, 8}, {1, 48, 64, 8},
                                {20, 32, 128, 8}, {5, 20, 64, 8}, {3, 40, 128, 8}, {17, 33, 192, 8}};

// Bytes of a part's codes, high bits, d, s, d_off and s_off (0: none), for np panels, in the bf16 or the
// int8 contract's layout.
std::vector<int64_t> array_bytes(const Format& f, int64_t np, int64_t k, bool int8) {
  const int64_t d = np * (k / f.block) * kPanel * 2, s = np * (k / f.group) * kPanel;
  const int64_t codes = int8 ? np * (k / 4) * quad_bytes(f.bits) : np * k * kPanel / (f.bits == 8 ? 1 : 2);
  const int64_t high = int8 ? np * (k / 4) * high_bytes(f.bits)
                            : f.bits == 5 || f.bits == 6 ? np * k / high_run(f.bits) * kPanel : 0;
  return {codes, high, d, f.s ? s : 0, f.off ? d : 0, f.off && f.s_off ? s : 0};
}

// Random bytes, except the fp16 d fields: finite values of either sign, subnormals among them. Formats
// f and f + 1 (mod `formats`).
at::Tensor make_quant(Rng& r, const Case& c, int f, int formats, int64_t magic) {
  const int64_t panels = (c.n + kPanel - 1) / kPanel, parts = panels > 1 ? 2 : 1;
  std::vector<int64_t> head = {magic, c.n, c.k, parts};
  int64_t at = round_up(8 * (4 + 12 * parts), 64);
  for (int64_t i = 0; i < parts; ++i) {
    const Format& fm = kFormats[(f + i) % formats];
    const int64_t np = i == 0 ? 1 : panels - 1;
    head.insert(head.end(), {np, fm.group, fm.block, fm.bits, fm.zero});
    for (int64_t bytes : array_bytes(fm, np, c.k, magic == kInt8Magic)) {
      head.push_back(bytes ? at : -1);
      at += round_up(bytes, 64);
    }
    head.push_back(fm.table);
  }
  at::Tensor blob = at::empty({at}, at::dtype(at::kByte));
  uint8_t* b = blob.data_ptr<uint8_t>();
  for (int64_t j = 0; j < at; ++j) b[j] = uint8_t(r.next());
  std::memcpy(b, head.data(), head.size() * 8);
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t* h = head.data() + 4 + 12 * i;
    const int64_t halves = h[0] * (c.k / h[2]) * kPanel;
    for (int64_t field : {h[7], h[9]})
      for (int64_t j = 0; field >= 0 && j < halves; ++j)
        reinterpret_cast<uint16_t*>(b + field)[j] = uint16_t(r.next() % 0x7c00 | (r.next() & 0x8000));
  }
  return blob;
}

// "" when got and want hold the same bits, else where they first differ.
std::string compare(const at::Tensor& got, const at::Tensor& want, const Case& c, bool fp32) {
  const at::Tensor g = got.view(fp32 ? at::kInt : at::kShort), w = want.view(fp32 ? at::kInt : at::kShort);
  const at::Tensor diff = g.ne(w).nonzero();
  if (diff.size(0) == 0) return "";
  const int64_t i = diff[0][0].item<int64_t>(), j = diff[0][1].item<int64_t>(), mask = fp32 ? 0xffffffff : 0xffff;
  std::ostringstream out;
  out << (fp32 ? "fp32" : "bf16") << " x, m=" << c.m << " n=" << c.n << " k=" << c.k << ": " << diff.size(0)
      << " outputs differ, first [" << i << ", " << j << "]: bits 0x" << std::hex << (g[i][j].item<int64_t>() & mask)
      << " instead of 0x" << (w[i][j].item<int64_t>() & mask);
  return out.str();
}

}  // namespace

// MARGINGATE_PROOF_FAULT=<path> flips one output bit of that path inside its proof: how the tests
// make a path fail (a refused path must warn, step aside, and be named), never used otherwise.
std::string prove_linear(const std::string& path, const LinearRun& run, bool fp32_x) {
  Rng r{0x9E3779B97F4A7C15ull};
  for (const Case& c : kCases)
    for (int fp32 = 0; fp32 <= int(fp32_x); ++fp32) {
      const at::Tensor x = make_x(r, c, fp32), w = make_packed(r, c);
      at::Tensor bias = at::empty({c.n}, at::dtype(at::kFloat));
      for (int64_t j = 0; j < c.n; ++j) bias.data_ptr<float>()[j] = float(int(r.next() % 9) - 4) * 0.25f;
      for (const c10::optional<at::Tensor>& b : {c10::optional<at::Tensor>(), c10::optional<at::Tensor>(bias)}) {
        at::Tensor got = run(x, w, c.n, b);
        if (faulted(path)) got.view(fp32 ? at::kInt : at::kShort)[0][0].bitwise_xor_(1);
        const std::string why = compare(got, linear_reference(x, w, c.n, b, fp32), c, fp32);
        if (!why.empty()) return why;
      }
    }
  for (int f = 0; f < kExactFormats; ++f) {  // quantized weights: dequantized by the path's ISA, then its kernel
    const Case& c = kQuantCases[f];
    const at::Tensor w = make_quant(r, c, f, kExactFormats, kQuantMagic);
    for (int fp32 = 0; fp32 <= int(fp32_x); ++fp32) {
      const at::Tensor x = make_x(r, c, fp32);
      const std::string why = compare(run(x, w, c.n, c10::nullopt),
                                      linear_reference(x, w, c.n, c10::nullopt, fp32), c, fp32);
      if (!why.empty()) return "quantized weight, " + why;
    }
  }
  return "";
}

// The int8 path against the int8 scalar reference (contract.h, 5): every code layout (2 to 8 bits, tables),
// two parts of different blocks in one matrix, rows with zeros, denormals and wide exponents, 1 to 200 rows.
std::string prove_int8(const std::string& path,
                       const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>& run) {
  Rng r{0xD1B54A32D192ED03ull};
  for (int f = 0; f < kInt8Formats; ++f) {
    const Case& c = kQuantCases[f];
    const at::Tensor w = make_quant(r, c, f, kInt8Formats, kInt8Magic), x = make_x(r, c, false);
    at::Tensor got = run(x, w, c.n);
    if (faulted(path)) got.view(at::kShort)[0][0].bitwise_xor_(1);
    const std::string why = compare(got, linear_reference(x, w, c.n, c10::nullopt, false), c, false);
    if (!why.empty()) return "int8, " + why;
  }
  return "";
}

}  // namespace mg
