// Native CPU kernels of the grouped embedding lookup, built on the user's machine against the
// installed torch (see shardkit/kernels/native_build.py). Registered as torch ops in the namespace
// `shardkit_native`; every op has a pure-torch twin in shardkit/kernels/embedding_torch.py and the
// tests compare the two. This file: the forward (pooled or per-id lookup) and the namespace's
// TORCH_LIBRARY; embedding_backward.cpp: the fused backward + optimizer; embedding_common.h: both.
// Numerics (fp32 sums in id order, torch.optim's op order, no FMA contraction): embedding_common.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <strings.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "embedding_common.h"

namespace {

using shardkit_embedding::check_common;
using shardkit_embedding::from_float;
using shardkit_embedding::prefetch_row;
using shardkit_embedding::to_float;

// A fresh output of tens of MiB is fresh pages, each faulted in and zeroed on its first write (a
// pooled output above glibc's 32 MiB mmap threshold is new memory every step): 128 MiB took 47-49 ms
// to write fresh, 11.7 ms advised MADV_HUGEPAGE, 7 ms reused (one thread, 2-core VM). Same rule and
// switch (SHARDKIT_HUGE_PAGES=0) as shardkit/huge_pages.py; only the backing changes, never a value.
constexpr int64_t kHugeMinBytes = int64_t(4) << 20;

inline bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("SHARDKIT_HUGE_PAGES");
    if (env == nullptr) return true;
    return !(std::strcmp(env, "0") == 0 || strcasecmp(env, "false") == 0 || strcasecmp(env, "off") == 0 ||
             strcasecmp(env, "no") == 0);
  }();
  return enabled;
}

// Advises the whole 4 KiB pages of a fresh CPU tensor (before any write) to be backed by huge pages.
inline void advise_huge_pages(const at::Tensor& t) {
#ifdef MADV_HUGEPAGE
  const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (nbytes < kHugeMinBytes || !t.device().is_cpu() || !huge_pages_enabled()) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (start + 4095) & ~uintptr_t(4095);
  const uintptr_t end = (start + static_cast<uintptr_t>(nbytes)) & ~uintptr_t(4095);
  if (end > first) madvise(reinterpret_cast<void*>(first), end - first, MADV_HUGEPAGE);  // advice only
#else
  (void)t;
#endif
}

// Calls f(std::integral_constant<int64_t, W>) with the widest block W of whole vectors (kLanes floats)
// up to kMaxBlock that divides dim, else W = 8 where 8 divides dim, else W = 0 (run-time width):
// fixed-width blocks keep the accumulators in vector registers, which a loop over a run-time dim does
// not, and each block is one more pass over a bag's ids. So dim 24 / 40 / 48 on AVX2 is one pass (3, 5,
// 6 ymm), not three to five passes of 8 or 16 (0.5-0.7x the time, benchmarks/results
// kernel_block_widths_*_session23.txt), and dim 96 two passes of 48. 128 (one pass over a bag's ids at
// dim 128 instead of two of 64) pays with the vector-register sums below: 8 zmm registers on AVX-512; on
// AVX2 it would take all 16 ymm registers, and two passes of 64 measured 0.67x its time (Zen 3).
constexpr int64_t kLanes = shardkit_embedding::kVectorLanes;
constexpr int64_t kMaxBlock = kLanes == 16 ? 128 : 64;

template <int64_t W, typename F>
inline bool with_vector_block(int64_t dim, F& f) {
  if constexpr (W < kLanes) {
    return false;
  } else {
    if (dim % W == 0) {
      f(std::integral_constant<int64_t, W>());
      return true;
    }
    return with_vector_block<W - kLanes>(dim, f);
  }
}

template <typename F>
inline void with_block_width(int64_t dim, F&& f) {
  if (with_vector_block<kMaxBlock>(dim, f)) return;
  if (dim % 8 == 0) f(std::integral_constant<int64_t, 8>());
  else f(std::integral_constant<int64_t, 0>());
}

