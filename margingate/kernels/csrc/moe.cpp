// A mixture-of-experts block in one call, in the order models/moe.py states: the router's choice (softmax with
// the contract's exp, a stable top-k, the kept weights normalized left to right), then each chosen expert
// runs its rows (ascending) through the invariant linear (gate|up, SwiGLU, down), and the experts' outputs,
// each times its row's weight and rounded, are added into the row by expert index, ascending, one rounding
// each. The same bits as moe.py's loop over experts (a row's linear is a function of the row alone), without
// a Python step per expert; the compiled decoder stack (stack.cpp) calls it for its MoE layers. Under the
// int8 contract the chosen experts' panels of each matrix run in one parallel region, x quantized once: a
// decode step streams the experts' bytes without a fork and join per matrix (as llama.cpp's mul_mat_id does).
#include <ATen/Parallel.h>

#include <array>
#include <cmath>

#include "kernels.h"

namespace mg {
namespace {

struct Routes {  // moe.py's loop order: chosen experts ascending, each one's rows ascending
  std::vector<int64_t> experts;
  std::vector<at::Tensor> rows;                             // per chosen expert: its rows (int64)
  std::vector<std::vector<std::array<int64_t, 3>>> by_row;  // per row: (chosen index, place in its rows, slot)
};

Routes routes(const at::Tensor& chosen, int64_t num_experts) {
  const int64_t n = chosen.size(0), k = chosen.size(1);
  const int64_t* c = chosen.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(num_experts), slots(num_experts);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = c[r * k + j];
      TORCH_CHECK(e >= 0 && e < num_experts, "moe_experts: row ", r, " chose expert ", e, " of ", num_experts);
      TORCH_CHECK(rows[e].empty() || rows[e].back() != r, "moe_experts: row ", r, " chose expert ", e, " twice");
      rows[e].push_back(r);
      slots[e].push_back(j);
    }
  Routes out;
  out.by_row.resize(n);
  for (int64_t e = 0; e < num_experts; ++e) {
    if (rows[e].empty()) continue;  // an expert no row chose costs nothing
    const int64_t i = static_cast<int64_t>(out.experts.size());
    out.experts.push_back(e);
    out.rows.push_back(at::tensor(rows[e], at::kLong));
    for (size_t p = 0; p < rows[e].size(); ++p) out.by_row[rows[e][p]].push_back({i, int64_t(p), slots[e][p]});
  }
  return out;
}

// The gated activation of an expert's gate|up rows: SiLU, or gpt-oss's clamped SwiGLU (limit > 0).
at::Tensor gate(const at::Tensor& y, const ExpertSet& set) {
  return set.limit > 0 ? swiglu_clamped(y, set.alpha, set.limit) : silu_mul(y);
}

c10::optional<at::Tensor> bias_of(const std::vector<at::Tensor>& biases, int64_t e) {
  return biases.empty() ? c10::nullopt : c10::optional<at::Tensor>(biases[e]);
}

// Each chosen expert's rows through its MLP, a linear call at a time (packed bf16, or quantized under "exact").
std::vector<at::Tensor> expert_by_expert(const at::Tensor& x, const Routes& rt, const ExpertSet& set) {
  const bool fp32 = x.scalar_type() == at::kFloat;
  std::vector<at::Tensor> z;
  for (size_t i = 0; i < rt.experts.size(); ++i) {
    const int64_t e = rt.experts[i];
    const at::Tensor y = linear(x.index_select(0, rt.rows[i]), set.gate_up[e], set.n_gate_up,
                                bias_of(set.gate_up_bias, e), fp32);
    z.push_back(linear(gate(y, set), set.down[e], set.n_down, bias_of(set.down_bias, e), fp32));
  }
  return z;
}

// Matrix i's panels [p0, p1): a few jobs per thread, each inside one matrix, in matrix order.
struct Job {
  size_t i;
  int64_t p0, p1;
};

void run_matrices(const std::vector<const QuantMatrix*>& ms, const std::vector<Int8Input>& in,
                  const std::vector<std::vector<float>>& biases, std::vector<at::Tensor>& out) {
  int64_t total = 0;
  for (const QuantMatrix* m : ms) total += m->panels;
  const int64_t per = std::max<int64_t>(1, total / (8 * at::get_num_threads()));
  std::vector<Job> jobs;
  for (size_t i = 0; i < ms.size(); ++i)
    for (int64_t p0 = 0; p0 < ms[i]->panels; p0 += per) jobs.push_back({i, p0, std::min(ms[i]->panels, p0 + per)});
  const Int8Kernel kernel = int8_kernel(false);
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) int8_panels(in[jobs[j].i], *ms[jobs[j].i], biases[jobs[j].i], kernel,
                                                  out[jobs[j].i], jobs[j].p0, jobs[j].p1);
  });
}

