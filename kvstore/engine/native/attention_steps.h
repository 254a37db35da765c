// The arithmetic of attention.cpp's attention_rows (its comment states the contract): one group of 16
// keys for the queries of one KV head (scores, online softmax, weighted values), a partition's partial
// folded into the ones before, the output rounded. Here for AVX512 (namespace avx512);
// attention_steps_avx2.h has the same steps for AVX2 CPUs, lane for lane the same arithmetic.
// Included through attention_rows.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include "check.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>

namespace {

constexpr int64_t kGroup = 16;  // keys scored at once, one per float32 lane
constexpr int kSub = 4;         // queries held in registers at once
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define KV_NOINLINE __attribute__((noinline))

// What every unit of work reads.
struct Problem {
  const uint16_t* q;            // [R, n_heads, hd] through q_row / q_head strides
  int64_t q_row, q_head;
  const uint16_t* pool;         // [n_blocks, block_tokens, 2, n_kv, hd]
  const int32_t* tables;        // [S, max_blocks]
  const int32_t* row_seq;
  const int32_t* row_len;
  uint16_t* out;                // [R, n_heads, hd]
  int64_t n_heads, n_kv, group, hd, block_tokens, max_blocks;
  float scale;
  bool dot_bf16;  // the scores by vdpbf16ps (see scores_bf16)
  bool avx2;      // the steps of attention_steps_avx2.h (the CPU lacks AVX512, or a test asked), else these

