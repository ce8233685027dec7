// Native CPU kernels of the vocab-parallel cross-entropy: one rank's [T, w] logits shard (fp32 or bf16,
// rows contiguous). Pure-torch twin: shardkit/losses/statistics.py (_plain_statistics and the "direct"
// path of softmax_gradient_blocks); the tests compare the two.
//
// Why native: the torch path runs 3-4 elementwise kernels per cache block (sub, exp, mul, scatter), so
// the data crosses the core's load/store units several times and each call has a fixed cost; here each
// row is read once for the statistics (in chunks that stay in the L1 cache between the max and the
// exp-sum sub-passes) and read once / written once for the gradient.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__linux__)
#include <sys/mman.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux >= 5.14; an older kernel answers EINVAL and the stores fault instead
#endif
#endif

namespace {

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float load(const float* p, int64_t j) { return p[j]; }
inline float load(const c10::BFloat16* p, int64_t j) { return bits_to_float(uint32_t(p[j].x) << 16); }

inline void store(float* p, int64_t j, float v) { p[j] = v; }
inline void store(c10::BFloat16* p, int64_t j, float v) {
  // round to nearest even, NaN kept a (quiet) NaN: the rule of c10::BFloat16's constructor
  const uint32_t b = float_to_bits(v);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  p[j].x = static_cast<uint16_t>(v != v ? 0x7FC0u : rounded);
}

// exp(x) in a form the compiler vectorizes (Cody-Waite reduction, Cephes' degree-6 polynomial; within
// 2 ulp of std::exp on [-87, 88]): exp(x) = 2^n * exp(r), n = round(x / ln 2). Below -87.3 (where exp is
// denormal or 0, e.g. x = -inf) it returns 0; NaN stays NaN; above 88.7 it returns inf; in (88, 88.7] it
// returns exp(88) (the callers' arguments are x - max or x - logsumexp, never above ~0).
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer held in the low bits
  const float t = xc * 1.44269504088896341f + shifter;
  const int32_t n = static_cast<int32_t>(float_to_bits(t)) - 0x4B400000;
  const float nf = t - shifter;
  // fused multiply-adds (one rounding each): the polynomial is this file's own, nothing to match bitwise
  float r = std::fma(nf, -0.693359375f, xc);
  r = std::fma(nf, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  float out = y * bits_to_float(static_cast<uint32_t>(n + 127) << 23);  // n in [-126, 127]: a normal 2^n
  out = x < -87.3f ? 0.0f : out;
  out = x > 88.7f ? std::numeric_limits<float>::infinity() : out;
  return x != x ? x : out;
}

void check_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, op, ": logits must be [T, w] with contiguous rows, got ",
              logits.sizes(), " strides ", logits.strides());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, op,
              ": logits must be float32 or bfloat16, got ", logits.scalar_type());
}

void check_rows(const at::Tensor& t, int64_t rows, at::ScalarType dtype, const char* name, const char* op) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.is_contiguous() && t.scalar_type() == dtype, op, ": ", name,
              " must be contiguous [", rows, "] ", dtype, ", got ", t.sizes(), " ", t.scalar_type());
}

// Per row: (max x * inv_t, sum exp(x * inv_t - shift), x[index] * inv_t if owned else 0[, sum x * inv_t]) over
// the first `real` columns, shift = the max when finite else 0 (an all -inf row sums to 0). The max and
// the sum run over chunks of `chunk` columns: the chunk's max, then its exp-sum from the L1 cache,
// merged into the row's running (max, sum).
template <typename scalar_t>
void statistics_rows(const at::Tensor& logits, const int64_t* index, const bool* owned, int64_t real, double inv_t_d,
                     bool with_sum, int64_t chunk, float* stats, int64_t k) {
  const int64_t rows = logits.size(0);
  const int64_t stride = logits.stride(0);
  const scalar_t* base = logits.data_ptr<scalar_t>();
  const float inv_t = static_cast<float>(inv_t_d);
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, real)), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const scalar_t* x = base + i * stride;
      float* out = stats + i * k;
      if (real == 0) {
        out[0] = ninf;
        for (int64_t c = 1; c < k; ++c) out[c] = 0.0f;
        continue;
      }
      float row_max = ninf;  // of x * inv_t
      float row_sum = 0.0f;  // of exp(x * inv_t - row_max)
      float sum_z = 0.0f;
      for (int64_t j0 = 0; j0 < real; j0 += chunk) {
        const int64_t j1 = std::min(real, j0 + chunk);
        float m = ninf;
#pragma omp simd reduction(max : m)
        for (int64_t j = j0; j < j1; ++j) m = std::max(m, load(x, j));
        m = m * inv_t;  // inv_t > 0 keeps the order
        const float shift = std::isfinite(m) ? m : 0.0f;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = j0; j < j1; ++j) s += fast_exp(load(x, j) * inv_t - shift);
        if (with_sum) {
          float z = 0.0f;
#pragma omp simd reduction(+ : z)
          for (int64_t j = j0; j < j1; ++j) z += load(x, j);
          sum_z += z * inv_t;
        }
        // merge (m, s relative to shift) into (row_max, row_sum relative to the row's shift)
        const float new_max = std::max(row_max, m);
        const float new_shift = std::isfinite(new_max) ? new_max : 0.0f;
        const float old_shift = std::isfinite(row_max) ? row_max : 0.0f;
        row_sum = (row_sum == 0.0f ? 0.0f : row_sum * std::exp(old_shift - new_shift)) +
                  (s == 0.0f ? 0.0f : s * std::exp(shift - new_shift));
        row_max = new_max;
      }
      out[0] = row_max;
      out[1] = row_sum;
      out[2] = owned[i] ? load(x, index[i]) * inv_t : 0.0f;
      if (with_sum) out[3] = sum_z;
    }
  });
}

