// Stable counting sort of small non-negative keys (a save orders each table's rows by bucket: 4096
// keys for millions of rows, where a comparison sort spends 10-20 ms a table and this one pass of
// counting and one of placing, about 3 ms).
#pragma once

#include <cstdint>

namespace recsave {

// order[k] = the position in `keys` of the k-th key in ascending order, equal keys in their original
// order; counts[j] = how many keys equal j (num_keys entries). Returns false, leaving order and
// counts unspecified, when a key lies outside [0, num_keys).
bool counting_order(const int64_t* keys, int64_t n, int64_t num_keys, int64_t* order, int64_t* counts);

}  // namespace recsave