  int64_t token_stride() const { return 2 * n_kv * hd; }
  int64_t record() const { return hd + 16; }  // floats per partial: acc [hd], m, l, padding to 64 bytes
  // the cache row of position p of sequence s: K of each KV head, then V of each
  const uint16_t* token(int64_t s, int64_t p) const {
    const int64_t block = tables[s * max_blocks + p / block_tokens];
    return pool + (block * block_tokens + p % block_tokens) * token_stride();
  }
};

// Per-thread working memory, 64-byte aligned, sized for `queries` queries and n_kv KV heads (kt holds
// a group's K of every head: [n_kv][hd / 2][16]).
struct Work {
  std::unique_ptr<float, decltype(&std::free)> mem{nullptr, &std::free};
  float *qf, *p, *lsum, *m, *corr, *acc, *fold;
  uint16_t* qb;
  uint32_t *kt, *pw, *vt;
  const char *ahead = nullptr, *ahead_end = nullptr;  // what prefetch_some fetches: the next group's rows
  int64_t ahead_lines = 0;                            // cache lines a call fetches
  Work(int64_t queries, int64_t hd, int64_t record, int64_t n_kv) {
    const int64_t sizes[] = {queries * hd, queries * kGroup, queries * kGroup, queries, queries, queries * hd,
                             queries * record, queries * hd / 2, n_kv * hd / 2 * kGroup, queries * kGroup / 2,
                             kGroup / 2 * hd};
    int64_t total = 0;
    for (int64_t n : sizes) total += (n + 15) / 16 * 16;
    mem.reset(static_cast<float*>(std::aligned_alloc(64, total * sizeof(float))));
    KV_CHECK(mem, "attention_rows: out of memory");
    float* at = mem.get();
    float* words[4];  // qb, kt, pw, vt: 32-bit words
    float** parts[] = {&qf, &p, &lsum, &m, &corr, &acc, &fold, &words[0], &words[1], &words[2], &words[3]};
    for (int i = 0; i < 11; i++) {
      *parts[i] = at;
      at += (sizes[i] + 15) / 16 * 16;
    }
    qb = reinterpret_cast<uint16_t*>(words[0]);
    kt = reinterpret_cast<uint32_t*>(words[1]);
    pw = reinterpret_cast<uint32_t*>(words[2]);
    vt = reinterpret_cast<uint32_t*>(words[3]);
  }
};

// ---- what every instruction set shares ----------------------------------------------------------

// Touches the group's rows (16 tokens of one block, each head's K then V: one stretch of memory) once
// in address order. The reads across rows that follow are no stream the hardware prefetcher follows;
// these loads are, which doubles the speed at which the cache comes from memory here (Zen 5), more than
// software prefetches did. Not on Intel CPUs, whose prefetchers follow the reads as they are: there
// the touch cost time with the cache in L2 (a decode row over 1k positions, one thread: 3 of 53 us)
// and gained none from memory. Nor on AMD EPYC Zen 4: one decode row over 1,024 positions, one thread,
// took 0.84x the time without it with the cache in L2 (38.0 against 45.4 us, a C++ loop over
// run_partition), and from memory (the cache's lines flushed before each call) 48.3-53.8 against
// 48.5-59.3 us, three runs each.
inline void read_in_order(const uint16_t* rows, int64_t elements) {
  if (intel_cpu() || amd_zen4()) return;
  const volatile char* bytes = reinterpret_cast<const volatile char*>(rows);
  for (int64_t b = 0; b < elements * 2; b += 64) (void)bytes[b];
}

// The next group's rows (of the same partition) are prefetched while this one computes, a few lines
// at a time at kPrefetchSlots points of each KV head's step (before and after its K is laid out,
// after its scores, after its softmax), not all at once: a core keeps only so many misses in flight
// (its fill buffers, 16 on these Intel cores), and a run of 192 prefetches stalls the step behind them
// until most have arrived, so the memory would idle while the step computes and the step wait while
// the memory works. Spread, the two overlap: a decode layer call over a cold cache (one row, 2
// threads, Intel Xeon with AMX) 0.91x the time at 1k positions and 0.83-0.86x at 4k against the whole
// group prefetched at once (which had been 0.89-0.96x no prefetch on AMD EPYC Zen 4); two or three
// groups ahead was slower. No result depends on it.
// The lines go to L2 (prefetcht1) on every CPU; not measured why, a guess: the core's fill buffers,
// which a fetch into L1 holds until the line arrives, are then free sooner. Alternated in one
// process (Intel Xeon with AMX, 2 threads), one decode row over every layer's cache from memory took
// 0.95x the time at 8,160 positions (11.1 against 11.7 ms), 0.93x at 2,048 and 0.98x at 1,024; a
// batched step of 8 sessions 0.99x at 512 positions and 0.97x at 2,048, of 16 at 512 0.98x.
// prefetcht2 was as fast as prefetcht1, two groups ahead no faster. On AMD EPYC Zen 4 (2 threads,
// every layer's cache from memory, fresh processes alternated, two rounds) against prefetches into
// L1: 8 sessions at 512 positions 0.64-0.72x the time (3.9-4.2 against 5.4-6.4 ms), one row at 2,048
// 0.76-0.84x, at 8,160 0.72-0.86x; prefetcht2 between the two, two or three groups ahead and the
// whole group at once slower, the touch above (read_in_order) left out as fast. Not measured on
// AMD EPYC Zen 5 nor on the AVX2 path's CPUs, which took L1 before.
// Also tried on the Xeon, in decode steps at 1,024 positions (alternated, 3 rounds), so that a step's
// reads of the cache would not push the layers' weights out of the last-level cache (the layer
// products run 1.6x faster from it): prefetchnta, and the group's rows flushed (clflushopt) after
// its steps. The first took 2x the attention's time and left the products as they were; the second
// took 1.4-1.6x the attention's time for products at 0.90-0.99x theirs, so 1.16-1.18x the step.
constexpr int64_t kPrefetchSlots = 4;

// Sets w to prefetch the rows from..from+bytes over the n_kv KV heads' steps of one group (bytes 0:
// nothing)
inline void prefetch_ahead(Work& w, const uint16_t* from, int64_t bytes, int64_t n_kv) {
  w.ahead = reinterpret_cast<const char*>(from);
  w.ahead_end = w.ahead + bytes;
  w.ahead_lines = (bytes + 63) / 64 / (kPrefetchSlots * n_kv) + 1;
}

// One of the slots: the next few lines of what prefetch_ahead set, into L2 (see above)
inline void prefetch_some(Work& w) {
  for (int64_t n = w.ahead_lines; n > 0 && w.ahead < w.ahead_end; n--, w.ahead += 64) _mm_prefetch(w.ahead, _MM_HINT_T1);
}

// the output of a folded record: acc / l, rounded to bfloat16
KV_NOINLINE void finish(const float* f, int64_t hd, uint16_t* out) {
  const float l = f[hd + 1];
  for (int64_t d = 0; d < hd; d++) out[d] = c10::BFloat16(f[d] / l).x;
}

// a record (acc [hd], m, l) that starts as the partial (acc, m, l): the first fold
inline void start_record(float* f, const float* acc, float m, float l, int64_t hd) {
  std::copy(acc, acc + hd, f);
  f[hd] = m;
  f[hd + 1] = l;
}

// whether group_step may take V from the rows (vt null) for nq queries: hd in 32-dimension steps, and
// at most kSub queries (one pass over V)
inline bool values_from_rows(int64_t hd, int64_t nq) { return hd % 32 == 0 && nq <= kSub; }

// K rows (16 from k, `stride` elements apart) -> kt [hd / 2][16]: pair-major, each lane one key's
// bfloat16 pair (dimensions 2p, 2p + 1) as 32 bits. In 256-bit steps: each register is loaded a
// 128-bit half at a time, 4 pairs of key j in the low half and of key j + 4 in the high one, so that
// the 4 x 4 transposes within the halves (8 unpacks) leave 4 pairs of 8 keys each in place, and no
// shuffle crosses the halves. On AMD EPYC Zen 4 the 512-bit butterfly this replaces (64 shuffles a
// 16 x 16 block, half of them across 128-bit lanes) took 2.2x the time: one decode row over 1,024
// positions in L2, one thread, every KV head's K laid out in 17.6 against 8.1 us (a C++ loop over the
// kernel's steps alone); the whole call 0.89x at 1,024 positions and 0.91x at 256 (`benchmarks.ab`,
// attention:N, the same bits). From memory (attention-cold:N, every layer, 2 threads), with the touch
// left out on Zen 4 too (read_in_order): 0.90x at 8,160 positions, 1.00x at 1,024.
// AVX2 instructions only: both paths lay K out with it. The AVX2 path had its own, 8 x 8 transposes
// ending in a shuffle across halves for each output: the same layout (checked for hd 16 to 128), and
// this took 0.87-0.95x its time on Zen 4 (a C++ loop over the layout alone, three rounds; not measured
// on a CPU without AVX512).
KV_AVX2 void keys_by_pairs(const uint16_t* k, int64_t stride, int64_t hd, uint32_t* kt) {
  for (int64_t h = 0; h < 2; h++)             // keys 8h..8h+7
    for (int64_t b = 0; b < hd / 2; b += 4) {  // pairs b..b+3 (hd is a multiple of 16)
      __m256i r[4];  // r[j]: the 4 pairs of key 8h + j (low half) and of key 8h + 4 + j (high half)
      for (int j = 0; j < 4; j++) {
        const uint16_t* low = k + (8 * h + j) * stride + 2 * b;
        r[j] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(low + 4 * stride), reinterpret_cast<const __m128i*>(low));
      }
      const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
      uint32_t* out = kt + b * kGroup + 8 * h;  // pair b + i of the 8 keys: four 32-bit words each half
      _mm256_store_si256(reinterpret_cast<__m256i*>(out), _mm256_unpacklo_epi64(t0, t2));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + kGroup), _mm256_unpackhi_epi64(t0, t2));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + 2 * kGroup), _mm256_unpacklo_epi64(t1, t3));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + 3 * kGroup), _mm256_unpackhi_epi64(t1, t3));
    }
}

