#include "core/crc32c.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define RECSAVE_CRC_X86 1
#include <immintrin.h>
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

// The `crc32` instruction, 8 bytes at a time: about one byte per cycle less than the folding kernel
// reaches, but no setup, so it also finishes the folding kernel's last bytes.
__attribute__((target("sse4.2"))) inline uint32_t sse42_update(uint32_t reg, const uint8_t* p, size_t n) {
  uint64_t c = reg;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c);
}

// ---- Folding by carry-less multiplication -------------------------------------------------------
//
// Notation: the CRC register after bytes M from register r is (r * x^(8|M|) + M * x^32) mod P, where
// the first bit of M (bit 0 of byte 0) is its highest-degree coefficient. A 16-byte block loaded into
// an XMM register therefore holds a polynomial whose bit k is the coefficient of x^(127-k): its low
// qword is the high-degree half. XORing r into the first 4 bytes of M accounts for r, so the register
// after M is just M * x^32 mod P, and any X with X == M (mod P) gives the same register: the 16 bytes
// of X run through `crc32` from register 0.
//
// Folding keeps such an X for the bytes consumed so far. Consuming a block B that lies D bits later:
// X' = X * x^D + B. With X = lo * x^64 + hi, X * x^D == lo * (x^(D+64) mod P) + hi * (x^D mod P),
// each a 64 x 32-bit carry-less product that fits 128 bits, so no reduction is needed until the end.
// PCLMULQDQ of two qwords read in this bit order yields the product times x; a 32-bit constant c
// held in the low dword of a qword stands for c * x^32. Hence the constants x^(D+64-33) and
// x^(D-33) mod P, in CRC-register form (bit k is the coefficient of x^(31-k)).

// x^d mod P in CRC-register form.
constexpr uint32_t xpow_mod(uint64_t d) {
  uint32_t r = 0x80000000u;  // x^0
  for (uint64_t i = 0; i < d; ++i) r = (r >> 1) ^ (kPoly & (0u - (r & 1u)));
  return r;
}

// Independent accumulators: enough to cover PCLMULQDQ's latency (up to 7 cycles) at one per cycle.
constexpr int kLanes = 8;
constexpr size_t kStride = 16 * kLanes;  // bytes consumed per loop iteration
constexpr size_t kFoldMin = 256;         // shorter buffers go through `crc32` directly
constexpr uint64_t kFarLo = xpow_mod(8 * kStride + 31), kFarHi = xpow_mod(8 * kStride - 33);
constexpr uint64_t kNearLo = xpow_mod(128 + 31), kNearHi = xpow_mod(128 - 33);

// X * x^D + next, for the distance D whose constants `k` holds (low qword for lo, high for hi).
__attribute__((target("sse4.2,pclmul"))) inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

// The 16 bytes at p + i, also stored at d + i (16-byte aligned, bypassing the cache) when kCopy.
template <bool kCopy>
__attribute__((target("sse4.2,pclmul"))) inline __m128i take16(const uint8_t* p, uint8_t* d, size_t i) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
  if (kCopy) _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), v);
  return v;
}

// Both folding kernels end alike: x holds the bytes before p + i; the whole 16-byte blocks left are
// folded in, p, d and n moved past them, and x's 16 bytes run through `crc32` from register 0 give
// the register after everything folded (see above).
template <bool kCopy>
__attribute__((target("sse4.2,pclmul"))) inline uint32_t finish_folding(__m128i x, __m128i near, size_t i,
                                                                        const uint8_t*& p, uint8_t*& d, size_t& n) {
  for (; n - i >= 16; i += 16) x = fold(x, near, take16<kCopy>(p, d, i));
  p += i, n -= i;
  if (kCopy) d += i;
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  return static_cast<uint32_t>(_mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1))));
}

