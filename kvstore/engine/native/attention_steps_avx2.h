// attention_steps.h's steps for CPUs with AVX2 and FMA but no AVX512 (namespace avx2): one group of
// 16 keys, a partial folded, the lanes of l summed. Each of the 16 float32 lanes of the AVX512 steps
// is a lane of one of two 8-lane halves here, and goes through the same operations in the same order
// (the fused multiply-add scores and values, exp_nonpositive8, the fixed tree of lane_sum), so the
// bits are the AVX512 steps', with vdpbf16ps or without. Included through attention_rows.h.
#pragma once

#include "attention_steps.h"

namespace {
namespace avx2 {

// avx512::scores_fma on 8-lane halves. Each query's two sums (of the even and of the odd pairs) are
// independent chains, made one after the other here, each over both halves at once, so that a query
// value broadcast once serves 16 keys (AVX2 has 16 registers: both chains of both halves of 4 queries
// do not fit); every sum takes the same steps in the same order: the same bits.
template <int N>
KV_AVX2 void scores_fma(const float* qf, int64_t hd, const uint32_t* kt, float scale, float* s) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
  for (int c = 0; c < 2; c++) {
    __m256 sum[N][2];
    for (int i = 0; i < N; i++) sum[i][0] = sum[i][1] = _mm256_setzero_ps();
    for (int64_t p = c; p < hd / 2; p += 2) {
      const __m256i k0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kt + p * kGroup));
      const __m256i k1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kt + p * kGroup + 8));
      const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(k0, 16)), odd0 = _mm256_castsi256_ps(_mm256_and_si256(k0, high));
      const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(k1, 16)), odd1 = _mm256_castsi256_ps(_mm256_and_si256(k1, high));
      for (int i = 0; i < N; i++) {
        const __m256 qo = _mm256_set1_ps(qf[i * hd + 2 * p + 1]), qe = _mm256_set1_ps(qf[i * hd + 2 * p]);
        sum[i][0] = _mm256_fmadd_ps(qe, even0, _mm256_fmadd_ps(qo, odd0, sum[i][0]));
        sum[i][1] = _mm256_fmadd_ps(qe, even1, _mm256_fmadd_ps(qo, odd1, sum[i][1]));
      }
    }
    for (int i = 0; i < N; i++)
      for (int h = 0; h < 2; h++) {
        float* out = s + i * kGroup + 8 * h;
        if (c == 0) _mm256_store_ps(out, sum[i][h]);  // the even pairs' sum, until the odd pairs' is made
        else _mm256_store_ps(out, _mm256_mul_ps(_mm256_add_ps(_mm256_load_ps(out), sum[i][h]), _mm256_set1_ps(scale)));
      }
  }
}

// V rows -> vt [8][hd], as avx512::values_by_pairs
KV_AVX2 void values_by_pairs(const uint16_t* v, int64_t stride, int64_t hd, int64_t keys, uint32_t* vt) {
  for (int64_t j = 0; j < (keys + 1) / 2; j++) {
    const uint16_t *a = v + 2 * j * stride, *b = a + stride;
    for (int64_t d = 0; d < hd; d += 8) {
      const __m256i ra = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + d)));
      const __m256i rb = 2 * j + 1 < keys ? _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + d)))
                                          : _mm256_setzero_si256();
      _mm256_store_si256(reinterpret_cast<__m256i*>(vt + j * hd + d), _mm256_or_si256(ra, _mm256_slli_epi32(rb, 16)));
    }
  }
}

// avx512::round_weights on 8 lanes
KV_AVX2 inline __m256 round_weights8(__m256 p) {
  const __m256i bits = _mm256_castps_si256(_mm256_and_ps(_mm256_cmp_ps(p, _mm256_set1_ps(0x1p-126f), _CMP_GE_OQ), p));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int32_t(0xffff0000u))));
}

// 8 dimensions of a V row as float32 (bfloat16 widened: exact)
KV_AVX2 inline __m256 widen8(const uint16_t* v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))), 16));
}

