// Native CPU kernel of the grouped embedding lookup's backward fused with the optimizer step (SGD,
// Adagrad, row-wise Adagrad, Adam): each touched row's gradient summed, then stepped in place, so no
// [num_rows, dim] gradient ever exists. Built with embedding.cpp (the forward) into one library
// (shardkit/kernels/native_build.py); the pure-torch twin is shardkit/kernels/row_optimizer.py.
// Numerics (fp32 sums in id order, torch.optim's op order, no FMA contraction): embedding_common.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "embedding_common.h"

namespace {

using shardkit_embedding::check_common;
using shardkit_embedding::from_float;
using shardkit_embedding::grad_offset;
using shardkit_embedding::gradient_row_distance;
using shardkit_embedding::kPrefetch;
using shardkit_embedding::kVectorLanes;
using shardkit_embedding::prefetch_row;
using shardkit_embedding::to_float;

enum Optim : int64_t { kSGD = 0, kAdagrad = 1, kRowwiseAdagrad = 2, kAdam = 3 };

// Calls f(std::integral_constant<int64_t, D>) with D = dim for the common row widths, else D = 0 (the
// block loop, not the row runs: 1.4-1.8x the time at dims 24 / 48 / 96; each width compiled is ~4 s
// more of the first build)
template <typename F>
inline void with_row_width(int64_t dim, F&& f) {
  switch (dim) {
    case 8: f(std::integral_constant<int64_t, 8>()); break;  // a column-wise block of a 16-wide table
    case 16: f(std::integral_constant<int64_t, 16>()); break;
    case 24: f(std::integral_constant<int64_t, 24>()); break;
    case 32: f(std::integral_constant<int64_t, 32>()); break;
    case 48: f(std::integral_constant<int64_t, 48>()); break;
    case 64: f(std::integral_constant<int64_t, 64>()); break;
    case 96: f(std::integral_constant<int64_t, 96>()); break;
    case 128: f(std::integral_constant<int64_t, 128>()); break;
    default: f(std::integral_constant<int64_t, 0>());
  }
}

// The ids are grouped by row in two steps, keeping each row's ids in position order (the order the
// sums are taken in, so results are those of a stable sort by row):
//   1. a stable LSD radix sort of packed (row << 32 | payload) keys by the row's high bits only, the
//      block of 2^low rows it falls in (a block's sums stay in cache: 2^low * dim floats <= 64 KiB,
//      kBlockBytes; 32-256 KiB measured alike at dim 16, 64 KiB best at dim 64);
//   2. per block, each id's gradient is added to its row's sum in a block-sized buffer, in key order.
// This replaced a full sort by row (two 11-bit passes for a 1e6-row buffer) whose last pass scattered
// every key once more. Rows of a buffer of at most 2^low rows need no sort at all.
constexpr int64_t kBlockBytes = int64_t(64) << 10;

struct RadixPlan {
  int low = 0, passes = 0, digit = 0;
  RadixPlan(int64_t num_rows, int64_t dim, int64_t block_bytes) {
    while (low < 31 && (int64_t(2) << low) * dim * 4 <= block_bytes) ++low;
    int bits = 0;
    while (bits < 32 && (int64_t(1) << bits) < num_rows) ++bits;
    const int high = std::max(0, bits - low);
    passes = (high + 10) / 11;  // digits of at most 11 bits, balanced: 2^11 places to scatter to at most
    digit = passes > 0 ? (high + passes - 1) / passes : 0;
  }
  int64_t buckets() const { return int64_t(1) << digit; }
  int64_t digit_of(uint64_t key, int pass) const {
    return static_cast<int64_t>((key >> (32 + low + pass * digit)) & (buckets() - 1));
  }
};

// The plan of a backward: block_bytes > 0 (tests) takes blocks of that many bytes of sums. 0: one row a
// block (a full sort by row) where each row's run of ids can be summed in registers (`row_runs`: see
// update_by_row_runs), else blocks of kBlockBytes. The row runs paid even where the full sort takes a
// radix pass more than the blocks (dim 16, 1e6-4e6 rows: 0.80-0.93x the backward's time; dim 128:
// 0.71x, as many passes; sweep rows 26 / 32 / 36 / 31, Zen 5, loaded).
RadixPlan choose_plan(int64_t num_rows, int64_t dim, int64_t block_bytes, bool row_runs) {
  if (block_bytes > 0) return RadixPlan(num_rows, dim, block_bytes);
  return RadixPlan(num_rows, dim, row_runs ? dim * 4 : kBlockBytes);  // dim * 4 bytes: low == 0
}

// Sorts keys[0, n) by their block, stable; the caller counted every pass's digits while writing the keys
// (hist: [passes][buckets]), so a pass reads the keys once. Returns the buffer (keys or tmp) holding them.
uint64_t* radix_sort_by_block(uint64_t* keys, uint64_t* tmp, int64_t n, const RadixPlan& plan,
                              std::vector<int64_t>& hist) {
  const int64_t buckets = plan.buckets();
  for (int pass = 0; pass < plan.passes; ++pass) {
    int64_t* place = hist.data() + pass * buckets;
    int64_t sum = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      const int64_t c = place[d];
      place[d] = sum;
      sum += c;
    }
    for (int64_t k = 0; k < n; ++k) tmp[place[plan.digit_of(keys[k], pass)]++] = keys[k];
    std::swap(keys, tmp);
  }
  return keys;
}

