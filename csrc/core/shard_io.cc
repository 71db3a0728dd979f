#include "core/shard_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include "core/crc32c.h"
#include "core/errors.h"
#include "core/thread_pool.h"

namespace recsave {
namespace {

// Work is split into units of at most kUnit bytes of one item, so every thread has a share even when
// the items are few and large; the CRCs of an item's units are combined afterwards.
constexpr uint64_t kUnit = 1ull << 20;
// A writer checksums then writes pieces of up to this many bytes, so the system call copies them out
// of the (L2 or L3) cache. Not smaller: the page cache most likely takes a buffered write in folios
// up to the write's size (ext4's large folios, Linux 6.16 on), and every folio costs its own
// allocation, accounting and extent lookup. The engine's write of 1 GB went from 5.0 GB/s with
// 256 KiB pieces to 6.2 with 1 MiB (4 rounds each, higher in every round), a Saver's save of 2 GB
// from 3.6 to 4.0 GB/s (benchmarks/README.md, write-grain session).
constexpr uint64_t kWritePiece = 1ull << 20;
// A gather writes a run of two or more consecutive source rows of this many bytes or more straight
// from the source (an iovec of pwritev), as a contiguous write would; shorter runs, and single rows,
// are copied into the thread's buffer first. A table kept in bucket order (e.g. restored from a checkpoint) is then written
// without the copy; one in random order pays it, as one iovec per row would cost more.
constexpr uint64_t kDirectRun = 4096;
constexpr int kMaxIov = 1024;  // IOV_MAX on Linux
// A reader reads pieces of this size into a per-thread buffer that stays in the L2 cache, then copies
// them into place with streaming stores while checksumming in the same pass: the destination is
// written once, without first being read into the cache, and the CRC costs no extra memory pass.
// Items up to kDirectMax bytes are read straight into place instead.
constexpr uint64_t kBouncePiece = 128ull << 10;
constexpr uint64_t kDirectMax = 64ull << 10;

struct Unit {
  size_t item;
  uint64_t begin;   // relative to the item, in the item's own measure (bytes, or rows of a gather)
  uint64_t length;
};

// Units of every item in order, at most `step` long, where extent_of(i) is {item i's length, step}
// (a zero-length item has one empty unit); first[i] is item i's first unit.
template <typename ExtentOf>
std::vector<Unit> split_units(size_t n, ExtentOf extent_of, std::vector<size_t>& first) {
  std::vector<Unit> units;
  first.assign(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    first[i] = units.size();
    const auto [length, step] = extent_of(i);
    uint64_t begin = 0;
    do {
      uint64_t len = std::min(step, length - begin);
      units.push_back({i, begin, len});
      begin += len;
    } while (begin < length);
  }
  first[n] = units.size();
  return units;
}

// Byte units of items with a `length`.
template <typename Item>
std::vector<Unit> split_units(const Item* items, size_t n, std::vector<size_t>& first) {
  return split_units(n, [items](size_t i) { return std::pair<uint64_t, uint64_t>{items[i].length, kUnit}; }, first);
}

// CRC of a whole item from the CRCs of its units [from, to); length_of(u) is unit u's byte count.
template <typename LengthOf>
uint32_t combine_units(const std::vector<uint32_t>& crcs, size_t from, size_t to, LengthOf length_of) {
  uint32_t crc = crcs[from];
  for (size_t u = from + 1; u < to; ++u) crc = crc32c_combine(crc, crcs[u], length_of(u));
  return crc;
}

// Work groups: runs of consecutive units that follow each other in the file, up to kUnit bytes
// each; group g is units [groups[g], groups[g + 1]). A caller's checksum segments may be short
// (cut at bucket boundaries): a group writes several of them with one system call per
// kWritePiece bytes while still checksumming each unit apart.
// `joinable(u)`, when given, must also hold for unit u to join the group of unit u - 1.
template <typename OffsetOf, typename BytesOf, typename Joinable = bool (*)(size_t)>
std::vector<size_t> group_units(size_t num_units, OffsetOf offset_of, BytesOf bytes_of,
                                Joinable joinable = [](size_t) { return true; }) {
  std::vector<size_t> groups;
  uint64_t bytes = 0;
  for (size_t u = 0; u < num_units; ++u) {
    const bool follows = u > 0 && offset_of(u) == offset_of(u - 1) + bytes_of(u - 1) && joinable(u);
    if (groups.empty() || !follows || bytes + bytes_of(u) > kUnit) {
      groups.push_back(u);
      bytes = 0;
    }
    bytes += bytes_of(u);
  }
  groups.push_back(num_units);
  return groups;
}

// The kernel copies a buffered read or write with `rep movsb`, which runs markedly slower when the
// user buffer and the file offset are not aligned alike modulo a cache line (a 2 GB save written 16
// bytes off: 360 ms against 290 aligned; benchmarks/README.md, the alignment session). Staging
// buffers are therefore allocated kAlignSpare bytes larger, used from a cache-line boundary, and
// each transfer starts at aligned_like(its file offset) in them.
constexpr uint64_t kCacheLine = 64;
constexpr uint64_t kAlignSpare = 2 * kCacheLine;  // up to a boundary, then up to aligned_like()

uint8_t* cache_line_aligned(uint8_t* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<uint8_t*>((a + kCacheLine - 1) & ~static_cast<uintptr_t>(kCacheLine - 1));
}

// Where in a cache-line aligned buffer a transfer at file offset `at` starts.
uint64_t aligned_like(uint64_t at) { return at & (kCacheLine - 1); }

// kBouncePiece bytes starting at any aligned_like offset of the result.
uint8_t* bounce_buffer() {
  thread_local std::unique_ptr<uint8_t[]> buffer(new uint8_t[kBouncePiece + kAlignSpare]);
  return cache_line_aligned(buffer.get());
}

#if defined(__linux__) && !defined(MADV_POPULATE_WRITE)
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and the hint is dropped
#endif

// A load into a new model writes memory nothing has touched yet, which then faults in one 4 KB page
// at a time from inside the copy. Asking the kernel to populate a whole unit's pages in one call
// costs about a fifth less CPU (2 GB copied into fresh memory here: 0.84 s faulting, 0.69 s with
// MADV_POPULATE_WRITE per 1 MiB). Memory already backed is left alone (mincore of its first page):
// populating it again walks its page tables for nothing (+0.13 s per 2 GB).
// RECSAVE_POPULATE=0 in the environment turns it off (read once, at first use): for A/B timing.
bool populate_disabled() {
  const char* v = std::getenv("RECSAVE_POPULATE");
  return v != nullptr && std::strcmp(v, "0") == 0;
}

void populate_if_fresh(uint8_t* p, uint64_t n) {
#if defined(__linux__)
  static std::atomic<bool> unsupported{populate_disabled()};
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  if (unsupported.load(std::memory_order_relaxed)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~(page - 1);
  if (end <= begin || end - begin < 16 * page) return;
  unsigned char resident = 0;
  if (::mincore(reinterpret_cast<void*>(begin), page, &resident) != 0 || (resident & 1)) return;
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) != 0 && errno == EINVAL) {
    unsupported.store(true, std::memory_order_relaxed);  // kernel before 5.14, or memory it cannot populate
  }
#else
  (void)p, (void)n;
#endif
}

// memcpy with streaming stores (the destination is not brought into the cache).
void copy_streaming(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (n >= head + 256) {
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; n - i >= 64; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    _mm_sfence();
    std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

std::string parent_dir(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string temp_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
}

std::string describe_range(uint64_t offset, uint64_t length) {
  return "bytes [" + std::to_string(offset) + ", " + std::to_string(offset) + " + " +
         std::to_string(length) + ")";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ShardWriter

ShardWriter::ShardWriter(std::string path, bool durable)
    : path_(std::move(path)), temp_path_(temp_name(path_)), durable_(durable) {
  fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) throw_errno(temp_path_, "open for writing");
}

ShardWriter::~ShardWriter() { abort(); }

void ShardWriter::reserve(uint64_t size) {
  if (fd_ < 0) throw Error(ErrorKind::kInvalid, path_, "reserve() after commit or abort");
  if (size == 0) return;
  int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(size));
  if (rc == 0 || rc == EOPNOTSUPP || rc == EINVAL) return;
  errno = rc;
  throw_errno(temp_path_, "reserving " + std::to_string(size) + " bytes (posix_fallocate)");
}

void ShardWriter::check_ranges(std::vector<std::pair<uint64_t, uint64_t>> ranges) const {
  if (fd_ < 0) throw Error(ErrorKind::kInvalid, path_, "write after commit or abort");
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 0; k < ranges.size(); ++k) {
    const auto [offset, length] = ranges[k];
    if (offset + length < offset) {
      throw Error(ErrorKind::kInvalid, path_, "write range overflows: " + describe_range(offset, length));
    }
    if (k + 1 < ranges.size() && offset + length > ranges[k + 1].first) {
      throw Error(ErrorKind::kInvalid, path_,
                  "overlapping writes: " + describe_range(offset, length) + " and " +
                      describe_range(ranges[k + 1].first, ranges[k + 1].second));
    }
  }
}

void ShardWriter::putv(iovec* iov, int count, uint64_t length, uint64_t at) {
  for (uint64_t done = 0; done < length;) {
    ssize_t rc = ::pwritev(fd_, iov, count, static_cast<off_t>(at + done));
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw_errno(temp_path_, "write of " + describe_range(at + done, length - done));
    }
    if (rc == 0) {
      throw Error(ErrorKind::kIo, temp_path_, "write returned 0 for " + describe_range(at + done, length - done));
    }
    done += static_cast<uint64_t>(rc);
    // A short write: skip the iovecs written whole, advance into the one written in part.
    for (uint64_t left = static_cast<uint64_t>(rc); left && count;) {
      if (left >= iov->iov_len) {
        left -= iov->iov_len;
        ++iov;
        --count;
      } else {
        iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
        iov->iov_len -= left;
        left = 0;
      }
    }
  }
  bytes_written_.fetch_add(length, std::memory_order_relaxed);
#if defined(__linux__)
  // A durable file is fsynced at commit: start writing these pages back now, so the disk works
  // while the rest is written and the fsync has little left to wait for. Only a hint: errors
  // (e.g. a file system without it) are the fsync's to report.
  if (durable_) ::sync_file_range(fd_, static_cast<off_t>(at), static_cast<off_t>(length), SYNC_FILE_RANGE_WRITE);
#endif
}

