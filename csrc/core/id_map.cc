// recsave: CPU id map. See id_map.h for the contract.
#include "core/id_map.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace recsave {
namespace {

constexpr uint64_t kMinCapacity = 16;
constexpr uint64_t kMaxCapacity = uint64_t{1} << 56;  // slots; 1 EiB of memory, never reached
constexpr int64_t kMinIdsPerThread = 32768;           // smaller batches run inline
constexpr int kMaxThreads = 256;
constexpr int kPrefetch = 16;                          // ids hashed and prefetched ahead
constexpr size_t kHugePage = size_t{2} << 20;

// murmur3 fmix64. Independent of the splitmix64 finaliser used for rank routing, so ids that
// share `mix64(id) % 4096` still spread over all slots. The home slot is the high bits.
inline uint64_t slot_hash(int64_t key) {
  uint64_t k = static_cast<uint64_t>(key);
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

int log2_pow2(uint64_t x) { return 63 - __builtin_clzll(x); }

// Load limit: rehash when more than 5/8 of the slots are used.
int64_t grow_threshold(uint64_t capacity) { return static_cast<int64_t>(capacity / 8 * 5); }

// Smallest power-of-two slot count that holds n ids under the load limit.
uint64_t capacity_for(int64_t n) {
  uint64_t cap = kMinCapacity;
  while (grow_threshold(cap) < n) {
    if (cap >= kMaxCapacity) {
      throw std::length_error("IdMap: cannot hold " + std::to_string(n) + " ids (limit " +
                              std::to_string(grow_threshold(kMaxCapacity)) + ")");
    }
    cap <<= 1;
  }
  return cap;
}

void check_threads(const char* what, int threads) {
  if (threads < 1) {
    throw std::invalid_argument(std::string("IdMap.") + what + ": threads must be >= 1, got " +
                                std::to_string(threads));
  }
}

void check_batch(const char* what, int64_t n, const void* in, const void* out, bool out_required) {
  if (n < 0) {
    throw std::invalid_argument(std::string("IdMap.") + what + ": n must be >= 0, got " +
                                std::to_string(n));
  }
  if (n > 0 && in == nullptr) {
    throw std::invalid_argument(std::string("IdMap.") + what + ": null input pointer with n = " +
                                std::to_string(n));
  }
  if (n > 0 && out_required && out == nullptr) {
    throw std::invalid_argument(std::string("IdMap.") + what + ": null output pointer with n = " +
                                std::to_string(n));
  }
}

// Runs f(k) for k in [0, t): k = 0 on this thread, the others on std::threads. f must not throw.
// If a thread cannot be started, its part runs inline.
template <typename F>
void run_parts(int64_t t, const F& f) {
  if (t <= 1) {
    f(int64_t{0});
    return;
  }
  std::vector<std::thread> workers;
  int64_t started = 1;  // part 0 runs on this thread
  try {
    workers.reserve(static_cast<size_t>(t - 1));
    for (; started < t; ++started) workers.emplace_back([&f, started] { f(started); });
  } catch (...) {
    // Out of threads: the remaining parts run below on this thread.
  }
  f(int64_t{0});
  for (int64_t k = started; k < t; ++k) f(k);
  for (auto& w : workers) w.join();
}

// Runs f(begin, end) over [0, n) split in up to `threads` contiguous chunks, on std::threads for
// large batches. f must not throw.
template <typename F>
void parallel_for(int64_t n, int threads, const F& f) {
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>({threads, kMaxThreads, n / kMinIdsPerThread}));
  const int64_t chunk = (n + t - 1) / t;
  run_parts(t, [&](int64_t k) {
    const int64_t b = std::min(n, k * chunk), e = std::min(n, b + chunk);
    if (b < e || k == 0) f(b, e);
  });
}

// Calls body(i, hash(ids[i])) for i in [0, n), having prefetched addr(hash) kPrefetch ids ahead.
template <typename Addr, typename Body>
inline void pipelined(const int64_t* ids, int64_t n, const Addr& addr, const Body& body) {
  uint64_t ring[kPrefetch];
  const int64_t warm = std::min<int64_t>(n, kPrefetch);
  for (int64_t i = 0; i < warm; ++i) {
    ring[i] = slot_hash(ids[i]);
    prefetch(addr(ring[i]));
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = ring[i & (kPrefetch - 1)];
    if (i + kPrefetch < n) {
      const uint64_t hn = slot_hash(ids[i + kPrefetch]);
      ring[i & (kPrefetch - 1)] = hn;
      prefetch(addr(hn));
    }
    body(i, h);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// RowSet

void RowSet::ensure(int64_t nbits) {
  if (nbits <= nbits_) return;
  const int64_t want = std::max(nbits, nbits_ * 2);
  const size_t words = static_cast<size_t>((want + 63) / 64);
  std::vector<std::vector<uint64_t>> levels;
  levels.reserve(8);
  levels.emplace_back();
  levels[0].reserve(words);
  levels[0] = levels_[0];
  levels[0].resize(words, 0);
  while (levels.back().size() > 1) {
    const std::vector<uint64_t>& below = levels.back();
    std::vector<uint64_t> up((below.size() + 63) / 64, 0);
    for (size_t i = 0; i < below.size(); ++i) {
      if (below[i] != 0) up[i >> 6] |= uint64_t{1} << (i & 63);
    }
    levels.push_back(std::move(up));
  }
  levels_.swap(levels);
  nbits_ = static_cast<int64_t>(words) * 64;
}

void RowSet::set(int64_t i) {
  uint64_t pos = static_cast<uint64_t>(i);
  for (size_t k = 0; k < levels_.size(); ++k) {
    uint64_t& w = levels_[k][pos >> 6];
    const uint64_t bit = uint64_t{1} << (pos & 63);
    if (k == 0) {
      if (w & bit) return;
      ++count_;
    }
    const bool was_empty = (w == 0);
    w |= bit;
    if (!was_empty) return;
    pos >>= 6;
  }
}

void RowSet::reset(int64_t i) {
  uint64_t pos = static_cast<uint64_t>(i);
  for (size_t k = 0; k < levels_.size(); ++k) {
    uint64_t& w = levels_[k][pos >> 6];
    const uint64_t bit = uint64_t{1} << (pos & 63);
    if (k == 0) {
      if (!(w & bit)) return;
      --count_;
    }
    w &= ~bit;
    if (w != 0) return;
    pos >>= 6;
  }
}

int64_t RowSet::first() const {
  if (count_ == 0) return -1;
  uint64_t idx = 0;
  for (size_t k = levels_.size(); k-- > 0;) {
    idx = idx * 64 + static_cast<uint64_t>(__builtin_ctzll(levels_[k][idx]));
  }
  return static_cast<int64_t>(idx);
}

void RowSet::clear() {
  levels_.assign(1, std::vector<uint64_t>(1, 0));
  nbits_ = 64;
  count_ = 0;
}

// ---------------------------------------------------------------------------------------------
// IdMap: storage

void IdMap::SlotFree::operator()(Slot* p) const { std::free(p); }

namespace {
// Slot arrays are cache-line aligned; big ones are 2 MiB aligned and asked to use huge pages
// (random probes into a multi-GiB table otherwise miss the TLB on nearly every id).
void* allocate_slots(uint64_t capacity, size_t* bytes_out, bool huge_pages) {
  size_t bytes = static_cast<size_t>(capacity) * 16;
  const size_t align = bytes >= kHugePage ? kHugePage : 64;
  bytes = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, bytes);
  if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == kHugePage && huge_pages) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
  // The caller fills every slot at once: one call faults the pages in, instead of a fault per 4 KB
  // page during the fill (on a VM each fault is an exit: 16 MB took 6 ms that way). Before Linux
  // 5.14 it fails, and the fill faults them as before.
  if (align == kHugePage) madvise(p, bytes, MADV_POPULATE_WRITE);
#endif
  *bytes_out = bytes;
  return p;
}
}  // namespace

IdMap::IdMap(int64_t initial_capacity) {
  if (initial_capacity < 0) {
    throw std::invalid_argument("IdMap: initial_capacity must be >= 0, got " +
                                std::to_string(initial_capacity));
  }
  rehash(capacity_for(initial_capacity));
}

void IdMap::advise_huge_pages() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t bytes = static_cast<size_t>(mask_ + 1) * sizeof(Slot);
  if (bytes >= kHugePage) madvise(slots_.get(), bytes / kHugePage * kHugePage, MADV_HUGEPAGE);
#endif
}

