// Native CPU kernel for reordering jagged data by whole segments (the "recat" after a KJT all-to-all):
// each segment is a run of consecutive rows, so its values are one contiguous range, copied with one
// memcpy. Pure-torch twin: shardkit/sharding/dist_data/recat.py (jagged_segment_index + gather).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename length_t>
std::vector<int64_t> segment_value_starts(const at::Tensor& lengths, const int64_t* rows, int64_t segments) {
  const length_t* len = lengths.data_ptr<length_t>();
  std::vector<int64_t> starts(segments + 1, 0);
  int64_t row = 0;
  for (int64_t s = 0; s < segments; ++s) {
    int64_t total = 0;
    for (int64_t r = 0; r < rows[s]; ++r, ++row) total += len[row];
    starts[s + 1] = starts[s] + total;
  }
  TORCH_CHECK(row == lengths.numel(), "permute_segments: segment rows sum to ", row, ", lengths has ",
              lengths.numel());
  return starts;
}

void copy_segments(const at::Tensor& src, at::Tensor& dst, const std::vector<int64_t>& starts,
                   const int64_t* order, int64_t segments, const std::vector<int64_t>& out_starts) {
  const int64_t item = src.element_size();
  const char* in = static_cast<const char*>(src.data_ptr());
  char* out = static_cast<char*>(dst.data_ptr());
  at::parallel_for(0, segments, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t j = order[k];
      const int64_t count = starts[j + 1] - starts[j];
      if (count > 0) std::memcpy(out + out_starts[k] * item, in + starts[j] * item, count * item);
    }
  });
}

// values (and weights) [N] of rows whose lengths are `lengths` [R], grouped into segments of
// segment_rows [S] consecutive rows; returns them with output segment k = input segment order[k].
std::tuple<at::Tensor, c10::optional<at::Tensor>> permute_segments(
    const at::Tensor& lengths, const at::Tensor& values, const c10::optional<at::Tensor>& weights,
    const at::Tensor& segment_rows, const at::Tensor& order) {
  TORCH_CHECK(lengths.dim() == 1 && lengths.is_contiguous() &&
                  (lengths.scalar_type() == at::kLong || lengths.scalar_type() == at::kInt),
              "permute_segments: lengths must be contiguous int32/int64 [R]");
  TORCH_CHECK(segment_rows.scalar_type() == at::kLong && order.scalar_type() == at::kLong &&
                  segment_rows.is_contiguous() && order.is_contiguous() && segment_rows.numel() == order.numel(),
              "permute_segments: segment_rows and order must be contiguous int64 of one length");
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous(), "permute_segments: values must be contiguous 1-d");
  const int64_t segments = order.numel();
  const int64_t* rows = segment_rows.data_ptr<int64_t>();
  const int64_t* ord = order.data_ptr<int64_t>();
  std::vector<int64_t> starts = lengths.scalar_type() == at::kLong
                                    ? segment_value_starts<int64_t>(lengths, rows, segments)
                                    : segment_value_starts<int32_t>(lengths, rows, segments);
  TORCH_CHECK(starts[segments] == values.numel(), "permute_segments: lengths sum to ", starts[segments],
              ", values has ", values.numel());
  std::vector<int64_t> out_starts(segments + 1, 0);
  for (int64_t k = 0; k < segments; ++k) {
    TORCH_CHECK(ord[k] >= 0 && ord[k] < segments, "permute_segments: order out of range");
    out_starts[k + 1] = out_starts[k] + starts[ord[k] + 1] - starts[ord[k]];
  }
  at::Tensor out = at::empty_like(values);
  copy_segments(values, out, starts, ord, segments, out_starts);
  c10::optional<at::Tensor> out_weights;
  if (weights) {
    TORCH_CHECK(weights->dim() == 1 && weights->is_contiguous() && weights->numel() == values.numel(),
                "permute_segments: weights must be contiguous and match values");
    at::Tensor w = at::empty_like(*weights);
    copy_segments(*weights, w, starts, ord, segments, out_starts);
    out_weights = w;
  }
  return {out, out_weights};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def(
      "permute_segments(Tensor lengths, Tensor values, Tensor? weights, Tensor segment_rows, Tensor order) "
      "-> (Tensor, Tensor?)");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) { m.impl("permute_segments", &permute_segments); }
