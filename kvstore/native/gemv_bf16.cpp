// y = W x (+ add) for a bfloat16 matrix W [rows, n] and vector x [n]: the decode step's products.
//
// torch.mv on bfloat16 widens every weight to float32 before its multiply-add; on a CPU with
// AVX512-BF16 the vdpbf16ps instruction multiplies 32 bfloat16 pairs and adds them into 16 float32
// lanes in one step, and with the next rows prefetched the product runs at the speed memory streams
// the weights (a decode step reads every weight once).
//
// Contract (kvstore/native/__init__.py relies on it):
// - y[r] = bfloat16(add[r] + dot(W[r], x)), rounded once to nearest even. The dot product is one
//   thread's: 16 float32 lanes accumulated over n in steps of 32 (a zero-padded tail last), then the
//   lanes summed in a fixed tree. So the bits depend on W, x and add alone, never on the thread count
//   or on which thread took the row.
// - W, x and add (when given, [rows]) are bfloat16 CPU tensors; non-contiguous ones are copied first.
// - kvstore::avx512_bf16() says whether this CPU has the instructions; gemv_bf16 refuses to run
//   without them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kRows = 4;    // rows per block: four dot products in flight
constexpr int64_t kAhead = 4;   // prefetch the rows this many rows ahead (the next block)
constexpr int64_t kGrain = 16;  // blocks: a thread takes at least this many
constexpr int64_t kStep = 32;   // bfloat16 pairs per vdpbf16ps

#define KV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

KV_AVX512_BF16 inline __m512bh load(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// dot products of `count` (1..kRows) consecutive rows starting at w with x, into out[0..count)
KV_AVX512_BF16 void dot_rows(const uint16_t* w, const uint16_t* x, int64_t n, int64_t count, float* out) {
  __m512 acc[kRows];
  for (int64_t i = 0; i < kRows; i++) acc[i] = _mm512_setzero_ps();
  const __mmask32 all = ~__mmask32(0);
  for (int64_t k = 0; k < n; k += kStep) {
    const __mmask32 mask = n - k >= kStep ? all : ((__mmask32(1) << (n - k)) - 1);
    const __m512bh xv = load(x + k, mask);
    for (int64_t i = 0; i < count; i++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (i + kAhead) * n + k), _MM_HINT_T0);
      acc[i] = _mm512_dpbf16_ps(acc[i], load(w + i * n + k, mask), xv);
    }
  }
  for (int64_t i = 0; i < count; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

bool avx512_bf16() {
  static const bool present = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return present;
}

void check(const at::Tensor& t, int64_t dims, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == dims,
              "gemv_bf16: ", what, " must be a bfloat16 CPU tensor with ", dims, " dimension(s)");
}

at::Tensor gemv_bf16(const at::Tensor& w_any, const at::Tensor& x_any, const std::optional<at::Tensor>& add_any) {
  TORCH_CHECK(avx512_bf16(), "gemv_bf16: this CPU has no AVX512-BF16 instructions");
  check(w_any, 2, "the matrix");
  check(x_any, 1, "the vector");
  const at::Tensor w = w_any.contiguous(), x = x_any.contiguous();
  const int64_t rows = w.size(0), n = w.size(1);
  TORCH_CHECK(x.size(0) == n, "gemv_bf16: the vector has ", x.size(0), " elements, the matrix ", n, " columns");
  at::Tensor add;
  if (add_any.has_value()) {
    check(*add_any, 1, "the addend");
    TORCH_CHECK(add_any->size(0) == rows, "gemv_bf16: the addend has ", add_any->size(0), " elements, the matrix ",
                rows, " rows");
    add = add_any->contiguous();
  }
  const auto* base = add.defined() ? static_cast<const uint16_t*>(add.data_ptr()) : nullptr;
  at::Tensor y = at::empty({rows}, w.options());
  const auto* W = static_cast<const uint16_t*>(w.data_ptr());
  const auto* X = static_cast<const uint16_t*>(x.data_ptr());
  auto* Y = static_cast<c10::BFloat16*>(y.data_ptr());
  const int64_t blocks = (rows + kRows - 1) / kRows;
  at::parallel_for(0, blocks, kGrain, [&](int64_t begin, int64_t end) {
    float dots[kRows];
    for (int64_t b = begin; b < end; b++) {
      const int64_t r0 = b * kRows, count = std::min(kRows, rows - r0);
      dot_rows(W + r0 * n, X, n, count, dots);
      for (int64_t i = 0; i < count; i++) {
        const float extra = base ? float(c10::BFloat16(base[r0 + i], c10::BFloat16::from_bits())) : 0.0f;
        Y[r0 + i] = c10::BFloat16(extra + dots[i]);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(kvstore, m) {
  m.def("avx512_bf16() -> bool", &avx512_bf16);
  m.def("gemv_bf16(Tensor w, Tensor x, Tensor? add=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvstore, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
}