void ShardWriter::write(const WriteItem* items, size_t n, uint32_t* crcs_out, int threads) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges(n);
  for (size_t i = 0; i < n; ++i) {
    if (items[i].length && !items[i].src) throw Error(ErrorKind::kInvalid, path_, "null source buffer");
    ranges[i] = {items[i].offset, items[i].length};
  }
  check_ranges(std::move(ranges));

  std::vector<size_t> first;
  const std::vector<Unit> units = split_units(items, n, first);
  const std::vector<size_t> groups = group_units(
      units.size(), [&](size_t u) { return items[units[u].item].offset + units[u].begin; },
      [&](size_t u) { return units[u].length; });
  std::vector<uint32_t> crcs(units.size());
  shared_pool(threads).parallel_for(static_cast<int64_t>(groups.size() - 1), threads, [&](int64_t g) {
    // Pieces of up to kWritePiece bytes, checksummed then written (still in the cache) with one
    // pwritev, each unit's CRC apart; a piece may span units.
    iovec iov[kMaxIov];
    int count = 0;
    uint64_t at = items[units[groups[g]].item].offset + units[groups[g]].begin, pending = 0;
    for (size_t u = groups[g]; u < groups[g + 1]; ++u) {
      const Unit& unit = units[u];
      const uint8_t* src = static_cast<const uint8_t*>(items[unit.item].src) + unit.begin;
      uint32_t crc = 0;
      for (uint64_t done = 0; done < unit.length;) {
        const uint64_t piece = std::min(kWritePiece - pending, unit.length - done);
        crc = crc32c(crc, src + done, piece);
        iov[count++] = {const_cast<uint8_t*>(src + done), piece};
        pending += piece;
        done += piece;
        if (pending == kWritePiece || count == kMaxIov) {
          putv(iov, count, pending, at);
          at += pending;
          pending = 0;
          count = 0;
        }
      }
      crcs[u] = crc;
    }
    if (pending) putv(iov, count, pending, at);
  });
  for (size_t i = 0; i < n; ++i) crcs_out[i] = combine_units(crcs, first[i], first[i + 1], [&](size_t u) { return units[u].length; });
}