IdMap::~IdMap() = default;
IdMap::IdMap(IdMap&&) noexcept = default;
IdMap& IdMap::operator=(IdMap&&) noexcept = default;

void IdMap::rehash(uint64_t new_capacity, bool huge_pages) {
  size_t bytes = 0;
  std::unique_ptr<Slot, SlotFree> fresh(static_cast<Slot*>(allocate_slots(new_capacity, &bytes, huge_pages)));
  std::memset(fresh.get(), 0xFF, bytes);  // row = -1 everywhere
  const uint64_t new_mask = new_capacity - 1;
  const int new_shift = 64 - log2_pow2(new_capacity);
  Slot* dst = fresh.get();
  if (slots_) {
    // Home slots come from the high hash bits, so walking the old array in order writes the new
    // one almost sequentially.
    const Slot* src = slots_.get();
    for (uint64_t i = 0; i <= mask_; ++i) {
      if (src[i].row < 0) continue;
      uint64_t idx = slot_hash(src[i].key) >> new_shift;
      while (dst[idx].row >= 0) idx = (idx + 1) & new_mask;
      dst[idx] = src[i];
    }
  }
  slots_ = std::move(fresh);
  mask_ = new_mask;
  shift_ = new_shift;
  grow_at_ = grow_threshold(new_capacity);
}

