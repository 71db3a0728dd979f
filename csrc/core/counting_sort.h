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

// The rows of a save in bucket order in one call: key[i] = mix64(ids[i]) % num_buckets - first, then
// order and counts as counting_order gives them for those keys (num_keys = the rank's buckets). The
// keys are never written out (each pass hashes the ids), and both passes run on up to `threads`
// threads: each thread counts, then places, its own slice of the ids, at offsets
// taken bucket by bucket and slice by slice, so equal keys stay in their original order.
// sorted_ids (n entries) receives ids[order[k]] at k, placed in the same pass: the save then writes
// the ids as they lie instead of gathering 8-byte rows one cache miss each. Returns false,
// leaving order, counts and sorted_ids unspecified, when an id's key lies outside [0, num_keys) (an
// id another rank owns).
bool bucket_order_of_ids(const int64_t* ids, int64_t n, uint64_t num_buckets, int64_t first, int64_t num_keys,
                         int64_t* order, int64_t* counts, int64_t* sorted_ids, int threads);

}  // namespace recsave