// avx512::values_fma for 16 dimensions from d0 (two halves); V from vt [8][hd] (values_by_pairs), or
// (vt null) from the first `keys` V rows at v, `stride` apart, widened where they lie (the same values:
// a row past them reads as 0, as values_by_pairs makes it), so that a decode step's few queries, which
// read V once, do not lay it out first
template <int N>
KV_AVX2 void weighted_values(const float* p, const float* corr, const int64_t* valid, const uint32_t* vt,
                             const uint16_t* v, int64_t stride, int64_t rows, int64_t hd, int64_t d0, float* acc) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
  const __m256 zero = _mm256_setzero_ps();  // as avx512::values_fma
  __m256 a[N][2];
  int64_t keys = 0;
  for (int i = 0; i < N; i++) {
    keys = std::max(keys, valid[i]);
    const __m256 c = _mm256_set1_ps(corr[i]);
    for (int w = 0; w < 2; w++) a[i][w] = valid[i] ? _mm256_fmadd_ps(_mm256_load_ps(acc + i * hd + d0 + 8 * w), c, zero) : c;
  }
  for (int64_t j = 0; 2 * j < keys; j++) {
    __m256 even[2], odd[2];
    for (int w = 0; w < 2; w++) {
      if (vt) {
        const __m256i pair = _mm256_load_si256(reinterpret_cast<const __m256i*>(vt + j * hd + d0 + 8 * w));
        even[w] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
        odd[w] = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
      } else {
        const uint16_t* row = v + 2 * j * stride + d0 + 8 * w;
        even[w] = widen8(row);
        odd[w] = 2 * j + 1 < rows ? widen8(row + stride) : zero;
      }
    }
    for (int i = 0; i < N; i++) {
      if (2 * j >= valid[i]) continue;
      const __m256 pe = _mm256_set1_ps(p[i * kGroup + 2 * j]), po = _mm256_set1_ps(p[i * kGroup + 2 * j + 1]);
      for (int w = 0; w < 2; w++) a[i][w] = _mm256_fmadd_ps(pe, even[w], _mm256_fmadd_ps(po, odd[w], a[i][w]));
    }
  }
  for (int i = 0; i < N; i++)
    if (valid[i])
      for (int w = 0; w < 2; w++) _mm256_store_ps(acc + i * hd + d0 + 8 * w, a[i][w]);
}

// the largest of 8 lanes (max is exact: any order gives it)
KV_AVX2 inline float lane_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// avx512::layout_group
KV_AVX2 void layout_group(const Problem& pb, const uint16_t* k, int64_t keys, uint32_t* kt, uint32_t* vt) {
  keys_by_pairs(k, pb.token_stride(), pb.hd, kt);
  if (vt) values_by_pairs(k + pb.n_kv * pb.hd, pb.token_stride(), pb.hd, keys, vt);
}

