#include "core/counting_sort.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/row_init.h"
#include "core/thread_pool.h"

namespace recsave {

bool counting_order(const int64_t* keys, int64_t n, int64_t num_keys, int64_t* order, int64_t* counts) {
  std::fill(counts, counts + num_keys, 0);
  const uint64_t limit = static_cast<uint64_t>(num_keys);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t k = static_cast<uint64_t>(keys[i]);  // a negative key wraps past the limit
    if (k >= limit) return false;
    ++counts[k];
  }
  std::vector<int64_t> next(static_cast<size_t>(num_keys));
  int64_t at = 0;
  for (int64_t j = 0; j < num_keys; ++j) {
    next[static_cast<size_t>(j)] = at;
    at += counts[j];
  }
  for (int64_t i = 0; i < n; ++i) order[next[static_cast<size_t>(keys[i])]++] = i;
  return true;
}

namespace {

// key(id) = mix64(id) % buckets - base, with a mask where the bucket count is a power of two (the
// default 4096): a 64-bit division costs more than the rest of a row's work.
struct BucketKey {
  uint64_t buckets, base, mask;
  bool pow2;
  uint64_t operator()(int64_t id) const {
    const uint64_t h = mix64(static_cast<uint64_t>(id));
    return (pow2 ? (h & mask) : (h % buckets)) - base;
  }
};

}  // namespace

bool bucket_order_of_ids(const int64_t* ids, int64_t n, uint64_t num_buckets, int64_t first, int64_t num_keys,
                         int64_t* order, int64_t* counts, int64_t* sorted_ids, int threads) {
  constexpr int64_t kMinSlice = 1 << 16;  // below this a thread's start costs more than its share
  constexpr int64_t kMaxCountCells = 1 << 22;  // per-slice count tables: at most 32 MB in all
  const int64_t by_size = std::max<int64_t>(1, n / kMinSlice);
  const int64_t by_keys = std::max<int64_t>(1, kMaxCountCells / std::max<int64_t>(num_keys, 1));
  const int slices = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({threads, by_size, by_keys})));
  const auto slice_begin = [&](int64_t t) { return n * t / slices; };
  std::vector<int64_t> local(static_cast<size_t>(slices) * static_cast<size_t>(num_keys), 0);
  std::atomic<bool> foreign{false};
  // Copied into each task: the count stores below may alias any int64 the compiler cannot prove
  // distinct, and captured references would be reloaded every row.
  const BucketKey key_of{num_buckets, static_cast<uint64_t>(first), num_buckets - 1,
                         (num_buckets & (num_buckets - 1)) == 0};
  const uint64_t limit = static_cast<uint64_t>(num_keys);
  ThreadPool& pool = shared_pool(slices);
  pool.parallel_for(slices, slices, [&, key_of, limit](int64_t t) {
    int64_t* mine = local.data() + t * num_keys;
    const int64_t end = slice_begin(t + 1);
    for (int64_t i = slice_begin(t); i < end; ++i) {
      const uint64_t k = key_of(ids[i]);  // a bucket below `first` wraps past the limit
      if (k >= limit) {
        foreign.store(true, std::memory_order_relaxed);
        return;
      }
      ++mine[k];
    }
  });
  if (foreign.load()) return false;
  int64_t at = 0;
  for (int64_t k = 0; k < num_keys; ++k) {  // offsets: bucket by bucket, then slice by slice
    const int64_t start = at;
    for (int64_t t = 0; t < slices; ++t) {
      int64_t& cell = local[static_cast<size_t>(t * num_keys + k)];
      const int64_t c = cell;
      cell = at;
      at += c;
    }
    counts[k] = at - start;
  }
  pool.parallel_for(slices, slices, [&, key_of](int64_t t) {
    // The keys are hashed again rather than kept: a buffer of them would be fresh memory, whose
    // page faults cost more on a VM than the hash (about 1 ns an id).
    int64_t* next = local.data() + t * num_keys;
    int64_t* placed = order;
    int64_t* placed_ids = sorted_ids;
    const int64_t end = slice_begin(t + 1);
    for (int64_t i = slice_begin(t); i < end; ++i) {
      const int64_t id = ids[i];
      const int64_t at = next[key_of(id)]++;
      placed[at] = i;
      placed_ids[at] = id;
    }
  });
  return true;
}

}  // namespace recsave
