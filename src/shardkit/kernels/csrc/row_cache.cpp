// The row cache's per-batch bookkeeping in one pass each (kernels/offload/row_cache.py, RowCache): the
// pure-torch path runs each of these as several small torch ops (index_select, compare, masked select,
// index_add_, kthvalue / topk over the whole cache); here they are single loops over the batch or the
// candidates. Same results as the torch path (tests/kernels/offload/test_row_cache_native.py):
//
// slot_map: the row -> slot map, [slot_of_row int32 [R]] (dense) or [keys int64 [H], slots int32 [H]]
// (hashed: open addressing, O(cache slots) whatever R), csrc/slot_map.h; num_rows: R.
//
// row_cache_lookup(slot_map, num_rows, pins int32 [C] (written), rows int64 [U])
//     -> (slots int64 [U]: the slot of each row, -1 for a miss; miss_rows int64 [M]: the rows with -1, in
//        the order of `rows`). Every hit's pin count is incremented (before any victim is chosen).
// row_cache_commit(slot_map, num_rows, rows int64 [U], stamp int64 [C] (written), freq int64 [C]
//                  (written), clock) -> slots int64 [U]: stamp[slots[i]] = clock + i, freq[slots] += 1.
// row_cache_victims(candidates int64 [n], stamp int64 [C], freq int64 [C], count, lfu)
//     -> the `count` candidates with the smallest (freq, stamp) (lfu) or stamp (lru), ascending slot
//        order; ties (never among stamped slots: stamps are distinct) broken by the smaller slot.
// row_cache_victim_rows(victims int64 [n], row_of_slot int64 [C], dirty bool [C])
//     -> (dirty_rows int64 [d], dirty_slots int64 [d]): the victims holding a dirty row, ascending by row
//        (the order they are written back in). Reads only: the write-back comes before row_cache_drop.
// row_cache_drop(victims, slot_map (written), num_rows, row_of_slot (written), dirty (written), stamp
//                (written), freq (written)): the victims' rows forgotten: out of the map, row_of_slot = -1,
//                dirty = false, stamp = freq = 0.
// row_cache_install(rows int64 [n], slots int64 [n], slot_map (written), num_rows, row_of_slot, dirty, stamp, freq, pins,
//                   pin): loaded rows made resident in their (free) slots, clean, unstamped, pinned `pin`
//                   times (an acquire pins its misses).
// row_cache_release(slots int64 [n], pins (written), dirty (written), mark_dirty): a ticket's slots
//     unpinned once each, marked dirty when its kernel updated them.
//
// The caller holds the cache's lock; the Python interpreter's lock is released by the dispatcher
// (torch.ops calls drop the GIL), so a thread running a kernel on pinned slots keeps going meanwhile.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "slot_map.h"

namespace {

using shardkit_slot_map::SlotMapView;

void check_1d(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(),
              "row_cache: ", what, " must be a contiguous 1-D CPU tensor of ", dtype, ", got ", t.scalar_type(),
              " of shape ", t.sizes());
}

std::tuple<at::Tensor, at::Tensor> row_cache_lookup(at::TensorList slot_map, int64_t num_rows, at::Tensor pins,
                                                    const at::Tensor& rows) {
  const SlotMapView map(slot_map, num_rows, "row_cache_lookup");
  check_1d(pins, at::kInt, "pins");
  check_1d(rows, at::kLong, "rows");
  const int64_t count = rows.numel();
  const int64_t size = pins.numel();
  const int64_t* row = rows.data_ptr<int64_t>();
  int32_t* pin = pins.data_ptr<int32_t>();
  at::Tensor slots = at::empty({count}, rows.options());
  int64_t* out = slots.data_ptr<int64_t>();
  // checked before anything is written: a bad row leaves the pins untouched (the slots looked up once)
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < num_rows, "row_cache_lookup: row ", row[i], " outside [0, ", num_rows,
                ")");
    const int32_t s = map.get(row[i]);
    TORCH_CHECK(s < size, "row_cache_lookup: slot ", s, " of row ", row[i], " outside the ", size, " slots");
    out[i] = s;
  }
  std::vector<int64_t> missing;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = out[i];
    if (s >= 0) {
      pin[s] += 1;
    } else {
      missing.push_back(row[i]);
    }
  }
  at::Tensor miss_rows = at::empty({static_cast<int64_t>(missing.size())}, rows.options());
  std::copy(missing.begin(), missing.end(), miss_rows.data_ptr<int64_t>());
  return {slots, miss_rows};
}