// Bag b's ids are [offsets[b], offsets[b+1]); row of id i = ids[i] + shift[b]. Checks every row
// against [0, num_rows) and returns the position of the first id outside it (or -1): the caller
// raises, nothing is read out of bounds.
template <int64_t W, typename scalar_t, typename index_t>
int64_t forward_kernel(const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& offsets,
                       const int64_t* shift, const float* psw, const float* scale, bool pooled,
                       int64_t batch, int64_t prefetch, at::Tensor& out, int64_t ld) {
  const int64_t num_rows = weight.size(0), dim = weight.size(1);
  const int64_t width = W > 0 ? W : dim;  // columns summed per pass over a bag's ids
  const int64_t bags = offsets.numel() - 1;
  const scalar_t* table = weight.data_ptr<scalar_t>();
  const index_t* id = ids.data_ptr<index_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  const int64_t total = off[bags];
  std::vector<int64_t> first_bad(at::get_num_threads() + 1, std::numeric_limits<int64_t>::max());
  at::parallel_for(0, bags, 64, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc_storage(width);
    float* acc = acc_storage.data();
    int64_t bad = std::numeric_limits<int64_t>::max();
    // where bag b's output row starts, grad_offset(b, batch, dim, ld), kept up to date without a
    // division per bag (out's rows are ld values apart: a column slice of several groups' output)
    int64_t sample = batch > 0 ? b0 % batch : 0, feature = batch > 0 ? b0 / batch : 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t out_at = batch > 0 ? sample * ld + feature * dim : b * ld;
      if (batch > 0 && ++sample == batch) {
        sample = 0;
        ++feature;
      }
      const int64_t s = shift ? shift[b] : 0;
      const int64_t lo = off[b], hi = off[b + 1];
      // every id is checked right before its row is read: a row outside the table is never read
      // (the caller raises; this bag's output is never used)
      if (!pooled) {
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t row = static_cast<int64_t>(id[i]) + s;
          if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(num_rows)) {
            bad = std::min(bad, i);
            continue;
          }
          const scalar_t* src = table + row * dim;
          std::copy(src, src + dim, dst + i * ld);
        }
        continue;
      }
      // past this bag, the next bag's shift is right for most ids (a wrong guess costs nothing)
      const int64_t s_next = shift && b + 1 < bags ? shift[b + 1] : s;
      // fp32 unweighted bags: the sums in vector registers of the target's width (kLanes floats; GCC
      // vector type; the same adds in the same order, so the same bits). The generic loop below keeps
      // them in a stack array that gcc 12 spilled and reloaded on every id at W = 128. Rows are
      // prefetched into L1 (prefetcht0) here: with register sums that measured 0.86-0.94x the time of
      // L2 prefetches at dims 128 / 64 and equal at 16 (Zen 5, loaded; docs/performance.md, session 13),
      // the reverse of the generic loop's finding (prefetch_row's comment).
      if constexpr (std::is_same<scalar_t, float>::value && W >= kLanes && W % kLanes == 0) {
        if (!psw) {
          typedef float lanes_t __attribute__((vector_size(kLanes * 4)));
          constexpr int64_t kVecs = W / kLanes;
          for (int64_t c0 = 0; c0 < dim; c0 += W) {
            lanes_t a[kVecs];
#pragma GCC unroll 8
            for (int64_t k = 0; k < kVecs; ++k) a[k] = lanes_t{};
            for (int64_t i = lo; i < hi; ++i) {
              const int64_t ahead = i + prefetch;
              if (prefetch > 0 && ahead < total) {
                const int64_t next = static_cast<int64_t>(id[ahead]) + (ahead < hi ? s : s_next);
                if (static_cast<uint64_t>(next) < static_cast<uint64_t>(num_rows)) {
                  const char* pb = reinterpret_cast<const char*>(table + next * dim + c0);
#pragma GCC unroll 8
                  for (int64_t k = 0; k < W * 4; k += 64) __builtin_prefetch(pb + k, 0, 3);
                }
              }
              const int64_t row = static_cast<int64_t>(id[i]) + s;
              if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(num_rows)) {
                bad = std::min(bad, i);
                continue;
              }
              const float* src = table + row * dim + c0;
#pragma GCC unroll 8
              for (int64_t k = 0; k < kVecs; ++k) {
                lanes_t v;
                std::memcpy(&v, src + kLanes * k, sizeof(v));
                a[k] += v;
              }
            }
            float* o = dst + out_at + c0;
            if (scale) {
              const float c = scale[b];
#pragma GCC unroll 8
              for (int64_t k = 0; k < kVecs; ++k) a[k] *= c;
            }
#pragma GCC unroll 8
            for (int64_t k = 0; k < kVecs; ++k) std::memcpy(o + kLanes * k, &a[k], sizeof(lanes_t));
          }
          continue;
        }
      }
      for (int64_t c0 = 0; c0 < dim; c0 += width) {
        float local[W > 0 ? W : 1];
        float* a = W > 0 ? local : acc;
        for (int64_t j = 0; j < width; ++j) a[j] = 0.0f;
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t ahead = i + prefetch;
          if (prefetch > 0 && ahead < total) {
            const int64_t next = static_cast<int64_t>(id[ahead]) + (ahead < hi ? s : s_next);
            if (static_cast<uint64_t>(next) < static_cast<uint64_t>(num_rows)) {
              prefetch_row(table + next * dim + c0, width);
            }
          }
          const int64_t row = static_cast<int64_t>(id[i]) + s;
          if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(num_rows)) {
            bad = std::min(bad, i);
            continue;
          }
          const scalar_t* src = table + row * dim + c0;
          if (psw) {
            const float w = psw[i];
            for (int64_t j = 0; j < width; ++j) a[j] = std::fma(w, to_float(src[j]), a[j]);
          } else {
            for (int64_t j = 0; j < width; ++j) a[j] += to_float(src[j]);
          }
        }
        scalar_t* o = dst + out_at + c0;
        const float c = scale ? scale[b] : 1.0f;
        if (scale) {
          for (int64_t j = 0; j < width; ++j) o[j] = from_float<scalar_t>(a[j] * c);
        } else {
          for (int64_t j = 0; j < width; ++j) o[j] = from_float<scalar_t>(a[j]);
        }
      }
    }
    if (bad != std::numeric_limits<int64_t>::max()) {
      first_bad[at::get_thread_num()] = std::min(first_bad[at::get_thread_num()], bad);
    }
  });
  const int64_t bad = *std::min_element(first_bad.begin(), first_bad.end());
  return bad == std::numeric_limits<int64_t>::max() ? -1 : bad;
}

