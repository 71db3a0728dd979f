#include "core/crc32c.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define RECSAVE_CRC_X86 1
#include <nmmintrin.h>
#endif

namespace recsave {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// Slicing-by-8 tables: table[k][b] is the CRC register after byte b followed by k zero bytes.
struct PortableTables {
  uint32_t t[8][256];
  PortableTables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
    }
  }
};

const PortableTables& portable_tables() {
  static const PortableTables tables;
  return tables;
}

// Advances a raw CRC register (no inversion) over n bytes.
uint32_t portable_update(uint32_t reg, const uint8_t* p, size_t n) {
  const auto& t = portable_tables().t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    reg = (reg >> 8) ^ t[0][(reg ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian hosts only (x86-64, aarch64 LE)
    word ^= reg;
    reg = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^
          t[4][(word >> 24) & 0xFF] ^ t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
          t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) reg = (reg >> 8) ^ t[0][(reg ^ *p++) & 0xFF];
  return reg;
}

#ifdef RECSAVE_CRC_X86

// Stream lengths for the three-way interleave. A register that has consumed `len` bytes is moved
// past the `len` bytes of the next stream by multiplying by x^(8*len) mod P ("shifting"), which is
// linear in the register: a 4x256 table per length applies it a byte of the register at a time.
constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;

struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(size_t zeros) {
    // Image of each single-bit register value after `zeros` zero bytes, then tables by linearity.
    uint32_t basis[32];
    static const uint8_t kZeros[kLong] = {};
    for (int bit = 0; bit < 32; ++bit) basis[bit] = portable_update(1u << bit, kZeros, zeros);
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int i = 0; i < 8; ++i)
          if (b & (1u << i)) v ^= basis[8 * k + i];
        t[k][b] = v;
      }
    }
  }
  uint32_t shift(uint32_t reg) const {
    return t[0][reg & 0xFF] ^ t[1][(reg >> 8) & 0xFF] ^ t[2][(reg >> 16) & 0xFF] ^ t[3][reg >> 24];
  }
};

const ShiftTable& long_shift() {
  static const ShiftTable table(kLong);
  return table;
}
const ShiftTable& short_shift() {
  static const ShiftTable table(kShort);
  return table;
}

// Runs three streams of `len` bytes side by side while at least 3*len bytes remain, then folds
// them into c0 with two shifts.
__attribute__((target("sse4.2"))) void interleave3(uint64_t& c0, const uint8_t*& p, size_t& n,
                                                   size_t len, const ShiftTable& shift) {
  while (n >= 3 * len) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + len;
    do {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p, 8);
      std::memcpy(&w1, p + len, 8);
      std::memcpy(&w2, p + 2 * len, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
      p += 8;
    } while (p < end);
    c0 = shift.shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = shift.shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c2);
    p += 2 * len;
    n -= 3 * len;
  }
}

__attribute__((target("sse4.2"))) uint32_t hardware_update(uint32_t reg, const uint8_t* p,
                                                           size_t n) {
  uint64_t c0 = reg;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *p++);
    --n;
  }
  interleave3(c0, p, n, kLong, long_shift());
  interleave3(c0, p, n, kShort, short_shift());
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c0 = _mm_crc32_u64(c0, w);
    p += 8;
    n -= 8;
  }
  while (n--) c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *p++);
  return static_cast<uint32_t>(c0);
}

bool detect_hardware() {
  if (const char* force = std::getenv("RECSAVE_CRC32C_PORTABLE")) {
    if (force[0] && force[0] != '0') return false;
  }
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

#else

bool detect_hardware() { return false; }
uint32_t hardware_update(uint32_t reg, const uint8_t* p, size_t n) { return portable_update(reg, p, n); }

#endif

bool use_hardware() {
  static const bool hw = [] {
    bool ok = detect_hardware();
#ifdef RECSAVE_CRC_X86
    if (ok) {  // build the shift tables before threads race to first use
      long_shift();
      short_shift();
    }
#endif
    return ok;
  }();
  return hw;
}

}  // namespace

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  return ~portable_update(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c_hardware(uint32_t crc, const void* data, size_t n) {
  return ~hardware_update(~crc, static_cast<const uint8_t*>(data), n);
}

bool crc32c_hardware_available() {
#ifdef RECSAVE_CRC_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  return use_hardware() ? crc32c_hardware(crc, data, n) : crc32c_portable(crc, data, n);
}

const char* crc32c_implementation() { return use_hardware() ? "sse4.2" : "portable"; }

}  // namespace recsave
