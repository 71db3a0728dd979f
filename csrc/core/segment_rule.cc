#include "core/segment_rule.h"

#include <string>

#include "core/errors.h"

namespace recsave {

int64_t bucket_segment_ends(const int64_t* row_starts, int64_t n, int64_t row_bytes, int64_t step,
                            int64_t min_bytes, int64_t* ends) {
  const auto invalid = [](const std::string& what) { return Error(ErrorKind::kInvalid, "", what); };
  if (n < 1 || row_starts[0] != 0) throw invalid("bucket row starts must be a non-empty list beginning at 0");
  if (row_bytes < 0 || min_bytes < 0 || step < 1) {
    throw invalid("segment rule: row bytes and min must be >= 0 and step >= 1");
  }
  for (int64_t i = 1; i < n; ++i) {
    if (row_starts[i] < row_starts[i - 1]) throw invalid("bucket row starts must never decrease");
  }
  constexpr int64_t kMaxBytes = int64_t{1} << 62;  // keeps begin + step and the products below in range
  const int64_t rows = row_starts[n - 1];
  if (row_bytes && rows > kMaxBytes / row_bytes) throw invalid("a chunk of more than 2^62 bytes");
  const int64_t total = rows * row_bytes;
  if (total == 0) {
    if (ends) ends[0] = 0;
    return 1;
  }
  int64_t count = 0, begin = 0;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t boundary = row_starts[i] * row_bytes;
    const int64_t gap = boundary - begin;
    if (gap > step) {  // the cuts that leave at most `step` bytes before the boundary
      const int64_t inner = (gap - 1) / step;
      if (ends) {
        for (int64_t k = 1; k <= inner; ++k) ends[count + k - 1] = begin + k * step;
      }
      begin += inner * step;
      count += inner;
    }
    if (boundary > begin && (boundary - begin >= min_bytes || boundary == total)) {
      if (ends) ends[count] = boundary;
      ++count;
      begin = boundary;
    }
  }
  if (count == 0 || begin != total) {
    if (ends) ends[count] = total;
    ++count;
  }
  return count;
}

}  // namespace recsave