// Writes the lookup into out: [bags, dim] (pooled; [batch, bags / batch * dim] when batch > 0) or
// [ids, dim] in weight's dtype, rows ld values apart. Raises IndexError naming the first id whose row
// is outside the buffer.
void forward_into(const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& offsets,
                  const c10::optional<at::Tensor>& bag_shift, const c10::optional<at::Tensor>& per_sample_weights,
                  const c10::optional<at::Tensor>& bag_scale, bool pooled, int64_t batch, int64_t prefetch,
                  at::Tensor& out, int64_t ld) {
  const int64_t* shift = bag_shift ? bag_shift->data_ptr<int64_t>() : nullptr;
  const float* psw = per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr;
  const float* scale = bag_scale ? bag_scale->data_ptr<float>() : nullptr;
  int64_t bad = -1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "embedding_forward", [&] {
    with_block_width(weight.size(1), [&](auto w) {
      constexpr int64_t W = decltype(w)::value;
      if (ids.scalar_type() == at::kLong) {
        bad = forward_kernel<W, scalar_t, int64_t>(weight, ids, offsets, shift, psw, scale, pooled, batch,
                                                    prefetch, out, ld);
      } else {
        bad = forward_kernel<W, scalar_t, int32_t>(weight, ids, offsets, shift, psw, scale, pooled, batch,
                                                    prefetch, out, ld);
      }
    });
  });
  if (bad >= 0) {
    const int64_t b = std::upper_bound(offsets.data_ptr<int64_t>(), offsets.data_ptr<int64_t>() + offsets.numel(),
                                       bad) - offsets.data_ptr<int64_t>() - 1;
    const int64_t id = ids.scalar_type() == at::kLong ? ids.data_ptr<int64_t>()[bad] : ids.data_ptr<int32_t>()[bad];
    const int64_t row = id + (shift ? shift[b] : 0);
    TORCH_CHECK_INDEX(false, "id at position ", bad, " maps to buffer row ", row, ", outside [0, ",
                      weight.size(0), ")");
  }
}

