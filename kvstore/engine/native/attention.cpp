// attention_rows: the attention of query rows over a paged bfloat16 KV cache, on CPUs with AVX512 or AVX2.
//
// attention_rows(q [R, n_heads, hd], pool [n_blocks, block_tokens, 2 (K, V), n_kv, hd],
//                tables [S, max_blocks] int32, row_seq [R] int32, row_len [R] int32) -> [R, n_heads, hd]
// Row r is one query of sequence s = row_seq[r], attending to its positions 0..row_len[r]-1; position
// p lives at slot p % block_tokens of block tables[s][p / block_tokens]. Query head h reads KV head
// h / (n_heads / n_kv), scores scale by 1/sqrt(hd): SDPA's grouped-query mode and default scale. A
// decode step of B sessions is B rows; a prefill chunk at positions pos..pos+T-1 is T rows of one
// sequence with row_len pos+1..pos+T (causal).
//
// Contract (bits): a row's output depends on its query, its sequence's K/V at 0..row_len-1 and
// row_len alone: not on the other rows, the thread count, the block size, the pool's size or where
// the blocks sit. Per query head, in float32, every step with subnormal inputs and results taken as 0
// (MXCSR's DAZ and FTZ, set on each thread for the call: simd.h's FlushSubnormals), which is what
// vdpbf16ps does in any case:
// - keys go in groups of 16 positions (block sizes are multiples of 16: a group lies in one block),
//   in position order, within partitions of 256 positions;
// - a group's scores: q . k over pairs of dimensions in order, pair p adding q[2p+1] k[2p+1] and then
//   q[2p] k[2p] (each product exact, each sum rounded) to one of two sums (even and odd pairs), added
//   at the end, times 1/sqrt(hd); positions >= row_len are left out. vdpbf16ps computes exactly that,
//   and so do fused multiply-adds, bit for bit (where the CPU lacks AVX512-BF16, or they are faster:
//   dot_bf16_default);
// - online softmax within a partition: m' = max(m, scores), c = e^(m - m'), p = e^(s - m') rounded
//   to bfloat16 (nearest even; below the smallest normal float32, 0), l = l c + p (16 lane sums),
//   acc = acc c + 0 (never -0), then the values by pairs of keys in position order, pair j adding
//   p_2j+1 V_2j+1 and then p_2j V_2j (each product exact, each sum rounded); pairs past the row's
//   keys are left out, and a key past them in its last pair weighs 0, which adds nothing. vdpbf16ps
//   or fused multiply-adds compute that, as for the scores. The rounded weights halve the values'
//   arithmetic; against a float64 reference the error stays that of the output's rounding (2.3e-3
//   of the largest output, as with float32 weights). The partition's partial is (m, the lanes of l
//   summed in a fixed tree, acc);
// - partials fold left to right in partition order (`fold`), and the output is acc / l, rounded once
//   to bfloat16 (nearest even).
// Rows of one sequence next to each other share each load of K and V (a tile); a sequence read by
// several tiles (a prefill chunk) has its K and V laid out for the steps once, before the tiles run;
// a long row's partitions may run on several threads, their partials folded afterwards; a partition that
// several sequences hold in the same blocks (a step's forks of one document, prefix-cache hits) and
// whose every position their rows see is read once for all of them (`Shared`). None of
// these changes a step above: the floating-point code sits in functions that are never inlined
// (group_step, fold, finish, lane_sum), so each is compiled once and every path runs the same
// instructions.
// The steps run on AVX512 (F, BW, VL: attention_steps.h) or, on CPUs without it, on AVX2 and FMA
// (attention_steps_avx2.h: the same arithmetic on two 8-lane halves of each 16-lane vector).
// kvstore::attention_isa() says which steps run ("avx512", "avx2", or "" where neither: the CPU's
// best, unless a test asked for the AVX2 steps on an AVX512 CPU to compare the two);
// kvstore::attention_dot_bf16() whether the scores and the values use vdpbf16ps (tests switch it to
// compare the two ways).
// The units, the plan and the problem's checks are in attention_rows.h (which layers.cpp shares).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check.h"
#include "attention_rows.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