struct OptimArgs {
  int64_t kind;
  float lr, eps, beta1_complement, beta2_complement, step_size;
  float* state0;  // Adagrad / row-wise Adagrad: sum; Adam: exp_avg
  float* state1;  // Adam: exp_avg_sq
};

// The sum of g[j]^2 over a row, in a fixed order that vector code can follow: kSquareLanes partial sums
// (lane l: elements l, l + kSquareLanes, ... in increasing j), then a pairwise tree over the lanes
// (lane l += lane l + w for w = 8, 4, 2, 1). A single running sum is a chain of dim dependent adds
// (scalar, ~4 cycles each): at dim 128 that chain alone was ~40% of a row-wise Adagrad backward on a Zen 5
// CPU. row_optimizer.py's pure-torch rule takes the same sums in the same order (bitwise equal).
constexpr int64_t kSquareLanes = 16;

template <int64_t kDim>
inline float sum_of_squares(const float* g, int64_t run_time_dim) {
  const int64_t dim = kDim > 0 ? kDim : run_time_dim;
  float lane[kSquareLanes] = {};
  int64_t j = 0;
  for (; j + kSquareLanes <= dim; j += kSquareLanes) {
    for (int64_t l = 0; l < kSquareLanes; ++l) lane[l] += g[j + l] * g[j + l];
  }
  for (int64_t l = 0; j + l < dim; ++l) lane[l] += g[j + l] * g[j + l];
  for (int64_t w = kSquareLanes / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lane[l] += lane[l + w];
  }
  return lane[0];
}