// ---- AVX512: one group of 16 keys ------------------------------------------------------------

namespace avx512 {

// Scores of N queries against the 16 keys of kt, scaled, into s [N][16]. A query's dot product runs
// in two sums, of the even and of the odd pairs, added at the end; pair p adds q[2p+1] k[2p+1], then
// q[2p] k[2p], each rounded (products of bfloat16 values are exact in float32). That is what
// vdpbf16ps computes (AVX512-BF16, q's pairs in qb [N][hd]), and what fused multiply-adds compute from
// the widened values (qf [N][hd]): the same bits, since the kernel runs with subnormals read and
// written as 0, as vdpbf16ps treats them (FlushSubnormals).
// H > 1: the N queries of each of H KV heads at once (query h N + i against the keys at kt + h
// kt_words), so that more sums are in flight: a sum's steps depend each on the one before, and N
// queries alone (a decode step's few per KV head) leave the multiply-adds waiting on that chain. The
// same steps for every sum, so the same bits.
template <int N, int H = 1>
KV_AVX512_BF16 void scores_bf16(const uint16_t* qb, const float*, int64_t hd, const uint32_t* kt, float scale, float* s,
                                int64_t kt_words = 0) {
  __m512 sum[H][N][2];
  for (int h = 0; h < H; h++)
    for (int i = 0; i < N; i++) sum[h][i][0] = sum[h][i][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < hd / 2; p += 2)
    for (int c = 0; c < 2; c++)
      for (int h = 0; h < H; h++) {
        const __m512bh k = (__m512bh)_mm512_load_si512(kt + h * kt_words + (p + c) * kGroup);
        for (int i = 0; i < N; i++) {
          const uint32_t* pairs = reinterpret_cast<const uint32_t*>(qb + (h * N + i) * hd);
          sum[h][i][c] = _mm512_dpbf16_ps(sum[h][i][c], k, (__m512bh)_mm512_set1_epi32(int32_t(pairs[p + c])));
        }
      }
  for (int h = 0; h < H; h++)
    for (int i = 0; i < N; i++)
      _mm512_store_ps(s + (h * N + i) * kGroup, _mm512_mul_ps(_mm512_add_ps(sum[h][i][0], sum[h][i][1]), _mm512_set1_ps(scale)));
}

template <int N, int H = 1>
KV_AVX512 void scores_fma(const uint16_t*, const float* qf, int64_t hd, const uint32_t* kt, float scale, float* s,
                          int64_t kt_words = 0) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  __m512 sum[H][N][2];
  for (int h = 0; h < H; h++)
    for (int i = 0; i < N; i++) sum[h][i][0] = sum[h][i][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < hd / 2; p += 2)
    for (int c = 0; c < 2; c++)
      for (int h = 0; h < H; h++) {
        const __m512i k = _mm512_load_si512(kt + h * kt_words + (p + c) * kGroup);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(k, 16)), odd = _mm512_castsi512_ps(_mm512_and_si512(k, high));
        const int64_t d = 2 * (p + c);
        for (int i = 0; i < N; i++) {
          const float* q = qf + (h * N + i) * hd;
          sum[h][i][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 1]), odd, sum[h][i][c]);
          sum[h][i][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), even, sum[h][i][c]);
        }
      }
  for (int h = 0; h < H; h++)
    for (int i = 0; i < N; i++)
      _mm512_store_ps(s + (h * N + i) * kGroup, _mm512_mul_ps(_mm512_add_ps(sum[h][i][0], sum[h][i][1]), _mm512_set1_ps(scale)));
}

