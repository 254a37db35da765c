// kernels_bf16.h: the row steps of the bfloat16 kernels (kernels_bf16.cpp holds the ops and states
// their contract; layers.cpp shares these steps): dot products of weight rows, rms_norm, swiglu and
// rope, on AVX512-BF16 or, on CPUs without it, AVX2 with FMA (kernels_bf16_avx2.h).
#pragma once
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include "check.h"
#include "kernels_bf16_avx2.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <string>

namespace {
namespace kvbf16 {

constexpr int64_t kRows = 4;    // rows per block: four dot products in flight
constexpr int64_t kAhead = 4;   // prefetch the rows this many rows ahead (the next block)
constexpr int64_t kGrain = 16;  // blocks: a thread takes at least this many
constexpr int64_t kStep = 32;   // bfloat16 pairs per vdpbf16ps


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
    return has_avx512() && __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return present;
}

// the best path this CPU has
std::string best_bf16_isa() { return avx512_bf16() ? "avx512-bf16" : has_avx2() ? "avx2" : ""; }

void require_isa(const char* op) {
  KV_CHECK(avx512_bf16() || has_avx2(), op, ": this CPU has neither AVX512-BF16 nor AVX2 with FMA");
}

// The row steps of this CPU's path (see bf16_isa).
struct Steps {
  void (*dot_rows)(const uint16_t*, const uint16_t*, int64_t, int64_t, float*);
  // columns c0..c1-1 of the row (c0 a multiple of 16; the scale from the whole row, so the same bits)
  void (*rms_norm_row)(const uint16_t*, const uint16_t*, uint16_t*, int64_t, float, int64_t, int64_t);
  void (*swiglu_row)(const uint16_t*, const uint16_t*, uint16_t*, int64_t);
  void (*rope_head)(uint16_t*, const uint16_t*, const uint16_t*, int64_t);
};

// the AVX2 steps where avx2 (the CPU lacks AVX512-BF16, or a test asked: bf16_isa), else AVX512-BF16's
const Steps& steps(bool avx2);

// ---- elementwise kernels: float32 lanes in, bfloat16 out -----------------------------------------

KV_AVX512_BF16 inline void store16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

KV_AVX512_BF16 void rms_norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t H, float eps,
                                 int64_t c0, int64_t c1) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t k = 0; k < H; k += 16) {
    const __m512 v = load16(x + k, lanes16(H - k));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / float(H) + eps));
  for (int64_t k = c0; k < c1; k += 16) {
    const __mmask16 m = lanes16(H - k);
    store16(out + k, m, _mm512_mul_ps(_mm512_mul_ps(load16(x + k, m), scale), load16(w + k, m)));
  }
}

// silu(g) u = g sigmoid(g) u, with sigmoid from e = e^-|g| (never overflows): 1/(1+e) or e/(1+e)
KV_AVX512_BF16 void swiglu_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t F) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t k = 0; k < F; k += 16) {
    const __mmask16 m = lanes16(F - k);
    const __m512 g = load16(gate + k, m);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
    store16(out + k, m, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), load16(up + k, m)));
  }
}

// one head of one token, in place: x[:h] x cos[:h] + x[h:] sin[:h] | x[h:] cos[h:] + x[:h] sin[h:]
KV_AVX512_BF16 void rope_head(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t k = 0; k < half; k += 16) {
    const __mmask16 m = lanes16(half - k);
    const __m512 a = load16(x + k, m), b = load16(x + half + k, m);
    const __m512 lo = _mm512_fmadd_ps(b, load16(sin + k, m), _mm512_mul_ps(a, load16(cos + k, m)));
    const __m512 hi = _mm512_fmadd_ps(a, load16(sin + half + k, m), _mm512_mul_ps(b, load16(cos + half + k, m)));
    store16(x + k, m, lo);
    store16(x + half + k, m, hi);
  }
}

const Steps& steps(bool avx2) {
  static const Steps avx512{&dot_rows, &rms_norm_row, &swiglu_row, &rope_head};
  static const Steps on_avx2{&bf16_avx2::dot_rows, &bf16_avx2::rms_norm_row, &bf16_avx2::swiglu_row, &bf16_avx2::rope_head};
  return avx2 ? on_avx2 : avx512;
}

}  // namespace kvbf16
}  // namespace
