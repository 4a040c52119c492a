// A mixture-of-experts block's experts in one call, in the order models/moe.py states: each chosen expert
// runs its rows (ascending) through the invariant linear (gate|up, SwiGLU, down), and the experts' outputs,
// each times its row's weight and rounded, are added into the row by expert index, ascending, one rounding
// each. The same bits as moe.py's loop over experts (a row's linear is a function of the row alone), without
// a Python step per expert. Under the int8 contract the chosen experts' panels of each matrix run in one
// parallel region, x quantized once: a decode step streams the experts' bytes without a fork and join per
// matrix (as llama.cpp's mul_mat_id does).
#include <ATen/Parallel.h>

#include <array>

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

// Each chosen expert's rows through its MLP, a linear call at a time (packed bf16, or quantized under "exact").
std::vector<at::Tensor> expert_by_expert(const at::Tensor& x, const Routes& rt, const std::vector<at::Tensor>& gate_up,
                                         const std::vector<at::Tensor>& down, int64_t n_gate_up, int64_t n_down) {
  const bool fp32 = x.scalar_type() == at::kFloat;
  std::vector<at::Tensor> z;
  for (size_t i = 0; i < rt.experts.size(); ++i) {
    const int64_t e = rt.experts[i];
    const at::Tensor y = linear(x.index_select(0, rt.rows[i]), gate_up[e], n_gate_up, c10::nullopt, fp32);
    z.push_back(linear(silu_mul(y), down[e], n_down, c10::nullopt, fp32));
  }
  return z;
}

// Matrix i's panels [p0, p1): a few jobs per thread, each inside one matrix, in matrix order.
struct Job {
  size_t i;
  int64_t p0, p1;
};

void run_matrices(const std::vector<QuantMatrix>& ms, const std::vector<Int8Input>& in, std::vector<at::Tensor>& out) {
  int64_t total = 0;
  for (const QuantMatrix& m : ms) total += m.panels;
  const int64_t per = std::max<int64_t>(1, total / (8 * at::get_num_threads()));
  std::vector<Job> jobs;
  for (size_t i = 0; i < ms.size(); ++i)
    for (int64_t p0 = 0; p0 < ms[i].panels; p0 += per) jobs.push_back({i, p0, std::min(ms[i].panels, p0 + per)});
  const Int8Kernel kernel = int8_kernel(false);
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) int8_panels(in[jobs[j].i], ms[jobs[j].i], {}, kernel, out[jobs[j].i], jobs[j].p0,
                                                  jobs[j].p1);
  });
}

std::vector<int64_t> blocks_of(const std::vector<QuantMatrix>& ms) {
  std::vector<int64_t> blocks;
  for (const QuantMatrix& m : ms)
    for (const int64_t b : int8_blocks(m))
      if (std::find(blocks.begin(), blocks.end(), b) == blocks.end()) blocks.push_back(b);
  return blocks;
}

// The same under the int8 contract, every chosen expert's panels of a matrix in one parallel region.
std::vector<at::Tensor> grouped_int8(const at::Tensor& x, const Routes& rt, const std::vector<QuantMatrix>& gate_up,
                                     const std::vector<QuantMatrix>& down) {
  const size_t chosen = rt.experts.size();
  const Int8Input all = int8_input(x, blocks_of(gate_up));  // a row quantizes alike for every expert
  std::vector<Int8Input> in;
  std::vector<at::Tensor> y, z;
  for (size_t i = 0; i < chosen; ++i) {
    in.push_back(all.select(rt.rows[i]));
    y.push_back(at::empty({rt.rows[i].size(0), gate_up[i].n}, x.options()));
    z.push_back(at::empty({rt.rows[i].size(0), down[i].n}, x.options()));
  }
  run_matrices(gate_up, in, y);
  at::parallel_for(0, static_cast<int64_t>(chosen), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) in[i] = int8_input(silu_mul(y[i]), int8_blocks(down[i]));
  });
  run_matrices(down, in, z);
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

// The quantized matrices of the chosen experts, if every one is under the int8 contract; else none.
std::vector<QuantMatrix> int8_matrices(const Routes& rt, const std::vector<at::Tensor>& ws, int64_t n, int64_t k) {
  std::vector<QuantMatrix> ms;
  for (const int64_t e : rt.experts) {
    if (!is_quantized(ws[e])) return {};
    ms.push_back(quant_matrix(ws[e]));
    if (!ms.back().int8) return {};
    TORCH_CHECK(ms.back().n == n && ms.back().k == k, "moe_experts: expert ", e, "'s matrix is [", ms.back().n, ", ",
                ms.back().k, "], not [", n, ", ", k, "]");
  }
  return ms;
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                       const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, int64_t n_gate_up,
                       int64_t n_down) {
  check_cpu(x, "x");
  check_cpu(chosen, "chosen");
  check_cpu(weights, "weights");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "moe_experts: x [N, hidden] bf16 or fp32");
  TORCH_CHECK(chosen.dim() == 2 && chosen.size(0) == x.size(0) && chosen.scalar_type() == at::kLong,
              "moe_experts: chosen [N, k] int64");
  TORCH_CHECK(weights.sizes() == chosen.sizes() && weights.scalar_type() == x.scalar_type(),
              "moe_experts: weights [N, k] in x's dtype");
  TORCH_CHECK(gate_up.size() == down.size() && n_gate_up % 2 == 0 && n_down == x.size(1),
              "moe_experts: one gate|up and one down per expert, down back to x's width");
  const Routes rt = routes(chosen, static_cast<int64_t>(gate_up.size()));
  const std::vector<QuantMatrix> gu = int8_matrices(rt, gate_up, n_gate_up, x.size(1));
  const std::vector<QuantMatrix> dn = int8_matrices(rt, down, n_down, n_gate_up / 2);
  const bool grouped = !rt.experts.empty() && gu.size() == rt.experts.size() && dn.size() == rt.experts.size();
  const std::vector<at::Tensor> z = grouped ? grouped_int8(x, rt, gu, dn)
                                            : expert_by_expert(x, rt, gate_up, down, n_gate_up, n_down);
  at::Tensor out = at::empty_like(x);
  combine(rt, z, weights, out);
  return out;
}

}  // namespace mg
