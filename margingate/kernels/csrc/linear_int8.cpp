// The integer-exact linear (contract.h, 5): x's rows quantized by the row alone, exact integer sums, one
// float epilogue per (row, column). Here: the activation quantizer, the scalar reference every path must
// equal, the threads' split (panels and rows, never k) and the path's load-time proof.
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <mutex>

#include "int8_layout.h"
#include "kernels.h"

// Set by the build (kernels/invariant.py) for each int8 ISA unit the compiler could build.
#ifndef MG_BUILT_INT8_AMX
#define MG_BUILT_INT8_AMX 0
#endif
#ifndef MG_BUILT_INT8_VNNI
#define MG_BUILT_INT8_VNNI 0
#endif

namespace mg {
namespace {

inline float rne(float v) {  // round to nearest even, set in the instruction (not by MXCSR)
  return _mm_cvtss_f32(_mm_round_ss(_mm_setzero_ps(), _mm_set_ss(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// One block of n values (contract.h, 5a) into q, its scale returned.
float quantize_block(const float* v, int64_t n, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    finite = finite && std::isfinite(v[j]);
    const float a = std::fabs(v[j]);
    if (a >= FLT_MIN && a > amax) amax = a;
  }
  if (!finite || amax == 0.0f) {
    std::memset(q, 0, n);
    return finite ? 0.0f : NAN;
  }
  const float r = 127.0f / amax;
  for (int64_t j = 0; j < n; ++j) {
    const float t = std::fabs(v[j]) < FLT_MIN ? 0.0f : rne(v[j] * r);
    q[j] = int8_t(t > 127.0f ? 127 : t < -127.0f ? -127 : int(t));
  }
  const float scale = amax / 127.0f;
  return scale < FLT_MIN ? 0.0f : scale;
}

template <typename X>
void quantize_row(const X* src, int64_t k, int64_t kp, int64_t block, int8_t* q, float* scale, int32_t* sum16) {
  std::vector<float> v(block);
  for (int64_t b = 0; b < kp / block; ++b) {
    for (int64_t j = 0; j < block; ++j) v[j] = b * block + j < k ? static_cast<float>(src[b * block + j]) : 0.0f;
    scale[b] = quantize_block(v.data(), block, q + b * block);
  }
  for (int64_t g = 0; g < kp / 16; ++g) {
    int32_t s = 0;
    for (int64_t j = 0; j < 16; ++j) s += q[16 * g + j];
    sum16[g] = s;
  }
}

Int8Acts quantize(const at::Tensor& x, int64_t kp, int64_t block) {
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(kp % block == 0 && block % 16 == 0, "int8 activations: blocks of ", block, " in ", kp);
  Int8Acts a{at::empty({m, kp}, at::kChar), at::empty({m, kp / block}, at::kFloat), at::empty({m, kp / 16}, at::kInt)};
  at::parallel_for(0, m, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int8_t* q = a.q.data_ptr<int8_t>() + i * kp;
      float* s = a.scale.data_ptr<float>() + i * (kp / block);
      int32_t* s16 = a.sum16.data_ptr<int32_t>() + i * (kp / 16);
      if (x.scalar_type() == at::kFloat) quantize_row(x.data_ptr<float>() + i * k, k, kp, block, q, s, s16);
      else quantize_row(x.data_ptr<bf16>() + i * k, k, kp, block, q, s, s16);
    }
  });
  return a;
}

constexpr int64_t kInt8RowBlock = 64;  // rows whose q stay in L2 while a job's panels pass

at::Tensor run_int8(const at::Tensor& x, const QuantMatrix& m, const std::vector<float>& bias, Int8Kernel kernel) {
  const Int8Input in = int8_input(x, int8_blocks({&m}));
  at::Tensor out = at::empty({x.size(0), m.n}, x.options());
  const int64_t work = x.size(0) * m.k * m.panels * kPanel;
  const int64_t grain = work < (int64_t(1) << 18) ? m.panels : std::max<int64_t>(1, m.panels / (8 * at::get_num_threads()));
  at::parallel_for(0, m.panels, grain, [&](int64_t p0, int64_t p1) { int8_panels(in, m, bias, kernel, out, p0, p1); });
  return out;
}

// The int8 paths, fastest first. Each is built where the compiler has its target (isa_units.py), runs
// where the CPU has it, and is used only once its load-time proof against the scalar reference passed.
struct Int8Path {
  const char* name;
  bool built;
  bool (*cpu)();
  Int8Kernel kernel;
  std::once_flag once;
  std::string why;  // the proof's first difference; "" when it passed
};

Int8Path int8_paths[] = {
#if MG_BUILT_INT8_AMX
    {"int8-amx", true, []() -> bool { return __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("avx512vnni") &&
                                   amx_granted(); }, &linear_int8_amx, {}, {}},
#else
    {"int8-amx", false, []() -> bool { return __builtin_cpu_supports("amx-int8"); }, nullptr, {}, {}},
#endif
#if MG_BUILT_INT8_VNNI
    {"int8-avx512vnni", true, []() -> bool { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); },
     &linear_int8_vnni, {}, {}},
#else
    {"int8-avx512vnni", false, []() -> bool { return __builtin_cpu_supports("avx512vnni"); }, nullptr, {}, {}},
#endif
    {"int8-avx2", true, []() -> bool { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); },
     &linear_int8_avx2, {}, {}},
};

const std::string& proof(Int8Path& p) {
  std::call_once(p.once, [&p] {
    p.why = prove_int8(p.name, [&p](const at::Tensor& x, const at::Tensor& w, int64_t) {
      return run_int8(x, quant_matrix(w), {}, p.kernel);
    });
    if (!p.why.empty())
      TORCH_WARN("margingate: the int8 linear path '", p.name, "' was refused: its load-time proof differs from the ",
                 "scalar reference (", p.why, "); the next path runs instead");
  });
  return p.why;
}

bool usable(Int8Path& p) { return p.built && p.cpu() && proof(p).empty(); }

Int8Path* forced_int8 = nullptr;  // set_int8_path

Int8Path& chosen() {
  if (forced_int8) return *forced_int8;
  static Int8Path* best = [] {
    for (Int8Path& p : int8_paths)
      if (usable(p)) return &p;
    return static_cast<Int8Path*>(nullptr);
  }();
  if (!best) {
    std::string all;
    for (const auto& row : int8_proofs())  // name, status, the refused path's first difference
      all += (all.empty() ? "" : "; ") + row[0] + ": " + (row[1] == "refused" ? row[2] : row[1]);
    TORCH_CHECK(false, "margingate: no int8 linear path passed its load-time proof on this CPU (", all,
                "); load the file with --weights exact or bf16");
  }
  return *best;
}

}  // namespace

