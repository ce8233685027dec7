// Native CPU lookup of quantized stored rows (shardkit/kernels/quant_rows.py describes the formats),
// the twin of the pure-torch path in shardkit/kernels/quant_embedding.py. Each row read is dequantized
// into a row-sized fp32 buffer, then added to the bag's accumulator. value = code * scale + bias is
// rounded after the product and after the sum (the build disables FMA contraction), exactly as the
// torch path computes it; weighted sums use a fused multiply-add, as torch's CPU embedding_bag does,
// so the two paths agree bitwise.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// The storage argument of the op: the order of (*FLOAT_STORAGES, *INT_BITS) in quant_rows.py.
enum Storage : int64_t { kFP32 = 0, kFP16 = 1, kBF16 = 2, kINT8 = 3, kINT4 = 4, kINT2 = 5 };

inline int bits_of(int64_t storage) { return storage == kINT8 ? 8 : storage == kINT4 ? 4 : 2; }

inline int64_t data_bytes(int64_t storage, int64_t dim) {
  switch (storage) {
    case kFP32: return dim * 4;
    case kFP16:
    case kBF16: return dim * 2;
    default: {
      const int64_t per_byte = 8 / bits_of(storage);
      return (dim + per_byte - 1) / per_byte;
    }
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Writes the row's dim values, dequantized to fp32, to vals (codes: scratch of dim bytes). Separate
// restrict-qualified buffers let the compiler vectorize each loop (uint8 pointers may alias anything).
template <int64_t S>
inline void dequantize_row(const uint8_t* __restrict__ row, int64_t dim, float* __restrict__ vals,
                           uint8_t* __restrict__ codes) {
  if constexpr (S == kFP32) {
    std::memcpy(vals, row, dim * sizeof(float));
  } else if constexpr (S == kFP16) {
    int64_t j = 0;
#if defined(__F16C__)
    for (; j + 8 <= dim; j += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * j));
      _mm256_storeu_ps(vals + j, _mm256_cvtph_ps(h));
    }
#endif
    for (; j < dim; ++j) {
      uint16_t bits;
      std::memcpy(&bits, row + 2 * j, 2);
      vals[j] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
    }
  } else if constexpr (S == kBF16) {
    uint16_t bits[1];
    for (int64_t j = 0; j < dim; ++j) {
      std::memcpy(bits, row + 2 * j, 2);
      vals[j] = bf16_bits_to_float(bits[0]);
    }
  } else {
    constexpr int kBits = S == kINT8 ? 8 : S == kINT4 ? 4 : 2;
    constexpr int kPerByte = 8 / kBits;
    constexpr uint8_t kMask = static_cast<uint8_t>((1 << kBits) - 1);
    const int64_t nbytes = (dim + kPerByte - 1) / kPerByte;
    const float scale = half_at(row + nbytes), bias = half_at(row + nbytes + 2);
    const uint8_t* c = row;
    if constexpr (kBits == 4) {
      // both codes of a byte straight to values (vals has room for the padding code of an odd dim)
      for (int64_t k = 0; k < nbytes; ++k) {
        float lo = static_cast<float>(row[k] & 15) * scale;
        float hi = static_cast<float>(row[k] >> 4) * scale;
        vals[2 * k] = lo + bias;
        vals[2 * k + 1] = hi + bias;
      }
      return;
    } else if constexpr (kBits == 2) {
      // one table lookup per byte gives its 4 codes, in memory order (measured faster than shifts)
      static const auto table = [] {
        std::array<std::array<uint8_t, kPerByte>, 256> t{};
        for (int b = 0; b < 256; ++b) {
          for (int p = 0; p < kPerByte; ++p) t[b][p] = static_cast<uint8_t>((b >> (p * kBits)) & kMask);
        }
        return t;
      }();
      for (int64_t k = 0; k < nbytes; ++k) std::memcpy(codes + k * kPerByte, table[row[k]].data(), kPerByte);
      c = codes;
    }
    for (int64_t j = 0; j < dim; ++j) {
      float v = static_cast<float>(c[j]) * scale;
      vals[j] = v + bias;
    }
  }
}

