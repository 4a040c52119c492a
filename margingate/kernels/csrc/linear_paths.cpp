// Which linear path runs: the fastest one that is built (the compiler had its target), that this
// CPU has, and that passed its load-time proof (linear_proof.cpp). A refused path is skipped with a
// warning naming it and why, and the reports name it (linear_proofs). Every path computes the same
// order (contract.h, 1); the proof is what keeps a path no one could test here from changing a bit.
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <mutex>

#include "isa.h"
#include "kernels.h"

// Set by the build (kernels/invariant.py) for each ISA unit the compiler could build.
#ifndef MG_BUILT_AMX
#define MG_BUILT_AMX 0
#endif
#ifndef MG_BUILT_AVX512BF16
#define MG_BUILT_AVX512BF16 0
#endif
#ifndef MG_BUILT_AVX512
#define MG_BUILT_AVX512 0
#endif

namespace mg {
namespace {

const char* const kPathNames[] = {"avx2", "avx512", "avx512bf16", "amx"};
constexpr Path kFastestFirst[] = {Path::kAmx, Path::kAvx512Bf16, Path::kAvx512, Path::kAvx2};

bool built(Path p) {
  switch (p) {
    case Path::kAmx: return MG_BUILT_AMX;
    case Path::kAvx512Bf16: return MG_BUILT_AVX512BF16;
    case Path::kAvx512: return MG_BUILT_AVX512;
    default: return true;
  }
}

bool cpu_has(Path p) {
  switch (p) {
#if MG_BUILT_AMX
    case Path::kAmx: return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                            __builtin_cpu_supports("avx512f") && amx_granted();
#else
    case Path::kAmx: return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
#endif
    case Path::kAvx512Bf16: return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
    case Path::kAvx512: return __builtin_cpu_supports("avx512f");
    default: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
}

bool runs(Path p) { return built(p) && cpu_has(p); }

struct Proof {
  bool done = false, passed = false;
  std::string why;  // the first difference, when refused
};

std::mutex proof_mutex;
Proof proofs[4];

// The path's proof, run on first asking (bf16 x on every path; fp32 x too on the FMA paths).
const Proof& proof(Path p) {
  std::lock_guard<std::mutex> lock(proof_mutex);
  Proof& pr = proofs[int(p)];
  if (pr.done) return pr;
  const LinearRun run = [p](const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& b) {
    return linear_on(p, x, w, n, b, x.scalar_type() == at::kFloat);
  };
  pr.why = prove_linear(path_name(p), run, !reads_bf16(p));
  pr.done = true, pr.passed = pr.why.empty();
  if (!pr.passed)
    TORCH_WARN("margingate: the linear path '", path_name(p), "' was refused: its load-time proof differs from the ",
               "contract's order (", pr.why, "); the next path runs instead");
  return pr;
}

bool usable(Path p) { return runs(p) && proof(p).passed; }

Path first_usable(bool fp32_x) {
  for (Path p : kFastestFirst)
    if (!(fp32_x && reads_bf16(p)) && usable(p)) return p;
  TORCH_CHECK(false, "margingate: no linear path passed its load-time proof on this CPU");
}

struct Choice {
  bool forced = false;
  Path path = Path::kAvx2;
};

Choice& choice() {
  static Choice c;
  return c;
}

}  // namespace

std::string path_name(Path p) { return kPathNames[int(p)]; }

// AMX needs the OS's permission once per process (no AMX instruction here: this unit is baseline AVX2).
bool amx_granted() {
  constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return granted;
}

// AMX and AVX512-BF16 take bf16 x only; fp32 x takes the best usable FMA path (the same order).
Path linear_path_for(bool fp32_x) {
  static const Path best = first_usable(false), best_fma = first_usable(true);  // proven once
  const Choice& c = choice();
  if (!c.forced) return fp32_x ? best_fma : best;
  return fp32_x && reads_bf16(c.path) ? best_fma : c.path;
}

void run_path(Path p, const LinearTask& t) {
  switch (p) {
#if MG_BUILT_AMX
    case Path::kAmx: linear_amx(t); break;
#endif
#if MG_BUILT_AVX512BF16
    case Path::kAvx512Bf16: linear_avx512bf16(t); break;
#endif
#if MG_BUILT_AVX512
    case Path::kAvx512: linear_avx512(t); break;
#endif
    case Path::kAvx2: linear_avx2(t); break;
    default: TORCH_CHECK(false, "the linear path '", path_name(p), "' is not built");
  }
}

// The dequantizer of the path's ISA (AMX CPUs have AVX512-BF16); every one gives the reference's bits.
// The AVX512-BF16 path never comes here: it dequantizes as it reads (run_quant_directly).
void dequant_panel(Path p, const QuantMatrix& m, int64_t panel, uint16_t* dst) {
  const auto [q, at] = m.locate(panel);
#if MG_BUILT_AVX512BF16
  static const bool bf16 = cpu_has(Path::kAvx512Bf16);
  if (bf16 && p == Path::kAmx) return dequant_panel_avx512bf16(*q, at, m.k, dst);
#endif
  dequant_panel_avx2(*q, at, m.k, dst);
}

// A quantized weight on AVX512-BF16: dequantized as the kernel reads it (linear_avx512bf16_quant), a
// run of panels within one part at a time. False where the path has no such kernel: the caller
// dequantizes whole panels into a scratch.
bool run_quant_directly(Path p, const LinearTask& t, const QuantMatrix& m) {
#if MG_BUILT_AVX512BF16
  if (p != Path::kAvx512Bf16) return false;
  for (int64_t panel = t.p0; panel < t.p1;) {
    const auto [q, at] = m.locate(panel);
    const int64_t run = std::min(t.p1 - panel, q->panels - at);
    LinearTask s = t;
    s.p0 = 0, s.p1 = run, s.acc = t.acc + (panel - t.p0) * kPanel;
    linear_avx512bf16_quant(s, *q, at);
    panel += run;
  }
  return true;
#else
  return false;
#endif
}

std::vector<std::string> linear_paths() {
  std::vector<std::string> out;
  for (Path p : kFastestFirst)
    if (usable(p)) out.emplace_back(kPathNames[int(p)]);
  return out;
}

std::string linear_path() { return path_name(linear_path_for(false)); }

// For audits (MARGINGATE_FORCE_ISA) and tests. A path that is not built, that this CPU cannot run
// or that failed its proof is an error saying which.
void set_linear_path(const std::string& name) {
  for (Path p : kFastestFirst) {
    if (name != kPathNames[int(p)]) continue;
    TORCH_CHECK(built(p), "the linear path '", name, "' is not built: the compiler lacks its target");
    TORCH_CHECK(cpu_has(p), "the linear path '", name, "' cannot run on this CPU (it runs: ",
                c10::Join(", ", linear_paths()), ")");
    TORCH_CHECK(proof(p).passed, "the linear path '", name, "' was refused at load: its proof differs from the ",
                "contract's order (", proof(p).why, ")");
    choice() = {true, p};
    return;
  }
  TORCH_CHECK(false, "unknown linear path '", name, "': amx, avx512bf16, avx512 or avx2");
}

// Every path, fastest first: (name, status, detail). status: "passed", "refused" (detail: why),
// "not built" (the compiler lacked its target), "cpu lacks it". Proves the paths the CPU runs.
std::vector<std::vector<std::string>> linear_proofs() {
  std::vector<std::vector<std::string>> out;
  for (Path p : kFastestFirst) {
    const std::string name = kPathNames[int(p)];
    if (!built(p)) out.push_back({name, "not built", "the compiler lacks its target"});
    else if (!cpu_has(p)) out.push_back({name, "cpu lacks it", ""});
    else out.push_back({name, proof(p).passed ? "passed" : "refused", proof(p).why});
  }
  return out;
}

}  // namespace mg