void IdMap::reserve(int64_t n, bool huge_pages) {
  if (n < 0) throw std::invalid_argument("IdMap.reserve: n must be >= 0, got " + std::to_string(n));
  const uint64_t cap = capacity_for(n);
  if (cap > mask_ + 1) rehash(cap, huge_pages);
}

void IdMap::clear() {
  std::memset(slots_.get(), 0xFF, static_cast<size_t>(mask_ + 1) * sizeof(Slot));
  size_ = 0;
  row_capacity_ = 0;
  free_.clear();
}

// ---------------------------------------------------------------------------------------------
// IdMap: single-id primitives

inline int64_t IdMap::find(int64_t key, uint64_t hash) const {
  const Slot* s = slots_.get();
  for (uint64_t idx = home(hash);; idx = (idx + 1) & mask_) {
    if (s[idx].row < 0) return -1;
    if (s[idx].key == key) return s[idx].row;
  }
}

int64_t IdMap::allocate_row() {
  const int64_t f = free_.first();
  if (f >= 0) {
    free_.reset(f);
    return f;
  }
  return row_capacity_++;
}

inline int64_t IdMap::find_or_insert(int64_t key, uint64_t hash, bool* is_new) {
  Slot* s = slots_.get();
  uint64_t idx = home(hash);
  for (;; idx = (idx + 1) & mask_) {
    if (s[idx].row < 0) break;
    if (s[idx].key == key) {
      *is_new = false;
      return s[idx].row;
    }
  }
  if (size_ >= grow_at_) {
    if (mask_ + 1 >= kMaxCapacity) {
      throw std::length_error("IdMap: table full at " + std::to_string(size_) + " ids");
    }
    rehash((mask_ + 1) * 2);
    s = slots_.get();
    for (idx = home(hash); s[idx].row >= 0; idx = (idx + 1) & mask_) {
    }
  }
  const int64_t row = allocate_row();
  s[idx].key = key;
  s[idx].row = row;
  ++size_;
  *is_new = true;
  return row;
}

