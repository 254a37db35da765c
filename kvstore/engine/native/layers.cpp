// llama_layers: the layer stack of a Llama forward (models/llama.py) in one call, for block-quantized
// weights without biases over a paged bfloat16 KV cache: the loop Python runs (`Llama._rows`), with
// the same kernels called in the same order on the same arguments. So the same bits; what it saves is
// Python's dispatch between the kernels, ten calls a layer (about 1.5 ms of a 9 ms decode step here).
//
// llama_layers(x [R, H] bf16 (the embedded rows), weights: per layer wqkv, wo, w_gate_up, w_down
//              (quant.Packed data, uint8), meta: per weight (kind, rows, cols), norms: per layer
//              attn_norm2, mlp_norm2 (the norm weights twice over), cos, sin [R, 1, hd] (each row's
//              rotary), pools: per layer [n_blocks, block_tokens, 2, n_kv, hd] bf16, slots [R] int64
//              (each row's row in its layer's pool viewed as [n_blocks * block_tokens, 2, n_kv, hd]),
//              tables [S, width] int32, row_seq [R] int32, row_len [R] int32, n_heads, eps)
//   -> x after the last layer [R, H]; each row's K|V written at its slot in every layer.
// Per layer, exactly as `Llama._rows`:
//   qkv = qgemm(wqkv, rms_norm(x, attn_norm2))        [R, (n_heads + 2 n_kv) hd]: q | k | v
//   rope_(q and k heads of qkv, cos, sin)             in place
//   pool rows at slots = the k | v part of qkv         [R, 2, n_kv, hd] (the cache's one copy)
//   o = attention_rows(q, pool, tables, row_seq, row_len)
//   x = qgemm(wo, o) + x                              (the residual fused: qgemm's add)
//   x = qgemm(w_down, swiglu(qgemm(w_gate_up, rms_norm(x, mlp_norm2)))) + x
// The kernels are the ones kvstore::qgemm, rms_norm_bf16, rope_bf16_, swiglu_bf16 and attention_rows
// register (kernels_quant.cpp, kernels_bf16.cpp, attention.cpp), called through the dispatcher: this
// library holds no arithmetic of its own, and needs the other three loaded first (found at first call).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "check.h"

#include <cstdint>
#include <cstring>
#include <optional>

namespace {

using QGemm = at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t, const at::Tensor&,
                         const std::optional<at::Tensor>&, int64_t);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using Unary = at::Tensor(const at::Tensor&);
using Rope = at::Tensor&(at::Tensor&, const at::Tensor&, const at::Tensor&);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&);

template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Ops {
  c10::TypedOperatorHandle<QGemm> qgemm = op<QGemm>("kvstore::qgemm");
  c10::TypedOperatorHandle<Norm> rms_norm = op<Norm>("kvstore::rms_norm_bf16");
  c10::TypedOperatorHandle<Unary> swiglu = op<Unary>("kvstore::swiglu_bf16");
  c10::TypedOperatorHandle<Rope> rope = op<Rope>("kvstore::rope_bf16_");
  c10::TypedOperatorHandle<Attention> attention = op<Attention>("kvstore::attention_rows");
};

const Ops& ops() {
  static const Ops found;  // the first call: every library it calls is loaded by then
  return found;
}

constexpr int64_t kWeights = 4, kNorms = 2, kMeta = 3;  // per layer: wqkv, wo, w_gate_up, w_down; 2 norms

at::Tensor llama_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef meta, at::TensorList norms,
                        const at::Tensor& cos, const at::Tensor& sin, at::TensorList pools, const at::Tensor& slots_any,
                        const at::Tensor& tables, const at::Tensor& row_seq, const at::Tensor& row_len,
                        int64_t n_heads, double eps) {
  const int64_t n_layers = int64_t(pools.size());
  KV_CHECK(n_layers > 0 && int64_t(weights.size()) == kWeights * n_layers &&
                  int64_t(meta.size()) == kMeta * kWeights * n_layers && int64_t(norms.size()) == kNorms * n_layers,
              "llama_layers: per layer 4 weights (12 meta ints), 2 norms and 1 pool");
  KV_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.is_cpu(),
              "llama_layers: x must be [R, hidden] bfloat16 on the CPU");
  const int64_t R = x_in.size(0);
  const at::Tensor slots = slots_any.contiguous();
  KV_CHECK(slots.scalar_type() == at::kLong && slots.numel() == R, "llama_layers: slots must be int64 [R]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const at::Tensor& first = pools[0];
  KV_CHECK(first.dim() == 5 && first.scalar_type() == at::kBFloat16,
              "llama_layers: a pool is [n_blocks, block_tokens, 2, n_kv, hd] bfloat16");
  const int64_t n_kv = first.size(3), hd = first.size(4), rows = first.size(0) * first.size(1);
  const int64_t q_end = n_heads * hd, k_end = (n_heads + n_kv) * hd, row_bytes = 2 * n_kv * hd * 2;
  for (int64_t r = 0; r < R; r++)
    KV_CHECK(slot[r] >= 0 && slot[r] < rows, "llama_layers: slot ", slot[r], " is outside the pool's ", rows, " rows");
  const Ops& k = ops();
  at::Tensor x = x_in;
  for (int64_t i = 0; i < n_layers; i++) {
    const at::Tensor* w = &weights[kWeights * i];
    const int64_t* m = &meta[kMeta * kWeights * i];
    const at::Tensor& pool = pools[i];
    KV_CHECK(pool.is_contiguous() && pool.sizes() == first.sizes() && pool.scalar_type() == at::kBFloat16,
                "llama_layers: every layer's pool must be contiguous, shaped and typed as the first");
    const auto product = [&](int64_t j, const at::Tensor& in, const std::optional<at::Tensor>& add) {
      return k.qgemm.call(w[j], m[kMeta * j], m[kMeta * j + 1], m[kMeta * j + 2], in, add, -1);
    };
    at::Tensor qkv = product(0, k.rms_norm.call(x, norms[kNorms * i], eps), std::nullopt);
    KV_CHECK(qkv.is_contiguous() && qkv.size(1) == k_end + n_kv * hd,
                "llama_layers: wqkv must have (n_heads + 2 n_kv) hd rows");
    at::Tensor heads = qkv.narrow(1, 0, k_end).view({R, n_heads + n_kv, hd});
    k.rope.call(heads, cos, sin);
    const auto* src = static_cast<const uint8_t*>(qkv.data_ptr()) + q_end * 2;
    auto* dst = static_cast<uint8_t*>(pool.data_ptr());
    for (int64_t r = 0; r < R; r++)  // the cache's copy: row r's k | v to its slot
      std::memcpy(dst + slot[r] * row_bytes, src + r * qkv.stride(0) * 2, row_bytes);
    at::Tensor q = qkv.narrow(1, 0, q_end).view({R, n_heads, hd});
    at::Tensor o = k.attention.call(q, pool, tables, row_seq, row_len).view({R, q_end});
    x = product(1, o, x);
    at::Tensor gate_up = product(2, k.rms_norm.call(x, norms[kNorms * i + 1], eps), std::nullopt);
    x = product(3, k.swiglu.call(gate_up), x);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstore, m) {
  m.def("llama_layers(Tensor x, Tensor[] weights, int[] meta, Tensor[] norms, Tensor cos, Tensor sin, "
        "Tensor[] pools, Tensor slots, Tensor tables, Tensor row_seq, Tensor row_len, int n_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvstore, CPU, m) { m.impl("llama_layers", &llama_layers); }