// ce_statistics(logits [T, w], index [T] int64, owned [T] bool, real, inv_t, with_sum, chunk) -> [T, 3|4] fp32
at::Tensor ce_statistics(const at::Tensor& logits, const at::Tensor& index, const at::Tensor& owned, int64_t real,
                         double inv_t, bool with_sum, int64_t chunk) {
  const char* op = "ce_statistics";
  check_logits(logits, op);
  const int64_t rows = logits.size(0);
  check_rows(index, rows, at::kLong, "index", op);
  check_rows(owned, rows, at::kBool, "owned", op);
  TORCH_CHECK(real >= 0 && real <= logits.size(1), op, ": real width ", real, " outside [0, ", logits.size(1), "]");
  TORCH_CHECK(chunk > 0 && inv_t > 0, op, ": chunk (", chunk, ") and inv_t (", inv_t, ") must be positive");
  const int64_t k = with_sum ? 4 : 3;
  at::Tensor stats = at::empty({rows, k}, logits.options().dtype(at::kFloat));
  const int64_t* idx = index.data_ptr<int64_t>();
  const int64_t w = logits.size(1);
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < std::max<int64_t>(1, w), op, ": index[", i, "] = ", idx[i], " outside [0, ", w, ")");
  if (logits.scalar_type() == at::kFloat)
    statistics_rows<float>(logits, idx, owned.data_ptr<bool>(), real, inv_t, with_sum, chunk, stats.data_ptr<float>(), k);
  else
    statistics_rows<c10::BFloat16>(logits, idx, owned.data_ptr<bool>(), real, inv_t, with_sum, chunk,
                                   stats.data_ptr<float>(), k);
  return stats;
}

// out[i, j] = exp(x * inv_t - lse) * coef_p - coef_uniform (j < real), 0 for padding columns, plus
// minus_target at the row's index; every column 0 in rows that are not active. coef_p, coef_uniform and
// minus_target already carry the factor inv_t. `out` may be `logits` itself (each element is read
// before it is written; the target element is read first).
// A fresh output buffer's pages are mapped about 1 MiB of rows at a time, just before those rows are
// computed: the kernel zeroes them then, and the just-zeroed lines are still in cache for the rows'
// stores (faulting them from inside the compute loop cost more: a fresh 1 GB
// gradient took 620 ms of faults against 300 ms for a plain copy into a fresh buffer, on a 2-core Xeon
// VM). Two ways, chosen by ce_fault_mode():
//  kTouch:    one store per 4 KiB page, each a page fault (a trap into the kernel per page).
//  kPopulate: madvise(MADV_POPULATE_WRITE) on the rows' whole pages: the kernel maps them in one call,
//             without a trap per page (Linux >= 5.14). Where the call fails the row is touched
//             instead; where it is not supported (EINVAL: an older kernel) the mode drops to kTouch.
// Transparent huge pages (MADV_HUGEPAGE) are not used: on that VM a 1 GB gradient with 998 MB of it in
// huge pages (free 2 MiB blocks, no compaction stall) took 4x the CPU time of 4 KiB pages, and with
// THP's default defrag policy a huge-page fault may also compact memory synchronously (see
// docs/performance.md). So THP's setting (never / madvise / always) changes nothing here. Never for an
// output that is the input (its pages are present, and a store would destroy the logits).
enum FaultMode : int64_t { kTouch = 0, kPopulate = 1 };

#if defined(__linux__)
std::atomic<int64_t> g_fault_mode{kPopulate};
#else
std::atomic<int64_t> g_fault_mode{kTouch};
#endif

