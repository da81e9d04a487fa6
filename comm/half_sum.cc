#include "comm/half_sum.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "core/isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DTRAIN_HALF_SUM_X86 1
#endif

namespace dtrain::comm {
namespace {

template <typename T>
void scalar_sum(const uint16_t* in, uint16_t* inout, int64_t i, int64_t n) {
  for (; i < n; ++i) {
    T a, b;
    std::memcpy(&a, in + i, sizeof a);
    std::memcpy(&b, inout + i, sizeof b);
    const T s(static_cast<float>(a) + static_cast<float>(b));
    std::memcpy(inout + i, &s, sizeof s);
  }
}

#ifdef DTRAIN_HALF_SUM_X86

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized once inlined (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

__attribute__((target("avx512f"))) __m512 bf16_to_float(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// c10::BFloat16(float): NaN -> 0x7fc0, else round to nearest even on the upper 16 bits.
__attribute__((target("avx512f"))) __m256i float_to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

template <bool kBF16>
__attribute__((target("avx512f"))) void avx512_sum(const uint16_t* in, uint16_t* inout, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(inout + i));
    __m256i s;
    if constexpr (kBF16) {
      s = float_to_bf16(_mm512_add_ps(bf16_to_float(a), bf16_to_float(b)));
    } else {
      s = _mm512_cvtps_ph(_mm512_add_ps(_mm512_cvtph_ps(a), _mm512_cvtph_ps(b)),
                          _MM_FROUND_TO_NEAREST_INT);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(inout + i), s);
  }
  if constexpr (kBF16) {
    scalar_sum<c10::BFloat16>(in, inout, i, n);
  } else {
    scalar_sum<c10::Half>(in, inout, i, n);
  }
}

#pragma GCC diagnostic pop

__attribute__((target("avx2,f16c"))) __m256 bf16_to_float8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,f16c"))) __m128i float_to_bf16_8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // Every lane is below 2^16: the unsigned saturating pack keeps it.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <bool kBF16>
__attribute__((target("avx2,f16c"))) void avx2_sum(const uint16_t* in, uint16_t* inout, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(inout + i));
    __m128i s;
    if constexpr (kBF16) {
      s = float_to_bf16_8(_mm256_add_ps(bf16_to_float8(a), bf16_to_float8(b)));
    } else {
      s = _mm256_cvtps_ph(_mm256_add_ps(_mm256_cvtph_ps(a), _mm256_cvtph_ps(b)),
                          _MM_FROUND_TO_NEAREST_INT);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(inout + i), s);
  }
  if constexpr (kBF16) {
    scalar_sum<c10::BFloat16>(in, inout, i, n);
  } else {
    scalar_sum<c10::Half>(in, inout, i, n);
  }
}

#endif  // DTRAIN_HALF_SUM_X86

template <bool kBF16>
void sum(const uint16_t* in, uint16_t* inout, int64_t n) {
#ifdef DTRAIN_HALF_SUM_X86
  const VectorIsa isa = vector_isa();
  if (isa == VectorIsa::kAvx512) return avx512_sum<kBF16>(in, inout, n);
  if (isa == VectorIsa::kAvx2) return avx2_sum<kBF16>(in, inout, n);
#endif
  if constexpr (kBF16) {
    scalar_sum<c10::BFloat16>(in, inout, 0, n);
  } else {
    scalar_sum<c10::Half>(in, inout, 0, n);
  }
}

}  // namespace

void sum_into(const uint16_t* in, uint16_t* inout, int64_t n, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kBFloat16:
      return sum<true>(in, inout, n);
    case c10::kHalf:
      return sum<false>(in, inout, n);
    default:
      throw std::invalid_argument(std::string("sum_into: not a 16-bit float dtype: ") +
                                  c10::toString(dtype));
  }
}

}  // namespace dtrain::comm
