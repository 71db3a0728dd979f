// Standalone tests and a throughput benchmark for recsave::IdMap.
//
//   g++ -std=c++17 -O2 -pthread -Icsrc csrc/tests/id_map_test.cc csrc/core/id_map.cc -o id_map_test
//   ./id_map_test            # tests + benchmark (prints ids/s; never fails on time)
//   ./id_map_test --no-bench # tests only
//
// RECSAVE_IDMAP_TEST_SMALL=1 shrinks the tests and skips the benchmark (sanitizer builds).
//
// Exits non-zero after printing every failed check.
#include "core/id_map.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

int g_failures = 0;
bool g_small = false;  // RECSAVE_IDMAP_TEST_SMALL: smaller tables, fewer rounds

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      ++g_failures;                                                          \
      if (g_failures <= 50) {                                                \
        std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      }                                                                      \
    }                                                                        \
  } while (0)

#define CHECK_EQ(a, b)                                                                     \
  do {                                                                                     \
    const auto va = (a);                                                                   \
    const auto vb = (b);                                                                   \
    if (!(va == vb)) {                                                                     \
      ++g_failures;                                                                        \
      if (g_failures <= 50) {                                                              \
        std::fprintf(stderr, "FAILED %s:%d: %s == %s (%lld vs %lld)\n", __FILE__, __LINE__, \
                     #a, #b, static_cast<long long>(va), static_cast<long long>(vb));      \
      }                                                                                    \
    }                                                                                      \
  } while (0)

// Expects `stmt` to throw E whose message contains `needle`.
#define CHECK_THROWS(E, needle, stmt)                                                    \
  do {                                                                                   \
    bool thrown = false;                                                                 \
    try {                                                                                \
      stmt;                                                                              \
    } catch (const E& e) {                                                               \
      thrown = true;                                                                     \
      if (std::string(e.what()).find(needle) == std::string::npos) {                     \
        ++g_failures;                                                                    \
        std::fprintf(stderr, "FAILED %s:%d: message '%s' lacks '%s'\n", __FILE__,         \
                     __LINE__, e.what(), needle);                                        \
      }                                                                                  \
    } catch (...) {                                                                      \
    }                                                                                    \
    if (!thrown) {                                                                       \
      ++g_failures;                                                                      \
      std::fprintf(stderr, "FAILED %s:%d: %s did not throw %s\n", __FILE__, __LINE__,    \
                   #stmt, #E);                                                           \
    }                                                                                    \
  } while (0)

using recsave::IdMap;
using Vec = std::vector<int64_t>;

constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// Reference model: the documented semantics, written the obvious way.
struct Oracle {
  std::unordered_map<int64_t, int64_t> map;
  std::set<int64_t> free_rows;
  int64_t row_capacity = 0;

  int64_t lookup_or_insert(const Vec& ids, Vec* rows, std::vector<uint8_t>* is_new) {
    rows->assign(ids.size(), -1);
    is_new->assign(ids.size(), 0);
    int64_t num_new = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = map.find(ids[i]);
      if (it != map.end()) {
        (*rows)[i] = it->second;
        continue;
      }
      int64_t row;
      if (!free_rows.empty()) {
        row = *free_rows.begin();
        free_rows.erase(free_rows.begin());
      } else {
        row = row_capacity++;
      }
      map[ids[i]] = row;
      (*rows)[i] = row;
      (*is_new)[i] = 1;
      ++num_new;
    }
    return num_new;
  }
  int64_t erase(const Vec& ids, Vec* rows) {
    rows->assign(ids.size(), -1);
    int64_t removed = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = map.find(ids[i]);
      if (it == map.end()) continue;
      (*rows)[i] = it->second;
      free_rows.insert(it->second);
      map.erase(it);
      ++removed;
    }
    return removed;
  }
  Vec lookup(const Vec& ids) const {
    Vec out(ids.size(), -1);
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = map.find(ids[i]);
      if (it != map.end()) out[i] = it->second;
    }
    return out;
  }
};

