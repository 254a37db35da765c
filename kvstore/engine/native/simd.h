// AVX512 helpers shared by the native kernels: bfloat16 lanes widened to float32, and e^x for x <= 0.
//
// They carry the AVX512F/BW/VL target (KV_AVX512) only, the subset every kernel here compiles for, so
// they inline into functions that add AVX512-BF16 (KV_AVX512_BF16). build.py hashes this header with
// each source.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define KV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// the mask of the first min(left, 16) lanes
static inline __mmask16 lanes16(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

// 16 bfloat16 values (the lanes of m; the others read as 0) widened exactly to float32
KV_AVX512 static inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// 16 bfloat16 values widened exactly to float32
KV_AVX512 static inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// e^x for x <= 0: 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (|r| <= 0.35, ln 2 in two parts),
// e^r by its Taylor polynomial of degree 7 (relative error below 1e-8); scalef applies 2^n.
KV_AVX512 static inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // e^-104 is 0 in float32
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// whether this CPU runs KV_AVX512 code
static inline bool has_avx512() {
  static const bool present = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return present;
}
