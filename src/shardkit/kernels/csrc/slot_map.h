// A row cache's slot map, row -> slot, as the native bookkeeping ops see it (csrc/row_cache.cpp,
// csrc/row_cache_ids.cpp; kernels/offload/slot_map.py builds and sizes it). Two layouts, one interface:
//
// - dense: [slot_of_row int32 [R]], -1 for a row not cached (4 bytes a row of the table);
// - hashed: [keys int64 [H], slots int32 [H]], H a power of two >= 16, keys[h] = -1 for an empty entry:
//   open addressing with linear probing from the row's home h(row) = (row * 0x9E3779B97F4A7C15) >> (64 -
//   log2 H) (Fibonacci hashing; the torch path computes the same home), deletion by backward shift (no
//   tombstones: a probe stops at the first empty entry). The Python side keeps H >= 2 x the cache's slots,
//   so the load stays <= 0.5 and a probe ends (12 bytes an entry: 24 to 48 bytes a slot of the cache).
//
// Layout-independent results: get / set / erase give the same slots whichever layout holds the map
// (tests/kernels/offload/test_slot_map.py compares them with the dense map and the torch path).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace shardkit_slot_map {

constexpr uint64_t kMultiplier = 0x9E3779B97F4A7C15ull;

struct SlotMapView {
  int32_t* dense = nullptr;  // the dense layout
  int64_t* keys = nullptr;   // the hashed layout
  int32_t* vals = nullptr;
  uint64_t mask = 0;
  int shift = 0;
  int64_t num_rows = 0;

  // `map`: [slot_of_row] or [keys, slots] (see above); `num_rows`: the table's rows (R), for range checks
  SlotMapView(at::TensorList map, int64_t rows, const char* op) : num_rows(rows) {
    TORCH_CHECK(map.size() == 1 || map.size() == 2, op, ": the slot map must be [slot_of_row] or [keys, slots], got ",
                map.size(), " tensors");
    for (const auto& t : map) {
      TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(), op,
                  ": the slot map's tensors must be contiguous 1-D CPU tensors");
    }
    if (map.size() == 1) {
      TORCH_CHECK(map[0].scalar_type() == at::kInt && map[0].numel() == rows, op,
                  ": a dense slot map is int32 [num_rows], got ", map[0].scalar_type(), " of shape ", map[0].sizes(),
                  " for ", rows, " rows");
      dense = map[0].data_ptr<int32_t>();
      return;
    }
    const int64_t size = map[0].numel();
    TORCH_CHECK(map[0].scalar_type() == at::kLong && map[1].scalar_type() == at::kInt && map[1].numel() == size, op,
                ": a hashed slot map is [keys int64 [H], slots int32 [H]]");
    TORCH_CHECK(size >= 16 && (size & (size - 1)) == 0, op, ": a hashed slot map's size ", size,
                " is not a power of two >= 16");
    keys = map[0].data_ptr<int64_t>();
    vals = map[1].data_ptr<int32_t>();
    mask = static_cast<uint64_t>(size) - 1;
    int bits = 0;
    while ((int64_t(1) << bits) < size) ++bits;
    shift = 64 - bits;
  }

  uint64_t home(int64_t row) const { return (static_cast<uint64_t>(row) * kMultiplier) >> shift; }

  // the slot of `row` (in [0, num_rows)), -1 if it is not cached
  int32_t get(int64_t row) const {
    if (dense) return dense[row];
    for (uint64_t h = home(row);; h = (h + 1) & mask) {
      const int64_t k = keys[h];
      if (k == row) return vals[h];
      if (k < 0) return -1;
    }
  }

  // `row` (not in the map) -> `slot`
  void set(int64_t row, int32_t slot) {
    if (dense) {
      dense[row] = slot;
      return;
    }
    uint64_t h = home(row);
    for (uint64_t probes = 0; keys[h] >= 0; h = (h + 1) & mask) {
      TORCH_CHECK(++probes <= mask, "slot map: the hashed map is full (", mask + 1, " entries)");
    }
    keys[h] = row;
    vals[h] = slot;
  }

  // `row` (in the map) forgotten; the entries after it in its run shifted back where their probe allows
  void erase(int64_t row) {
    if (dense) {
      dense[row] = -1;
      return;
    }
    uint64_t i = home(row);
    while (keys[i] != row) {
      TORCH_CHECK(keys[i] >= 0, "slot map: row ", row, " is not in the hashed map");
      i = (i + 1) & mask;
    }
    for (uint64_t j = (i + 1) & mask; keys[j] >= 0; j = (j + 1) & mask) {
      // the entry at j may move to the hole at i unless its home lies cyclically in (i, j]
      const uint64_t h = home(keys[j]);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        keys[i] = keys[j];
        vals[i] = vals[j];
        i = j;
      }
    }
    keys[i] = -1;
  }
};

}  // namespace shardkit_slot_map