// Advances `reg` over n >= kFoldMin bytes at p, copying them to d when kCopy (d 16-byte aligned).
// Returns the register after the whole 16-byte blocks; p, d and n are moved past them.
template <bool kCopy>
__attribute__((target("sse4.2,pclmul"))) uint32_t pclmul_blocks(uint32_t reg, const uint8_t*& p, uint8_t*& d,
                                                                size_t& n) {
  const __m128i far = _mm_set_epi64x(static_cast<long long>(kFarHi), static_cast<long long>(kFarLo));
  const __m128i near = _mm_set_epi64x(static_cast<long long>(kNearHi), static_cast<long long>(kNearLo));
  // Lane l holds the blocks at 16*l + kStride*j; each folds over the kStride bytes to its next block.
  __m128i a[kLanes];
#pragma GCC unroll 8
  for (int l = 0; l < kLanes; ++l) a[l] = take16<kCopy>(p, d, 16 * l);
  a[0] = _mm_xor_si128(a[0], _mm_cvtsi32_si128(static_cast<int>(reg)));
  size_t i = kStride;
  for (; n - i >= kStride; i += kStride) {
#pragma GCC unroll 8
    for (int l = 0; l < kLanes; ++l) a[l] = fold(a[l], far, take16<kCopy>(p, d, i + 16 * l));
  }
  // The lanes are consecutive 16-byte blocks now: fold them into one, then the whole blocks left.
  __m128i x = a[0];
#pragma GCC unroll 8
  for (int l = 1; l < kLanes; ++l) x = fold(x, near, a[l]);
  return finish_folding<kCopy>(x, near, i, p, d, n);
}

__attribute__((target("sse4.2,pclmul"))) uint32_t pclmul_update(uint32_t reg, const uint8_t* p, size_t n) {
  if (n >= kFoldMin) {
    uint8_t* unused = nullptr;
    reg = pclmul_blocks<false>(reg, p, unused, n);
  }
  return sse42_update(reg, p, n);
}

// A folding kernel's copy: the bytes up to a kAlign boundary of the destination through `crc32`,
// the blocks (streaming stores), then the tail; buffers shorter than min_blocks + that head go to
// `shorter`. Blocks(reg, p, d, n) advances p, d and n past the blocks it took.
template <size_t kAlign, typename Blocks, typename Shorter>
__attribute__((target("sse4.2,pclmul"))) inline uint32_t folding_copy(uint32_t reg, uint8_t* d, const uint8_t* p,
                                                                      size_t n, size_t min_blocks, Blocks blocks,
                                                                      Shorter shorter) {
  size_t head = (kAlign - (reinterpret_cast<uintptr_t>(d) & (kAlign - 1))) & (kAlign - 1);
  if (n < min_blocks + head) return shorter(reg, d, p, n);
  std::memcpy(d, p, head);
  reg = sse42_update(reg, p, head);
  p += head, d += head, n -= head;
  reg = blocks(reg, p, d, n);
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
  std::memcpy(d, p, n);
  return sse42_update(reg, p, n);
}

__attribute__((target("sse4.2,pclmul"))) uint32_t pclmul_copy(uint32_t reg, uint8_t* d, const uint8_t* p,
                                                              size_t n) {
  return folding_copy<16>(reg, d, p, n, kFoldMin, pclmul_blocks<true>,
                          [](uint32_t r, uint8_t* dst, const uint8_t* src, size_t len) {
                            std::memcpy(dst, src, len);
                            return sse42_update(r, src, len);
                          });
}

// ---- The same folding, four 128-bit blocks to a 512-bit register (AVX-512 with VPCLMULQDQ) ------
//
// Four ZMM accumulators hold 16 consecutive 16-byte blocks; every block folds over the 256 bytes to
// its next one, so one constant pair serves all 16. At the end the blocks are folded into one in
// order, exactly as the 128-bit kernel's lanes are. About 3x the 128-bit kernel's bytes per cycle.
#define RECSAVE_WIDE __attribute__((target("sse4.2,pclmul,avx512f,avx512vl,vpclmulqdq")))

constexpr int kWideLanes = 4;
constexpr size_t kWideStride = 64 * kWideLanes;  // bytes consumed per loop iteration
constexpr size_t kWideMin = 2 * kWideStride;     // shorter buffers go through the 128-bit kernel
constexpr uint64_t kWideLo = xpow_mod(8 * kWideStride + 31), kWideHi = xpow_mod(8 * kWideStride - 33);

