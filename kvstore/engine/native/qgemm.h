// qgemm.h: matrix products with GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), computed as stored: the
// activation rows are quantized to 8-bit blocks and every block's product is an exact integer sum.
//
// qgemm(w, kind, rows, cols, x [T, cols], add=None, isa=-1) -> y [T, rows] (x's dtype: bf16 or f32)
//   y[t, r] = round(sum_b term(t, r, b) (+ add[t or 0, r]))
// qembed(w, kind, rows, cols, ids [n], dtype) -> [n, cols]: rows of the matrix, dequantized (an
//   embedding table kept quantized): GGUF's values, d * (q - 8), d * q + m or d * q in float32.
//
// The arithmetic, which quant_reference.py restates in torch op for op (the tests hold them equal):
// - Activation block b of row t (32 values, float32): amax = max |x|, dx = amax / 127,
//   id = 1 / dx where dx is normal, else 0 (a subnormal dx's reciprocal can overflow: its p are 0),
//   p = round-half-even(x * id) (int8), s = sum p, sx = dx * float(s). A block holding NaN or an
//   infinity: p = 0, s = 0, dx = sx = NaN (the row's products come out NaN).
// - Weight block b of row r: q (Q4: 0..15, Q8_0: -128..127), dw (fp16), mw (Q4_1's fp16 minimum).
//   isum = sum q p (exact), minus 8 s for Q4_0 (q - 8 is the value); float32 from there on:
//   acc += float(isum) * (dw * dx), then for Q4_1 acc += mw * sx; blocks in order, one accumulator
//   per output element, starting at +0. Then + add, one rounding to the output dtype.
// So every output element is computed in one fixed order that depends on its own row and column of
// inputs only: the same bits whatever T is (a decode step, a prefill chunk, a batch of sessions),
// whatever the thread count, and whichever of the three instruction paths ran (the integer sums are
// exact; the float operations are the same ones, lane for lane).
//
// Packed layout (quant.py `pack` writes it): rows in groups of 16 (zero rows pad the last group);
// per group, per block b, one record: the 16 rows' quants as slices of 64 bytes (4 bytes per row,
// row i at bytes 4i..4i+3), then the 16 rows' dw (fp16), then for Q4_1 the 16 mw (fp16).
// - Q8_0: 8 slices; slice k holds elements 4k..4k+3 of each row, each byte XOR 0x80 (unsigned).
// - Q4_0 / Q4_1: 4 slices of GGUF's own bytes: slice k holds bytes 4k..4k+3 of each row's block,
//   whose low nibbles are elements 4k..4k+3 and high nibbles elements 16+4k..16+4k+3.
// So one vpdpbusd multiplies 4 quants of each of the 16 rows by the same 4 activation bytes
// (broadcast), and the 16 int32 lanes are the 16 rows: no horizontal sums anywhere.
//
// Paths: AVX512-VNNI (16 lanes), AVX-VNNI (two 8-lane halves), AVX2 (maddubs + madd; Q8_0 through
// |q| and sign-adjusted activations so no pair saturates), and AMX-INT8 for products of many rows
// (prefill chunks, large batches): one tdpbsud per block takes the integer sums of 16 activation rows
// against a row group's 16 weight rows at once (the record's slices are AMX's B layout as they lie:
// 4 bytes of each of the 16 rows per 64-byte row), and the float steps after it are the AVX512 path's,
// so its bits are the others'. kvstore::quant_isa() names the best one for a single row ("" when the
// CPU lacks AVX2 and F16C: then qgemm refuses, and the caller uses the torch reference). `isa` forces
// a path (tests): 0 AVX2, 1 AVX-VNNI, 2 AVX512-VNNI, 3 AMX-INT8, -1 the best for the call (AMX from
// kAmxRows rows where the CPU and the kernel allow it, else the best of the others); a path this CPU
// lacks is refused (kvstore::quant_paths() lists the ones it has: AVX512-VNNI does not imply AVX-VNNI).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include "check.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cpuid.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {
namespace kvq {

constexpr int64_t kLanes = 16;  // weight rows per group: one int32 lane each
constexpr int64_t kBlock = 32;  // elements per quant block
constexpr int64_t kTile = 8;    // activation rows computed together (each weight record unpacked once)
constexpr int kFewRows = 3;     // up to this many, the 8-lane paths take both halves in one pass (few_rows)
// How near its arithmetic's bound a full tile runs: one layer's w_gate_up (1 MB, in the caches) by 8 rows
// on one thread took 102 us, 139 billion multiply-adds a second, 38 a cycle at the 3.6 GHz the core ran
// at (AMD EPYC Zen 4; 16 rows: 40); one 512-bit vpdpbusd a cycle would be 64, and per row and record
// the tile also runs the contract's float steps (a conversion, 3 multiplies, 2 adds, none of them
// fused) on the same vector units. So a batch of sessions' products are bound by this arithmetic, not
// by reading the weights (8 rows read them at 10.8 GB/s there, 1 row at 46 GB/s).
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kSmallest = std::numeric_limits<float>::min();  // the smallest normal float32

enum Kind : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
enum Isa : int64_t { AVX2 = 0, AVX_VNNI = 1, AVX512_VNNI = 2, AMX_INT8 = 3 };
constexpr int64_t kAmxTile = 16;  // activation rows per AMX tile (a tile register's rows)
// Rows from which -1 takes the AMX path: below it the AVX512 path is as fast or faster. A decode step's
// 120 layer products (Intel Xeon with AMX, 2 threads), AMX's time over AVX512-VNNI's: 16 rows 1.02-1.15x,
// 32 1.06x, 48 0.98x, 64 0.94x, 128 0.87x, 512 0.80x. Prefill chunks reach it; batches of sessions rarely.
constexpr int64_t kAmxRows = 48;
// Why AMX gains so little here: while a thread's tiles hold data (from its first tile instruction to
// tilerelease), the core runs slower. On the Intel Xeon with AMX (KVM guest, 2 vCPUs), a loop of 96
// independent 512-bit multiplies took 2.1x its time with one tilezero every 16 loops, and a chain of
// dependent imuls 1.55x (the clock: about 3.9 -> 2.5 GHz); the clock was back within about 15 us of
// tilerelease. So the float steps after each tdpbsud (six vector operations per row and block, in the
// contract's order) run at about half rate: in a 512-row product by gate_up they took 0.59 ms with no
// tile in use, the tile instructions 0.67 ms without the float steps, and both together 1.68 ms (plus
// 0.44 ms quantizing and storing). Tried and dropped, each alternated in one process against this
// path, with the same bits: the sums made 1 or 2 blocks ahead into a ring of 4 buffers (1.10-1.15x
// the time); the sums of 8 or 32 activation tiles made first, the tiles released, then their float
// steps at the full clock (1.65x and 1.76x; not taken apart further: a phase lasts 2-7 us, about as
// long as the clock took to return, and its sums are read back from the L2 rather than the L1).

constexpr int64_t quant_bytes(int64_t kind) { return kind == Q8_0 ? 512 : 256; }
constexpr int64_t record_bytes(int64_t kind) { return quant_bytes(kind) + 32 + (kind == Q4_1 ? 32 : 0); }

// Software prefetch of the weights, measured over a decode step's 121 products with the weights
// coming from memory (AMD EPYC Zen 4, AVX512 path, against one cache line 4 records ahead, which
// this replaces): with none, 1 row takes 0.83-0.85x the time, 4 rows 0.71x, 8 rows 0.82-0.90x; with
// whole records prefetched about 4 KB ahead (13 Q4_1 records, 8 of Q8_0), 1 row 0.83-0.90x, 4 rows
// 0.74x, 8 rows 0.76-0.81x. A full tile of 8 rows computes long enough on each record for the
// hardware's prefetcher to fall behind; fewer rows read faster without. On an Intel Xeon (AMX, AVX512
// path, 2 threads) fewer rows want it too: the 120 layer products of a decode step from memory take
// 0.90-0.95x the time with it for 1 row, 0.88-0.97x for 4, 0.80-0.90x for 6 (2 rows: 0.95-1.08x), and
// a whole decode step's layers 0.80-0.90x at 64-2k positions of cache. So the AVX512 path prefetches
// in its first pass over a row group with a full tile (later passes find the records in the cache),
// on Intel CPUs (`prefetch_few_rows`) with any number of rows. The 8-lane paths prefetch with up to
// kFewRows rows (few_rows: 1 row from memory 0.83-0.90x the time on an AMD EPYC with AVX2 alone, the
// Zen 1 kind, 4 KB ahead as good as 1-2 KB, 8-16 KB worse), and with more, which read each record
// twice, a half at a time (tile_half), never (4 to 8 rows there: 1.04-1.08x with it). No result depends
// on it.
constexpr int64_t kAheadBytes = 4096;
constexpr int64_t ahead_records(int64_t kind) { return (kAheadBytes + record_bytes(kind) - 1) / record_bytes(kind); }

// whether tiles of fewer than kTile rows prefetch the records ahead (see above): on Intel CPUs
bool prefetch_few_rows() {
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
}

// every cache line of the record `ahead_records` after rec (prefetches never fault: past the end of
// the weights they are dropped)
template <int64_t kind>
inline void prefetch_ahead(const uint8_t* rec) {
  constexpr int64_t RB = record_bytes(kind);
  const uint8_t* next = rec + ahead_records(kind) * RB;
  for (int64_t o = 0; o < RB; o += 64) _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
}

#define KV_QAVX2 __attribute__((target("avx2,f16c,fma")))
#define KV_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")))

// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7: EDX bits 24, 25), and Linux lets this process
// use the tile registers: their state is asked for once (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA), as every AMX user must; refused (an older kernel, a container that forbids it), the
// AMX path is not offered.
bool amx_permitted() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

// Whether this CPU runs path `isa`. Each path needs its own instructions: AVX-VNNI (VEX-encoded
// vpdpbusd) is not implied by AVX512-VNNI (AMD Zen 4 has the second and not the first), so a path
// below the best one may still be missing.
bool has_isa(int64_t isa) {
  static const bool base = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  }();
  static const bool avx_vnni = base && __builtin_cpu_supports("avxvnni");
  static const bool avx512_vnni = base && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  static const bool amx_int8 = avx512_vnni && amx_permitted();
  switch (isa) {
    case AVX2: return base;
    case AVX_VNNI: return avx_vnni;
    case AVX512_VNNI: return avx512_vnni;
    case AMX_INT8: return amx_int8;
    default: return false;
  }
}

