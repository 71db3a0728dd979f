// Standalone test of csrc/core (no Python): CRC32C vectors on both paths, the thread pool, the
// shard writer / reader and the row copy. Build: g++ -std=c++17 -O2 -pthread -Icsrc
// csrc/tests/core_test.cc csrc/core/crc32c.cc csrc/core/shard_io.cc csrc/core/thread_pool.cc
// csrc/core/row_copy.cc
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "core/errors.h"
#include "core/row_copy.h"
#include "core/shard_io.h"
#include "core/thread_pool.h"

namespace {

int failures = 0;

#define CHECK(cond)                                                     \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                       \
    }                                                                   \
  } while (0)

template <typename Fn>
bool throws_kind(recsave::ErrorKind kind, Fn fn) {
  try {
    fn();
  } catch (const recsave::Error& e) {
    return e.kind() == kind;
  }
  return false;
}

using CrcFn = uint32_t (*)(uint32_t, const void*, size_t);

void check_vectors(CrcFn crc) {
  // RFC 3720 appendix B.4 and the common check value.
  std::vector<uint8_t> buf(32);
  CHECK(crc(0, buf.data(), 32) == 0x8A9136AAu);
  std::memset(buf.data(), 0xFF, 32);
  CHECK(crc(0, buf.data(), 32) == 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(i);
  CHECK(crc(0, buf.data(), 32) == 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<uint8_t>(31 - i);
  CHECK(crc(0, buf.data(), 32) == 0x113FDB5Cu);
  CHECK(crc(0, "123456789", 9) == 0xE3069283u);
  CHECK(crc(0, "", 0) == 0u);
  // Extending a CRC equals the CRC of the concatenation.
  CHECK(crc(crc(0, "1234", 4), "56789", 5) == 0xE3069283u);
}

// Known CRCs of longer inputs (computed with google-crc32c), long enough for every kernel's main loop.
void check_long_vectors(CrcFn crc) {
  std::vector<uint8_t> buf((1 << 20) + 13);
  CHECK(crc(0, buf.data(), 1 << 20) == 0x14298C12u);  // 1 MiB of zeros
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 31 + 7);
  CHECK(crc(0, buf.data(), buf.size()) == 0x35EE8E1Au);
  std::string digits;
  for (int i = 0; i < 1000; ++i) digits += "123456789";
  CHECK(crc(0, digits.data(), digits.size()) == 0xD601351Du);
}

const recsave::Crc32cKernel kKernels[] = {recsave::Crc32cKernel::kPortable, recsave::Crc32cKernel::kSse42,
                                          recsave::Crc32cKernel::kPclmul, recsave::Crc32cKernel::kVpclmul};
recsave::Crc32cKernel g_kernel;  // the kernel check_vectors() runs through crc_with_kernel
uint32_t crc_with_kernel(uint32_t crc, const void* data, size_t n) {
  return recsave::crc32c_with(g_kernel, crc, data, n);
}

void test_crc() {
  check_vectors(recsave::crc32c_portable);
  check_vectors(recsave::crc32c);
  check_long_vectors(recsave::crc32c_portable);
  check_long_vectors(recsave::crc32c);
  if (recsave::crc32c_hardware_available()) {
    check_vectors(recsave::crc32c_hardware);
    check_long_vectors(recsave::crc32c_hardware);
  }
  std::mt19937_64 rng(7);
  std::vector<uint8_t> big((16 << 20) + 64);
  for (auto& b : big) b = static_cast<uint8_t>(rng());
  for (auto kernel : kKernels) {
    if (!recsave::crc32c_kernel_available(kernel)) {
      std::printf("crc32c: kernel %s not available on this CPU\n", recsave::crc32c_kernel_name(kernel));
      continue;
    }
    g_kernel = kernel;
    check_vectors(crc_with_kernel);
    check_long_vectors(crc_with_kernel);
    if (kernel == recsave::Crc32cKernel::kPortable) continue;
    // Every length 0..4096 at 16 start alignments, against the portable kernel.
    bool all_equal = true;
    for (size_t off = 0; off < 16; ++off) {
      for (size_t len = 0; len <= 4096; ++len) {
        uint32_t seed = static_cast<uint32_t>(len * 2654435761u);
        all_equal = all_equal && recsave::crc32c_with(kernel, seed, big.data() + off, len) ==
                                     recsave::crc32c_portable(seed, big.data() + off, len);
      }
    }
    CHECK(all_equal);
    // Large buffers at odd starts and lengths.
    for (int trial = 0; trial < 4; ++trial) {
      size_t off = rng() % 64, len = (16 << 20) - rng() % 4096;
      CHECK(recsave::crc32c_with(kernel, 0, big.data() + off, len) ==
            recsave::crc32c_portable(0, big.data() + off, len));
    }
  }
  // Extending piece by piece equals the whole, and combining independent pieces does too.
  const size_t whole_len = 3 << 20;
  const uint32_t whole = recsave::crc32c_portable(0, big.data(), whole_len);
  for (int trial = 0; trial < 200; ++trial) {
    size_t cut = trial < 3 ? (trial == 0 ? 0 : trial == 1 ? whole_len : 1) : rng() % (whole_len + 1);
    uint32_t a = recsave::crc32c(0, big.data(), cut);
    uint32_t b = recsave::crc32c(0, big.data() + cut, whole_len - cut);
    CHECK(recsave::crc32c(a, big.data() + cut, whole_len - cut) == whole);
    CHECK(recsave::crc32c_combine(a, b, whole_len - cut) == whole);
  }
  CHECK(recsave::crc32c_combine(0xE3069283u, 0, 0) == 0xE3069283u);
  // Copy and checksum in one pass, through every kernel: every length 0..1100 at mixed alignments,
  // then large copies; the bytes around the destination stay untouched.
  std::vector<uint8_t> dst((4 << 20) + 256);
  for (auto kernel : kKernels) {
    if (!recsave::crc32c_kernel_available(kernel)) continue;
    bool copies_ok = true;
    for (size_t len = 0; len <= 1100; ++len) {
      size_t src_off = len % 7, dst_off = 32 + len % 13 + (len % 3) * 16;
      std::memset(dst.data(), 0xA5, len + 160);
      uint32_t got = recsave::crc32c_copy_with(kernel, 17, dst.data() + dst_off, big.data() + src_off, len);
      copies_ok = copies_ok && got == recsave::crc32c_portable(17, big.data() + src_off, len) &&
                  std::memcmp(dst.data() + dst_off, big.data() + src_off, len) == 0 &&
                  dst[dst_off - 1] == 0xA5 && dst[dst_off + len] == 0xA5;
    }
    for (size_t dst_off : {0, 1, 8, 15, 16, 33, 63, 64}) {
      size_t len = (4 << 20) - dst_off * 3;
      std::memset(dst.data(), 0xA5, dst.size());
      uint32_t got = recsave::crc32c_copy_with(kernel, 0, dst.data() + dst_off, big.data() + 5, len);
      copies_ok = copies_ok && got == recsave::crc32c_portable(0, big.data() + 5, len) &&
                  std::memcmp(dst.data() + dst_off, big.data() + 5, len) == 0 && dst[dst_off + len] == 0xA5 &&
                  (dst_off == 0 || dst[dst_off - 1] == 0xA5);
    }
    if (!copies_ok) std::fprintf(stderr, "crc32c_copy: kernel %s\n", recsave::crc32c_kernel_name(kernel));
    CHECK(copies_ok);
  }
  // crc32c_copy goes through the selected kernel.
  std::memset(dst.data(), 0, dst.size());
  CHECK(recsave::crc32c_copy(3, dst.data() + 7, big.data() + 1, 100000) ==
        recsave::crc32c_portable(3, big.data() + 1, 100000));
  CHECK(std::memcmp(dst.data() + 7, big.data() + 1, 100000) == 0);
  std::printf("crc32c: kernel %s\n", recsave::crc32c_kernel_name(recsave::crc32c_selected_kernel()));
}

void test_thread_pool() {
  recsave::ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, 4, [&](int64_t i) { hits[i]++; });
  bool all_once = true;
  for (auto& h : hits) all_once = all_once && h.load() == 1;
  CHECK(all_once);
  bool rethrown = false;
  try {
    pool.parallel_for(100, 4, [&](int64_t i) {
      if (i == 50) throw std::runtime_error("boom");
    });
  } catch (const std::runtime_error& e) {
    rethrown = std::string(e.what()) == "boom";
  }
  CHECK(rethrown);
  pool.parallel_for(0, 4, [&](int64_t) { CHECK(false); });
}

