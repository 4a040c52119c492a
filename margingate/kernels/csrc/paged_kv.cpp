// The KV cache in blocks: where a row's position lies, and how a K/V row is stored (contract.h, 6).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace mg {

BlockTables block_tables(const at::Tensor& tables, const at::Tensor& table_of, const at::Tensor& lengths,
                         int64_t num_blocks, int64_t block) {
  check_cpu(tables, "block tables");
  check_cpu(table_of, "table_of");
  check_cpu(lengths, "lengths");
  TORCH_CHECK(tables.scalar_type() == at::kLong && table_of.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong && tables.dim() == 2,
              "block tables: tables [T, W], table_of [N] and lengths [N], int64");
  TORCH_CHECK(table_of.numel() == lengths.numel(), "block tables: one table and one length per row");
  TORCH_CHECK(block > 0, "block tables: the block size must be positive");
  const BlockTables bt{tables.data_ptr<int64_t>(), table_of.data_ptr<int64_t>(), tables.size(1), block};
  // each table's longest row, then its blocks: rows of one request share a table, so this reads each once
  std::vector<int64_t> longest(tables.size(0), 0);
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < table_of.numel(); ++r) {
    const int64_t t = bt.table_of[r];
    TORCH_CHECK(t >= 0 && t < tables.size(0), "block tables: row ", r, " names table ", t, " of ", tables.size(0));
    TORCH_CHECK(len[r] >= 1 && len[r] <= bt.width * block, "block tables: row ", r, " reaches position ", len[r] - 1,
                ", beyond its table's ", bt.width, " blocks");
    longest[t] = std::max(longest[t], len[r]);
  }
  for (int64_t t = 0; t < tables.size(0); ++t)
    for (int64_t b = 0; b * block < longest[t]; ++b) {
      const int64_t blk = bt.tables[t * bt.width + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block tables: table ", t, " entry ", b, " is block ", blk,
                  ", outside the pool's ", num_blocks);
    }
  return bt;
}

LayerCache layer_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_scale, const at::Tensor& v_scale,
                       bool rotate) {
  check_cpu(k, "k_cache");
  check_cpu(v, "v_cache");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "KV cache: K and V [blocks, Hkv, B, D] of one dtype");
  const at::ScalarType dt = k.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kChar || dt == at::kByte,
              "KV cache: bf16, fp32, int8 or int4 (uint8, two codes a byte)");
  const bool quantized = dt == at::kChar || dt == at::kByte;
  const int64_t d = dt == at::kByte ? 2 * k.size(3) : k.size(3);
  TORCH_CHECK(quantized == (k_scale.numel() > 0) && quantized == (v_scale.numel() > 0),
              "KV cache: scales exactly when the cache is quantized");
  TORCH_CHECK(quantized || !rotate, "KV cache: only a quantized cache is stored rotated");
  int64_t group = d;
  if (quantized) {
    check_cpu(k_scale, "k_scale");
    check_cpu(v_scale, "v_scale");
    TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat && k_scale.dim() == 4 &&
                    k_scale.sizes().slice(0, 3) == k.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes() &&
                    k_scale.size(3) > 0 && d % k_scale.size(3) == 0,
                "KV cache: scales fp32 [blocks, Hkv, B, groups], the groups dividing the head dim");
    group = d / k_scale.size(3);
    TORCH_CHECK(d <= 256, "KV cache: a quantized cache's head dim must be <= 256");
    TORCH_CHECK(group % (dt == at::kByte ? 16 : 8) == 0, "KV cache: ", group,
                " values per scale; int8 needs a multiple of 8, int4 of 16");
  }
  return {dt, k.data_ptr(), v.data_ptr(), quantized ? k_scale.data_ptr<float>() : nullptr,
          quantized ? v_scale.data_ptr<float>() : nullptr, k.size(1), k.size(2), d, group, rotate};
}

namespace {

// A group's scale, or false (its codes are then all zero) where it holds a NaN or an infinity (scale NaN) or
// only zeros (scale 0): contract.h 6b. int8: amax / 127; int4: the value of largest |v|, first among equals, / -8.
bool group_scale(const float* x, int64_t n, bool int4, float* scale) {
  float amax = 0.0f, m = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), m = x[i];
  }
  *scale = !finite ? NAN : amax == 0.0f ? 0.0f : int4 ? m / -8.0f : amax / 127.0f;
  return finite && amax != 0.0f;
}