// the best path for a single row (AMX never: see kAmxRows)
int64_t best_isa() {
  for (int64_t isa : {AVX512_VNNI, AVX_VNNI, AVX2})
    if (has_isa(isa)) return isa;
  return -1;
}

// the paths this CPU runs, in order (tests run each)
std::vector<int64_t> quant_paths() {
  std::vector<int64_t> paths;
  for (int64_t isa : {AVX2, AVX_VNNI, AVX512_VNNI, AMX_INT8})
    if (has_isa(isa)) paths.push_back(isa);
  return paths;
}

std::string quant_isa() {
  switch (best_isa()) {
    case AVX512_VNNI: return "avx512-vnni";
    case AVX_VNNI: return "avx-vnni";
    case AVX2: return "avx2";
    default: return "";
  }
}

// ---- activations ----------------------------------------------------------------------------------

// The activation rows, quantized, in tiles of kTile rows: per tile and block one record of kTile rows'
// 32 quants, then their dx, their sx (Q4_1) and their integer sums' starting offsets (-8 s for Q4_0,
// whose values are q - 8; -128 s for Q8_0, stored XOR 0x80; 0 for Q4_1). Everything one block of a
// tile needs is at a fixed offset from one pointer.
// The AMX path takes tiles of kAmxTile rows, laid out the same way (ActLayout).
struct ActLayout {
  int64_t rows;  // per tile
  constexpr int64_t quants() const { return rows * kBlock; }  // bytes of quants per tile and block
  constexpr int64_t dx() const { return quants(); }
  constexpr int64_t sx() const { return dx() + 4 * rows; }
  constexpr int64_t off() const { return sx() + 4 * rows; }
  constexpr int64_t record() const { return off() + 4 * rows; }  // + dx, sx, offset (4 bytes each)
};
constexpr ActLayout kVectorTiles{kTile}, kAmxTiles{kAmxTile};
constexpr int64_t kActRecord = kVectorTiles.record(), kDx = kVectorTiles.dx(), kSx = kVectorTiles.sx(),
                  kOff = kVectorTiles.off();