bool IdMap::insert_unique(int64_t key, uint64_t hash, int64_t row) {
  Slot* s = slots_.get();
  uint64_t idx = home(hash);
  for (; s[idx].row >= 0; idx = (idx + 1) & mask_) {
    if (s[idx].key == key) return false;
  }
  s[idx].key = key;
  s[idx].row = row;
  ++size_;
  return true;
}

int64_t IdMap::remove(int64_t key, uint64_t hash) {
  Slot* s = slots_.get();
  uint64_t i = home(hash);
  for (;; i = (i + 1) & mask_) {
    if (s[i].row < 0) return -1;
    if (s[i].key == key) break;
  }
  const int64_t row = s[i].row;
  // Backward shift: pull later members of the cluster into the hole when the hole lies on
  // their probe path (between their home slot and where they sit).
  for (uint64_t j = (i + 1) & mask_; s[j].row >= 0; j = (j + 1) & mask_) {
    const uint64_t k = home(slot_hash(s[j].key));
    if (((j - k) & mask_) >= ((j - i) & mask_)) {
      s[i] = s[j];
      i = j;
    }
  }
  s[i].row = -1;
  --size_;
  return row;
}

// ---------------------------------------------------------------------------------------------
// IdMap: batch operations

void IdMap::lookup_range(const int64_t* ids, int64_t n, int64_t* rows_out) const {
  const Slot* s = slots_.get();
  const uint64_t mask = mask_;
  const int shift = shift_;
  pipelined(
      ids, n, [s, shift](uint64_t h) { return s + (h >> shift); },
      [&](int64_t i, uint64_t h) {
        const int64_t key = ids[i];
        for (uint64_t idx = h >> shift;; idx = (idx + 1) & mask) {
          const Slot& sl = s[idx];
          if (sl.row < 0) {
            rows_out[i] = -1;
            return;
          }
          if (sl.key == key) {
            rows_out[i] = sl.row;
            return;
          }
        }
      });
}

void IdMap::lookup(const int64_t* ids, int64_t n, int64_t* rows_out, int threads) const {
  check_batch("lookup", n, ids, rows_out, true);
  check_threads("lookup", threads);
  if (n == 0) return;
  parallel_for(n, threads,
               [&](int64_t b, int64_t e) { lookup_range(ids + b, e - b, rows_out + b); });
}

bool IdMap::load_distinct(const int64_t* ids, int64_t n, int threads) {
  check_batch("load_distinct", n, ids, ids, false);
  check_threads("load_distinct", threads);
  if (size_ != 0 || row_capacity_ != 0) {
    throw std::invalid_argument("IdMap.load_distinct: the map is not empty (" + std::to_string(size_) +
                                " ids, row capacity " + std::to_string(row_capacity_) +
                                "); clear() it first");
  }
  if (n == 0) return true;
  reserve(n);
  const int64_t parts = std::min<int64_t>(
      {threads, kMaxThreads, n / kMinIdsPerThread, static_cast<int64_t>((mask_ + 1) / 4096)});
  if (parts >= 2) {
    if (!insert_parts(ids, n, parts)) return false;
  } else {
    bool repeat = false;
    pipelined(
        ids, n, [this](uint64_t h) { return slots_.get() + home(h); },
        [&](int64_t i, uint64_t h) {
          if (!repeat) repeat = !insert_unique(ids[i], h, i);
        });
    if (repeat) {
      clear();
      return false;
    }
  }
  row_capacity_ = n;
  return true;
}

