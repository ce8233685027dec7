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
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

#ifdef IOV_MAX
constexpr int64_t kMaxPieces = IOV_MAX;
#else
constexpr int64_t kMaxPieces = 1024;
#endif
// a read-modify-write span (a write that also rewrites gaps) moves at most this many bytes
constexpr int64_t kMaxWriteSpan = int64_t{1} << 20;
// a reader thread is started for at least this many system calls of its own
constexpr int64_t kMinCallsPerThread = 128;
// reader threads take the calls of a read in chunks of this many, in file order, from a shared counter
constexpr int64_t kCallsPerChunk = 32;

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

std::tuple<int64_t, int64_t> move_rows(int64_t fd, const at::Tensor& rows, const at::Tensor& slots, at::TensorList buffers,
                  at::IntArrayRef offsets, at::IntArrayRef strides, int64_t max_gap, bool write, int64_t threads) {
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
  if (n == 0 || fields == 0) return {0, 1};
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
  // a gap of at most max_gap bytes between two extents is moved too, so that both go in one call: read
  // into `junk` (its bytes are never used), written back as read (read-modify-write through `scratch`,
  // a span of at most kMaxWriteSpan bytes: the caller is the file's only writer meanwhile)
  const int64_t gap_limit = std::max<int64_t>(max_gap, 0);
  // the calls for extents [from, to): returns "" or what went wrong (never throws: it may run on a
  // reader thread); `calls` counts the system calls
  auto run = [&](size_t from, size_t to, int64_t& calls) -> std::string {
    std::vector<iovec> pieces;
    std::vector<char> junk(static_cast<size_t>(gap_limit));
    std::vector<char> scratch;
    size_t start = from;  // first extent of the current call
    while (start < to) {
      pieces.clear();
      const int64_t pos = extents[start].pos;
      int64_t end = pos;
      bool gaps = false;
      size_t k = start;
      for (; k < to; ++k) {
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
      if (!error.empty()) {
        return std::string(op) + ": " + error + " at file bytes " + std::to_string(pos) + ".." +
               std::to_string(end - 1) + " (rows " + std::to_string(extents[start].row) + ".." +
               std::to_string(extents[k - 1].row) + ")";
      }
      ++calls;
      start = k;
    }
    return "";
  };
  // reads of many calls are shared among `threads` threads (the same calls as on one thread: page-cache
  // reads of disjoint bytes into disjoint slots, independent of each other): the calls are cut into
  // chunks of kCallsPerChunk in file order, and each thread takes the next chunk from a shared counter
  // until none is left, so a thread that the OS does not run (a busy machine), or one that starts late,
  // leaves its share to the others instead of making the caller wait for it. After a failed call no
  // further chunk is started (chunks taken finish). Writes stay on one thread: the write-behind thread
  // already takes them off the step.
  const size_t total = extents.size();
  std::vector<size_t> call_start;  // the first extent of each call (reads on several threads only)
  if (!write && threads > 1) {
    for (size_t i = 0; i < total;) {
      call_start.push_back(i);
      int64_t end = extents[i].pos + extents[i].len;
      size_t k = i + 1;
      for (; k < total; ++k) {
        const int64_t gap = extents[k].pos - end;
        if (gap < 0 || gap > gap_limit) break;
        end = extents[k].pos + extents[k].len;
      }
      i = k;
    }
  }
  const int64_t groups = static_cast<int64_t>(call_start.size());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, groups / kMinCallsPerThread));
  if (parts == 1) {
    int64_t calls = 0;
    const std::string error = run(0, total, calls);
    TORCH_CHECK(error.empty(), error);
    return {calls, 1};
  }
  const int64_t chunks = (groups + kCallsPerChunk - 1) / kCallsPerChunk;
  auto chunk_start = [&](int64_t c) -> size_t {
    return c >= chunks ? total : call_start[static_cast<size_t>(c * kCallsPerChunk)];
  };
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<int64_t> calls(static_cast<size_t>(parts), 0);
  std::vector<std::string> errors(static_cast<size_t>(parts));
  auto work = [&](int64_t part) {
    while (!failed.load(std::memory_order_relaxed)) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      errors[part] = run(chunk_start(c), chunk_start(c + 1), calls[part]);
      if (!errors[part].empty()) {
        failed.store(true, std::memory_order_relaxed);
        return;
      }
    }
  };
  std::vector<std::thread> helpers;
  for (int64_t part = 1; part < parts; ++part) helpers.emplace_back(work, part);
  work(0);
  for (auto& helper : helpers) helper.join();
  int64_t sum = 0;
  for (int64_t part = 0; part < parts; ++part) {
    TORCH_CHECK(errors[part].empty(), errors[part]);
    sum += calls[part];
  }
  return {sum, parts};
}

// Reads file rows rows[i] into slot slots[i] of every buffer, on up to `threads` threads (the caller's
// and threads - 1 started for the call, each for at least kMinCallsPerThread calls); returns the number
// of preadv calls and the threads that made them.
std::tuple<int64_t, int64_t> file_read_rows(int64_t fd, const at::Tensor& rows, const at::Tensor& slots,
                                            at::TensorList buffers, at::IntArrayRef offsets,
                                            at::IntArrayRef strides, int64_t max_gap, int64_t threads) {
  TORCH_CHECK(threads >= 1, "file_read_rows: threads must be >= 1, got ", threads);
  return move_rows(fd, rows, slots, buffers, offsets, strides, max_gap, false, threads);
}

// Writes slot slots[i] of every buffer to file row rows[i]; returns the number of pwritev calls.
int64_t file_write_rows(int64_t fd, const at::Tensor& rows, const at::Tensor& slots, at::TensorList buffers,
                        at::IntArrayRef offsets, at::IntArrayRef strides, int64_t max_gap) {
  return std::get<0>(move_rows(fd, rows, slots, buffers, offsets, strides, max_gap, true, 1));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardkit_native, m) {
  m.def(
      "file_read_rows(int fd, Tensor rows, Tensor slots, Tensor(a!)[] buffers, int[] offsets, int[] strides, "
      "int max_gap=0, int threads=1) -> (int, int)");
  m.def(
      "file_write_rows(int fd, Tensor rows, Tensor slots, Tensor[] buffers, int[] offsets, int[] strides, "
      "int max_gap=0) -> int");
}

TORCH_LIBRARY_IMPL(shardkit_native, CPU, m) {
  m.impl("file_read_rows", &file_read_rows);
  m.impl("file_write_rows", &file_write_rows);
}
