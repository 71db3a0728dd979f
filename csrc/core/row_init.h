// Deterministic row initialisation for hash-table embeddings: the value of every element depends only
// on (seed, id, column), so a table rebuilt after a restart, or rows inserted in another order or on
// another rank, get exactly the values of an uninterrupted run.
#pragma once

#include <cstdint>

namespace recsave {

// splitmix64's finaliser; also the documented id -> bucket mixer of recsave.partition.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// out[i * dim + j] ~ normal(0, stddev), a pure function of (seed, ids[i], j). Uses up to `threads`.
void init_rows_normal(const int64_t* ids, int64_t n, int64_t dim, uint64_t seed, float stddev,
                      float* out, int threads);

// out[i] = mix64(ids[i]) % num_buckets (num_buckets > 0).
void bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, int64_t* out, int threads);

}  // namespace recsave