// The 64 bytes at p + i, also stored at d + i (64-byte aligned, bypassing the cache) when kCopy.
template <bool kCopy>
RECSAVE_WIDE inline __m512i take64(const uint8_t* p, uint8_t* d, size_t i) {
  __m512i v = _mm512_loadu_si512(p + i);
  if (kCopy) _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), v);
  return v;
}

// As pclmul_blocks, for n >= kWideMin bytes (d 64-byte aligned when kCopy).
template <bool kCopy>
RECSAVE_WIDE uint32_t vpclmul_blocks(uint32_t reg, const uint8_t*& p, uint8_t*& d, size_t& n) {
  const long long far_lo = static_cast<long long>(kWideLo), far_hi = static_cast<long long>(kWideHi);
  const __m512i far = _mm512_set_epi64(far_hi, far_lo, far_hi, far_lo, far_hi, far_lo, far_hi, far_lo);
  const __m128i near = _mm_set_epi64x(static_cast<long long>(kNearHi), static_cast<long long>(kNearLo));
  __m512i a[kWideLanes];
#pragma GCC unroll 4
  for (int l = 0; l < kWideLanes; ++l) a[l] = take64<kCopy>(p, d, 64 * l);
  a[0] = _mm512_xor_si512(a[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(reg))));
  size_t i = kWideStride;
  for (; n - i >= kWideStride; i += kWideStride) {
#pragma GCC unroll 4
    for (int l = 0; l < kWideLanes; ++l) {
      __m512i lo = _mm512_clmulepi64_epi128(a[l], far, 0x00);
      __m512i hi = _mm512_clmulepi64_epi128(a[l], far, 0x11);
      a[l] = _mm512_ternarylogic_epi64(lo, hi, take64<kCopy>(p, d, i + 64 * l), 0x96);  // lo ^ hi ^ next
    }
  }
  // The lanes' 16 blocks, in order, folded into one.
  alignas(64) __m128i blocks[4 * kWideLanes];
#pragma GCC unroll 4
  for (int l = 0; l < kWideLanes; ++l) _mm512_store_si512(reinterpret_cast<__m512i*>(blocks + 4 * l), a[l]);
  __m128i x = blocks[0];
  for (int b = 1; b < 4 * kWideLanes; ++b) x = fold(x, near, blocks[b]);
  return finish_folding<kCopy>(x, near, i, p, d, n);
}

RECSAVE_WIDE uint32_t vpclmul_update(uint32_t reg, const uint8_t* p, size_t n) {
  if (n < kWideMin) return pclmul_update(reg, p, n);
  uint8_t* unused = nullptr;
  reg = vpclmul_blocks<false>(reg, p, unused, n);
  return sse42_update(reg, p, n);
}

RECSAVE_WIDE uint32_t vpclmul_copy(uint32_t reg, uint8_t* d, const uint8_t* p, size_t n) {
  return folding_copy<64>(reg, d, p, n, kWideMin, vpclmul_blocks<true>, pclmul_copy);
}

bool cpu_has(Crc32cKernel kernel) {
  __builtin_cpu_init();
  switch (kernel) {
    case Crc32cKernel::kPortable: return true;
    case Crc32cKernel::kSse42: return __builtin_cpu_supports("sse4.2");
    case Crc32cKernel::kPclmul: return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul");
    case Crc32cKernel::kVpclmul:
      return cpu_has(Crc32cKernel::kPclmul) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
  }
  return false;
}

#else

bool cpu_has(Crc32cKernel kernel) { return kernel == Crc32cKernel::kPortable; }

#endif

// Raw register update through `kernel` (which the CPU must support).
uint32_t update_with(Crc32cKernel kernel, uint32_t reg, const uint8_t* p, size_t n) {
  switch (kernel) {
#ifdef RECSAVE_CRC_X86
    case Crc32cKernel::kVpclmul: return vpclmul_update(reg, p, n);
    case Crc32cKernel::kPclmul: return pclmul_update(reg, p, n);
    case Crc32cKernel::kSse42: return sse42_update(reg, p, n);
#endif
    default: return portable_update(reg, p, n);
  }
}

