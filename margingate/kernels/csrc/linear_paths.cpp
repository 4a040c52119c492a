// Every path of the linear in one table, both families: the bf16 contract's (contract.h, 1: AMX tiles,
// AVX512-BF16 dot products, AVX-512 or AVX2 FMAs) and the integer-exact contract's (contract.h, 5: AMX-INT8,
// AVX-512 VNNI, AVX2). A path runs once it is built (the compiler had its target), this CPU has it and it
// passed its load-time proof (linear_proof.cpp); each family takes its fastest such path, or the one forced.
// A path whose proof failed is refused with a warning naming it and why, reported "failed" (path_proofs),
// and an error when forced. Every path of a family computes the same order; the proof is what keeps a path
// no one could test here from changing a bit.
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <mutex>

#include "isa.h"
#include "kernels.h"

// Set by the build (kernels/isa_units.py) for each ISA unit the compiler could build.
#ifndef MG_BUILT_AMX
#define MG_BUILT_AMX 0
#endif
#ifndef MG_BUILT_AVX512BF16
#define MG_BUILT_AVX512BF16 0
#endif
#ifndef MG_BUILT_AVX512
#define MG_BUILT_AVX512 0
#endif
#ifndef MG_BUILT_INT8_AMX
#define MG_BUILT_INT8_AMX 0
#endif
#ifndef MG_BUILT_INT8_VNNI
#define MG_BUILT_INT8_VNNI 0
#endif