struct Items {
  Vec ids, rows;
  bool operator==(const Items& o) const { return ids == o.ids && rows == o.rows; }
};

Items export_all(const IdMap& m) {
  Items it;
  it.ids.resize(static_cast<size_t>(m.size()));
  it.rows.resize(static_cast<size_t>(m.size()));
  m.export_items(it.ids.data(), it.rows.data());
  return it;
}

// The export must be exactly the oracle's contents sorted by row.
void check_against_oracle(const IdMap& m, const Oracle& o) {
  CHECK_EQ(m.size(), static_cast<int64_t>(o.map.size()));
  CHECK_EQ(m.row_capacity(), o.row_capacity);
  CHECK_EQ(m.free_rows(), static_cast<int64_t>(o.free_rows.size()));
  CHECK_EQ(m.size() + m.free_rows(), m.row_capacity());
  std::vector<std::pair<int64_t, int64_t>> expect;
  for (const auto& kv : o.map) expect.emplace_back(kv.second, kv.first);
  std::sort(expect.begin(), expect.end());
  Items got = export_all(m);
  bool same = got.ids.size() == expect.size();
  for (size_t i = 0; same && i < expect.size(); ++i) {
    same = got.rows[i] == expect[i].first && got.ids[i] == expect[i].second;
  }
  CHECK(same);
}

