// A row cache's acquire of a step's ids, not of its distinct rows (kernels/offload/row_cache.py,
// RowCache.acquire_ids): the deduplication, the slot lookup and the ids' remap to slots in two native
// passes, where the pure-torch path runs torch.unique (a sort of all the ids, then an inverse), the
// lookup of the distinct rows and an index_select of their slots by the inverse. The same results as
// that path: the distinct rows ascending, the same pins, stamps and counts
// (tests/kernels/offload/test_row_cache_ids.py).
//
// row_cache_lookup_ids(slot_map (csrc/slot_map.h: dense or hashed), num_rows R, pins int32 [C] (written),
//                      ids int64 [N])
//     -> (rows int64 [U]: the distinct ids ascending (torch.unique's values); looked int64 [U]: the slot
//        of each, -1 for a miss; miss_rows int64 [M]: the rows with -1, ascending; inverse int64 [N]:
//        rows[inverse[k]] == ids[k]). Every hit's pin count is incremented once (before any victim is
//        chosen), as row_cache_lookup of `rows` does.
//     The ids are deduplicated by a bitmap of the table's rows where it has at most 256 N rows (the
//     distinct rows then come out of a scan of the bitmap ascending, each id's rank from counts of the
//     bits), else by an open-addressing hash table (2N entries or more, small enough to stay in the
//     CPU's caches) and a radix sort of the U distinct rows (11 bits a pass); then the slot map is read
//     in ascending row order, as the lookup after torch.unique did (a prefetch-friendly pattern; marking
//     rows in the map itself, megabytes for a large table, measured slower in a training step: a cache
//     miss per mark and per restore).
// row_cache_commit_ids(looked int64 [U], loaded int64 [M], inverse int64 [N], rows int64 [U],
//                      row_of_slot int64 [C], stamp int64 [C] (written), freq int64 [C] (written), clock)
//     -> (slots int64 [U], slot_ids int64 [N]): slots = looked with its -1 entries replaced, in order,
//        by `loaded` (the slots the misses were loaded into, in the misses' ascending order);
//        stamp[slots[i]] = clock + i, freq[slots] += 1 (as row_cache_commit); slot_ids[k] =
//        slots[inverse[k]] (the ids remapped to slots, the kernels' input).
//
// The caller holds the cache's lock; torch.ops calls release the Python interpreter's lock.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "slot_map.h"

namespace {

void check_1d(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(),
              "row_cache ids: ", what, " must be a contiguous 1-D CPU tensor of ", dtype, ", got ",
              t.scalar_type(), " of shape ", t.sizes());
}

