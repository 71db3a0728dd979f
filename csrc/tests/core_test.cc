// Standalone test of csrc/core (no Python): CRC32C vectors on both paths, the thread pool, and the
// shard writer / reader. Build: g++ -std=c++17 -O2 -pthread -Icsrc csrc/tests/core_test.cc
// csrc/core/crc32c.cc csrc/core/shard_io.cc csrc/core/thread_pool.cc
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "core/errors.h"
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

void test_crc() {
  check_vectors(recsave::crc32c_portable);
  check_vectors(recsave::crc32c);
  if (recsave::crc32c_hardware_available()) {
    check_vectors(recsave::crc32c_hardware);
    // The interleaved paths (>= 3*256 and >= 3*8192 bytes) at every alignment and many lengths.
    std::mt19937_64 rng(7);
    std::vector<uint8_t> big(200000);
    for (auto& b : big) b = static_cast<uint8_t>(rng());
    const size_t lengths[] = {0, 1, 7, 8, 767, 768, 769, 24575, 24576, 24577, 50000, 199990};
    for (size_t off = 0; off < 8; ++off) {
      for (size_t len : lengths) {
        CHECK(recsave::crc32c_hardware(0, big.data() + off, len) ==
              recsave::crc32c_portable(0, big.data() + off, len));
      }
    }
  }
  std::printf("crc32c: implementation %s\n", recsave::crc32c_implementation());
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

}  // namespace

int main() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/recsave-core-test-XXXXXX";
  const char* dir = mkdtemp(tmpl.data());
  if (!dir) return 2;
  test_crc();
  test_thread_pool();
  test_shard_io(dir);
  std::string cleanup = std::string("rm -rf ") + dir;
  if (std::system(cleanup.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir);
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("core_test: all checks passed\n");
  return 0;
}
