// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4, RocksDB and GCS.
// Two implementations, chosen once at run time: the SSE4.2 `crc32` instruction over three
// interleaved streams (hides the instruction's 3-cycle latency), and a portable slicing-by-8 table.
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

// "sse4.2" or "portable": the path crc32c() dispatches to.
const char* crc32c_implementation();

}  // namespace recsave