// The scalar reference (contract.h, 5b and 5c), one code at a time.
void linear_int8_scalar(const Int8Rows& x, const QuantPart& q, int64_t panel, float* acc, int64_t ldacc) {
  const int64_t kp = x.kp, blocks = kp / q.block;
  auto half = [](uint16_t h) { return float(c10::Half(h, c10::Half::from_bits())); };
  for (int64_t r = 0; r < x.m; ++r)
    for (int64_t l = 0; l < kPanel; ++l) {
      float a = acc[r * ldacc + l];
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t S = 0, M = 0;
        for (int64_t g = b * q.block / q.group; g < (b + 1) * q.block / q.group; ++g) {
          int32_t isum = 0, xsum = 0;
          for (int64_t k = g * q.group; k < (g + 1) * q.group; ++k) {
            isum += (int8_code(q, panel, kp, k, l) - q.zero) * x.q[r * kp + k];
            xsum += x.q[r * kp + k];
          }
          const int64_t at_s = (panel * (kp / q.group) + g) * kPanel + l;
          S += (q.s ? q.s[at_s] : 1) * isum;
          M += (q.s_off ? q.s_off[at_s] : 1) * xsum;
        }
        const int64_t at_d = (panel * blocks + b) * kPanel + l;
        const float scale = x.scale[r * blocks + b];
        a = a + float(S) * (scale * half(q.d[at_d]));
        if (q.d_off) a = a + float(M) * (scale * half(q.d_off[at_d]));
      }
      acc[r * ldacc + l] = a;
    }
}

Int8Rows Int8Acts::rows(int64_t r0, int64_t m) const {
  const int64_t kp = q.size(1), block = kp / scale.size(1);
  return {q.data_ptr<int8_t>() + r0 * kp, scale.data_ptr<float>() + r0 * (kp / block),
          sum16.data_ptr<int32_t>() + r0 * (kp / 16), m, kp, block};
}