void test_shard_io(const std::string& dir) {
  std::string path = dir + "/shard.bin";
  std::vector<uint8_t> a(10 << 20), b(12345), c(0);
  std::mt19937_64 rng(1);
  for (auto& x : a) x = static_cast<uint8_t>(rng());
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  std::vector<uint32_t> crcs(3);
  {
    recsave::ShardWriter w(path, true);
    w.reserve(a.size() + b.size());
    recsave::WriteItem items[3] = {{0, a.data(), a.size()}, {a.size(), b.data(), b.size()},
                                   {a.size() + b.size(), c.data(), 0}};
    w.write(items, 3, crcs.data(), 4);
    CHECK(access(path.c_str(), F_OK) != 0);  // not visible before commit
    w.commit();
  }
  CHECK(crcs[0] == recsave::crc32c(0, a.data(), a.size()));
  CHECK(crcs[1] == recsave::crc32c(0, b.data(), b.size()));
  CHECK(crcs[2] == 0u);

  recsave::ShardReader r(path);
  CHECK(r.size() == a.size() + b.size());
  std::vector<uint8_t> ra(a.size()), rb(b.size());
  recsave::ReadItem reads[2] = {{0, ra.data(), ra.size(), crcs[0]}, {a.size(), rb.data(), rb.size(), crcs[1]}};
  r.read(reads, 2, true, 4);
  CHECK(ra == a);
  CHECK(rb == b);

  recsave::ReadItem bad_crc{0, ra.data(), 100, 0xDEADBEEF};
  CHECK(throws_kind(recsave::ErrorKind::kCorrupt, [&] { r.read(&bad_crc, 1, true, 1); }));
  recsave::ReadItem beyond{r.size() - 10, ra.data(), 11, 0};
  CHECK(throws_kind(recsave::ErrorKind::kBounds, [&] { r.read(&beyond, 1, false, 1); }));
  recsave::ReadItem overflow{~0ull - 5, ra.data(), 10, 0};
  CHECK(throws_kind(recsave::ErrorKind::kBounds, [&] { r.read(&overflow, 1, false, 1); }));
  // First 8 bytes of random data as a header length: far beyond the limit.
  CHECK(throws_kind(recsave::ErrorKind::kCorrupt, [&] { r.read_header(1 << 20); }));

  {  // Overlapping writes are refused; an uncommitted writer leaves nothing behind.
    std::string p2 = dir + "/overlap.bin";
    recsave::ShardWriter w(p2, false);
    recsave::WriteItem items[2] = {{0, a.data(), 100}, {50, b.data(), 100}};
    CHECK(throws_kind(recsave::ErrorKind::kInvalid, [&] { w.write(items, 2, crcs.data(), 2); }));
    std::string temp = w.temp_path();
    CHECK(access(temp.c_str(), F_OK) == 0);
    w.abort();
    CHECK(access(temp.c_str(), F_OK) != 0);
    CHECK(access(p2.c_str(), F_OK) != 0);
  }
  CHECK(throws_kind(recsave::ErrorKind::kIo, [&] { recsave::ShardReader missing(dir + "/nope"); }));
}