// One head's d values, by themselves (contract.h, 6a-b): widened, rotated where the cache is, then per group
// a scale and codes (int8: one a byte; int4: code + 8, values j and j + G / 2 of a group in byte j's nibbles).
void quantize_head(const LayerCache& c, const bf16* x, void* codes, float* scales) {
  alignas(32) float t[256];
  for (int64_t i = 0; i < c.d; ++i) t[i] = static_cast<float>(x[i]);
  if (c.rotate) hadamard(t, c.d);
  const bool int4 = c.dtype == at::kByte;
  const int64_t g = c.group, half = g / 2;
  for (int64_t q = 0; q < c.groups(); ++q) {
    const float* v = t + q * g;
    float s;
    const bool coded = group_scale(v, g, int4, &s);
    scales[q] = s;
    const auto code = [&](int64_t i, float lo, float hi) {
      return coded ? std::clamp(std::nearbyint(v[i] / s), lo, hi) : 0.0f;
    };
    if (int4) {
      uint8_t* dst = static_cast<uint8_t*>(codes) + q * half;
      for (int64_t j = 0; j < half; ++j)
        dst[j] = uint8_t(int(code(j, -8.0f, 7.0f)) + 8) | uint8_t((int(code(j + half, -8.0f, 7.0f)) + 8) << 4);
    } else {
      int8_t* dst = static_cast<int8_t*>(codes) + q * g;
      for (int64_t i = 0; i < g; ++i) dst[i] = static_cast<int8_t>(code(i, -127.0f, 127.0f));
    }
  }
}

template <typename C>
void store_head(void* base, int64_t row, int64_t d, const bf16* x) {
  C* dst = static_cast<C*>(base) + row * d;
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<C>(x[i]);
}

}  // namespace

void store_kv_row(const LayerCache& c, const BlockTables& bt, int64_t r, int64_t pos, const bf16* k, const bf16* v) {
  const int64_t blk = bt.block_of(r, pos), w = c.width();  // bytes per head, quantized
  for (int64_t g = 0; g < c.kv_heads; ++g) {
    const int64_t row = c.row_of(blk, g, pos);
    if (c.quantized()) {
      quantize_head(c, k + g * c.d, static_cast<uint8_t*>(c.k) + row * w, c.k_scale + row * c.groups());
      quantize_head(c, v + g * c.d, static_cast<uint8_t*>(c.v) + row * w, c.v_scale + row * c.groups());
    } else if (c.dtype == at::kFloat) {
      store_head<float>(c.k, row, c.d, k + g * c.d);
      store_head<float>(c.v, row, c.d, v + g * c.d);
    } else {
      store_head<bf16>(c.k, row, c.d, k + g * c.d);
      store_head<bf16>(c.v, row, c.d, v + g * c.d);
    }
  }
}

// k, v [N, Hkv, D] bf16: row r's into position positions[r] of its table's block (the Python layer's write;
// the compiled stack stores through store_kv_row too, so both paths leave the same bytes).
void kv_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
              bool rotate, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
              const at::Tensor& table_of, const at::Tensor& positions) {
  const LayerCache c = layer_cache(k_cache, v_cache, k_scale, v_scale, rotate);
  check_cpu(k, "k");
  check_cpu(v, "v");
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && k.dim() == 3 &&
                  k.sizes() == v.sizes() && k.size(1) == c.kv_heads && k.size(2) == c.d,
              "kv_write: k, v [N, Hkv, D] bf16 matching the cache");
  const at::Tensor lengths = positions.to(at::kLong) + 1;
  const BlockTables bt = block_tables(tables, table_of, lengths, k_cache.size(0), c.block);
  const int64_t* len = lengths.data_ptr<int64_t>();
  const bf16 *kp = k.data_ptr<bf16>(), *vp = v.data_ptr<bf16>();
  const int64_t stride = c.kv_heads * c.d;
  at::parallel_for(0, k.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) store_kv_row(c, bt, r, len[r] - 1, kp + r * stride, vp + r * stride);
  });
}

}  // namespace mg