namespace {

using namespace kvattn;

// Whether the scores and the values take vdpbf16ps (else fused multiply-adds: the same bits, see the
// contract): where the CPU has AVX512-BF16 and is not Intel's. On an Intel Xeon with AMX vdpbf16ps
// ran at a quarter of the rate of fused multiply-adds (1.4 against 0.36 cycles of the 2.6 GHz clock
// each, 8-12 independent sums), so the two multiply-adds that replace one take half its time:
// measured alternately against vdpbf16ps, a prefill chunk's attention (512 rows at 1,536 positions,
// one layer, 2 threads) 0.85-0.89x the time, a whole 2,048-token prefill 0.88-0.92x, one row over
// 1k positions (one thread, the cache in L2) 0.86-0.94x. AMD's Zen 4 and 5 keep vdpbf16ps, as
// their benchmarks ran; the multiply-adds were not measured against it there.
bool dot_bf16_default() {
  __builtin_cpu_init();
  return has_avx512() && __builtin_cpu_supports("avx512bf16") && !intel_cpu();
}
std::atomic<bool> dot_bf16{dot_bf16_default()};  // see attention_dot_bf16
std::atomic<bool> avx2_steps{!has_avx512()};      // see attention_isa

// runs body(i, work) for i in 0..n-1, each on some thread, threads taking the next i as they finish
template <typename F>
void each(int64_t n, int64_t queries, const Problem& pb, const F& body) {
  std::atomic<int64_t> next{0};
  const auto run = [&](int64_t, int64_t) {
    const FlushSubnormals flush;  // the contract's rounding, on each thread that computes
    Work w(queries, pb.hd, pb.record(), pb.n_kv);
    for (int64_t i; (i = next.fetch_add(1)) < n;) body(i, w);
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) return run(0, 1);  // no parallel region: its threads would only wake to wait
  at::parallel_for(0, threads, 1, run);
}

at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables,
                          const at::Tensor& row_seq, const at::Tensor& row_len) {
  KV_CHECK(*isa(), "attention_rows: this CPU has neither AVX512 (F, BW, VL) nor AVX2 with FMA");
  Problem pb = problem(q, pool, tables, row_seq, row_len, dot_bf16.load(), avx2_steps.load());
  const int64_t R = q.size(0);
  at::Tensor out = at::empty({R, pb.n_heads, pb.hd}, q.options());
  pb.out = static_cast<uint16_t*>(out.data_ptr());
  if (R == 0) return out;
  const Plan plan = plan_of(pb, R, at::get_num_threads());
  at::Tensor layout_memory = plan.layout_total ? at::empty({plan.layout_total}, q.options().dtype(at::kInt)) : at::Tensor();
  uint32_t* layouts = plan.layout_total ? static_cast<uint32_t*>(layout_memory.data_ptr()) : nullptr;
  at::Tensor scratch = at::empty({plan.scratch_records * pb.record()}, q.options().dtype(at::kFloat));
  float* partials = scratch.data_ptr<float>();
  if (!plan.groups.empty())  // (a decode step has none: no threads woken, no working memory for them)
    each(int64_t(plan.groups.size()), plan.queries, pb, [&](int64_t i, Work&) { lay_out(pb, plan, layouts, i); });
  each(int64_t(plan.units.size()), plan.queries, pb,
       [&](int64_t i, Work& w) { run_unit_at(pb, plan, partials, layouts, i, w); });
  if (plan.folds.empty()) return out;
  each(int64_t(plan.folds.size()), plan.queries, pb, [&](int64_t i, Work& w) { fold_at(pb, plan, partials, i, w); });
  return out;
}

// The steps attention_rows runs: "avx512", "avx2" or "" (the CPU has neither). set("avx2") makes it
// run the AVX2 steps, on any CPU with AVX2, set("avx512") the AVX512 ones where the CPU has them,
// set("") the CPU's best again: for tests that compare the two (the same bits) on an AVX512 CPU.
// Returns the setting before; a name the CPU cannot run is refused.
std::string attention_isa(std::optional<std::string> set) {
  const std::string before = !*isa() ? "" : avx2_steps.load() ? "avx2" : "avx512";
  if (set.has_value()) avx2_steps.store(avx2_after("attention_isa", *set, "avx512", has_avx512()));
  return before;
}

// Whether the scores and the values use vdpbf16ps (by default: dot_bf16_default); set(true) makes
// them take it where the CPU has it, set(false) the fused multiply-adds, for tests that compare the two
// and benchmarks. Returns the setting before.
bool attention_dot_bf16(std::optional<bool> set) {
  static const bool present = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  const bool before = dot_bf16.load();
  if (set.has_value()) dot_bf16.store(*set && present);
  return before;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstore, m) {
  m.def("attention_isa(str? set=None) -> str", &attention_isa);
  m.def("attention_dot_bf16(bool? set=None) -> bool", &attention_dot_bf16);
  m.def("attention_rows(Tensor q, Tensor pool, Tensor tables, Tensor row_seq, Tensor row_len) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvstore, CPU, m) { m.impl("attention_rows", &attention_rows); }