// One optimizer step on one row: p (the fp32 row itself, or an fp32 copy of a half / bf16 row) and its
// summed gradient g, both [dim], never overlapping (restrict: p may be the table's row).
// Each line mirrors the op order of the torch path (shardkit/kernels/row_optimizer.py).
template <int64_t kDim>
inline void apply_rule(const OptimArgs& o, int64_t row, int64_t run_time_dim, float* __restrict__ p,
                       const float* __restrict__ g) {
  const int64_t dim = kDim > 0 ? kDim : run_time_dim;
  switch (o.kind) {
    case kSGD:
      for (int64_t j = 0; j < dim; ++j) p[j] = std::fma(-o.lr, g[j], p[j]);
      break;
    case kAdagrad: {
      float* s = o.state0 + row * dim;
      for (int64_t j = 0; j < dim; ++j) {
        s[j] = std::fma(g[j], g[j], s[j]);
        p[j] = p[j] + (-o.lr) * g[j] / (std::sqrt(s[j]) + o.eps);
      }
      break;
    }
    case kRowwiseAdagrad: {
      const float sq = sum_of_squares<kDim>(g, dim);
      float& s = o.state0[row];
      s = s + sq / static_cast<float>(dim);
      const float denom = std::sqrt(s) + o.eps;
      for (int64_t j = 0; j < dim; ++j) p[j] = p[j] + (-o.lr) * g[j] / denom;
      break;
    }
    default: {  // Adam (lazy, as torch.optim.SparseAdam)
      float* m = o.state0 + row * dim;
      float* v = o.state1 + row * dim;
      for (int64_t j = 0; j < dim; ++j) {
        m[j] = (g[j] - m[j]) * o.beta1_complement + m[j];
        v[j] = (g[j] * g[j] - v[j]) * o.beta2_complement + v[j];
        p[j] = std::fma(-o.step_size, m[j] / (std::sqrt(v[j]) + o.eps), p[j]);
      }
    }
  }
}

// The largest divisor of n that is at most limit (a row's vectors summed in equal chunks: dim 96 on AVX2,
// 12 ymm, in two chunks of 6).
constexpr int64_t largest_divisor_up_to(int64_t n, int64_t limit) {
  for (int64_t d = limit; d > 1; --d) {
    if (n % d == 0) return d;
  }
  return 1;
}

typedef float vec16 __attribute__((vector_size(64)));

