// Native CPU kernel of the row-wise input distribution: which destination block each id goes to, and
// the stable order that groups the ids by (destination key, bag). Pure-torch twin:
// shardkit/kernels/bucketize.py (the tests compare the two).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// A feature of kBlocks (3..8) blocks whose second..last first rows are first[1..kBlocks-1]: the block
// of an id is the number of those at or below it (the last block starting at or before the id; the
// first block for smaller ids), a sum of compares with no branch (std::upper_bound's binary search
// mispredicted about every other id). Counting: ids at or above each first row, in registers.
template <int kBlocks, typename index_t>
inline void count_small(const index_t* v, int64_t i0, int64_t i1, const int64_t* first, int64_t* counts) {
  int64_t at_least[kBlocks] = {};
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t id = static_cast<int64_t>(v[i]);
    for (int j = 1; j < kBlocks; ++j) at_least[j] += id >= first[j];
  }
  counts[0] = (i1 - i0) - at_least[1];
  for (int j = 1; j < kBlocks - 1; ++j) counts[j] = at_least[j] - at_least[j + 1];
  counts[kBlocks - 1] = at_least[kBlocks - 1];
}

// Placing: each id at its block's next place, the places in registers (selects, no indexed store
// that the next id's load would wait for).
template <int kBlocks, typename index_t>
inline void place_small(const index_t* v, int64_t i0, int64_t i1, const int64_t* first, int64_t* places,
                        index_t* out, int64_t* ord) {
  int64_t at[kBlocks];
  for (int j = 0; j < kBlocks; ++j) at[j] = places[j];
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t id = static_cast<int64_t>(v[i]);
    int64_t block = 0;
    for (int j = 1; j < kBlocks; ++j) block += id >= first[j];
    int64_t pos = at[0];
    for (int j = 1; j < kBlocks; ++j) pos = block == j ? at[j] : pos;
    out[pos] = v[i];
    if (ord != nullptr) ord[pos] = i;
    for (int j = 0; j < kBlocks; ++j) at[j] += block == j;
  }
}

// Calls f(std::integral_constant<int, C>) for a block count C of 3..8; false for another count.
template <typename F>
inline bool with_small_blocks(int64_t count, F&& f) {
  switch (count) {
    case 3: f(std::integral_constant<int, 3>()); return true;
    case 4: f(std::integral_constant<int, 4>()); return true;
    case 5: f(std::integral_constant<int, 5>()); return true;
    case 6: f(std::integral_constant<int, 6>()); return true;
    case 7: f(std::integral_constant<int, 7>()); return true;
    case 8: f(std::integral_constant<int, 8>()); return true;
    default: return false;
  }
}

