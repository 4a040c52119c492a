// The linear: checks, the activations laid out for the path (linear_paths.cpp picks it), the
// threads' split (blocks of output elements, never k), the weights (packed bf16, or quantized and
// dequantized panel by panel: quant.cpp) and the epilogue (bias, rounding). The order: contract.h, 1.
#include <ATen/Parallel.h>

#include "isa.h"
#include "kernels.h"

namespace mg {
namespace {

struct Shape {
  int64_t m, k, kp, n, panels;
  c10::optional<QuantMatrix> quant;  // a quantized weight, as parsed once for the call
};

Shape check_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, bool fp32_out) {
  check_cpu(x, "x");
  check_cpu(w, "weight");
  TORCH_CHECK(x.dim() == 2, "linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "linear: x bf16 or fp32");
  TORCH_CHECK((x.scalar_type() == at::kFloat) == fp32_out, "linear: the result has x's dtype");
  const int64_t k = x.size(1), kp = round_up(k, kBlock);
  if (is_quantized(w)) {
    const QuantMatrix q = quant_matrix(w);
    TORCH_CHECK(q.k == k && q.n == n, "linear: x has ", k, " features and ", n, " outputs are asked for; the ",
                "quantized weight is [", q.n, ", ", q.k, "]");
    return {x.size(0), k, kp, n, q.panels, q};
  }
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 4 && w.size(2) == kPanel && w.size(3) == 2,
              "linear: weight must be packed bf16 [panels, K/2, 16, 2] (kernels.packing.pack) or quantized "
              "(kernels.quant_pack)");
  TORCH_CHECK(w.size(1) * 2 == kp, "linear: x has ", k, " features, the packed weight ", w.size(1) * 2);
  TORCH_CHECK(n > (w.size(0) - 1) * kPanel && n <= w.size(0) * kPanel,
              "linear: ", n, " outputs do not fit ", w.size(0), " panels");
  return {x.size(0), k, kp, n, w.size(0), c10::nullopt};
}

// x as the path reads it, zero-padded in k: fp32 rows (FMA paths, exact widening), bf16 rows
// (AMX: a multiple of 16 rows), or bf16 rows regrouped by chain in tiles of kBf16Rows rows
// (AVX512-BF16: per block of 32 k, k = 32b + 4s + t, the words (lo t=2 | hi t=0) for s = 0..7, then
// (lo t=3 | hi t=1); a block's 32 values at `step` apart from the next block's). Moves bits only.
template <typename X>
void lay_out_row(const X* src, int64_t k, int64_t kp, Path path, int64_t step, void* dst) {
  if (!reads_bf16(path)) {
    float* d = static_cast<float*>(dst);
    for (int64_t j = 0; j < kp; ++j) d[j] = j < k ? static_cast<float>(src[j]) : 0.0f;
    return;
  }
  auto at_k = [&](int64_t j) { return j < k ? static_cast<bf16>(src[j]) : bf16(0.0f); };
  bf16* d = static_cast<bf16*>(dst);
  if (path == Path::kAmx) {
    for (int64_t j = 0; j < kp; ++j) d[j] = at_k(j);
    return;
  }
  for (int64_t b = 0; b < kp; b += kBlock, d += step)
    for (int64_t c = 0; c < 2; ++c)      // the even chain's words, then the odd one's
      for (int64_t s = 0; s < 8; ++s) {  // lo: step 2s + 1, hi: step 2s
        d[16 * c + 2 * s] = at_k(b + 4 * s + 2 + c);
        d[16 * c + 2 * s + 1] = at_k(b + 4 * s + c);
      }
}

at::Tensor lay_out(const at::Tensor& x, const Shape& s, Path path) {
  const bool bf16_rows = reads_bf16(path), tiled = path == Path::kAvx512Bf16;
  const int64_t rows = path == Path::kAmx ? round_up(s.m, 16) : s.m;
  const auto options = x.options().dtype(bf16_rows ? at::kBFloat16 : at::kFloat);
  at::Tensor out = rows > s.m ? at::zeros({rows, s.kp}, options) : at::empty({rows, s.kp}, options);
  const int64_t size = out.element_size();
  at::parallel_for(0, s.m, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t tile = i / kBf16Rows * kBf16Rows, r = std::min(kBf16Rows, s.m - tile);
      const int64_t at = tiled ? tile * s.kp + (i - tile) * kBlock : i * s.kp;  // elements
      const int64_t step = r * kBlock;  // tiled: from one block of the row to its next
      char* dst = static_cast<char*>(out.data_ptr()) + at * size;
      if (x.scalar_type() == at::kFloat) lay_out_row(x.data_ptr<float>() + i * s.k, s.k, s.kp, path, step, dst);
      else lay_out_row(x.data_ptr<bf16>() + i * s.k, s.k, s.kp, path, step, dst);
    }
  });
  return out;
}

}  // namespace