// Items cut into units across threads: sizes around the 1 MiB unit and the 64 KiB direct-read limit,
// unaligned buffers, corruption inside a long item, a file truncated under an open reader.
void test_shard_units(const std::string& dir) {
  std::string path = dir + "/units.bin";
  const size_t sizes[] = {(1 << 20) + 1, 1 << 20, (64 << 10) + 1, 64 << 10, 5, 0, (3 << 20) - 7, 300000};
  std::mt19937_64 rng(5);
  std::vector<std::vector<uint8_t>> data;
  std::vector<recsave::WriteItem> items;
  uint64_t offset = 0;
  for (size_t len : sizes) {
    data.emplace_back(len + 1);
    for (auto& x : data.back()) x = static_cast<uint8_t>(rng());
    items.push_back({offset, data.back().data() + 1, len});  // sources at odd addresses
    offset += len;
  }
  std::vector<uint32_t> crcs(items.size());
  {
    recsave::ShardWriter w(path, false);
    w.write(items.data(), items.size(), crcs.data(), 3);
    w.commit();
  }
  bool crcs_ok = true;
  for (size_t i = 0; i < items.size(); ++i) crcs_ok = crcs_ok && crcs[i] == recsave::crc32c(0, items[i].src, sizes[i]);
  CHECK(crcs_ok);

  for (bool verify : {true, false}) {
    for (int threads : {1, 2, 5}) {
      std::vector<std::vector<uint8_t>> out;
      std::vector<recsave::ReadItem> reads;
      for (size_t i = 0; i < items.size(); ++i) {
        out.emplace_back(sizes[i] + 3, 0xEE);
        reads.push_back({items[i].offset, out.back().data() + 3, sizes[i], crcs[i]});  // unaligned
      }
      recsave::ShardReader r(path);
      r.read(reads.data(), reads.size(), verify, threads);
      bool same = true;
      for (size_t i = 0; i < items.size(); ++i) {
        same = same && std::memcmp(out[i].data() + 3, items[i].src, sizes[i]) == 0 && out[i][2] == 0xEE;
      }
      CHECK(same);
    }
  }

  // One flipped byte deep inside the (3 MiB - 7)-byte item: found with verify, named by its range.
  const size_t victim = 6;
  {
    FILE* f = std::fopen(path.c_str(), "r+b");
    CHECK(f != nullptr);
    std::fseek(f, static_cast<long>(items[victim].offset + (2 << 20) + 12345), SEEK_SET);
    int c = std::fgetc(f);
    std::fseek(f, static_cast<long>(items[victim].offset + (2 << 20) + 12345), SEEK_SET);
    std::fputc(c ^ 0x40, f);
    std::fclose(f);
  }
  std::vector<uint8_t> buf(sizes[victim]);
  recsave::ReadItem all{items[victim].offset, buf.data(), sizes[victim], crcs[victim]};
  recsave::ReadItem other{items[0].offset, buf.data(), sizes[0], crcs[0]};
  recsave::ReadItem both[2] = {other, all};
  {
    recsave::ShardReader r(path);
    std::string message;
    try {
      r.read(both, 2, true, 4);
    } catch (const recsave::Error& e) {
      message = e.what();
      CHECK(e.kind() == recsave::ErrorKind::kCorrupt);
    }
    CHECK(message.find("CRC32C mismatch") != std::string::npos);
    CHECK(message.find(std::to_string(items[victim].offset)) != std::string::npos);
    r.read(&all, 1, false, 4);  // without verify the bytes are simply delivered
  }
  {  // Truncated after the reader opened it (and checked the size): a short read is kCorrupt.
    recsave::ShardReader r(path);
    CHECK(::truncate(path.c_str(), static_cast<off_t>(items[victim].offset + 1000)) == 0);
    CHECK(throws_kind(recsave::ErrorKind::kCorrupt, [&] { r.read(&all, 1, true, 2); }));
  }
}

