#include "core/shard_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <vector>

#include "core/crc32c.h"
#include "core/errors.h"
#include "core/thread_pool.h"

namespace recsave {
namespace {

// Bytes moved per system call: large enough to amortise the call, small enough that the checksum
// of a piece runs while it is still in cache.
constexpr uint64_t kPiece = 4ull << 20;

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

void ShardWriter::write(const WriteItem* items, size_t n, uint32_t* crcs_out, int threads) {
  if (fd_ < 0) throw Error(ErrorKind::kInvalid, path_, "write() after commit or abort");
  // Reject overlapping items: two threads writing the same bytes would make the file depend on timing.
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return items[a].offset < items[b].offset; });
  for (size_t k = 0; k < n; ++k) {
    const WriteItem& it = items[order[k]];
    if (it.offset + it.length < it.offset) {
      throw Error(ErrorKind::kInvalid, path_, "write range overflows: " + describe_range(it.offset, it.length));
    }
    if (it.length && !it.src) throw Error(ErrorKind::kInvalid, path_, "null source buffer");
    if (k + 1 < n && it.offset + it.length > items[order[k + 1]].offset) {
      throw Error(ErrorKind::kInvalid, path_,
                  "overlapping writes: " + describe_range(it.offset, it.length) + " and " +
                      describe_range(items[order[k + 1]].offset, items[order[k + 1]].length));
    }
  }

  const int fd = fd_;
  const std::string& name = temp_path_;
  shared_pool(threads).parallel_for(static_cast<int64_t>(n), threads, [&](int64_t i) {
    const WriteItem& it = items[i];
    const uint8_t* src = static_cast<const uint8_t*>(it.src);
    uint32_t crc = 0;
    uint64_t done = 0;
    while (done < it.length) {
      uint64_t piece = std::min(kPiece, it.length - done);
      crc = crc32c(crc, src + done, piece);
      uint64_t put = 0;
      while (put < piece) {
        ssize_t rc = ::pwrite(fd, src + done + put, piece - put, static_cast<off_t>(it.offset + done + put));
        if (rc < 0) {
          if (errno == EINTR) continue;
          throw_errno(name, "write of " + describe_range(it.offset + done + put, piece - put));
        }
        if (rc == 0) {
          throw Error(ErrorKind::kIo, name, "write returned 0 for " + describe_range(it.offset + done + put, piece - put));
        }
        put += static_cast<uint64_t>(rc);
      }
      done += piece;
      bytes_written_.fetch_add(piece, std::memory_order_relaxed);
    }
    crcs_out[i] = crc;
  });
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
  const int fd = fd_;
  shared_pool(threads).parallel_for(static_cast<int64_t>(n), threads, [&](int64_t i) {
    const ReadItem& it = items[i];
    uint8_t* dst = static_cast<uint8_t*>(it.dst);
    uint32_t crc = 0;
    uint64_t done = 0;
    while (done < it.length) {
      uint64_t piece = std::min(kPiece, it.length - done);
      uint64_t got = 0;
      while (got < piece) {
        ssize_t rc = ::pread(fd, dst + done + got, piece - got, static_cast<off_t>(it.offset + done + got));
        if (rc < 0) {
          if (errno == EINTR) continue;
          throw_errno(path_, "read of " + describe_range(it.offset + done + got, piece - got));
        }
        if (rc == 0) {
          throw Error(ErrorKind::kCorrupt, path_,
                      "unexpected end of file reading " + describe_range(it.offset, it.length) +
                          " (the file was truncated)");
        }
        got += static_cast<uint64_t>(rc);
      }
      if (verify) crc = crc32c(crc, dst + done, piece);
      done += piece;
    }
    if (verify && crc != it.expected_crc) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "CRC32C mismatch: expected %08x, found %08x", it.expected_crc, crc);
      throw Error(ErrorKind::kCorrupt, path_, std::string(buf) + " in " + describe_range(it.offset, it.length));
    }
  });
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