uint64_t mix64(uint64_t x) {
  uint64_t z = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t inverse_odd(uint64_t a) {  // a * inverse_odd(a) == 1 mod 2^64
  uint64_t x = a;
  for (int i = 0; i < 6; ++i) x *= 2 - a * x;
  return x;
}

uint64_t unxorshift(uint64_t y, int s) {
  uint64_t x = y;
  for (int i = 0; i < 64 / s + 1; ++i) x = y ^ (x >> s);
  return x;
}

uint64_t mix64_inverse(uint64_t z) {
  z = unxorshift(z, 31);
  z *= inverse_odd(0x94d049bb133111ebULL);
  z = unxorshift(z, 27);
  z *= inverse_odd(0xbf58476d1ce4e5b9ULL);
  return unxorshift(z, 30);
}

// ---------------------------------------------------------------------------------------------

void test_basic_and_extremes() {
  IdMap m;
  CHECK_EQ(m.size(), 0);
  CHECK_EQ(m.row_capacity(), 0);
  Vec ids = {0, -1, kMin, kMax, 1, kMin + 1, kMax - 1, 0, -1, kMin};
  Vec rows(ids.size());
  std::vector<uint8_t> is_new(ids.size());
  CHECK_EQ(m.lookup_or_insert(ids.data(), 10, rows.data(), is_new.data()), 7);
  Vec expect_rows = {0, 1, 2, 3, 4, 5, 6, 0, 1, 2};
  std::vector<uint8_t> expect_new = {1, 1, 1, 1, 1, 1, 1, 0, 0, 0};
  CHECK(rows == expect_rows);
  CHECK(is_new == expect_new);
  CHECK_EQ(m.size(), 7);
  CHECK_EQ(m.row_capacity(), 7);

  Vec probe = {kMax, kMin, 2, -1, 0, -2};
  Vec out(probe.size());
  m.lookup(probe.data(), 6, out.data());
  CHECK((out == Vec{3, 2, -1, 1, 0, -1}));

  // Erase with a duplicate in the batch: only the first occurrence removes.
  Vec er = {-1, 12345, -1, kMin};
  Vec freed(er.size());
  CHECK_EQ(m.erase(er.data(), 4, freed.data()), 2);
  CHECK((freed == Vec{1, -1, -1, 2}));
  CHECK_EQ(m.size(), 5);
  CHECK_EQ(m.row_capacity(), 7);
  m.lookup(probe.data(), 6, out.data());
  CHECK((out == Vec{3, -1, -1, -1, 0, -1}));
  CHECK_EQ(m.erase(er.data(), 4, nullptr), 0);

  // Empty batches and null pointers with n == 0 are no-ops.
  m.lookup(nullptr, 0, nullptr);
  CHECK_EQ(m.lookup_or_insert(nullptr, 0, nullptr, nullptr, 4), 0);
  CHECK_EQ(m.erase(nullptr, 0, nullptr), 0);
  m.insert_with_rows(nullptr, nullptr, 0);
  CHECK_EQ(m.size(), 5);

  CHECK_THROWS(std::invalid_argument, "n must be >= 0", m.lookup(ids.data(), -1, rows.data()));
  CHECK_THROWS(std::invalid_argument, "n must be >= 0",
               m.lookup_or_insert(ids.data(), -3, rows.data(), nullptr));
  CHECK_THROWS(std::invalid_argument, "n must be >= 0", m.erase(ids.data(), -1, nullptr));
  CHECK_THROWS(std::invalid_argument, "n must be >= 0",
               m.insert_with_rows(ids.data(), rows.data(), -1));
  CHECK_THROWS(std::invalid_argument, "null", m.lookup(nullptr, 3, rows.data()));
  CHECK_THROWS(std::invalid_argument, "null", m.lookup(ids.data(), 3, nullptr));
  CHECK_THROWS(std::invalid_argument, "threads", m.lookup(ids.data(), 3, rows.data(), 0));
  CHECK_THROWS(std::invalid_argument, "reserve", m.reserve(-5));
  CHECK_THROWS(std::invalid_argument, "initial_capacity", IdMap bad(-1));
  CHECK_EQ(m.size(), 5);

  m.clear();
  CHECK_EQ(m.size(), 0);
  CHECK_EQ(m.row_capacity(), 0);
  CHECK_EQ(m.free_rows(), 0);
  m.lookup(probe.data(), 6, out.data());
  CHECK((out == Vec{-1, -1, -1, -1, -1, -1}));
  CHECK_EQ(m.lookup_or_insert(probe.data(), 1, rows.data(), nullptr), 1);
  CHECK_EQ(rows[0], 0);  // rows restart at 0 after clear
}

void test_free_list_order() {
  IdMap m;
  Vec ids(10), rows(10);
  for (int i = 0; i < 10; ++i) ids[static_cast<size_t>(i)] = 100 + i;
  m.lookup_or_insert(ids.data(), 10, rows.data(), nullptr);
  Vec er = {107, 102, 105};
  m.erase(er.data(), 3, nullptr);
  CHECK_EQ(m.row_capacity(), 10);
  Vec fresh = {1, 2, 1, 3, 4}, got(5);
  std::vector<uint8_t> is_new(5);
  CHECK_EQ(m.lookup_or_insert(fresh.data(), 5, got.data(), is_new.data()), 4);
  CHECK((got == Vec{2, 5, 2, 7, 10}));  // lowest freed row first, then row_capacity
  CHECK((is_new == std::vector<uint8_t>{1, 1, 0, 1, 1}));
  CHECK_EQ(m.row_capacity(), 11);
  CHECK_EQ(m.free_rows(), 0);
}

// Random batches against the oracle: extreme ids, duplicates, mixed threads, growth and shrink.
void test_random_against_oracle() {
  std::mt19937_64 rng(12345);
  IdMap m;
  Oracle o;
  const Vec extremes = {0, -1, 1, kMin, kMax, kMin + 1, kMax - 1};
  const int rounds = g_small ? 100 : 400;
  for (int round = 0; round < rounds; ++round) {
    // Batch size mostly small, sometimes big enough for the multi-threaded path.
    const size_t n = (round % 50 == 49) ? 150000 : rng() % 3000;
    // A narrow pool makes many duplicates, hits and erase/reinsert churn; a wide one grows.
    const uint64_t pool = (round / (rounds / 4)) % 2 == 0 ? 5000 : (uint64_t{1} << 40);
    Vec ids(n);
    for (auto& id : ids) {
      const uint64_t r = rng();
      if (r % 50 == 0) {
        id = extremes[r % extremes.size()];
      } else {
        id = static_cast<int64_t>(mix64(rng() % pool)) ^ 0x5555;  // spread over int64
      }
    }
    const int threads = 1 << (round % 3);
    Vec rows(n), expect_rows;
    std::vector<uint8_t> is_new(n), expect_new;
    const int64_t num_new = m.lookup_or_insert(ids.data(), static_cast<int64_t>(n), rows.data(),
                                               is_new.data(), threads);
    CHECK_EQ(num_new, o.lookup_or_insert(ids, &expect_rows, &expect_new));
    CHECK(rows == expect_rows);
    CHECK(is_new == expect_new);

    // Erase a random subset (some absent ids, some duplicated).
    Vec er(rng() % (n / 2 + 1));
    for (auto& id : er) id = (rng() % 4 == 0) ? static_cast<int64_t>(rng()) : ids[rng() % n];
    Vec freed(er.size()), expect_freed;
    CHECK_EQ(m.erase(er.data(), static_cast<int64_t>(er.size()), freed.data()),
             o.erase(er, &expect_freed));
    CHECK(freed == expect_freed);

    Vec probe(ids);
    probe.insert(probe.end(), er.begin(), er.end());
    Vec got(probe.size());
    m.lookup(probe.data(), static_cast<int64_t>(probe.size()), got.data(), threads);
    CHECK(got == o.lookup(probe));
    if (round % 20 == 0) check_against_oracle(m, o);
  }
  check_against_oracle(m, o);
  const IdMap::Stats st = m.stats();
  CHECK(st.size * 8 <= st.capacity * 5);
}

// Same operations with threads = 1, 2, 4 give identical results and tables.
void test_determinism() {
  std::mt19937_64 rng(7);
  IdMap maps[3];
  for (int round = 0; round < (g_small ? 2 : 6); ++round) {
    Vec ids(300000);
    for (auto& id : ids) id = static_cast<int64_t>(rng() % 400000) * 7919 - 1000000;
    Vec er(50000);
    for (auto& id : er) id = ids[rng() % ids.size()];
    Vec ref_rows, ref_freed;
    std::vector<uint8_t> ref_new;
    for (int k = 0; k < 3; ++k) {
      Vec rows(ids.size()), freed(er.size());
      std::vector<uint8_t> is_new(ids.size());
      maps[k].lookup_or_insert(ids.data(), static_cast<int64_t>(ids.size()), rows.data(),
                               is_new.data(), 1 << k);
      maps[k].erase(er.data(), static_cast<int64_t>(er.size()), freed.data());
      if (k == 0) {
        ref_rows = rows;
        ref_new = is_new;
        ref_freed = freed;
      } else {
        CHECK(rows == ref_rows);
        CHECK(is_new == ref_new);
        CHECK(freed == ref_freed);
      }
    }
  }
  CHECK(export_all(maps[0]) == export_all(maps[1]));
  CHECK(export_all(maps[0]) == export_all(maps[2]));
}

void test_growth_and_reserve() {
  IdMap m(0);
  const int64_t n = g_small ? 200000 : 1500000;
  Vec ids(static_cast<size_t>(n)), rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = i * 1000003 - (n / 2);
  // Insert in chunks so that the table grows many times, between batches and inside them.
  for (int64_t b = 0; b < n; b += 100000) {
    const int64_t e = std::min(n, b + 100000);
    CHECK_EQ(m.lookup_or_insert(ids.data() + b, e - b, rows.data() + b, nullptr), e - b);
  }
  CHECK_EQ(m.size(), n);
  Vec got(static_cast<size_t>(n));
  m.lookup(ids.data(), n, got.data(), 2);
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok = ok && got[static_cast<size_t>(i)] == i;
  CHECK(ok);
  const IdMap::Stats st = m.stats();
  CHECK((st.capacity & (st.capacity - 1)) == 0);
  CHECK(st.size * 8 <= st.capacity * 5);

  IdMap r;
  const int64_t rn = n * 2 / 3;
  r.reserve(rn);
  const int64_t cap = r.capacity();
  CHECK(cap * 5 / 8 >= rn);
  CHECK(cap <= 2 * rn * 8 / 5 + 16);
  r.lookup_or_insert(ids.data(), rn, rows.data(), nullptr);
  CHECK_EQ(r.capacity(), cap);  // no rehash
  r.reserve(10);                // never shrinks
  CHECK_EQ(r.capacity(), cap);
  IdMap pre(5000);
  CHECK(pre.capacity() * 5 / 8 >= 5000);
}

void test_insert_with_rows() {
  IdMap m;
  Vec ids = {10, 20, 30}, rows = {0, 3, 5};
  m.insert_with_rows(ids.data(), rows.data(), 3);
  CHECK_EQ(m.size(), 3);
  CHECK_EQ(m.row_capacity(), 6);
  CHECK_EQ(m.free_rows(), 3);
  Items it = export_all(m);
  CHECK((it.ids == Vec{10, 20, 30}) && (it.rows == Vec{0, 3, 5}));
  const Items before = it;

  // Every failure names the culprit and leaves the map unchanged.
  Vec bad_ids = {40, 41, 40}, bad_rows = {1, 2, 4};
  CHECK_THROWS(std::invalid_argument, "id 40 (index 2) appears more than once",
               m.insert_with_rows(bad_ids.data(), bad_rows.data(), 3));
  bad_ids = {40, 20};
  bad_rows = {1, 2};
  CHECK_THROWS(std::invalid_argument, "id 20 (index 1) is already in the map",
               m.insert_with_rows(bad_ids.data(), bad_rows.data(), 2));
  bad_ids = {40, 41};
  bad_rows = {1, -7};
  CHECK_THROWS(std::invalid_argument, "row -7 of id 41",
               m.insert_with_rows(bad_ids.data(), bad_rows.data(), 2));
  bad_rows = {9, 9};
  CHECK_THROWS(std::invalid_argument, "row 9 of id 41 (index 1) appears more than once",
               m.insert_with_rows(bad_ids.data(), bad_rows.data(), 2));
  bad_rows = {1, 3};
  CHECK_THROWS(std::invalid_argument, "row 3 of id 41 (index 1) is already used",
               m.insert_with_rows(bad_ids.data(), bad_rows.data(), 2));
  bad_rows = {1, IdMap::kMaxRow + 1};
  CHECK_THROWS(std::invalid_argument, "exceeds the maximum row",
               m.insert_with_rows(bad_ids.data(), bad_rows.data(), 2));
  CHECK(export_all(m) == before);
  CHECK_EQ(m.row_capacity(), 6);
  CHECK_EQ(m.free_rows(), 3);

  // Loading into freed rows takes them off the free list; rows above extend row_capacity.
  Vec more_ids = {50, 60}, more_rows = {2, 8};
  m.insert_with_rows(more_ids.data(), more_rows.data(), 2, 4);
  CHECK_EQ(m.row_capacity(), 9);
  CHECK_EQ(m.free_rows(), 9 - 5);  // 1, 4, 6, 7
  Vec fresh = {1, 2, 3, 4, 5}, got(5);
  m.lookup_or_insert(fresh.data(), 5, got.data(), nullptr);
  CHECK((got == Vec{1, 4, 6, 7, 9}));

  // A big restore with holes (multi-threaded presence check), then lookups.
  IdMap big;
  const int64_t n = 200000;
  Vec bids(static_cast<size_t>(n)), brows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    bids[static_cast<size_t>(i)] = kMax - i * 3;
    brows[static_cast<size_t>(i)] = (n - 1 - i) * 2;  // even rows only, reversed
  }
  big.insert_with_rows(bids.data(), brows.data(), n, 4);
  CHECK_EQ(big.row_capacity(), 2 * n - 1);
  CHECK_EQ(big.free_rows(), n - 1);
  Vec bgot(static_cast<size_t>(n));
  big.lookup(bids.data(), n, bgot.data(), 2);
  CHECK(bgot == brows);
  Items bit = export_all(big);
  bool sorted = true;
  for (int64_t i = 0; i < n; ++i) {
    sorted = sorted && bit.rows[static_cast<size_t>(i)] == 2 * i &&
             bit.ids[static_cast<size_t>(i)] == kMax - (n - 1 - i) * 3;
  }
  CHECK(sorted);
  // A present id at the end of a large batch is found by the parallel check.
  Vec bad2(bids.begin(), bids.begin() + 100000);
  for (auto& id : bad2) id -= 1;  // fresh ids ...
  bad2.back() = bids[5];          // ... except the last
  Vec bad2_rows(bad2.size());
  for (size_t i = 0; i < bad2.size(); ++i) bad2_rows[i] = 4 * n + static_cast<int64_t>(i);
  CHECK_THROWS(std::invalid_argument, "(index 99999) is already in the map",
               big.insert_with_rows(bad2.data(), bad2_rows.data(), 100000, 4));
  CHECK(export_all(big) == bit);
  // Same batch with a late intra-batch duplicate instead: inserts are rolled back.
  bad2.back() = bad2[0];
  CHECK_THROWS(std::invalid_argument, "(index 99999) appears more than once",
               big.insert_with_rows(bad2.data(), bad2_rows.data(), 100000, 4));
  CHECK(export_all(big) == bit);
  CHECK_EQ(big.row_capacity(), 2 * n - 1);
}

