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

// dst row rows[i] = src row i for i in [0, n) (src holds n rows back to back), in that order: a
// row listed twice takes its last value, as an indexed assignment does. Every rows[i] must lie in
// [0, num_rows), the rows dst holds: returns false, copying nothing, otherwise. One thread, dst rows
// prefetched ahead: a restore applies each delta's rows this way, and training's loads too.
bool scatter_rows(void* dst, uint64_t num_rows, uint64_t row_bytes, const int64_t* rows, int64_t n, const void* src);

}  // namespace recsave
