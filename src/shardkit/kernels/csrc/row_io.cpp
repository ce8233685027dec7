// Native positioned I/O of whole rows between an offloaded table's backing file and its cache buffers
// (the miss path of kernels/offload/row_cache.py). Pure-Python twin: kernels/offload/row_io.py
// (os.preadv / os.pwritev, one call per run of adjacent rows and field, from Python).
//
// Each field f of a row r lives at file byte `offsets[f] + r * strides[f]` and is `row_bytes[f]` long
// (the size of one row of buffers[f]); row i of the request moves between file row rows[i] and slot
// slots[i] of every buffer. The bytes of the request are cut into extents (one per row and field),
// ordered as they lie in the file (field by field when the fields are separate regions, row by row
// when each row is one record of all its fields), and extents that are adjacent in the file go in one
// preadv / pwritev call (up to IOV_MAX pieces, adjacent destinations merged into one piece): a run of
// consecutive rows costs one system call whatever the slots. Extents at most `max_gap` bytes apart go
// in one call too (a narrow field's misses, a few hundred bytes apart, cost one call per row otherwise):
// a read puts the gap into a throw-away buffer; a write reads the span first and writes it back with
// the extents in their places. All of it runs in this C++ loop, with the
// Python interpreter's lock released by the dispatcher (torch.ops calls drop the GIL), so another
// Python thread (the prefetching pipeline, the training step) runs meanwhile.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

#ifdef IOV_MAX
constexpr int64_t kMaxPieces = IOV_MAX;
#else
constexpr int64_t kMaxPieces = 1024;
#endif
// a read-modify-write span (a write that also rewrites gaps) moves at most this many bytes
constexpr int64_t kMaxWriteSpan = int64_t{1} << 20;

struct Extent {
  int64_t pos;  // byte offset in the file
  char* mem;    // where the bytes go to / come from
  int64_t len;
  int64_t row;  // the request's file row (for error messages)
};

// Moves `total` bytes at file offset `pos` from / to `pieces`, looping over partial transfers and
// EINTR. Returns "" on success, else what went wrong.
std::string transfer(int fd, std::vector<iovec>& pieces, int64_t total, int64_t pos, bool write) {
  size_t first = 0;
  int64_t done = 0;
  while (done < total) {
    const int count = static_cast<int>(std::min<size_t>(pieces.size() - first, static_cast<size_t>(kMaxPieces)));
    const ssize_t got = write ? ::pwritev(fd, pieces.data() + first, count, pos + done)
                              : ::preadv(fd, pieces.data() + first, count, pos + done);
    if (got < 0) {
      if (errno == EINTR) continue;
      return std::string(std::strerror(errno)) + " after " + std::to_string(done) + " of " + std::to_string(total) +
             " bytes";
    }
    if (got == 0) {
      return std::string(write ? "short write" : "short read") + " (" + std::to_string(done) + " of " +
             std::to_string(total) + " bytes)";
    }
    done += got;
    int64_t left = got;  // advance over the pieces the call completed, trim the one it stopped in
    while (left > 0 && first < pieces.size()) {
      const int64_t len = static_cast<int64_t>(pieces[first].iov_len);
      if (left >= len) {
        left -= len;
        ++first;
      } else {
        pieces[first].iov_base = static_cast<char*>(pieces[first].iov_base) + left;
        pieces[first].iov_len = len - left;
        left = 0;
      }
    }
  }
  return "";
}

