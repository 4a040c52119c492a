// The kernels as tensor operations (the baseline translation units: AVX2 + FMA), and the tensor
// helpers they share. Orders: contract.h.
#pragma once

#include <torch/extension.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "contract.h"
#include "isa.h"

namespace mg {

using bf16 = at::BFloat16;

// linear.cpp: y = x W^T + b with W packed (packing.py), n its output features; the contract's order
// on the path chosen at load (AMX, AVX-512 or AVX2), or on the scalar reference.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  bool fp32_out);
at::Tensor linear_reference(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const c10::optional<at::Tensor>& bias, bool fp32_out);
at::Tensor linear_on(Path path, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     const c10::optional<at::Tensor>& bias, bool fp32_out);  // on this path, unproven

// linear_paths.cpp: one table of every path, bf16 and int8 (isa.h): the path each family runs (built, on
// this CPU, proven at load), and one report of every path's proof
std::string path_name(Path p);
Path linear_path_for(bool fp32_x);  // the bf16 family's
void run_path(Path p, const LinearTask& t);
// every path, fastest first within its family: [family ("bf16", "int8"), name, status, detail], status
// "passed", "failed" (detail: the first difference; the path is refused), "not built" or "cpu lacks it"
std::vector<std::vector<std::string>> path_proofs();
std::string path_in_use(const std::string& family);  // bf16 (for bf16 x) or int8; an error where none passed
void set_path(const std::string& name);  // run its family on this path (an error where it cannot)

// linear_proof.cpp: "" when `run` gives the reference's bits on the fixed cases, else the first difference
using LinearRun = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                           const c10::optional<at::Tensor>& bias)>;
std::string prove_linear(const std::string& path, const LinearRun& run, bool fp32_x);

// quant.cpp: a quantized weight (one uint8 tensor, kernels/quant_pack.py) as its parts (isa.h)
struct QuantMatrix {
  int64_t n, k, panels;
  std::vector<QuantPart> parts;
  bool int8 = false;  // the integer-exact contract (magic "MGI8"; contract.h, 5), else the bf16 one
  std::pair<const QuantPart*, int64_t> locate(int64_t panel) const;  // its part, and its place there
};
bool is_quantized(const at::Tensor& w);
QuantMatrix quant_matrix(const at::Tensor& blob);  // checked: an error names what is wrong
void dequant_panel_reference(const QuantMatrix& m, int64_t panel, uint16_t* dst);
void dequant_panel(Path p, const QuantMatrix& m, int64_t panel, uint16_t* dst);  // linear_paths.cpp: p's ISA
bool run_quant_directly(Path p, const LinearTask& t, const QuantMatrix& m);  // linear_paths.cpp
at::Tensor dequantize_packed(const at::Tensor& blob);  // [panels, k / 2, 16, 2] bf16, the reference
at::Tensor dequantize_rows(const at::Tensor& blob, const at::Tensor& index);

// linear_int8.cpp: the integer-exact contract (contract.h, 5) on the best proven path, or the scalar reference
at::Tensor linear_int8(const at::Tensor& x, const QuantMatrix& m, const std::vector<float>& bias, bool reference);
std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x, int64_t block);  // q, scale, sum16
// The same linear in halves, for a caller that runs many matrices in one parallel region (moe.cpp): x's
// rows quantized once for each activation block the matrices use, then panels [p0, p1) of every row.
struct Int8Acts {  // x's rows for one block size; owns what an Int8Rows points at
  at::Tensor q, scale, sum16;
  Int8Rows rows(int64_t r0, int64_t m) const;
};
struct Int8Input {
  std::vector<int64_t> blocks;
  std::vector<Int8Acts> acts;  // one per block
  Int8Input select(const at::Tensor& index) const;  // those rows, in that order
};
using Int8Kernel = void (*)(const Int8Rows&, const QuantPart&, int64_t, float*, int64_t);
std::vector<int64_t> int8_blocks(const std::vector<const QuantMatrix*>& ms);  // the blocks their parts use
Int8Input int8_input(const at::Tensor& x, const std::vector<int64_t>& blocks);
Int8Kernel int8_kernel(bool reference);  // linear_paths.cpp: the proven path in use, or the scalar reference
at::Tensor linear_int8_on(Int8Kernel kernel, const at::Tensor& x, const QuantMatrix& m,
                          const std::vector<float>& bias);  // with this kernel, unproven