// Feature f's bags are [feature_bag_start[f], feature_bag_start[f+1]); its blocks are
// [block_ptr[f], block_ptr[f+1]) of block_starts (ascending first rows) / block_keys. An id goes to
// the last block whose first row is <= id (the first block for smaller ids), i.e. to key k, and its
// segment is key_base[k] + (its bag - the feature's first bag). Returns (order [N]: ids sorted by
// segment, stable; lengths [num_segments]; values[order]).
template <typename index_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> bucketize_impl(
    const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& feature_bag_start,
    const at::Tensor& block_starts, const at::Tensor& block_ptr, const at::Tensor& block_keys,
    const at::Tensor& key_base, int64_t num_segments, bool need_order) {
  const int64_t n = values.numel();
  const int64_t features = feature_bag_start.numel() - 1;
  const index_t* v = values.data_ptr<index_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* fbag = feature_bag_start.data_ptr<int64_t>();
  const int64_t* starts = block_starts.data_ptr<int64_t>();
  const int64_t* bptr = block_ptr.data_ptr<int64_t>();
  const int64_t* bkey = block_keys.data_ptr<int64_t>();
  const int64_t* kbase = key_base.data_ptr<int64_t>();
  // the key tables are small: check them once, so no id needs a check of its own
  const int64_t keys = key_base.numel();
  TORCH_CHECK(num_segments < (int64_t(1) << 31), "bucketize: at most 2^31 segments");
  // every segment belongs to at most one block (the segments of a one-block feature then hold its
  // ids only, which are copied whole)
  std::vector<char> owned(num_segments, 0);
  for (int64_t f = 0; f < features; ++f) {
    TORCH_CHECK(bptr[f] < bptr[f + 1] && bptr[f + 1] <= block_keys.numel(),
                "bucketize: feature ", f, " needs at least one block");
    for (int64_t j = bptr[f]; j < bptr[f + 1]; ++j) {
      TORCH_CHECK(bkey[j] >= 0 && bkey[j] < keys && kbase[bkey[j]] >= 0 &&
                      kbase[bkey[j]] + (fbag[f + 1] - fbag[f]) <= num_segments,
                  "bucketize: block ", j, " of feature ", f, " sends to a segment range outside [0, ",
                  num_segments, ")");
      for (int64_t seg = kbase[bkey[j]]; seg < kbase[bkey[j]] + (fbag[f + 1] - fbag[f]); ++seg) {
        TORCH_CHECK(!owned[seg], "bucketize: segment ", seg, " is sent by more than one block");
        owned[seg] = 1;
      }
    }
  }
  // Two passes over the ids, no per-id scratch: count every segment's ids, then place them (a
  // counting sort, stable). A feature of one block sends each bag whole to one key, in bag order, so
  // its ids are counted per bag and placed with one copy per feature.
  at::Tensor lengths = at::zeros({num_segments}, offsets.options());
  int64_t* len = lengths.data_ptr<int64_t>();
  auto segment_of = [&](int64_t f, int64_t sample, int64_t id) -> int64_t {
    const int64_t* first = starts + bptr[f];
    const int64_t count = bptr[f + 1] - bptr[f];
    int64_t block = 0;
    if (count == 2) {
      block = id >= first[1] ? 1 : 0;
    } else if (count > 2) {
      block = std::upper_bound(first, first + count, id) - first - 1;
      block = std::max<int64_t>(block, 0);
    }
    return kbase[bkey[bptr[f] + block]] + sample;
  };
  for (int64_t f = 0; f < features; ++f) {
    const bool one_block = bptr[f + 1] - bptr[f] == 1;
    const int64_t base = kbase[bkey[bptr[f]]];
    for (int64_t b = fbag[f]; b < fbag[f + 1]; ++b) {
      const int64_t sample = b - fbag[f];
      if (one_block) {
        len[base + sample] += off[b + 1] - off[b];
        continue;
      }
      if (bptr[f + 1] - bptr[f] == 2) {
        // two blocks: the bag's ids at or above the second block's first row, counted in a register
        // (through len[], each id's count was a load of the store the id before made)
        const int64_t split = starts[bptr[f] + 1];
        int64_t high = 0;
        for (int64_t i = off[b]; i < off[b + 1]; ++i) high += static_cast<int64_t>(v[i]) >= split;
        len[kbase[bkey[bptr[f]]] + sample] += off[b + 1] - off[b] - high;
        len[kbase[bkey[bptr[f] + 1]] + sample] += high;
        continue;
      }
      const bool small = with_small_blocks(bptr[f + 1] - bptr[f], [&](auto blocks) {
        constexpr int C = decltype(blocks)::value;
        int64_t counts[C];
        count_small<C>(v, off[b], off[b + 1], starts + bptr[f], counts);
        for (int j = 0; j < C; ++j) len[kbase[bkey[bptr[f] + j]] + sample] += counts[j];
      });
      if (small) continue;
      for (int64_t i = off[b]; i < off[b + 1]; ++i) ++len[segment_of(f, sample, v[i])];
    }
  }
  std::vector<int64_t> cursor(num_segments + 1, 0);
  for (int64_t s = 0; s < num_segments; ++s) cursor[s + 1] = cursor[s] + len[s];
  at::Tensor order = need_order ? at::empty({n}, offsets.options()) : at::empty({0}, offsets.options());
  at::Tensor sorted = at::empty({n}, values.options());
  int64_t* ord = need_order ? order.data_ptr<int64_t>() : nullptr;
  index_t* out = sorted.data_ptr<index_t>();
  for (int64_t f = 0; f < features; ++f) {
    if (fbag[f] == fbag[f + 1]) continue;
    if (bptr[f + 1] - bptr[f] == 1) {
      // the feature's segments are consecutive and its ids arrive in their order: one block copy
      const int64_t first_id = off[fbag[f]];
      const int64_t count = off[fbag[f + 1]] - first_id;
      const int64_t seg = kbase[bkey[bptr[f]]];
      const int64_t pos = cursor[seg];
      std::copy(v + first_id, v + first_id + count, out + pos);
      if (ord != nullptr) {
        for (int64_t j = 0; j < count; ++j) ord[pos + j] = first_id + j;
      }
      for (int64_t s = seg; s < seg + (fbag[f + 1] - fbag[f]); ++s) cursor[s] += len[s];
      continue;
    }
    if (bptr[f + 1] - bptr[f] == 2) {
      // two blocks (two ranks): both places of a bag in registers and no branch on the id; through
      // cursor[] each id's place was a load of the store the id before made (a serial chain)
      const int64_t split = starts[bptr[f] + 1];
      const int64_t lower = kbase[bkey[bptr[f]]], upper = kbase[bkey[bptr[f] + 1]];
      for (int64_t b = fbag[f]; b < fbag[f + 1]; ++b) {
        int64_t low_at = cursor[lower + b - fbag[f]], high_at = cursor[upper + b - fbag[f]];
        for (int64_t i = off[b]; i < off[b + 1]; ++i) {
          const index_t id = v[i];
          const bool high = static_cast<int64_t>(id) >= split;
          const int64_t pos = high ? high_at : low_at;
          out[pos] = id;
          if (ord != nullptr) ord[pos] = i;
          high_at += high;
          low_at += !high;
        }
      }
      continue;
    }
    const bool small = with_small_blocks(bptr[f + 1] - bptr[f], [&](auto blocks) {
      constexpr int C = decltype(blocks)::value;
      for (int64_t b = fbag[f]; b < fbag[f + 1]; ++b) {
        int64_t places[C];
        for (int j = 0; j < C; ++j) places[j] = cursor[kbase[bkey[bptr[f] + j]] + b - fbag[f]];
        place_small<C>(v, off[b], off[b + 1], starts + bptr[f], places, out, ord);
      }
    });
    if (small) continue;
    for (int64_t b = fbag[f]; b < fbag[f + 1]; ++b) {
      const int64_t sample = b - fbag[f];
      for (int64_t i = off[b]; i < off[b + 1]; ++i) {
        const int64_t pos = cursor[segment_of(f, sample, v[i])]++;
        out[pos] = v[i];
        if (ord != nullptr) ord[pos] = i;
      }
    }
  }
  return {order, lengths, sorted};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bucketize_blocks(
    const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& feature_bag_start,
    const at::Tensor& block_starts, const at::Tensor& block_ptr, const at::Tensor& block_keys,
    const at::Tensor& key_base, int64_t num_segments, bool need_order) {
  for (const at::Tensor* t : {&offsets, &feature_bag_start, &block_starts, &block_ptr, &block_keys, &key_base}) {
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous(),
                "bucketize: index arguments must be contiguous 1-d int64");
  }
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous(), "bucketize: values must be contiguous 1-d");
  TORCH_CHECK(offsets.numel() >= 1 && offsets.data_ptr<int64_t>()[offsets.numel() - 1] == values.numel(),
              "bucketize: offsets must end at the number of values");
  TORCH_CHECK(feature_bag_start.numel() == block_ptr.numel(), "bucketize: one block range per feature");
  if (values.scalar_type() == at::kLong) {
    return bucketize_impl<int64_t>(values, offsets, feature_bag_start, block_starts, block_ptr, block_keys,
                                   key_base, num_segments, need_order);
  }
  TORCH_CHECK(values.scalar_type() == at::kInt, "bucketize: values must be int32 or int64");
  return bucketize_impl<int32_t>(values, offsets, feature_bag_start, block_starts, block_ptr, block_keys,
                                 key_base, num_segments, need_order);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def(
      "bucketize_blocks(Tensor values, Tensor offsets, Tensor feature_bag_start, Tensor block_starts, "
      "Tensor block_ptr, Tensor block_keys, Tensor key_base, int num_segments, bool need_order) -> "
      "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) { m.impl("bucketize_blocks", &bucketize_blocks); }