// V rows (16 from v, `stride` elements apart, the first `keys` of them; the others read as 0) ->
// vt [8][hd]: key-pair-major, lane d of pair j holding dimension d of keys 2j (low half) and 2j + 1
KV_AVX512 void values_by_pairs(const uint16_t* v, int64_t stride, int64_t hd, int64_t keys, uint32_t* vt) {
  // 64-bit quarters 0, 4, 1, 5, 2, 6, 3, 7: 128-bit lane L holds dimensions 4L.. and 16 + 4L.., which
  // the 16-bit unpacks take from each lane (low halves: 0-15, high: 16-31) beside the other row's
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t j = 0; j < (keys + 1) / 2; j++) {
    const uint16_t *a = v + 2 * j * stride, *b = a + stride;
    for (int64_t d = 0; d < hd; d += 32) {
      const __mmask32 m = hd - d >= 32 ? __mmask32(~0u) : __mmask32((1u << (hd - d)) - 1);
      const __m512i ra = _mm512_permutexvar_epi64(order, _mm512_maskz_loadu_epi16(m, a + d));
      const __m512i rb = 2 * j + 1 < keys ? _mm512_permutexvar_epi64(order, _mm512_maskz_loadu_epi16(m, b + d))
                                          : _mm512_setzero_si512();
      _mm512_store_si512(vt + j * hd + d, _mm512_unpacklo_epi16(ra, rb));
      if (hd - d > 16) _mm512_store_si512(vt + j * hd + d + 16, _mm512_unpackhi_epi16(ra, rb));
    }
  }
}

// The softmax weights as the values take them: rounded to bfloat16 (nearest even), those below the
// smallest normal float32 (e^-87.3 and less) made 0 first. Returned as float32.
KV_AVX512 inline __m512 round_weights(__m512 p) {
  const __m512i bits = _mm512_castps_si512(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(p, _mm512_set1_ps(0x1p-126f), _CMP_GE_OQ), p));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(int32_t(0xffff0000u))));
}