void int8_panels(const Int8Input& in, const QuantMatrix& m, const std::vector<float>& bias, Int8Kernel kernel,
                 at::Tensor& out, int64_t p0, int64_t p1);  // under its own FTZ | DAZ
// linear_proof.cpp: "" when run gives the int8 scalar reference's bits on the fixed cases, else the first difference
std::string prove_int8(const std::string& path,
                       const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>& run);
// linear.cpp: the bias as fp32 (empty: none), and bias plus the output rounding of acc's rows and columns
std::vector<float> bias_fp32(const c10::optional<at::Tensor>& bias, int64_t n);
void linear_epilogue(const float* acc, int64_t ldacc, const std::vector<float>& bias, at::Tensor& out, int64_t r0,
                     int64_t rows, int64_t c0, int64_t c1);

// moe.cpp: a mixture-of-experts layer (models/moe.py states the order): its experts, parsed once
struct ExpertSet {
  std::vector<at::Tensor> gate_up, down;  // per expert, packed or quantized; empty: a dense layer
  int64_t n_gate_up, n_down, top_k;
  bool normalize;
  std::vector<QuantMatrix> gate_up_int8, down_int8;  // every matrix, where all are under the int8 contract
  // gpt-oss (set_gpt_oss): biases (per expert; the router's), the top-k of the logits before their softmax, and
  // the clamped SwiGLU (limit > 0) in place of SiLU
  std::vector<at::Tensor> gate_up_bias, down_bias;
  at::Tensor router_bias;
  bool topk_first = false;
  double alpha = 0.0, limit = 0.0;
  ExpertSet(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t n_gate_up, int64_t n_down,
            int64_t top_k, bool normalize);
  void set_gpt_oss(std::vector<at::Tensor> gate_up_bias, std::vector<at::Tensor> down_bias, at::Tensor router_bias,
                   double alpha, double limit);
  int64_t size() const { return int64_t(gate_up.size()); }
};
// experts, fp32 weights; topk_first: gpt-oss's order (the top-k of the logits, then their softmax)
std::vector<at::Tensor> moe_route(const at::Tensor& logits, int64_t k, bool normalize, bool topk_first);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights, const ExpertSet& set);
at::Tensor moe_block(const at::Tensor& x, const at::Tensor& router, const ExpertSet& set);  // route, then experts

// paged_kv.cpp: the KV cache in blocks (models/kv_cache.py's KVPool). One layer's K or V is [blocks, Hkv, B, C]:
// bf16 or fp32 values (C = D), int8 codes (C = D) or int4 codes two to a byte (uint8, C = D / 2); a quantized
// cache has fp32 scales [blocks, Hkv, B, D / G], one per group of G values, and stores its values rotated where
// `rotate` (contract.h, 6). Position p of a forward's row r lies in row p % B of block tables[table_of[r]][p / B]
// (tables [T, W], table_of [N], int64).
struct BlockTables {
  const int64_t* tables;
  const int64_t* table_of;
  int64_t width, block;
  int64_t block_of(int64_t r, int64_t p) const { return tables[table_of[r] * width + p / block]; }
};
// The tables, checked: every block that rows of these `lengths` (positions + 1) reach lies in [0, num_blocks).
BlockTables block_tables(const at::Tensor& tables, const at::Tensor& table_of, const at::Tensor& lengths,
                         int64_t num_blocks, int64_t block);
// One layer's cache as the kernels read and write it (scales null unless quantized).
struct LayerCache {
  at::ScalarType dtype;  // kBFloat16, kFloat, kChar (int8 codes), kByte (int4 codes, two a byte)
  void *k, *v;
  float *k_scale, *v_scale;
  int64_t kv_heads, block, d, group;  // group: values per scale (quantized), else d
  bool rotate;
  bool quantized() const { return dtype == at::kChar || dtype == at::kByte; }
  int64_t width() const { return dtype == at::kByte ? d / 2 : d; }  // stored elements per (position, head)
  int64_t groups() const { return d / group; }
  int64_t row_of(int64_t blk, int64_t head, int64_t p) const { return (blk * kv_heads + head) * block + p % block; }
};
LayerCache layer_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_scale, const at::Tensor& v_scale,
                       bool rotate);