// The output's rows and columns: [rows_out, dim], or [batch, rows_out / batch * dim] when batch > 0.
std::pair<int64_t, int64_t> check_forward(const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& offsets,
                                          const c10::optional<at::Tensor>& bag_shift,
                                          const c10::optional<at::Tensor>& per_sample_weights,
                                          const c10::optional<at::Tensor>& bag_scale, bool pooled, int64_t batch,
                                          int64_t prefetch) {
  check_common(weight, ids, offsets, bag_shift, per_sample_weights, bag_scale);
  TORCH_CHECK(prefetch >= 0, "prefetch (rows ahead) must be >= 0, got ", prefetch);
  // read through the pointer: offsets[-1].item() would dispatch two more ops per call
  TORCH_CHECK(offsets.data_ptr<int64_t>()[offsets.numel() - 1] == ids.numel(), "offsets must end at the number of ids");
  const int64_t rows_out = pooled ? offsets.numel() - 1 : ids.numel();
  TORCH_CHECK(batch == 0 || (pooled && batch > 0 && rows_out % batch == 0),
              "batch must be 0 or divide the number of bags of a pooled lookup");
  return batch > 0 ? std::make_pair(batch, rows_out / batch * weight.size(1))
                   : std::make_pair(rows_out, weight.size(1));
}

// Returns [bags, dim] (pooled; [batch, bags / batch * dim] when batch > 0) or [ids, dim] in weight's
// dtype. Raises IndexError naming the first id whose row is outside the buffer.
at::Tensor embedding_forward(const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& offsets,
                             const c10::optional<at::Tensor>& bag_shift,
                             const c10::optional<at::Tensor>& per_sample_weights,
                             const c10::optional<at::Tensor>& bag_scale, bool pooled, int64_t batch,
                             int64_t prefetch) {
  const auto shape = check_forward(weight, ids, offsets, bag_shift, per_sample_weights, bag_scale, pooled, batch,
                                   prefetch);
  at::Tensor out = at::empty({shape.first, shape.second}, weight.options());
  advise_huge_pages(out);
  forward_into(weight, ids, offsets, bag_shift, per_sample_weights, bag_scale, pooled, batch, prefetch, out,
               shape.second);
  return out;
}

// embedding_forward's result written into out (weight's dtype, the result's shape, unit column stride,
// rows at least a row's values apart: a column slice of a wider matrix, such as several lookup groups'
// outputs side by side, which then need no concatenation).
void embedding_forward_into(const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& offsets,
                            const c10::optional<at::Tensor>& bag_shift,
                            const c10::optional<at::Tensor>& per_sample_weights,
                            const c10::optional<at::Tensor>& bag_scale, bool pooled, int64_t batch,
                            int64_t prefetch, at::Tensor& out) {
  const auto shape = check_forward(weight, ids, offsets, bag_shift, per_sample_weights, bag_scale, pooled, batch,
                                   prefetch);
  TORCH_CHECK(out.scalar_type() == weight.scalar_type() && out.dim() == 2 && out.size(0) == shape.first &&
                  out.size(1) == shape.second && (shape.second <= 1 || out.stride(1) == 1) &&
                  (shape.first <= 1 || out.stride(0) >= shape.second),
              "out must be a [", shape.first, ", ", shape.second, "] matrix of the weight's dtype with unit column ",
              "stride, got ", out.scalar_type(), " sizes ", out.sizes(), " strides ", out.strides());
  forward_into(weight, ids, offsets, bag_shift, per_sample_weights, bag_scale, pooled, batch, prefetch, out,
               shape.first <= 1 ? shape.second : out.stride(0));
}

}  // namespace

// the namespace's one TORCH_LIBRARY (every other source adds a TORCH_LIBRARY_FRAGMENT)
TORCH_LIBRARY(shardkit_native, m) {
  m.def(
      "embedding_forward(Tensor weight, Tensor ids, Tensor offsets, Tensor? bag_shift, "
      "Tensor? per_sample_weights, Tensor? bag_scale, bool pooled, int batch, int prefetch=16) -> Tensor");
  m.def(
      "embedding_forward_into(Tensor weight, Tensor ids, Tensor offsets, Tensor? bag_shift, "
      "Tensor? per_sample_weights, Tensor? bag_scale, bool pooled, int batch, int prefetch, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) {
  m.impl("embedding_forward", &embedding_forward);
  m.impl("embedding_forward_into", &embedding_forward_into);
}
