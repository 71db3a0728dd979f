// Shard files: positional writes from many threads with CRC32C computed in the same pass, and
// parallel ranged reads into caller buffers with bounds checks and checksum verification.
// The byte layout (safetensors: 8-byte header length, JSON header, data) is decided by the caller;
// this layer moves bytes and guarantees each write / read either fully happened or threw.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace recsave {

struct WriteItem {
  uint64_t offset;   // byte offset in the file
  const void* src;   // `length` readable bytes
  uint64_t length;
};

// Rows of a row-major matrix written back to back: rows[0..num_rows) index `base`, which holds
// base_rows rows of row_bytes bytes each. Lets a caller write a table's rows in another order
// (e.g. by bucket) without first building that permuted copy.
struct GatherItem {
  uint64_t offset;      // byte offset in the file
  const void* base;     // base_rows * row_bytes readable bytes
  uint64_t base_rows;
  uint64_t row_bytes;
  const int64_t* rows;  // num_rows indexes into base, each in [0, base_rows)
  uint64_t num_rows;
};

struct ReadItem {
  uint64_t offset;        // byte offset in the file
  void* dst;              // `length` writable bytes
  uint64_t length;
  uint32_t expected_crc;  // CRC32C of the bytes, checked when verifying
};

// Writes one shard file under a temporary name next to `path`; commit() makes it appear at `path`
// atomically. Destroying an uncommitted writer removes the temporary file.
class ShardWriter {
 public:
  ShardWriter(std::string path, bool durable);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Asks the file system for `size` bytes up front so a full disk fails here, early. File systems
  // without fallocate support are tolerated.
  void reserve(uint64_t size);

  // Writes every item at its offset, on up to `threads` threads (items are cut into 1 MiB units that
  // threads take in turn), and stores each item's CRC32C in crcs_out[i]. Overlapping items are
  // rejected.
  void write(const WriteItem* items, size_t n, uint32_t* crcs_out, int threads);

  // Writes every gather item at its offset like write(), gathering the rows on the worker threads:
  // each thread copies rows into a buffer of up to 1 MiB (its cache), checksums it and writes it, so the
  // bytes are read from memory once and no permuted copy of the matrix exists. Runs of two or more
  // consecutive rows, 4 KiB and more, are checksummed and written where they lie (pwritev), without
  // the copy: a matrix already in the caller's order costs what a contiguous write() does. Items that follow
  // each other in the file are written together, up to 1 MiB, so short items (checksum segments cut
  // at bucket boundaries) do not mean short writes. A row index outside [0, base_rows) is rejected
  // (kInvalid) before anything is written.
  void write_gathered(const GatherItem* items, size_t n, uint32_t* crcs_out, int threads);

  // fsync (when durable), close, rename to `path`, fsync the directory (when durable).
  void commit();
  // Closes and unlinks the temporary file. Never throws; a no-op after commit().
  void abort() noexcept;

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t bytes_written() const { return bytes_written_.load(); }

 private:
  // Throws unless the ranges [offset, offset + length) are valid and disjoint (two threads writing the
  // same bytes would make the file depend on timing).
  void check_ranges(std::vector<std::pair<uint64_t, uint64_t>> ranges) const;
  // pwritev of all `length` bytes of the `count` iovecs at `at` (advances the iovecs on a short write).
  void putv(struct iovec* iov, int count, uint64_t length, uint64_t at);

  std::string path_;
  std::string temp_path_;
  bool durable_;
  int fd_ = -1;
  bool committed_ = false;
  std::atomic<uint64_t> bytes_written_{0};
};

// Reads from one shard file. Every range is checked against the file size (overflow-safe) before
// anything is read or allocated by the caller.
class ShardReader {
 public:
  explicit ShardReader(std::string path);
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // The safetensors header: a little-endian u64 N, then N bytes of JSON. Throws kCorrupt when the
  // file is shorter than 8 bytes, N > max_header_bytes, or 8 + N exceeds the file.
  std::string read_header(uint64_t max_header_bytes) const;

  // Reads every item into its buffer on up to `threads` threads (items are cut into 1 MiB units that
  // threads take in turn); when `verify`, each item's CRC32C must equal expected_crc. A range beyond
  // the file is kBounds, a mismatch or a short read kCorrupt (the first mismatching item is named;
  // every item is read before checksums are compared). Buffers of items over 64 KiB are written
  // with streaming stores, so they are not left in the CPU cache.
  void read(const ReadItem* items, size_t n, bool verify, int threads) const;

  void close() noexcept;

 private:
  // Reads exactly `length` bytes at file offset `at` into dst (part of `item`, named in errors).
  void read_exact(uint8_t* dst, uint64_t length, uint64_t at, const ReadItem& item) const;

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// fsyncs a directory so a rename inside it survives a power cut.
void fsync_directory(const std::string& dir);

}  // namespace recsave