std::vector<float> bias_fp32(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return {};
  check_cpu(*bias, "bias");
  TORCH_CHECK(bias->numel() == n, "linear: bias size");
  at::Tensor b = bias->to(at::kFloat).contiguous();
  return std::vector<float>(b.data_ptr<float>(), b.data_ptr<float>() + n);
}

// Bias (fp32, after the sum), then the output rounding, for rows [r0, r0 + rows) and columns
// [c0, c1) of out; acc holds those rows from its row 0 and those columns from its column 0. Under FTZ | DAZ too.
void linear_epilogue(const float* acc, int64_t ldacc, const std::vector<float>& bias, at::Tensor& out, int64_t r0,
                     int64_t rows, int64_t c0, int64_t c1) {
  const int64_t n = out.size(1), w = c1 - c0;
  const float* b = bias.empty() ? nullptr : bias.data() + c0;
  for (int64_t i = 0; i < rows; ++i) {
    const float* a = acc + i * ldacc;
    if (out.scalar_type() == at::kFloat) {
      float* o = out.data_ptr<float>() + (r0 + i) * n + c0;
      for (int64_t j = 0; j < w; ++j) o[j] = b ? a[j] + b[j] : a[j];
      continue;
    }
    bf16* o = out.data_ptr<bf16>() + (r0 + i) * n + c0;
    int64_t j = 0;
    for (; j + 8 <= w; j += 8) {
      __m256 v = _mm256_loadu_ps(a + j);
      if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + j));
      store8(o + j, v);
    }
    for (; j < w; ++j) o[j] = static_cast<bf16>(b ? a[j] + b[j] : a[j]);
  }
}

namespace {

// The threads' split: jobs of `rows` rows x `panels` panels, each a block of output elements (never
// a range of k, so no split changes a bit). A job's x rows stay in L2 while its panels stream past;
// its accumulator (rows x panels x 16 fp32) stays in L2 too.
struct Split {
  int64_t rows, panels, row_jobs, panel_jobs;
};

constexpr int64_t kRowBlock = 192;  // a multiple of every path's row tile (AMX: 16 and 32, FMA: 4, BF16: kBf16Rows)

Split split_for(const Shape& s, int64_t threads) {
  const int64_t row_jobs = (s.m + kRowBlock - 1) / kRowBlock;
  const int64_t rows = row_jobs == 1 ? s.m : round_up((s.m + row_jobs - 1) / row_jobs, 16);
  const int64_t least = std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(1, rows * s.kp) / kPanel);
  const int64_t most = std::max<int64_t>(2, (int64_t(1) << 16) / (round_up(rows, 16) * kPanel));
  const int64_t even = (s.panels * row_jobs + 4 * threads - 1) / (4 * threads);  // ~4 jobs a thread
  const int64_t panels = round_up(std::min(std::max(even, least), most), 2);
  return {rows, panels, row_jobs, (s.panels + panels - 1) / panels};
}

// Panels [t.p0, t.p1) of a job on the path: straight from the packed weight; from a quantized one
// dequantized as the kernel reads it (AVX512-BF16: run_quant_directly); else dequantized a few panels
// at a time into a scratch (in L2) that the path then reads like a packed weight. The dequantized
// panels hold the packed weight's bits, so the sums are the same.
void run_panels(Path path, const LinearTask& t, const QuantMatrix* q) {
  if (!q) return run_path(path, t);
  if (run_quant_directly(path, t, *q)) return;
  static thread_local std::vector<uint16_t> scratch;
  const int64_t chunk = std::max<int64_t>(2, (int64_t(1) << 17) / (t.kp * kPanel));  // 256 KB of bf16
  scratch.resize(chunk * t.kp * kPanel);
  for (int64_t c0 = t.p0; c0 < t.p1; c0 += chunk) {
    const int64_t c1 = std::min(t.p1, c0 + chunk);
    for (int64_t p = c0; p < c1; ++p) dequant_panel(path, *q, p, scratch.data() + (p - c0) * t.kp * kPanel);
    LinearTask s = t;
    s.w = scratch.data(), s.p0 = 0, s.p1 = c1 - c0, s.acc = t.acc + (c0 - t.p0) * kPanel;
    run_path(path, s);
  }
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  bool fp32_out) {
  return linear_on(linear_path_for(fp32_out), x, packed, n, bias, fp32_out);
}