// One tensor's checksum segments, short and long (as a save cuts them at bucket boundaries), written
// as items and read back as items into one destination: consecutive segments are written and read
// together, yet every segment keeps its own CRC, and a flipped byte is named by its segment's range.
void test_short_segments(const std::string& dir) {
  const uint64_t seg[] = {70000, 100000, 65537, 300000, 65536, 1, 200000, 1 << 20, 90000, 120000, 0, 150000};
  uint64_t total = 0;
  for (uint64_t len : seg) total += len;
  std::vector<uint8_t> src(total);
  std::mt19937_64 rng(11);
  for (auto& x : src) x = static_cast<uint8_t>(rng());
  const uint64_t header = 13;  // the tensor starts at an odd file offset
  std::vector<recsave::WriteItem> items;
  uint64_t at = 0;
  for (uint64_t len : seg) {
    items.push_back({header + at, src.data() + at, len});
    at += len;
  }
  std::vector<uint32_t> crcs(items.size());
  const std::string path = dir + "/segments.bin";
  {
    recsave::ShardWriter w(path, false);
    const std::vector<uint8_t> head(header, 7);
    recsave::WriteItem head_item{0, head.data(), header};
    uint32_t head_crc = 0;
    w.write(&head_item, 1, &head_crc, 1);
    w.write(items.data(), items.size(), crcs.data(), 3);
    w.commit();
  }
  bool crcs_ok = true;
  for (size_t i = 0; i < items.size(); ++i) crcs_ok = crcs_ok && crcs[i] == recsave::crc32c(0, items[i].src, items[i].length);
  CHECK(crcs_ok);
  std::vector<uint8_t> out(total);
  std::vector<recsave::ReadItem> reads;
  for (size_t i = 0; i < items.size(); ++i) {
    reads.push_back({items[i].offset, out.data() + (items[i].offset - header), items[i].length, crcs[i]});
  }
  for (bool verify : {true, false}) {
    for (int threads : {1, 3}) {
      std::fill(out.begin(), out.end(), 0);
      recsave::ShardReader r(path);
      r.read(reads.data(), reads.size(), verify, threads);
      CHECK(out == src);
    }
  }
  // A flipped byte in the ninth segment (90000 bytes, between two others read with it).
  const uint64_t victim_at = items[8].offset + 4321;
  {
    FILE* f = std::fopen(path.c_str(), "r+b");
    CHECK(f != nullptr);
    std::fseek(f, static_cast<long>(victim_at), SEEK_SET);
    int c = std::fgetc(f);
    std::fseek(f, static_cast<long>(victim_at), SEEK_SET);
    std::fputc(c ^ 0x10, f);
    std::fclose(f);
  }
  recsave::ShardReader r(path);
  std::string message;
  try {
    r.read(reads.data(), reads.size(), true, 2);
  } catch (const recsave::Error& e) {
    message = e.what();
  }
  CHECK(message.find("CRC32C mismatch") != std::string::npos);
  CHECK(message.find(std::to_string(items[8].offset)) != std::string::npos);
  std::vector<recsave::ReadItem> others(reads.begin(), reads.begin() + 8);
  others.insert(others.end(), reads.begin() + 9, reads.end());
  r.read(others.data(), others.size(), true, 2);  // the other segments still verify
}