template <int64_t S, typename index_t>
int64_t quant_kernel(const at::Tensor& weight, int64_t dim, const at::Tensor& ids, const at::Tensor& offsets,
                     const int64_t* shift, const float* psw, const float* scale, bool pooled, int64_t batch,
                     int64_t prefetch, at::Tensor& out) {
  const int64_t num_rows = weight.size(0), row_bytes = weight.size(1);
  const int64_t bags = offsets.numel() - 1;
  const uint8_t* table = weight.data_ptr<uint8_t>();
  const index_t* id = ids.data_ptr<index_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  const int64_t features = batch > 0 ? bags / batch : 1;
  const int64_t total = off[bags];
  std::vector<int64_t> first_bad(at::get_num_threads() + 1, std::numeric_limits<int64_t>::max());
  at::parallel_for(0, bags, 64, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc_storage(dim), vals_storage(dim + 8);
    std::vector<uint8_t> codes_storage(row_bytes * 4 + 8);  // unpacked codes of one row
    float* __restrict__ acc = acc_storage.data();
    float* __restrict__ vals = vals_storage.data();
    uint8_t* __restrict__ codes = codes_storage.data();
    int64_t bad = std::numeric_limits<int64_t>::max();
    for (int64_t b = b0; b < b1; ++b) {
      // bag b's output row: feature-major bags, sample-major output when batch > 0
      const int64_t out_row = batch > 0 ? (b % batch) * features + b / batch : b;
      const int64_t s = shift ? shift[b] : 0;
      const int64_t lo = off[b], hi = off[b + 1];
      // past this bag, the next bag's shift is right for most ids (a wrong guess costs nothing)
      const int64_t s_next = shift && b + 1 < bags ? shift[b + 1] : s;
      if (pooled) std::fill(acc, acc + dim, 0.0f);
      for (int64_t i = lo; i < hi; ++i) {
        // across bag boundaries, as the fp forward: within a bag only, a distance beyond the bag's
        // length prefetched nothing (64 rows ran as slowly as none at ~20 ids a bag)
        const int64_t ahead = i + prefetch;
        if (prefetch > 0 && ahead < total) {
          const int64_t next = static_cast<int64_t>(id[ahead]) + (ahead < hi ? s : s_next);
          if (static_cast<uint64_t>(next) < static_cast<uint64_t>(num_rows)) {
            for (int64_t k = 0; k < row_bytes; k += 64) __builtin_prefetch(table + next * row_bytes + k, 0, 1);
          }
        }
        // checked before the row is read: a row outside the table is never read
        const int64_t row = static_cast<int64_t>(id[i]) + s;
        if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(num_rows)) {
          bad = std::min(bad, i);
          continue;
        }
        dequantize_row<S>(table + row * row_bytes, dim, vals, codes);
        if (!pooled) {
          std::memcpy(dst + i * dim, vals, dim * sizeof(float));
          continue;
        }
        if (psw) {
          const float w = psw[i];
          for (int64_t j = 0; j < dim; ++j) acc[j] = std::fma(w, vals[j], acc[j]);
        } else {
          for (int64_t j = 0; j < dim; ++j) acc[j] += vals[j];
        }
      }
      if (!pooled) continue;
      float* o = dst + out_row * dim;
      if (scale) {
        const float c = scale[b];
        for (int64_t j = 0; j < dim; ++j) o[j] = acc[j] * c;
      } else {
        std::copy(acc, acc + dim, o);
      }
    }
    if (bad != std::numeric_limits<int64_t>::max()) {
      first_bad[at::get_thread_num()] = std::min(first_bad[at::get_thread_num()], bad);
    }
  });
  const int64_t bad = *std::min_element(first_bad.begin(), first_bad.end());
  return bad == std::numeric_limits<int64_t>::max() ? -1 : bad;
}

template <int64_t S>
int64_t dispatch_ids(const at::Tensor& weight, int64_t dim, const at::Tensor& ids, const at::Tensor& offsets,
                     const int64_t* shift, const float* psw, const float* scale, bool pooled, int64_t batch,
                     int64_t prefetch, at::Tensor& out) {
  if (ids.scalar_type() == at::kLong) {
    return quant_kernel<S, int64_t>(weight, dim, ids, offsets, shift, psw, scale, pooled, batch, prefetch, out);
  }
  return quant_kernel<S, int32_t>(weight, dim, ids, offsets, shift, psw, scale, pooled, batch, prefetch, out);
}

