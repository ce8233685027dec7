// The row cache's replacement queue (kernels/offload/slot_queue.py, NativeSlotQueue), a torch custom class
// `torch.classes.shardkit_native.SlotQueue`: the victims of an eviction taken from the front of a queue
// instead of a selection over every slot of the cache.
//
// Victims are the unpinned resident slots with the smallest key: LRU, the last-acquire stamp; LFU, the
// (acquisitions since loaded, stamp) pair. Every commit of an acquire appends its slots with their new
// stamps, to the bucket of their new acquisition count (LFU) or to the one bucket (LRU): since a stamp is
// larger than every earlier one, each bucket stays in stamp order without sorting. A slot's entry is
// *current* while the slot still has the entry's stamp (stamps never repeat; loading and eviction reset
// a slot's stamp to 0), so an acquire's new entry makes the slot's older ones stale, and each resident
// stamped slot has exactly one current entry, in the bucket of its count. take() walks the buckets in
// ascending count, each from its front: stale entries are dropped, current pinned ones stay in their place,
// the others are taken: exactly the slots the full selection (victims.py, row_cache_victims) would choose.
//
// Stale entries are dropped only when they reach the front; the caller rebuilds the queue from the stamps
// (rebuild) once it holds several times as many entries as slots, and after anything that moves slots
// (shrinking) or leaves a resident slot without an entry (an acquire that failed halfway: its rows stay
// resident with stamp 0, which rebuild() puts first, as the full selection would).
//
// Not thread-safe: the cache's lock serializes every call.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <tuple>
#include <vector>

namespace {

void check_slots(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(),
              "SlotQueue: ", what, " must be a contiguous 1-D CPU tensor of ", dtype, ", got ", t.scalar_type(),
              " of shape ", t.sizes());
}

struct Entry {
  int64_t slot;
  int64_t stamp;
};

struct SlotQueue : torch::CustomClassHolder {
  bool lfu;
  std::map<int64_t, std::deque<Entry>> buckets;  // key (0 for LRU, the count for LFU) -> entries
  int64_t entries = 0;

  explicit SlotQueue(bool lfu_) : lfu(lfu_) {}

  // slots[i] was stamped clock + i; freq: every slot's count after this acquire (LFU's bucket)
  void push(const at::Tensor& slots, const at::Tensor& freq, int64_t clock) {
    check_slots(slots, at::kLong, "slots");
    check_slots(freq, at::kLong, "freq");
    const int64_t n = slots.numel();
    const int64_t size = freq.numel();
    const int64_t* s = slots.data_ptr<int64_t>();
    const int64_t* fr = freq.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(s[i] >= 0 && s[i] < size, "SlotQueue.push: slot ", s[i], " outside the ", size, " slots");
    }
    std::deque<Entry>* bucket = nullptr;
    int64_t bucket_key = -1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = lfu ? fr[s[i]] : 0;
      if (bucket == nullptr || key != bucket_key) {  // an acquire's slots mostly share a count
        bucket = &buckets[key];
        bucket_key = key;
      }
      bucket->push_back({s[i], clock + i});
    }
    entries += n;
  }

  // The `count` victims, ascending; fewer than `count` when the queue ran out (it has then lost the
  // entries it took: the caller chooses by a full selection and rebuilds the queue)
  at::Tensor take(int64_t count, const at::Tensor& stamp, const at::Tensor& pins) {
    check_slots(stamp, at::kLong, "stamp");
    check_slots(pins, at::kInt, "pins");
    TORCH_CHECK(stamp.numel() == pins.numel(), "SlotQueue.take: stamp and pins disagree on the slots");
    TORCH_CHECK(count >= 0, "SlotQueue.take: count must be >= 0, got ", count);
    const int64_t size = stamp.numel();
    const int64_t* st = stamp.data_ptr<int64_t>();
    const int32_t* pin = pins.data_ptr<int32_t>();
    std::vector<int64_t> taken;
    taken.reserve(count);
    std::vector<Entry> kept;  // current pinned entries met on the way: back to the front, in order
    auto it = buckets.begin();
    while (static_cast<int64_t>(taken.size()) < count && it != buckets.end()) {
      std::deque<Entry>& q = it->second;
      kept.clear();
      while (static_cast<int64_t>(taken.size()) < count && !q.empty()) {
        const Entry e = q.front();
        q.pop_front();
        --entries;
        if (e.slot >= size || st[e.slot] != e.stamp) continue;  // stale
        if (pin[e.slot] != 0) {
          kept.push_back(e);
        } else {
          taken.push_back(e.slot);
        }
      }
      for (auto k = kept.rbegin(); k != kept.rend(); ++k) q.push_front(*k);
      entries += static_cast<int64_t>(kept.size());
      if (q.empty()) {
        it = buckets.erase(it);
      } else if (static_cast<int64_t>(taken.size()) < count) {
        ++it;  // only pinned entries left in this bucket
      }
    }
    std::sort(taken.begin(), taken.end());
    at::Tensor out = at::empty({static_cast<int64_t>(taken.size())}, stamp.options());
    std::copy(taken.begin(), taken.end(), out.data_ptr<int64_t>());
    return out;
  }

  // One current entry per resident slot (row_of_slot >= 0), in (key, stamp, slot) order
  void rebuild(const at::Tensor& row_of_slot, const at::Tensor& stamp, const at::Tensor& freq) {
    check_slots(row_of_slot, at::kLong, "row_of_slot");
    check_slots(stamp, at::kLong, "stamp");
    check_slots(freq, at::kLong, "freq");
    const int64_t size = row_of_slot.numel();
    TORCH_CHECK(stamp.numel() == size && freq.numel() == size, "SlotQueue.rebuild: ", size, " slots but ",
                stamp.numel(), " stamps and ", freq.numel(), " counts");
    const int64_t* row = row_of_slot.data_ptr<int64_t>();
    const int64_t* st = stamp.data_ptr<int64_t>();
    const int64_t* fr = freq.data_ptr<int64_t>();
    std::vector<std::tuple<int64_t, int64_t, int64_t>> order;  // (key, stamp, slot)
    for (int64_t s = 0; s < size; ++s) {
      if (row[s] >= 0) order.emplace_back(lfu ? fr[s] : 0, st[s], s);
    }
    std::sort(order.begin(), order.end());
    buckets.clear();
    for (const auto& [key, stamp_of, slot] : order) buckets[key].push_back({slot, stamp_of});
    entries = static_cast<int64_t>(order.size());
  }

  void clear() {
    buckets.clear();
    entries = 0;
  }

  int64_t size() const { return entries; }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.class_<SlotQueue>("SlotQueue")
      .def(torch::init<bool>())
      .def("push", &SlotQueue::push)
      .def("take", &SlotQueue::take)
      .def("rebuild", &SlotQueue::rebuild)
      .def("clear", &SlotQueue::clear)
      .def("entries", &SlotQueue::size);
}