namespace mg {
namespace {

enum class Family { kBf16, kInt8 };

struct FamilyInfo {
  const char* name;       // as the reports and Python name it
  const char* label;      // as the messages name its paths
  const char* reference;  // what its proof compares against
  const char* otherwise;  // what a user can do when none of its paths passed
};

const FamilyInfo kFamilies[] = {
    {"bf16", "linear", "the contract's order", ""},
    {"int8", "int8 linear", "the int8 scalar reference", "; load the file with --weights exact or bf16"},
};

// One row per path, fastest first within its family. `cpu` is asked only of a built path (AMX asks the OS).
struct PathRow {
  Path path;
  Family family;
  const char* name;
  bool built;
  bool (*cpu)();
};

// What each path needs of the CPU (and, for AMX, of the OS).
bool cpu_amx() {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         __builtin_cpu_supports("avx512f") && amx_granted();
}
bool cpu_avx512bf16() { return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16"); }
bool cpu_avx512() { return __builtin_cpu_supports("avx512f"); }
bool cpu_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool cpu_int8_amx() { return __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("avx512vnni") && amx_granted(); }
bool cpu_int8_vnni() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }

const PathRow kPaths[] = {
    {Path::kAmx, Family::kBf16, "amx", MG_BUILT_AMX, cpu_amx},
    {Path::kAvx512Bf16, Family::kBf16, "avx512bf16", MG_BUILT_AVX512BF16, cpu_avx512bf16},
    {Path::kAvx512, Family::kBf16, "avx512", MG_BUILT_AVX512, cpu_avx512},
    {Path::kAvx2, Family::kBf16, "avx2", true, cpu_avx2},
    {Path::kInt8Amx, Family::kInt8, "int8-amx", MG_BUILT_INT8_AMX, cpu_int8_amx},
    {Path::kInt8Vnni, Family::kInt8, "int8-avx512vnni", MG_BUILT_INT8_VNNI, cpu_int8_vnni},
    {Path::kInt8Avx2, Family::kInt8, "int8-avx2", true, cpu_avx2},
};

const PathRow& row_of(Path p) {
  for (const PathRow& r : kPaths)
    if (r.path == p) return r;
  TORCH_CHECK(false, "margingate: linear path ", int(p), " has no row in the table");
}

Int8Kernel int8_kernel_of(Path p) {
  switch (p) {
#if MG_BUILT_INT8_AMX
    case Path::kInt8Amx: return &linear_int8_amx;
#endif
#if MG_BUILT_INT8_VNNI
    case Path::kInt8Vnni: return &linear_int8_vnni;
#endif
    case Path::kInt8Avx2: return &linear_int8_avx2;
    default: TORCH_CHECK(false, "the int8 linear path '", path_name(p), "' is not built");
  }
}

// The path's products on the fixed cases against its family's reference: "" or the first difference.
std::string prove(const PathRow& r) {
  if (r.family == Family::kInt8)
    return prove_int8(r.name, [k = int8_kernel_of(r.path)](const at::Tensor& x, const at::Tensor& w, int64_t) {
      return linear_int8_on(k, x, quant_matrix(w), {});
    });
  const LinearRun run = [p = r.path](const at::Tensor& x, const at::Tensor& w, int64_t n,
                                     const c10::optional<at::Tensor>& b) {
    return linear_on(p, x, w, n, b, x.scalar_type() == at::kFloat);  // bf16 x on every path; fp32 x on FMA ones
  };
  return prove_linear(r.name, run, !reads_bf16(r.path));
}

struct Proof {
  std::once_flag once;
  std::string why;  // the first difference; "" when it passed
};
Proof proofs[kNumPaths];

// The path's proof, run on its first asking in the process.
const std::string& proof(const PathRow& r) {
  Proof& pr = proofs[int(r.path)];
  std::call_once(pr.once, [&] {
    pr.why = prove(r);
    const FamilyInfo& f = kFamilies[int(r.family)];
    if (!pr.why.empty())
      TORCH_WARN("margingate: the ", f.label, " path '", r.name, "' was refused: its load-time proof differs from ",
                 f.reference, " (", pr.why, "); the next path runs instead");
  });
  return pr.why;
}

bool usable(const PathRow& r) { return r.built && r.cpu() && proof(r).empty(); }

// [family, name, status, detail]: "not built", "cpu lacks it", or the proof's "passed" / "failed" (detail: why).
std::vector<std::string> report(const PathRow& r) {
  const std::string family = kFamilies[int(r.family)].name;
  if (!r.built) return {family, r.name, "not built", "the compiler lacks its target"};
  if (!r.cpu()) return {family, r.name, "cpu lacks it", ""};
  return {family, r.name, proof(r).empty() ? "passed" : "failed", proof(r)};
}

// The family's fastest usable path (fp32_x: among those that read fp32 rows); an error naming every
// path's status where none is.
const PathRow& fastest(Family f, bool fp32_x) {
  for (const PathRow& r : kPaths)
    if (r.family == f && !(fp32_x && reads_bf16(r.path)) && usable(r)) return r;
  std::string all;
  for (const PathRow& r : kPaths) {
    if (r.family != f) continue;
    const std::vector<std::string> rep = report(r);
    all += (all.empty() ? "" : "; ") + rep[1] + ": " + (rep[2] == "failed" ? rep[3] : rep[2]);
  }
  const FamilyInfo& info = kFamilies[int(f)];
  TORCH_CHECK(false, "margingate: no ", info.label, " path passed its load-time proof on this CPU (", all, ")",
              info.otherwise);
}

const PathRow* forced[2] = {nullptr, nullptr};  // set_path, per family

const PathRow& int8_in_use() {
  if (forced[int(Family::kInt8)]) return *forced[int(Family::kInt8)];
  static const PathRow& best = fastest(Family::kInt8, false);  // proven once
  return best;
}

}  // namespace

std::string path_name(Path p) { return row_of(p).name; }

// AMX needs the OS's permission once per process (no AMX instruction here: this unit is baseline AVX2).
bool amx_granted() {
  constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return granted;
}

// AMX and AVX512-BF16 take bf16 x only; fp32 x takes the best usable FMA path (the same order).
Path linear_path_for(bool fp32_x) {
  static const Path best = fastest(Family::kBf16, false).path, best_fma = fastest(Family::kBf16, true).path;
  const PathRow* f = forced[int(Family::kBf16)];
  if (!f) return fp32_x ? best_fma : best;
  return fp32_x && reads_bf16(f->path) ? best_fma : f->path;
}

Int8Kernel int8_kernel(bool reference) {
  return reference ? &linear_int8_scalar : int8_kernel_of(int8_in_use().path);
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
  static const bool bf16 = row_of(Path::kAvx512Bf16).cpu();
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

std::vector<std::vector<std::string>> path_proofs() {
  std::vector<std::vector<std::string>> out;
  for (const PathRow& r : kPaths) out.push_back(report(r));
  return out;
}

std::string path_in_use(const std::string& family) {
  if (family == kFamilies[int(Family::kInt8)].name) return int8_in_use().name;
  TORCH_CHECK(family == kFamilies[int(Family::kBf16)].name, "unknown family of linear paths '", family,
              "': bf16 or int8");
  return path_name(linear_path_for(false));
}

// For audits (MARGINGATE_FORCE_ISA, MARGINGATE_FORCE_INT8) and tests. A path that is not built, that this
// CPU cannot run or whose proof failed is an error saying which.
void set_path(const std::string& name) {
  for (const PathRow& r : kPaths) {
    if (name != r.name) continue;
    const FamilyInfo& f = kFamilies[int(r.family)];
    TORCH_CHECK(r.built, "the ", f.label, " path '", name, "' is not built: the compiler lacks its target");
    TORCH_CHECK(r.cpu(), "the ", f.label, " path '", name, "' cannot run on this CPU");
    TORCH_CHECK(proof(r).empty(), "the ", f.label, " path '", name, "' was refused at load: its proof differs from ",
                f.reference, " (", proof(r), ")");
    forced[int(r.family)] = &r;
    return;
  }
  std::string names;
  for (const PathRow& r : kPaths) names += (names.empty() ? "" : ", ") + std::string(r.name);
  TORCH_CHECK(false, "unknown linear path '", name, "': one of ", names);
}

}  // namespace mg
