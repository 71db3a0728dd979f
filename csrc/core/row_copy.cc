#include "core/row_copy.h"

#include <algorithm>
#include <cstring>

#include "core/thread_pool.h"

namespace recsave {

namespace {
// Every row index in [0, num_rows): checked before anything is copied.
bool rows_in_range(const int64_t* rows, int64_t n, uint64_t num_rows) {
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0 || static_cast<uint64_t>(rows[i]) >= num_rows) return false;
  }
  return true;
}
}  // namespace

bool copy_rows(void* dst, const void* src, uint64_t num_rows, uint64_t row_bytes, const int64_t* rows, int64_t n,
               int threads) {
  if (n <= 0 || row_bytes == 0) return true;
  if (!rows_in_range(rows, n, num_rows)) return false;
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  // Tasks of about 1 MiB of rows; rows are random reads and writes, so a few are prefetched ahead.
  const int64_t per_task = std::max<int64_t>(1, static_cast<int64_t>((uint64_t{1} << 20) / row_bytes));
  const int64_t tasks = (n + per_task - 1) / per_task;
  constexpr int64_t kAhead = 8;
  shared_pool(threads).parallel_for(tasks, threads, [&](int64_t t) {
    const int64_t begin = t * per_task, end = std::min(n, begin + per_task);
    for (int64_t i = begin; i < end;) {
      if (i + kAhead < end) {
        __builtin_prefetch(in + static_cast<uint64_t>(rows[i + kAhead]) * row_bytes, 0);
        __builtin_prefetch(out + static_cast<uint64_t>(rows[i + kAhead]) * row_bytes, 1);
      }
      int64_t run = 1;
      while (i + run < end && rows[i + run] == rows[i] + run) ++run;
      const uint64_t at = static_cast<uint64_t>(rows[i]) * row_bytes;
      std::memcpy(out + at, in + at, static_cast<uint64_t>(run) * row_bytes);
      i += run;
    }
  });
  return true;
}

bool scatter_rows(void* dst, uint64_t num_rows, uint64_t row_bytes, const int64_t* rows, int64_t n, const void* src) {
  if (n <= 0 || row_bytes == 0) return true;
  if (!rows_in_range(rows, n, num_rows)) return false;
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  constexpr int64_t kAhead = 8;
  for (int64_t i = 0; i < n;) {
    if (i + kAhead < n) __builtin_prefetch(out + static_cast<uint64_t>(rows[i + kAhead]) * row_bytes, 1);
    int64_t run = 1;  // consecutive destination rows: one block
    while (i + run < n && rows[i + run] == rows[i] + run) ++run;
    std::memcpy(out + static_cast<uint64_t>(rows[i]) * row_bytes, in + static_cast<uint64_t>(i) * row_bytes,
                static_cast<uint64_t>(run) * row_bytes);
    i += run;
  }
  return true;
}

}  // namespace recsave
