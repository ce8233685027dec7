// Native CPU kernels of a FUSED data-parallel table's backward (shardkit/sharding/replicated_*.py):
// this rank's gradient of the rows its ids touched, summed into a kept buffer by a scatter in id
// order, with no sort of the ids. Pure-torch twins: shardkit/kernels/replica_grad.py.
//
// Numerics: each target row's sum takes its ids' contributions in id order starting from 0, the
// order of the fused backward (embedding_backward.cpp), so the sums are those of that kernel; each
// contribution is multiplied by `factor` (a power of two: the division by the world size) before it
// is added, which for a power of two changes no bit outside the subnormal range.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "embedding_common.h"

namespace {

using shardkit_embedding::grad_offset;
using shardkit_embedding::gradient_row_distance;

constexpr int64_t kAhead = 16;     // ids ahead whose target row is prefetched
constexpr int64_t kBagsAhead = 8;  // bags ahead whose gradient row is prefetched
// Putting U touched rows of a table of R in order: a sort of their list costs ~3 ns x U log2 U, a read
// of every mark ~0.08 ns a row (one call, one thread, Zen 3, warm caches: sort 1024 rows 25-31 us, 4096
// 141 us, 8192 424 us; read 1e6 marks 87 us, 2.56e5 22-34 us). The sort is taken where U log2 U x
// kMarksPerSortStep < R (twenty-fourth session's timings, tests/kernels/test_replica_grad.py has both ways).
constexpr int64_t kMarksPerSortStep = 40;

inline bool sort_beats_read(int64_t count, int64_t num_rows) {
  return count <= 1 || count * (64 - __builtin_clzll(static_cast<uint64_t>(count))) * kMarksPerSortStep < num_rows;
}

// Asks for every cache line of `count` floats at `p` (into L2: prefetcht2, as the lookup kernels).
inline void prefetch_row(const float* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t k = 0; k < count * 4; k += 64) __builtin_prefetch(bytes + k, 0, 1);
}

// Calls f(std::integral_constant<int64_t, D>) with D = dim for the common widths, else D = 0.
template <typename F>
inline void with_width(int64_t dim, F&& f) {
  switch (dim) {
    case 8: f(std::integral_constant<int64_t, 8>()); break;
    case 16: f(std::integral_constant<int64_t, 16>()); break;
    case 32: f(std::integral_constant<int64_t, 32>()); break;
    case 64: f(std::integral_constant<int64_t, 64>()); break;
    case 128: f(std::integral_constant<int64_t, 128>()); break;
    default: f(std::integral_constant<int64_t, 0>());
  }
}

template <typename index_t>
void check_rows(const index_t* id, const int64_t* off, const int64_t* shift, int64_t bags, int64_t num_rows) {
  for (int64_t b = 0; b < bags; ++b) {
    const int64_t s = shift ? shift[b] : 0;
    for (int64_t i = off[b]; i < off[b + 1]; ++i) {
      const int64_t row = static_cast<int64_t>(id[i]) + s;
      TORCH_CHECK_INDEX(row >= 0 && row < num_rows, "id at position ", i, " maps to buffer row ", row,
                        ", outside [0, ", num_rows, ")");
    }
  }
}

void check_lookup(const at::Tensor& ids, const at::Tensor& offsets, const c10::optional<at::Tensor>& shift) {
  TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous() && (ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt),
              "ids must be contiguous int32 or int64 [ids]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              "offsets must be contiguous int64 [bags + 1]");
  TORCH_CHECK(offsets.data_ptr<int64_t>()[offsets.numel() - 1] == ids.numel(), "offsets must end at the number of ids");
  if (shift) {
    TORCH_CHECK(shift->scalar_type() == at::kLong && shift->is_contiguous() && shift->numel() == offsets.numel() - 1,
                "bag_shift must be contiguous int64 [bags]");
  }
}

