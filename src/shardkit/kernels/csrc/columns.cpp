// Native CPU kernel for moving column ranges between two row-major matrices: the pooled all-to-all's
// placement of each rank's received columns into the module's order (and the gradient's columns back),
// one memcpy per row and range instead of a strided copy per range or an index copy per column block.
// Pure-torch twin: shardkit/kernels/column_copy.py (copy_column_ranges_torch).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

// dst [R, Cd] and src [R, Cs], contiguous, one dtype; ranges int64 [K, 3]: (source column, destination
// column, columns). Row r's columns [s, s + n) of src are copied to columns [d, d + n) of dst.
void copy_column_ranges(at::Tensor dst, const at::Tensor& src, const at::Tensor& ranges) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && ranges.device().is_cpu(),
              "copy_column_ranges: CPU tensors only");
  TORCH_CHECK(dst.dim() == 2 && src.dim() == 2 && dst.is_contiguous() && src.is_contiguous(),
              "copy_column_ranges: dst and src must be contiguous 2-d tensors");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "copy_column_ranges: dst is ", dst.scalar_type(),
              ", src is ", src.scalar_type());
  TORCH_CHECK(dst.size(0) == src.size(0), "copy_column_ranges: dst has ", dst.size(0), " rows, src ", src.size(0));
  TORCH_CHECK(ranges.scalar_type() == at::kLong && ranges.dim() == 2 && ranges.size(1) == 3 && ranges.is_contiguous(),
              "copy_column_ranges: ranges must be contiguous int64 [K, 3]");
  const int64_t rows = dst.size(0), dcols = dst.size(1), scols = src.size(1), count = ranges.size(0);
  const int64_t* range = ranges.data_ptr<int64_t>();
  for (int64_t k = 0; k < count; ++k) {
    const int64_t s = range[3 * k], d = range[3 * k + 1], n = range[3 * k + 2];
    TORCH_CHECK(s >= 0 && d >= 0 && n >= 0 && s + n <= scols && d + n <= dcols, "copy_column_ranges: range ", k,
                " (source ", s, ", destination ", d, ", ", n, " columns) is outside src [", rows, ", ", scols,
                "] or dst [", rows, ", ", dcols, "]");
  }
  if (rows == 0 || count == 0) return;
  const int64_t item = dst.element_size();
  char* out = static_cast<char*>(dst.data_ptr());
  const char* in = static_cast<const char*>(src.data_ptr());
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      char* out_row = out + r * dcols * item;
      const char* in_row = in + r * scols * item;
      for (int64_t k = 0; k < count; ++k) {
        const int64_t* q = range + 3 * k;
        if (q[2] > 0) std::memcpy(out_row + q[1] * item, in_row + q[0] * item, q[2] * item);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def("copy_column_ranges(Tensor(a!) dst, Tensor src, Tensor ranges) -> ()");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) { m.impl("copy_column_ranges", &copy_column_ranges); }
