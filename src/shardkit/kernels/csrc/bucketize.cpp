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
#include <vector>

namespace {

// Feature f's bags are [feature_bag_start[f], feature_bag_start[f+1]); its blocks are
// [block_ptr[f], block_ptr[f+1]) of block_starts (ascending first rows) / block_keys. An id goes to
// the last block whose first row is <= id (the first block for smaller ids), i.e. to key k, and its
// segment is key_base[k] + (its bag - the feature's first bag). Returns (order [N]: ids sorted by
// segment, stable; lengths [num_segments]; values[order]).
template <typename index_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> bucketize_impl(
    const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& feature_bag_start,
    const at::Tensor& block_starts, const at::Tensor& block_ptr, const at::Tensor& block_keys,
    const at::Tensor& key_base, int64_t num_segments) {
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
  for (int64_t f = 0; f < features; ++f) {
    TORCH_CHECK(bptr[f] < bptr[f + 1] && bptr[f + 1] <= block_keys.numel(),
                "bucketize: feature ", f, " needs at least one block");
    for (int64_t j = bptr[f]; j < bptr[f + 1]; ++j) {
      TORCH_CHECK(bkey[j] >= 0 && bkey[j] < keys && kbase[bkey[j]] >= 0 &&
                      kbase[bkey[j]] + (fbag[f + 1] - fbag[f]) <= num_segments,
                  "bucketize: block ", j, " of feature ", f, " sends to a segment range outside [0, ",
                  num_segments, ")");
    }
  }
  std::vector<int32_t> segment(n);
  TORCH_CHECK(num_segments < (int64_t(1) << 31), "bucketize: at most 2^31 segments");
  at::parallel_for(0, features, 1, [&](int64_t f0, int64_t f1) {
    for (int64_t f = f0; f < f1; ++f) {
      const int64_t* first = starts + bptr[f];
      const int64_t* last = starts + bptr[f + 1];
      const bool one_block = last - first == 1;
      for (int64_t b = fbag[f]; b < fbag[f + 1]; ++b) {
        const int64_t sample = b - fbag[f];
        for (int64_t i = off[b]; i < off[b + 1]; ++i) {
          int64_t block = 0;
          if (!one_block) {
            block = std::upper_bound(first, last, static_cast<int64_t>(v[i])) - first - 1;
            block = std::max<int64_t>(block, 0);
          }
          segment[i] = static_cast<int32_t>(kbase[bkey[bptr[f] + block]] + sample);
        }
      }
    }
  });
  at::Tensor lengths = at::zeros({num_segments}, offsets.options());
  int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) ++len[segment[i]];
  std::vector<int64_t> cursor(num_segments + 1, 0);
  for (int64_t s = 0; s < num_segments; ++s) cursor[s + 1] = cursor[s] + len[s];
  at::Tensor order = at::empty({n}, offsets.options());
  at::Tensor sorted = at::empty({n}, values.options());
  int64_t* ord = order.data_ptr<int64_t>();
  index_t* out = sorted.data_ptr<index_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = cursor[segment[i]]++;
    ord[pos] = i;
    out[pos] = v[i];
  }
  return {order, lengths, sorted};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bucketize_blocks(
    const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& feature_bag_start,
    const at::Tensor& block_starts, const at::Tensor& block_ptr, const at::Tensor& block_keys,
    const at::Tensor& key_base, int64_t num_segments) {
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
                                   key_base, num_segments);
  }
  TORCH_CHECK(values.scalar_type() == at::kInt, "bucketize: values must be int32 or int64");
  return bucketize_impl<int32_t>(values, offsets, feature_bag_start, block_starts, block_ptr, block_keys,
                                 key_base, num_segments);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def(
      "bucketize_blocks(Tensor values, Tensor offsets, Tensor feature_bag_start, Tensor block_starts, "
      "Tensor block_ptr, Tensor block_keys, Tensor key_base, int num_segments) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) { m.impl("bucketize_blocks", &bucketize_blocks); }