typedef int32_t word32 __attribute__((may_alias, aligned(1)));  // 4 activation bytes, read where they lie
typedef float float_a __attribute__((may_alias));

KV_QAVX2 inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
KV_QAVX2 inline __m256 load8(const c10::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 1 / d for a block's scale d (= its max |x| / 127), where d is normal; else 0: a subnormal d's
// reciprocal can overflow, and such a block's quants are all 0 (both quantizers take it from here)
inline float inverse_scale(float d) { return d >= kSmallest ? 1.0f / d : 0.0f; }

// row t's dx, sx and integer offset in a block's record, from the block's d and the sum of its quants
inline void put_scales(uint8_t* rec, int64_t t, const ActLayout& L, int64_t kind, float d, int32_t total) {
  const float dx = d, sx = d * float(total);
  const int32_t off = kind == Q8_0 ? -128 * total : kind == Q4_0 ? -8 * total : 0;
  std::memcpy(rec + L.dx() + 4 * t, &dx, 4);
  std::memcpy(rec + L.sx() + 4 * t, &sx, 4);
  std::memcpy(rec + L.off() + 4 * t, &off, 4);
}

// A block that holds NaN or an infinity: quants 0, dx = sx = NaN, so each of the row's products is NaN
// (as the reference's are), with the same bits on every path. (Quantized as a finite block, its NaN
// would go unseen and the integer paths would disagree on what an infinity became.)
inline void put_nonfinite(uint8_t* rec, int64_t t, const ActLayout& L) {
  std::memset(rec + t * kBlock, 0, kBlock);
  std::memcpy(rec + L.dx() + 4 * t, &kNaN, 4);
  std::memcpy(rec + L.sx() + 4 * t, &kNaN, 4);
  std::memset(rec + L.off() + 4 * t, 0, 4);
}

// one row of `cols` values -> its quantized blocks, as row `t` of the tile at `tile` laid out as L
// says (the arithmetic of the header, exactly)
template <typename T>
KV_QAVX2 void quantize_row(const T* x, int64_t cols, int64_t kind, uint8_t* tile, int64_t t, const ActLayout& L) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < cols / kBlock; b++) {
    uint8_t* rec = tile + b * L.record();
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps(), nonfinite = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
      v[j] = load8(x + b * kBlock + 8 * j);
      const __m256 a = _mm256_and_ps(v[j], sign);
      amax = _mm256_max_ps(amax, a);
      nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or infinite
    }
    if (_mm256_movemask_ps(nonfinite)) {
      put_nonfinite(rec, t, L);
      continue;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, amax);
    float m = 0.0f;
    for (float l : lanes) m = l > m ? l : m;  // a max: exact in any order
    const float d = m / 127.0f;
    const float id = inverse_scale(d);
    const __m256 scale = _mm256_set1_ps(id);
    __m256i q[4];
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale));  // round half even
    // int32 -> int8: the packs work per 128-bit half, the permute puts the dwords back in order
    const __m256i w16a = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i w8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rec + t * kBlock), w8);
    const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    int32_t parts[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts), sum4);
    int32_t total = 0;
    for (int32_t v8 : parts) total += v8;
    put_scales(rec, t, L, kind, d, total);
  }
}

// quantize_row on AVX512 (F, BW): a block's 32 values in two 16-lane vectors; the same arithmetic,
// so the same bytes (the max and the integer sum are exact in any order). A layer's four products
// took 0.97-0.98x the time of the AVX2 quantizer's at 512 rows, 0.95x at 16 (alternated in one
// process; Intel Xeon with AMX, 2 threads).
KV_AVX512_VNNI inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
KV_AVX512_VNNI inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
KV_AVX512_VNNI void quantize_row_avx512(const T* x, int64_t cols, int64_t kind, uint8_t* tile, int64_t t,
                                        const ActLayout& L) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < cols / kBlock; b++) {
    uint8_t* rec = tile + b * L.record();
    const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
    const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
    if (_mm512_cmp_ps_mask(a0, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(a1, inf, _CMP_NLT_UQ)) {
      put_nonfinite(rec, t, L);
      continue;
    }
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const float d = m / 127.0f;
    const float id = inverse_scale(d);
    const __m512 scale = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, scale)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + t * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + t * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    put_scales(rec, t, L, kind, d, _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// ---- the 16-lane AVX512-VNNI path -------------------------------------------------------------------

// acc + one block's term for one activation row (16 weight rows in the lanes): float(isum) (dw dx),
// then for Q4_1 + mw sx, each rounded; dx and sx of the row read at `row` + the layout's offsets (row:
// its tile's block record + 4 t). The AVX512 and AMX paths both take it, so their bits agree.
template <int64_t kind>
KV_AVX512_VNNI inline __m512 add_block_term(__m512 acc, __m512i isum, __m512 dw, __m512 mw, const uint8_t* row,
                                            const ActLayout& L) {
  const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(*reinterpret_cast<const float_a*>(row + L.dx())));
  acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(isum), scale));
  if constexpr (kind == Q4_1) acc = _mm512_add_ps(acc, _mm512_mul_ps(mw, _mm512_set1_ps(*reinterpret_cast<const float_a*>(row + L.sx()))));
  return acc;
}

// acc += the 16 rows' products of 4 quants with the 4 activation bytes at x, broadcast from memory
// (the intrinsic makes a separate broadcast instruction of it)
KV_AVX512_VNNI inline __m512i dot16(__m512i acc, __m512i w, const uint8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const word32*>(x)));
  return acc;
}

// Row t's term of one block (its 16 weight rows in the lanes, their 8 words of quants in w): the
// integer sum from the block's offset, then add_block_term. Alone (N < 4), a row takes two chains of
// dependent products; else the other rows' chains overlap its own.
template <int64_t kind, int N>
KV_AVX512_VNNI inline __m512 vnni_row_term(__m512 acc, const __m512i* w, __m512 dw, __m512 mw, const uint8_t* act, int t) {
  const uint8_t* x = act + t * kBlock;
  __m512i isum = kind == Q4_1 ? _mm512_setzero_si512()
                              : _mm512_set1_epi32(*reinterpret_cast<const word32*>(act + kOff + 4 * t));
  if constexpr (N < 4) {
    __m512i i1 = _mm512_setzero_si512();
    for (int k = 0; k < 8; k += 2) {
      isum = dot16(isum, w[k], x + 4 * k);
      i1 = dot16(i1, w[k + 1], x + 4 * k + 4);
    }
    isum = _mm512_add_epi32(isum, i1);
  } else {
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) isum = dot16(isum, w[k], x + 4 * k);
  }
  return add_block_term<kind>(acc, isum, dw, mw, act + t * 4, kVectorTiles);
}