// The same under the int8 contract, every chosen expert's panels of a matrix in one parallel region.
std::vector<at::Tensor> grouped_int8(const at::Tensor& x, const Routes& rt, const ExpertSet& set) {
  const size_t chosen = rt.experts.size();
  std::vector<const QuantMatrix*> gate_up, down;
  for (const int64_t e : rt.experts) gate_up.push_back(&set.gate_up_int8[e]), down.push_back(&set.down_int8[e]);
  const Int8Input all = int8_input(x, int8_blocks(gate_up));  // a row quantizes alike for every expert
  std::vector<Int8Input> in;
  std::vector<at::Tensor> y, z;
  std::vector<std::vector<float>> gate_up_bias, down_bias;  // per chosen expert, fp32 (empty: none)
  for (size_t i = 0; i < chosen; ++i) {
    const int64_t e = rt.experts[i];
    gate_up_bias.push_back(bias_fp32(bias_of(set.gate_up_bias, e), set.n_gate_up));
    down_bias.push_back(bias_fp32(bias_of(set.down_bias, e), set.n_down));
    in.push_back(all.select(rt.rows[i]));
    y.push_back(at::empty({rt.rows[i].size(0), set.n_gate_up}, x.options()));
    z.push_back(at::empty({rt.rows[i].size(0), set.n_down}, x.options()));
  }
  run_matrices(gate_up, in, gate_up_bias, y);
  at::parallel_for(0, static_cast<int64_t>(chosen), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) in[i] = int8_input(gate(y[i], set), int8_blocks({down[i]}));
  });
  run_matrices(down, in, down_bias, z);
  return z;
}

// out[r] = sum over r's experts, ascending, of z * w: in bf16 each product and each sum rounded (torch's
// bf16 mul and add), in fp32 each one fp32 step; from +0, as moe.py's zeros.
void combine(const Routes& rt, const std::vector<at::Tensor>& z, const at::Tensor& weights, at::Tensor& out) {
  const int64_t h = out.size(1), k = weights.size(1);
  const bool fp32 = out.scalar_type() == at::kFloat;
  at::parallel_for(0, out.size(0), 4, [&](int64_t r0, int64_t r1) {
    std::vector<float> acc(h);
    for (int64_t r = r0; r < r1; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (const auto& [i, p, slot] : rt.by_row[r]) {
        if (fp32) {
          const float w = weights.data_ptr<float>()[r * k + slot], *zr = z[i].data_ptr<float>() + p * h;
          for (int64_t j = 0; j < h; ++j) acc[j] = acc[j] + zr[j] * w;
          continue;
        }
        const float w = static_cast<float>(weights.data_ptr<bf16>()[r * k + slot]);
        const bf16* zr = z[i].data_ptr<bf16>() + p * h;
        int64_t j = 0;
        for (; j + 8 <= h; j += 8) {
          const __m256 t = round_bf16(_mm256_mul_ps(load8(zr + j), _mm256_set1_ps(w)));
          _mm256_storeu_ps(acc.data() + j, round_bf16(_mm256_add_ps(_mm256_loadu_ps(acc.data() + j), t)));
        }
        for (; j < h; ++j) acc[j] = rnd(acc[j] + rnd(static_cast<float>(zr[j]) * w));
      }
      if (fp32) std::copy(acc.begin(), acc.end(), out.data_ptr<float>() + r * h);
      else for (int64_t j = 0; j < h; ++j) out.data_ptr<bf16>()[r * h + j] = static_cast<bf16>(acc[j]);  // exact
    }
  });
}