// Inverse of the map's murmur3 fmix64 slot hash: the id whose slot hash is `h`.
int64_t id_with_slot_hash(uint64_t h) {
  h = unxorshift(h, 33);
  h *= inverse_odd(0xc4ceb9fe1a85ec53ULL);
  h = unxorshift(h, 33);
  h *= inverse_odd(0xff51afd7ed558ccdULL);
  return static_cast<int64_t>(unxorshift(h, 33));
}

// load_distinct (a restore) inserts on several threads, each into its own range of slots. It must
// give ids[i] row i, including for ids whose probe runs past a range's end or wraps around the
// array, and refuse repeated ids leaving the map empty.
void test_load_distinct() {
  std::mt19937_64 rng(5);
  const int64_t n = 300000;  // >= 8 * 32768: up to 8 parts
  const int64_t capacity = [&] {
    IdMap probe;
    probe.reserve(n);
    return probe.capacity();
  }();
  const int shift = 64 - (63 - __builtin_clzll(static_cast<uint64_t>(capacity)));
  // 12 ids homed in the last 4 slots before every range boundary of 2, 3, 4 and 8 parts (and the
  // array's end): their probes must leave their range.
  Vec crowded;
  for (int64_t parts : {2, 3, 4, 8}) {
    for (int64_t k = 1; k <= parts; ++k) {
      const int64_t boundary = k == parts ? capacity : capacity / parts * k;
      for (int j = 0; j < 12; ++j) {
        const uint64_t home = static_cast<uint64_t>(boundary - 1 - j % 4);
        crowded.push_back(id_with_slot_hash((home << shift) | (rng() >> (64 - shift))));
      }
    }
  }
  Vec distinct(static_cast<size_t>(n));
  for (auto& id : distinct) id = static_cast<int64_t>(rng());
  std::shuffle(crowded.begin(), crowded.end(), rng);
  std::copy(crowded.begin(), crowded.end(), distinct.begin() + n / 3);
  Vec repeated = distinct;
  repeated[static_cast<size_t>(n - 1)] = crowded[7];  // a repeat among the overflowing ids
  Vec repeated_early = distinct;
  repeated_early[static_cast<size_t>(n / 2)] = distinct[5];
  Vec iota(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) iota[static_cast<size_t>(i)] = i;

  for (int threads : {1, 2, 3, 4, 8}) {
    IdMap m;
    CHECK(m.load_distinct(distinct.data(), n, threads));
    CHECK_EQ(m.size(), n);
    CHECK_EQ(m.row_capacity(), n);
    CHECK_EQ(m.free_rows(), int64_t{0});
    Vec got(static_cast<size_t>(n));
    m.lookup(distinct.data(), n, got.data(), threads);
    CHECK(got == iota);
    Items items = export_all(m);
    CHECK(items.ids == distinct && items.rows == iota);
    const int64_t extra = static_cast<int64_t>(rng());  // the map goes on as usual
    int64_t row = -1;
    m.lookup_or_insert(&extra, 1, &row, nullptr, threads);
    CHECK_EQ(row, n);
    CHECK_THROWS(std::invalid_argument, "not empty", m.load_distinct(distinct.data(), 1, threads));

    for (const Vec* bad : {&repeated, &repeated_early}) {
      IdMap r;
      CHECK(!r.load_distinct(bad->data(), n, threads));
      CHECK_EQ(r.size(), int64_t{0});
      CHECK_EQ(r.row_capacity(), int64_t{0});
      r.lookup(distinct.data(), n, got.data(), threads);
      CHECK(std::all_of(got.begin(), got.end(), [](int64_t v) { return v == -1; }));
      CHECK(r.load_distinct(distinct.data(), n, threads));  // usable again
    }
  }
  IdMap empty;
  CHECK(empty.load_distinct(nullptr, 0, 4));
  CHECK_THROWS(std::invalid_argument, "threads", empty.load_distinct(distinct.data(), 1, 0));
}