bool IdMap::insert_parts(const int64_t* ids, int64_t n, int64_t parts) {
  // The slot array is cut into `parts` ranges; part k inserts the ids whose home slot lies in
  // range k and never writes outside it, so the threads share no slot and need no atomics. An id
  // whose probe would run past its range's end (or wrap) waits for the sequential pass after
  // them, which probes across ranges as usual. Every part reads all ids: hashing is cheap next to
  // the cache miss of an insert.
  const uint64_t capacity = mask_ + 1;
  Slot* s = slots_.get();
  const int shift = shift_;
  struct alignas(64) Part {  // one cache line each: the parts' counters are not shared
    std::vector<int64_t> overflow;  // positions of ids left for the sequential pass
    int64_t inserted = 0;
    bool repeat = false;            // an id of this part appears twice
    bool out_of_memory = false;
  };
  std::vector<Part> result(static_cast<size_t>(parts));
  run_parts(parts, [&](int64_t k) {
    Part& part = result[static_cast<size_t>(k)];
    const uint64_t lo = capacity / parts * k;
    const uint64_t hi = k + 1 == parts ? capacity : capacity / parts * (k + 1);
    const uint64_t width = hi - lo;
    // Ids are taken in blocks: the ones of this range are picked without branches (half or more
    // of them belong elsewhere: a branch per id would mispredict), then inserted with their home
    // slots prefetched kPrefetch ahead.
    constexpr int64_t kBlock = 2048;
    int64_t pos[kBlock];
    uint64_t home[kBlock];
    int64_t inserted = 0;
    try {
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t e = std::min(n, b + kBlock);
        int64_t mine = 0;
        for (int64_t i = b; i < e; ++i) {
          const uint64_t h = slot_hash(ids[i]) >> shift;
          pos[mine] = i;
          home[mine] = h;
          mine += (h - lo) < width;  // unsigned: false below lo too
        }
        for (int64_t j = 0; j < std::min<int64_t>(mine, kPrefetch); ++j) prefetch(s + home[j]);
        for (int64_t j = 0; j < mine; ++j) {
          if (j + kPrefetch < mine) prefetch(s + home[j + kPrefetch]);
          const int64_t key = ids[pos[j]];
          uint64_t idx = home[j];
          for (; idx < hi && s[idx].row >= 0; ++idx) {
            if (s[idx].key == key) {
              part.repeat = true;
              part.inserted = inserted;
              return;
            }
          }
          if (idx == hi) {
            part.overflow.push_back(pos[j]);
            continue;
          }
          s[idx].key = key;
          s[idx].row = pos[j];
          ++inserted;
        }
      }
    } catch (const std::bad_alloc&) {
      part.out_of_memory = true;
    }
    part.inserted = inserted;
  });

  bool repeat = false, out_of_memory = false;
  for (const Part& part : result) {
    size_ += part.inserted;
    repeat = repeat || part.repeat;
    out_of_memory = out_of_memory || part.out_of_memory;
  }
  for (const Part& part : result) {
    for (size_t j = 0; !repeat && j < part.overflow.size(); ++j) {
      const int64_t pos = part.overflow[j];
      repeat = !insert_unique(ids[pos], slot_hash(ids[pos]), pos);
    }
  }
  if (repeat || out_of_memory) {
    clear();
    if (out_of_memory) throw std::bad_alloc();
    return false;
  }
  return true;
}