// Sorts `keys` (each (row << 32) | index, row < 2^row_bits) ascending by row; rows are distinct, so the
// order is total. LSD radix over the row's bits, 11 a pass; a comparison sort when it is short or wide.
void sort_by_row(std::vector<uint64_t>& keys, int row_bits) {
  const size_t n = keys.size();
  constexpr int kDigit = 11;
  const int passes = (row_bits + kDigit - 1) / kDigit;
  if (n < 1024 || passes > 3) {
    std::sort(keys.begin(), keys.end());
    return;
  }
  std::vector<uint64_t> tmp(n);
  std::vector<size_t> count(size_t(1) << kDigit);
  for (int p = 0; p < passes; ++p) {
    const int shift = 32 + p * kDigit;
    std::fill(count.begin(), count.end(), 0);
    for (size_t i = 0; i < n; ++i) ++count[(keys[i] >> shift) & ((1u << kDigit) - 1)];
    size_t sum = 0;
    for (auto& c : count) {
      const size_t here = c;
      c = sum;
      sum += here;
    }
    for (size_t i = 0; i < n; ++i) tmp[count[(keys[i] >> shift) & ((1u << kDigit) - 1)]++] = keys[i];
    keys.swap(tmp);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_cache_lookup_ids(at::TensorList slot_map,
                                                                                 int64_t num_rows, at::Tensor pins,
                                                                                 const at::Tensor& ids) {
  const shardkit_slot_map::SlotMapView map(slot_map, num_rows, "row_cache_lookup_ids");
  check_1d(pins, at::kInt, "pins");
  check_1d(ids, at::kLong, "ids");
  const int64_t n = ids.numel();
  const int64_t size = pins.numel();
  TORCH_CHECK(num_rows <= (int64_t(1) << 32), "row_cache_lookup_ids: ", num_rows, " rows: at most 2^32");
  TORCH_CHECK(n < std::numeric_limits<int32_t>::max() - 2, "row_cache_lookup_ids: ", n, " ids: too many");
  const int64_t* id = ids.data_ptr<int64_t>();
  // checked before anything is written: a bad id leaves the pins untouched
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(id[k] >= 0 && id[k] < num_rows, "row_cache_lookup_ids: row ", id[k], " outside [0, ", num_rows,
                ")");
  }
  at::Tensor inverse = at::empty({n}, ids.options());
  int64_t* inv = inverse.data_ptr<int64_t>();
  std::vector<int64_t> first;  // the distinct rows, in the order of their first id (hash table path)
  at::Tensor rows;
  int64_t count = 0;
  if (num_rows / 64 <= 4 * n) {
    // a bitmap of the table's rows (R / 8 bytes, kept per thread: for such tables at most 32 bytes an
    // id): a pass setting the ids' bits, a scan of the bitmap that yields the distinct rows ascending
    // (no sort) with a count of the bits before each word, and a pass ranking each id among them
    const int64_t words = (num_rows + 63) / 64;
    thread_local std::vector<uint64_t> bits;
    thread_local std::vector<int32_t> before;
    // grown as needed; given back when 4x larger than needed (a table far larger seen once)
    if (static_cast<int64_t>(bits.size()) < words || static_cast<int64_t>(bits.size()) > 4 * words + 4096) {
      std::vector<uint64_t>(words, 0).swap(bits);
      std::vector<int32_t>(words).swap(before);
    }
    uint64_t* b = bits.data();
    struct Clear {  // the bitmap all zero again if anything below throws (an allocation)
      uint64_t* b;
      int64_t words;
      bool armed = true;
      ~Clear() {
        if (armed) std::fill(b, b + words, 0);
      }
    } clear{b, words};
    for (int64_t k = 0; k < n; ++k) b[id[k] >> 6] |= uint64_t(1) << (id[k] & 63);
    int64_t total = 0;
    for (int64_t w = 0; w < words; ++w) {
      before[w] = static_cast<int32_t>(total);
      total += __builtin_popcountll(b[w]);
    }
    count = total;
    rows = at::empty({count}, ids.options());
    int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t w = 0, j = 0; w < words; ++w) {
      for (uint64_t word = b[w]; word; word &= word - 1) r[j++] = w * 64 + __builtin_ctzll(word);
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t w = id[k] >> 6;
      inv[k] = before[w] + __builtin_popcountll(b[w] & ((uint64_t(1) << (id[k] & 63)) - 1));
    }
    for (int64_t j = 0; j < count; ++j) b[r[j] >> 6] = 0;  // cleared for the next call
    clear.armed = false;
  } else {
    // an open-addressing hash table of at least twice the ids (a few hundred KiB for a step's ids:
    // it stays in the CPU's caches), then a radix sort of the distinct rows
    int hbits = 4;
    while ((int64_t(1) << hbits) < 2 * n) ++hbits;
    const uint64_t mask = (uint64_t(1) << hbits) - 1;
    constexpr uint64_t kEmpty = ~uint64_t(0);
    // an entry: (row << 32) | index among the distinct rows (rows < 2^32, checked above); the table
    // is kept per thread between calls (no allocation nor page faults per step)
    thread_local std::vector<uint64_t> table;
    if (table.size() < mask + 1 || table.size() > 4 * (mask + 1) + 4096) std::vector<uint64_t>(mask + 1).swap(table);
    std::fill(table.begin(), table.begin() + (mask + 1), kEmpty);
    uint64_t* entries = table.data();
    first.reserve(n);
    for (int64_t k = 0; k < n; ++k) {
      const uint64_t row = static_cast<uint64_t>(id[k]);
      uint64_t h = (row * 0x9E3779B97F4A7C15ull) >> (64 - hbits);
      while (true) {
        const uint64_t e = entries[h];
        if ((e >> 32) == row && e != kEmpty) {
          inv[k] = static_cast<int64_t>(e & 0xffffffffu);
          break;
        }
        if (e == kEmpty) {
          const uint64_t u = first.size();
          entries[h] = (row << 32) | u;
          inv[k] = static_cast<int64_t>(u);
          first.push_back(static_cast<int64_t>(row));
          break;
        }
        h = (h + 1) & mask;
      }
    }
    count = static_cast<int64_t>(first.size());
    std::vector<uint64_t> keys(count);
    for (int64_t u = 0; u < count; ++u) keys[u] = (static_cast<uint64_t>(first[u]) << 32) | static_cast<uint64_t>(u);
    int row_bits = 1;
    while (row_bits < 63 && (int64_t(1) << row_bits) < num_rows) ++row_bits;
    sort_by_row(keys, row_bits);
    rows = at::empty({count}, ids.options());
    int64_t* r = rows.data_ptr<int64_t>();
    std::vector<int64_t> position(count);  // index of first occurrence -> index ascending
    for (int64_t j = 0; j < count; ++j) {
      const int64_t u = static_cast<int64_t>(keys[j] & 0xffffffffu);
      position[u] = j;
      r[j] = first[u];
    }
    for (int64_t k = 0; k < n; ++k) inv[k] = position[inv[k]];
  }
  const int64_t* r = rows.data_ptr<int64_t>();
  at::Tensor looked = at::empty({count}, ids.options());
  int64_t* l = looked.data_ptr<int64_t>();
  // the slot map read in ascending row order (the prefetcher's pattern), the hits pinned; a slot
  // outside the cache (a damaged map) undoes the pins made so far before raising
  int32_t* pin = pins.data_ptr<int32_t>();
  int64_t misses = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int32_t s = map.get(r[j]);
    l[j] = s;
    if (s < 0) {
      ++misses;
    } else if (s < size) {
      pin[s] += 1;
    } else {
      for (int64_t i = 0; i < j; ++i) {
        if (l[i] >= 0) pin[l[i]] -= 1;
      }
      TORCH_CHECK(false, "row_cache_lookup_ids: slot ", s, " of row ", r[j], " outside the ", size, " slots");
    }
  }
  at::Tensor miss_rows = at::empty({misses}, ids.options());
  int64_t* miss = miss_rows.data_ptr<int64_t>();
  for (int64_t j = 0, m = 0; j < count; ++j) {
    if (l[j] < 0) miss[m++] = r[j];
  }
  return {rows, looked, miss_rows, inverse};
}