// fp32 [bags, dim] (pooled; [batch, bags / batch * dim] when batch > 0) or [ids, dim]. Raises IndexError
// naming the first id whose row is outside the buffer.
at::Tensor quant_embedding_forward(const at::Tensor& weight, int64_t storage, int64_t dim, const at::Tensor& ids,
                                   const at::Tensor& offsets, const c10::optional<at::Tensor>& bag_shift,
                                   const c10::optional<at::Tensor>& per_sample_weights,
                                   const c10::optional<at::Tensor>& bag_scale, bool pooled, int64_t batch,
                                   int64_t prefetch) {
  TORCH_CHECK(prefetch >= 0, "prefetch (rows ahead) must be >= 0, got ", prefetch);
  TORCH_CHECK(storage >= kFP32 && storage <= kINT2, "unknown storage code ", storage);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kByte,
              "weight must be a contiguous uint8 [rows, row_bytes] tensor");
  const int64_t extra = storage >= kINT8 ? 4 : 0;
  TORCH_CHECK(weight.size(1) == data_bytes(storage, dim) + extra, "weight rows of ", weight.size(1),
              " bytes do not hold ", dim, " values of this storage");
  TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous(), "ids must be a contiguous 1-d tensor");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "ids must be int32 or int64");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.numel() >= 1,
              "offsets must be contiguous int64 [bags + 1]");
  const int64_t bags = offsets.numel() - 1;
  TORCH_CHECK(offsets.data_ptr<int64_t>()[bags] == ids.numel(), "offsets must end at the number of ids");
  if (bag_shift) {
    TORCH_CHECK(bag_shift->scalar_type() == at::kLong && bag_shift->numel() == bags && bag_shift->is_contiguous(),
                "bag_shift must be contiguous int64 [bags]");
  }
  if (per_sample_weights) {
    TORCH_CHECK(per_sample_weights->scalar_type() == at::kFloat && per_sample_weights->numel() == ids.numel() &&
                    per_sample_weights->is_contiguous(),
                "per_sample_weights must be contiguous fp32 [ids]");
  }
  if (bag_scale) {
    TORCH_CHECK(bag_scale->scalar_type() == at::kFloat && bag_scale->numel() == bags && bag_scale->is_contiguous(),
                "bag_scale must be contiguous fp32 [bags]");
  }
  const int64_t rows_out = pooled ? bags : ids.numel();
  TORCH_CHECK(batch == 0 || (pooled && batch > 0 && rows_out % batch == 0),
              "batch must be 0 or divide the number of bags of a pooled lookup");
  const auto options = weight.options().dtype(at::kFloat);
  at::Tensor out = batch > 0 ? at::empty({batch, rows_out / batch * dim}, options) : at::empty({rows_out, dim}, options);
  const int64_t* shift = bag_shift ? bag_shift->data_ptr<int64_t>() : nullptr;
  const float* psw = per_sample_weights ? per_sample_weights->data_ptr<float>() : nullptr;
  const float* scale = bag_scale ? bag_scale->data_ptr<float>() : nullptr;
  int64_t bad = -1;
  switch (storage) {
    case kFP32: bad = dispatch_ids<kFP32>(weight, dim, ids, offsets, shift, psw, scale, pooled, batch, prefetch, out); break;
    case kFP16: bad = dispatch_ids<kFP16>(weight, dim, ids, offsets, shift, psw, scale, pooled, batch, prefetch, out); break;
    case kBF16: bad = dispatch_ids<kBF16>(weight, dim, ids, offsets, shift, psw, scale, pooled, batch, prefetch, out); break;
    case kINT8: bad = dispatch_ids<kINT8>(weight, dim, ids, offsets, shift, psw, scale, pooled, batch, prefetch, out); break;
    case kINT4: bad = dispatch_ids<kINT4>(weight, dim, ids, offsets, shift, psw, scale, pooled, batch, prefetch, out); break;
    default: bad = dispatch_ids<kINT2>(weight, dim, ids, offsets, shift, psw, scale, pooled, batch, prefetch, out); break;
  }
  if (bad >= 0) {
    const int64_t* off = offsets.data_ptr<int64_t>();
    const int64_t b = std::upper_bound(off, off + offsets.numel(), bad) - off - 1;
    const int64_t id = ids.scalar_type() == at::kLong ? ids.data_ptr<int64_t>()[bad] : ids.data_ptr<int32_t>()[bad];
    const int64_t row = id + (shift ? shift[b] : 0);
    TORCH_CHECK_INDEX(false, "id at position ", bad, " maps to buffer row ", row, ", outside [0, ", weight.size(0), ")");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def(
      "quant_embedding_forward(Tensor weight, int storage, int dim, Tensor ids, Tensor offsets, Tensor? bag_shift, "
      "Tensor? per_sample_weights, Tensor? bag_scale, bool pooled, int batch, int prefetch=16) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) { m.impl("quant_embedding_forward", &quant_embedding_forward); }