void ShardWriter::write_gathered(const GatherItem* items, size_t n, uint32_t* crcs_out, int threads) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges(n);
  for (size_t i = 0; i < n; ++i) {
    const GatherItem& it = items[i];
    if (it.row_bytes == 0 || (it.num_rows && (!it.base || !it.rows))) {
      throw Error(ErrorKind::kInvalid, path_, "gather item without rows, base buffer or row size");
    }
    if (it.num_rows > UINT64_MAX / it.row_bytes || it.base_rows > UINT64_MAX / it.row_bytes) {
      throw Error(ErrorKind::kInvalid, path_, "gather item size overflows");
    }
    for (uint64_t r = 0; r < it.num_rows; ++r) {
      if (it.rows[r] < 0 || static_cast<uint64_t>(it.rows[r]) >= it.base_rows) {
        throw Error(ErrorKind::kInvalid, path_,
                    "row index " + std::to_string(it.rows[r]) + " is outside the " +
                        std::to_string(it.base_rows) + " rows of the source");
      }
    }
    ranges[i] = {it.offset, it.num_rows * it.row_bytes};
  }
  check_ranges(std::move(ranges));

  // Units of about kUnit bytes, in whole rows (a row larger than kUnit is a unit of its own).
  std::vector<size_t> first;
  const std::vector<Unit> units = split_units(n, [items](size_t i) {
    return std::pair<uint64_t, uint64_t>{items[i].num_rows, std::max<uint64_t>(1, kUnit / items[i].row_bytes)};
  }, first);

  const auto unit_bytes = [&](size_t u) { return units[u].length * items[units[u].item].row_bytes; };
  const auto unit_offset = [&](size_t u) {
    return items[units[u].item].offset + units[u].begin * items[units[u].item].row_bytes;
  };
  const std::vector<size_t> groups = group_units(units.size(), unit_offset, unit_bytes);
  const size_t num_groups = groups.size() - 1;

  std::vector<uint32_t> crcs(units.size());
  shared_pool(threads).parallel_for(static_cast<int64_t>(num_groups), threads, [&](int64_t g) {
    // The pending write: iovecs over rows where they lie (runs of at least kDirectRun bytes) and
    // over rows copied into `buffer` (adjacent copies share one), in file order from `at`.
    thread_local std::vector<uint8_t> buffer;
    thread_local std::vector<iovec> iov;
    if (iov.size() < static_cast<size_t>(kMaxIov)) iov.resize(kMaxIov);
    uint64_t capacity = kWritePiece;
    for (size_t u = groups[g]; u < groups[g + 1]; ++u) capacity = std::max(capacity, items[units[u].item].row_bytes);
    if (buffer.size() < capacity + kAlignSpare) buffer.resize(capacity + kAlignSpare);
    uint8_t* const aligned = cache_line_aligned(buffer.data());
    uint64_t at = unit_offset(groups[g]);
    uint8_t* buf = aligned + aligned_like(at);  // copies land aligned like the file offset they go to
    int count = 0;
    uint64_t pending = 0, used = 0, span = 0, crc_from = 0;  // bytes: to write, of buf taken, not in an iovec, not checksummed
    const auto checksum_copied = [&](uint32_t& crc) {
      if (used > crc_from) crc = crc32c(crc, buf + crc_from, used - crc_from);
      crc_from = used;
    };
    const auto close_span = [&] {
      if (used > span) iov[count++] = {buf + span, used - span};
      span = used;
    };
    const auto flush = [&](uint32_t& crc) {
      checksum_copied(crc);
      close_span();
      if (pending) putv(iov.data(), count, pending, at);
      at += pending;
      pending = used = span = crc_from = 0;
      count = 0;
      buf = aligned + aligned_like(at);
    };
    // Rows are random reads from memory: prefetching a few ahead keeps several misses in flight.
    constexpr uint64_t kAhead = 8;
    constexpr uint64_t kSmallRow = 16;    // bytes: rows this small take the batched copy below
    constexpr uint64_t kSmallAhead = 32;  // rows: enough misses in flight to cover memory latency
    for (size_t u = groups[g]; u < groups[g + 1]; ++u) {
      const Unit& unit = units[u];  // begin, length: rows
      const GatherItem& it = items[unit.item];
      const uint8_t* base = static_cast<const uint8_t*>(it.base);
      const int64_t* rows = it.rows + unit.begin;
      const uint64_t rb = it.row_bytes;
      const uint64_t direct_rows = std::max<uint64_t>(2, (kDirectRun + rb - 1) / rb);
      const uint64_t max_run = std::max<uint64_t>(direct_rows, kWritePiece / rb);
      uint32_t crc = 0;
      if (rb <= kSmallRow) {
        // Small rows (ids, row metadata): each is a cache miss of its own when the order is random,
        // so the generic loop's per-row run detection and short prefetch distance dominate. Copy
        // them in batches, prefetching far ahead; a run of them copies at memory speed anyway.
        for (uint64_t j = 0; j < unit.length;) {
          if (pending >= kWritePiece || count >= kMaxIov - 1 || used + rb > capacity) flush(crc);
          const uint64_t fit = std::min<uint64_t>(unit.length - j, (capacity - used) / rb);
          uint8_t* out = buf + used;
          // Consecutive rows (a table in bucket order, as a restore leaves it): one block copy; the
          // check reads the row numbers the loop below would read anyway.
          uint64_t consecutive = 1;
          while (consecutive < fit && rows[j + consecutive] == rows[j] + static_cast<int64_t>(consecutive)) ++consecutive;
          if (consecutive == fit) {
            std::memcpy(out, base + static_cast<uint64_t>(rows[j]) * rb, fit * rb);
            used += fit * rb;
            pending += fit * rb;
            j += fit;
            continue;
          }
          for (uint64_t r = 0; r < fit; ++r) {
            if (j + r + kSmallAhead < unit.length) {
              __builtin_prefetch(base + static_cast<uint64_t>(rows[j + r + kSmallAhead]) * rb);
            }
            std::memcpy(out + r * rb, base + static_cast<uint64_t>(rows[j + r]) * rb, rb);
          }
          used += fit * rb;
          pending += fit * rb;
          j += fit;
        }
        checksum_copied(crc);
        crcs[u] = crc;
        continue;
      }
      for (uint64_t j = 0; j < unit.length;) {
        if (pending >= kWritePiece || count >= kMaxIov - 1) flush(crc);
        const int64_t first_row = rows[j];
        uint64_t run = 1;
        while (run < max_run && j + run < unit.length && rows[j + run] == first_row + static_cast<int64_t>(run)) ++run;
        const uint8_t* src = base + static_cast<uint64_t>(first_row) * rb;
        if (run >= direct_rows) {
          checksum_copied(crc);
          close_span();
          crc = crc32c(crc, src, run * rb);
          iov[count++] = {const_cast<uint8_t*>(src), run * rb};
        } else {
          if (used + run * rb > capacity) flush(crc);
          for (uint64_t r = 0; r < run; ++r) {
            const uint64_t next = j + r + kAhead;
            if (next < unit.length) {
              const uint8_t* ahead = base + static_cast<uint64_t>(rows[next]) * rb;
              for (uint64_t line = 0; line < std::min<uint64_t>(rb, 256); line += 64) __builtin_prefetch(ahead + line);
            }
          }
          std::memcpy(buf + used, src, run * rb);
          used += run * rb;
        }
        pending += run * rb;
        j += run;
      }
      checksum_copied(crc);
      crcs[u] = crc;
    }
    uint32_t unused = 0;
    flush(unused);
  });
  for (size_t i = 0; i < n; ++i) {
    crcs_out[i] = combine_units(crcs, first[i], first[i + 1],
                                [&](size_t u) { return units[u].length * items[units[u].item].row_bytes; });
  }
}