// The tile's accumulators as variables acc0..acc7 (KV_TILE_ROWS(F): F(t) for every row; F acts where
// t < N), not an array: GCC keeps an array of 4 or more vectors on the stack, and every block's terms
// then load and store each accumulator.
#define KV_TILE_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)

template <int64_t kind, int N>
KV_AVX512_VNNI void tile_avx512(const uint8_t* rec, int64_t nb, const uint8_t* act, float* out, bool ahead) {
  static_assert(N <= kTile);
  constexpr int64_t QB = quant_bytes(kind), RB = record_bytes(kind);
#define KV_ZERO(t) __m512 acc##t = _mm512_setzero_ps();
  KV_TILE_ROWS(KV_ZERO)
#undef KV_ZERO
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; b++, rec += RB, act += kActRecord) {
    __m512i w[8];  // w[k] pairs with the activation's int32 word k (elements 4k..4k+3)
    if constexpr (kind == Q8_0) {
      for (int k = 0; k < 8; k++) w[k] = _mm512_loadu_si512(rec + 64 * k);
    } else {
      for (int k = 0; k < 4; k++) {
        const __m512i v = _mm512_loadu_si512(rec + 64 * k);
        w[k] = _mm512_and_si512(v, low);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    if (ahead) prefetch_ahead<kind>(rec);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + QB)));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (kind == Q4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + QB + 32)));
#define KV_TERM(t) if constexpr (t < N) acc##t = vnni_row_term<kind, N>(acc##t, w, dw, mw, act, t);
    KV_TILE_ROWS(KV_TERM)
#undef KV_TERM
  }
#define KV_OUT(t) if constexpr (t < N) _mm512_storeu_ps(out + kLanes * t, acc##t);
  KV_TILE_ROWS(KV_OUT)
#undef KV_OUT
}

// ---- the 8-lane paths: the same lanes in two halves ----------------------------------------------------

// 4 products of each of 8 rows with the same 4 activation bytes, added to the rows' int32 lanes.
// AVX-VNNI's vpdpbusd is written as inline assembly so that one body, compiled for plain AVX2, serves
// both paths: a function compiled with avxvnni enabled could get VNNI instructions from the compiler
// where the AVX2 path must not have any (madd + add is vpdpwssd there). It runs only when chosen.
template <bool vnni>
KV_QAVX2 inline __m256i dot8(__m256i acc, __m256i w, __m256i x) {
  if constexpr (vnni) {
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
    return acc;
  } else {
    // w is below 16 (Q4) or |q| with x sign-adjusted (Q8_0): no int16 pair saturates
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
  }
}

// acc + activation row t's term of a block on 8 lanes, from its integer sums isum (the contract's float
// steps, as tile_avx512's add_block_term on 16): Q4_0's and AVX-VNNI Q8_0's offset added to isum, then
// acc + float(isum) * (dw * dx), then for Q4_1 + mw * sx
template <int64_t kind, bool vnni>
KV_QAVX2 inline __m256 block_term8(__m256 acc, __m256i isum, __m256 dw, __m256 mw, const uint8_t* act, int t) {
  if constexpr ((kind == Q8_0 && vnni) || kind == Q4_0)
    isum = _mm256_add_epi32(isum, _mm256_set1_epi32(*reinterpret_cast<const word32*>(act + kOff + 4 * t)));
  const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(*reinterpret_cast<const float_a*>(act + kDx + 4 * t)));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), scale));
  if constexpr (kind == Q4_1) acc = _mm256_add_ps(acc, _mm256_mul_ps(mw, _mm256_set1_ps(*reinterpret_cast<const float_a*>(act + kSx + 4 * t))));
  return acc;
}

template <int64_t kind, int N, bool vnni>
KV_QAVX2 void tile_half(const uint8_t* rec, int64_t nb, const uint8_t* act, float* out, int half) {
  constexpr int64_t QB = quant_bytes(kind), RB = record_bytes(kind);
  __m256 acc[N];
  for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
  rec += 32 * half;  // this half's 8 rows in each 64-byte slice
  for (int64_t b = 0; b < nb; b++, rec += RB, act += kActRecord) {
    __m256i w[8];
    if constexpr (kind == Q8_0) {
      for (int k = 0; k < 8; k++) w[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * k));
      if constexpr (!vnni) for (int k = 0; k < 8; k++) w[k] = _mm256_xor_si256(w[k], flip);  // signed again
    } else {
      for (int k = 0; k < 4; k++) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * k));
        w[k] = _mm256_and_si256(v, low);
        w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
    }
    const uint8_t* scales = rec - 32 * half + QB + 16 * half;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (kind == Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32)));
#pragma GCC unroll 8
    for (int t = 0; t < N; t++) {
      const word32* words = reinterpret_cast<const word32*>(act + t * kBlock);
      __m256i isum;
      if constexpr (kind != Q8_0 && !vnni) {
        // Q4 on AVX2: the 8 pair sums of each int16 lane are added as int16 before one widening madd.
        // Exact: a pair is at most 2 x 15 x 127 = 3,810 in magnitude (activations lie in [-127, 127]),
        // 8 of them 30,480 < 32,767.
        __m256i p[8];
        for (int k = 0; k < 8; k++) p[k] = _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(words[k]));
        const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                           _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
        isum = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
      } else {
        __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
        for (int k = 0; k < 8; k += 2) {
          __m256i x0 = _mm256_set1_epi32(words[k]), x1 = _mm256_set1_epi32(words[k + 1]);
          if constexpr (kind == Q8_0 && !vnni) {
            i0 = dot8<false>(i0, _mm256_abs_epi8(w[k]), _mm256_sign_epi8(x0, w[k]));
            i1 = dot8<false>(i1, _mm256_abs_epi8(w[k + 1]), _mm256_sign_epi8(x1, w[k + 1]));
          } else {
            i0 = dot8<vnni>(i0, w[k], x0);
            i1 = dot8<vnni>(i1, w[k + 1], x1);
          }
        }
        isum = _mm256_add_epi32(i0, i1);
      }
      acc[t] = block_term8<kind, vnni>(acc[t], isum, dw, mw, act, t);
    }
  }
  for (int t = 0; t < N; t++) _mm256_storeu_ps(out + kLanes * t + 8 * half, acc[t]);
}

