// SIMD helpers shared by the native kernels: bfloat16 lanes widened to float32, and e^x for x <= 0,
// for AVX512 (16 lanes) and for AVX2 (8 lanes, the same arithmetic lane for lane).
//
// The AVX512 ones carry the AVX512F/BW/VL target (KV_AVX512) only, the subset every AVX512 kernel here
// compiles for, so they inline into functions that add AVX512-BF16 (KV_AVX512_BF16); the AVX2 ones
// carry AVX2 and FMA (KV_AVX2). build.py hashes this header with each source.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <string>

#include "check.h"

#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define KV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define KV_AVX2 __attribute__((target("avx2,fma")))

// the mask of the first min(left, 16) lanes
static inline __mmask16 lanes16(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

// 16 bfloat16 values (the lanes of m; the others read as 0) widened exactly to float32
KV_AVX512 static inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
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

// 8 bfloat16 values widened exactly to float32
KV_AVX2 static inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// exp_nonpositive on 8 lanes, the same bits: the same steps, and 2^n applied as scalef does, with one
// rounding (p 2^(n+64) is exact for the n here, -150..0; the multiply by 2^-64 rounds once where the
// result is subnormal)
KV_AVX2 static inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-104.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n64 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127 + 64)), 23);
  return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n64)), _mm256_set1_ps(0x1p-64f));
}

// vdpbf16ps's handling of subnormal values for every floating-point step on this thread while it
// lives: subnormal inputs read as 0 (MXCSR's DAZ) and subnormal results written as 0 (FTZ), which
// vdpbf16ps does whatever MXCSR says. Under it, two float32 fused multiply-adds (the odd pair's
// product, then the even's, each product exact, each sum rounded to nearest even) give vdpbf16ps's
// bits exactly: checked over 320 million random lanes, subnormal, huge and cancelling values among
// them, with 0 differences (with only DAZ, or only FTZ, or neither, thousands to millions differ).
// The thread's MXCSR comes back as it was.
struct FlushSubnormals {
  const unsigned int saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | kDazFtz); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;
  static constexpr unsigned int kDazFtz = 0x8040;  // MXCSR's FTZ (bit 15) and DAZ (bit 6)
};

// whether this CPU runs KV_AVX2 code
static inline bool has_avx2() {
  static const bool present = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return present;
}

// whether the CPU is Intel's (some steps choose their way by vendor: each says why)
static inline bool intel_cpu() {
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
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

// whether the CPU is an AMD Zen 4: AMD family 19h with AVX512 (Zen 3, of the same family, has none)
static inline bool amd_zen4() {
  static const bool zen4 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amdfam19h") != 0 && has_avx512();
  }();
  return zen4;
}

// The path setting of a kernel library (attention_isa, bf16_isa; tests compare the paths, and every
// process starts on the best): whether its AVX2 steps run once `name` is set, name being "avx2",
// `fast` (the library's AVX512 path, which the CPU has where has_fast) or "" (the CPU's best). A name
// that is none of these, or a path the CPU lacks, is refused.
inline bool avx2_after(const char* op, const std::string& name, const char* fast, bool has_fast) {
  KV_CHECK(name.empty() || name == "avx2" || name == fast, op, ": no path named '", name, "' (", fast,
           ", avx2, or '' for this CPU's best)");
  KV_CHECK(name != "avx2" || has_avx2(), op, ": this CPU lacks the avx2 path (AVX2 with FMA)");
  KV_CHECK(name != fast || has_fast, op, ": this CPU lacks the ", fast, " path");
  return name.empty() ? !has_fast : name == "avx2";
}
