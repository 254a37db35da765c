// kernels_bf16.cpp's row steps for CPUs with AVX2 and FMA but no AVX512-BF16 (namespace bf16_avx2). Each
// of the AVX512 steps' 16 float32 lanes is a lane of one of two 8-lane halves here, through the same
// operations in the same order: a dot product's lane adds its odd pair's product, then its even
// pair's, each a fused multiply-add of exact products (what vdpbf16ps computes, but that it reads and
// writes subnormals as 0); a row's lanes are summed in _mm512_reduce_add_ps's tree; rounding to
// bfloat16 is to nearest even (where vcvtneps2bf16 also flushes subnormals). Tails are zero-padded
// as the AVX512 masks pad them. Included through kernels_bf16.h.
#pragma once

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {
namespace bf16_avx2 {

constexpr int64_t kRows = 4;   // rows per block, as the AVX512 steps
constexpr int64_t kAhead = 4;  // prefetch distance, in rows
constexpr int64_t kStep = 32;  // bfloat16 values per step: 16 pairs, one per lane

// n - k (< 32) values from p, then zeros: 32 values
inline void padded32(const uint16_t* p, int64_t live, uint16_t* out) {
  std::fill(out, out + kStep, uint16_t(0));
  std::copy(p, p + live, out);
}

// 16 lanes (two halves) summed in _mm512_reduce_add_ps's tree
KV_AVX2 inline float sum16(__m256 lo, __m256 hi) {
  const __m256 eight = _mm256_add_ps(hi, lo);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
}

// acc += the odd pair's product, then the even pair's, lane by lane (16 bfloat16 pairs of w and x)
KV_AVX2 inline void dot_pairs(__m256& acc, __m256i w, __m256 x_even, __m256 x_odd) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, high)), x_odd, acc);
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), x_even, acc);
}

// dot products of `count` (1..kRows) consecutive rows starting at w with x, into out[0..count)
KV_AVX2 void dot_rows(const uint16_t* w, const uint16_t* x, int64_t n, int64_t count, float* out) {
  __m256 acc[kRows][2];
  for (int64_t i = 0; i < kRows; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
  alignas(32) uint16_t xt[kStep], wt[kStep];
  for (int64_t k = 0; k < n; k += kStep) {
    const bool tail = n - k < kStep;
    const uint16_t* xs = x + k;
    if (tail) {
      padded32(xs, n - k, xt);
      xs = xt;
    }
    __m256 x_even[2], x_odd[2];
    for (int h = 0; h < 2; h++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 16 * h));
      x_even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      x_odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
    for (int64_t i = 0; i < count; i++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (i + kAhead) * n + k), _MM_HINT_T0);
      const uint16_t* ws = w + i * n + k;
      if (tail) {
        padded32(ws, n - k, wt);
        ws = wt;
      }
      for (int h = 0; h < 2; h++)
        dot_pairs(acc[i][h], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + 16 * h)), x_even[h], x_odd[h]);
    }
  }
  for (int64_t i = 0; i < count; i++) out[i] = sum16(acc[i][0], acc[i][1]);
}

// ---- elementwise rows: 8 lanes at a time, tails through a zero-padded buffer ---------------------

// 8 float32 lanes rounded to bfloat16, nearest even (NaN stays NaN)
KV_AVX2 inline __m128i to_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// the next 8 (or the last `live` < 8, then zeros) bfloat16 values of p, widened
KV_AVX2 inline __m256 load8(const uint16_t* p, int64_t live) {
  if (live >= 8) return widen8(p);
  alignas(16) uint16_t t[8] = {};
  std::copy(p, p + live, t);
  return widen8(t);
}

KV_AVX2 inline void store8(uint16_t* p, int64_t live, __m256 v) {
  const __m128i b = to_bf16(v);
  if (live >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  alignas(16) uint16_t t[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(t), b);
  std::copy(t, t + live, p);
}

KV_AVX2 void rms_norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t H, float eps, int64_t c0,
                          int64_t c1) {
  __m256 squares[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0..7 and 8..15 of 16
  for (int64_t k = 0; k < H; k += 8) {
    const __m256 v = load8(x + k, H - k);
    __m256& s = squares[(k / 8) % 2];
    s = _mm256_fmadd_ps(v, v, s);
  }
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(sum16(squares[0], squares[1]) / float(H) + eps));
  for (int64_t k = c0; k < c1; k += 8)
    store8(out + k, H - k, _mm256_mul_ps(_mm256_mul_ps(load8(x + k, H - k), scale), load8(w + k, H - k)));
}

KV_AVX2 void swiglu_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t F) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t k = 0; k < F; k += 8) {
    const __m256 g = load8(gate + k, F - k);
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(zero, _mm256_andnot_ps(sign, g)));
    const __m256 negative = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
    store8(out + k, F - k, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), load8(up + k, F - k)));
  }
}

KV_AVX2 void rope_head(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t k = 0; k < half; k += 8) {
    const int64_t live = half - k;
    const __m256 a = load8(x + k, live), b = load8(x + half + k, live);
    const __m256 lo = _mm256_fmadd_ps(b, load8(sin + k, live), _mm256_mul_ps(a, load8(cos + k, live)));
    const __m256 hi = _mm256_fmadd_ps(a, load8(sin + half + k, live), _mm256_mul_ps(b, load8(cos + half + k, live)));
    store8(x + k, live, lo);
    store8(x + half + k, live, hi);
  }
}

}  // namespace bf16_avx2
}  // namespace