int64_t move_rows(int64_t fd, const at::Tensor& rows, const at::Tensor& slots, at::TensorList buffers,
                  at::IntArrayRef offsets, at::IntArrayRef strides, int64_t max_gap, bool write) {
  const char* op = write ? "file_write_rows" : "file_read_rows";
  TORCH_CHECK(rows.device().is_cpu() && slots.device().is_cpu() && rows.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong && rows.dim() == 1 && slots.dim() == 1 &&
                  rows.is_contiguous() && slots.is_contiguous(),
              op, ": rows and slots must be contiguous int64 [n] CPU tensors");
  TORCH_CHECK(rows.numel() == slots.numel(), op, ": ", rows.numel(), " rows but ", slots.numel(), " slots");
  const int64_t fields = static_cast<int64_t>(buffers.size());
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == fields && static_cast<int64_t>(strides.size()) == fields,
              op, ": ", fields, " buffers, ", offsets.size(), " offsets, ", strides.size(), " strides");
  const int64_t n = rows.numel();
  std::vector<char*> base(fields);
  std::vector<int64_t> row_bytes(fields), capacity(fields);
  for (int64_t f = 0; f < fields; ++f) {
    const at::Tensor& b = buffers[f];
    TORCH_CHECK(b.device().is_cpu() && b.is_contiguous() && b.dim() >= 1, op, ": buffer ", f,
                " must be a contiguous CPU tensor [C, *width]");
    capacity[f] = b.size(0);
    row_bytes[f] = b.size(0) ? b.numel() / b.size(0) * static_cast<int64_t>(b.element_size()) : 0;
    base[f] = static_cast<char*>(b.data_ptr());
    TORCH_CHECK(offsets[f] >= 0 && strides[f] >= row_bytes[f], op, ": field ", f, " offset ", offsets[f],
                " stride ", strides[f], " (rows of ", row_bytes[f], " bytes)");
  }
  if (n == 0 || fields == 0) return 0;
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row[i] >= 0, op, ": row ", row[i], " at position ", i, " is negative");
    for (int64_t f = 0; f < fields; ++f) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity[f], op, ": slot ", slot[i], " at position ", i,
                  " outside buffer ", f, " of ", capacity[f], " rows");
    }
  }
  // one record per row when every field starts within the first field's row stride
  const int64_t low = *std::min_element(offsets.begin(), offsets.end());
  bool records = fields > 1;
  for (int64_t f = 0; f < fields; ++f) records = records && strides[f] == strides[0] && offsets[f] < low + strides[0];
  std::vector<Extent> extents;
  extents.reserve(static_cast<size_t>(n * fields));
  auto add = [&](int64_t i, int64_t f) {
    if (row_bytes[f]) extents.push_back({offsets[f] + row[i] * strides[f], base[f] + slot[i] * row_bytes[f], row_bytes[f], row[i]});
  };
  if (records) {
    std::vector<int64_t> order(fields);  // a record's fields in file order
    for (int64_t f = 0; f < fields; ++f) order[f] = f;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return offsets[a] < offsets[b]; });
    for (int64_t i = 0; i < n; ++i)
      for (int64_t f : order) add(i, f);
  } else {
    for (int64_t f = 0; f < fields; ++f)
      for (int64_t i = 0; i < n; ++i) add(i, f);
  }
  int64_t calls = 0;
  std::vector<iovec> pieces;
  // a gap of at most max_gap bytes between two extents is moved too, so that both go in one call: read
  // into `junk` (its bytes are never used), written back as read (read-modify-write through `scratch`,
  // a span of at most kMaxWriteSpan bytes: the caller is the file's only writer meanwhile)
  const int64_t gap_limit = std::max<int64_t>(max_gap, 0);
  std::vector<char> junk(static_cast<size_t>(gap_limit));
  std::vector<char> scratch;
  size_t start = 0;  // first extent of the current call
  while (start < extents.size()) {
    pieces.clear();
    const int64_t pos = extents[start].pos;
    int64_t end = pos;
    bool gaps = false;
    size_t k = start;
    for (; k < extents.size(); ++k) {
      const Extent& e = extents[k];
      const int64_t gap = e.pos - end;
      if (gap < 0 || gap > gap_limit) break;
      if (write && (gaps || gap > 0) && e.pos + e.len - pos > kMaxWriteSpan) break;
      if (gap > 0) {
        if (!write) pieces.push_back({junk.data(), static_cast<size_t>(gap)});
        gaps = true;
      }
      if (!pieces.empty() && static_cast<char*>(pieces.back().iov_base) + pieces.back().iov_len == e.mem) {
        pieces.back().iov_len += e.len;
      } else {
        pieces.push_back({e.mem, static_cast<size_t>(e.len)});
      }
      end = e.pos + e.len;
    }
    std::string error;
    if (write && gaps) {
      // read the span, put the extents' bytes in their places, write the span back
      scratch.resize(static_cast<size_t>(end - pos));
      std::vector<iovec> whole{{scratch.data(), scratch.size()}};
      error = transfer(static_cast<int>(fd), whole, end - pos, pos, false);
      if (error.empty()) {
        for (size_t j = start; j < k; ++j) std::memcpy(scratch.data() + (extents[j].pos - pos), extents[j].mem, extents[j].len);
        whole.assign(1, {scratch.data(), scratch.size()});
        error = transfer(static_cast<int>(fd), whole, end - pos, pos, true);
        ++calls;
      }
    } else {
      error = transfer(static_cast<int>(fd), pieces, end - pos, pos, write);
    }
    TORCH_CHECK(error.empty(), op, ": ", error, " at file bytes ", pos, "..", end - 1, " (rows ",
                extents[start].row, "..", extents[k - 1].row, ")");
    ++calls;
    start = k;
  }
  return calls;
}

// Reads file rows rows[i] into slot slots[i] of every buffer; returns the number of preadv calls.
int64_t file_read_rows(int64_t fd, const at::Tensor& rows, const at::Tensor& slots, at::TensorList buffers,
                       at::IntArrayRef offsets, at::IntArrayRef strides, int64_t max_gap) {
  return move_rows(fd, rows, slots, buffers, offsets, strides, max_gap, false);
}

// Writes slot slots[i] of every buffer to file row rows[i]; returns the number of pwritev calls.
int64_t file_write_rows(int64_t fd, const at::Tensor& rows, const at::Tensor& slots, at::TensorList buffers,
                        at::IntArrayRef offsets, at::IntArrayRef strides, int64_t max_gap) {
  return move_rows(fd, rows, slots, buffers, offsets, strides, max_gap, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def(
      "file_read_rows(int fd, Tensor rows, Tensor slots, Tensor(a!)[] buffers, int[] offsets, int[] strides, "
      "int max_gap=0) -> int");
  m.def(
      "file_write_rows(int fd, Tensor rows, Tensor slots, Tensor[] buffers, int[] offsets, int[] strides, "
      "int max_gap=0) -> int");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) {
  m.impl("file_read_rows", &file_read_rows);
  m.impl("file_write_rows", &file_write_rows);
}