// Marks the buffer row of every id (marks all zero on entry) and returns how many distinct rows were
// marked. A row outside [0, num_rows) raises IndexError naming the id, after clearing the marks this
// call set (the kept scratch stays all zero).
// Each newly marked row is also written to `found` (room for every id), in id order. `pos` (int64
// [num_rows]) is only prefetched: the position of each newly marked row, which the read-back writes and
// the scatter reads (the marks and positions of a 1e5-row table are past the caches by the next
// backward, a miss per id and per row otherwise).
template <typename index_t>
int64_t mark_rows(uint8_t* mark, const int64_t* pos, int64_t* found, const index_t* id, const int64_t* off,
                  const int64_t* shift, int64_t bags, int64_t num_rows) {
  int64_t count = 0;
  const int64_t n = off[bags];
  for (int64_t b = 0; b < bags; ++b) {
    const int64_t s = shift ? shift[b] : 0;
    for (int64_t i = off[b]; i < off[b + 1]; ++i) {
      if (i + kAhead < n) {  // this bag's shift: right but at a feature's last ids, where it is only wasted
        const int64_t ahead = static_cast<int64_t>(id[i + kAhead]) + s;
        if (ahead >= 0 && ahead < num_rows) __builtin_prefetch(mark + ahead, 1, 3);
      }
      const int64_t row = static_cast<int64_t>(id[i]) + s;
      if (row < 0 || row >= num_rows) {
        for (int64_t c = 0; c < b; ++c) {
          for (int64_t j = off[c]; j < off[c + 1]; ++j) mark[static_cast<int64_t>(id[j]) + (shift ? shift[c] : 0)] = 0;
        }
        for (int64_t j = off[b]; j < i; ++j) mark[static_cast<int64_t>(id[j]) + s] = 0;
        TORCH_CHECK_INDEX(false, "id at position ", i, " maps to buffer row ", row, ", outside [0, ", num_rows, ")");
      }
      if (!mark[row]) {
        __builtin_prefetch(pos + row, 1, 3);
        found[count++] = row;
        mark[row] = 1;
      }
    }
  }
  return count;
}

// replica_touched_rows(marks, position, ids, offsets, bag_shift) -> rows: the distinct buffer rows
// (int64 [U], ascending) that the ids touch (row of id i = ids[i] + bag_shift[bag of i]), and
// position[row] = its index in rows for each of them (other entries of position are left as they
// were). marks (uint8 [R]) must be all zero on entry and is all zero again on return (no sort, no memset).
at::Tensor replica_touched_rows(at::Tensor& marks, at::Tensor& position, const at::Tensor& ids,
                                const at::Tensor& offsets, const c10::optional<at::Tensor>& bag_shift) {
  check_lookup(ids, offsets, bag_shift);
  const int64_t num_rows = marks.numel(), bags = offsets.numel() - 1;
  TORCH_CHECK(marks.scalar_type() == at::kByte && marks.is_contiguous(), "marks must be contiguous uint8 [rows]");
  TORCH_CHECK(position.scalar_type() == at::kLong && position.is_contiguous() && position.numel() == num_rows,
              "position must be contiguous int64 [rows], as marks");
  const int64_t* shift = bag_shift ? bag_shift->data_ptr<int64_t>() : nullptr;
  const int64_t* off = offsets.data_ptr<int64_t>();
  uint8_t* mark = marks.data_ptr<uint8_t>();
  int64_t* pos = position.data_ptr<int64_t>();
  // one pass over the ids checks, marks, counts and lists the distinct rows; then they are put in
  // order by sorting that list or, where they are not sparse, by one read of the marks
  at::Tensor found = at::empty({ids.numel()}, ids.options().dtype(at::kLong));
  int64_t* out = found.data_ptr<int64_t>();
  const int64_t count = ids.scalar_type() == at::kLong
                            ? mark_rows(mark, pos, out, ids.data_ptr<int64_t>(), off, shift, bags, num_rows)
                            : mark_rows(mark, pos, out, ids.data_ptr<int32_t>(), off, shift, bags, num_rows);
  if (sort_beats_read(count, num_rows)) {
    // few rows of many (a thousand ids in a 1e6-row table): sorting them beats reading every mark
    std::sort(out, out + count);
    for (int64_t k = 0; k < count; ++k) {
      mark[out[k]] = 0;
      pos[out[k]] = k;
    }
    return found.narrow(0, 0, count);
  }
  // the read-back, 8 marks (bytes of 0 or 1) a word: a word's set bits are its marked rows, lowest
  // address first on a little-endian CPU, found by counting trailing zeros (a byte-by-byte read of every
  // mark cost ~1 ns a row: 0.2 ms a step at 256k rows); whole spans of 32 unmarked bytes are skipped.
  // The rows overwrite the list, which is never ahead of them (k <= count).
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the marks' read-back assumes little-endian words");
  int64_t k = 0;
  auto take_word = [&](int64_t r, uint64_t word) {
    for (; word != 0; word &= word - 1) {
      const int64_t row = r + (__builtin_ctzll(word) >> 3);
      mark[row] = 0;
      pos[row] = k;
      out[k++] = row;
    }
  };
  constexpr int64_t kSpan = 32;
  const int64_t whole = num_rows - num_rows % kSpan;
  for (int64_t r = 0; r < whole; r += kSpan) {
    uint64_t words[kSpan / 8];
    std::memcpy(words, mark + r, kSpan);
    if ((words[0] | words[1] | words[2] | words[3]) == 0) continue;
    for (int64_t w = 0; w < kSpan / 8; ++w) take_word(r + 8 * w, words[w]);
  }
  for (int64_t r = whole; r < num_rows; ++r) take_word(r, mark[r]);
  return found.narrow(0, 0, count);
}