// V's 16-dimension words (W of them, from d0) of key pair j, as vt [8][hd] holds them: from vt, or
// (vt null, W even) made here from the first `keys` V rows at v, `stride` apart, as values_by_pairs
// makes them: what a tile of at most kSub queries reads once takes no trip through memory
template <int W>
KV_AVX512 inline void pair_values(const uint32_t* vt, const uint16_t* v, int64_t stride, int64_t keys, int64_t hd,
                                  int64_t j, int64_t d0, __m512i out[W]) {
  if (vt) {
    for (int w = 0; w < W; w++) out[w] = _mm512_load_si512(vt + j * hd + d0 + 16 * w);
    return;
  }
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);  // see values_by_pairs
  const uint16_t* a = v + 2 * j * stride + d0;
  for (int w = 0; w + 1 < W; w += 2) {
    const __m512i ra = _mm512_permutexvar_epi64(order, _mm512_loadu_si512(a + 16 * w));
    const __m512i rb = 2 * j + 1 < keys ? _mm512_permutexvar_epi64(order, _mm512_loadu_si512(a + stride + 16 * w))
                                        : _mm512_setzero_si512();
    out[w] = _mm512_unpacklo_epi16(ra, rb);
    out[w + 1] = _mm512_unpackhi_epi16(ra, rb);
  }
}

// The accumulators of values_bf16 / values_fma: a = acc corr + 0 (never -0, so a weight of 0 adds
// nothing), corr alone for queries with no valid key (left alone at the end); returns the most valid
// keys of the N queries
template <int N, int W>
KV_AVX512 inline int64_t start_values(const float* corr, const int64_t* valid, const float* acc, int64_t hd, int64_t d0,
                                      __m512 a[N][W]) {
  int64_t keys = 0;
  for (int i = 0; i < N; i++) {
    keys = std::max(keys, valid[i]);
    const __m512 c = _mm512_set1_ps(corr[i]);
    for (int w = 0; w < W; w++)
      a[i][w] = valid[i] ? _mm512_fmadd_ps(_mm512_load_ps(acc + i * hd + d0 + 16 * w), c, _mm512_setzero_ps()) : c;
  }
  return keys;
}

template <int N, int W>
KV_AVX512 inline void end_values(const int64_t* valid, __m512 a[N][W], int64_t hd, int64_t d0, float* acc) {
  for (int i = 0; i < N; i++)
    if (valid[i])
      for (int w = 0; w < W; w++) _mm512_store_ps(acc + i * hd + d0 + 16 * w, a[i][w]);
}

// acc[i] = acc[i] corr[i] + the weighted values of the pairs of keys that hold one of the first
// valid[i] keys, for N queries and W x 16 dimensions from d0; pair j adds p[2j+1] v[2j+1] and then
// p[2j] v[2j] (each product exact, each sum rounded: vdpbf16ps's steps), the weights rounded
// (round_weights; those of keys past valid[i] are 0) in pw [N][8] as bfloat16 pairs; queries with no
// valid key are left alone
template <int N, int W>
KV_AVX512_BF16 void values_bf16(const uint32_t* pw, const float*, const float* corr, const int64_t* valid,
                                const uint32_t* vt, const uint16_t* v, int64_t stride, int64_t rows, int64_t hd,
                                int64_t d0, float* acc) {
  __m512 a[N][W];
  const int64_t keys = start_values<N, W>(corr, valid, acc, hd, d0, a);
  for (int64_t j = 0; 2 * j < keys; j++) {
    __m512i vj[W];
    pair_values<W>(vt, v, stride, rows, hd, j, d0, vj);
    for (int i = 0; i < N; i++) {
      if (2 * j >= valid[i]) continue;
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(int32_t(pw[i * kGroup / 2 + j]));
      for (int w = 0; w < W; w++) a[i][w] = _mm512_dpbf16_ps(a[i][w], (__m512bh)vj[w], pj);
    }
  }
  end_values<N, W>(valid, a, hd, d0, acc);
}

// values_bf16 by fused multiply-adds of the widened values and the rounded weights (p [N][16])
template <int N, int W>
KV_AVX512 void values_fma(const uint32_t*, const float* p, const float* corr, const int64_t* valid, const uint32_t* vt,
                          const uint16_t* v, int64_t stride, int64_t rows, int64_t hd, int64_t d0, float* acc) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  __m512 a[N][W];
  const int64_t keys = start_values<N, W>(corr, valid, acc, hd, d0, a);
  for (int64_t j = 0; 2 * j < keys; j++) {
    __m512i vj[W];
    pair_values<W>(vt, v, stride, rows, hd, j, d0, vj);
    __m512 even[W], odd[W];
    for (int w = 0; w < W; w++) {
      even[w] = _mm512_castsi512_ps(_mm512_slli_epi32(vj[w], 16));
      odd[w] = _mm512_castsi512_ps(_mm512_and_si512(vj[w], high));
    }
    for (int i = 0; i < N; i++) {
      if (2 * j >= valid[i]) continue;
      const __m512 pe = _mm512_set1_ps(p[i * kGroup + 2 * j]), po = _mm512_set1_ps(p[i * kGroup + 2 * j + 1]);
      for (int w = 0; w < W; w++) a[i][w] = _mm512_fmadd_ps(pe, even[w], _mm512_fmadd_ps(po, odd[w], a[i][w]));
    }
  }
  end_values<N, W>(valid, a, hd, d0, acc);
}