at::Tensor row_cache_commit(at::TensorList slot_map, int64_t num_rows, const at::Tensor& rows, at::Tensor stamp,
                            at::Tensor freq, int64_t clock) {
  const SlotMapView map(slot_map, num_rows, "row_cache_commit");
  check_1d(rows, at::kLong, "rows");
  check_1d(stamp, at::kLong, "stamp");
  check_1d(freq, at::kLong, "freq");
  TORCH_CHECK(stamp.numel() == freq.numel(), "row_cache_commit: stamp and freq disagree on the slots");
  const int64_t count = rows.numel();
  const int64_t size = stamp.numel();
  const int64_t* row = rows.data_ptr<int64_t>();
  at::Tensor slots = at::empty({count}, rows.options());
  int64_t* out = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < num_rows, "row_cache_commit: row ", row[i], " outside [0, ", num_rows,
                ")");
    const int32_t s = map.get(row[i]);
    TORCH_CHECK(s >= 0 && s < size, "row_cache_commit: row ", row[i], " is not resident (slot ", s, ")");
    out[i] = s;
  }
  int64_t* st = stamp.data_ptr<int64_t>();
  int64_t* fr = freq.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = out[i];
    st[s] = clock + i;
    fr[s] += 1;
  }
  return slots;
}

at::Tensor row_cache_victims(const at::Tensor& candidates, const at::Tensor& stamp, const at::Tensor& freq,
                             int64_t count, bool lfu) {
  check_1d(candidates, at::kLong, "candidates");
  check_1d(stamp, at::kLong, "stamp");
  check_1d(freq, at::kLong, "freq");
  const int64_t n = candidates.numel();
  const int64_t size = stamp.numel();
  TORCH_CHECK(count >= 0, "row_cache_victims: count must be >= 0, got ", count);
  const int64_t* cand = candidates.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(cand[i] >= 0 && cand[i] < size, "row_cache_victims: slot ", cand[i], " outside the ", size,
                " slots");
  }
  if (count >= n) {
    return candidates.clone();
  }
  const int64_t* st = stamp.data_ptr<int64_t>();
  const int64_t* fr = freq.data_ptr<int64_t>();
  std::vector<int64_t> chosen;
  chosen.reserve(count);
  // lfu, as the torch path: every candidate with fewer acquisitions than the count-th smallest, then the
  // least recent of those tied at that count (a selection over 8-byte counts, then one over the ties)
  int64_t threshold = 0;
  if (lfu && count > 0) {
    std::vector<int64_t> counts(n);
    for (int64_t i = 0; i < n; ++i) counts[i] = fr[cand[i]];
    std::nth_element(counts.begin(), counts.begin() + (count - 1), counts.end());
    threshold = counts[count - 1];
  }
  std::vector<std::pair<int64_t, int64_t>> tied;  // (stamp, slot) of the candidates at the threshold
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = cand[i];
    const int64_t f = lfu ? fr[s] : 0;
    if (f < threshold) {
      chosen.push_back(s);
    } else if (f == threshold) {
      tied.emplace_back(st[s], s);
    }
  }
  const int64_t rest = count - static_cast<int64_t>(chosen.size());
  if (rest > 0) {
    std::nth_element(tied.begin(), tied.begin() + (rest - 1), tied.end());
    for (int64_t i = 0; i < rest; ++i) chosen.push_back(tied[i].second);
  }
  std::sort(chosen.begin(), chosen.end());
  at::Tensor out = at::empty({count}, candidates.options());
  std::copy(chosen.begin(), chosen.end(), out.data_ptr<int64_t>());
  return out;
}