template <typename out_t>
inline void touch_pages(out_t* row, int64_t n) {
  volatile char* bytes = reinterpret_cast<volatile char*>(row);
  const int64_t size = n * static_cast<int64_t>(sizeof(out_t));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(row) + 4095) & ~uintptr_t(4095);
  for (int64_t b = static_cast<int64_t>(first - reinterpret_cast<uintptr_t>(row)); b < size; b += 4096) bytes[b] = 0;
}

// maps the pages of [p, p + bytes) ahead of the stores (see above); the partial pages at the ends are
// left to the stores (a neighbouring row may share them)
inline void prefault(void* p, int64_t bytes) {
#if defined(__linux__)
  if (g_fault_mode.load(std::memory_order_relaxed) == kPopulate) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
    const uintptr_t a = (begin + 4095) & ~uintptr_t(4095), e = (begin + static_cast<uintptr_t>(bytes)) & ~uintptr_t(4095);
    if (e <= a || madvise(reinterpret_cast<void*>(a), e - a, MADV_POPULATE_WRITE) == 0) return;
    // EINVAL: this kernel has no MADV_POPULATE_WRITE (or the memory is not ordinary): never ask again.
    // Anything else (EINTR, EAGAIN, ENOMEM) concerns this call only: these rows are touched instead.
    if (errno == EINVAL) g_fault_mode.store(kTouch, std::memory_order_relaxed);
  }
#endif
  touch_pages(static_cast<char*>(p), bytes);
}

// rows of a fresh contiguous output mapped per madvise call: about 1 MiB (a row at least), so that the
// call's fixed cost is spread over many pages while the zeroed lines still fit the L2 for the stores
// (one call per 256 KiB row cost 3-10% more than per 1-2 MiB: a standalone copy of this loop, 262 MB of
// fp32 gradient, on a 2-core Xeon VM)
constexpr int64_t kPrefaultBytes = 1 << 20;

constexpr int64_t kGradientPiece = 1024;  // 4 KiB of fp32: stays in L1

template <typename in_t, typename out_t>
void gradient_rows(const at::Tensor& logits, at::Tensor& out, const float* lse, const float* coef_p,
                   const float* minus_target, const float* coef_uniform, const int64_t* index, const bool* active,
                   int64_t real, double inv_t_d, bool premapped) {
  const int64_t rows = logits.size(0), w = logits.size(1);
  const int64_t in_stride = logits.stride(0), out_stride = out.stride(0);
  const in_t* in_base = logits.data_ptr<in_t>();
  out_t* out_base = out.data_ptr<out_t>();
  const float inv_t = static_cast<float>(inv_t_d);
  const bool in_place = static_cast<const void*>(in_base) == static_cast<const void*>(out_base);
  const bool map_ahead = !in_place && !premapped;  // an input's or a ce_map_pages'd buffer's pages are present
  const int64_t row_bytes = w * static_cast<int64_t>(sizeof(out_t));
  // rows per prefault call: one where rows have gaps between them (only the rows' own pages are mapped)
  const int64_t group = out_stride == w ? std::max<int64_t>(1, kPrefaultBytes / std::max<int64_t>(1, row_bytes)) : 1;
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, w)), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const in_t* x = in_base + i * in_stride;
      out_t* o = out_base + i * out_stride;
      if (map_ahead && (i - r0) % group == 0) prefault(o, std::min(group, r1 - i) * row_bytes);
      if (!active[i]) {
        for (int64_t j = 0; j < w; ++j) store(o, j, 0.0f);
        continue;
      }
      const float l = lse[i], cp = coef_p[i], cu = coef_uniform ? coef_uniform[i] : 0.0f;
      const int64_t t = index[i];
      const float xt = (t < real) ? load(x, t) : 0.0f;  // before the row is overwritten
      // through a small fp32 buffer: computing straight into `o` ran 2x slower when o aliases x (in place)
      float buf[kGradientPiece];
      for (int64_t j0 = 0; j0 < real; j0 += kGradientPiece) {
        const int64_t n = std::min<int64_t>(kGradientPiece, real - j0);
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) buf[j] = fast_exp(load(x, j0 + j) * inv_t - l) * cp - cu;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) store(o, j0 + j, buf[j]);
      }
      for (int64_t j = real; j < w; ++j) store(o, j, 0.0f);
      if (t < real && minus_target[i] != 0.0f)
        store(o, t, (fast_exp(xt * inv_t - l) * cp - cu) + minus_target[i]);
    }
  });
}

