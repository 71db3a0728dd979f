// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4, RocksDB and GCS.
// Kernels, the fastest one the CPU supports chosen once at run time:
//   vpclmul  x86-64 with AVX-512 and VPCLMULQDQ: the pclmul kernel's folding on 512-bit registers,
//            256 bytes at a time (buffers of 512 bytes and more; shorter ones go through pclmul).
//   pclmul   x86-64 with SSE4.2 and PCLMULQDQ: buffers of 256 bytes and more are folded 128 bytes
//            at a time by carry-less multiplication (eight independent 128-bit accumulators), the
//            remainder goes through the `crc32` instruction.
//   sse4.2   x86-64 with SSE4.2 only: the `crc32` instruction, 8 bytes at a time.
//   portable everywhere: slicing-by-8 tables.
// RECSAVE_CRC32C_PORTABLE=1 in the environment forces the portable kernel (read once, at first use).
#pragma once

#include <cstddef>
#include <cstdint>

namespace recsave {

// Extends `crc` (the CRC of earlier bytes; 0 to start) by `n` bytes. Standard pre/post inversion:
// crc32c(0, "123456789", 9) == 0xE3069283.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

// Both paths, exposed so tests can check each against known vectors.
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);
uint32_t crc32c_hardware(uint32_t crc, const void* data, size_t n);  // requires crc32c_hardware_available()
bool crc32c_hardware_available();

// The CRC32C of A followed by B, from crc_a = crc32c(0, A), crc_b = crc32c(0, B) and len_b = |B|:
// lets threads checksum pieces of one range independently.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// Copies n bytes from src to dst (which must not overlap) and returns crc32c(crc, src, n), in one
// pass. With the (v)pclmul kernels the stores bypass the cache (streaming stores, fenced before
// returning): meant for large destinations that are not read again soon.
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n);

// Every kernel on its own, for tests and benchmarks.
enum class Crc32cKernel { kPortable, kSse42, kPclmul, kVpclmul };
bool crc32c_kernel_available(Crc32cKernel kernel);                                   // on this CPU
uint32_t crc32c_with(Crc32cKernel kernel, uint32_t crc, const void* data, size_t n);  // requires it
uint32_t crc32c_copy_with(Crc32cKernel kernel, uint32_t crc, void* dst, const void* src, size_t n);
// The one vocabulary for kernels, in C++, Python (_C.crc32c_kernel()) and the docs: "vpclmul",
// "pclmul", "sse4.2" or "portable".
const char* crc32c_kernel_name(Crc32cKernel kernel);
Crc32cKernel crc32c_selected_kernel();                                               // what crc32c() uses

}  // namespace recsave
