// attention_rows.h: attention_rows' work, cut into units and phases (attention.cpp holds the op and
// states its contract; layers.cpp runs the same phases inside its layer stack). The floating-point
// steps are in attention_steps.h (AVX512) and attention_steps_avx2.h.
#pragma once
#include <ATen/core/Tensor.h>

#include "check.h"
#include "attention_steps.h"
#include "attention_steps_avx2.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {
namespace kvattn {

constexpr int64_t kPartition = 256;   // keys per partial softmax: what a long row splits into
constexpr int64_t kTileQueries = 24;  // query heads (rows x heads per KV head) sharing each K/V load

// Rows next to each other of one sequence, computed together.
struct Tile {
  int64_t row, rows, seq, max_len;
  bool split;       // its partitions run as separate units, partials in the scratch
  int64_t scratch;  // first record of its partials: [partitions][queries]
  int64_t layout;   // its sequence's K and V laid out once for all its tiles: first group's words, or -1
  int64_t shared_parts = 0;  // its first partitions, computed by Shared units with other tiles
  int64_t partitions() const { return (max_len + kPartition - 1) / kPartition; }
};
// A tile's queries go KV head by KV head: query i is row row + (i % (rows G)) / G, head
// (i / (rows G)) G + i % G; the queries of one KV head are rows G consecutive ones.

// The floating-point steps of one instruction set (never inlined: see the contract above).
struct Steps {
  void (*layout_group)(const Problem&, const uint16_t*, int64_t, uint32_t*, uint32_t*);
  void (*group_step)(const Problem&, const uint32_t*, const uint32_t*, const uint16_t*, int64_t, const int64_t*, int64_t,
                     int64_t, Work&);
  void (*fold)(float*, const float*, float, float, int64_t, bool);
  float (*lane_sum)(const float*);
  // where the instruction set has them (else null): a group's scores for every KV head at once, and
  // the accumulators back in dimension order after values taken from the rows (see group_step)
  void (*head_scores)(const Problem&, const uint32_t*, int64_t, Work&);
  void (*natural_order)(const Problem&, float*, int64_t);
};

// the steps pb runs on (Problem::avx2)
const Steps& steps(const Problem& pb) {
  static const Steps avx512_steps{&avx512::layout_group, &avx512::group_step, &avx512::fold, &avx512::lane_sum,
                                  &avx512::head_scores, &avx512::natural_order};
  static const Steps avx2_steps{&avx2::layout_group, &avx2::group_step, &avx2::fold, &avx2::lane_sum, nullptr, nullptr};
  return pb.avx2 ? avx2_steps : avx512_steps;
}

// the best steps this CPU has
const char* isa() { return has_avx512() ? "avx512" : has_avx2() ? "avx2" : ""; }

struct Unit {
  int64_t tile, first, end;  // partitions first..end-1, every KV head (a shared unit: its rows' partition first)
  int64_t cost;
  int64_t shared = -1;  // else the index of the Shared partition it computes
};

// One partition that the tiles' sequences hold in the same blocks (forks of one document, prefix-cache
// hits: a step's sessions that share a prefix), computed for all their rows with one load of its K
// and V. Every row sees the whole partition. Each query's partial goes where its own tile's unit would
// have put it (the tiles are split), so no bit changes.
struct Shared {
  int64_t part, seq;  // the partition, read through this sequence's table (the same blocks as the others')
  std::vector<int64_t> tiles;
};

// ---- units ----------------------------------------------------------------------------------------

// 32-bit words of one group's K and V of one KV head, laid out (kt, then vt)
int64_t layout_words(int64_t hd) { return hd / 2 * kGroup + kGroup / 2 * hd; }

// The queries of `n` rows (row[k]) into w, KV head by KV head: query i is row row[i % (n G) / G], head
// (i / (n G)) G + i % G; the queries of one KV head are n G consecutive ones. len[i] (i < n G): the
// positions query i of a KV head sees. Returns n G.
int64_t load_queries(const Problem& pb, const int64_t* row, int64_t n, int64_t* len, Work& w) {
  const int64_t G = pb.group, hd = pb.hd, per_kv = n * G;
  for (int64_t i = 0; i < per_kv; i++) len[i] = pb.row_len[row[i / G]];
  for (int64_t i = 0; i < per_kv * pb.n_kv; i++) {
    const uint16_t* q = pb.q + row[i % per_kv / G] * pb.q_row + (i / per_kv * G + i % G) * pb.q_head;
    for (int64_t d = 0; d < hd; d++) w.qf[i * hd + d] = c10::BFloat16(q[d], c10::BFloat16::from_bits());  // exact
    std::copy(q, q + hd, w.qb + i * hd);
  }
  return per_kv;
}

// Partition `part` of sequence `seq` (read up to max_len; laid out at `layout` in layouts, or -1) for the
// queries in w, per_kv a KV head, query i seeing len[i % per_kv] positions: the partials (m, lane sums,
// acc) in w.
// A decode step's tiles (few queries per KV head, nothing laid out) take each group's V from the rows
// and, on AVX512, score every KV head's queries at once (head_scores) and weigh the values without
// shuffles across keys (values_rows_fma). With the touch left out on Intel (read_in_order) and the
// softmax weights kept in bfloat16 only for vdpbf16ps (group_step), one decode row over 1k positions
// (Intel Xeon with AMX, one thread, the cache in L2) took 0.84-0.92x the time (alternated 3 times:
// 43 against 49 us a layer call); the same output bits. From memory on two threads it ran as fast as
// before: there the reads bound it (benchmarks/decode_parts.py).
// What a decode tile costs (AMD EPYC Zen 4 at 3.6 GHz, one thread, one row over one layer's 1,024
// positions, in L2): 59 us a call, 23 cycles a query-key, where a prefill chunk's tiles take 12-14;
// perf put a quarter of it in the softmax (group_step's own time), a quarter in laying K out
// (keys_by_pairs), a fifth in this loop (the touch and the prefetches), 19 % in the values and 13 % in
// the scores. Every layer's 1,024 positions on two threads took 1.13 ms warm and 1.33 ms from memory:
// the arithmetic, not the reads, bounds a decode step's attention there. Since then K is laid out in
// 256-bit steps and Zen 4 leaves the touch out (keys_by_pairs, read_in_order): a C++ loop over
// run_partition for that row puts a group of 16 keys (3 KV heads) at about 2,230 cycles where it was
// 3,030 (K 425 where 857, the touch 0 where 440; scores 380, softmax about 420, values about 750), and
// the call at 44 us. From memory, every layer on two threads: 0.90x at 8,160 positions, 1.00x at
// 1,024 (`benchmarks.ab`, attention-cold:N), where the reads bound it. Tried and dropped (separate
// builds alternated in fresh processes, the same output bits, that call): K laid out from masked
// 128-bit broadcast loads so that only the moves within lanes are left (16 unpacks for the 64
// shuffles of transpose16), 1.00x the time; V's pairs made from the rows without the 64-bit permute
// (the accumulators put back in order after the partition), 1.01x; the corrections e^(old - new) of a
// KV head's queries by one exponential, with no branch on the maxima, 1.01x; the softmax of up to 4
// queries at once, their exponentials' steps interleaved, 0.99x (`python -m benchmarks.ab HEAD --case
// attention:1024`, 4 processes each). Neither the shuffles, nor the branches, nor the exponential's
// chain of dependent steps are what it waits on. (The first, behind an environment switch in one
// build, had looked 5-12 % faster in decode steps: the switch itself slowed the other path. Compare
// builds.)
// ahead_end: where the positions the unit reads after this partition end (its last partition's end;
// this partition's own end or less: none): the next group's rows are prefetched up to it, so the
// first group of the unit's next partition comes from memory while this one's last computes.
void run_partition(const Problem& pb, int64_t seq, int64_t max_len, int64_t layout, const uint32_t* layouts,
                   const int64_t* len, int64_t per_kv, int64_t part, Work& w, int64_t ahead_end) {
  const Steps& st = steps(pb);
  const int64_t hd = pb.hd, nq = per_kv * pb.n_kv, stride = pb.token_stride();
  const int64_t start = part * kPartition, end = std::min(start + kPartition, max_len);
  // a few queries per KV head (a decode step's tiles) read V from the rows and score every head at once
  const bool from_rows = layout < 0 && values_from_rows(hd, per_kv), heads_at_once = from_rows && st.head_scores;
  int64_t valid[kTileQueries];  // of the queries of one KV head (the same for each)
  std::fill(w.m, w.m + nq, kNegInf);
  std::fill(w.lsum, w.lsum + nq * kGroup, 0.0f);
  std::fill(w.acc, w.acc + nq * hd, 0.0f);
  for (int64_t g = start; g < end; g += kGroup) {
    for (int64_t i = 0; i < per_kv; i++) valid[i] = std::clamp<int64_t>(len[i] - g, 0, kGroup);
    if (layout >= 0) {  // laid out before the units ran
      const uint32_t* kt = layouts + layout + g / kGroup * pb.n_kv * layout_words(hd);
      for (int64_t kv = 0; kv < pb.n_kv; kv++, kt += layout_words(hd))
        st.group_step(pb, kt, kt + hd / 2 * kGroup, nullptr, 0, valid, kv * per_kv, per_kv, w);
      continue;
    }
    const uint16_t* rows = pb.token(seq, g);
    read_in_order(rows, std::min(kGroup, max_len - g) * stride);
    const int64_t next = g + kGroup < std::max(end, ahead_end) ? std::min(kGroup, max_len - g - kGroup) : 0;  // its keys
    prefetch_ahead(w, next ? pb.token(seq, g + kGroup) : rows, next * stride * 2, pb.n_kv);
    const int64_t keys = std::min(kGroup, max_len - g), words = hd / 2 * kGroup;
    uint32_t* vt = from_rows ? nullptr : w.vt;
    if (heads_at_once) {  // every head's K laid out, then all their scores (head_scores)
      for (int64_t kv = 0; kv < pb.n_kv; kv++) {
        prefetch_some(w);
        st.layout_group(pb, rows + kv * hd, keys, w.kt + kv * words, nullptr);
      }
      st.head_scores(pb, w.kt, per_kv, w);
    }
    for (int64_t kv = 0; kv < pb.n_kv; kv++) {  // the prefetch slots: here, between the two calls, two in the step
      prefetch_some(w);
      if (!heads_at_once) st.layout_group(pb, rows + kv * hd, keys, w.kt, vt);
      prefetch_some(w);
      st.group_step(pb, heads_at_once ? nullptr : w.kt, vt, rows + (pb.n_kv + kv) * hd, keys, valid, kv * per_kv,
                    per_kv, w);
    }
  }
  if (from_rows && st.natural_order) st.natural_order(pb, w.acc, nq);
}

// query i's partial in w (run_partition's) into the record r of the scratch: acc, m, l
void keep_partial(const Problem& pb, const Work& w, int64_t i, float* r) {
  const int64_t hd = pb.hd;
  std::copy(w.acc + i * hd, w.acc + (i + 1) * hd, r);
  r[hd] = w.m[i];
  r[hd + 1] = steps(pb).lane_sum(w.lsum + i * kGroup);
}

// partitions u.first..u.end-1 of one tile, every KV head: folded and written out when the unit holds
// all of them, else each partial into the scratch
void run_unit(const Problem& pb, const Tile& t, const Unit& u, float* scratch, const uint32_t* layouts, Work& w) {
  const Steps& st = steps(pb);
  const int64_t G = pb.group, hd = pb.hd, rec = pb.record();
  int64_t row[kTileQueries], len[kTileQueries];
  for (int64_t k = 0; k < t.rows; k++) row[k] = t.row + k;
  const int64_t per_kv = load_queries(pb, row, t.rows, len, w), nq = per_kv * pb.n_kv;
  for (int64_t part = u.first; part < u.end; part++) {
    run_partition(pb, t.seq, t.max_len, t.layout, layouts, len, per_kv, part, w, std::min(u.end * kPartition, t.max_len));
    const int64_t start = part * kPartition;
    for (int64_t i = 0; i < nq; i++) {
      if (len[i % per_kv] <= start) continue;
      if (t.split) {
        keep_partial(pb, w, i, scratch + (t.scratch + part * nq + i) * rec);
      } else {
        st.fold(w.fold + i * rec, w.acc + i * hd, w.m[i], st.lane_sum(w.lsum + i * kGroup), hd, part == 0);
      }
    }
  }
  if (t.split) return;
  for (int64_t i = 0; i < nq; i++)
    finish(w.fold + i * rec, hd, pb.out + ((t.row + i % per_kv / G) * pb.n_heads + i / per_kv * G + i % G) * hd);
}

// one Shared partition for the rows of all its tiles: its K and V read once (see Shared)
void run_shared(const Problem& pb, const std::vector<Tile>& tiles, const Shared& sh, float* scratch, Work& w) {
  const int64_t G = pb.group, rec = pb.record();
  int64_t row[kTileQueries], len[kTileQueries], n = 0;
  for (int64_t ti : sh.tiles)
    for (int64_t k = 0; k < tiles[ti].rows; k++) row[n++] = tiles[ti].row + k;
  const int64_t per_kv = load_queries(pb, row, n, len, w), nq = per_kv * pb.n_kv;
  // where each query's partial goes: its tile's record for this partition, as run_unit numbers them
  std::vector<int64_t> record(nq);
  int64_t i = 0;
  for (int64_t kv = 0; kv < pb.n_kv; kv++)
    for (int64_t ti : sh.tiles) {
      const Tile& t = tiles[ti];
      const int64_t t_per_kv = t.rows * G, t_nq = t_per_kv * pb.n_kv;
      for (int64_t j = 0; j < t_per_kv; j++) record[i++] = t.scratch + sh.part * t_nq + kv * t_per_kv + j;
    }
  run_partition(pb, sh.seq, (sh.part + 1) * kPartition, -1, nullptr, len, per_kv, sh.part, w, 0);
  for (int64_t q = 0; q < nq; q++) keep_partial(pb, w, q, scratch + record[q] * rec);
}

// a split tile's partials, folded in partition order and written out
void fold_unit(const Problem& pb, const Tile& t, const float* scratch, float* f) {
  const int64_t G = pb.group, hd = pb.hd, per_kv = t.rows * G, nq = per_kv * pb.n_kv, rec = pb.record();
  for (int64_t i = 0; i < nq; i++) {
    const int64_t row = t.row + i % per_kv / G, parts = (pb.row_len[row] + kPartition - 1) / kPartition;
    for (int64_t part = 0; part < parts; part++) {
      const float* r = scratch + (t.scratch + part * nq + i) * rec;
      steps(pb).fold(f, r, r[hd], r[hd + 1], hd, part == 0);
    }
    finish(f, hd, pb.out + (row * pb.n_heads + i / per_kv * G + i % G) * hd);
  }
}

// ---- shared partitions ----------------------------------------------------------------------------

// whether sequences a and b hold partition `part` in the same blocks
bool same_blocks(const Problem& pb, int64_t a, int64_t b, int64_t part) {
  const int64_t first = part * kPartition / pb.block_tokens, last = ((part + 1) * kPartition - 1) / pb.block_tokens;
  for (int64_t blk = first; blk <= last; blk++)
    if (pb.tables[a * pb.max_blocks + blk] != pb.tables[b * pb.max_blocks + blk]) return false;
  return true;
}

// The partitions that tiles read from the same blocks (Shared): tiles read through their own tables,
// and every row of each sees the whole partition (tiles laid out for a prefill chunk keep their own
// reads). Partition by partition, from the first, tiles that agree on it and on every partition before
// go together; each set is cut into units of at most tile_rows rows. Sets tiles' shared_parts.
std::vector<Shared> find_shared(const Problem& pb, std::vector<Tile>& tiles, int64_t tile_rows) {
  std::vector<Shared> out;
  std::vector<int64_t> full(tiles.size());  // partitions every row of the tile sees whole
  std::vector<std::vector<int64_t>> level(1);
  for (int64_t i = 0; i < int64_t(tiles.size()); i++) {
    int64_t least = tiles[i].max_len;
    for (int64_t r = tiles[i].row; r < tiles[i].row + tiles[i].rows; r++) least = std::min<int64_t>(least, pb.row_len[r]);
    full[i] = tiles[i].layout < 0 ? least / kPartition : 0;
    if (full[i] > 0) level[0].push_back(i);
  }
  for (int64_t part = 0; !level.empty(); part++) {
    std::vector<std::vector<int64_t>> next;
    for (const std::vector<int64_t>& set : level) {
      std::vector<bool> taken(set.size(), false);
      for (size_t a = 0; a < set.size(); a++) {
        if (taken[a] || full[set[a]] <= part) continue;
        std::vector<int64_t> same{set[a]};
        for (size_t b = a + 1; b < set.size(); b++)
          if (!taken[b] && full[set[b]] > part && same_blocks(pb, tiles[set[a]].seq, tiles[set[b]].seq, part)) {
            same.push_back(set[b]);
            taken[b] = true;
          }
        if (same.size() < 2) continue;
        for (size_t k = 0; k < same.size();) {  // units of at most tile_rows rows
          Shared sh{part, tiles[same[k]].seq, {}};
          for (int64_t rows = 0; k < same.size() && rows + tiles[same[k]].rows <= tile_rows; k++) {
            rows += tiles[same[k]].rows;
            sh.tiles.push_back(same[k]);
            tiles[same[k]].shared_parts = part + 1;
          }
          out.push_back(std::move(sh));
        }
        next.push_back(std::move(same));
      }
    }
    level = std::move(next);
  }
  return out;
}

// ---- the problem ----------------------------------------------------------------------------------

void check_tensor(const at::Tensor& t, const char* what, at::ScalarType type, int64_t dims) {
  KV_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == dims, "attention_rows: ", what, " must be a ",
              type, " CPU tensor with ", dims, " dimension(s), not ", t.scalar_type(), " ", t.sizes(),
              " on ", t.device());
}