std::tuple<at::Tensor, at::Tensor> row_cache_victim_rows(const at::Tensor& victims, const at::Tensor& row_of_slot,
                                                         const at::Tensor& dirty) {
  check_1d(victims, at::kLong, "victims");
  check_1d(row_of_slot, at::kLong, "row_of_slot");
  check_1d(dirty, at::kBool, "dirty");
  TORCH_CHECK(dirty.numel() == row_of_slot.numel(), "row_cache_victim_rows: dirty and row_of_slot disagree");
  const int64_t n = victims.numel();
  const int64_t size = row_of_slot.numel();
  const int64_t* v = victims.data_ptr<int64_t>();
  const int64_t* row = row_of_slot.data_ptr<int64_t>();
  const bool* d = dirty.data_ptr<bool>();
  std::vector<std::pair<int64_t, int64_t>> out;  // (row, slot) of the dirty victims
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(v[i] >= 0 && v[i] < size && row[v[i]] >= 0, "row_cache_victim_rows: slot ", v[i],
                " holds no row");
    if (d[v[i]]) out.emplace_back(row[v[i]], v[i]);
  }
  std::sort(out.begin(), out.end());
  const int64_t count = static_cast<int64_t>(out.size());
  at::Tensor rows = at::empty({count}, victims.options());
  at::Tensor slots = at::empty({count}, victims.options());
  int64_t* r = rows.data_ptr<int64_t>();
  int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    r[i] = out[i].first;
    s[i] = out[i].second;
  }
  return {rows, slots};
}

void row_cache_drop(const at::Tensor& victims, at::TensorList slot_map, int64_t num_rows, at::Tensor row_of_slot,
                    at::Tensor dirty, at::Tensor stamp, at::Tensor freq) {
  check_1d(victims, at::kLong, "victims");
  SlotMapView map(slot_map, num_rows, "row_cache_drop");
  check_1d(row_of_slot, at::kLong, "row_of_slot");
  check_1d(dirty, at::kBool, "dirty");
  check_1d(stamp, at::kLong, "stamp");
  check_1d(freq, at::kLong, "freq");
  const int64_t size = row_of_slot.numel();
  TORCH_CHECK(dirty.numel() == size && stamp.numel() == size && freq.numel() == size,
              "row_cache_drop: the per-slot tensors disagree on the slots");
  const int64_t n = victims.numel();
  const int64_t* v = victims.data_ptr<int64_t>();
  int64_t* row = row_of_slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // checked before anything is written
    TORCH_CHECK(v[i] >= 0 && v[i] < size && row[v[i]] >= 0 && row[v[i]] < num_rows, "row_cache_drop: slot ",
                v[i], " holds no row");
    TORCH_CHECK(map.get(row[v[i]]) == v[i], "row_cache_drop: row ", row[v[i]], " of slot ", v[i],
                " is not mapped to it");
  }
  bool* d = dirty.data_ptr<bool>();
  int64_t* st = stamp.data_ptr<int64_t>();
  int64_t* fr = freq.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = v[i];
    map.erase(row[s]);
    row[s] = -1;
    d[s] = false;
    st[s] = 0;
    fr[s] = 0;
  }
}

