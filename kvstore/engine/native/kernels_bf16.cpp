// bfloat16 kernels for the Llama forward on CPUs with AVX512-BF16, or AVX2 with FMA (the same
// arithmetic on two 8-lane halves of each 16-lane step: kernels_bf16_avx2.h): one pass each where
// torch takes several, float32 inside, one rounding to bfloat16 at the end.
//
// - gemv_bf16(W [rows, n], x [n], add=None) -> [rows]: y = W x (+ add), the one-row products (the
//   decode step); gemv_rows_bf16 does it for several rows (several sessions' decode steps) in one
//   pass over the weights, each row's bits as alone. torch.mv widens every weight to float32 before its multiply-add; vdpbf16ps
//   multiplies 32 bfloat16 pairs into 16 float32 lanes in one step, and with the next rows
//   prefetched the product runs at the speed memory streams the weights.
// - rms_norm_bf16(x [..., H], weight [>= H], eps) -> [..., H]: x / sqrt(mean(x^2) + eps) * weight[:H].
// - swiglu_bf16(gate_up [..., 2F]) -> [..., F]: silu(gate) * up.
// - rope_bf16_(x [T, heads, hd] or [heads, hd], cos [T, hd], sin [T, hd]) -> x, in place:
//   x * cos + swap_halves(x) * sin (the sign of rotate_half folded into sin by the caller).
//
// Contract (kvstore/engine/native/__init__.py and kvstore/engine/ops.py rely on it):
// - Every output element is computed by one thread in a fixed order (a row's dot product or sum of
//   squares: 16 float32 lanes accumulated in steps along the row, zero-padded tail last, then the
//   lanes summed in a fixed tree), so the bits depend on the inputs alone, never on the thread
//   count or on which thread took the row. Results round once, to nearest even.
// - Inputs are bfloat16 CPU tensors; non-contiguous ones are copied first, except rope's x, which
//   is updated in place through its strides (its last dimension must be contiguous).
// - kvstore::bf16_isa() says which path the ops take: "avx512-bf16", "avx2" (bits equal to the
//   AVX512 path's but where a value is subnormal: vdpbf16ps and vcvtneps2bf16 flush those), or "" where
//   neither runs: then the kernels refuse to run. It is the CPU's best, unless a test asked for the
//   AVX2 path on an AVX512-BF16 CPU to compare the two (bf16_isa(set)).
// The row steps the ops run are in kernels_bf16.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "check.h"
#include "kernels_bf16.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace kvbf16;

std::atomic<bool> avx2_path{!avx512_bf16()};  // see bf16_isa

// The path the ops take: "avx512-bf16", "avx2" or "" (the CPU has neither). set("avx2") makes them take
// the AVX2 steps, on any CPU with AVX2, set("avx512-bf16") the AVX512-BF16 ones where the CPU has them,
// set("") the CPU's best again: for tests that compare the two on an AVX512-BF16 CPU. Returns the
// setting before; a path the CPU cannot run is refused.
std::string bf16_isa(std::optional<std::string> set) {
  const std::string before = best_bf16_isa().empty() ? "" : avx2_path.load() ? "avx2" : "avx512-bf16";
  if (set.has_value()) avx2_path.store(avx2_after("bf16_isa", *set, "avx512-bf16", avx512_bf16()));
  return before;
}

// the row steps of the path the ops take now (bf16_isa)
const Steps& path_steps() { return steps(avx2_path.load()); }

// t is a bfloat16 CPU tensor with `dims` dimensions (0: any number but none)
void check(const at::Tensor& t, const char* op, const char* what, int64_t dims = 0) {
  const bool shaped = dims > 0 ? t.dim() == dims : t.dim() >= 1;
  KV_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && shaped, op, ": ", what,
              " must be a bfloat16 CPU tensor", dims > 0 ? " with " + std::to_string(dims) + " dimension(s)" : "");
}

