#include "core/row_init.h"

#include <algorithm>
#include <cmath>

#include "core/thread_pool.h"

namespace recsave {
namespace {

constexpr int64_t kRowsPerTask = 4096;

// Uniform double in (0, 1]: never 0, so log() below is finite.
inline double unit(uint64_t bits) { return (static_cast<double>(bits >> 11) + 1.0) * 0x1.0p-53; }

void fill_row(uint64_t seed, int64_t id, int64_t dim, float stddev, float* row) {
  const uint64_t key = mix64(seed ^ mix64(static_cast<uint64_t>(id) + 0x9e3779b97f4a7c15ull));
  for (int64_t j = 0; j < dim; j += 2) {
    // Box-Muller on two independent uniforms of this column pair.
    uint64_t h1 = mix64(key + static_cast<uint64_t>(j) * 0xd1b54a32d192ed03ull);
    uint64_t h2 = mix64(h1 ^ 0xa0761d6478bd642full);
    double r = std::sqrt(-2.0 * std::log(unit(h1)));
    double theta = 6.283185307179586476925 * unit(h2);
    row[j] = static_cast<float>(stddev * r * std::cos(theta));
    if (j + 1 < dim) row[j + 1] = static_cast<float>(stddev * r * std::sin(theta));
  }
}

}  // namespace

void init_rows_normal(const int64_t* ids, int64_t n, int64_t dim, uint64_t seed, float stddev,
                      float* out, int threads) {
  int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  shared_pool(threads).parallel_for(tasks, threads, [&](int64_t t) {
    int64_t end = std::min(n, (t + 1) * kRowsPerTask);
    for (int64_t i = t * kRowsPerTask; i < end; ++i) fill_row(seed, ids[i], dim, stddev, out + i * dim);
  });
}

void bucket_of(const int64_t* ids, int64_t n, uint64_t num_buckets, int64_t* out, int threads) {
  constexpr int64_t kIdsPerTask = 1 << 16;
  int64_t tasks = (n + kIdsPerTask - 1) / kIdsPerTask;
  shared_pool(threads).parallel_for(tasks, threads, [&](int64_t t) {
    int64_t end = std::min(n, (t + 1) * kIdsPerTask);
    for (int64_t i = t * kIdsPerTask; i < end; ++i) {
      out[i] = static_cast<int64_t>(mix64(static_cast<uint64_t>(ids[i])) % num_buckets);
    }
  });
}

}  // namespace recsave