std::tuple<at::Tensor, at::Tensor> row_cache_commit_ids(const at::Tensor& looked, const at::Tensor& loaded,
                                                        const at::Tensor& inverse, const at::Tensor& rows,
                                                        const at::Tensor& row_of_slot, at::Tensor stamp,
                                                        at::Tensor freq, int64_t clock) {
  check_1d(looked, at::kLong, "looked");
  check_1d(loaded, at::kLong, "loaded");
  check_1d(inverse, at::kLong, "inverse");
  check_1d(rows, at::kLong, "rows");
  check_1d(row_of_slot, at::kLong, "row_of_slot");
  check_1d(stamp, at::kLong, "stamp");
  check_1d(freq, at::kLong, "freq");
  const int64_t count = looked.numel();
  const int64_t size = row_of_slot.numel();
  TORCH_CHECK(rows.numel() == count, "row_cache_commit_ids: ", rows.numel(), " rows but ", count, " slots");
  TORCH_CHECK(stamp.numel() == size && freq.numel() == size, "row_cache_commit_ids: the per-slot tensors "
              "disagree on the slots");
  const int64_t* l = looked.data_ptr<int64_t>();
  const int64_t* ld = loaded.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  at::Tensor slots = at::empty({count}, looked.options());
  int64_t* out = slots.data_ptr<int64_t>();
  int64_t next = 0;
  for (int64_t i = 0; i < count; ++i) {
    int64_t s = l[i];
    if (s < 0) {
      TORCH_CHECK(next < loaded.numel(), "row_cache_commit_ids: more misses than the ", loaded.numel(),
                  " loaded slots");
      s = ld[next++];
    }
    // range only: the hits' slots were looked up under the same lock and are pinned, the misses'
    // were checked free by row_cache_install (a read of row_of_slot per row here: a cache miss each;
    // the tests compare every slot with the torch path's)
    TORCH_CHECK(s >= 0 && s < size, "row_cache_commit_ids: slot ", s, " of row ", r[i], " outside the ", size,
                " slots");
    out[i] = s;
  }
  TORCH_CHECK(next == loaded.numel(), "row_cache_commit_ids: ", loaded.numel(), " loaded slots but ", next,
              " misses");
  int64_t* st = stamp.data_ptr<int64_t>();
  int64_t* fr = freq.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    st[out[i]] = clock + i;
    fr[out[i]] += 1;
  }
  const int64_t n = inverse.numel();
  const int64_t* inv = inverse.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(inv[k] >= 0 && inv[k] < count, "row_cache_commit_ids: inverse ", inv[k], " outside [0, ", count,
                ")");
  }
  at::Tensor slot_ids = at::empty({n}, looked.options());
  int64_t* ids = slot_ids.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) ids[k] = out[inv[k]];
  return {slots, slot_ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def(
      "row_cache_lookup_ids(Tensor[] slot_map, int num_rows, Tensor(a!) pins, Tensor ids) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "row_cache_commit_ids(Tensor looked, Tensor loaded, Tensor inverse, Tensor rows, Tensor row_of_slot, "
      "Tensor(a!) stamp, Tensor(b!) freq, int clock) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) {
  m.impl("row_cache_lookup_ids", &row_cache_lookup_ids);
  m.impl("row_cache_commit_ids", &row_cache_commit_ids);
}