// Up to kFewRows activation rows (a decode step's one, a batch of two or three sessions) against a row
// group on the 8-lane paths: both halves in one pass over the records, so that each record is read,
// and its quants unpacked, once, not once per half (tile_half), and the records ahead are prefetched
// when `ahead`. The integer sums are exact in any order, and each half's float steps are tile_half's,
// lane for lane: the same bits. On an AMD EPYC with AVX2 alone (Zen 1 kind, 2 threads, weights from
// memory; in-process alternation, the same bits), its time against tile_half's: Q4_1 1 row 0.73-0.74x,
// 2 rows 0.67-0.69x, 3 rows 0.86x, 4 rows 0.90-0.94x; Q8_0 (the output matrix) 1 row 0.56x, 2 rows
// 0.65x, 3 rows 0.89x, 4 rows 1.05x; without the prefetch 1 row 0.83x (Q4_1) and 0.99x (Q8_0). Four
// rows' sums no longer fit the 16 registers with the record's.
template <int64_t kind, int N, bool vnni>
KV_QAVX2 void few_rows(const uint8_t* rec, int64_t nb, const uint8_t* act, float* out, bool ahead) {
  constexpr int64_t QB = quant_bytes(kind), RB = record_bytes(kind);
  __m256 acc[N][2];
  for (int t = 0; t < N; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
  for (int64_t b = 0; b < nb; b++, rec += RB, act += kActRecord) {
    if (ahead) prefetch_ahead<kind>(rec);
    __m256i isum[N][2];
    if constexpr (kind != Q8_0) {
      // Q4: each slice's two halves unpacked once for every row. On AVX2 the 8 pair sums of each int16
      // lane are added as int16 and widened once (exact, as tile_half's); on AVX-VNNI int32 sums.
      __m256i s[N][2];
      for (int t = 0; t < N; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();
      for (int k = 0; k < 4; k++) {
        __m256i lo[2], hi[2];  // the low and the high nibbles of slice k, per half
        for (int h = 0; h < 2; h++) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * k + 32 * h));
          lo[h] = _mm256_and_si256(v, low), hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
#pragma GCC unroll 4
        for (int t = 0; t < N; t++) {
          const word32* words = reinterpret_cast<const word32*>(act + t * kBlock);
          const __m256i xl = _mm256_set1_epi32(words[k]), xh = _mm256_set1_epi32(words[k + 4]);
          for (int h = 0; h < 2; h++) {
            if constexpr (vnni) s[t][h] = dot8<true>(dot8<true>(s[t][h], lo[h], xl), hi[h], xh);
            else s[t][h] = _mm256_add_epi16(s[t][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl), _mm256_maddubs_epi16(hi[h], xh)));
          }
        }
      }
      for (int t = 0; t < N; t++)
        for (int h = 0; h < 2; h++) isum[t][h] = vnni ? s[t][h] : _mm256_madd_epi16(s[t][h], _mm256_set1_epi16(1));
    } else {
      for (int t = 0; t < N; t++) isum[t][0] = isum[t][1] = _mm256_setzero_si256();
      for (int k = 0; k < 8; k++) {
        __m256i w[2], a[2];  // slice k's quants per half; a: what multiplies the activations
        for (int h = 0; h < 2; h++) {
          w[h] = a[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * k + 32 * h));
          if constexpr (!vnni) w[h] = _mm256_xor_si256(w[h], flip), a[h] = _mm256_abs_epi8(w[h]);  // signed again, |q|
        }
#pragma GCC unroll 4
        for (int t = 0; t < N; t++) {
          const __m256i x = _mm256_set1_epi32(reinterpret_cast<const word32*>(act + t * kBlock)[k]);
          for (int h = 0; h < 2; h++) {
            if constexpr (vnni) isum[t][h] = dot8<true>(isum[t][h], a[h], x);
            else isum[t][h] = dot8<false>(isum[t][h], a[h], _mm256_sign_epi8(x, w[h]));
          }
        }
      }
    }
    const uint8_t* scales = rec + QB;
    for (int h = 0; h < 2; h++) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * h)));
      const __m256 mw = kind == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32 + 16 * h)))
                                     : _mm256_setzero_ps();
      for (int t = 0; t < N; t++) acc[t][h] = block_term8<kind, vnni>(acc[t][h], isum[t][h], dw, mw, act, t);
    }
  }
  for (int t = 0; t < N; t++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + kLanes * t + 8 * h, acc[t][h]);
}

// ---- the AMX-INT8 path: 16 activation rows at once -------------------------------------------------

#define KV_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")))

// ldtilecfg's 64 bytes: palette 1; per block in flight (two: one's integer sums are made while the
// other's float steps run), an A tile (up to 16 activation rows x a block's 32 quants, signed: tiles 0
// and 3), a B tile (the block's 8 slices: 16 weight rows x 4 quants each, unsigned: 1 and 4) and a C
// tile (the rows x 16 int32 sums: 2 and 5)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile state is per thread: each thread configures it before its first tile and releases it after its
// last (a thread with tiles configured saves 8 KB more at every context switch). `rows`: the A and C
// tiles' rows, the call's activation rows up to kAmxTile (a tile computes as many rows as it has).
KV_AMX void amx_start(int64_t rows) {
  TileConfig c;
  for (int i : {0, 3}) c.rows[i] = uint8_t(rows), c.colsb[i] = kBlock;
  for (int i : {1, 4}) c.rows[i] = kBlock / 4, c.colsb[i] = 4 * kLanes;
  for (int i : {2, 5}) c.rows[i] = uint8_t(rows), c.colsb[i] = 4 * kLanes;
  // not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes, and the stores above go
  asm volatile("ldtilecfg %0" : : "m"(c));
}

KV_AMX void amx_end() { _tile_release(); }