// Reads into memory nothing has touched (a fresh anonymous mapping, as a new model's tables are):
// the reader populates such units before copying into them. The bytes arrive exactly, at an
// unaligned address and with a tail that ends inside a page, and the bytes around the destination
// stay zero; reading again into the now-populated memory gives the same bytes.
void test_read_into_fresh_memory(const std::string& dir) {
  std::string path = dir + "/fresh.bin";
  const size_t len = (5 << 20) + 12345;
  std::vector<uint8_t> data(len);
  std::mt19937_64 rng(9);
  for (auto& x : data) x = static_cast<uint8_t>(rng());
  uint32_t crc = 0;
  {
    recsave::WriteItem item{0, data.data(), len};
    recsave::ShardWriter w(path, false);
    w.write(&item, 1, &crc, 2);
    w.commit();
  }
  const size_t map_len = len + (1 << 20);
  void* map = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(map != MAP_FAILED);
  if (map == MAP_FAILED) return;
  uint8_t* base = static_cast<uint8_t*>(map);
  uint8_t* dst = base + 4096 * 3 + 5;
  recsave::ShardReader r(path);
  for (int round = 0; round < 2; ++round) {
    recsave::ReadItem item{0, dst, len, crc};
    r.read(&item, 1, true, 3);
    CHECK(std::memcmp(dst, data.data(), len) == 0);
    bool outside_zero = true;
    for (uint8_t* p = base; p < dst; ++p) outside_zero = outside_zero && *p == 0;
    for (uint8_t* p = dst + len; p < base + map_len; ++p) outside_zero = outside_zero && *p == 0;
    CHECK(outside_zero);
  }
  ::munmap(map, map_len);
}

