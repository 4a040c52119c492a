// The Python module: margingate.kernels.invariant loads it (built on first use, cached).
#include "kernels.h"

namespace {
bool cpu_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace mg;
  m.def("linear", &linear, "x @ W^T + b, W packed bf16 or quantized, in the contract's order on the current path");
  m.def("linear_reference", &linear_reference, "the same, one scalar step at a time (tests, audits)");
  m.def("path_proofs", &path_proofs,
        "every linear path, bf16 and int8: [family, name, status, detail] (proves those the CPU runs)");
  m.def("path_in_use", &path_in_use, "the path a family (bf16, int8) runs");
  m.def("set_path", &set_path,
        "run its family on this path (an error where it is not built, the CPU cannot run it or its proof failed)");
  m.def("dequantize_packed", &dequantize_packed, "a quantized weight dequantized to packed bf16 panels (the reference)");
  m.def("dequantize_rows", &dequantize_rows, "rows of a quantized weight, dequantized to bf16 (embedding lookups)");
  m.def("quantize_rows_int8", &quantize_rows_int8, "x's rows quantized as the int8 contract does: q, scale, sum16");
  py::class_<ExpertSet, std::shared_ptr<ExpertSet>>(m, "ExpertSet", "a mixture-of-experts layer's experts, parsed once")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, bool>())
      .def("set_gpt_oss", &ExpertSet::set_gpt_oss, "gpt-oss's biases, routing and clamped SwiGLU")
      .def("__len__", &ExpertSet::size)
      .def_property_readonly("grouped", [](const ExpertSet& s) { return !s.gate_up_int8.empty(); });
  m.def("moe_route", &moe_route, "a router's choice of experts and their fp32 weights, in models/moe.py's order");
  m.def("moe_experts", &moe_experts, "a mixture-of-experts block's experts in models/moe.py's order, one call");
  m.def("moe_block", &moe_block, "a mixture-of-experts block: router, route, experts, one call");
  m.def("attention", &attention, "batch-invariant attention of query rows over their own paged cached prefix");
  m.def("kv_write", &kv_write, "rows' K and V into their positions of a paged cache (int8, int4: rotated, quantized per group)");
  m.def("rmsnorm", &rmsnorm, "per-row RMSNorm, fixed order (mode 1: Gemma's 1 + weight; 2: gpt-oss's fp32 product)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("swiglu_clamped", &swiglu_clamped, "gpt-oss's (clamp(up) + 1) * (g * sigmoid(alpha g)), g = min(gate, limit)");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up");
  m.def("gelu_erf", &gelu_erf, "exact GELU (erf form), elementwise");
  m.def("logsumexp_rows", &logsumexp_rows, "per-row log(sum(exp(x))) of fp32 logits, a fixed order");
  m.def("exp_shifted", &exp_shifted, "exp(x - shift[row]) with the contract's exp");
  m.def("sum_exp_rows", &sum_exp_rows, "per-row sum of exp(x - max), fp64, the fixed order of logsumexp_rows");
  m.def("argmax_rows", &argmax_rows, "per-row index of the first maximum, as torch.argmax (NaN wins)");
  m.def("philox4x32", &philox4x32, "one Philox4x32-10 block (known-answer tests)");
  m.def("add_gumbel_", &add_gumbel_, "rows[r] += Gumbel noise keyed by (seed, first_position + r, token), in place");
  py::class_<StackSpec, std::shared_ptr<StackSpec>>(m, "StackSpec", "a model's decoder stack: layer, shape, weights")
      .def(py::init<>())
      .def_readwrite("unit_offset_norms", &StackSpec::unit_offset_norms)
      .def_readwrite("fp32_norm_product", &StackSpec::fp32_norm_product)
      .def_readwrite("qk_norm", &StackSpec::qk_norm)
      .def_readwrite("sandwich_norms", &StackSpec::sandwich_norms)
      .def_readwrite("gelu_tanh", &StackSpec::gelu_tanh)
      .def_readwrite("heads", &StackSpec::heads)
      .def_readwrite("kv_heads", &StackSpec::kv_heads)
      .def_readwrite("intermediate", &StackSpec::intermediate)
      .def_readwrite("eps", &StackSpec::eps)
      .def_readwrite("scale", &StackSpec::scale)
      .def_readwrite("windows", &StackSpec::windows)
      .def_readwrite("weights", &StackSpec::weights)
      .def_readwrite("names", &StackSpec::names)
      .def_readwrite("experts", &StackSpec::experts)
      .def("check", &StackSpec::check);
  m.def("decoder_stack", &decoder_stack, "every decoder layer of a StackSpec for bf16 rows", py::arg("h"),
        py::arg("spec"), py::arg("cos"), py::arg("sin"), py::arg("cos_local"), py::arg("sin_local"),
        py::arg("cache"), py::arg("kv_rotate"), py::arg("tables"), py::arg("table_of"), py::arg("positions"), py::arg("aligns"));
  m.def("stack_profile", &stack_profile, "ms per phase of decoder_stack since the last call; turns timing on/off");
  m.def("cpu_supported", &cpu_supported, "AVX2 and FMA present");
  m.attr("CHUNK") = kChunk;
  m.attr("PANEL") = kPanel;
  m.attr("BLOCK") = kBlock;
}
