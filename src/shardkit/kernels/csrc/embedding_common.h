// What the embedding lookup's forward (embedding.cpp) and its fused backward + optimizer
// (embedding_backward.cpp) share: fp32 conversions, row prefetches, the pooled output's row layout and
// the validation of the ops' common arguments. Both files are built into one library by
// shardkit/kernels/native_build.py (which lists this header: an edit rebuilds).
//
// Numerics: sums accumulate in fp32 in id order (the order of torch's CPU embedding_bag), and each
// optimizer rule uses the same sequence of fp32 operations as its torch.optim counterpart, so that
// fp32 results agree with the pure-torch path (bitwise for unweighted bags; the build disables FMA
// contraction so that `a + b * c` rounds twice, as torch's elementwise kernels do).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace shardkit_embedding {

inline float to_float(float x) { return x; }
inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

template <typename scalar_t>
inline scalar_t from_float(float x) { return static_cast<scalar_t>(x); }

// Rows are read in id order; fetching a few ids ahead hides part of the DRAM latency of random rows.
// The forward's distance is an argument of the op (chosen per machine at run time:
// shardkit/kernels/prefetch.py); kPrefetch is its schema default and the fused backward's distance
// for gradient rows.
constexpr int64_t kPrefetch = 16;

// Floats in one vector register of the build's target (-march=native): 16 (a zmm) with AVX-512, else 8
// (a ymm, AVX2). Sums kept in GCC vectors wider than the registers cost 1.6-4.5x the time of the plain
// loop on an AVX2 CPU (Zen 3, forward at dims 16-128, fp32, docs/performance.md): the vector code is
// only worth it at the register's width.
// SHARDKIT_VECTOR_LANES (from $SHARDKIT_NATIVE_VECTOR_LANES, native_build.py) forces one: the tests
// build the AVX-512 width on an AVX2 machine to check its results.
#if defined(SHARDKIT_VECTOR_LANES)
constexpr int64_t kVectorLanes = SHARDKIT_VECTOR_LANES;
#elif defined(__AVX512F__)
constexpr int64_t kVectorLanes = 16;
#else
constexpr int64_t kVectorLanes = 8;
#endif
static_assert(kVectorLanes == 8 || kVectorLanes == 16, "SHARDKIT_VECTOR_LANES must be 8 or 16");

// Asks for every cache line of `count` elements at `p` (one prefetch covers 64 bytes only), into L2
// (locality 1, prefetcht2) rather than L1: with 16 rows in flight this measured 0.85-0.89x fbgemm's TBE
// forward time where prefetcht0 gave 1.01-1.09x (vs_fbgemm_kernel.py, this repository's 2-core machine).
template <typename T>
inline void prefetch_row(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t k = 0; k < count * static_cast<int64_t>(sizeof(T)); k += 64) __builtin_prefetch(bytes + k, 0, 1);
}

// Where bag b's row starts in a pooled output or gradient whose rows are ld values apart: [bags, dim]
// (batch 0), or batch-major [batch, bags / batch x dim] (bag b = feature b / batch of sample b % batch)
inline int64_t grad_offset(int64_t b, int64_t batch, int64_t dim, int64_t ld) {
  return batch > 0 ? (b % batch) * ld + (b / batch) * dim : b * ld;
}

// The distance between grad's rows (values) for a backward reading grad_rows x dim gradient values
// ([grad_rows, dim], or [batch, grad_rows / batch x dim] when batch > 0): contiguous (any shape), or
// that matrix with unit column stride and rows at least its columns apart (a column slice of a wider
// gradient, read in place). The result's element offsets fit in 32 bits (the sort keys carry them).
inline int64_t gradient_row_distance(const at::Tensor& grad, int64_t grad_rows, int64_t dim, int64_t batch) {
  const int64_t cols = batch > 0 ? grad_rows / batch * dim : dim;
  const int64_t lines = batch > 0 ? batch : grad_rows;
  TORCH_CHECK(grad.scalar_type() == at::kFloat, "grad must be fp32");
  int64_t ld = cols;
  if (grad.is_contiguous()) {
    TORCH_CHECK(grad.numel() == grad_rows * dim, "grad must be contiguous fp32 with ", grad_rows, " x ", dim,
                " elements");
  } else {
    TORCH_CHECK(grad.dim() == 2 && grad.size(0) == lines && grad.size(1) == cols &&
                    (cols <= 1 || grad.stride(1) == 1) && grad.stride(0) >= cols,
                "grad must be contiguous fp32 with ", grad_rows, " x ", dim, " elements, or a [", lines, ", ",
                cols, "] matrix of unit column stride, got sizes ", grad.sizes(), " strides ", grad.strides());
    ld = grad.stride(0);
  }
  TORCH_CHECK(lines == 0 || (lines - 1) * ld + cols < (int64_t(1) << 32),
              "the native backward handles gradients spanning < 2^32 values per call");
  return ld;
}

// Checks the arguments both ops take (shapes, dtypes, contiguity); raises naming the argument.
inline void check_common(const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& offsets,
                         const c10::optional<at::Tensor>& shift, const c10::optional<at::Tensor>& psw,
                         const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [rows, dim] tensor");
  TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous(), "ids must be a contiguous 1-d tensor");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "ids must be int32 or int64");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous(),
              "offsets must be contiguous int64 [bags + 1]");
  const int64_t bags = offsets.numel() - 1;
  TORCH_CHECK(bags >= 0, "offsets must hold at least one entry");
  if (shift) {
    TORCH_CHECK(shift->scalar_type() == at::kLong && shift->numel() == bags && shift->is_contiguous(),
                "bag_shift must be contiguous int64 [bags]");
  }
  if (psw) {
    TORCH_CHECK(psw->scalar_type() == at::kFloat && psw->numel() == ids.numel() && psw->is_contiguous(),
                "per_sample_weights must be contiguous fp32 [ids]");
  }
  if (scale) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == bags && scale->is_contiguous(),
                "bag_scale must be contiguous fp32 [bags]");
  }
}

}  // namespace shardkit_embedding
