#include "sharding/widen.h"

#include <c10/util/Half.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "core/isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DTRAIN_WIDEN_X86 1
#endif

namespace dtrain::sharding {
namespace {

enum class Src { kF32, kBF16, kF16 };
constexpr uint32_t kExponent = 0x7f800000;

template <Src S>
float load_one(const void* src, int64_t i) {
  if constexpr (S == Src::kF32) {
    return static_cast<const float*>(src)[i];
  } else if constexpr (S == Src::kBF16) {
    const uint32_t bits = uint32_t{static_cast<const uint16_t*>(src)[i]} << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  } else {
    return c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(src)[i]);
  }
}

// Elements [i, n), one at a time: the tail of the vector loops, and the whole loop on CPUs
// without them.
template <Src S, bool kDivide, bool kMultiply, bool kStore>
bool scalar_loop(const void* src, float* dst, int64_t i, int64_t n, float divide, float multiply) {
  uint32_t bad = 0;
  for (; i < n; ++i) {
    float x = load_one<S>(src, i);
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bad |= static_cast<uint32_t>((bits & kExponent) == kExponent);
    if constexpr (kDivide) x = x / divide;
    if constexpr (kMultiply) x = x * multiply;
    if constexpr (kStore) dst[i] = x;
  }
  return bad != 0;
}

#ifdef DTRAIN_WIDEN_X86

// GCC 12's AVX-512 headers leave a dummy operand uninitialized on purpose (_mm512_undefined_*),
// which -Wmaybe-uninitialized reports once the intrinsics are inlined (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

template <Src S, bool kDivide, bool kMultiply, bool kStore>
__attribute__((target("avx512f"))) bool avx512_loop(const void* src, float* dst, int64_t n,
                                                    float divide, float multiply) {
  const __m512 vdivide = _mm512_set1_ps(divide);
  const __m512 vmultiply = _mm512_set1_ps(multiply);
  const __m512i exponent = _mm512_set1_epi32(static_cast<int>(kExponent));
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 x;
    if constexpr (S == Src::kF32) {
      x = _mm512_loadu_ps(static_cast<const float*>(src) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + i));
      if constexpr (S == Src::kBF16) {
        x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        x = _mm512_cvtph_ps(h);
      }
    }
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), exponent), exponent);
    if constexpr (kDivide) x = _mm512_div_ps(x, vdivide);
    if constexpr (kMultiply) x = _mm512_mul_ps(x, vmultiply);
    if constexpr (kStore) _mm512_storeu_ps(dst + i, x);
  }
  const bool tail = scalar_loop<S, kDivide, kMultiply, kStore>(src, dst, i, n, divide, multiply);
  return bad != 0 || tail;
}

template <Src S, bool kDivide, bool kMultiply, bool kStore>
__attribute__((target("avx2,f16c"))) bool avx2_loop(const void* src, float* dst, int64_t n,
                                                    float divide, float multiply) {
  const __m256 vdivide = _mm256_set1_ps(divide);
  const __m256 vmultiply = _mm256_set1_ps(multiply);
  const __m256i exponent = _mm256_set1_epi32(static_cast<int>(kExponent));
  __m256i bad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x;
    if constexpr (S == Src::kF32) {
      x = _mm256_loadu_ps(static_cast<const float*>(src) + i);
    } else {
      const __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i));
      if constexpr (S == Src::kBF16) {
        x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        x = _mm256_cvtph_ps(h);
      }
    }
    const __m256i masked = _mm256_and_si256(_mm256_castps_si256(x), exponent);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(masked, exponent));
    if constexpr (kDivide) x = _mm256_div_ps(x, vdivide);
    if constexpr (kMultiply) x = _mm256_mul_ps(x, vmultiply);
    if constexpr (kStore) _mm256_storeu_ps(dst + i, x);
  }
  const bool tail = scalar_loop<S, kDivide, kMultiply, kStore>(src, dst, i, n, divide, multiply);
  return !_mm256_testz_si256(bad, bad) || tail;
}

#pragma GCC diagnostic pop

#endif  // DTRAIN_WIDEN_X86

template <Src S, bool kDivide, bool kMultiply, bool kStore>
bool dispatch(const void* src, float* dst, int64_t n, float divide, float multiply) {
#ifdef DTRAIN_WIDEN_X86
  const VectorIsa isa = vector_isa();
  if (isa == VectorIsa::kAvx512) {
    return avx512_loop<S, kDivide, kMultiply, kStore>(src, dst, n, divide, multiply);
  }
  if (isa == VectorIsa::kAvx2) {
    return avx2_loop<S, kDivide, kMultiply, kStore>(src, dst, n, divide, multiply);
  }
#endif
  return scalar_loop<S, kDivide, kMultiply, kStore>(src, dst, 0, n, divide, multiply);
}

template <Src S>
bool by_operations(const void* src, float* dst, int64_t n, float divide, float multiply) {
  const bool d = divide != 1.0f, m = multiply != 1.0f;
  if (d && m) return dispatch<S, true, true, true>(src, dst, n, divide, multiply);
  if (d) return dispatch<S, true, false, true>(src, dst, n, divide, multiply);
  if (m) return dispatch<S, false, true, true>(src, dst, n, divide, multiply);
  // fp32 in place with nothing to do: the check alone, without rewriting the values.
  if (S == Src::kF32 && src == dst) return dispatch<S, false, false, false>(src, dst, n, 1, 1);
  return dispatch<S, false, false, true>(src, dst, n, divide, multiply);
}

}  // namespace

bool widen_checked(const void* src, c10::ScalarType src_dtype, float* dst, int64_t n, float divide,
                   float multiply) {
  switch (src_dtype) {
    case c10::kFloat:
      return by_operations<Src::kF32>(src, dst, n, divide, multiply);
    case c10::kBFloat16:
      return by_operations<Src::kBF16>(src, dst, n, divide, multiply);
    case c10::kHalf:
      return by_operations<Src::kF16>(src, dst, n, divide, multiply);
    default:
      throw std::invalid_argument(std::string("widen_checked: unsupported source dtype ") +
                                  c10::toString(src_dtype));
  }
}

}  // namespace dtrain::sharding