// the attention of q over the pool, checked (dot_bf16: whether the steps take vdpbf16ps, which the AVX512
// steps alone have; avx2: the AVX2 steps, else AVX512's); its out is set later
Problem problem(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables, const at::Tensor& row_seq,
                const at::Tensor& row_len, bool dot_bf16, bool avx2) {
  KV_CHECK(avx2 ? has_avx2() : has_avx512(), "attention_rows: this CPU lacks the ", avx2 ? "AVX2" : "AVX512",
           " steps asked for");
  check_tensor(q, "q", at::kBFloat16, 3);
  check_tensor(pool, "the pool", at::kBFloat16, 5);
  check_tensor(tables, "the block tables", at::kInt, 2);
  check_tensor(row_seq, "row_seq", at::kInt, 1);
  check_tensor(row_len, "row_len", at::kInt, 1);
  const int64_t R = q.size(0), H = q.size(1), hd = q.size(2);
  const int64_t n_blocks = pool.size(0), bt = pool.size(1), n_kv = pool.size(3);
  KV_CHECK(q.stride(2) == 1, "attention_rows: q's rows must be contiguous");
  KV_CHECK(pool.is_contiguous(), "attention_rows: the pool must be contiguous");
  KV_CHECK(pool.size(2) == 2 && pool.size(4) == hd, "attention_rows: the pool must be [n_blocks, block_tokens, 2, ",
              "n_kv, ", hd, "] for queries of ", hd, " dimensions, not ", pool.sizes());
  KV_CHECK(hd % 16 == 0 && hd > 0, "attention_rows: the head dimension must be a multiple of 16, not ", hd);
  KV_CHECK(bt % kGroup == 0 && bt > 0, "attention_rows: block_tokens must be a multiple of ", kGroup, ", not ", bt);
  KV_CHECK(n_kv > 0 && H % n_kv == 0 && H / n_kv <= kTileQueries, "attention_rows: ", H,
              " query heads cannot share ", n_kv, " KV heads (at most ", kTileQueries, " per KV head)");
  KV_CHECK(row_seq.size(0) == R && row_len.size(0) == R, "attention_rows: row_seq and row_len must hold ", R,
              " rows, one per query, not ", row_seq.size(0), " and ", row_len.size(0));
  KV_CHECK(tables.is_contiguous() && row_seq.is_contiguous() && row_len.is_contiguous(),
              "attention_rows: tables, row_seq and row_len must be contiguous");
  const int64_t S = tables.size(0), max_blocks = tables.size(1);
  const int32_t *tab = tables.data_ptr<int32_t>(), *seq = row_seq.data_ptr<int32_t>(), *len = row_len.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; r++) {
    KV_CHECK(seq[r] >= 0 && seq[r] < S, "attention_rows: row ", r, " names sequence ", seq[r], " of ", S);
    KV_CHECK(len[r] >= 1 && len[r] <= max_blocks * bt, "attention_rows: row ", r, " attends to ", len[r],
                " positions; its table holds 1..", max_blocks * bt);
    for (int64_t b = 0; b < (len[r] + bt - 1) / bt; b++) {
      const int32_t block = tab[seq[r] * max_blocks + b];
      KV_CHECK(block >= 0 && block < n_blocks, "attention_rows: sequence ", seq[r], "'s block ", b, " is ", block,
                  ", outside the pool's ", n_blocks, " blocks");
    }
  }
  return Problem{static_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                 static_cast<const uint16_t*>(pool.data_ptr()), tab, seq, len, nullptr, H, n_kv, H / n_kv, hd, bt,
                 max_blocks, float(1.0 / std::sqrt(double(hd))), dot_bf16 && !avx2, avx2};
}