// avx512::group_step (vt null: V read from the rows, in weighted_values). The scores' chains one at a
// time and V from the rows, against the halves one at a time and V laid out first (values_by_pairs),
// on an AMD EPYC with AVX2 alone (family 23 model 1: 128-bit vector units, so each 256-bit operation
// is two): one decode row over one layer's 1,024 positions, one thread, 0.92x the time; every layer
// from memory on two threads 0.91x at 1,024 positions and 0.88x at 8,160 (`benchmarks.ab`, attention
// and attention-cold, 3 processes each); the same bits there and over the native attention tests'
// shapes (hd 16 to 128, decode rows, prefill chunks, subnormal values). Tried and dropped on that CPU:
// 32 dimensions a values pass for up to 3 queries (0.97x: the 16 registers spill), and the touch left
// out (read_in_order: 0.97x in L2, 1.02x and 0.99x from memory).
KV_AVX2 KV_NOINLINE void group_step(const Problem& pb, const uint32_t* kt, const uint32_t* vt, const uint16_t* v,
                                    int64_t keys, const int64_t* valid, int64_t first, int64_t nq, Work& w) {
  const int64_t hd = pb.hd, stride = pb.token_stride();
  const float* qf_all = w.qf + first * hd;
  float *p_all = w.p + first * kGroup, *lsum = w.lsum + first * kGroup;
  float *m_all = w.m + first, *corr_all = w.corr + first, *acc_all = w.acc + first * hd;
  for (int64_t i = 0; i < nq; i += kSub) {
    const int64_t n = std::min<int64_t>(kSub, nq - i);
    if (*std::max_element(valid + i, valid + i + n) == 0) continue;
    const float* qf = qf_all + i * hd;
    float* s = p_all + i * kGroup;
    switch (n) {
      case 1: scores_fma<1>(qf, hd, kt, pb.scale, s); break;
      case 2: scores_fma<2>(qf, hd, kt, pb.scale, s); break;
      case 3: scores_fma<3>(qf, hd, kt, pb.scale, s); break;
      default: scores_fma<4>(qf, hd, kt, pb.scale, s); break;
    }
  }
  prefetch_some(w);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  for (int64_t i = 0; i < nq; i++) {
    if (valid[i] == 0) continue;
    float* pi = p_all + i * kGroup;
    float* li = lsum + i * kGroup;
    __m256 mask[2], s[2];
    for (int h = 0; h < 2; h++) {
      mask[h] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(valid[i] - 8 * h)), lane));
      s[h] = _mm256_blendv_ps(neg_inf, _mm256_load_ps(pi + 8 * h), mask[h]);
    }
    const float m = std::max(m_all[i], lane_max(_mm256_max_ps(s[0], s[1])));
    const float c = m_all[i] == kNegInf ? 0.0f
                    : m_all[i] == m     ? 1.0f
                                        : _mm256_cvtss_f32(exp_nonpositive8(_mm256_set1_ps(m_all[i] - m)));
    for (int h = 0; h < 2; h++) {
      const __m256 p = round_weights8(_mm256_and_ps(mask[h], exp_nonpositive8(_mm256_sub_ps(s[h], _mm256_set1_ps(m)))));
      _mm256_store_ps(li + 8 * h, _mm256_fmadd_ps(_mm256_load_ps(li + 8 * h), _mm256_set1_ps(c), p));
      _mm256_store_ps(pi + 8 * h, p);
    }
    m_all[i] = m;
    corr_all[i] = c;
  }
  prefetch_some(w);
  for (int64_t i = 0; i < nq; i += kSub) {
    const int64_t n = std::min<int64_t>(kSub, nq - i);
    const float *p = p_all + i * kGroup, *corr = corr_all + i;
    float* acc = acc_all + i * hd;
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
      switch (n) {
        case 1: weighted_values<1>(p, corr, valid + i, vt, v, stride, keys, hd, d0, acc); break;
        case 2: weighted_values<2>(p, corr, valid + i, vt, v, stride, keys, hd, d0, acc); break;
        case 3: weighted_values<3>(p, corr, valid + i, vt, v, stride, keys, hd, d0, acc); break;
        default: weighted_values<4>(p, corr, valid + i, vt, v, stride, keys, hd, d0, acc); break;
      }
    }
  }
}

// avx512::fold
KV_AVX2 KV_NOINLINE void fold(float* f, const float* acc, float m, float l, int64_t hd, bool first) {
  if (first) return start_record(f, acc, m, l, hd);
  const float top = std::max(f[hd], m);
  const __m256 a = exp_nonpositive8(_mm256_set1_ps(f[hd] - top)), b = exp_nonpositive8(_mm256_set1_ps(m - top));
  for (int64_t d = 0; d < hd; d += 8)
    _mm256_store_ps(f + d, _mm256_fmadd_ps(_mm256_load_ps(f + d), a, _mm256_mul_ps(_mm256_load_ps(acc + d), b)));
  const __m256 sum = _mm256_fmadd_ps(_mm256_set1_ps(f[hd + 1]), a, _mm256_mul_ps(_mm256_set1_ps(l), b));
  f[hd] = top;
  f[hd + 1] = _mm256_cvtss_f32(sum);
}

// the sum of a query's 16 lane sums in _mm512_reduce_add_ps's tree: the halves added lane by lane,
// then the quarters, then lanes 0 + 2 and 1 + 3, then those two
KV_AVX2 KV_NOINLINE float lane_sum(const float* lsum) {
  const __m256 eight = _mm256_add_ps(_mm256_load_ps(lsum + 8), _mm256_load_ps(lsum));
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
}

}  // namespace avx2
}  // namespace