int64_t IdMap::lookup_or_insert(const int64_t* ids, int64_t n, int64_t* rows_out,
                                uint8_t* is_new_out, int threads) {
  check_batch("lookup_or_insert", n, ids, rows_out, true);
  check_threads("lookup_or_insert", threads);
  if (n == 0) return 0;
  if (is_new_out != nullptr) std::memset(is_new_out, 0, static_cast<size_t>(n));

  int64_t num_new = 0;
  // Into an empty map (a table's first batch) every id misses: a parallel lookup first would be
  // a wasted pass.
  if (threads == 1 || n < 2 * kMinIdsPerThread || size_ == 0) {
    // One sequential pass; the same result as the two phases below. Hits are probed with local
    // copies of the table fields (stores to rows_out could alias the members), refreshed after
    // each insert since it may rehash.
    const Slot* s = slots_.get();
    uint64_t mask = mask_;
    int shift = shift_;
    pipelined(
        ids, n, [&](uint64_t h) { return s + (h >> shift); },
        [&](int64_t i, uint64_t h) {
          const int64_t key = ids[i];
          for (uint64_t idx = h >> shift;; idx = (idx + 1) & mask) {
            if (s[idx].row < 0) break;
            if (s[idx].key == key) {
              rows_out[i] = s[idx].row;
              return;
            }
          }
          bool is_new = false;
          rows_out[i] = find_or_insert(key, h, &is_new);
          if (is_new) {
            ++num_new;
            if (is_new_out != nullptr) is_new_out[i] = 1;
          }
          s = slots_.get();
          mask = mask_;
          shift = shift_;
        });
    return num_new;
  }

  // Phase 1 (parallel, read-only): rows of ids already present; -1 marks the rest.
  lookup(ids, n, rows_out, threads);

  // Phase 2 (sequential, so rows go out in first-occurrence order whatever `threads` is): insert
  // the misses, prefetching the home slots of the next kPrefetch misses. A rehash in between
  // only makes a prefetch useless; the home slot is recomputed when the id is processed.
  struct Pending {
    int64_t pos;
    uint64_t hash;
  };
  Pending ring[kPrefetch];
  int head = 0, count = 0;
  int64_t scan = 0;
  auto push_next_miss = [&]() {
    while (scan < n && rows_out[scan] >= 0) ++scan;
    if (scan == n) return;
    const uint64_t h = slot_hash(ids[scan]);
    prefetch(slots_.get() + home(h));
    ring[(head + count) % kPrefetch] = Pending{scan, h};
    ++count;
    ++scan;
  };
  while (count < kPrefetch && scan < n) push_next_miss();

  while (count > 0) {
    const Pending p = ring[head];
    head = (head + 1) % kPrefetch;
    --count;
    push_next_miss();
    bool is_new = false;
    rows_out[p.pos] = find_or_insert(ids[p.pos], p.hash, &is_new);
    if (is_new) {
      ++num_new;
      if (is_new_out != nullptr) is_new_out[p.pos] = 1;
    }
  }
  return num_new;
}

int64_t IdMap::erase(const int64_t* ids, int64_t n, int64_t* rows_out) {
  check_batch("erase", n, ids, rows_out, false);
  if (n == 0) return 0;
  free_.ensure(row_capacity_);  // the only allocation: done before anything changes
  int64_t removed = 0;
  pipelined(
      ids, n, [this](uint64_t h) { return slots_.get() + home(h); },
      [&](int64_t i, uint64_t h) {
        const int64_t row = remove(ids[i], h);
        if (row >= 0) {
          free_.set(row);
          ++removed;
        }
        if (rows_out != nullptr) rows_out[i] = row;
      });
  return removed;
}

void IdMap::export_items(int64_t* ids_out, int64_t* rows_out, int threads) const {
  check_threads("export_items", threads);
  if (size_ == 0) return;
  if (ids_out == nullptr || rows_out == nullptr) {
    throw std::invalid_argument("IdMap.export_items: null output pointer with size " +
                                std::to_string(size_));
  }
  // Rows are unique and below row_capacity: row r goes to position r - (free rows below r),
  // counted with per-word prefix sums of the free bitmap.
  std::vector<int64_t> free_before;
  const std::vector<uint64_t>& words = free_.leaf_words();
  const bool dense = free_.count() == 0;
  if (!dense) {
    const size_t nwords = static_cast<size_t>((row_capacity_ + 63) / 64);
    free_before.resize(nwords);
    int64_t acc = 0;
    for (size_t w = 0; w < nwords; ++w) {
      free_before[w] = acc;
      if (w < words.size()) acc += __builtin_popcountll(words[w]);
    }
  }
  auto position = [&](int64_t r) {
    if (dense) return r;
    const size_t w = static_cast<size_t>(r >> 6);
    const uint64_t below = (uint64_t{1} << (r & 63)) - 1;
    return r - free_before[w] - (w < words.size() ? __builtin_popcountll(words[w] & below) : 0);
  };
  // Slots are read in order and the writes land at random positions (independent stores, which
  // the CPU overlaps by itself: prefetching them measured no faster).
  const Slot* s = slots_.get();
  parallel_for(static_cast<int64_t>(mask_ + 1), threads, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t r = s[i].row;
      if (r < 0) continue;
      const int64_t p = position(r);
      ids_out[p] = s[i].key;
      rows_out[p] = r;
    }
  });
}