// The scatter: target t of id i = position[row] (or row itself without position); a thread owns the
// targets of a range of buffer rows (so no target is written by two threads, and each target's ids
// come in id order).
template <int64_t kDim, typename index_t>
int64_t scatter_kernel(float* out, float* seen, int64_t targets, const index_t* id, const int64_t* off,
                       const int64_t* shift, const float* psw, const float* scale, const float* grad,
                       int64_t ld, bool pooled, int64_t run_time_dim, int64_t bags, int64_t batch, float factor,
                       const int64_t* position, int64_t num_rows) {
  const int64_t dim = kDim > 0 ? kDim : run_time_dim;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_rows / 4096 + 1));
  std::vector<int64_t> counts(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = num_rows * t / threads, hi = num_rows * (t + 1) / threads;
      int64_t count = 0;
      float fixed[kDim > 0 ? kDim : 1];
      std::vector<float> storage(kDim > 0 ? 0 : dim);
      float* term = kDim > 0 ? fixed : storage.data();  // one id's contribution
      const int64_t n = off[bags];
      // where bag b's gradient row starts (grad_offset; rows ld values apart: a column slice of several
      // groups' gradient), kept up to date without a division per bag
      int64_t sample = 0, feature = 0;
      for (int64_t b = 0; b < bags; ++b) {
        const int64_t bag_at = batch > 0 ? sample * ld + feature * dim : b * ld;
        if (batch > 0 && ++sample == batch) {
          sample = 0;
          ++feature;
        }
        // the gradient rows of feature-major bags in a sample-major gradient are a whole row of the
        // KeyedTensor apart (pages apart): ask for a later bag's row now, as its rows' are asked below
        if (pooled && b + kBagsAhead < bags) prefetch_row(grad + grad_offset(b + kBagsAhead, batch, dim, ld), dim);
        const int64_t s = shift ? shift[b] : 0;
        const float c = scale ? scale[b] : 1.0f;
        // one id's contribution before its weight: the same for every id of a pooled bag, made once, at
        // the bag's first id this thread owns (a thread owning none of a bag's rows makes none)
        bool term_made = false;
        auto make_term = [&](const float* g) {
          if (scale) {
            for (int64_t j = 0; j < dim; ++j) term[j] = (g[j] * c) * factor;
          } else {
            for (int64_t j = 0; j < dim; ++j) term[j] = g[j] * factor;
          }
        };
        for (int64_t i = off[b]; i < off[b + 1]; ++i) {
        const int64_t row = static_cast<int64_t>(id[i]) + s;
        if (row < lo || row >= hi) continue;
        // the next ids are mostly of this bag's table: their rows, with this bag's shift. With a
        // position map, two stages: the map's entry 2 x kAhead ids ahead, then (cached by now) the
        // target row kAhead ahead, so that no load here waits on memory
        if (position && i + 2 * kAhead < n) {
          const int64_t later = static_cast<int64_t>(id[i + 2 * kAhead]) + s;
          if (later >= 0 && later < num_rows) __builtin_prefetch(position + later, 0, 1);
        }
        if (i + kAhead < n) {
          const int64_t next = static_cast<int64_t>(id[i + kAhead]) + s;
          if (next >= 0 && next < num_rows) {
            const int64_t nt = position ? position[next] : next;
            if (nt >= 0 && nt < targets) prefetch_row(out + nt * dim, dim);
          }
        }
        const int64_t target = position ? position[row] : row;
        float* o = out + target * dim;
        if (!pooled) {
          make_term(grad + i * ld);
        } else if (!term_made) {
          make_term(grad + bag_at);
          term_made = true;
        }
        const float w = psw ? psw[i] : 1.0f;
        // the fused backward's sum: acc = 0, then per id in order acc += g * c (or fma(w, g * c, acc)); here
        // each term times factor, the first one written into the (unspecified) target row as 0 + term
        const bool first = seen[target] == 0.0f;
        if (first) {
          seen[target] = 1.0f;
          ++count;
        }
        if (first) {
          if (psw) {
            for (int64_t j = 0; j < dim; ++j) o[j] = std::fma(w, term[j], 0.0f);
          } else {
            for (int64_t j = 0; j < dim; ++j) o[j] = 0.0f + term[j];
          }
        } else if (psw) {
          for (int64_t j = 0; j < dim; ++j) o[j] = std::fma(w, term[j], o[j]);
        } else {
          for (int64_t j = 0; j < dim; ++j) o[j] += term[j];
        }
        }
      }
      counts[t] = count;
    }
  });
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

