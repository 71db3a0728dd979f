// Copying chosen rows of one row-major matrix into the same rows of another: an async save brings
// its host copy of a table up to date by copying only the rows changed since the previous one.
#pragma once

#include <cstdint>

namespace recsave {

// dst row rows[i] = src row rows[i] for every i, rows of row_bytes bytes. Every rows[i] must lie in
// [0, num_rows), the rows both buffers hold: returns false, copying nothing, otherwise. Runs of
// consecutive rows are copied as one block; uses up to `threads` threads.
bool copy_rows(void* dst, const void* src, uint64_t num_rows, uint64_t row_bytes, const int64_t* rows, int64_t n,
               int threads);

}  // namespace recsave
