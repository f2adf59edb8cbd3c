// The Python bindings of the engine-cpu kernels: pybind11 with torch's tensor caster
// only (torch/extension.h would bring the whole C++ frontend: four times the compile time).
#include <optional>
#include <torch/csrc/utils/pybind.h>

#include "kernel.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

// paged_attention.cpp
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
                     torch::Tensor token_seq, torch::Tensor tokens, double scale, int64_t window);
void cache_write(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slot_mapping, torch::Tensor k,
                 torch::Tensor v);

// layer_ops.cpp
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
void silu_and_mul(torch::Tensor out, torch::Tensor x);
void argmax(torch::Tensor out, torch::Tensor logits);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);

// packed_attention.cpp
bool packed_kv_supported(int64_t head_size, int64_t block_size);
void paged_attention_packed(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                            torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor token_seq,
                            torch::Tensor tokens, double scale, int64_t window, torch::Tensor sinks);
void cache_write_packed(torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor k, torch::Tensor v);
void decode_attention_packed(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                             torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                             torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor token_seq,
                             double scale, int64_t window, torch::Tensor sinks);

// prefill_attention.cpp
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                       torch::Tensor query_start_loc, torch::Tensor context_lens, torch::Tensor seqs, double scale,
                       int64_t window, torch::Tensor sinks);

// gemv.cpp
bool gemv_supported();
void gemv(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias, bool batch_invariant);

// amx_linear.cpp
bool amx_supported();
void amx_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias);
void amx_gated_linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias);
void amx_linear_argmax(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N);
std::tuple<int64_t, int64_t> amx_linear_argmax_screened(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                                                        torch::Tensor bias, int64_t N, torch::Tensor qweight,
                                                        torch::Tensor scale, torch::Tensor q1, double max_scale,
                                                        torch::Tensor rowmajor);

// dot_linear.cpp
void dot_linear(torch::Tensor out, torch::Tensor x, torch::Tensor w, torch::Tensor bias);

// group_quant.cpp
void group_quant_linear(torch::Tensor out, torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        torch::Tensor offsets, torch::Tensor super_scales, torch::Tensor super_offsets,
                        int64_t bits, int64_t group_size, int64_t super_group, int64_t zero, torch::Tensor bias,
                        bool int8_activations);
torch::Tensor group_quant_matmul(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                                 std::optional<torch::Tensor> offsets, std::optional<torch::Tensor> super_scales,
                                 std::optional<torch::Tensor> super_offsets, int64_t bits, int64_t group_size,
                                 int64_t super_group, int64_t zero, std::optional<torch::Tensor> bias,
                                 bool int8_activations);
bool group_quant_int8_supported(int64_t bits, int64_t in_features, int64_t group_size);

// fp8_linear.cpp
torch::Tensor fp8_matmul(torch::Tensor x, torch::Tensor weight, torch::Tensor scales, int64_t block_k,
                         std::optional<torch::Tensor> bias);
void fp8_dequantize(torch::Tensor out, torch::Tensor weight, torch::Tensor scales, int64_t block_k);

// mamba2.cpp
void mamba2_conv(torch::Tensor x_out, torch::Tensor b_out, torch::Tensor c_out, torch::Tensor xbc,
                 torch::Tensor kept, torch::Tensor weight, torch::Tensor bias, torch::Tensor query_start_loc,
                 torch::Tensor query_lens);
void mamba2_chunk_scores(torch::Tensor scores, torch::Tensor cb, torch::Tensor cumulative, torch::Tensor delta,
                         double log_floor);
void mamba2_pass_states(torch::Tensor states, torch::Tensor decays, torch::Tensor initial, torch::Tensor final_state);
void mamba2_gather_outputs(torch::Tensor out, torch::Tensor y, torch::Tensor entering, torch::Tensor x,
                           torch::Tensor cumulative, torch::Tensor D, torch::Tensor token_seq,
                           torch::Tensor token_row, double log_floor);
void mamba2_decode(torch::Tensor out, torch::Tensor xbc, torch::Tensor state, torch::Tensor slots,
                   torch::Tensor fresh, torch::Tensor weight, torch::Tensor bias, torch::Tensor delta,
                   torch::Tensor A, torch::Tensor D, int64_t groups, int64_t state_size);