void row_cache_install(const at::Tensor& rows, const at::Tensor& slots, at::TensorList slot_map, int64_t num_rows,
                       at::Tensor row_of_slot, at::Tensor dirty, at::Tensor stamp, at::Tensor freq, at::Tensor pins,
                       int64_t pin) {
  check_1d(rows, at::kLong, "rows");
  check_1d(slots, at::kLong, "slots");
  SlotMapView map(slot_map, num_rows, "row_cache_install");
  check_1d(row_of_slot, at::kLong, "row_of_slot");
  check_1d(dirty, at::kBool, "dirty");
  check_1d(stamp, at::kLong, "stamp");
  check_1d(freq, at::kLong, "freq");
  check_1d(pins, at::kInt, "pins");
  const int64_t size = row_of_slot.numel();
  TORCH_CHECK(dirty.numel() == size && stamp.numel() == size && freq.numel() == size && pins.numel() == size,
              "row_cache_install: the per-slot tensors disagree on the slots");
  TORCH_CHECK(rows.numel() == slots.numel(), "row_cache_install: ", rows.numel(), " rows but ", slots.numel(),
              " slots");
  const int64_t n = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  int64_t* row = row_of_slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < num_rows && map.get(r[i]) < 0, "row_cache_install: row ", r[i],
                " is outside the table or already resident");
    TORCH_CHECK(s[i] >= 0 && s[i] < size && row[s[i]] < 0, "row_cache_install: slot ", s[i], " is not free");
  }
  bool* d = dirty.data_ptr<bool>();
  int64_t* st = stamp.data_ptr<int64_t>();
  int64_t* fr = freq.data_ptr<int64_t>();
  int32_t* p = pins.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    map.set(r[i], static_cast<int32_t>(s[i]));
    row[s[i]] = r[i];
    d[s[i]] = false;
    st[s[i]] = 0;
    fr[s[i]] = 0;
    p[s[i]] += static_cast<int32_t>(pin);
  }
}

void row_cache_release(const at::Tensor& slots, at::Tensor pins, at::Tensor dirty, bool mark_dirty) {
  check_1d(slots, at::kLong, "slots");
  check_1d(pins, at::kInt, "pins");
  check_1d(dirty, at::kBool, "dirty");
  const int64_t n = slots.numel();
  const int64_t size = pins.numel();
  TORCH_CHECK(dirty.numel() == size, "row_cache_release: pins and dirty disagree on the slots");
  const int64_t* s = slots.data_ptr<int64_t>();
  int32_t* p = pins.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < size && p[s[i]] > 0, "row_cache_release: slot ", s[i], " is not pinned");
  }
  bool* d = dirty.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    p[s[i]] -= 1;
    if (mark_dirty) d[s[i]] = true;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def("row_cache_lookup(Tensor[] slot_map, int num_rows, Tensor(a!) pins, Tensor rows) -> (Tensor, Tensor)");
  m.def(
      "row_cache_commit(Tensor[] slot_map, int num_rows, Tensor rows, Tensor(a!) stamp, Tensor(b!) freq, int clock) "
      "-> Tensor");
  m.def("row_cache_victims(Tensor candidates, Tensor stamp, Tensor freq, int count, bool lfu) -> Tensor");
  m.def("row_cache_victim_rows(Tensor victims, Tensor row_of_slot, Tensor dirty) -> (Tensor, Tensor)");
  m.def(
      "row_cache_drop(Tensor victims, Tensor(a!)[] slot_map, int num_rows, Tensor(b!) row_of_slot, Tensor(c!) dirty, "
      "Tensor(d!) stamp, Tensor(e!) freq) -> ()");
  m.def(
      "row_cache_install(Tensor rows, Tensor slots, Tensor(a!)[] slot_map, int num_rows, Tensor(b!) row_of_slot, "
      "Tensor(c!) dirty, Tensor(d!) stamp, Tensor(e!) freq, Tensor(f!) pins, int pin) -> ()");
  m.def("row_cache_release(Tensor slots, Tensor(a!) pins, Tensor(b!) dirty, bool mark_dirty) -> ()");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) {
  m.impl("row_cache_lookup", &row_cache_lookup);
  m.impl("row_cache_commit", &row_cache_commit);
  m.impl("row_cache_victims", &row_cache_victims);
  m.impl("row_cache_victim_rows", &row_cache_victim_rows);
  m.impl("row_cache_drop", &row_cache_drop);
  m.impl("row_cache_install", &row_cache_install);
  m.impl("row_cache_release", &row_cache_release);
}