// Rows gathered by the writer threads: the file holds the permuted rows, each item's CRC is that of
// its bytes; rows of several sizes (one byte, around the 256 KiB piece, larger than a 1 MiB unit),
// repeated and empty row lists, runs of consecutive rows short and long (a long run is written from
// the source, the rest copied: both in one write, in file order); an index outside the source is
// refused before anything is written.
void test_write_gathered(const std::string& dir) {
  std::mt19937_64 rng(9);
  struct Matrix {
    uint64_t rows, row_bytes;
    std::vector<uint8_t> data;
    std::vector<int64_t> order;
  };
  std::vector<Matrix> mats = {{1000, 256, {}, {}}, {7, 1, {}, {}}, {5, (256 << 10) + 3, {}, {}},
                              {3, (1 << 20) + 17, {}, {}}, {4, 8, {}, {}}};
  for (auto& m : mats) {
    m.data.resize(m.rows * m.row_bytes);
    for (auto& x : m.data) x = static_cast<uint8_t>(rng());
    for (uint64_t k = 0; k < 2 * m.rows + 1; ++k) m.order.push_back(static_cast<int64_t>(rng() % m.rows));
  }
  mats.back().order.clear();  // an empty row list: an empty item
  // Runs of consecutive rows of every length around the direct-write threshold (4 KiB: 16 rows of
  // 256 bytes, 512 of 8, 1 of 4096), mixed with single rows, and whole tables in row order.
  const std::vector<uint64_t> run_lengths = {1, 2, 15, 16, 17, 40, 600, 1500};
  for (auto [rows, row_bytes] : {std::pair<uint64_t, uint64_t>{3000, 256}, {40000, 8}, {300, 4096}, {5000, 100}}) {
    Matrix m{rows, row_bytes, {}, {}};
    m.data.resize(m.rows * m.row_bytes);
    for (auto& x : m.data) x = static_cast<uint8_t>(rng());
    while (m.order.size() < 3 * rows) {
      const uint64_t len = std::min<uint64_t>(run_lengths[rng() % run_lengths.size()], rows);
      const uint64_t start = rng() % (rows - len + 1);
      for (uint64_t r = 0; r < len; ++r) m.order.push_back(static_cast<int64_t>(start + r));
    }
    mats.insert(mats.begin(), std::move(m));
    Matrix ident{rows, row_bytes, mats.front().data, {}};
    for (uint64_t r = 0; r < rows; ++r) ident.order.push_back(static_cast<int64_t>(r));
    mats.insert(mats.begin(), std::move(ident));
  }
  std::vector<recsave::GatherItem> items;
  std::vector<std::vector<uint8_t>> expected;
  uint64_t offset = 3;  // unaligned file offsets
  for (auto& m : mats) {
    // Two items per matrix: the first row and the rest, as a caller splits rows at segment ends.
    uint64_t cut = std::min<uint64_t>(1, m.order.size());
    for (auto [from, to] : {std::pair<uint64_t, uint64_t>{0, cut}, {cut, m.order.size()}}) {
      items.push_back({offset, m.data.data(), m.rows, m.row_bytes, m.order.data() + from, to - from});
      expected.emplace_back();
      for (uint64_t k = from; k < to; ++k) {
        const uint8_t* row = m.data.data() + m.order[k] * m.row_bytes;
        expected.back().insert(expected.back().end(), row, row + m.row_bytes);
      }
      offset += expected.back().size();
    }
  }
  std::string path = dir + "/gathered.bin";
  std::vector<uint32_t> crcs(items.size());
  {
    recsave::ShardWriter w(path, false);
    w.write_gathered(items.data(), items.size(), crcs.data(), 3);
    CHECK(w.bytes_written() == offset - 3);
    w.commit();
  }
  recsave::ShardReader r(path);
  CHECK(r.size() == offset);
  bool same = true;
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<uint8_t> got(expected[i].size());
    recsave::ReadItem read{items[i].offset, got.data(), got.size(), crcs[i]};
    r.read(&read, 1, true, 2);
    same = same && got == expected[i] &&
           crcs[i] == recsave::crc32c(0, expected[i].data(), expected[i].size());
  }
  CHECK(same);

  const Matrix& m = *std::find_if(mats.begin(), mats.end(), [](const Matrix& x) { return x.rows == 1000; });
  for (int64_t bad : {int64_t{-1}, static_cast<int64_t>(m.rows)}) {
    std::vector<int64_t> order = {0, 1, bad};
    recsave::GatherItem item{0, m.data.data(), m.rows, m.row_bytes, order.data(), order.size()};
    recsave::ShardWriter w(dir + "/bad.bin", false);
    CHECK(throws_kind(recsave::ErrorKind::kInvalid, [&] { w.write_gathered(&item, 1, crcs.data(), 2); }));
    CHECK(w.bytes_written() == 0);
  }
  {  // overlapping gathered items
    recsave::GatherItem two[2] = {{0, m.data.data(), m.rows, m.row_bytes, m.order.data(), 4},
                                  {3 * m.row_bytes, m.data.data(), m.rows, m.row_bytes, m.order.data(), 4}};
    recsave::ShardWriter w(dir + "/overlap-gather.bin", false);
    CHECK(throws_kind(recsave::ErrorKind::kInvalid, [&] { w.write_gathered(two, 2, crcs.data(), 2); }));
  }
}