// A row group's quants as AMX's B tiles, 512 bytes per block, made once for all its activation tiles:
// Q4's nibbles as bytes (the record's slice k: low nibbles -> slice k, high -> slice k + 4); Q8_0's
// records hold them as they are (XOR 0x80: unsigned), read in place (returns the records then).
template <int64_t kind>
KV_AMX const uint8_t* b_tiles(const uint8_t* rec, int64_t nb, uint8_t* out) {
  if constexpr (kind == Q8_0) return rec;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; b++, rec += record_bytes(kind))
    for (int k = 0; k < 4; k++) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * k);
      _mm512_store_si512(out + 512 * b + 64 * k, _mm512_and_si512(v, low));
      _mm512_store_si512(out + 512 * b + 64 * (k + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  return out;
}

// Tile loads and stores that name the memory they read or write: GCC's _tile_loadd names none, and its
// _tile_stored clobbers all memory, which sends the accumulators to the stack at every block.
struct TileBytes { uint8_t b[512]; };  // what an A tile (up to 16 rows x 32 bytes) or a B tile (8 x 64) reads
struct TileSums { int32_t v[kAmxTile * kLanes]; };  // what a C tile's store writes
#define KV_TILE_LOAD(tmm, base, stride)                                                    \
  asm volatile("tileloadd (%1,%2,1), %%tmm" #tmm                                           \
               : : "m"(*reinterpret_cast<const TileBytes*>(base)), "r"(base), "r"(int64_t(stride)))
#define KV_TILE_STORE(tmm, sums) \
  asm volatile("tilestored %%tmm" #tmm ", (%1,%2,1)" : "=m"(*reinterpret_cast<TileSums*>(sums)) : "r"(sums), "r"(int64_t(64)))

// Block b's integer sums into C tile 2 (slot 0: A tile 0, B tile 1) or 5 (slot 1: tiles 3 and 4). A
// block's sums are made two blocks before its float steps run, so tdpbsud's latency is spent on them.
template <int64_t kind, int slot>
KV_AMX inline void amx_sums(const uint8_t* B, const uint8_t* act, int64_t b) {
  constexpr int64_t BB = kind == Q8_0 ? record_bytes(kind) : 512;  // B: a block's tile every BB bytes
  constexpr int64_t AR = kAmxTiles.record();
  if constexpr (slot == 0) {
    KV_TILE_LOAD(0, act + b * AR, kBlock);
    KV_TILE_LOAD(1, B + b * BB, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
  } else {
    KV_TILE_LOAD(3, act + b * AR, kBlock);
    KV_TILE_LOAD(4, B + b * BB, 64);
    _tile_zero(5);
    _tile_dpbsud(5, 3, 4);
  }
}

// The 16 accumulators of a tile's rows as 16 variables, acc0..acc15: an array of 16 (or 8) vectors is
// kept on the stack by GCC (too large for its scalar replacement), and every block's terms then load
// and store each one. KV_ROWS(F) expands F(t) for every row, F(t) acting only where t < N.
#define KV_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)

// acc + row t's term of a block from its integer sums (add_block_term, as tile_avx512)
template <int64_t kind>
KV_AMX inline __m512 amx_row_term(__m512 acc, const int32_t* sums, int t, __m512 dw, __m512 mw, const uint8_t* act) {
  constexpr ActLayout L = kAmxTiles;
  __m512i isum = _mm512_load_si512(sums + kLanes * t);
  if constexpr (kind != Q4_1) isum = _mm512_add_epi32(isum, _mm512_set1_epi32(*reinterpret_cast<const word32*>(act + L.off() + 4 * t)));
  return add_block_term<kind>(acc, isum, dw, mw, act + 4 * t, L);
}

// One row group's 16 weight rows (records at rec, B tiles at B: b_tiles) against a tile of activation
// rows into out [N][16]: the tile's first N rows (its tile registers may hold more: padding, dropped).
// Per block, tdpbsud makes the integer sums (exact, as vpdpbusd's are); the float steps are
// tile_avx512's, so the bits are the same.
template <int64_t kind, int N>
KV_AMX void tile_amx(const uint8_t* rec, const uint8_t* B, int64_t nb, const uint8_t* act, float* out) {
  constexpr int64_t RB = record_bytes(kind), QB = quant_bytes(kind), AR = kAmxTiles.record();
  alignas(64) int32_t sums[2][kAmxTile * kLanes];
#define KV_ZERO(t) __m512 acc##t = _mm512_setzero_ps();
  KV_ROWS(KV_ZERO)
#undef KV_ZERO
  // block b's terms from sums s, for every row of the tile
#define KV_TERM(t) if constexpr (t < N) acc##t = amx_row_term<kind>(acc##t, s, t, dw, mw, a);
#define KV_BLOCK_TERMS(s_, b_)                                                                                 \
  {                                                                                                            \
    const int32_t* s = s_;                                                                                     \
    const uint8_t* r = rec + (b_) * RB;                                                                        \
    const uint8_t* a = act + (b_) * AR;                                                                        \
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + QB)));           \
    __m512 mw = _mm512_setzero_ps();                                                                           \
    if constexpr (kind == Q4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + QB + 32))); \
    KV_ROWS(KV_TERM)                                                                                           \
  }
  // block b: its sums made (tdpbsud into C tile 2 or 5 by b's parity) two blocks ahead of its float
  // steps, stored one block ahead, so neither tdpbsud's latency nor the wait of a load behind a
  // tile store falls on the float steps
  amx_sums<kind, 0>(B, act, 0);
  if (nb > 1) amx_sums<kind, 1>(B, act, 1);
  KV_TILE_STORE(2, sums[0]);
  for (int64_t b = 0; b < nb; b += 2) {
    if (b + 1 < nb) KV_TILE_STORE(5, sums[1]);
    if (b + 2 < nb) amx_sums<kind, 0>(B, act, b + 2);
    KV_BLOCK_TERMS(sums[0], b)
    if (b + 1 < nb) {
      if (b + 2 < nb) KV_TILE_STORE(2, sums[0]);
      if (b + 3 < nb) amx_sums<kind, 1>(B, act, b + 3);
      KV_BLOCK_TERMS(sums[1], b + 1)
    }
  }
#undef KV_BLOCK_TERMS
#undef KV_TERM
#define KV_OUT(t) if constexpr (t < N) _mm512_storeu_ps(out + kLanes * t, acc##t);
  KV_ROWS(KV_OUT)
#undef KV_OUT
}