// Every matrix of the set parsed, if all are quantized under the int8 contract; else none.
std::vector<QuantMatrix> int8_matrices(const std::vector<at::Tensor>& ws, int64_t n, int64_t k) {
  std::vector<QuantMatrix> ms;
  for (size_t e = 0; e < ws.size(); ++e) {
    if (!is_quantized(ws[e])) return {};
    ms.push_back(quant_matrix(ws[e]));
    if (!ms.back().int8) return {};
    TORCH_CHECK(ms.back().n == n && ms.back().k == k, "ExpertSet: expert ", e, "'s matrix is [", ms.back().n, ", ",
                ms.back().k, "], not [", n, ", ", k, "]");
  }
  return ms;
}

// One row's route (moe.py, steps 2-4): p[j] = fp32(exp(l[j] - max) / sum), a stable top-k by p descending
// (ties to the lower expert, a NaN first as torch.sort puts it), the kept weights divided by their sum
// added left to right.
void route_row(const float* e, double sum, int64_t n, int64_t k, bool normalize, int64_t* experts, float* weights) {
  std::vector<float> p(n);
  std::vector<int64_t> order(n);
  for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>(double(e[j]) / sum), order[j] = j;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::isnan(p[a]) ? !std::isnan(p[b]) : !std::isnan(p[b]) && p[a] > p[b];
  });
  float total = p[order[0]];
  for (int64_t j = 1; j < k; ++j) total = total + p[order[j]];
  for (int64_t j = 0; j < k; ++j) experts[j] = order[j], weights[j] = normalize ? p[order[j]] / total : p[order[j]];
}

// gpt-oss's route of one row: a stable top-k of the logits themselves (ties to the lower expert, a NaN first),
// then the softmax of the k kept: e_j = exp(l_j - l_top) with the contract's exp, their sum in rank order (fp32),
// w_j = e_j / sum.
void route_topk_first(const float* l, int64_t n, int64_t k, int64_t* experts, float* weights) {
  std::vector<int64_t> order(n);
  for (int64_t j = 0; j < n; ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::isnan(l[a]) ? !std::isnan(l[b]) : !std::isnan(l[b]) && l[a] > l[b];
  });
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) weights[j] = exp1(l[order[j]] - l[order[0]]), sum = sum + weights[j];
  for (int64_t j = 0; j < k; ++j) experts[j] = order[j], weights[j] = weights[j] / sum;
}

}  // namespace

ExpertSet::ExpertSet(std::vector<at::Tensor> gate_up_, std::vector<at::Tensor> down_, int64_t n_gate_up_,
                     int64_t n_down_, int64_t top_k_, bool normalize_)
    : gate_up(std::move(gate_up_)), down(std::move(down_)), n_gate_up(n_gate_up_), n_down(n_down_), top_k(top_k_),
      normalize(normalize_) {
  TORCH_CHECK(gate_up.size() == down.size(), "ExpertSet: one gate|up and one down per expert");
  TORCH_CHECK(gate_up.empty() ? top_k == 0 : top_k >= 1 && top_k <= size(), "ExpertSet: top-k ", top_k, " of ",
              size(), " experts");
  TORCH_CHECK(n_gate_up % 2 == 0, "ExpertSet: gate|up has an even number of outputs");
  for (const at::Tensor& w : gate_up) check_cpu(w, "an expert's gate|up");
  for (const at::Tensor& w : down) check_cpu(w, "an expert's down");
  gate_up_int8 = int8_matrices(gate_up, n_gate_up, n_down);  // gate|up takes the hidden width down gives
  down_int8 = int8_matrices(down, n_down, n_gate_up / 2);
  if (gate_up_int8.empty() || down_int8.empty()) gate_up_int8.clear(), down_int8.clear();
}