// ---- the plan -------------------------------------------------------------------------------------

// How a call's work is cut up: tiles of rows, the sequences laid out before the units run, the units
// (a tile's partitions, or a Shared partition) and the split tiles whose partials are folded after.
// It depends on the rows' sequences and lengths, the tables and the thread count only, never on the
// cache's contents: a layer stack plans once for all its layers (layers.cpp). Three phases, each
// finished by every thread before the next starts: lay_out each of `groups`, run_unit_at each of
// `units`, fold_at each of `folds` (any thread may take any item; the bits are the same).
struct Plan {
  struct Layout {
    int64_t seq, max_len, at;  // at: its first word in the layouts
  };
  std::vector<Tile> tiles;
  std::vector<Layout> laid;
  std::vector<std::pair<int64_t, int64_t>> groups;  // (its layout in laid, group) to lay out
  std::vector<Shared> shared;
  std::vector<Unit> units;
  std::vector<int64_t> folds;  // the split tiles
  int64_t layout_total = 0;    // 32-bit words of layouts
  int64_t scratch_records = 0;  // partials (pb.record() floats each)
  int64_t queries = 0;          // a thread's Work holds this many queries
};

Plan plan_of(const Problem& pb, int64_t R, int64_t threads) {
  Plan p;
  const int64_t G = pb.group, tile_rows = std::max<int64_t>(1, kTileQueries / G);
  std::vector<Tile>& tiles = p.tiles;
  int64_t total = 0;
  for (int64_t r = 0; r < R; r++) {
    if (tiles.empty() || tiles.back().seq != pb.row_seq[r] || tiles.back().rows == tile_rows)
      tiles.push_back(Tile{r, 0, pb.row_seq[r], 0, false, 0, -1});
    tiles.back().rows++;
    tiles.back().max_len = std::max<int64_t>(tiles.back().max_len, pb.row_len[r]);
    total += pb.row_len[r];
  }
  // A sequence read by several tiles in a row (a prefill chunk) has its K and V laid out once, for
  // them all, not once per tile. No bit changes: a group's layout is the same data (rows past one
  // tile's keys that another tile reads weigh 0 for the first, which adds nothing).
  const int64_t words = layout_words(pb.hd);
  for (size_t a = 0, b; a < tiles.size(); a = b) {  // tiles a..b-1: one sequence's, in a row
    int64_t max_len = tiles[a].max_len;
    for (b = a + 1; b < tiles.size() && tiles[b].seq == tiles[a].seq; b++) max_len = std::max(max_len, tiles[b].max_len);
    if (b - a < 2) continue;
    for (size_t t = a; t < b; t++) tiles[t].layout = p.layout_total;
    p.laid.push_back(Plan::Layout{tiles[a].seq, max_len, p.layout_total});
    p.layout_total += (max_len + kGroup - 1) / kGroup * pb.n_kv * words;
  }
  for (int64_t l = 0; l < int64_t(p.laid.size()); l++)
    for (int64_t g = 0; g < p.laid[l].max_len; g += kGroup) p.groups.emplace_back(l, g);
  p.shared = find_shared(pb, tiles, tile_rows);
  // split what would leave threads idle: a tile with more than a quarter of a thread's share, and the
  // tiles whose first partitions Shared units compute
  for (int64_t i = 0; i < int64_t(tiles.size()); i++) {
    Tile& t = tiles[i];
    t.split = t.shared_parts > 0 || (t.partitions() > 1 && t.max_len * t.rows * 4 * threads > total);
    t.scratch = p.scratch_records;
    if (t.split) p.scratch_records += t.partitions() * t.rows * pb.n_heads;
    if (!t.split) p.units.push_back(Unit{i, 0, t.partitions(), t.max_len * t.rows});
    // a split tile's partitions in runs, about four units a thread: a unit's next partition is
    // prefetched while it ends the one before (run_partition's ahead_end), where one unit a partition
    // began each cold. One decode row over every layer's 8,160 positions (2 threads, runs of 4) took
    // 0.94-0.96x the time from memory (alternated in one process, three runs; Intel Xeon with AMX).
    const int64_t run = std::max<int64_t>(1, (t.partitions() - t.shared_parts) / (4 * threads));
    for (int64_t part = t.shared_parts; t.split && part < t.partitions(); part += run) {
      const int64_t last = std::min(part + run, t.partitions());
      p.units.push_back(Unit{i, part, last, (std::min(last * kPartition, t.max_len) - part * kPartition) * t.rows});
    }
    if (t.split) p.folds.push_back(i);
  }
  for (int64_t i = 0; i < int64_t(p.shared.size()); i++) {
    int64_t rows = 0;
    for (int64_t t : p.shared[i].tiles) rows += tiles[t].rows;
    p.units.push_back(Unit{-1, p.shared[i].part, p.shared[i].part + 1, kPartition * rows, i});
  }
  std::stable_sort(p.units.begin(), p.units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  p.queries = tile_rows * pb.n_heads;
  return p;
}

// phase 1, item i: one group of a laid-out sequence's K and V, every KV head
void lay_out(const Problem& pb, const Plan& p, uint32_t* layouts, int64_t i) {
  const auto [l, g] = p.groups[i];
  const Plan::Layout& lay = p.laid[l];
  const int64_t words = layout_words(pb.hd);
  const uint16_t* rows = pb.token(lay.seq, g);
  uint32_t* kt = layouts + lay.at + g / kGroup * pb.n_kv * words;
  for (int64_t kv = 0; kv < pb.n_kv; kv++, kt += words)
    steps(pb).layout_group(pb, rows + kv * pb.hd, std::min(kGroup, lay.max_len - g), kt, kt + pb.hd / 2 * kGroup);
}

// phase 2, item i: one unit (a tile's partitions, or a Shared partition)
void run_unit_at(const Problem& pb, const Plan& p, float* partials, const uint32_t* layouts, int64_t i, Work& w) {
  const Unit& u = p.units[i];
  if (u.shared >= 0) return run_shared(pb, p.tiles, p.shared[u.shared], partials, w);
  run_unit(pb, p.tiles[u.tile], u, partials, layouts, w);
}

// phase 3, item i: a split tile's partials folded and written out
void fold_at(const Problem& pb, const Plan& p, const float* partials, int64_t i, Work& w) {
  fold_unit(pb, p.tiles[p.folds[i]], partials, w.fold);
}

}  // namespace kvattn
}  // namespace