uint32_t copy_with(Crc32cKernel kernel, uint32_t reg, uint8_t* d, const uint8_t* p, size_t n) {
#ifdef RECSAVE_CRC_X86
  if (kernel == Crc32cKernel::kVpclmul) return vpclmul_copy(reg, d, p, n);
  if (kernel == Crc32cKernel::kPclmul) return pclmul_copy(reg, d, p, n);
#endif
  std::memcpy(d, p, n);
  return update_with(kernel, reg, p, n);
}

// Products modulo P in CRC-register form, for combining: bit k of a register is the coefficient of
// x^(31-k), so multiplying by x is one step of the bitwise CRC.
uint32_t times_x(uint32_t a) { return (a >> 1) ^ (kPoly & (0u - (a & 1u))); }

uint32_t multiply_mod(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (int i = 0; i < 32; ++i, b = times_x(b)) {  // b is now (original b) * x^i
    if (a & (0x80000000u >> i)) product ^= b;
  }
  return product;
}

// x^(8n) mod P: a product of x^(2^k) mod P over the bits k of 8n.
uint32_t x_pow_8n(uint64_t n) {
  struct Squares {
    uint32_t x2k[67];  // x^(2^k) mod P; 8n < 2^67
    Squares() {
      x2k[0] = 0x40000000u;  // x^1
      for (int k = 1; k < 67; ++k) x2k[k] = multiply_mod(x2k[k - 1], x2k[k - 1]);
    }
  };
  static const Squares squares;
  uint32_t result = 0x80000000u;  // x^0
  for (int k = 3; n; ++k, n >>= 1) {
    if (n & 1) result = multiply_mod(result, squares.x2k[k]);
  }
  return result;
}

Crc32cKernel best_hardware() {
  static const Crc32cKernel best = cpu_has(Crc32cKernel::kVpclmul) ? Crc32cKernel::kVpclmul
                                   : cpu_has(Crc32cKernel::kPclmul) ? Crc32cKernel::kPclmul
                                   : cpu_has(Crc32cKernel::kSse42) ? Crc32cKernel::kSse42
                                                                   : Crc32cKernel::kPortable;
  return best;
}

Crc32cKernel selected() {
  static const Crc32cKernel kernel = [] {
    if (const char* force = std::getenv("RECSAVE_CRC32C_PORTABLE")) {
      if (force[0] && force[0] != '0') return Crc32cKernel::kPortable;
    }
    portable_tables();  // build the tables before threads race to first use
    x_pow_8n(1);
    return best_hardware();
  }();
  return kernel;
}

}  // namespace

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  return ~portable_update(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c_hardware(uint32_t crc, const void* data, size_t n) {
  return ~update_with(best_hardware(), ~crc, static_cast<const uint8_t*>(data), n);
}

bool crc32c_hardware_available() { return best_hardware() != Crc32cKernel::kPortable; }

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  return ~update_with(selected(), ~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // With inversion, crc(A B) = ~(raw(~crc_a, B)) and raw is linear, so the initial registers cancel
  // out: crc(A B) = crc_a * x^(8|B|) + crc_b.
  return multiply_mod(crc_a, x_pow_8n(len_b)) ^ crc_b;
}

uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n) {
  return ~copy_with(selected(), ~crc, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
}

bool crc32c_kernel_available(Crc32cKernel kernel) { return cpu_has(kernel); }

uint32_t crc32c_with(Crc32cKernel kernel, uint32_t crc, const void* data, size_t n) {
  return ~update_with(kernel, ~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c_copy_with(Crc32cKernel kernel, uint32_t crc, void* dst, const void* src, size_t n) {
  return ~copy_with(kernel, ~crc, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
}

const char* crc32c_kernel_name(Crc32cKernel kernel) {
  switch (kernel) {
    case Crc32cKernel::kVpclmul: return "vpclmul";
    case Crc32cKernel::kPclmul: return "pclmul";
    case Crc32cKernel::kSse42: return "sse4.2";
    case Crc32cKernel::kPortable: return "portable";
  }
  return "unknown";
}

Crc32cKernel crc32c_selected_kernel() { return selected(); }

}  // namespace recsave