// Ids that all share one `mix64(id) % 4096` bucket (what one rank of a 4096-bucket job sees),
// plus structured ids, must still spread over the slots.
void test_hash_quality() {
  std::mt19937_64 rng(99);
  const int64_t n = g_small ? (1 << 16) : (1 << 20);
  Vec rank_ids(static_cast<size_t>(n)), seq_ids(static_cast<size_t>(n)),
      shifted(static_cast<size_t>(n)), rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    rank_ids[static_cast<size_t>(i)] =
        static_cast<int64_t>(mix64_inverse((rng() << 12) | 123));
    seq_ids[static_cast<size_t>(i)] = i;
    shifted[static_cast<size_t>(i)] = static_cast<int64_t>(static_cast<uint64_t>(i) << 32);
  }
  CHECK_EQ(static_cast<int64_t>(mix64(static_cast<uint64_t>(rank_ids[0])) % 4096), 123);
  for (const Vec* v : {&rank_ids, &seq_ids, &shifted}) {
    IdMap m;
    m.lookup_or_insert(v->data(), n, rows.data(), nullptr);
    const IdMap::Stats st = m.stats();
    std::printf("  hash quality: %lld ids in %lld slots, mean probe %.3f, max probe %lld\n",
                static_cast<long long>(st.size), static_cast<long long>(st.capacity),
                st.mean_probe, static_cast<long long>(st.max_probe));
    CHECK(st.mean_probe < 1.6);  // theory at load 0.5: 1.5
    CHECK(st.max_probe < 80);
  }
}