const uint16_t* bits(const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* bits_out(at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

// y[t, r] = W[r] . x[t] (+ add[t, r]) for R rows of x: each block of kRows weight rows meets every
// x row while it is in the cache, and every element is dot_rows' product, whatever R is
void products(const at::Tensor& w, const at::Tensor& x, int64_t R, const uint16_t* add, at::Tensor& y) {
  const int64_t rows = w.size(0), n = w.size(1);
  const uint16_t *W = bits(w), *X = bits(x);
  auto* Y = static_cast<c10::BFloat16*>(y.data_ptr());
  const int64_t blocks = (rows + kRows - 1) / kRows;
  const Steps& st = path_steps();
  at::parallel_for(0, blocks, kGrain, [&](int64_t begin, int64_t end) {
    float dots[kRows];
    for (int64_t b = begin; b < end; b++) {
      const int64_t r0 = b * kRows, count = std::min(kRows, rows - r0);
      for (int64_t t = 0; t < R; t++) {
        st.dot_rows(W + r0 * n, X + t * n, n, count, dots);
        for (int64_t i = 0; i < count; i++) {
          const float extra = add ? float(c10::BFloat16(add[t * rows + r0 + i], c10::BFloat16::from_bits())) : 0.0f;
          Y[t * rows + r0 + i] = c10::BFloat16(extra + dots[i]);
        }
      }
    }
  });
}

at::Tensor gemv_bf16(const at::Tensor& w_any, const at::Tensor& x_any, const std::optional<at::Tensor>& add_any) {
  require_isa("gemv_bf16");
  check(w_any, "gemv_bf16", "the matrix", 2);
  check(x_any, "gemv_bf16", "the vector", 1);
  const at::Tensor w = w_any.contiguous(), x = x_any.contiguous();
  const int64_t rows = w.size(0), n = w.size(1);
  KV_CHECK(x.size(0) == n, "gemv_bf16: the vector has ", x.size(0), " elements, the matrix ", n, " columns");
  at::Tensor add;
  if (add_any.has_value()) {
    check(*add_any, "gemv_bf16", "the addend", 1);
    KV_CHECK(add_any->size(0) == rows, "gemv_bf16: the addend has ", add_any->size(0), " elements, the matrix ",
                rows, " rows");
    add = add_any->contiguous();
  }
  at::Tensor y = at::empty({rows}, w.options());
  products(w, x, 1, add.defined() ? bits(add) : nullptr, y);
  return y;
}

// gemv_rows_bf16(W [rows, n], X [R, n], add [R, rows] | None) -> [R, rows]: gemv_bf16 of each row of X,
// the weights read once for all of them (each block of weight rows meets every x row while it is in
// the cache); every output element is the very dot product gemv_bf16 computes for its row alone.
at::Tensor gemv_rows_bf16(const at::Tensor& w_any, const at::Tensor& x_any, const std::optional<at::Tensor>& add_any) {
  require_isa("gemv_rows_bf16");
  check(w_any, "gemv_rows_bf16", "the matrix", 2);
  check(x_any, "gemv_rows_bf16", "the rows", 2);
  const at::Tensor w = w_any.contiguous(), x = x_any.contiguous();
  const int64_t rows = w.size(0), n = w.size(1), R = x.size(0);
  KV_CHECK(x.size(1) == n, "gemv_rows_bf16: the rows have ", x.size(1), " elements, the matrix ", n, " columns");
  at::Tensor add;
  if (add_any.has_value()) {
    check(*add_any, "gemv_rows_bf16", "the addend", 2);
    KV_CHECK(add_any->size(0) == R && add_any->size(1) == rows, "gemv_rows_bf16: the addend must be [", R, ", ",
                rows, "]");
    add = add_any->contiguous();
  }
  at::Tensor y = at::empty({R, rows}, w.options());
  products(w, x, R, add.defined() ? bits(add) : nullptr, y);
  return y;
}

at::Tensor rms_norm_bf16(const at::Tensor& x_any, const at::Tensor& w_any, double eps) {
  require_isa("rms_norm_bf16");
  check(x_any, "rms_norm_bf16", "x");
  check(w_any, "rms_norm_bf16", "the weight");
  const at::Tensor x = x_any.contiguous(), w = w_any.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  KV_CHECK(w.numel() >= H, "rms_norm_bf16: the weight has ", w.numel(), " elements, fewer than ", H);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const uint16_t *X = bits(x), *W = bits(w);
  uint16_t* O = bits_out(out);
  const Steps& st = path_steps();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) st.rms_norm_row(X + r * H, W, O + r * H, H, float(eps), 0, H);
  });
  return out;
}

at::Tensor swiglu_bf16(const at::Tensor& gu_any) {
  require_isa("swiglu_bf16");
  check(gu_any, "swiglu_bf16", "gate_up");
  const at::Tensor gu = gu_any.contiguous();
  KV_CHECK(gu.size(-1) % 2 == 0, "swiglu_bf16: the last dimension (gate | up) must be even");
  const int64_t F = gu.size(-1) / 2, rows = gu.numel() / std::max<int64_t>(2 * F, 1);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = F;
  at::Tensor out = at::empty(shape, gu.options());
  const uint16_t* G = bits(gu);
  uint16_t* O = bits_out(out);
  const Steps& st = path_steps();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) st.swiglu_row(G + r * 2 * F, G + r * 2 * F + F, O + r * F, F);
  });
  return out;
}

at::Tensor& rope_bf16_(at::Tensor& x, const at::Tensor& cos_any, const at::Tensor& sin_any) {
  require_isa("rope_bf16_");
  check(x, "rope_bf16_", "x");
  check(cos_any, "rope_bf16_", "cos");
  check(sin_any, "rope_bf16_", "sin");
  KV_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1 && x.size(-1) % 2 == 0,
              "rope_bf16_: x must be [T, heads, hd] or [heads, hd] with contiguous rows of even length");
  const int64_t T = x.dim() == 3 ? x.size(0) : 1, heads = x.size(-2), hd = x.size(-1);
  const int64_t st = x.dim() == 3 ? x.stride(0) : 0, sh = x.stride(-2);
  const at::Tensor cos = cos_any.contiguous(), sin = sin_any.contiguous();
  KV_CHECK(cos.numel() == T * hd && sin.numel() == T * hd, "rope_bf16_: cos and sin must hold ", T, " rows of ",
              hd);
  uint16_t* X = bits_out(x);
  const uint16_t *C = bits(cos), *S = bits(sin);
  const Steps& path = path_steps();  // (st is the token stride here)
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++)
      for (int64_t h = 0; h < heads; h++) path.rope_head(X + t * st + h * sh, C + t * hd, S + t * hd, hd);
  });
  return x;
}

}  // namespace

TORCH_LIBRARY(kvstore, m) {
  m.def("avx512_bf16() -> bool", &avx512_bf16);
  m.def("bf16_isa(str? set=None) -> str", &bf16_isa);
  m.def("gemv_bf16(Tensor w, Tensor x, Tensor? add=None) -> Tensor");
  m.def("gemv_rows_bf16(Tensor w, Tensor x, Tensor? add=None) -> Tensor");
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("swiglu_bf16(Tensor gate_up) -> Tensor");
  m.def("rope_bf16_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(kvstore, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_rows_bf16", &gemv_rows_bf16);
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("swiglu_bf16", &swiglu_bf16);
  m.impl("rope_bf16_", &rope_bf16_);
}
