// The decoder stack in one call: models/decoder.py's layer, its switches read from a StackSpec (kernels/layer_spec.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <initializer_list>

#include "kernels.h"

namespace mg {
namespace {

// models/decoder.py's layer for a forward with bf16 activations (each row's
// attention chunks aligned as `aligns` says, see attend_row): the same kernels in the same order, called from here
// instead of ~14 Python dispatches per layer. RoPE and the residual adds round each op
// to bf16 as PyTorch's elementwise bf16 ops do (compute in fp32, round to nearest even),
// so every bit equals the Python path's (tests/test_kernels.py compares them).
c10::optional<at::Tensor> maybe(const at::Tensor& t) {  // an empty tensor stands for "no bias"
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// Where the stack's time goes, by phase, for the step profile (scripts/profile_step.py);
// off unless asked for, and never part of any value.
const char* const kPhaseNames[] = {"norms", "gemm", "rope, kv write", "attention", "residual, silu"};
constexpr int kPhases = 5;
bool g_profiling = false;
double g_phase_ms[kPhases] = {};

struct Phase {
  int id;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~Phase() {
    if (g_profiling) g_phase_ms[id] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};

// Where each weight sits among a layer's tensors. Their order is stated once, in Python
// (kernels/stack.py: STACK_WEIGHTS), and arrives with them; each is found here by its name.
// An absent one (a bias, Gemma's norms on a Llama) is an empty tensor; qkv, o, gate_up and down
// are packed (packing.py); an MoE layer has a router instead of gate_up and down, and its ExpertSet.
struct WeightIndex {
  int64_t per_layer, ln1, qkv, qkv_bias, o, o_bias, ln2, gate_up, down, q_norm, k_norm, pre_ffn, post_ffn, router,
      sinks;
};

WeightIndex weight_index(const std::vector<std::string>& names) {
  const auto find = [&](const char* name) {
    const auto it = std::find(names.begin(), names.end(), name);
    TORCH_CHECK(it != names.end(), "decoder_stack: no layer weight named ", name);
    TORCH_CHECK(std::find(it + 1, names.end(), name) == names.end(), "decoder_stack: ", name, " named twice");
    return int64_t(it - names.begin());
  };
  return {int64_t(names.size()), find("input_layernorm"), find("qkv"), find("qkv_bias"), find("o_proj"),
          find("o_proj_bias"), find("post_attention_layernorm"), find("gate_up"), find("down_proj"),
          find("q_norm"), find("k_norm"), find("pre_feedforward_layernorm"), find("post_feedforward_layernorm"),
          find("router"), find("sinks")};
}

constexpr int64_t kMaxKV = 16 * 256;  // KV heads x head dim of one row, on the stack

// The model's cache as the stack reads it: K, V [layers, blocks, Hkv, B, C] and, for a quantized cache, their
// scales [layers, blocks, Hkv, B, groups] (empty tensors otherwise), stored rotated where `rotate` (kernels.h).
struct StackCache {
  at::Tensor k, v, k_scale, v_scale;
  bool rotate;
  LayerCache layer(int64_t li) const {
    const bool quantized = k_scale.numel() > 0;
    return layer_cache(k[li], v[li], quantized ? k_scale[li] : k_scale, quantized ? v_scale[li] : v_scale, rotate);
  }
  int64_t head_dim() const { return k.scalar_type() == at::kByte ? 2 * k.size(4) : k.size(4); }
};

StackCache stack_cache(const std::vector<at::Tensor>& cache, bool rotate, const StackSpec& spec) {
  TORCH_CHECK(cache.size() == 4, "decoder_stack: the cache as [k, v, k_scale, v_scale] (scales empty unless quantized)");
  const StackCache c{cache[0], cache[1], cache[2], cache[3], rotate};
  TORCH_CHECK(c.k.dim() == 5 && c.k.sizes() == c.v.sizes() && c.k.is_contiguous() && c.v.is_contiguous(),
              "decoder_stack: contiguous caches [layers, blocks, Hkv, B, D]");
  TORCH_CHECK(int64_t(spec.windows.size()) == c.k.size(0), "decoder_stack: one cache layer per layer");
  TORCH_CHECK(c.k.size(2) == spec.kv_heads, "decoder_stack: the cache's KV heads");
  TORCH_CHECK(spec.kv_heads * c.head_dim() <= kMaxKV, "decoder_stack: KV heads x head dim above ", kMaxKV);
  return c;
}

void check_rows(const at::Tensor& h, std::initializer_list<const at::Tensor*> ropes, int64_t d) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kBFloat16, "decoder_stack: h [N, hidden] bf16");
  const at::Tensor& cos = **ropes.begin();
  for (const at::Tensor* t : ropes)
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kBFloat16 && t->sizes() == cos.sizes(),
                "decoder_stack: cos, sin (global and local) [N, D] bf16");
  TORCH_CHECK(cos.size(0) == h.size(0) && cos.size(1) == d, "decoder_stack: shapes");
}

// Where a layer's rows go in the cache, and the rotary tables they use.
struct RowsInCache {
  const BlockTables& bt;
  const LayerCache& cache;
  const int64_t* pos;
  const bf16* cos;
  const bf16* sin;
};

// Row by row: q rotated into `q`; k rotated and v stored into the cache at the row's position.
// q_in, k_in: the rows' q and k (Gemma's normed copies, else inside qkv).
void rotate_and_cache(const at::Tensor& qkv, const bf16* q_in, int64_t q_stride, const bf16* k_in,
                      int64_t k_stride, const RowsInCache& c, int64_t heads, int64_t kv_heads, int64_t d,
                      at::Tensor& q) {
  const int64_t n = qkv.size(0), qs = heads * d, kvs = kv_heads * d;
  const bf16* qkvp = qkv.data_ptr<bf16>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const bf16* v_in = qkvp + r * (qs + 2 * kvs) + qs + kvs;
      const bf16 *cs = c.cos + r * d, *sn = c.sin + r * d;
      rope_row(q_in + r * q_stride, cs, sn, heads, d, q.data_ptr<bf16>() + r * qs);
      alignas(64) bf16 k_rot[kMaxKV];
      rope_row(k_in + r * k_stride, cs, sn, kv_heads, d, k_rot);
      store_kv_row(c.cache, c.bt, r, c.pos[r], k_rot, v_in);
    }
  });
}

}  // namespace