void ExpertSet::set_gpt_oss(std::vector<at::Tensor> gate_up_bias_, std::vector<at::Tensor> down_bias_,
                            at::Tensor router_bias_, double alpha_, double limit_) {
  TORCH_CHECK(gate_up_bias_.size() == gate_up.size() && down_bias_.size() == down.size(),
              "ExpertSet: one gate|up bias and one down bias per expert");
  TORCH_CHECK(router_bias_.numel() == size(), "ExpertSet: one router bias per expert");
  TORCH_CHECK(limit_ > 0, "ExpertSet: the SwiGLU's limit must be > 0");
  for (size_t e = 0; e < gate_up.size(); ++e)
    TORCH_CHECK(gate_up_bias_[e].numel() == n_gate_up && down_bias_[e].numel() == n_down, "ExpertSet: expert ", e,
                "'s biases: ", n_gate_up, " and ", n_down, " values");
  gate_up_bias = std::move(gate_up_bias_), down_bias = std::move(down_bias_), router_bias = router_bias_.contiguous();
  alpha = alpha_, limit = limit_, topk_first = true;
}

std::vector<at::Tensor> moe_route(const at::Tensor& logits, int64_t k, bool normalize, bool topk_first) {
  check_cpu(logits, "router logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "moe_route: logits [N, experts] fp32");
  const int64_t n = logits.size(0), e = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= e, "moe_route: top-k ", k, " of ", e, " experts");
  if (topk_first) {
    at::Tensor experts = at::empty({n, k}, at::kLong), weights = at::empty({n, k}, at::kFloat);
    for (int64_t r = 0; r < n; ++r)
      route_topk_first(logits.data_ptr<float>() + r * e, e, k, experts.data_ptr<int64_t>() + r * k,
                       weights.data_ptr<float>() + r * k);
    return {experts, weights};
  }
  const at::Tensor top = n ? std::get<0>(logits.max(1)).contiguous() : at::empty({0}, logits.options());
  const at::Tensor ex = exp_shifted(logits, top), sums = sum_exp_rows(logits);
  at::Tensor experts = at::empty({n, k}, at::kLong), weights = at::empty({n, k}, at::kFloat);
  for (int64_t r = 0; r < n; ++r)
    route_row(ex.data_ptr<float>() + r * e, sums.data_ptr<double>()[r], e, k, normalize,
              experts.data_ptr<int64_t>() + r * k, weights.data_ptr<float>() + r * k);
  return {experts, weights};
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights, const ExpertSet& set) {
  check_cpu(x, "x");
  check_cpu(chosen, "chosen");
  check_cpu(weights, "weights");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "moe_experts: x [N, hidden] bf16 or fp32");
  TORCH_CHECK(chosen.dim() == 2 && chosen.size(0) == x.size(0) && chosen.scalar_type() == at::kLong,
              "moe_experts: chosen [N, k] int64");
  TORCH_CHECK(weights.sizes() == chosen.sizes() && weights.scalar_type() == x.scalar_type(),
              "moe_experts: weights [N, k] in x's dtype");
  TORCH_CHECK(set.size() > 0 && set.n_down == x.size(1), "moe_experts: experts that take and give x's width");
  const Routes rt = routes(chosen, set.size());
  const bool grouped = !rt.experts.empty() && !set.gate_up_int8.empty();
  const std::vector<at::Tensor> z = grouped ? grouped_int8(x, rt, set) : expert_by_expert(x, rt, set);
  at::Tensor out = at::empty_like(x);
  combine(rt, z, weights, out);
  return out;
}

at::Tensor moe_block(const at::Tensor& x, const at::Tensor& router, const ExpertSet& set) {
  const c10::optional<at::Tensor> bias = set.router_bias.defined() ? c10::optional<at::Tensor>(set.router_bias) : c10::nullopt;
  const at::Tensor logits = linear(x, router, set.size(), bias, x.scalar_type() == at::kFloat);
  const std::vector<at::Tensor> r = moe_route(logits.to(at::kFloat).contiguous(), set.top_k, set.normalize, set.topk_first);
  return moe_experts(x, r[0], r[1].to(x.scalar_type()), set);
}

}  // namespace mg
