// llama_layers: the layer stack of a Llama forward (models/llama.py) in one call, for block-quantized
// weights without biases over a paged bfloat16 KV cache: the loop Python runs (`Llama._rows`), with
// the same kernels' steps in the same order on the same arguments. So the same bits; what it saves is
// Python's dispatch between the kernels, ten calls a layer, and the threads' fork and join around each
// of them: the whole stack runs in one parallel region, its threads meeting at a barrier between
// steps, where the kernels called one by one start a region each (about 150 a decode step).
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
// The steps are the ones the ops kvstore::qgemm, rms_norm_bf16, rope_bf16_, swiglu_bf16 and
// attention_rows run (qgemm.h, kernels_bf16.h, attention_rows.h: this file holds no arithmetic of its
// own), each phase shared out among the threads as the op shares it (rows, row groups, attention
// units), every output element computed by one thread in its fixed order: the bits of the ops called
// one by one, whatever the thread count (tests/test_native_layers.py).
// Everything the threads write is allocated and every argument checked before the region starts.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <omp.h>

#include "attention_rows.h"
#include "check.h"
#include "kernels_bf16.h"
#include "qgemm.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kWeights = 4, kNorms = 2, kMeta = 3;  // per layer: wqkv, wo, w_gate_up, w_down; 2 norms
constexpr int64_t kRowGrain = 16;  // rows a thread takes at least, as the row-wise ops share them

// [begin, end) of n items for thread `tid` of `team`, as at::parallel_for shares them with this grain
std::pair<int64_t, int64_t> share(int64_t n, int64_t grain, int64_t tid, int64_t team) {
  const int64_t used = std::max<int64_t>(1, std::min(team, (n + grain - 1) / grain));
  const int64_t chunk = (n + used - 1) / used, begin = std::min(n, tid * chunk);
  return {begin, std::min(n, begin + chunk)};
}

// whether attention_rows' scores and values take vdpbf16ps now (attention.cpp holds the setting,
// which tests switch): asked at each call
bool attention_dot_bf16() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvstore::attention_dot_bf16", "")
                             .typed<bool(std::optional<bool>)>();
  return op.call(std::nullopt);
}

// whether the attention's and the bfloat16 ops' AVX2 steps run now (their settings, held by
// attention.cpp and kernels_bf16.cpp, which tests switch): asked at each call
using PathSetting = c10::TypedOperatorHandle<std::string(std::optional<std::string>)>;
PathSetting path_setting(const char* op) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(op, "").typed<std::string(std::optional<std::string>)>();
}
bool avx2_attention() {
  static const PathSetting op = path_setting("kvstore::attention_isa");
  return op.call(std::nullopt) == "avx2";
}
bool avx2_bf16() {
  static const PathSetting op = path_setting("kvstore::bf16_isa");
  return op.call(std::nullopt) == "avx2";
}

void check_bf16(const at::Tensor& t, const char* what) {
  KV_CHECK(t.is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(), "llama_layers: ", what,
              " must be a contiguous bfloat16 CPU tensor");
}