// apply_rule's row-wise Adagrad step of one fp32 row whose summed gradient is in registers (kVecs
// vectors of 16): the same operations in the same order, so the same bits. The squares' 16 lanes are
// one vector (lane l sums elements l, l + 16, ... in increasing order, from 0), the pairwise tree over
// the lanes is done with shuffles (lane l += lane l + w for w = 8, 4, 2, 1), and each element moves by
// ((-lr) * g) / denom, added to the weight; sum_of_squares' stack array, which gcc spilled and summed
// with scalar adds, was ~6% of a dim-128 backward (perf, Zen 5).
template <int64_t kVecs>
inline void rowwise_adagrad_registers(const OptimArgs& o, int64_t row, float* __restrict__ p,
                                      const vec16* g) {
  typedef float vec8 __attribute__((vector_size(32)));
  typedef float vec4 __attribute__((vector_size(16)));
  typedef float vec2 __attribute__((vector_size(8)));
  vec16 lanes = vec16{};
#pragma GCC unroll 8
  for (int64_t v = 0; v < kVecs; ++v) lanes += g[v] * g[v];
  const vec8 s8 = __builtin_shufflevector(lanes, lanes, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(lanes, lanes, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  const vec2 s2 = __builtin_shufflevector(s4, s4, 0, 1) + __builtin_shufflevector(s4, s4, 2, 3);
  const float sq = s2[0] + s2[1];
  float& s = o.state0[row];
  s = s + sq / static_cast<float>(kVecs * 16);
  const float denom = std::sqrt(s) + o.eps;
  vec16 step, by;  // broadcasts (not 0 - lr, which is +0 where -lr is -0)
  for (int l = 0; l < 16; ++l) {
    step[l] = -o.lr;
    by[l] = denom;
  }
#pragma GCC unroll 8
  for (int64_t v = 0; v < kVecs; ++v) {
    vec16 w;
    std::memcpy(&w, p + 16 * v, sizeof(w));
    w = w + (step * g[v]) / by;
    std::memcpy(p + 16 * v, &w, sizeof(w));
  }
}

// Step 4 when the keys are sorted by row (one row a block) and each id's sum term is its gradient row
// alone (unweighted, unscaled): each row's run of keys is summed in vector registers (kDim / 16 zmm at
// AVX-512; one ymm at dim 8), then its optimizer step applied at once, while its weights and state (asked for when
// its first key was kPrefetch keys ahead) are in cache. The block loop instead adds every id into a
// block-sized buffer in memory (a load and a store of the row's sums per id: ~30% of its time at dim
// 128, perf on Zen 5) and needs the stamps and touched list; fbgemm's CPU backward likewise sums each
// row's run, then steps it. Same adds in the same order (0 + the first id's row, then the next ids in
// position order, no FMA): the same bits as the block loop. A thread owns whole rows (a chunk starts at
// the first key of a row), so no row is written twice and the thread count changes nothing.
template <int64_t kDim, typename scalar_t>
void update_by_row_runs(scalar_t* table, const uint64_t* keys, int64_t n, const float* grad,
                        const OptimArgs& optim) {
  // the register's vectors: 16 floats (a zmm) on AVX-512 where the row is a multiple of 16, else 8 (a
  // ymm; on an AVX2 CPU 16-float vectors are split and cost more than the block loop)
  constexpr int64_t kLanes = kVectorLanes == 16 && kDim % 16 == 0 ? 16 : 8;
  static_assert(kDim > 0 && kDim % kLanes == 0, "row runs are summed in whole vectors");
  typedef float vec __attribute__((vector_size(kLanes * 4)));
  constexpr int64_t kVecs = kDim / kLanes;
  // accumulators summed at a time: all of them, but 8 ymm on AVX2 (dim 128 would take all 16 ymm
  // registers and spill): the rest of the row in further passes over the run's keys, each column's
  // adds in the same order
  constexpr int64_t kChunk = kLanes == 8 && kVecs > 8 ? largest_divisor_up_to(kVecs, 8) : kVecs;
  static_assert(kVecs % kChunk == 0, "a row's vectors are summed in whole chunks");
  const float* state_a = optim.kind == kSGD ? nullptr : optim.state0;
  const float* state_b = optim.kind == kAdam ? optim.state1 : nullptr;
  const int64_t state_width = optim.kind == kRowwiseAdagrad ? 1 : kDim;
  at::parallel_for(0, n, 2048, [&](int64_t k0, int64_t k1) {
    while (k0 < k1 && k0 > 0 && (keys[k0] >> 32) == (keys[k0 - 1] >> 32)) ++k0;
    alignas(64) float sum[kDim];
    float param[kDim];
    int64_t k = k0;
    while (k < k1) {
      const uint64_t run_row = keys[k] >> 32;
      const int64_t run_start = k;
      vec a[kChunk];
#pragma GCC unroll 8
      for (int64_t v = 0; v < kChunk; ++v) a[v] = vec{};
      do {
        if (k + kPrefetch < n) {
          const uint64_t ahead = keys[k + kPrefetch];
          prefetch_row(grad + static_cast<int64_t>(ahead & 0xffffffffu), kDim);
          if ((ahead >> 32) != (keys[k + kPrefetch - 1] >> 32)) {  // a row's first key: its weights, state
            const int64_t arow = static_cast<int64_t>(ahead >> 32);
            prefetch_row(table + arow * kDim, kDim);
            if (state_a) prefetch_row(state_a + arow * state_width, state_width);
            if (state_b) prefetch_row(state_b + arow * state_width, state_width);
          }
        }
        const float* g = grad + static_cast<int64_t>(keys[k] & 0xffffffffu);
#pragma GCC unroll 8
        for (int64_t v = 0; v < kChunk; ++v) {
          vec x;
          std::memcpy(&x, g + kLanes * v, sizeof(x));
          a[v] += x;
        }
        ++k;
      } while (k < n && (keys[k] >> 32) == run_row);
      if constexpr (kChunk < kVecs) {  // the row's other columns, chunk by chunk, over the same keys
        for (int64_t c = kChunk; c < kVecs; c += kChunk) {
          vec b[kChunk];
#pragma GCC unroll 8
          for (int64_t v = 0; v < kChunk; ++v) b[v] = vec{};
          for (int64_t j = run_start; j < k; ++j) {
            const float* g = grad + static_cast<int64_t>(keys[j] & 0xffffffffu) + kLanes * c;
#pragma GCC unroll 8
            for (int64_t v = 0; v < kChunk; ++v) {
              vec x;
              std::memcpy(&x, g + kLanes * v, sizeof(x));
              b[v] += x;
            }
          }
#pragma GCC unroll 8
          for (int64_t v = 0; v < kChunk; ++v) std::memcpy(sum + kLanes * (c + v), &b[v], sizeof(vec));
        }
      }
      const int64_t row = static_cast<int64_t>(run_row);
      scalar_t* w = table + row * kDim;
      if constexpr (std::is_same<scalar_t, float>::value && kLanes == 16 && kChunk == kVecs) {
        if (optim.kind == kRowwiseAdagrad) {  // apply_rule's row-wise Adagrad on the registers
          rowwise_adagrad_registers<kVecs>(optim, row, w, a);
          continue;
        }
      }
#pragma GCC unroll 8
      for (int64_t v = 0; v < kChunk; ++v) std::memcpy(sum + kLanes * v, &a[v], sizeof(vec));
      if constexpr (std::is_same<scalar_t, float>::value) {
        apply_rule<kDim>(optim, row, kDim, w, sum);
      } else {
        for (int64_t j = 0; j < kDim; ++j) param[j] = to_float(w[j]);
        apply_rule<kDim>(optim, row, kDim, param, sum);
        for (int64_t j = 0; j < kDim; ++j) w[j] = from_float<scalar_t>(param[j]);
      }
    }
  });
}

template <int64_t kDim, typename scalar_t, typename index_t>
void fused_backward_kernel(at::Tensor& weight, const at::Tensor& ids, const at::Tensor& offsets,
                           const int64_t* shift, const float* psw, const float* scale, const float* grad,
                           int64_t ld, bool pooled, int64_t batch, const OptimArgs& optim, float* psw_grad,
                           int64_t block_bytes) {
  // a compile-time row width keeps a row's sums in vector registers
  const int64_t num_rows = weight.size(0), dim = kDim > 0 ? kDim : weight.size(1);
  const int64_t bags = offsets.numel() - 1, n = ids.numel();
  scalar_t* table = weight.data_ptr<scalar_t>();
  const index_t* id = ids.data_ptr<index_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();

  // 1. per id a sort key: its row, packed with where its gradient row starts in grad (the element
  //    offset; unweighted, unscaled bags: the sum needs nothing else) or with its position (weighted or
  //    scaled: the bag and the weight are looked up by position); the sort's digits are counted on the
  //    way (per thread, then summed). grad's rows are ld floats apart (a column slice of a wider
  //    gradient: several lookup groups' outputs side by side), so no copy makes them contiguous
  const bool by_position = psw != nullptr || scale != nullptr;
  // unweighted, unscaled bags (or one row per id): an id's term is its gradient row alone
  constexpr bool kVectorRows = kDim > 0 && kDim % 8 == 0;
  const RadixPlan plan = choose_plan(num_rows, dim, block_bytes, kVectorRows && !by_position);
  const int64_t hist_size = plan.passes * plan.buckets();
  const int threads = at::get_num_threads();
  std::vector<int64_t> thread_hist(threads * hist_size, 0);
  // uninitialized (no std::vector zero fill): every entry is written before it is read
  std::unique_ptr<uint64_t[]> keys_storage(new uint64_t[n]);
  std::unique_ptr<uint64_t[]> tmp_storage(new uint64_t[plan.passes > 0 ? n : 0]);
  uint64_t* keys = keys_storage.get();
  std::unique_ptr<int32_t[]> bag_storage(new int32_t[by_position ? n : 0]);
  int32_t* bag_of = bag_storage.get();  // by_position only
  at::parallel_for(0, bags, 256, [&](int64_t b0, int64_t b1) {
    int64_t* hist = thread_hist.data() + at::get_thread_num() * hist_size;
    // bag b's grad row's offset, grad_offset(b, batch, dim, ld), kept up to date without a division per bag
    int64_t sample = batch > 0 ? b0 % batch : 0, feature = batch > 0 ? b0 / batch : 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t grad_at = batch > 0 ? sample * ld + feature * dim : b * ld;
      if (batch > 0 && ++sample == batch) {
        sample = 0;
        ++feature;
      }
      const int64_t s = shift ? shift[b] : 0;
      for (int64_t i = off[b]; i < off[b + 1]; ++i) {
        const int64_t row = static_cast<int64_t>(id[i]) + s;
        TORCH_CHECK(row >= 0 && row < num_rows, "id at position ", i, " maps to row ", row,
                    " outside the buffer of ", num_rows, " rows");
        const uint64_t payload = by_position ? i : pooled ? grad_at : i * ld;
        keys[i] = (static_cast<uint64_t>(row) << 32) | payload;
        for (int pass = 0; pass < plan.passes; ++pass) {
          ++hist[pass * plan.buckets() + plan.digit_of(keys[i], pass)];
        }
        if (by_position) bag_of[i] = static_cast<int32_t>(b);
      }
    }
  });
  std::vector<int64_t> hist(thread_hist.begin(), thread_hist.begin() + hist_size);
  for (int t = 1; t < threads; ++t) {
    for (int64_t d = 0; d < hist_size; ++d) hist[d] += thread_hist[t * hist_size + d];
  }

  // 2. gradient of each per-sample weight: scale_b * <grad[b], row before the update>
  if (psw_grad) {
    at::parallel_for(0, n, 1024, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = bag_of[i];
        const scalar_t* w = table + static_cast<int64_t>(keys[i] >> 32) * dim;
        const float* g = grad + grad_offset(b, batch, dim, ld);
        const float c = scale ? scale[b] : 1.0f;
        float dot = 0.0f;
        for (int64_t j = 0; j < dim; ++j) dot += (g[j] * c) * to_float(w[j]);
        psw_grad[i] = dot;
      }
    });
  }

  // 3. group the ids by block of rows (stable: each row's ids stay in position order)
  keys = radix_sort_by_block(keys, tmp_storage.get(), n, plan, hist);
  if constexpr (kVectorRows) {
    if (plan.low == 0 && !by_position) {  // sorted by row: each row's run summed in registers
      update_by_row_runs<kDim, scalar_t>(table, keys, n, grad, optim);
      return;
    }
  }

  // 4. per block: each id's contribution added to its row's fp32 sum (first touch: the sum starts at
  //    0), in key order, then one optimizer step per touched row. A thread owns whole blocks (chunks
  //    start at the first key of a block), so no row is written twice.
  const int64_t block_rows = std::min<int64_t>(int64_t(1) << plan.low, num_rows);
  const int low = plan.low;
  at::parallel_for(0, n, 2048, [&](int64_t k0, int64_t k1) {
    while (k0 < k1 && k0 > 0 && (keys[k0] >> (32 + low)) == (keys[k0 - 1] >> (32 + low))) ++k0;
    if (k0 >= k1) return;
    std::unique_ptr<float[]> sums(new float[block_rows * dim]);
    std::vector<int64_t> stamp(block_rows, -1);  // the block whose sum a place holds
    std::vector<int32_t> touched;
    touched.reserve(block_rows);
    std::vector<float> param_storage(kDim > 0 ? 0 : dim);
    float param_fixed[kDim > 0 ? kDim : 1];
    float* param = kDim > 0 ? param_fixed : param_storage.data();
    // locals, not the enclosing function's variables by reference (this lambda is not inlined there):
    // d is a compile-time width when kDim is, so the sums below are vector code
    const bool plain = !by_position, by_bag = by_position && pooled;
    const int64_t d = kDim > 0 ? kDim : dim, shift_bits = 32 + low;
    // a row's weights and optimizer state are asked for kPrefetch keys ahead, with its gradient row:
    // within a block rows are first touched in random order, so nothing else fetches them ahead (a
    // row-wise Adagrad sum read from DRAM was ~17% of the backward's samples at dim 128, perf on Zen 5),
    // and asking at the row's first id (before session 13) left too little time in a block of a large
    // table, which has a few ids only: the weight row's first read was ~35% of the step's samples.
    // Pointers tested per row, not a switch on the rule: gcc 12 dropped the prefetches of a
    // switch-based helper entirely.
    const float* state_a = optim.kind == kSGD ? nullptr : optim.state0;
    const float* state_b = optim.kind == kAdam ? optim.state1 : nullptr;
    const int64_t state_width = optim.kind == kRowwiseAdagrad ? 1 : d;
    // where the row of grad that the id of a sorted key reads starts
    auto source_of = [=](uint64_t key) -> int64_t {
      const int64_t payload = static_cast<int64_t>(key & 0xffffffffu);
      return by_bag ? grad_offset(bag_of[payload], batch, d, ld) : payload;
    };
    int64_t k = k0;
    while (k < k1) {
      const int64_t block = static_cast<int64_t>(keys[k] >> shift_bits);
      const int64_t base = block << low;
      touched.clear();
      for (; k < n && static_cast<int64_t>(keys[k] >> shift_bits) == block; ++k) {
        if (k + kPrefetch < n) {  // a repeated row is asked for again: cheap, it is in cache by then
          const uint64_t ahead = keys[k + kPrefetch];
          prefetch_row(grad + source_of(ahead), d);
          const int64_t arow = static_cast<int64_t>(ahead >> 32);
          prefetch_row(table + arow * d, d);
          if (state_a) prefetch_row(state_a + arow * state_width, state_width);
          if (state_b) prefetch_row(state_b + arow * state_width, state_width);
        }
        const uint64_t key = keys[k];
        const int64_t local = static_cast<int64_t>(key >> 32) - base;
        float* __restrict__ acc = sums.get() + local * d;
        const float* __restrict__ g = grad + source_of(key);
        if (stamp[local] != block) {  // the row's first id: its sum starts at 0
          stamp[local] = block;
          touched.push_back(static_cast<int32_t>(local));
          if (plain) {  // 0 + g in one pass: the same sums as zeroing, then adding (one store less)
            for (int64_t j = 0; j < d; ++j) acc[j] = 0.0f + g[j];
            continue;
          }
          for (int64_t j = 0; j < d; ++j) acc[j] = 0.0f;
        }
        if (plain) {
          for (int64_t j = 0; j < d; ++j) acc[j] += g[j];
          continue;
        }
        const int64_t i = static_cast<int64_t>(key & 0xffffffffu);
        const int64_t b = bag_of[i];
        if (scale && psw) {
          const float c = scale[b], w = psw[i];
          for (int64_t j = 0; j < d; ++j) acc[j] = std::fma(w, g[j] * c, acc[j]);
        } else if (scale) {
          const float c = scale[b];
          for (int64_t j = 0; j < d; ++j) acc[j] += g[j] * c;
        } else {
          const float w = psw[i];
          for (int64_t j = 0; j < d; ++j) acc[j] = std::fma(w, g[j], acc[j]);
        }
      }
      for (const int32_t local : touched) {
        const int64_t row = base + local;
        scalar_t* w = table + row * d;
        if constexpr (std::is_same<scalar_t, float>::value) {
          // in place: a copy to fp32 and back is a no-op for fp32 rows (the same values), and it cost
          // ~12% of a row-wise Adagrad backward at dim 128
          apply_rule<kDim>(optim, row, d, w, sums.get() + local * d);
        } else {
          for (int64_t j = 0; j < d; ++j) param[j] = to_float(w[j]);
          apply_rule<kDim>(optim, row, d, param, sums.get() + local * d);
          for (int64_t j = 0; j < d; ++j) w[j] = from_float<scalar_t>(param[j]);
        }
      }
    }
  });
}