// values_fma with V taken from the rows (no vt), in other lanes: a key's 32 dimensions from d0 + 32 c
// are one load, its even dimensions (the low halves of its 32-bit words, shifted up) and its odd ones
// (the high halves) two vectors, with no shuffle across keys; so the accumulators hold, for those 32
// dimensions, the even ones at acc [d0 + 32 c, +16) (dimension 2k in lane k) and the odd ones at
// [+16, +32) (natural_order puts them back). Each dimension takes the same steps in the same order as
// in values_fma, so the same bits.
template <int N, int W>
KV_AVX512 void values_rows_fma(const uint32_t*, const float* p, const float* corr, const int64_t* valid, const uint32_t*,
                               const uint16_t* v, int64_t stride, int64_t rows, int64_t hd, int64_t d0, float* acc) {
  static_assert(W % 2 == 0);
  constexpr int C = W / 2;  // 32-dimension stretches
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  __m512 a[N][W];
  const int64_t keys = start_values<N, W>(corr, valid, acc, hd, d0, a);
  for (int64_t j = 0; 2 * j < keys; j++) {
    const uint16_t* even_key = v + 2 * j * stride + d0;
    __m512 e0[C], o0[C], e1[C], o1[C];  // keys 2j (0) and 2j + 1 (1): even and odd dimensions
    for (int c = 0; c < C; c++) {
      const __m512i x0 = _mm512_loadu_si512(even_key + 32 * c);
      const __m512i x1 = 2 * j + 1 < rows ? _mm512_loadu_si512(even_key + stride + 32 * c) : _mm512_setzero_si512();
      e0[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16));
      o0[c] = _mm512_castsi512_ps(_mm512_and_si512(x0, high));
      e1[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16));
      o1[c] = _mm512_castsi512_ps(_mm512_and_si512(x1, high));
    }
    for (int i = 0; i < N; i++) {
      if (2 * j >= valid[i]) continue;
      const __m512 pe = _mm512_set1_ps(p[i * kGroup + 2 * j]), po = _mm512_set1_ps(p[i * kGroup + 2 * j + 1]);
      for (int c = 0; c < C; c++) {
        a[i][2 * c] = _mm512_fmadd_ps(pe, e0[c], _mm512_fmadd_ps(po, e1[c], a[i][2 * c]));
        a[i][2 * c + 1] = _mm512_fmadd_ps(pe, o0[c], _mm512_fmadd_ps(po, o1[c], a[i][2 * c + 1]));
      }
    }
  }
  end_values<N, W>(valid, a, hd, d0, acc);
}

template <int N>
void weighted_values_n(bool dot, const uint32_t* pw, const float* p, const float* corr, const int64_t* valid,
                       const uint32_t* vt, const uint16_t* v, int64_t stride, int64_t rows, int64_t hd, int64_t d0,
                       int64_t width, float* acc) {
  if (!vt && !dot) {  // from the rows: hd a multiple of 32 (values_from_rows), so width is 2 or 4
    if (width == 2) return values_rows_fma<N, 2>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
    return values_rows_fma<N, 4>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
  }
  switch (width + (dot ? 4 : 0)) {
    case 1: return values_fma<N, 1>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
    case 2: return values_fma<N, 2>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
    case 3: return values_fma<N, 3>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
    case 4: return values_fma<N, 4>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
    case 5: return values_bf16<N, 1>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
    case 6: return values_bf16<N, 2>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
    case 7: return values_bf16<N, 3>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
    default: return values_bf16<N, 4>(pw, p, corr, valid, vt, v, stride, rows, hd, d0, acc);
  }
}

// A group's K and V of one KV head as the steps read them: kt [hd / 2][16] (keys_by_pairs) and, unless
// vt is null, vt [8][hd] (values_by_pairs, the first `keys` rows); k points at the group's first K row
// of the head.
KV_AVX512 void layout_group(const Problem& pb, const uint16_t* k, int64_t keys, uint32_t* kt, uint32_t* vt) {
  keys_by_pairs(k, pb.token_stride(), pb.hd, kt);
  if (vt) values_by_pairs(k + pb.n_kv * pb.hd, pb.token_stride(), pb.hd, keys, vt);  // V of the head: n_kv hd on
}

