// recsave: CPU id map (int64 id -> int64 row), the index behind a CPU HashTable embedding.
//
// Open addressing with linear probing over a power-of-two array of {key, row} slots; a slot is
// empty when its row is -1, so every int64 value is a valid id. The home slot comes from the high
// bits of a murmur3 fmix64 hash of the id (deliberately not the splitmix64 `mix64` that routes ids
// to ranks: on one rank all ids share few `mix64 % 4096` values). Deletion is by backward shift
// (no tombstones). The table grows by doubling once it is more than 5/8 full.
//
// Rows are dense indices into embedding storage kept elsewhere. A new id takes the lowest row
// released by erase() if there is one, else row_capacity() (which then grows by one). Rows are
// assigned in order of first occurrence in a batch, so results never depend on `threads`.
//
// Thread safety: const methods may run concurrently with each other; any non-const call needs
// exclusive access (the Python binding adds a reader/writer lock). Batch methods parallelise
// internally (up to `threads` std::threads; batches below ~64K ids run on the calling thread).
// New ids are inserted by one thread, in batch order, except by load_distinct (a restore).
//
// Errors: every batch method throws std::invalid_argument for n < 0, threads < 1, or a null
// pointer with n > 0 (n == 0 with null pointers is a no-op). Growth past 2^56 slots throws
// std::length_error. If memory runs out (std::bad_alloc) in lookup_or_insert, the ids inserted
// before that stay inserted; insert_with_rows and erase allocate before changing anything, and
// load_distinct leaves the map empty.
#ifndef RECSAVE_CORE_ID_MAP_H_
#define RECSAVE_CORE_ID_MAP_H_

#include <cstdint>
#include <memory>
#include <vector>

namespace recsave {

// Set of row indices with O(log64 n) insert/remove/lowest-element (a 64-ary bit tree).
// Holds the free list of an IdMap.
class RowSet {
 public:
  // Make room for rows [0, nbits). Never shrinks. May allocate (throws std::bad_alloc).
  void ensure(int64_t nbits);
  // Bits capacity currently allocated.
  int64_t capacity() const { return nbits_; }
  // Requires i < capacity().
  void set(int64_t i);
  void reset(int64_t i);
  bool test(int64_t i) const {
    return i < nbits_ && ((levels_[0][static_cast<size_t>(i >> 6)] >> (i & 63)) & 1u);
  }
  // Lowest member, or -1 when empty.
  int64_t first() const;
  int64_t count() const { return count_; }
  // The membership bitmap, 64 rows per word (bit r % 64 of word r / 64).
  const std::vector<uint64_t>& leaf_words() const { return levels_[0]; }
  void clear();

 private:
  std::vector<std::vector<uint64_t>> levels_{std::vector<uint64_t>(1, 0)};
  int64_t nbits_ = 64;
  int64_t count_ = 0;
};

class IdMap {
 public:
  // Largest row insert_with_rows accepts (rows are dense indices: a bigger one means corrupt data).
  static constexpr int64_t kMaxRow = (int64_t{1} << 40) - 1;

  explicit IdMap(int64_t initial_capacity = 0);
  ~IdMap();
  IdMap(const IdMap&) = delete;
  IdMap& operator=(const IdMap&) = delete;
  IdMap(IdMap&&) noexcept;  // a moved-from map may only be destroyed or assigned to
  IdMap& operator=(IdMap&&) noexcept;

  // Number of live ids.
  int64_t size() const { return size_; }
  // Rows ever handed out: max row + 1 (high-water mark). 0 for a new or cleared map; erasing
  // ids does not lower it (their rows go to the free list).
  int64_t row_capacity() const { return row_capacity_; }
  // Number of slots in the table (power of two); diagnostics and tests.
  int64_t capacity() const { return static_cast<int64_t>(mask_ + 1); }
  // Number of rows in the free list (always row_capacity() - size()).
  int64_t free_rows() const { return free_.count(); }

  // rows_out[i] = row of ids[i], or -1 if absent. Read-only; may use up to `threads` threads.
  void lookup(const int64_t* ids, int64_t n, int64_t* rows_out, int threads = 1) const;