at::Tensor llama_layers(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef meta, at::TensorList norms,
                        const at::Tensor& cos_any, const at::Tensor& sin_any, at::TensorList pools,
                        const at::Tensor& slots_any, const at::Tensor& tables, const at::Tensor& row_seq,
                        const at::Tensor& row_len, int64_t n_heads, double eps) {
  // ---- the arguments, checked: the phases below check nothing ----
  const int64_t n_layers = int64_t(pools.size());
  KV_CHECK(n_layers > 0 && int64_t(weights.size()) == kWeights * n_layers &&
                  int64_t(meta.size()) == kMeta * kWeights * n_layers && int64_t(norms.size()) == kNorms * n_layers,
              "llama_layers: per layer 4 weights (12 meta ints), 2 norms and 1 pool");
  KV_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.is_cpu(),
              "llama_layers: x must be [R, hidden] bfloat16 on the CPU");
  KV_CHECK(kvbf16::avx512_bf16() || has_avx2(), "llama_layers: this CPU has neither AVX512-BF16 nor AVX2 with FMA");
  KV_CHECK(*kvattn::isa(), "llama_layers: this CPU has neither AVX512 (F, BW, VL) nor AVX2 with FMA");
  const int64_t R = x_in.size(0), H = x_in.size(1);
  const at::Tensor slots = slots_any.contiguous(), cos = cos_any.contiguous(), sin = sin_any.contiguous();
  KV_CHECK(slots.scalar_type() == at::kLong && slots.numel() == R, "llama_layers: slots must be int64 [R]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const at::Tensor& first = pools[0];
  KV_CHECK(first.dim() == 5 && first.scalar_type() == at::kBFloat16,
              "llama_layers: a pool is [n_blocks, block_tokens, 2, n_kv, hd] bfloat16");
  const int64_t n_kv = first.size(3), hd = first.size(4), pool_rows = first.size(0) * first.size(1);
  KV_CHECK(n_heads > 0 && n_heads % n_kv == 0, "llama_layers: ", n_heads, " heads cannot share ", n_kv, " KV heads");
  const int64_t q_end = n_heads * hd, k_end = (n_heads + n_kv) * hd, QKV = k_end + n_kv * hd;
  const int64_t row_bytes = 2 * n_kv * hd * 2;
  for (int64_t r = 0; r < R; r++)
    KV_CHECK(slot[r] >= 0 && slot[r] < pool_rows, "llama_layers: slot ", slot[r], " is outside the pool's ", pool_rows,
                " rows");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  KV_CHECK(cos.numel() == R * hd && sin.numel() == R * hd, "llama_layers: cos and sin must hold ", R, " rows of ", hd);
  const int64_t isa = kvq::isa_for(-1, R);  // every product's path: qgemm's choice for R rows
  kvq::check_isa(isa);
  int64_t F = 0;  // the MLP's width
  for (int64_t i = 0; i < n_layers; i++) {
    const at::Tensor& pool = pools[i];
    KV_CHECK(pool.is_contiguous() && pool.sizes() == first.sizes() && pool.scalar_type() == at::kBFloat16 && pool.is_cpu(),
                "llama_layers: every layer's pool must be contiguous, shaped and typed as the first");
    for (int64_t j = 0; j < kWeights; j++) {
      const at::Tensor& w = weights[kWeights * i + j];
      const int64_t* m = &meta[kMeta * (kWeights * i + j)];
      const int64_t kind = m[0], rows = m[1], cols = m[2];
      KV_CHECK(kind == kvq::Q4_0 || kind == kvq::Q4_1 || kind == kvq::Q8_0, "llama_layers: unknown block kind ", kind);
      KV_CHECK(rows > 0 && cols > 0 && cols % kvq::kBlock == 0, "llama_layers: cols must be a positive multiple of ",
                  kvq::kBlock);
      const int64_t bytes = (rows + kvq::kLanes - 1) / kvq::kLanes * (cols / kvq::kBlock) * kvq::record_bytes(kind);
      KV_CHECK(w.is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == bytes,
                  "llama_layers: layer ", i, "'s weight ", j, " must be a contiguous uint8 CPU tensor of ", bytes, " bytes");
      if (j == 2) F = rows / 2;
      const int64_t want_rows[] = {QKV, H, 2 * F, H}, want_cols[] = {H, q_end, H, F};
      KV_CHECK(rows == want_rows[j] && cols == want_cols[j] && (j != 2 || rows % 2 == 0), "llama_layers: layer ", i,
                  "'s weight ", j, " is [", rows, ", ", cols, "]; the stack needs [", want_rows[j], ", ", want_cols[j],
                  "] (wqkv, wo, w_gate_up, w_down for hidden ", H, ", ", n_heads, " heads, ", n_kv, " KV heads of ", hd, ")");
    }
    for (int64_t j = 0; j < kNorms; j++) {
      check_bf16(norms[kNorms * i + j], "a norm weight");
      KV_CHECK(norms[kNorms * i + j].numel() >= H, "llama_layers: a norm weight has fewer than ", H, " elements");
    }
  }

  // ---- what the threads write, allocated ----
  const auto bf16 = x_in.options().dtype(at::kBFloat16);
  at::Tensor x = x_in.clone(at::MemoryFormat::Contiguous);  // [R, H]: updated in place, layer by layer
  at::Tensor normed = at::empty({R, H}, bf16);               // [R, H]: rms_norm's rows
  at::Tensor qkv = at::empty({R, QKV}, bf16);                // [R, QKV]: q | k | v
  at::Tensor o = at::empty({R, n_heads, hd}, bf16);          // [R, n_heads, hd]: the attention's output
  at::Tensor gate_up = at::empty({R, 2 * F}, bf16);          // [R, 2F]
  at::Tensor mid = at::empty({R, F}, bf16);                  // [R, F]: swiglu's
  if (R == 0) return x;
  std::map<int64_t, at::Tensor> acts;  // the quantized rows of each product input's width (zero rows stay zero)
  for (int64_t cols : {H, q_end, F}) {
    if (acts.count(cols)) continue;
    acts[cols] = at::empty({kvq::act_bytes(isa, R, cols)}, x.options().dtype(at::kByte));
    kvq::clear_missing_rows(isa, R, cols, acts[cols].data_ptr<uint8_t>());
  }
  const int64_t threads = at::get_num_threads();
  const int64_t b_bytes = std::max({kvq::b_tile_bytes(isa, kvq::Q4_0, H), kvq::b_tile_bytes(isa, kvq::Q4_0, q_end),
                                    kvq::b_tile_bytes(isa, kvq::Q4_0, F)});
  at::Tensor b_memory = at::empty({threads * b_bytes + 64}, x.options().dtype(at::kByte));
  uint8_t* b_all = b_memory.data_ptr<uint8_t>() + (64 - reinterpret_cast<uintptr_t>(b_memory.data_ptr()) % 64) % 64;
  auto* X = static_cast<uint16_t*>(x.data_ptr());
  auto* XN = static_cast<uint16_t*>(normed.data_ptr());
  auto* Q = static_cast<uint16_t*>(qkv.data_ptr());
  auto* GU = static_cast<uint16_t*>(gate_up.data_ptr());
  auto* MID = static_cast<uint16_t*>(mid.data_ptr());
  const auto* COS = static_cast<const uint16_t*>(cos.data_ptr());
  const auto* SIN = static_cast<const uint16_t*>(sin.data_ptr());
  std::vector<kvq::Product> products;  // per layer: wqkv, wo, w_gate_up, w_down
  products.reserve(kWeights * n_layers);
  for (int64_t i = 0; i < n_layers; i++) {
    const void* in[] = {XN, o.data_ptr(), XN, MID};
    void* out[] = {Q, X, GU, X};
    const void* add[] = {nullptr, X, nullptr, X};  // the residual: x += the product, in place
    for (int64_t j = 0; j < kWeights; j++) {
      const int64_t* m = &meta[kMeta * (kWeights * i + j)];
      products.push_back(kvq::product_of(weights[kWeights * i + j].data_ptr<uint8_t>(), m[0], m[1], m[2], isa, R,
                                         in[j], true, acts[m[2]].data_ptr<uint8_t>(), add[j], add[j] && R > 1, out[j]));
    }
  }
  // the attention: one plan for every layer (it depends on the rows and tables, not on the cache)
  at::Tensor q_view = qkv.narrow(1, 0, q_end).view({R, n_heads, hd});
  Problem pb = kvattn::problem(q_view, first, tables, row_seq, row_len, attention_dot_bf16(),
                                avx2_attention());
  pb.out = static_cast<uint16_t*>(o.data_ptr());
  const kvattn::Plan plan = kvattn::plan_of(pb, R, threads);
  at::Tensor layout_memory = at::empty({std::max<int64_t>(plan.layout_total, 1)}, x.options().dtype(at::kInt));
  auto* layouts = static_cast<uint32_t*>(layout_memory.data_ptr());
  at::Tensor scratch = at::empty({plan.scratch_records * pb.record()}, x.options().dtype(at::kFloat));
  float* partials = scratch.data_ptr<float>();
  std::vector<Work> works;
  works.reserve(threads);
  for (int64_t t = 0; t < threads; t++) works.emplace_back(plan.queries, pb.hd, pb.record(), pb.n_kv);
  // per layer, the next item of each attention phase (taken by threads as they come free, as attention_rows does)
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[3 * n_layers]);
  for (int64_t k = 0; k < 3 * n_layers; k++) next[k].store(0);
  const kvbf16::Steps& bf = kvbf16::steps(avx2_bf16());
  const float eps_f = float(eps);
  const int64_t n_groups = int64_t(plan.groups.size()), n_units = int64_t(plan.units.size()),
                n_folds = int64_t(plan.folds.size());

  // ---- the stack: one parallel region, a barrier after each step ----
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
    const auto [rb, re] = share(R, kRowGrain, tid, team);  // this thread's rows in the row-wise steps
    const bool few_rows = team > 1 && R < kRowGrain * team;
    uint8_t* b_mine = b_bytes ? b_all + tid * b_bytes : nullptr;
    Work& w = works[tid];
    const auto groups = [&](const kvq::Product& p) {  // this thread's row groups of a product
      const auto [gb, ge] = share(p.groups, 1, tid, team);
      kvq::row_groups(p, gb, ge, b_mine);
    };
    // this thread's part of a row-wise step over rows of `cols` columns: fn(row, c0, c1) for columns
    // c0..c1-1. Whole rows (rb..re) where there are enough for every thread; else, fewer rows than
    // that (a decode step's one row, a batch's few), every row's quant blocks shared out instead, so
    // that no thread waits while one does them all
    const auto row_parts = [&](int64_t cols, const auto& fn) {
      if (!few_rows) {
        for (int64_t r = rb; r < re; r++) fn(r, 0, cols);
        return;
      }
      const auto [b0, b1] = share(cols / kvq::kBlock, 1, tid, team);
      for (int64_t r = 0; r < R && b1 > b0; r++) fn(r, b0 * kvq::kBlock, std::min(b1 * kvq::kBlock, cols));
    };
    const auto normed = [&](const at::Tensor& norm, const kvq::Product& p) {  // p's input: rms_norm(x), quantized
      const auto* weight = static_cast<const uint16_t*>(norm.data_ptr());
      row_parts(H, [&](int64_t r, int64_t c0, int64_t c1) {
        bf.rms_norm_row(X + r * H, weight, XN + r * H, H, eps_f, c0, c1);
        kvq::quantize_blocks(p, r, c0 / kvq::kBlock, c1 / kvq::kBlock);
      });
    };
    for (int64_t i = 0; i < n_layers; i++) {
      const kvq::Product* P = &products[kWeights * i];
      normed(norms[kNorms * i], P[0]);  // 1. qkv's input
#pragma omp barrier
      groups(P[0]);  // 2. qkv = wqkv . normed
#pragma omp barrier
      // 3. rope on each row's q and k heads, then its k | v into the cache
      auto* dst = static_cast<uint8_t*>(pools[i].data_ptr());
      for (int64_t r = rb; r < re; r++) {
        for (int64_t h = 0; h < n_heads + n_kv; h++) bf.rope_head(Q + r * QKV + h * hd, COS + r * hd, SIN + r * hd, hd);
        std::memcpy(dst + slot[r] * row_bytes, Q + r * QKV + q_end, row_bytes);
      }
#pragma omp barrier
      // Tried and dropped (AMD EPYC Zen 4, 2 threads, one decode row at 1,024 positions, alternated in one
      // process, the same bits): each thread prefetching its share of the next three products' weights
      // (wo, w_gate_up, w_down) into L2 at the attention's prefetch slots, so that they would come from
      // memory while the attention computes (its arithmetic bounds it there: attention_rows.h). Its whole
      // share took 1.23-1.29x the step's time, a fifth or a half of it 1.04-1.13x, 1 to 8 lines a slot
      // 0.95-1.09x (within the noise). Not measured why; a guess: what the prefetches bring pushes the
      // cache rows the attention reads next out of L2.
      {  // 4. the attention of each row's q over its sequence's cache: attention_rows' three phases
        const FlushSubnormals flush;  // the contract's rounding, for the attention only
        Problem layer = pb;
        layer.pool = static_cast<const uint16_t*>(pools[i].data_ptr());
        if (n_groups) {
          for (int64_t k; (k = next[3 * i].fetch_add(1)) < n_groups;) kvattn::lay_out(layer, plan, layouts, k);
#pragma omp barrier
        }
        for (int64_t k; (k = next[3 * i + 1].fetch_add(1)) < n_units;)
          kvattn::run_unit_at(layer, plan, partials, layouts, k, w);
#pragma omp barrier
        if (n_folds) {
          for (int64_t k; (k = next[3 * i + 2].fetch_add(1)) < n_folds;) kvattn::fold_at(layer, plan, partials, k, w);
#pragma omp barrier
        }
      }
      row_parts(q_end, [&](int64_t r, int64_t c0, int64_t c1) {  // 5. wo's input: the attention's rows, quantized
        kvq::quantize_blocks(P[1], r, c0 / kvq::kBlock, c1 / kvq::kBlock);
      });
#pragma omp barrier
      groups(P[1]);  // 6. x += wo . o
#pragma omp barrier
      normed(norms[kNorms * i + 1], P[2]);  // 7. gate_up's input
#pragma omp barrier
      groups(P[2]);  // 8. gate_up = w_gate_up . normed
#pragma omp barrier
      // 9. w_down's input: swiglu(gate_up) per row, quantized
      row_parts(F, [&](int64_t r, int64_t c0, int64_t c1) {
        bf.swiglu_row(GU + r * 2 * F + c0, GU + r * 2 * F + F + c0, MID + r * F + c0, c1 - c0);
        kvq::quantize_blocks(P[3], r, c0 / kvq::kBlock, c1 / kvq::kBlock);
      });
#pragma omp barrier
      groups(P[3]);  // 10. x += w_down . mid
#pragma omp barrier
    }
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstore, m) {
  m.def("llama_layers(Tensor x, Tensor[] weights, int[] meta, Tensor[] norms, Tensor cos, Tensor sin, "
        "Tensor[] pools, Tensor slots, Tensor tables, Tensor row_seq, Tensor row_len, int n_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvstore, CPU, m) { m.impl("llama_layers", &llama_layers); }