// Turns the phase timers on or off; returns the milliseconds gathered since the last call.
std::vector<std::pair<std::string, double>> stack_profile(bool on) {
  std::vector<std::pair<std::string, double>> out;
  for (int i = 0; i < kPhases; ++i) out.emplace_back(kPhaseNames[i], g_phase_ms[i]), g_phase_ms[i] = 0.0;
  g_profiling = on;
  return out;
}

void StackSpec::check() const {
  const WeightIndex ix = weight_index(names);
  const size_t layers = windows.size();
  TORCH_CHECK(weights.size() == size_t(ix.per_layer) * layers, "StackSpec: ", ix.per_layer,
              " tensors per layer (one per name) for ", layers, " layers (one window each)");
  TORCH_CHECK(experts.size() == layers, "StackSpec: one ExpertSet per layer (empty: dense)");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && intermediate > 0, "StackSpec: heads, kv_heads, intermediate");
  for (size_t li = 0; li < layers; ++li) {
    const at::Tensor* W = &weights[li * ix.per_layer];
    TORCH_CHECK((W[ix.q_norm].numel() > 0) == qk_norm && (W[ix.k_norm].numel() > 0) == qk_norm,
                "StackSpec: layer ", li, (qk_norm ? " lacks q_norm / k_norm" : " has q/k norms its spec does not use"));
    TORCH_CHECK((W[ix.pre_ffn].numel() > 0) == sandwich_norms && (W[ix.post_ffn].numel() > 0) == sandwich_norms,
                "StackSpec: layer ", li, (sandwich_norms ? " lacks its feed-forward norms" : " has feed-forward norms its spec does not use"));
  }
}

