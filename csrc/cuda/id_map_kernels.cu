// recsave: the probe loops of TensorIdMap (recsave/tables/idmap.py) as CUDA kernels.
//
// TensorIdMap keeps its table in torch tensors on the device: `keys` and `rows`, int64 arrays of a
// power-of-two size; a slot's row is -1 when empty, -2 when deleted, else the id's row. The home
// slot is murmur3 fmix64(id) & mask, probing linearly. In torch ops every probe step of a batch is
// several kernels and a host sync (the loop ends when no id is still probing); here each id probes
// on its own thread, so a batch is one launch whatever its longest probe.
//
// The layout, hash and probe order are exactly the torch-ops code's: either may run on a table the
// other wrote, and the rows handed out (decided in Python) never depend on which ran.
//
// A plain C ABI (no torch headers): the library is built with nvcc alone (setup.py, only where
// nvcc and a CUDA build of torch exist) and called through ctypes with raw device pointers and the
// caller's CUDA stream. Every entry point returns a cudaError_t (0 = launched).
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr long long kEmpty = -1;
constexpr long long kDeleted = -2;
constexpr long long kBusy = -3;  // claimed by a thread of place_kernel, its row not yet written

__device__ __forceinline__ unsigned long long home_slot(long long id, unsigned long long mask) {
  unsigned long long h = static_cast<unsigned long long>(id);
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDULL;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ULL;
  h ^= h >> 33;
  return h & mask;
}

// Row and slot of each id, -1 / -1 where absent. An empty slot ends a probe; the table is never
// full (TensorIdMap keeps it at most half full), the bound is a guard against a damaged one.
__global__ void find_kernel(const long long* __restrict__ keys, const long long* __restrict__ rows,
                            unsigned long long mask, const long long* __restrict__ ids, long long n,
                            long long* __restrict__ out_rows, long long* __restrict__ out_slots) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const long long id = ids[i];
    unsigned long long pos = home_slot(id, mask);
    long long row = -1, slot = -1;
    for (unsigned long long step = 0; step <= mask; ++step) {
      const long long r = rows[pos];
      if (r == kEmpty) break;
      if (r >= 0 && keys[pos] == id) {
        row = r;
        slot = static_cast<long long>(pos);
        break;
      }
      pos = (pos + 1) & mask;
    }
    out_rows[i] = row;
    if (out_slots != nullptr) out_slots[i] = slot;
  }
}

__device__ __forceinline__ long long load_row(const long long* p) {
  return *reinterpret_cast<const volatile long long*>(p);
}

// Stores distinct ids known to be absent with their rows. A thread claims the first empty or
// deleted slot of its probe with a compare-and-swap (losers probe on), writes the key, then
// publishes the row. Counts the deleted slots taken into *reused (TensorIdMap's tombstone count).
__global__ void place_kernel(long long* __restrict__ keys, long long* rows, unsigned long long mask,
                             const long long* __restrict__ ids, const long long* __restrict__ vals,
                             long long n, unsigned long long* reused) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    unsigned long long pos = home_slot(ids[i], mask);
    long long cur = load_row(rows + pos);
    for (unsigned long long tries = 0; tries <= 2 * mask + 1;) {
      if (cur == kEmpty || cur == kDeleted) {
        auto* word = reinterpret_cast<unsigned long long*>(rows + pos);
        const long long prev = static_cast<long long>(
            atomicCAS(word, static_cast<unsigned long long>(cur), static_cast<unsigned long long>(kBusy)));
        if (prev == cur) {
          keys[pos] = ids[i];
          __threadfence();
          atomicExch(word, static_cast<unsigned long long>(vals[i]));
          if (cur == kDeleted) atomicAdd(reused, 1ULL);
          break;
        }
        cur = prev;  // another thread took it: look at what is there now
        continue;
      }
      pos = (pos + 1) & mask;
      cur = load_row(rows + pos);
      ++tries;
    }
  }
}

int blocks_for(long long n, int threads) {
  long long b = (n + threads - 1) / threads;
  if (b > 65535LL * 32) b = 65535LL * 32;  // grid-stride loops cover the rest
  return static_cast<int>(b < 1 ? 1 : b);
}

}  // namespace

#define RECSAVE_EXPORT __attribute__((visibility("default")))

extern "C" {

// ABI version of this library; recsave/tables/cudakernels.py refuses a library of another.
RECSAVE_EXPORT int recsave_cuda_abi_version() { return 1; }

RECSAVE_EXPORT int recsave_idmap_find(const long long* keys, const long long* rows, unsigned long long mask,
                       const long long* ids, long long n, long long* out_rows, long long* out_slots,
                       void* stream) {
  if (n <= 0) return 0;
  constexpr int kThreads = 256;
  find_kernel<<<blocks_for(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      keys, rows, mask, ids, n, out_rows, out_slots);
  return static_cast<int>(cudaGetLastError());
}

RECSAVE_EXPORT int recsave_idmap_place(long long* keys, long long* rows, unsigned long long mask, const long long* ids,
                        const long long* vals, long long n, unsigned long long* reused, void* stream) {
  if (n <= 0) return 0;
  constexpr int kThreads = 256;
  place_kernel<<<blocks_for(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      keys, rows, mask, ids, vals, n, reused);
  return static_cast<int>(cudaGetLastError());
}

RECSAVE_EXPORT const char* recsave_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
