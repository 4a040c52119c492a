// The KV cache in blocks: where a row's position lies, and how a K/V row is stored (contract.h, 6).
#include <ATen/Parallel.h>

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

LayerCache layer_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  check_cpu(k, "k_cache");
  check_cpu(v, "v_cache");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "KV cache: K and V [blocks, Hkv, B, D] of one dtype");
  const at::ScalarType dt = k.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kFloat || dt == at::kChar, "KV cache: bf16, fp32 or int8");
  const bool int8 = dt == at::kChar;
  TORCH_CHECK(int8 == (k_scale.numel() > 0) && int8 == (v_scale.numel() > 0),
              "KV cache: scales exactly when the cache is int8");
  if (int8) {
    check_cpu(k_scale, "k_scale");
    check_cpu(v_scale, "v_scale");
    TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                    k_scale.sizes() == k.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
                "KV cache: int8 scales fp32 [blocks, Hkv, B]");
  }
  return {dt, k.data_ptr(), v.data_ptr(), int8 ? k_scale.data_ptr<float>() : nullptr,
          int8 ? v_scale.data_ptr<float>() : nullptr, k.size(1), k.size(2), k.size(3)};
}

namespace {

// One head's d values as int8 codes and a scale, by themselves: amax = max |x| (exact); scale = amax / 127
// (one fp32 division); code = x / scale rounded to nearest even, in [-127, 127]. amax = 0 stores scale 0 and
// zero codes; a NaN or infinity stores scale NaN (the head reads back as NaN, as the bf16 cache would carry it).
void quantize_head(const bf16* x, int64_t d, int8_t* code, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::fmax(amax, std::fabs(static_cast<float>(x[i])));
  bool finite = std::isfinite(amax);
  for (int64_t i = 0; i < d && finite; ++i) finite = !std::isnan(static_cast<float>(x[i]));
  if (!finite || amax == 0.0f) {
    *scale = finite ? 0.0f : NAN;
    std::fill(code, code + d, int8_t(0));
    return;
  }
  const float s = amax / 127.0f;
  *scale = s;
  for (int64_t i = 0; i < d; ++i)
    code[i] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(x[i]) / s), -127.0f, 127.0f));
}

template <typename C>
void store_head(void* base, float* scales, int64_t row, int64_t d, const bf16* x) {
  C* dst = static_cast<C*>(base) + row * d;
  if constexpr (std::is_same_v<C, int8_t>)
    quantize_head(x, d, dst, scales + row);
  else
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<C>(x[i]);
}

}  // namespace

void store_kv_row(const LayerCache& c, const BlockTables& bt, int64_t r, int64_t pos, const bf16* k, const bf16* v) {
  const int64_t blk = bt.block_of(r, pos);
  for (int64_t g = 0; g < c.kv_heads; ++g) {
    const int64_t row = c.row_of(blk, g, pos);
    if (c.dtype == at::kChar) {
      store_head<int8_t>(c.k, c.k_scale, row, c.d, k + g * c.d);
      store_head<int8_t>(c.v, c.v_scale, row, c.d, v + g * c.d);
    } else if (c.dtype == at::kFloat) {
      store_head<float>(c.k, nullptr, row, c.d, k + g * c.d);
      store_head<float>(c.v, nullptr, row, c.d, v + g * c.d);
    } else {
      store_head<bf16>(c.k, nullptr, row, c.d, k + g * c.d);
      store_head<bf16>(c.v, nullptr, row, c.d, v + g * c.d);
    }
  }
}

// k, v [N, Hkv, D] bf16: row r's into position positions[r] of its table's block (the Python layer's write;
// the compiled stack stores through store_kv_row too, so both paths leave the same bytes).
void kv_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
              const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables, const at::Tensor& table_of,
              const at::Tensor& positions) {
  const LayerCache c = layer_cache(k_cache, v_cache, k_scale, v_scale);
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