// One group for the nq queries of one KV head, the unit's queries first..first+nq-1: kt and vt hold
// the group's K and V of that head (layout_group); kt null: their scores are in w.p already
// (head_scores); vt null (values_from_rows): V from the first `keys` of the V rows at v, the
// accumulators in values_rows_fma's order where the values take fused multiply-adds (natural_order
// afterwards). valid[i] counts the group's keys query first + i sees (0..16).
KV_AVX512 KV_NOINLINE void group_step(const Problem& pb, const uint32_t* kt, const uint32_t* vt, const uint16_t* v,
                                      int64_t keys, const int64_t* valid, int64_t first, int64_t nq, Work& w) {
  const int64_t hd = pb.hd, stride = pb.token_stride();
  const uint16_t* qb_all = w.qb + first * hd;
  float *qf_all = w.qf + first * hd, *p_all = w.p + first * kGroup, *lsum = w.lsum + first * kGroup;
  float *m_all = w.m + first, *corr_all = w.corr + first, *acc_all = w.acc + first * hd;
  uint32_t* pw_all = w.pw + first * kGroup / 2;
  for (int64_t i = 0; kt && i < nq; i += kSub) {  // (kt null: head_scores made them)
    const int64_t n = std::min<int64_t>(kSub, nq - i);
    if (*std::max_element(valid + i, valid + i + n) == 0) continue;
    const uint16_t* qb = qb_all + i * hd;
    const float* qf = qf_all + i * hd;
    float* s = p_all + i * kGroup;
    switch (n + (pb.dot_bf16 ? 4 : 0)) {
      case 1: scores_fma<1>(qb, qf, hd, kt, pb.scale, s); break;
      case 2: scores_fma<2>(qb, qf, hd, kt, pb.scale, s); break;
      case 3: scores_fma<3>(qb, qf, hd, kt, pb.scale, s); break;
      case 4: scores_fma<4>(qb, qf, hd, kt, pb.scale, s); break;
      case 5: scores_bf16<1>(qb, qf, hd, kt, pb.scale, s); break;
      case 6: scores_bf16<2>(qb, qf, hd, kt, pb.scale, s); break;
      case 7: scores_bf16<3>(qb, qf, hd, kt, pb.scale, s); break;
      default: scores_bf16<4>(qb, qf, hd, kt, pb.scale, s); break;
    }
  }
  prefetch_some(w);
  for (int64_t i = 0; i < nq; i++) {
    if (valid[i] == 0) continue;
    const __mmask16 mask = lanes16(valid[i]);
    const __m512 s = _mm512_mask_blend_ps(mask, _mm512_set1_ps(kNegInf), _mm512_load_ps(p_all + i * kGroup));
    const float m = std::max(m_all[i], _mm512_reduce_max_ps(s));
    // e^0 is exactly 1 (the polynomial at 0, scaled by 2^0): skipping it changes no bit
    const float c = m_all[i] == kNegInf ? 0.0f
                    : m_all[i] == m     ? 1.0f
                                        : _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(m_all[i] - m)));
    const __m512 p = round_weights(_mm512_maskz_mov_ps(mask, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m)))));
    _mm512_store_ps(lsum + i * kGroup, _mm512_fmadd_ps(_mm512_load_ps(lsum + i * kGroup), _mm512_set1_ps(c), p));
    _mm512_store_ps(p_all + i * kGroup, p);
    if (pb.dot_bf16)  // the bfloat16 weights, by pairs, for vdpbf16ps (the multiply-adds take p)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pw_all + i * kGroup / 2),
                         _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
    m_all[i] = m;
    corr_all[i] = c;
  }
  prefetch_some(w);
  for (int64_t i = 0; i < nq; i += kSub) {
    const int64_t n = std::min<int64_t>(kSub, nq - i);
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
      const int64_t width = std::min<int64_t>(4, (hd - d0) / 16);
      const float *p = p_all + i * kGroup, *corr = corr_all + i;
      const uint32_t* pw = pw_all + i * kGroup / 2;
      float* acc = acc_all + i * hd;
      switch (n) {
        case 1: weighted_values_n<1>(pb.dot_bf16, pw, p, corr, valid + i, vt, v, stride, keys, hd, d0, width, acc); break;
        case 2: weighted_values_n<2>(pb.dot_bf16, pw, p, corr, valid + i, vt, v, stride, keys, hd, d0, width, acc); break;
        case 3: weighted_values_n<3>(pb.dot_bf16, pw, p, corr, valid + i, vt, v, stride, keys, hd, d0, width, acc); break;
        default: weighted_values_n<4>(pb.dot_bf16, pw, p, corr, valid + i, vt, v, stride, keys, hd, d0, width, acc); break;
      }
    }
  }
}

