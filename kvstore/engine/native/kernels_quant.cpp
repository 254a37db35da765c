// The ops of the block-quantized products; their arithmetic, its contract and the packed layout are in
// qgemm.h (which layers.cpp shares).
//
// qgemm(w, kind, rows, cols, x [T, cols], add=None, isa=-1) -> y [T, rows] (x's dtype: bf16 or f32)
//   y[t, r] = round(sum_b term(t, r, b) (+ add[t or 0, r]))
// qembed(w, kind, rows, cols, ids [n], dtype) -> [n, cols]: rows of the matrix, dequantized (an
//   embedding table kept quantized): GGUF's values, d * (q - 8), d * q + m or d * q in float32.
// quant_isa() -> the best path for one row ("" where the CPU lacks AVX2 and F16C); quant_paths() -> the
// paths this CPU runs (qgemm's `isa`: 0 AVX2, 1 AVX-VNNI, 2 AVX512-VNNI, 3 AMX-INT8).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check.h"
#include "qgemm.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace kvq;

at::Tensor qgemm(const at::Tensor& w_any, int64_t kind, int64_t rows, int64_t cols, const at::Tensor& x_any,
                 const std::optional<at::Tensor>& add_any, int64_t isa) {
  isa = isa_for(isa, x_any.dim() == 2 ? x_any.size(0) : 0);
  check_isa(isa);
  KV_CHECK(kind == Q4_0 || kind == Q4_1 || kind == Q8_0, "qgemm: unknown block kind ", kind);
  KV_CHECK(rows > 0 && cols > 0 && cols % kBlock == 0, "qgemm: cols must be a positive multiple of ", kBlock);
  const int64_t groups = (rows + kLanes - 1) / kLanes, nb = cols / kBlock, RB = record_bytes(kind);
  KV_CHECK(w_any.device().is_cpu() && w_any.scalar_type() == at::kByte && w_any.numel() == groups * nb * RB,
              "qgemm: the packed weights must be a uint8 CPU tensor of ", groups * nb * RB, " bytes");
  KV_CHECK(x_any.device().is_cpu() && x_any.dim() == 2 && x_any.size(1) == cols &&
                  (x_any.scalar_type() == at::kBFloat16 || x_any.scalar_type() == at::kFloat),
              "qgemm: x must be a [T, ", cols, "] bfloat16 or float32 CPU tensor");
  const at::Tensor w = w_any.contiguous(), x = x_any.contiguous();
  const int64_t T = x.size(0);
  at::Tensor add;
  if (add_any.has_value()) {
    add = add_any->contiguous();
    KV_CHECK(add.scalar_type() == x.scalar_type() && (add.numel() == rows || add.numel() == T * rows),
                "qgemm: the addend must be [rows] or [T, rows] in x's dtype");
  }
  at::Tensor y = at::empty({T, rows}, x.options());
  if (T == 0) return y;
  at::Tensor act = at::empty({act_bytes(isa, T, cols)}, x.options().dtype(at::kByte));
  uint8_t* A = act.data_ptr<uint8_t>();
  clear_missing_rows(isa, T, cols, A);
  // the tensors' memory, taken once: data_ptr<T>() checks the type at every call
  const Product p = product_of(w.data_ptr<uint8_t>(), kind, rows, cols, isa, T, x.data_ptr(),
                               x.scalar_type() == at::kBFloat16, A, add.defined() ? add.data_ptr() : nullptr,
                               add.defined() && add.numel() == T * rows && T > 1, y.data_ptr());
  // 1. every activation row quantized once
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) { quantize_rows(p, begin, end); });
  // 2. the row groups, one fixed share per thread. Tried and dropped: handing them out in runs (4 per
  //    thread, each thread taking the next run as it came free, as attention_rows hands out its units),
  //    so that a thread stopped by another process (a server's API process and clients share the two
  //    cores) would leave its work to the other. Alternated against this split (Intel Xeon with AMX,
  //    2 threads): a batched decode step of 8 paged sessions at 512 positions took 1.01-1.03x the
  //    time, and `kvstore serve` decoded no faster at 1 or 8 sessions (3 rounds each).
  // Per thread, a row group's B tiles (AMX with Q4 weights), 64-byte aligned for the stores that make
  // them (none on the other paths: a decode step's products allocate nothing more).
  at::Tensor b_memory;
  uint8_t* b_all = nullptr;
  if (p.b_bytes) {
    b_memory = at::empty({at::get_num_threads() * p.b_bytes + 64}, x.options().dtype(at::kByte));
    b_all = b_memory.data_ptr<uint8_t>() + (64 - reinterpret_cast<uintptr_t>(b_memory.data_ptr()) % 64) % 64;
  }
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    row_groups(p, begin, end, b_all ? b_all + at::get_thread_num() * p.b_bytes : nullptr);
  });
  return y;
}