void ShardWriter::commit() {
  if (committed_) return;
  if (fd_ < 0) throw Error(ErrorKind::kInvalid, path_, "commit() after abort");
  if (durable_ && ::fsync(fd_) != 0) throw_errno(temp_path_, "fsync");
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(temp_path_.c_str());
    errno = err;
    throw_errno(temp_path_, "close");
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(temp_path_.c_str());
    errno = err;
    throw_errno(path_, "rename from " + temp_path_);
  }
  committed_ = true;
  if (durable_) fsync_directory(parent_dir(path_));
}

void ShardWriter::abort() noexcept {
  if (committed_) return;
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
    ::unlink(temp_path_.c_str());
  }
}

// ---------------------------------------------------------------------------------------------
// ShardReader

ShardReader::ShardReader(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw_errno(path_, "open for reading");
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    int err = errno;
    ::close(fd_);
    fd_ = -1;
    errno = err;
    throw_errno(path_, "stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw Error(ErrorKind::kCorrupt, path_, "not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

ShardReader::~ShardReader() { close(); }

void ShardReader::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string ShardReader::read_header(uint64_t max_header_bytes) const {
  if (fd_ < 0) throw Error(ErrorKind::kInvalid, path_, "read after close");
  if (size_ < 8) {
    throw Error(ErrorKind::kCorrupt, path_,
                "file is " + std::to_string(size_) + " bytes, shorter than the 8-byte header length");
  }
  uint8_t raw[8];
  ReadItem len_item{0, raw, 8, 0};
  read(&len_item, 1, false, 1);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | raw[i];  // little-endian on every host
  if (n > max_header_bytes) {
    throw Error(ErrorKind::kCorrupt, path_,
                "header length " + std::to_string(n) + " exceeds the limit of " +
                    std::to_string(max_header_bytes) + " bytes");
  }
  if (n > size_ - 8) {
    throw Error(ErrorKind::kCorrupt, path_,
                "header length " + std::to_string(n) + " runs past the end of the " +
                    std::to_string(size_) + "-byte file");
  }
  std::string header(n, '\0');
  ReadItem item{8, header.data(), n, 0};
  read(&item, 1, false, 1);
  return header;
}

void ShardReader::read(const ReadItem* items, size_t n, bool verify, int threads) const {
  if (fd_ < 0) throw Error(ErrorKind::kInvalid, path_, "read after close");
  for (size_t i = 0; i < n; ++i) {
    const ReadItem& it = items[i];
    if (it.offset > size_ || it.length > size_ - it.offset) {
      throw Error(ErrorKind::kBounds, path_,
                  describe_range(it.offset, it.length) + " lie beyond the end of the " +
                      std::to_string(size_) + "-byte file");
    }
    if (it.length && !it.dst) throw Error(ErrorKind::kInvalid, path_, "null destination buffer");
  }
  std::vector<size_t> first;
  const std::vector<Unit> units = split_units(items, n, first);
  // Units of large items that follow each other in the file and in memory (the checksum segments
  // of one tensor) are read together: short segments do not mean short reads.
  const auto dst_of = [&](size_t u) { return static_cast<uint8_t*>(items[units[u].item].dst) + units[u].begin; };
  const std::vector<size_t> groups = group_units(
      units.size(), [&](size_t u) { return items[units[u].item].offset + units[u].begin; },
      [&](size_t u) { return units[u].length; },
      [&](size_t u) {
        return items[units[u].item].length > kDirectMax && items[units[u - 1].item].length > kDirectMax &&
               dst_of(u) == dst_of(u - 1) + units[u - 1].length;
      });
  std::vector<uint32_t> crcs(units.size());
  shared_pool(threads).parallel_for(static_cast<int64_t>(groups.size() - 1), threads, [&](int64_t g) {
    const size_t g0 = groups[g], g1 = groups[g + 1];
    const ReadItem& it = items[units[g0].item];
    uint8_t* dst = dst_of(g0);
    const uint64_t at = it.offset + units[g0].begin;
    if (it.length <= kDirectMax) {  // a group of one unit
      read_exact(dst, units[g0].length, at, it);
      crcs[g0] = verify ? crc32c(0, dst, units[g0].length) : 0;
      return;
    }
    uint64_t total = 0;
    for (size_t u = g0; u < g1; ++u) total += units[u].length;
    uint8_t* bounce = bounce_buffer();
    populate_if_fresh(dst, total);
    // Pieces of the group through the bounce buffer; each unit's CRC is taken apart.
    size_t u = g0;
    uint64_t in_unit = 0;
    uint32_t crc = 0;
    for (uint64_t done = 0; done < total;) {
      const uint64_t piece = std::min(kBouncePiece, total - done);
      uint8_t* const staged = bounce + aligned_like(at + done);
      read_exact(staged, piece, at + done, items[units[u].item]);
      for (uint64_t p = 0; p < piece;) {
        const uint64_t take = std::min(piece - p, units[u].length - in_unit);
        if (verify) {
          crc = crc32c_copy(crc, dst + done + p, staged + p, take);
        } else {
          copy_streaming(dst + done + p, staged + p, take);
        }
        p += take;
        in_unit += take;
        if (in_unit == units[u].length) {
          crcs[u++] = crc;
          crc = 0;
          in_unit = 0;
        }
      }
      done += piece;
    }
  });
  if (!verify) return;
  for (size_t i = 0; i < n; ++i) {
    const ReadItem& it = items[i];
    uint32_t crc = combine_units(crcs, first[i], first[i + 1], [&](size_t u) { return units[u].length; });
    if (crc != it.expected_crc) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "CRC32C mismatch: expected %08x, found %08x", it.expected_crc, crc);
      throw Error(ErrorKind::kCorrupt, path_, std::string(buf) + " in " + describe_range(it.offset, it.length));
    }
  }
}

void ShardReader::read_exact(uint8_t* dst, uint64_t length, uint64_t at, const ReadItem& item) const {
  for (uint64_t got = 0; got < length;) {
    ssize_t rc = ::pread(fd_, dst + got, length - got, static_cast<off_t>(at + got));
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw_errno(path_, "read of " + describe_range(at + got, length - got));
    }
    if (rc == 0) {
      throw Error(ErrorKind::kCorrupt, path_,
                  "unexpected end of file reading " + describe_range(item.offset, item.length) +
                      " (the file was truncated)");
    }
    got += static_cast<uint64_t>(rc);
  }
}

void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno(dir, "open directory for fsync");
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some file systems (e.g. certain network mounts) refuse fsync on directories; that is not data loss.
  if (rc != 0 && err != EINVAL && err != EROFS) {
    errno = err;
    throw_errno(dir, "fsync directory");
  }
}

}  // namespace recsave