// The scores of one group for the queries of every KV head, per_kv of each (at most kSub: a decode
// step's tiles), their keys laid out in kt [n_kv][hd / 2][16], into w.p as group_step makes them (it
// is then handed no kt): several heads at once (scores_fma's H), the same steps.
template <int N>
KV_AVX512 void head_scores_n(const Problem& pb, const uint32_t* kt, Work& w) {
  constexpr int H = N == 3 ? 3 : 8 / N;
  const int64_t hd = pb.hd, words = hd / 2 * kGroup;
  int64_t kv = 0;
  for (; kv + H <= pb.n_kv; kv += H) {
    const int64_t q = kv * N;
    if (pb.dot_bf16) scores_bf16<N, H>(w.qb + q * hd, nullptr, hd, kt + kv * words, pb.scale, w.p + q * kGroup, words);
    else scores_fma<N, H>(nullptr, w.qf + q * hd, hd, kt + kv * words, pb.scale, w.p + q * kGroup, words);
  }
  for (; kv < pb.n_kv; kv++) {
    const int64_t q = kv * N;
    if (pb.dot_bf16) scores_bf16<N>(w.qb + q * hd, nullptr, hd, kt + kv * words, pb.scale, w.p + q * kGroup);
    else scores_fma<N>(nullptr, w.qf + q * hd, hd, kt + kv * words, pb.scale, w.p + q * kGroup);
  }
}

KV_AVX512 KV_NOINLINE void head_scores(const Problem& pb, const uint32_t* kt, int64_t per_kv, Work& w) {
  switch (per_kv) {
    case 1: return head_scores_n<1>(pb, kt, w);
    case 2: return head_scores_n<2>(pb, kt, w);
    case 3: return head_scores_n<3>(pb, kt, w);
    default: return head_scores_n<4>(pb, kt, w);
  }
}

// The accumulators of nq queries back in dimension order after values taken from the rows (where
// the multiply-adds took them: values_rows_fma): per 32 dimensions, the even ones then the odd ones
// -> interleaved. Moves values only.
KV_AVX512 void natural_order(const Problem& pb, float* acc, int64_t nq) {
  if (pb.dot_bf16) return;
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t i = 0; i < nq; i++)
    for (int64_t d = 0; d < pb.hd; d += 32) {
      float* x = acc + i * pb.hd + d;
      const __m512 even = _mm512_load_ps(x), odd = _mm512_load_ps(x + 16);
      _mm512_store_ps(x, _mm512_permutex2var_ps(even, lo, odd));
      _mm512_store_ps(x + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
}

// ---- partials -------------------------------------------------------------------------------------

// f (a record: acc [hd], m, l) = the partial (acc, m, l) when first, else f folded with it
KV_AVX512 KV_NOINLINE void fold(float* f, const float* acc, float m, float l, int64_t hd, bool first) {
  if (first) return start_record(f, acc, m, l, hd);
  const float top = std::max(f[hd], m);
  const __m512 a = exp_nonpositive(_mm512_set1_ps(f[hd] - top)), b = exp_nonpositive(_mm512_set1_ps(m - top));
  for (int64_t d = 0; d < hd; d += 16)
    _mm512_store_ps(f + d, _mm512_fmadd_ps(_mm512_load_ps(f + d), a, _mm512_mul_ps(_mm512_load_ps(acc + d), b)));
  const __m512 sum = _mm512_fmadd_ps(_mm512_set1_ps(f[hd + 1]), a, _mm512_mul_ps(_mm512_set1_ps(l), b));
  f[hd] = top;
  f[hd + 1] = _mm512_cvtss_f32(sum);
}

// the sum of a query's 16 lane sums, in _mm512_reduce_add_ps's fixed tree
KV_AVX512 KV_NOINLINE float lane_sum(const float* lsum) { return _mm512_reduce_add_ps(_mm512_load_ps(lsum)); }

}  // namespace avx512

}  // namespace