void IdMap::insert_with_rows(const int64_t* ids, const int64_t* rows, int64_t n, int threads) {
  check_batch("insert_with_rows", n, ids, rows, true);
  check_threads("insert_with_rows", threads);
  if (n == 0) return;
  auto fail = [](const std::string& msg) {
    throw std::invalid_argument("IdMap.insert_with_rows: " + msg);
  };
  auto at = [&](int64_t i) {
    return "id " + std::to_string(ids[i]) + " (index " + std::to_string(i) + ")";
  };

  // 1. Rows: in range, unique in the batch, not held by a live id.
  int64_t max_row = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0) fail("row " + std::to_string(rows[i]) + " of " + at(i) + " is negative");
    if (rows[i] > kMaxRow) {
      fail("row " + std::to_string(rows[i]) + " of " + at(i) + " exceeds the maximum row " +
           std::to_string(kMaxRow));
    }
    max_row = std::max(max_row, rows[i]);
  }
  std::vector<uint64_t> seen(static_cast<size_t>(max_row / 64 + 1), 0);  // rows of the batch
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rows[i];
    uint64_t& w = seen[static_cast<size_t>(r >> 6)];
    const uint64_t bit = uint64_t{1} << (r & 63);
    if (w & bit) fail("row " + std::to_string(r) + " of " + at(i) + " appears more than once");
    w |= bit;
    if (r < row_capacity_ && !free_.test(r)) {
      fail("row " + std::to_string(r) + " of " + at(i) + " is already used by another id");
    }
  }

  // 2. Ids: none present yet (parallel, read-only). Duplicates within the batch are caught while
  // inserting below.
  if (size_ > 0) {
    std::mutex mu;
    int64_t bad = n;
    parallel_for(n, threads, [&](int64_t b, int64_t e) {
      const Slot* s = slots_.get();
      const int shift = shift_;
      int64_t found = n;
      pipelined(
          ids + b, e - b, [s, shift](uint64_t h) { return s + (h >> shift); },
          [&](int64_t i, uint64_t h) {
            if (found == n && find(ids[b + i], h) >= 0) found = b + i;
          });
      std::lock_guard<std::mutex> lock(mu);
      bad = std::min(bad, found);
    });
    if (bad < n) fail(at(bad) + " is already in the map");
  }

  // 3. Allocate everything up front so that nothing below can fail half way.
  const int64_t old_cap = row_capacity_;
  const int64_t new_cap = std::max(old_cap, max_row + 1);
  free_.ensure(new_cap);
  reserve(size_ + n);

  // 4. Insert; a duplicate id undoes the inserts made so far.
  pipelined(
      ids, n, [this](uint64_t h) { return slots_.get() + home(h); },
      [&](int64_t i, uint64_t h) {
        if (!insert_unique(ids[i], h, rows[i])) {
          for (int64_t k = 0; k < i; ++k) remove(ids[k], slot_hash(ids[k]));
          fail(at(i) + " appears more than once");
        }
      });

  // 5. Free list: loaded rows leave it; rows newly below row_capacity that nobody uses join it.
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < old_cap) free_.reset(rows[i]);
  }
  for (int64_t r = old_cap; r < new_cap; ++r) {
    if (!((seen[static_cast<size_t>(r >> 6)] >> (r & 63)) & 1u)) free_.set(r);
  }
  row_capacity_ = new_cap;
}

IdMap::Stats IdMap::stats() const {
  Stats st{static_cast<int64_t>(mask_ + 1), size_, 0.0, 0};
  const Slot* s = slots_.get();
  double total = 0;
  for (uint64_t i = 0; i <= mask_; ++i) {
    if (s[i].row < 0) continue;
    const int64_t probe = static_cast<int64_t>((i - home(slot_hash(s[i].key))) & mask_) + 1;
    total += static_cast<double>(probe);
    st.max_probe = std::max(st.max_probe, probe);
  }
  st.mean_probe = size_ > 0 ? total / static_cast<double>(size_) : 0.0;
  return st;
}

}  // namespace recsave