// copy_rows: exactly the rows given (runs and single rows, across task boundaries), on 1 and 3
// threads; a row outside either buffer copies nothing.
void test_copy_rows() {
  constexpr uint64_t kRows = 20000, kRowBytes = 24;
  std::vector<uint8_t> src(kRows * kRowBytes);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  std::mt19937_64 rng(5);
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < static_cast<int64_t>(kRows); r += 1 + static_cast<int64_t>(rng() % 5)) rows.push_back(r);
  for (int threads : {1, 3}) {
    std::vector<uint8_t> dst(src.size(), 0);
    CHECK(recsave::copy_rows(dst.data(), src.data(), kRows, kRowBytes, rows.data(),
                             static_cast<int64_t>(rows.size()), threads));
    std::vector<uint8_t> expect(src.size(), 0);
    for (int64_t r : rows) std::memcpy(&expect[r * kRowBytes], &src[r * kRowBytes], kRowBytes);
    CHECK(dst == expect);
  }
  std::vector<uint8_t> dst(src.size(), 0);
  const int64_t bad[] = {3, static_cast<int64_t>(kRows)};
  CHECK(!recsave::copy_rows(dst.data(), src.data(), kRows, kRowBytes, bad, 2, 2));
  const int64_t negative[] = {-1};
  CHECK(!recsave::copy_rows(dst.data(), src.data(), kRows, kRowBytes, negative, 1, 2));
  CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0; }));
}

}  // namespace

int main() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/recsave-core-test-XXXXXX";
  const char* dir = mkdtemp(tmpl.data());
  if (!dir) return 2;
  test_crc();
  test_thread_pool();
  test_shard_io(dir);
  test_shard_units(dir);
  test_short_segments(dir);
  test_read_into_fresh_memory(dir);
  test_write_gathered(dir);
  test_copy_rows();
  std::string cleanup = std::string("rm -rf ") + dir;
  if (std::system(cleanup.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir);
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("core_test: all checks passed\n");
  return 0;
}