// Sums each touched row's gradient and applies one optimizer step to it in place (weight, state).
// grad: fp32 [bags, dim] (pooled) or [ids, dim]. Returns the per-sample weights' gradient (fp32 [ids])
// when want_psw_grad, else an empty tensor. block_bytes: the bytes of one block's sums (0: choose_plan's);
// tests make it small so that small buffers take the radix passes and many blocks.
at::Tensor embedding_fused_backward(at::Tensor& weight, const at::Tensor& ids, const at::Tensor& offsets,
                                    const c10::optional<at::Tensor>& bag_shift,
                                    const c10::optional<at::Tensor>& per_sample_weights,
                                    const c10::optional<at::Tensor>& bag_scale, const at::Tensor& grad,
                                    bool pooled, int64_t batch, int64_t optimizer, double lr, double eps, double beta1,
                                    double beta2, double step_size, at::TensorList state,
                                    bool want_psw_grad, int64_t block_bytes) {
  check_common(weight, ids, offsets, bag_shift, per_sample_weights, bag_scale);
  const int64_t n = ids.numel(), dim = weight.size(1);
  TORCH_CHECK(n < (int64_t(1) << 31) && weight.size(0) < (int64_t(1) << 32),
              "the native backward handles < 2^31 ids and < 2^32 rows per call");
  const int64_t grad_rows = pooled ? offsets.numel() - 1 : n;
  TORCH_CHECK(batch == 0 || (pooled && batch > 0 && grad_rows % batch == 0),
              "batch must be 0 or divide the number of bags of a pooled lookup");
  // grad may be a column slice of a wider gradient (several lookup groups' outputs), read in place
  const int64_t ld = gradient_row_distance(grad, grad_rows, dim, batch);
  const size_t needed = optimizer == kSGD ? 0 : (optimizer == kAdam ? 2 : 1);
  TORCH_CHECK(state.size() == needed, "optimizer ", optimizer, " needs ", needed, " state tensors");
  for (const auto& t : state) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(0) == weight.size(0),
                "optimizer state must be contiguous fp32 with one entry per row");
  }
  OptimArgs o{optimizer,
              static_cast<float>(lr),
              static_cast<float>(eps),
              static_cast<float>(1.0 - beta1),
              static_cast<float>(1.0 - beta2),
              static_cast<float>(step_size),
              needed > 0 ? state[0].data_ptr<float>() : nullptr,
              needed > 1 ? state[1].data_ptr<float>() : nullptr};
  at::Tensor psw_grad = want_psw_grad ? at::empty({n}, grad.options()) : at::empty({0}, grad.options());
  const int64_t* shift = bag_shift ? bag_shift->data_ptr<int64_t>() : nullptr;
  const float* psw = per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr;
  const float* scale = bag_scale ? bag_scale->data_ptr<float>() : nullptr;
  if (n == 0) return psw_grad;
  float* psw_grad_ptr = want_psw_grad ? psw_grad.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "embedding_backward", [&] {
    with_row_width(dim, [&](auto width) {
      constexpr int64_t kDim = decltype(width)::value;
      if (ids.scalar_type() == at::kLong) {
        fused_backward_kernel<kDim, scalar_t, int64_t>(weight, ids, offsets, shift, psw, scale,
                                                       grad.data_ptr<float>(), ld, pooled, batch, o, psw_grad_ptr,
                                                       block_bytes);
      } else {
        fused_backward_kernel<kDim, scalar_t, int32_t>(weight, ids, offsets, shift, psw, scale,
                                                       grad.data_ptr<float>(), ld, pooled, batch, o, psw_grad_ptr,
                                                       block_bytes);
      }
    });
  });
  return psw_grad;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def(
      "embedding_fused_backward(Tensor(a!) weight, Tensor ids, Tensor offsets, Tensor? bag_shift, "
      "Tensor? per_sample_weights, Tensor? bag_scale, Tensor grad, bool pooled, int batch, int optimizer, float lr, "
      "float eps, float beta1, float beta2, float step_size, Tensor(b!)[] state, bool want_psw_grad, "
      "int block_bytes=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) {
  m.impl("embedding_fused_backward", &embedding_fused_backward);
}