// rows `ids` of a packed matrix, dequantized (GGUF's values: float32 math, then the output dtype)
at::Tensor qembed(const at::Tensor& w_any, int64_t kind, int64_t rows, int64_t cols, const at::Tensor& ids_any,
                  at::ScalarType dtype) {
  KV_CHECK(kind == Q4_0 || kind == Q4_1 || kind == Q8_0, "qembed: unknown block kind ", kind);
  KV_CHECK(rows > 0 && cols > 0 && cols % kBlock == 0, "qembed: cols must be a positive multiple of ", kBlock);
  KV_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "qembed: the output is bfloat16 or float32");
  const int64_t groups = (rows + kLanes - 1) / kLanes, nb = cols / kBlock, RB = record_bytes(kind), QB = quant_bytes(kind);
  KV_CHECK(w_any.device().is_cpu() && w_any.scalar_type() == at::kByte && w_any.numel() == groups * nb * RB,
              "qembed: the packed weights must be a uint8 CPU tensor of ", groups * nb * RB, " bytes");
  const at::Tensor w = w_any.contiguous(), ids = ids_any.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  const int64_t* I = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++) KV_CHECK(I[i] >= 0 && I[i] < rows, "qembed: row ", I[i], " is not in [0, ", rows, ")");
  at::Tensor y = at::empty({n, cols}, w.options().dtype(dtype));
  const uint8_t* W = w.data_ptr<uint8_t>();
  void* const y_data = y.data_ptr();  // once (data_ptr<T>() checks the type at every call)
  for (int64_t i = 0; i < n; i++) {
    const int64_t g = I[i] / kLanes, lane = I[i] % kLanes;
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* rec = W + (g * nb + b) * RB;
      const float d = float(c10::Half(*reinterpret_cast<const uint16_t*>(rec + QB + 2 * lane), c10::Half::from_bits()));
      const float m = kind == Q4_1 ? float(c10::Half(*reinterpret_cast<const uint16_t*>(rec + QB + 32 + 2 * lane),
                                                     c10::Half::from_bits())) : 0.0f;
      float v[kBlock];
      for (int64_t e = 0; e < kBlock; e++) {
        if (kind == Q8_0) {
          v[e] = float(int8_t(rec[64 * (e / 4) + 4 * lane + e % 4] ^ 0x80)) * d;
        } else {
          const uint8_t byte = rec[64 * ((e % 16) / 4) + 4 * lane + e % 4];
          const int q = e < 16 ? byte & 0x0F : byte >> 4;
          v[e] = kind == Q4_0 ? float(q - 8) * d : float(q) * d + m;
        }
      }
      for (int64_t e = 0; e < kBlock; e++) {
        if (dtype == at::kBFloat16) static_cast<c10::BFloat16*>(y_data)[i * cols + b * kBlock + e] = c10::BFloat16(v[e]);
        else static_cast<float*>(y_data)[i * cols + b * kBlock + e] = v[e];
      }
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstore, m) {
  m.def("quant_isa() -> str", &quant_isa);
  m.def("quant_paths() -> int[]", &quant_paths);
  m.def("qgemm(Tensor w, int kind, int rows, int cols, Tensor x, Tensor? add=None, int isa=-1) -> Tensor");
  m.def("qembed(Tensor w, int kind, int rows, int cols, Tensor ids, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvstore, CPU, m) {
  m.impl("qgemm", &qgemm);
  m.impl("qembed", &qembed);
}
