// The bucket rule of checksum segments (docs/FORMAT.md section 3, `bucket_segments`): a chunk's rows
// sorted by bucket are cut at a bucket boundary once a segment holds `min_bytes`, and inside a long
// stretch every `step` bytes. A save computes the ends of every tensor it writes and an index read
// counts them for every chunk: one pass over the buckets each, here rather than in Python, where a
// 4096-bucket walk cost about 0.5 ms (a small delta save spent a third of its time on it).
#pragma once

#include <cstdint>

namespace recsave {

// The segment ends (bytes, relative to the chunk) for bucket row starts row_starts[0..n) (from 0,
// never decreasing) and rows of row_bytes bytes: written to `ends` when it is not null, which then
// has room for the count this returns (call once with null to size it). A chunk of 0 bytes has one
// end, 0. Steps inside a stretch are counted, not walked, when `ends` is null: a hostile index (step
// 1 over gigabytes) costs a pass over its buckets. Throws recsave::Error(kInvalid) for n < 1,
// row_starts not starting at 0 or decreasing, negative sizes, step < 1, or a chunk past 2^62 bytes.
int64_t bucket_segment_ends(const int64_t* row_starts, int64_t n, int64_t row_bytes, int64_t step,
                            int64_t min_bytes, int64_t* ends);

}  // namespace recsave