// the instruction-set extensions this build was compiled with (its variant's -march flags)
std::vector<std::string> compiled_isa() {
  std::vector<std::string> isa;
#if defined(__AVX2__)
  isa.push_back("avx2");
#endif
#if defined(__FMA__)
  isa.push_back("fma");
#endif
#if defined(__AVX512F__)
  isa.push_back("avx512f");
#endif
#if defined(__AVX512BW__)
  isa.push_back("avx512bw");
#endif
#if defined(__AVX512VL__)
  isa.push_back("avx512vl");
#endif
#if defined(__AVX512VNNI__)
  isa.push_back("avx512_vnni");
#endif
#if defined(__AVX512BF16__)
  isa.push_back("avx512_bf16");
#endif
#if defined(__AMX_TILE__)
  isa.push_back("amx_tile");
#endif
#if defined(__AMX_BF16__)
  isa.push_back("amx_bf16");
#endif
#if defined(__AMX_INT8__)
  isa.push_back("amx_int8");
#endif
  return isa;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("compiled_isa", &compiled_isa, "the instruction-set extensions this build was compiled with");
  m.def("cache_write", &cache_write, "write the new tokens' K and V into their cache slots");
  m.def("gemv_supported", &gemv_supported, "whether gemv runs on this CPU and build");
  m.def("gemv", &gemv, "out = x @ W^T + bias for a few rows, W packed by pack_gemv_weight (bf16)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("batch_invariant") = false);
  m.def("amx_supported", &amx_supported, "whether amx_linear runs on this CPU, build and OS");
  m.def("amx_linear", &amx_linear, "out = x @ W^T + bias on AMX tiles, W packed by pack_gemv_weight (bf16)");
  m.def("amx_linear_argmax", &amx_linear_argmax,
        "greedy picks: argmax of each row of x @ W^T + bias on AMX tiles, the outputs never stored");
  m.def("amx_linear_argmax_screened", &amx_linear_argmax_screened,
        "amx_linear_argmax's picks, most columns ruled out first on an int8 copy of the weight; returns "
        "(columns computed exactly, rows unscreened)");
  m.def("amx_gated_linear", &amx_gated_linear,
        "out = silu(x @ Wg^T + bg) * (x @ Wu^T + bu) on AMX tiles, [Wg; Wu] packed by pack_gemv_weight (bf16)");
  m.def("dot_linear", &dot_linear, "out = x @ W^T + bias, each output summed in an order fixed by K (fp32 / bf16)");
  m.def("group_quant_linear", &group_quant_linear,
        "out = x @ W^T + bias, W group-quantized in 4, 6 or 8 bits with one- or two-level scales "
        "(engine.interfaces.group_quant; fp32 / bf16)",
        py::arg("out"), py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("offsets"),
        py::arg("super_scales"), py::arg("super_offsets"), py::arg("bits"), py::arg("group_size"),
        py::arg("super_group"), py::arg("zero"), py::arg("bias"), py::arg("int8_activations") = false);
  m.def("group_quant_matmul", &group_quant_matmul,
        "group_quant_linear into a new [T, N] tensor (offsets, super_scales, super_offsets and bias may be None)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("offsets"), py::arg("super_scales"),
        py::arg("super_offsets"), py::arg("bits"), py::arg("group_size"), py::arg("super_group"), py::arg("zero"),
        py::arg("bias"), py::arg("int8_activations"));
  m.def("fp8_matmul", &fp8_matmul,
        "x [T, K] @ (float8_e4m3fn weight [N, K] * float32 scales per row and block_k inputs)^T + bias (float32 [N] "
        "or None) into a new [T, N] tensor of x's dtype (fp32 / bf16)",
        py::arg("x"), py::arg("weight"), py::arg("scales"), py::arg("block_k"), py::arg("bias"));
  m.def("fp8_dequantize", &fp8_dequantize, "out [N, K] (fp32 / bf16) = float8_e4m3fn weight * its scales",
        py::arg("out"), py::arg("weight"), py::arg("scales"), py::arg("block_k"));
  m.def("group_quant_int8_supported", &group_quant_int8_supported,
        "whether group_quant_linear's int8 activations run in this build for such a weight");
  m.def("packed_kv_supported", &packed_kv_supported,
        "whether the packed bf16 cache layout and its kernels run for this head and block size");
  m.def("cache_write_packed", &cache_write_packed, "write the new tokens' K and V into the packed cache");
  m.def("paged_attention_packed", &paged_attention_packed, "paged attention over the packed cache (decode, short chunks)");
  m.def("decode_attention_packed", &decode_attention_packed,
        "a decode step's cache writes and paged attention over the packed cache, in one pass");
  m.def("prefill_attention", &prefill_attention, "tiled causal attention for long prefill chunks over the packed cache");
  m.def("paged_attention", &paged_attention, "Paged attention over a block-table KV cache (CPU)");
  m.def("rms_norm", &rms_norm, "out = weight * rms-normalised x");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = weight * rms-normalised residual (in place)");
  m.def("rotary", &rotary, "rotate-half RoPE on q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up");
  m.def("mamba2_conv", &mamba2_conv,
        "Mamba-2 short convolution + SiLU, rounded to the inputs' dtype (fp32 / bf16), per chunk head-major");
  m.def("mamba2_chunk_scores", &mamba2_chunk_scores, "Mamba-2 causal decayed scores within chunks (fp32)");
  m.def("mamba2_pass_states", &mamba2_pass_states, "Mamba-2 states entering each chunk, in place (fp32)");
  m.def("mamba2_gather_outputs", &mamba2_gather_outputs,
        "Mamba-2 chunk outputs summed and gathered to token rows (fp32)");
  m.def("mamba2_decode", &mamba2_decode, "Mamba-2 step of one token a sequence, in place on the state slots");
  m.def("argmax", &argmax, "out[r] = first index of the maximum of logits[r] (fp32 / bf16)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "logits[rows[j], t] = -inf where bitmask[j] clears t");
}