// Row r's K and V (kv_heads x d bf16 each) into position pos; quantized: each head by itself (contract.h, 6).
void store_kv_row(const LayerCache& c, const BlockTables& bt, int64_t r, int64_t pos, const bf16* k, const bf16* v);
void kv_write(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
              bool rotate, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
              const at::Tensor& table_of, const at::Tensor& positions);

// attention.cpp
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& k_scale, const at::Tensor& v_scale, bool rotate, const at::Tensor& tables,
                     const at::Tensor& table_of, const at::Tensor& lengths, const at::Tensor& aligns, double scale,
                     int64_t window, const at::Tensor& sinks);  // sinks: empty, or one fp32 logit per query head

// rowwise.cpp
// mode: how the normed row meets the weight (layer_spec.py's norm_mode)
constexpr int64_t kLlamaNorm = 0, kUnitOffsetNorm = 1, kFp32ProductNorm = 2;
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t mode);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
at::Tensor gelu_erf(const at::Tensor& x);
at::Tensor swiglu_clamped(const at::Tensor& gate_up, double alpha, double limit);  // gpt-oss's experts
void rope_row(const bf16* x, const bf16* cs, const bf16* sn, int64_t heads, int64_t d, bf16* out);
void add_into(at::Tensor& h, const at::Tensor& y);

// logits.cpp: per-row log-sum-exp and exp(x - shift) of fp32 logits, in a fixed order
at::Tensor logsumexp_rows(const at::Tensor& x);
at::Tensor exp_shifted(const at::Tensor& x, const at::Tensor& shift);
at::Tensor sum_exp_rows(const at::Tensor& x);
std::vector<int64_t> argmax_rows(const at::Tensor& x);
at::Tensor philox4x32(const at::Tensor& counter, const at::Tensor& key);
void add_gumbel_(at::Tensor& rows, int64_t seed, int64_t first_position);

// stack.cpp: a model's decoder stack, described once (kernels/stack.py's stack_spec builds it)
struct StackSpec {
  // the layer (kernels/layer_spec.py's LayerSpec): (1 + w) norms; q/k normed per head before RoPE; the
  // attention and MLP outputs normed before their adds (post_attention_layernorm then norms the attention's
  // output, pre_feedforward_layernorm the MLP's input); GELU-tanh instead of SiLU
  bool unit_offset_norms = false, qk_norm = false, sandwich_norms = false, gelu_tanh = false;
  bool fp32_norm_product = false;  // the normed row times the weight in fp32, rounded once (gpt-oss)
  int64_t heads = 0, kv_heads = 0, intermediate = 0;
  double eps = 0.0, scale = 0.0;
  std::vector<int64_t> windows;  // per layer: 0, or its sliding window (those layers rotate by the local tables)
  std::vector<at::Tensor> weights;  // per layer, one tensor per name (empty: absent)
  std::vector<std::string> names;
  std::vector<std::shared_ptr<ExpertSet>> experts;  // per layer (empty set: dense)
  void check() const;  // counts and shapes agree (a named error otherwise)
};
void decoder_stack(at::Tensor h, const StackSpec& spec, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& cos_local, const at::Tensor& sin_local, const std::vector<at::Tensor>& cache,
                   bool kv_rotate, const at::Tensor& tables, const at::Tensor& table_of, const at::Tensor& positions,
                   const at::Tensor& aligns);
std::vector<std::pair<std::string, double>> stack_profile(bool on);

namespace {

inline const uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline __m256 load8(const uint16_t* p) { return bf16x8(p); }
inline __m256 load8(const bf16* p) { return bf16x8(reinterpret_cast<const uint16_t*>(p)); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(bf16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits8(v)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline float rnd(float v) { return static_cast<float>(static_cast<bf16>(v)); }  // through bf16

}  // namespace
}  // namespace mg