template <int64_t kind>
void tile_amx_rows(int n, const uint8_t* rec, const uint8_t* B, int64_t nb, const uint8_t* act, float* out) {
  switch (n) {
    case 1: return tile_amx<kind, 1>(rec, B, nb, act, out);
    case 2: return tile_amx<kind, 2>(rec, B, nb, act, out);
    case 3: return tile_amx<kind, 3>(rec, B, nb, act, out);
    case 4: return tile_amx<kind, 4>(rec, B, nb, act, out);
    case 5: return tile_amx<kind, 5>(rec, B, nb, act, out);
    case 6: return tile_amx<kind, 6>(rec, B, nb, act, out);
    case 7: return tile_amx<kind, 7>(rec, B, nb, act, out);
    case 8: return tile_amx<kind, 8>(rec, B, nb, act, out);
    case 9: return tile_amx<kind, 9>(rec, B, nb, act, out);
    case 10: return tile_amx<kind, 10>(rec, B, nb, act, out);
    case 11: return tile_amx<kind, 11>(rec, B, nb, act, out);
    case 12: return tile_amx<kind, 12>(rec, B, nb, act, out);
    case 13: return tile_amx<kind, 13>(rec, B, nb, act, out);
    case 14: return tile_amx<kind, 14>(rec, B, nb, act, out);
    case 15: return tile_amx<kind, 15>(rec, B, nb, act, out);
    default: return tile_amx<kind, 16>(rec, B, nb, act, out);
  }
}

// ---- dispatch -----------------------------------------------------------------------------------------

// `ahead`: prefetch the records ahead (see kAheadBytes)
template <int64_t kind, int N>
void tile(int64_t isa, const uint8_t* rec, int64_t nb, const uint8_t* act, float* out, bool ahead) {
  if (isa == AVX512_VNNI) return tile_avx512<kind, N>(rec, nb, act, out, ahead);
  if constexpr (N <= kFewRows) {
    if (isa == AVX_VNNI) return few_rows<kind, N, true>(rec, nb, act, out, ahead);
    return few_rows<kind, N, false>(rec, nb, act, out, ahead);
  }
  for (int half = 0; half < 2; half++) {
    if (isa == AVX_VNNI) tile_half<kind, N, true>(rec, nb, act, out, half);
    else tile_half<kind, N, false>(rec, nb, act, out, half);
  }
}

template <int64_t kind>
void tile_rows(int64_t isa, int n, const uint8_t* rec, int64_t nb, const uint8_t* act, float* out, bool ahead) {
  switch (n) {
    case 1: return tile<kind, 1>(isa, rec, nb, act, out, ahead);
    case 2: return tile<kind, 2>(isa, rec, nb, act, out, ahead);
    case 3: return tile<kind, 3>(isa, rec, nb, act, out, ahead);
    case 4: return tile<kind, 4>(isa, rec, nb, act, out, ahead);
    case 5: return tile<kind, 5>(isa, rec, nb, act, out, ahead);
    case 6: return tile<kind, 6>(isa, rec, nb, act, out, ahead);
    case 7: return tile<kind, 7>(isa, rec, nb, act, out, ahead);
    default: return tile<kind, 8>(isa, rec, nb, act, out, ahead);
  }
}

// ---- results ----------------------------------------------------------------------------------------

// float32 -> bfloat16 bits, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's rounding, 8 at a time
KV_QAVX2 inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// y[t, r0 + l] = round(add + out[l]) for the 16 lanes of one row group of one activation row
template <typename T>
KV_QAVX2 void store_group(const float* out, const T* add, T* y, int64_t live) {
  if (live < kLanes) {  // the last group of a matrix whose rows are not a multiple of 16
    for (int64_t l = 0; l < live; l++) y[l] = T((add ? float(add[l]) : 0.0f) + out[l]);
    return;
  }
  for (int h = 0; h < 2; h++) {
    __m256 v = _mm256_loadu_ps(out + 8 * h);
    if (add) v = _mm256_add_ps(load8(add + 8 * h), v);
    if constexpr (std::is_same_v<T, float>) _mm256_storeu_ps(y + 8 * h, v);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 8 * h), to_bf16(v));
  }
}

void check_isa(int64_t isa) {
  const int64_t best = best_isa();
  KV_CHECK(best >= 0, "qgemm: this CPU lacks AVX2/F16C; use the torch reference (kvstore/engine/quant_reference.py)");
  KV_CHECK(has_isa(isa), "qgemm: instruction path ", isa, " is not available on this CPU (best: ", quant_isa(),
              "; kvstore::quant_paths() lists the ones it has)");
}

// ---- one product, in two phases ---------------------------------------------------------------------

// One product's arguments, everything its two phases need: first every activation row quantized
// (quantize_rows), then every row group against them (row_groups), with all threads done with the
// first before any starts the second. The threads of a parallel region share each phase out: qgemm's
// own two regions, or one region for a whole layer stack (layers.cpp). The phases allocate nothing
// and check nothing; the caller has (product_of and its buffers).
struct Product {
  const uint8_t* W;  // the packed weights: groups x nb records of RB bytes
  int64_t kind, rows, cols, isa, T;
  int64_t nb, RB, groups;
  ActLayout L;  // the activation tiles: kAmxTiles on the AMX path, else kVectorTiles
  int64_t tile_bytes;
  bool amx, bf16, wide, few_rows_ahead, add_per_row;
  const void* x;    // [T, cols] bfloat16 (bf16) or float32
  uint8_t* A;       // act_bytes(isa, T, cols) bytes: the quantized rows (a last tile's missing rows zero)
  const void* add;  // [rows] or [T, rows] (add_per_row) in x's dtype, or null
  void* y;          // [T, rows] in x's dtype (may be add itself: each element reads its addend, then is written)
  int64_t b_bytes;  // per thread, a row group's B tiles (AMX with Q4 weights), else 0
};

// the isa a call takes for T rows (-1: AMX from kAmxRows rows where the CPU allows it, else the best other)
int64_t isa_for(int64_t isa, int64_t T) {
  return isa != -1 ? isa : has_isa(AMX_INT8) && T >= kAmxRows ? AMX_INT8 : best_isa();
}

// bytes of quantized activation rows for T rows of `cols` on path isa
int64_t act_bytes(int64_t isa, int64_t T, int64_t cols) {
  const ActLayout L = isa == AMX_INT8 ? kAmxTiles : kVectorTiles;
  return (T + L.rows - 1) / L.rows * (cols / kBlock) * L.record();
}