Int8Input Int8Input::select(const at::Tensor& index) const {
  Int8Input out{blocks, {}};
  for (const Int8Acts& a : acts)
    out.acts.push_back({a.q.index_select(0, index), a.scale.index_select(0, index), a.sum16.index_select(0, index)});
  return out;
}

std::vector<int64_t> int8_blocks(const std::vector<const QuantMatrix*>& ms) {
  std::vector<int64_t> blocks;
  for (const QuantMatrix* m : ms)
    for (const QuantPart& q : m->parts)
      if (std::find(blocks.begin(), blocks.end(), q.block) == blocks.end()) blocks.push_back(q.block);
  return blocks;
}

Int8Input int8_input(const at::Tensor& x, const std::vector<int64_t>& blocks) {
  Int8Input in{blocks, {}};
  for (const int64_t block : blocks) in.acts.push_back(quantize(x, x.size(1), block));
  return in;
}

Int8Kernel int8_kernel(bool reference) { return reference ? &linear_int8_scalar : chosen().kernel; }

void int8_panels(const Int8Input& in, const QuantMatrix& m, const std::vector<float>& bias, Int8Kernel kernel,
                 at::Tensor& out, int64_t p0, int64_t p1) {
  FlushDenormals ftz;
  static thread_local std::vector<float> acc;
  const int64_t rows = out.size(0), ldacc = (p1 - p0) * kPanel;
  for (int64_t r0 = 0; r0 < rows; r0 += kInt8RowBlock) {
    const int64_t rn = std::min(kInt8RowBlock, rows - r0);
    acc.assign(rn * ldacc, 0.0f);
    for (int64_t p = p0; p < p1; ++p) {
      const auto [q, at] = m.locate(p);
      const size_t which = std::find(in.blocks.begin(), in.blocks.end(), q->block) - in.blocks.begin();
      TORCH_CHECK(which < in.blocks.size(), "int8 linear: x was not quantized in blocks of ", q->block);
      kernel(in.acts[which].rows(r0, rn), *q, at, acc.data() + (p - p0) * kPanel, ldacc);
    }
    linear_epilogue(acc.data(), ldacc, bias, out, r0, rn, p0 * kPanel, std::min(p1 * kPanel, m.n));
  }
}

at::Tensor linear_int8(const at::Tensor& x, const QuantMatrix& m, const std::vector<float>& bias, bool reference) {
  return run_int8(x, m, bias, int8_kernel(reference));
}

std::vector<std::vector<std::string>> int8_proofs() {
  std::vector<std::vector<std::string>> out;
  for (Int8Path& p : int8_paths) {
    if (!p.built) out.push_back({p.name, "not built", "the compiler lacks its target"});
    else if (!p.cpu()) out.push_back({p.name, "cpu lacks it", ""});
    else out.push_back({p.name, proof(p).empty() ? "passed" : "refused", proof(p)});
  }
  return out;
}

std::vector<std::string> int8_proof_report() {
  Int8Path& p = chosen();
  return {p.name, "passed", ""};
}

// For audits (MARGINGATE_FORCE_INT8) and tests: an error names why a path cannot be used.
void set_int8_path(const std::string& name) {
  for (Int8Path& p : int8_paths) {
    if (name != p.name) continue;
    TORCH_CHECK(p.built, "the int8 linear path '", name, "' is not built: the compiler lacks its target");
    TORCH_CHECK(p.cpu(), "the int8 linear path '", name, "' cannot run on this CPU");
    TORCH_CHECK(proof(p).empty(), "the int8 linear path '", name, "' was refused at load: ", proof(p));
    forced_int8 = &p;
    return;
  }
  TORCH_CHECK(false, "unknown int8 linear path '", name, "': int8-amx, int8-avx512vnni or int8-avx2");
}

std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x, int64_t block) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows_int8: x [M, K] bf16 or fp32");
  TORCH_CHECK(block > 0 && block % 16 == 0, "quantize_rows_int8: block a multiple of 16");
  const Int8Acts a = quantize(x, round_up(x.size(1), block), block);
  return {a.q, a.scale, a.sum16};
}

}  // namespace mg