// ce_gradient(logits [T, w], out [T, w] (float32 or the logits' dtype; may be logits), lse, coef_p,
// minus_target, coef_uniform?, index, active, real, inv_t, premapped) -> out; premapped: out's pages
// were mapped by ce_map_pages (no mapping ahead of the stores then)
at::Tensor ce_gradient(const at::Tensor& logits, at::Tensor out, const at::Tensor& lse, const at::Tensor& coef_p,
                       const at::Tensor& minus_target, const c10::optional<at::Tensor>& coef_uniform,
                       const at::Tensor& index, const at::Tensor& active, int64_t real, double inv_t,
                       bool premapped) {
  const char* op = "ce_gradient";
  check_logits(logits, op);
  check_logits(out, op);
  TORCH_CHECK(out.sizes() == logits.sizes(), op, ": out ", out.sizes(), " must match logits ", logits.sizes());
  const int64_t rows = logits.size(0);
  check_rows(lse, rows, at::kFloat, "lse", op);
  check_rows(coef_p, rows, at::kFloat, "coef_p", op);
  check_rows(minus_target, rows, at::kFloat, "minus_target", op);
  if (coef_uniform.has_value()) check_rows(*coef_uniform, rows, at::kFloat, "coef_uniform", op);
  check_rows(index, rows, at::kLong, "index", op);
  check_rows(active, rows, at::kBool, "active", op);
  TORCH_CHECK(real >= 0 && real <= logits.size(1), op, ": real width ", real, " outside [0, ", logits.size(1), "]");
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(idx[i] >= 0, op, ": index[", i, "] = ", idx[i], " is negative");
  const float* cu = coef_uniform.has_value() ? coef_uniform->data_ptr<float>() : nullptr;
  const auto in_type = logits.scalar_type(), out_type = out.scalar_type();
#define SK_CE_GRAD(IN, OUT)                                                                                       \
  gradient_rows<IN, OUT>(logits, out, lse.data_ptr<float>(), coef_p.data_ptr<float>(), minus_target.data_ptr<float>(), \
                         cu, idx, active.data_ptr<bool>(), real, inv_t, premapped)
  if (in_type == at::kFloat && out_type == at::kFloat) SK_CE_GRAD(float, float);
  else if (in_type == at::kBFloat16 && out_type == at::kBFloat16) SK_CE_GRAD(c10::BFloat16, c10::BFloat16);
  else if (in_type == at::kBFloat16 && out_type == at::kFloat) SK_CE_GRAD(c10::BFloat16, float);
  else TORCH_CHECK(false, op, ": out must be float32 or the logits' dtype, got ", out_type, " for ", in_type, " logits");
#undef SK_CE_GRAD
  return out;
}

// ce_map_pages(t) -> t: maps every whole page of t's (contiguous) memory now, in the mode of
// ce_fault_mode() (one madvise(MADV_POPULATE_WRITE) call, or one store per page), so that a later
// ce_gradient into t finds its pages present. The contents become unspecified (mapped pages read 0;
// under kTouch a page's first byte is written 0). The cross-entropy's forward maps the gradient
// buffer this way when a gradient will be wanted (shardkit/kernels/cross_entropy.py: the kernel work of
// mapping a fresh buffer, about 1 us per 4 KiB page on a 2-core Xeon VM, then falls in the forward).
at::Tensor ce_map_pages(at::Tensor t) {
  TORCH_CHECK(t.is_contiguous(), "ce_map_pages: the tensor must be contiguous, got strides ", t.strides());
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (bytes > 0) prefault(t.data_ptr(), bytes);
  return t;
}

// ce_fault_mode(requested) -> the mode in effect: requested -1 only asks; 0 (touch) or 1 (populate; on a
// platform without madvise it stays 0) sets it for this process
int64_t ce_fault_mode(int64_t requested) {
  TORCH_CHECK(requested >= -1 && requested <= 1, "ce_fault_mode: requested must be -1, 0 (touch) or 1 (populate), got ",
              requested);
#if defined(__linux__)
  if (requested >= 0) g_fault_mode.store(requested);
#endif
  return g_fault_mode.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def("ce_statistics(Tensor logits, Tensor index, Tensor owned, int real, float inv_t, bool with_sum, int chunk) -> Tensor");
  m.def(
      "ce_gradient(Tensor logits, Tensor(a!) out, Tensor lse, Tensor coef_p, Tensor minus_target, Tensor? coef_uniform, "
      "Tensor index, Tensor active, int real, float inv_t, bool premapped=False) -> Tensor(a!)");
  m.def("ce_map_pages(Tensor(a!) t) -> Tensor(a!)");
  m.def("ce_fault_mode(int requested) -> int", &ce_fault_mode);  // no tensor: one kernel for every backend
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) {
  m.impl("ce_statistics", &ce_statistics);
  m.impl("ce_gradient", &ce_gradient);
  m.impl("ce_map_pages", &ce_map_pages);
}