// ---------------------------------------------------------------------------------------------

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void bench() {
  const int64_t n = 4 << 20;  // 4M ids
  std::mt19937_64 rng(1);
  Vec ids(static_cast<size_t>(n)), rows(static_cast<size_t>(n));
  std::vector<uint8_t> is_new(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int64_t>(rng());
  // Query batch: 4M ids drawn at random from the table (random order, all hits).
  Vec query(static_cast<size_t>(n)), qidx(static_cast<size_t>(n)), miss(static_cast<size_t>(n)),
      out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    qidx[static_cast<size_t>(i)] = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
    query[static_cast<size_t>(i)] = ids[static_cast<size_t>(qidx[static_cast<size_t>(i)])];
  }
  for (auto& q : miss) q = static_cast<int64_t>(rng());
  auto report = [n](const char* what, double s) {
    std::printf("  %-46s %8.1f M ids/s\n", what, static_cast<double>(n) / s / 1e6);
  };
  std::printf("benchmark: 4M random int64 ids (%u hardware threads)\n",
              std::thread::hardware_concurrency());
  {
    IdMap m;
    auto t0 = std::chrono::steady_clock::now();
    m.lookup_or_insert(ids.data(), n, rows.data(), is_new.data());
    report("lookup_or_insert, 4M new ids, from empty", seconds_since(t0));
  }
  for (int threads : {1, 2, 4}) {
    IdMap m;
    m.reserve(n);  // as a restore does before reading
    auto t0 = std::chrono::steady_clock::now();
    CHECK(m.load_distinct(ids.data(), n, threads));
    std::string label = "load_distinct (restore), 4M ids, reserved, threads=" + std::to_string(threads);
    report(label.c_str(), seconds_since(t0));
  }
  IdMap m;
  m.reserve(n);
  auto t0 = std::chrono::steady_clock::now();
  m.lookup_or_insert(ids.data(), n, rows.data(), is_new.data());
  report("lookup_or_insert, 4M new ids, reserved", seconds_since(t0));
  const IdMap::Stats st = m.stats();
  std::printf("  table: %lld slots (load %.2f), mean probe %.3f\n",
              static_cast<long long>(st.capacity),
              static_cast<double>(st.size) / static_cast<double>(st.capacity), st.mean_probe);
  for (int threads : {1, 2}) {
    double best = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      t0 = std::chrono::steady_clock::now();
      m.lookup(query.data(), n, out.data(), threads);
      best = std::min(best, seconds_since(t0));
    }
    std::string label = "lookup, all hits, threads=" + std::to_string(threads);
    report(label.c_str(), best);
    best = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      t0 = std::chrono::steady_clock::now();
      m.lookup(miss.data(), n, out.data(), threads);
      best = std::min(best, seconds_since(t0));
    }
    label = "lookup, all misses, threads=" + std::to_string(threads);
    report(label.c_str(), best);
    best = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      t0 = std::chrono::steady_clock::now();
      m.lookup_or_insert(query.data(), n, out.data(), is_new.data(), threads);
      best = std::min(best, seconds_since(t0));
    }
    label = "lookup_or_insert, all hits, threads=" + std::to_string(threads);
    report(label.c_str(), best);
  }
  // The timed calls computed the right thing.
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) {
    ok = ok && out[static_cast<size_t>(i)] == rows[static_cast<size_t>(qidx[static_cast<size_t>(i)])];
  }
  CHECK(ok);
  Vec ex_ids(static_cast<size_t>(n)), ex_rows(static_cast<size_t>(n));
  for (int threads : {1, 2}) {
    double best = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      t0 = std::chrono::steady_clock::now();
      m.export_items(ex_ids.data(), ex_rows.data(), threads);
      best = std::min(best, seconds_since(t0));
    }
    std::string label = "export_items, threads=" + std::to_string(threads);
    report(label.c_str(), best);
  }
  for (int threads : {1, 2}) {
    IdMap restored;
    t0 = std::chrono::steady_clock::now();
    restored.insert_with_rows(ex_ids.data(), ex_rows.data(), n, threads);
    std::string label = "insert_with_rows into empty, threads=" + std::to_string(threads);
    report(label.c_str(), seconds_since(t0));
    CHECK_EQ(restored.size(), n);
  }
  t0 = std::chrono::steady_clock::now();
  m.erase(query.data(), n, nullptr);
  report("erase, 4M ids (~2.5M distinct present)", seconds_since(t0));
}

}  // namespace

int main(int argc, char** argv) {
  const char* small = std::getenv("RECSAVE_IDMAP_TEST_SMALL");
  g_small = small != nullptr && small[0] != '\0' && std::strcmp(small, "0") != 0;
  bool run_bench = !g_small;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-bench") == 0) run_bench = false;
  }
  test_basic_and_extremes();
  test_free_list_order();
  test_random_against_oracle();
  test_determinism();
  test_growth_and_reserve();
  test_insert_with_rows();
  test_load_distinct();
  test_hash_quality();
  if (g_failures > 0) {
    std::fprintf(stderr, "id_map_test: %d check(s) FAILED\n", g_failures);
    return 1;
  }
  std::printf("id_map_test: all checks passed\n");
  if (run_bench) {
    bench();
    if (g_failures > 0) return 1;
  }
  return 0;
}