// h [N, hidden] bf16, updated in place through every layer of `spec`. cos, sin [N, D] bf16 (the rows'
// positions; cos_local, sin_local: the sliding layers' tables); `cache` (StackCache) read and written through
// the rows' block tables (kernels.h: BlockTables).
void decoder_stack(at::Tensor h, const StackSpec& spec, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& cos_local, const at::Tensor& sin_local, const std::vector<at::Tensor>& cache,
                   bool kv_rotate, const at::Tensor& tables, const at::Tensor& table_of, const at::Tensor& positions,
                   const at::Tensor& aligns) {
  const WeightIndex ix = weight_index(spec.names);
  const StackCache kv = stack_cache(cache, kv_rotate, spec);
  const int64_t n = h.size(0), d = kv.head_dim();
  check_rows(h, {&cos, &sin, &cos_local, &sin_local}, d);
  const int64_t heads = spec.heads, kv_heads = spec.kv_heads, qs = heads * d, kvs = kv_heads * d;
  const int64_t offset = spec.unit_offset_norms ? kUnitOffsetNorm : spec.fp32_norm_product ? kFp32ProductNorm : kLlamaNorm;
  const bool sandwich = spec.sandwich_norms;
  const at::Tensor lengths = positions.to(at::kLong) + 1, ps = lengths - 1;
  const BlockTables bt = block_tables(tables, table_of, lengths, kv.k.size(1), kv.k.size(3));
  const int64_t* pp = ps.data_ptr<int64_t>();
  at::Tensor q = at::empty({n, heads, d}, h.options());
  for (int64_t li = 0; li < kv.k.size(0); ++li) {
    const at::Tensor* W = &spec.weights[li * ix.per_layer];
    const int64_t window = spec.windows[li];
    at::Tensor x, qkv, attn, y, gu, act, qn, kn;
    { Phase p{0}; x = rmsnorm(h, W[ix.ln1], spec.eps, offset); }
    { Phase p{1}; qkv = linear(x, W[ix.qkv], qs + 2 * kvs, maybe(W[ix.qkv_bias]), false); }
    if (spec.qk_norm) {
      Phase p{0};
      qn = rmsnorm(qkv.slice(1, 0, qs).contiguous().view({n * heads, d}), W[ix.q_norm], spec.eps, offset);
      kn = rmsnorm(qkv.slice(1, qs, qs + kvs).contiguous().view({n * kv_heads, d}), W[ix.k_norm], spec.eps, offset);
    }
    {
      Phase p{2};
      const LayerCache layer = kv.layer(li);
      const RowsInCache c{bt, layer, pp, (window ? cos_local : cos).data_ptr<bf16>(),
                          (window ? sin_local : sin).data_ptr<bf16>()};
      const bf16* qkvp = qkv.data_ptr<bf16>();
      if (spec.qk_norm) rotate_and_cache(qkv, qn.data_ptr<bf16>(), qs, kn.data_ptr<bf16>(), kvs, c, heads, kv_heads, d, q);
      else rotate_and_cache(qkv, qkvp, qs + 2 * kvs, qkvp + qs, qs + 2 * kvs, c, heads, kv_heads, d, q);
    }
    {
      Phase p{3};
      const bool quantized = kv.k_scale.numel() > 0;
      attn = attention(q, kv.k[li], kv.v[li], quantized ? kv.k_scale[li] : kv.k_scale,
                       quantized ? kv.v_scale[li] : kv.v_scale, kv.rotate, tables, table_of, lengths, aligns,
                       spec.scale, window, W[ix.sinks]);
    }
    { Phase p{1}; y = linear(attn.view({n, qs}), W[ix.o], h.size(1), maybe(W[ix.o_bias]), false); }
    if (sandwich) { Phase p{0}; y = rmsnorm(y, W[ix.ln2], spec.eps, offset); }
    { Phase p{4}; add_into(h, y); }
    { Phase p{0}; x = rmsnorm(h, sandwich ? W[ix.pre_ffn] : W[ix.ln2], spec.eps, offset); }
    if (spec.experts[li] && spec.experts[li]->size()) {  // a mixture of experts (moe.cpp)
      Phase p{1};
      y = moe_block(x, W[ix.router], *spec.experts[li]);
    } else {
      { Phase p{1}; gu = linear(x, W[ix.gate_up], 2 * spec.intermediate, c10::nullopt, false); }
      { Phase p{4}; act = spec.gelu_tanh ? gelu_tanh_mul(gu) : silu_mul(gu); }
      { Phase p{1}; y = linear(act, W[ix.down], h.size(1), c10::nullopt, false); }
    }
    if (sandwich) { Phase p{0}; y = rmsnorm(y, W[ix.post_ffn], spec.eps, offset); }
    { Phase p{4}; add_into(h, y); }
  }
}

}  // namespace mg