at::Tensor linear_on(Path path, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     const c10::optional<at::Tensor>& bias, bool fp32_out) {
  const Shape s = check_linear(x, packed, n, fp32_out);
  TORCH_CHECK(!(fp32_out && reads_bf16(path)), "linear: the ", path_name(path), " path takes bf16 x only");
  const std::vector<float> b = bias_fp32(bias, n);
  if (s.m == 0) return at::empty({0, n}, x.options());  // no rows (a forward whose rows choose nothing)
  if (s.quant && s.quant->int8) return linear_int8(x, *s.quant, b, false);
  const bool bf16_rows = reads_bf16(path);
  const at::Tensor xl = lay_out(x, s, path);
  at::Tensor out = at::empty({s.m, n}, x.options());
  const Split sp = split_for(s, at::get_num_threads());
  const char* x0 = static_cast<const char*>(xl.data_ptr());
  const int64_t x_row = xl.element_size() * s.kp;
  const int64_t jobs = sp.row_jobs * sp.panel_jobs;
  const bool small = s.m * s.kp * s.panels * kPanel < (int64_t(1) << 18);  // less than a fork and join costs
  at::parallel_for(0, jobs, small ? jobs : 1, [&](int64_t j0, int64_t j1) {
    FlushDenormals ftz;
    static thread_local std::vector<float> acc;
    for (int64_t job = j0; job < j1; ++job) {
      const int64_t r0 = job / sp.panel_jobs * sp.rows, rows = std::min(sp.rows, s.m - r0);
      const int64_t p0 = job % sp.panel_jobs * sp.panels, p1 = std::min(s.panels, p0 + sp.panels);
      const int64_t ldacc = (p1 - p0) * kPanel, acc_rows = path == Path::kAmx ? round_up(rows, 16) : rows;
      acc.assign(acc_rows * ldacc, 0.0f);
      const char* xr = x0 + r0 * x_row;
      const LinearTask t{bf16_rows ? nullptr : reinterpret_cast<const float*>(xr),
                         bf16_rows ? reinterpret_cast<const uint16_t*>(xr) : nullptr, rows, s.kp,
                         s.quant ? nullptr : u16(packed), p0, p1, acc.data(), ldacc};
      run_panels(path, t, s.quant ? &*s.quant : nullptr);
      linear_epilogue(acc.data(), ldacc, b, out, r0, rows, p0 * kPanel, std::min(p1 * kPanel, n));
    }
  });
  return out;
}

// The contract's order one scalar step at a time (contract.h, 1): what every path must equal.
// For tests and audits; slow.
at::Tensor linear_reference(const at::Tensor& x, const at::Tensor& weight, int64_t n,
                            const c10::optional<at::Tensor>& bias, bool fp32_out) {
  const Shape s = check_linear(x, weight, n, fp32_out);
  if (s.quant && s.quant->int8) return linear_int8(x, *s.quant, bias_fp32(bias, n), true);
  const at::Tensor packed = is_quantized(weight) ? dequantize_packed(weight) : weight;
  const std::vector<float> b = bias_fp32(bias, n);
  const at::Tensor xf = lay_out(x, s, Path::kAvx2);
  at::Tensor acc = at::zeros({s.m, n}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({s.m, n}, x.options());
  FlushDenormals ftz;
  auto fma = [](float a, float b, float c) {
    return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
  };
  auto add = [](float a, float b) { return _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(a), _mm_set_ss(b))); };
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float* xr = xf.data_ptr<float>() + i * s.kp;
      const uint16_t* wc = u16(packed) + (j / kPanel) * s.kp * kPanel + (j % kPanel) * 2;  // pair 0 of column j
      float a = 0.0f;
      for (int64_t blk = 0; blk < s.kp / kBlock; ++blk) {
        float e = 0.0f, o = 0.0f;
        for (int64_t q = blk * 16; q < blk * 16 + 16; ++q) {
          e = fma(xr[2 * q], bf16_value(wc[q * 2 * kPanel]), e);
          o = fma(xr[2 * q + 1], bf16_value(wc[q * 2 * kPanel + 1]), o);
        }
        a = add(a, add(e, o));
      }
      acc.data_ptr<float>()[i * n + j] = a;
    }
  linear_epilogue(acc.data_ptr<float>(), n, b, out, 0, s.m, 0, n);
  return out;
}

}  // namespace mg
