#include "core/counting_sort.h"

#include <algorithm>
#include <vector>

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

}  // namespace recsave