  // rows_out[i] = existing row, or a newly assigned row for an unseen id (lowest freed row
  // first, else row_capacity()++), assigned in order of first occurrence in the batch. Duplicated
  // ids get the same row. is_new_out (may be null): 1 at the first occurrence of each newly
  // inserted id, else 0. Returns the number of new ids. Identical results for any `threads`.
  int64_t lookup_or_insert(const int64_t* ids, int64_t n, int64_t* rows_out, uint8_t* is_new_out,
                           int threads = 1);

  // Restore into an empty map (no ids, no rows ever handed out; throws std::invalid_argument
  // otherwise): ids[i] gets row i. Returns false, leaving the map empty, if an id repeats. Up to
  // `threads` threads insert at once, each into its own range of slots; the caller caps
  // `threads` at the cores it may use (every thread reads all n ids).
  bool load_distinct(const int64_t* ids, int64_t n, int threads = 1);

  // Removes ids; rows_out (may be null) gets the freed row or -1 if absent (also for repeated
  // occurrences of an id within the batch: only the first removes). Returns the number removed.
  int64_t erase(const int64_t* ids, int64_t n, int64_t* rows_out);

  // Writes size() (id, row) pairs sorted by row ascending. May use up to `threads` threads.
  void export_items(int64_t* ids_out, int64_t* rows_out, int threads = 1) const;

  // Bulk load: ids unique and absent from the map, rows in [0, kMaxRow], unique and not used by
  // a live id. Throws std::invalid_argument naming the offending id/row, leaving the map
  // unchanged. row_capacity becomes max(row_capacity, max row + 1); unused rows below it are
  // free. Rows previously on the free list that are loaded here leave it.
  void insert_with_rows(const int64_t* ids, const int64_t* rows, int64_t n, int threads = 1);

  // Drops every id; row_capacity -> 0, free list empty. Keeps the slot array allocated.
  void clear();

  // Room for n ids without rehashing. Without `huge_pages` a new slot array is not advised for
  // huge pages (faulting 2 MiB pages may compact memory first: a restore calls
  // advise_huge_pages() once the map is filled).
  void reserve(int64_t n, bool huge_pages = true);
  // Asks for huge pages for the slot array (a hint, taken up in the background).
  void advise_huge_pages();

  struct Stats {
    int64_t capacity;    // slots
    int64_t size;        // live ids
    double mean_probe;   // mean slots inspected by a successful lookup (1.0 = no collisions)
    int64_t max_probe;   // worst successful lookup
  };
  // O(capacity) scan; diagnostics and tests.
  Stats stats() const;

 private:
  struct Slot {
    int64_t key;
    int64_t row;  // -1: empty
  };
  struct SlotFree {
    void operator()(Slot* p) const;
  };

  void rehash(uint64_t new_capacity, bool huge_pages = true);
  uint64_t home(uint64_t hash) const { return hash >> shift_; }
  // Probe for `key`; returns the row or -1.
  int64_t find(int64_t key, uint64_t hash) const;
  // Returns the row of `key`, assigning a new one (and setting *is_new) if it is absent.
  int64_t find_or_insert(int64_t key, uint64_t hash, bool* is_new);
  // Inserts a key known to be absent at the first empty slot from its home; no growth check.
  // Returns false (and changes nothing) if the key turns out to be present.
  bool insert_unique(int64_t key, uint64_t hash, int64_t row);
  // Removes `key`; returns its row or -1. Does not touch the free list.
  int64_t remove(int64_t key, uint64_t hash);
  int64_t allocate_row();
  // load_distinct's inserts on `parts` >= 2 threads into a map reserved for n ids; false (map
  // cleared) when an id repeats.
  bool insert_parts(const int64_t* ids, int64_t n, int64_t parts);
  void lookup_range(const int64_t* ids, int64_t n, int64_t* rows_out) const;

  std::unique_ptr<Slot, SlotFree> slots_;
  uint64_t mask_ = 0;       // capacity - 1
  int shift_ = 64;          // 64 - log2(capacity)
  int64_t size_ = 0;
  int64_t grow_at_ = 0;     // rehash when size_ would exceed this
  int64_t row_capacity_ = 0;
  RowSet free_;
};

}  // namespace recsave

#endif  // RECSAVE_CORE_ID_MAP_H_