// replica_grad_scatter(out, seen, ids, offsets, bag_shift, per_sample_weights, bag_scale, grad, pooled,
// batch, factor, position, num_rows) -> the number of targets touched. grad: [bags, D] pooled (sample-major
// [batch, bags / batch * D] when batch > 0), else [ids, D] (one row per id, weights and scale unused).
// out: fp32 [T, D] contiguous; seen: fp32 [T], all zero on entry. Target of id i: position[row of i]
// (position int64 [R] given: T = the touched rows, R = weight rows) or the row itself (no position:
// T = R). On return, for each touched target t: seen[t] = 1 and out[t] = the sum over its ids, in id
// order, of factor * w_i * scale_b * grad[b] (the fused backward's sum, times factor); every target
// not touched is zeroed (out) and left 0 (seen). Rows of out start unspecified: nothing is memset.
int64_t replica_grad_scatter(at::Tensor& out, at::Tensor& seen, const at::Tensor& ids, const at::Tensor& offsets,
                             const c10::optional<at::Tensor>& bag_shift,
                             const c10::optional<at::Tensor>& per_sample_weights,
                             const c10::optional<at::Tensor>& bag_scale, const at::Tensor& grad, bool pooled,
                             int64_t batch, double factor, const c10::optional<at::Tensor>& position, int64_t num_rows) {
  check_lookup(ids, offsets, bag_shift);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(), "out must be contiguous fp32 [targets, dim]");
  const int64_t targets = out.size(0), dim = out.size(1), bags = offsets.numel() - 1;
  TORCH_CHECK(seen.scalar_type() == at::kFloat && seen.is_contiguous() && seen.numel() == targets,
              "seen must be contiguous fp32 [targets]");
  const int64_t grad_rows = pooled ? bags : ids.numel();
  TORCH_CHECK(batch == 0 || (pooled && batch > 0 && bags % batch == 0),
              "batch must be 0 or divide the number of bags of a pooled lookup");
  const int64_t ld = gradient_row_distance(grad, grad_rows, dim, batch);
  if (per_sample_weights) {
    TORCH_CHECK(per_sample_weights->scalar_type() == at::kFloat && per_sample_weights->is_contiguous() &&
                    per_sample_weights->numel() == ids.numel(),
                "per_sample_weights must be contiguous fp32 [ids]");
  }
  if (bag_scale) {
    TORCH_CHECK(bag_scale->scalar_type() == at::kFloat && bag_scale->is_contiguous() && bag_scale->numel() == bags,
                "bag_scale must be contiguous fp32 [bags]");
  }
  if (position) {
    TORCH_CHECK(position->scalar_type() == at::kLong && position->is_contiguous() && position->numel() == num_rows,
                "position must be contiguous int64 [rows]");
  } else {
    TORCH_CHECK(num_rows == targets, "without position, num_rows must be out's rows");
  }
  const int64_t* shift = bag_shift ? bag_shift->data_ptr<int64_t>() : nullptr;
  const int64_t* off = offsets.data_ptr<int64_t>();
  // one row per id (not pooled): nothing to weight or scale
  const float* psw = per_sample_weights && pooled ? per_sample_weights->data_ptr<float>() : nullptr;
  const float* scale = bag_scale && pooled ? bag_scale->data_ptr<float>() : nullptr;
  const int64_t* pos = position ? position->data_ptr<int64_t>() : nullptr;
  float* o = out.data_ptr<float>();
  float* s = seen.data_ptr<float>();
  int64_t count = 0;
  with_width(dim, [&](auto width) {
    constexpr int64_t kDim = decltype(width)::value;
    if (ids.scalar_type() == at::kLong) {
      check_rows(ids.data_ptr<int64_t>(), off, shift, bags, num_rows);
      count = scatter_kernel<kDim, int64_t>(o, s, targets, ids.data_ptr<int64_t>(), off, shift, psw, scale,
                                            grad.data_ptr<float>(), ld, pooled, dim, bags, batch, static_cast<float>(factor),
                                            pos, num_rows);
    } else {
      check_rows(ids.data_ptr<int32_t>(), off, shift, bags, num_rows);
      count = scatter_kernel<kDim, int32_t>(o, s, targets, ids.data_ptr<int32_t>(), off, shift, psw, scale,
                                            grad.data_ptr<float>(), ld, pooled, dim, bags, batch, static_cast<float>(factor),
                                            pos, num_rows);
    }
  });
  if (count < targets) {  // the untouched targets' rows hold whatever was there: zero them
    for (int64_t t = 0; t < targets; ++t) {
      if (s[t] == 0.0f) std::fill(o + t * dim, o + (t + 1) * dim, 0.0f);
    }
  }
  return count;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def("replica_touched_rows(Tensor(a!) marks, Tensor(b!) position, Tensor ids, Tensor offsets, Tensor? bag_shift) -> Tensor");
  m.def(
      "replica_grad_scatter(Tensor(a!) out, Tensor(b!) seen, Tensor ids, Tensor offsets, Tensor? bag_shift, "
      "Tensor? per_sample_weights, Tensor? bag_scale, Tensor grad, bool pooled, int batch, float factor, "
      "Tensor? position, "
      "int num_rows) -> int");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) {
  m.impl("replica_touched_rows", &replica_touched_rows);
  m.impl("replica_grad_scatter", &replica_grad_scatter);
}