// the last activation tile's rows past T, zeroed (the AMX path computes them, and drops them)
void clear_missing_rows(int64_t isa, int64_t T, int64_t cols, uint8_t* A) {
  const ActLayout L = isa == AMX_INT8 ? kAmxTiles : kVectorTiles;
  const int64_t tile_bytes = (cols / kBlock) * L.record(), tiles = (T + L.rows - 1) / L.rows;
  if (T % L.rows) std::memset(A + (tiles - 1) * tile_bytes, 0, tile_bytes);
}

// per thread, the bytes of a row group's B tiles (AMX with Q4 weights; 0 on the other paths)
int64_t b_tile_bytes(int64_t isa, int64_t kind, int64_t cols) {
  return isa == AMX_INT8 && kind != Q8_0 ? cols / kBlock * 512 : 0;
}

Product product_of(const uint8_t* W, int64_t kind, int64_t rows, int64_t cols, int64_t isa, int64_t T, const void* x,
                   bool bf16, uint8_t* A, const void* add, bool add_per_row, void* y) {
  Product p{};
  p.W = W, p.kind = kind, p.rows = rows, p.cols = cols, p.isa = isa, p.T = T;
  p.nb = cols / kBlock, p.RB = record_bytes(kind), p.groups = (rows + kLanes - 1) / kLanes;
  p.amx = isa == AMX_INT8;
  p.L = p.amx ? kAmxTiles : kVectorTiles;
  p.tile_bytes = p.nb * p.L.record();
  p.bf16 = bf16, p.wide = isa >= AVX512_VNNI;  // the AVX512 and AMX paths quantize on AVX512 (the same bytes)
  p.few_rows_ahead = prefetch_few_rows();
  p.add_per_row = add_per_row;
  p.x = x, p.A = A, p.add = add, p.y = y;
  p.b_bytes = b_tile_bytes(isa, kind, cols);
  return p;
}

// whether a row group's first tile of n activation rows prefetches the records ahead (see kAheadBytes):
// on the AVX512 path a full tile, or any on Intel CPUs; on the 8-lane paths up to kFewRows rows
bool prefetches(const Product& p, int n) {
  return p.wide ? n == kTile || p.few_rows_ahead : n <= kFewRows;
}

// phase 1 for part of one row: its blocks b0..b1-1 (the bytes quantize_rows writes for them)
void quantize_blocks(const Product& p, int64_t t, int64_t b0, int64_t b1) {
  if (b1 <= b0) return;
  uint8_t* tile = p.A + (t / p.L.rows) * p.tile_bytes + b0 * p.L.record();
  const int64_t at = t * p.cols + b0 * kBlock, cols = (b1 - b0) * kBlock;
  if (p.wide && p.bf16) quantize_row_avx512(static_cast<const c10::BFloat16*>(p.x) + at, cols, p.kind, tile, t % p.L.rows, p.L);
  else if (p.wide) quantize_row_avx512(static_cast<const float*>(p.x) + at, cols, p.kind, tile, t % p.L.rows, p.L);
  else if (p.bf16) quantize_row(static_cast<const c10::BFloat16*>(p.x) + at, cols, p.kind, tile, t % p.L.rows, p.L);
  else quantize_row(static_cast<const float*>(p.x) + at, cols, p.kind, tile, t % p.L.rows, p.L);
}

// phase 1: activation rows begin..end-1 quantized into their tiles
void quantize_rows(const Product& p, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; t++) quantize_blocks(p, t, 0, p.nb);
}

// phase 2: row groups begin..end-1 (16 weight rows each) against every tile of activation rows, into
// y; b_mine: this thread's p.b_bytes bytes, 64-byte aligned (null when 0)
void row_groups(const Product& p, int64_t begin, int64_t end, uint8_t* b_mine) {
  float out[kAmxTile * kLanes];
  const int64_t T = p.T, nb = p.nb, rows = p.rows, kind = p.kind;
  if (p.amx) amx_start(std::min(T, kAmxTile));
  for (int64_t g = begin; g < end; g++) {
    const uint8_t* rec = p.W + g * nb * p.RB;
    const int64_t r0 = g * kLanes, live = std::min(kLanes, rows - r0);
    const uint8_t* B = nullptr;
    if (p.amx) {
      if (kind == Q4_0) B = b_tiles<Q4_0>(rec, nb, b_mine);
      else if (kind == Q4_1) B = b_tiles<Q4_1>(rec, nb, b_mine);
      else B = b_tiles<Q8_0>(rec, nb, nullptr);
    }
    for (int64_t t0 = 0; t0 < T; t0 += p.L.rows) {
      const int n = int(std::min(p.L.rows, T - t0));
      const uint8_t* tile = p.A + (t0 / p.L.rows) * p.tile_bytes;
      const bool ahead = t0 == 0 && prefetches(p, n);
      if (p.amx) {
        if (kind == Q4_0) tile_amx_rows<Q4_0>(n, rec, B, nb, tile, out);
        else if (kind == Q4_1) tile_amx_rows<Q4_1>(n, rec, B, nb, tile, out);
        else tile_amx_rows<Q8_0>(n, rec, B, nb, tile, out);
      } else if (kind == Q4_0) {
        tile_rows<Q4_0>(p.isa, n, rec, nb, tile, out, ahead);
      } else if (kind == Q4_1) {
        tile_rows<Q4_1>(p.isa, n, rec, nb, tile, out, ahead);
      } else {
        tile_rows<Q8_0>(p.isa, n, rec, nb, tile, out, ahead);
      }
      for (int i = 0; i < n; i++) {
        const int64_t t = t0 + i, at = (p.add_per_row ? t * rows : 0) + r0;
        if (p.bf16)
          store_group(out + kLanes * i, p.add ? static_cast<const c10::BFloat16*>(p.add) + at : nullptr,
                      static_cast<c10::BFloat16*>(p.y) + t * rows + r0, live);
        else
          store_group(out + kLanes * i, p.add ? static_cast<const float*>(p.add) + at : nullptr,
                      static_cast<float*>(p.y) + t * rows + r0, live);
      }
    }
  }
  if (p.amx) amx_end();
}

}  // namespace kvq
}  // namespace
