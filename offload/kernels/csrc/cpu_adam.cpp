// CPU Adam / AdamW over flat fp32 shards, at memory-bandwidth speed.
//
// One pass per element: read the fp32 master weight, exp_avg, exp_avg_sq and the gradient (bf16, fp16 or
// fp32), write the three fp32 states back and, optionally, the new weight in bf16/fp16 (round to nearest
// even) into a caller-given buffer. bf16 grads + bf16 out move 2+12 read + 12+2 written = 28 bytes/param.
//
// [Note: instruction set chosen at run time]
// The extension is compiled for the baseline x86-64 target (no -march=native: the build cache may be
// shared between machines, and a wheel must run anywhere). The AVX-512 and AVX2 kernels live in
// `#pragma GCC target` regions and are picked with __builtin_cpu_supports when called. Inside those
// regions we use only intrinsics and functions defined in the region (no std:: templates), so no
// out-of-line copy of a shared inline function can be emitted with AVX-512 code in it. The AVX-512
// region's target includes avx512bf16 for one intrinsic (vcvtneps2bf16), used only by the
// `adam_range_ne` and `adam8_range<G, BF16, true>` instantiations, which only the avx512bf16 level (a CPU
// reporting it) dispatches to. A third region adds avx512vbmi for the int8 step's map reads
// ([Note: map reads by byte planes]): the avx512bf16 level runs it where the CPU also reports VBMI.
//
// [Note: matching torch bit for bit where it matters]
// The math mirrors torch's fused CPU Adam (lerp for exp_avg, sqrt(v)/sqrt(bc2)+eps, AdamW decay applied
// to the weight first); fp32 results differ from torch.optim.AdamW by a few ulps. The bf16 output is
// c10::BFloat16's round-to-nearest-even (integer arithmetic, or vcvtneps2bf16 with a fix-up for the
// lanes where its DAZ and NaN handling differ), so it is bit-exact with `master.to(torch.bfloat16)`,
// denormals included. fp16 uses F16C/AVX-512 cvtps2ph with
// round-to-nearest-even, which is IEEE-exact like c10::Half.

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define OFFLOAD_X86 1
#include <immintrin.h>
#endif

namespace {

enum Dt : int { F32 = 0, BF16 = 1, F16 = 2, NONE = 3 };
enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512BF16 = 3 };

// Per-step constants, computed once in double and rounded to float (see adam_coeffs below).
struct Coeffs {
  float lerp_w;         // exp_avg = exp_avg + lerp_w * (g - exp_avg)   (torch lerp, weight 1 - beta1 < 0.5)
  bool lerp_from_grad;  // weight >= 0.5: torch computes g + (lerp_w - 1) * (g - exp_avg) instead
  float beta2, beta2_c; // exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
  float neg_step_size;  // -lr / (1 - beta1^step)
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^step)
  float eps;
  float decay;          // AdamW: param *= 1 - lr * wd before the update (1 when off)
  float l2;             // Adam: g += wd * param (0 when off)
  float inv_scale;      // g = grad / grad_scale, as a multiply
  bool scaled;
};

struct Ptrs {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* out;
  bool stream_out;  // non-temporal stores for `out` (see [Note: streaming the weight output])
};

using AdamFn = void (*)(const Ptrs&, const Coeffs&, int64_t, int64_t);
using SqFn = double (*)(const void*, int64_t, int64_t);
using DigestFn = void (*)(const float*, int64_t, int64_t, uint64_t&, uint64_t&);

// [Note: the int8 step]
// quant8.adam8_step, compiled ([Note: int8 optimizer states] in offload/kernels/quant8.py): per block of
// kBlock elements, one pass dequantizes m and v (map value x block absmax), does the reference's fp32
// operations in its order, each rounded on its own (separate multiplies and adds: the library is built with
// -ffp-contract=off so the compiler fuses none either), writes the weight, keeps the block's new m and v
// in a local buffer for their absmax, then writes their codes. Same bits as the reference (tested).
constexpr int64_t kBlock = 256;          // elements per absmax (quant8.BLOCK)
constexpr int64_t kLutNumel = 1 << 16;  // buckets: the top 16 bits of an fp32

// The int8 step's constants, each computed in double and rounded to fp32 once (quant8.coefficients).
struct Coeffs8 {
  float beta1, beta1_c, beta2, beta2_c, neg_step_size, inv_bc2_sqrt, eps;
  float decay;      // AdamW: param * (1 - lr * wd) first (1 for Adam)
  float l2;         // Adam: g + param * wd (0 for AdamW)
  float inv_scale;  // g * (1 / grad_scale)
  bool scaled;
};

// [Note: nearest code by bucket]
// x = value / absmax in [-1, 1] takes the code of the nearest map value, ties to the lower: the number of
// midpoints strictly below x (quant8.codes_of's searchsorted). Bucketed by its top 16 bits (sign,
// exponent, 7 mantissa bits), no bucket holds more than one midpoint of either map (checked where the
// tables are built: offload.kernels.adam8.kernel_tables), so the code is c, the midpoints below the
// bucket's smallest value, plus one if x lies above the bucket's midpoint. That midpoint shares x's top 16
// bits, so comparing the low 16 bits decides (reversed for negatives, larger bits meaning smaller values):
// lut[bucket] = c << 16 | t, t the midpoint's low 16 bits (xor 0xFFFF when negative; 0xFFFF when the
// bucket has none), and code = c + ((low 16 bits of x, xor 0xFFFF when negative) > t). One table read a
// value, no search: two reads (c, then a table of midpoints at c to compare x with) took 1.4x the time of
// the whole step in a cache-resident micro-benchmark on the AMD EPYC (Zen, family 23) build host.
struct Tables8 {
  const float* map[2];     // 256 sorted values each: [0] signed (m), [1] unsigned (v)
  const uint32_t* lut[2];  // kLutNumel entries each
};

struct Ptrs8 {
  float* p;
  const void* g;
  uint8_t *mc, *vc;  // codes
  float *ma, *va;    // block absmax
  void* out;
  bool stream_out;   // see [Note: streaming the weight output]
  Tables8 t;
};

using Adam8Fn = void (*)(const Ptrs8&, const Coeffs8&, int64_t, int64_t);
using Quant8Fn = void (*)(const float*, uint8_t*, float*, const uint32_t*, int64_t, int64_t);

// ---------------------------------------------------------------- scalar (any CPU; also AVX2 tails)
// std::fma where the vector kernels fuse, so every path rounds alike (it is a libm call on CPUs without
// FMA, which only the pre-AVX2 fallback runs on).
namespace scalar {

template <int G>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (G == F32) return static_cast<const float*>(g)[i];
  if constexpr (G == BF16) return static_cast<float>(static_cast<const c10::BFloat16*>(g)[i]);
  if constexpr (G == F16) return static_cast<float>(static_cast<const c10::Half*>(g)[i]);
  return 0.f;
}

template <int O>
inline void store_out(void* out, int64_t i, float x) {
  if constexpr (O == BF16) static_cast<c10::BFloat16*>(out)[i] = c10::BFloat16(x);  // RNE, NaN -> 0x7FC0
  if constexpr (O == F16) static_cast<c10::Half*>(out)[i] = c10::Half(x);
}

template <int G, int O>
void adam_range(const Ptrs& a, const Coeffs& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad<G>(a.g, i);
    if (c.scaled) g *= c.inv_scale;
    float p = a.p[i] * c.decay;
    if (c.l2 != 0.f) g = std::fma(c.l2, p, g);
    float m = a.m[i];
    m = c.lerp_from_grad ? std::fma(c.lerp_w - 1.f, g - m, g) : std::fma(c.lerp_w, g - m, m);
    float v = std::fma(c.beta2_c * g, g, a.v[i] * c.beta2);
    float denom = std::fma(std::sqrt(v), c.inv_bc2_sqrt, c.eps);
    p = std::fma(c.neg_step_size, m / denom, p);
    a.p[i] = p;
    a.m[i] = m;
    a.v[i] = v;
    store_out<O>(a.out, i, p);
  }
}

template <int G>
double sq_range(const void* g, int64_t begin, int64_t end) {
  double acc = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    double x = load_grad<G>(g, i);
    acc += x * x;
  }
  return acc;
}

// The swap digest of fp32 elements [begin, end) (begin even): sum and xor of the little-endian 64-bit
// words; an odd last element counts as swap.integrity.block_digest counts a 4-byte tail (s += u, x ^= u << 1).
// Written once as a plain loop and defined in each ISA namespace below, where the compiler vectorizes it
// to that region's width (sums and xors commute, so lane order does not matter). It reads what the step
// has in cache (see [Note: swap digests in the step]).
#define OFFLOAD_DEFINE_DIGEST_RANGE                                                                    \
  inline void digest_range(const float* a, int64_t begin, int64_t end, uint64_t& s, uint64_t& x) {    \
    const uint64_t* w = reinterpret_cast<const uint64_t*>(a + begin);                                 \
    const int64_t n = (end - begin) / 2;                                                              \
    uint64_t sum = s, acc = x;                                                                        \
    for (int64_t i = 0; i < n; ++i) {                                                                 \
      sum += w[i];                                                                                    \
      acc ^= w[i];                                                                                    \
    }                                                                                                 \
    if ((end - begin) % 2) {                                                                          \
      const uint64_t u = reinterpret_cast<const uint32_t*>(a)[end - 1];                               \
      sum += u;                                                                                       \
      acc ^= u << 1;                                                                                  \
    }                                                                                                 \
    s = sum;                                                                                          \
    x = acc;                                                                                          \
  }


// ---- int8 states ([Note: the int8 step], [Note: nearest code by bucket])

inline uint8_t code_of(float x, const uint32_t* lut) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t e = lut[bits >> 16];
  const uint32_t low = (bits ^ (bits >> 31 ? 0xFFFFu : 0u)) & 0xFFFFu;
  return static_cast<uint8_t>((e >> 16) + (low > (e & 0xFFFFu)));
}

// Codes of the block x[0, kBlock) / absmax; a zero block gets the zero's code (quant8.codes_of).
inline void quantize_block(const float* x, float absmax, const uint32_t* lut, uint8_t* codes) {
  const bool zero = !(absmax > 0.f);
  for (int64_t j = 0; j < kBlock; ++j) codes[j] = code_of(zero ? 0.f : x[j] / absmax, lut);
}

inline float block_absmax(const float* x) {
  float r = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) r = std::max(r, std::fabs(x[j]));
  return r;
}

// Blocks [begin, end) of x quantized alone (the tests' look at the step's quantization).
inline void quantize_range(const float* x, uint8_t* codes, float* absmax, const uint32_t* lut,
                           int64_t begin, int64_t end) {
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    absmax[b0 / kBlock] = block_absmax(x + b0);
    quantize_block(x + b0, absmax[b0 / kBlock], lut, codes + b0);
  }
}

template <int G, int O>
void adam8_range(const Ptrs8& a, const Coeffs8& c, int64_t begin, int64_t end) {
  float mb[kBlock], vb[kBlock];  // the block's new m and v, until their absmax is known
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t blk = b0 / kBlock;
    const float m_abs = a.ma[blk], v_abs = a.va[blk];
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t i = b0 + j;
      float g = load_grad<G>(a.g, i);
      if (c.scaled) g = g * c.inv_scale;
      float p = a.p[i] * c.decay;
      if (c.l2 != 0.f) g = g + p * c.l2;
      const float m = a.t.map[0][a.mc[i]] * m_abs * c.beta1 + g * c.beta1_c;
      const float v = a.t.map[1][a.vc[i]] * v_abs * c.beta2 + g * g * c.beta2_c;
      const float denom = std::sqrt(v) * c.inv_bc2_sqrt + c.eps;
      p = p + m / denom * c.neg_step_size;
      a.p[i] = p;
      store_out<O>(a.out, i, p);
      mb[j] = m;
      vb[j] = v;
    }
    a.ma[blk] = block_absmax(mb);
    a.va[blk] = block_absmax(vb);
    quantize_block(mb, a.ma[blk], a.t.lut[0], a.mc + b0);
    quantize_block(vb, a.va[blk], a.t.lut[1], a.vc + b0);
  }
}

OFFLOAD_DEFINE_DIGEST_RANGE

}  // namespace scalar

#ifdef OFFLOAD_X86
// ---------------------------------------------------------------- AVX-512 (16 lanes, masked tails)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#endif
namespace avx512 {

// Per-step constants, broadcast once per call into locals: the intrinsics' stores may alias anything,
// so values read through a reference (Coeffs, Ptrs) would be reloaded after every store.
struct K {
  __m512 inv_scale, decay, l2, lerp_w, beta2, beta2_c, neg_step_size, inv_bc2_sqrt, eps;
  bool scaled, has_l2, from_grad;
};

inline K broadcast(const Coeffs& c) {
  return K{_mm512_set1_ps(c.inv_scale), _mm512_set1_ps(c.decay), _mm512_set1_ps(c.l2),
           _mm512_set1_ps(c.lerp_from_grad ? c.lerp_w - 1.f : c.lerp_w), _mm512_set1_ps(c.beta2),
           _mm512_set1_ps(c.beta2_c), _mm512_set1_ps(c.neg_step_size), _mm512_set1_ps(c.inv_bc2_sqrt),
           _mm512_set1_ps(c.eps), c.scaled, c.l2 != 0.f, c.lerp_from_grad};
}

template <int G, bool kTail>
inline __m512 load_grad(const void* g, int64_t i, __mmask16 k) {
  if constexpr (G == F32) {
    const float* src = static_cast<const float*>(g) + i;
    return kTail ? _mm512_maskz_loadu_ps(k, src) : _mm512_loadu_ps(src);
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(g) + i;
    __m256i h = kTail ? _mm256_maskz_loadu_epi16(k, src) : _mm256_loadu_si256((const __m256i*)src);
    if constexpr (G == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}

template <bool kTail>
inline __m512 load(const float* src, __mmask16 k) {
  return kTail ? _mm512_maskz_loadu_ps(k, src) : _mm512_loadu_ps(src);
}

template <bool kTail>
inline void store(float* dst, __m512 x, __mmask16 k) {
  if (kTail) _mm512_mask_storeu_ps(dst, k, x);
  else _mm512_storeu_ps(dst, x);
}

// c10::BFloat16's round_to_nearest_even, 16 lanes: (bits + 0x7FFF + lsb) >> 16, NaN -> 0x7FC0.
inline __m256i to_bf16(__m512 x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0)));
}

// [Note: vcvtneps2bf16 with a fix-up]
// AVX512_BF16's vcvtneps2bf16 rounds to nearest even in one instruction, but reads denormal inputs as
// zero and keeps NaN payloads, where c10::BFloat16 rounds denormals and writes 0x7FC0 for every NaN.
// Normal inputs never round to a bf16 denormal (same exponent range), so only lanes whose input is a
// denormal or a NaN differ: those (rare) vectors take the integer path above. Bit-exact either way.
template <bool kNe>
inline __m256i to_bf16_fast(__m512 x) {
  if constexpr (kNe) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    const __mmask16 odd = _mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80);  // QNaN, denormal, SNaN
    if (__builtin_expect(odd != 0, 0)) h = to_bf16(x);
    return h;
  } else {
    return to_bf16(x);
  }
}

template <int O, bool kNe, bool kTail>
inline void store_out(void* out, int64_t i, __m512 x, __mmask16 k, bool stream) {
  if constexpr (O == NONE) return;
  __m256i h;
  if constexpr (O == BF16) h = to_bf16_fast<kNe>(x);
  else h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  uint16_t* dst = static_cast<uint16_t*>(out) + i;
  if (kTail) _mm256_mask_storeu_epi16(dst, k, h);
  else if (stream) _mm256_stream_si256((__m256i*)dst, h);
  else _mm256_storeu_si256((__m256i*)dst, h);
}

// One vector of the update. kPlain: no grad scale, no L2 term, lerp from exp_avg (AdamW, bf16 training).
template <int G, int O, bool kPlain, bool kNe, bool kTail, bool kStoreOut = true>
inline __m512 step16(float* p_, const void* g_, float* m_, float* v_, void* out, int64_t i, __mmask16 k,
                     const K& c, bool stream) {
  __m512 g = load_grad<G, kTail>(g_, i, k);
  if (!kPlain && c.scaled) g = _mm512_mul_ps(g, c.inv_scale);
  __m512 p = _mm512_mul_ps(load<kTail>(p_ + i, k), c.decay);
  if (!kPlain && c.has_l2) g = _mm512_fmadd_ps(c.l2, p, g);  // 0 * inf would be nan
  __m512 m = load<kTail>(m_ + i, k);
  m = _mm512_fmadd_ps(c.lerp_w, _mm512_sub_ps(g, m), (!kPlain && c.from_grad) ? g : m);
  __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(c.beta2_c, g), g, _mm512_mul_ps(load<kTail>(v_ + i, k), c.beta2));
  __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), c.inv_bc2_sqrt, c.eps);
  p = _mm512_fmadd_ps(c.neg_step_size, _mm512_div_ps(m, denom), p);
  store<kTail>(p_ + i, p, k);
  store<kTail>(m_ + i, m, k);
  store<kTail>(v_ + i, v, k);
  if constexpr (kStoreOut) store_out<O, kNe, kTail>(out, i, p, k, stream);
  return p;
}

template <int O, bool kNe>
inline __m256i to_half(__m512 x) {
  if constexpr (O == BF16) return to_bf16_fast<kNe>(x);
  else return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <int G, int O, bool kPlain, bool kNe>
void adam_loop(const Ptrs& a, const K& k, int64_t begin, int64_t end) {
  const K c = k;  // locals: see K
  float* const p = a.p;
  const void* const g = a.g;
  float* const m = a.m;
  float* const v = a.v;
  void* const out = a.out;
  const bool stream = a.stream_out;
  int64_t i = begin;
  if (O != NONE && stream) {
    // [Note: streaming the weight output] continued: two vectors per iteration so each non-temporal
    // store writes a whole 64-byte line (one write-combining buffer filled by one store); two 32-byte
    // halves with other stores between them measured slower (bench/RESULTS.md).
    for (; i + 32 <= end; i += 32) {
      const __m512 lo = step16<G, O, kPlain, kNe, false, false>(p, g, m, v, out, i, 0xFFFF, c, stream);
      const __m512 hi = step16<G, O, kPlain, kNe, false, false>(p, g, m, v, out, i + 16, 0xFFFF, c, stream);
      const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(to_half<O, kNe>(lo)), to_half<O, kNe>(hi), 1);
      _mm512_stream_si512((__m512i*)(static_cast<uint16_t*>(out) + i), h);
    }
  }
  for (; i + 16 <= end; i += 16) {
    step16<G, O, kPlain, kNe, false>(p, g, m, v, out, i, 0xFFFF, c, stream);
  }
  if (i < end) step16<G, O, kPlain, kNe, true>(p, g, m, v, out, i, (__mmask16)((1u << (end - i)) - 1u), c, stream);
  if (stream) _mm_sfence();  // order the non-temporal stores before the caller reads `out`
}

template <int G, int O, bool kNe>
void adam_range_isa(const Ptrs& a, const Coeffs& coeffs, int64_t begin, int64_t end) {
  const K c = broadcast(coeffs);
  if (c.scaled || c.has_l2 || c.from_grad) adam_loop<G, O, false, kNe>(a, c, begin, end);
  else adam_loop<G, O, true, kNe>(a, c, begin, end);
}

template <int G, int O>
void adam_range(const Ptrs& a, const Coeffs& c, int64_t begin, int64_t end) {
  adam_range_isa<G, O, false>(a, c, begin, end);
}

template <int G, int O>
void adam_range_ne(const Ptrs& a, const Coeffs& c, int64_t begin, int64_t end) {
  adam_range_isa<G, O, (O == BF16)>(a, c, begin, end);
}

// Squares accumulate in double: a finite bf16/fp32 gradient above ~1.8e19 must not read as overflow.
template <int G, bool kTail>
inline void sq16(const void* g, int64_t i, __mmask16 k, __m512d& lo_acc, __m512d& hi_acc) {
  __m512 x = load_grad<G, kTail>(g, i, k);
  __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  lo_acc = _mm512_fmadd_pd(lo, lo, lo_acc);
  hi_acc = _mm512_fmadd_pd(hi, hi, hi_acc);
}

template <int G>
double sq_range(const void* g, int64_t begin, int64_t end) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) sq16<G, false>(g, i, 0xFFFF, lo, hi);
  if (i < end) sq16<G, true>(g, i, (__mmask16)((1u << (end - i)) - 1u), lo, hi);
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

// ---- int8 states ([Note: the int8 step], [Note: nearest code by bucket])

struct K8 {
  __m512 beta1, beta1_c, beta2, beta2_c, neg_step_size, inv_bc2_sqrt, eps, decay, l2, inv_scale;
  bool scaled, has_l2;
};

inline K8 broadcast8(const Coeffs8& c) {
  return K8{_mm512_set1_ps(c.beta1), _mm512_set1_ps(c.beta1_c), _mm512_set1_ps(c.beta2), _mm512_set1_ps(c.beta2_c),
            _mm512_set1_ps(c.neg_step_size), _mm512_set1_ps(c.inv_bc2_sqrt), _mm512_set1_ps(c.eps),
            _mm512_set1_ps(c.decay), _mm512_set1_ps(c.l2), _mm512_set1_ps(c.inv_scale), c.scaled, c.l2 != 0.f};
}

// The 16 codes at `c` as fp32 values times the block's absmax. Scalar loads, not a gather, as in the AVX2
// path (and codes16's table reads): the int8 step is 1.12x faster so on an AVX512_BF16 Zen (bench/RESULTS.md).
inline __m512 dequant16(const uint8_t* c, const float* map, __m512 absmax) {
  const __m256 lo = _mm256_setr_ps(map[c[0]], map[c[1]], map[c[2]], map[c[3]], map[c[4]], map[c[5]], map[c[6]],
                                   map[c[7]]);
  const __m256 hi = _mm256_setr_ps(map[c[8]], map[c[9]], map[c[10]], map[c[11]], map[c[12]], map[c[13]], map[c[14]],
                                   map[c[15]]);
  return _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1), absmax);
}

inline __m128i codes16(__m512 x, const uint32_t* lut) {
  const __m512i bits = _mm512_castps_si512(x);
  alignas(64) uint32_t b[16];
  _mm512_store_si512((__m512i*)b, _mm512_srli_epi32(bits, 16));
  const __m512i e = _mm512_setr_epi32(lut[b[0]], lut[b[1]], lut[b[2]], lut[b[3]], lut[b[4]], lut[b[5]], lut[b[6]],
                                      lut[b[7]], lut[b[8]], lut[b[9]], lut[b[10]], lut[b[11]], lut[b[12]], lut[b[13]],
                                      lut[b[14]], lut[b[15]]);
  const __m512i ffff = _mm512_set1_epi32(0xFFFF);
  const __m512i low = _mm512_and_si512(_mm512_xor_si512(bits, _mm512_srai_epi32(bits, 31)), ffff);
  const __mmask16 above = _mm512_cmpgt_epi32_mask(low, _mm512_and_si512(e, ffff));
  const __m512i c = _mm512_srli_epi32(e, 16);
  return _mm512_cvtusepi32_epi8(_mm512_mask_add_epi32(c, above, c, _mm512_set1_epi32(1)));
}

inline void quantize_block(const float* x, float absmax, const uint32_t* lut, uint8_t* codes) {
  const __m512 am = _mm512_set1_ps(absmax);
  const bool zero = !(absmax > 0.f);
  for (int64_t j = 0; j < kBlock; j += 16) {
    const __m512 s = zero ? _mm512_setzero_ps() : _mm512_div_ps(_mm512_loadu_ps(x + j), am);
    _mm_storeu_si128((__m128i*)(codes + j), codes16(s, lut));
  }
}

inline void quantize_range(const float* x, uint8_t* codes, float* absmax, const uint32_t* lut,
                           int64_t begin, int64_t end) {
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t j = 0; j < kBlock; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + b0 + j)));
    absmax[b0 / kBlock] = _mm512_reduce_max_ps(mx);
    quantize_block(x + b0, absmax[b0 / kBlock], lut, codes + b0);
  }
}

// The 64 codes of m and of v at element i as fp32 values times their block's absmax (dequant16 four times).
struct ScalarLookups {
  const float *m_map, *v_map;
  explicit ScalarLookups(const Tables8& t) : m_map(t.map[0]), v_map(t.map[1]) {}
  void operator()(const uint8_t* mc, const uint8_t* vc, __m512 m_abs, __m512 v_abs, __m512* m, __m512* v) const {
    for (int q = 0; q < 4; ++q) {
      m[q] = dequant16(mc + 16 * q, m_map, m_abs);
      v[q] = dequant16(vc + 16 * q, v_map, v_abs);
    }
  }
};

// The step, 64 elements at a time; Deq dequantizes them (ScalarLookups, or avx512vbmi::PlaneLookups where the
// CPU has VBMI: that one is compiled for it and called, not inlined, once per 64 elements).
template <int G, int O, bool kNe, class Deq>
void adam8_loop(const Ptrs8& a, const Coeffs8& cf, int64_t begin, int64_t end) {
  const K8 c = broadcast8(cf);
  const Ptrs8 r = a;  // locals: see K
  const Deq deq(r.t);
  alignas(64) float mb[kBlock], vb[kBlock];
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t blk = b0 / kBlock;
    const __m512 m_abs = _mm512_set1_ps(r.ma[blk]), v_abs = _mm512_set1_ps(r.va[blk]);
    __m512 m_max = _mm512_setzero_ps(), v_max = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < kBlock; j0 += 64) {
      __m512 m_old[4], v_old[4];
      deq(r.mc + b0 + j0, r.vc + b0 + j0, m_abs, v_abs, m_old, v_old);
      for (int q = 0; q < 4; ++q) {
        const int64_t j = j0 + 16 * q, i = b0 + j;
        __m512 g = load_grad<G, false>(r.g, i, 0xFFFF);
        if (c.scaled) g = _mm512_mul_ps(g, c.inv_scale);
        __m512 p = _mm512_mul_ps(_mm512_loadu_ps(r.p + i), c.decay);
        if (c.has_l2) g = _mm512_add_ps(g, _mm512_mul_ps(p, c.l2));
        const __m512 m = _mm512_add_ps(_mm512_mul_ps(m_old[q], c.beta1), _mm512_mul_ps(g, c.beta1_c));
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(v_old[q], c.beta2), _mm512_mul_ps(_mm512_mul_ps(g, g), c.beta2_c));
        const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), c.inv_bc2_sqrt), c.eps);
        p = _mm512_add_ps(p, _mm512_mul_ps(_mm512_div_ps(m, denom), c.neg_step_size));
        _mm512_storeu_ps(r.p + i, p);
        store_out<O, kNe, false>(r.out, i, p, 0xFFFF, r.stream_out);
        _mm512_store_ps(mb + j, m);
        _mm512_store_ps(vb + j, v);
        m_max = _mm512_max_ps(m_max, _mm512_abs_ps(m));
        v_max = _mm512_max_ps(v_max, _mm512_abs_ps(v));
      }
    }
    const float m_new = _mm512_reduce_max_ps(m_max), v_new = _mm512_reduce_max_ps(v_max);
    r.ma[blk] = m_new;
    r.va[blk] = v_new;
    quantize_block(mb, m_new, r.t.lut[0], r.mc + b0);
    quantize_block(vb, v_new, r.t.lut[1], r.vc + b0);
  }
  if (r.stream_out) _mm_sfence();
}

template <int G, int O, bool kNe>
void adam8_range(const Ptrs8& a, const Coeffs8& cf, int64_t begin, int64_t end) {
  adam8_loop<G, O, kNe, ScalarLookups>(a, cf, begin, end);
}

OFFLOAD_DEFINE_DIGEST_RANGE

}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------- AVX-512 VBMI: the int8 step's map reads
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c")
#endif
namespace avx512vbmi {

// [Note: map reads by byte planes]
// Dequantizing reads 256-entry fp32 maps at 64 random codes; as loads (or gathers) that is 64 table reads.
// With VBMI, vpermt2b reads 64 bytes from a 128-byte table at once: each map is kept as four byte planes
// (byte k of every value, 256 bytes, four registers), each plane read with two vpermt2b (codes < 128 and
// >= 128) and a blend on the code's top bit, and the four planes' bytes interleaved into fp32 with the
// unpack instructions. Those interleave within 128-bit lanes, so the codes are first put in the order that
// makes the result come out in element order (kOrder). The same bits as the map's loads: 23 instructions
// for 64 values instead of 64 loads and the inserts that gather them into vectors.
struct PlaneLookups {
  __m512i planes[2][4][4];  // [map: m, v][byte k of the fp32 value][entries 64 q .. 64 q + 63]
  __m512i order;            // kOrder: position 16 L + 4 q + j takes code 16 q + 4 L + j

  explicit PlaneLookups(const Tables8& t) {
    alignas(64) uint8_t bytes[256], idx[64];
    for (int m = 0; m < 2; ++m)
      for (int k = 0; k < 4; ++k) {
        for (int e = 0; e < 256; ++e) {
          uint32_t u;
          std::memcpy(&u, t.map[m] + e, sizeof u);
          bytes[e] = static_cast<uint8_t>(u >> (8 * k));
        }
        for (int q = 0; q < 4; ++q) planes[m][k][q] = _mm512_load_si512((const __m512i*)(bytes + 64 * q));
      }
    for (int lane = 0; lane < 4; ++lane)
      for (int q = 0; q < 4; ++q)
        for (int j = 0; j < 4; ++j) idx[16 * lane + 4 * q + j] = static_cast<uint8_t>(16 * q + 4 * lane + j);
    order = _mm512_load_si512((const __m512i*)idx);
  }

  static __m512i plane(const __m512i* p, __m512i codes, __mmask64 high) {
    return _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(p[0], codes, p[1]),
                                  _mm512_permutex2var_epi8(p[2], codes, p[3]));
  }

  void dequant64(const uint8_t* c, const __m512i (*p)[4], __m512 absmax, __m512* out) const {
    const __m512i codes = _mm512_permutexvar_epi8(order, _mm512_loadu_si512((const __m512i*)c));
    const __mmask64 high = _mm512_movepi8_mask(codes);
    const __m512i b0 = plane(p[0], codes, high), b1 = plane(p[1], codes, high);
    const __m512i b2 = plane(p[2], codes, high), b3 = plane(p[3], codes, high);
    const __m512i lo01 = _mm512_unpacklo_epi8(b0, b1), hi01 = _mm512_unpackhi_epi8(b0, b1);
    const __m512i lo23 = _mm512_unpacklo_epi8(b2, b3), hi23 = _mm512_unpackhi_epi8(b2, b3);
    out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), absmax);
    out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), absmax);
    out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), absmax);
    out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), absmax);
  }

  void operator()(const uint8_t* mc, const uint8_t* vc, __m512 m_abs, __m512 v_abs, __m512* m, __m512* v) const {
    dequant64(mc, planes[0], m_abs, m);
    dequant64(vc, planes[1], v_abs, v);
  }
};

template <int G, int O>
void adam8_range(const Ptrs8& a, const Coeffs8& cf, int64_t begin, int64_t end) {
  avx512::adam8_loop<G, O, (O == BF16), PlaneLookups>(a, cf, begin, end);
}

}  // namespace avx512vbmi
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------- AVX2 + FMA + F16C (8 lanes, scalar tails)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {

template <int G>
inline __m256 load_grad(const void* g, int64_t i) {
  if constexpr (G == F32) return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  __m128i h = _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(g) + i));
  if constexpr (G == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

inline __m128i to_bf16(__m256 x) {
  __m256i b = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <int O>
inline void store_out(void* out, int64_t i, __m256 x, bool stream) {
  if constexpr (O == NONE) return;
  __m128i h;
  if constexpr (O == BF16) h = to_bf16(x);
  else h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m128i* dst = (__m128i*)(static_cast<uint16_t*>(out) + i);
  if (stream) _mm_stream_si128(dst, h);
  else _mm_storeu_si128(dst, h);
}

// Per-step constants in locals (see avx512::K).
struct K {
  __m256 inv_scale, decay, l2, lerp_w, beta2, beta2_c, neg_step_size, inv_bc2_sqrt, eps;
  bool scaled, has_l2, from_grad;
};

template <int G, int O>
inline void step8(float* p_, const void* g_, float* m_, float* v_, void* out, int64_t i, const K& c, bool stream) {
  __m256 g = load_grad<G>(g_, i);
  if (c.scaled) g = _mm256_mul_ps(g, c.inv_scale);
  __m256 p = _mm256_mul_ps(_mm256_loadu_ps(p_ + i), c.decay);
  if (c.has_l2) g = _mm256_fmadd_ps(c.l2, p, g);
  __m256 m = _mm256_loadu_ps(m_ + i);
  m = _mm256_fmadd_ps(c.lerp_w, _mm256_sub_ps(g, m), c.from_grad ? g : m);
  __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(c.beta2_c, g), g, _mm256_mul_ps(_mm256_loadu_ps(v_ + i), c.beta2));
  __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), c.inv_bc2_sqrt, c.eps);
  p = _mm256_fmadd_ps(c.neg_step_size, _mm256_div_ps(m, denom), p);
  _mm256_storeu_ps(p_ + i, p);
  _mm256_storeu_ps(m_ + i, m);
  _mm256_storeu_ps(v_ + i, v);
  store_out<O>(out, i, p, stream);
}

template <int G, int O>
void adam_range(const Ptrs& a, const Coeffs& cf, int64_t begin, int64_t end) {
  const K c{_mm256_set1_ps(cf.inv_scale), _mm256_set1_ps(cf.decay), _mm256_set1_ps(cf.l2),
            _mm256_set1_ps(cf.lerp_from_grad ? cf.lerp_w - 1.f : cf.lerp_w), _mm256_set1_ps(cf.beta2),
            _mm256_set1_ps(cf.beta2_c), _mm256_set1_ps(cf.neg_step_size), _mm256_set1_ps(cf.inv_bc2_sqrt),
            _mm256_set1_ps(cf.eps), cf.scaled, cf.l2 != 0.f, cf.lerp_from_grad};
  float* const p = a.p;
  float* const m = a.m;
  float* const v = a.v;
  const void* const g = a.g;
  void* const out = a.out;
  const bool stream = a.stream_out;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) step8<G, O>(p, g, m, v, out, i, c, stream);
  if (i < end) scalar::adam_range<G, O>(a, cf, i, end);
  if (stream) _mm_sfence();
}

template <int G>
double sq_range(const void* g, int64_t begin, int64_t end) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 x = load_grad<G>(g, i);
    __m256d xl = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d xh = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lo = _mm256_fmadd_pd(xl, xl, lo);
    hi = _mm256_fmadd_pd(xh, xh, hi);
  }
  __m256d s = _mm256_add_pd(lo, hi);
  __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
  double total = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
  return total + scalar::sq_range<G>(g, i, end);
}

// ---- int8 states ([Note: the int8 step], [Note: nearest code by bucket])

struct K8 {
  __m256 beta1, beta1_c, beta2, beta2_c, neg_step_size, inv_bc2_sqrt, eps, decay, l2, inv_scale;
  bool scaled, has_l2;
};

// The 8 codes at `codes` as fp32 values times the block's absmax. Eight scalar loads, not a gather: the
// step took 1.5 ns/element less so in a micro-benchmark on the AMD EPYC (Zen) build host, whose vgatherdps
// is microcoded. (The AVX-512 path does the same: measured there too.)
inline __m256 dequant8(const uint8_t* c, const float* map, __m256 absmax) {
  return _mm256_mul_ps(_mm256_setr_ps(map[c[0]], map[c[1]], map[c[2]], map[c[3]], map[c[4]], map[c[5]], map[c[6]],
                                      map[c[7]]),
                       absmax);
}

inline __m256 abs8(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }

inline float hmax8(__m256 x) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// The codes of the 8 lanes of x, one per int32 lane.
inline __m256i codes8(__m256 x, const uint32_t* lut) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i e = _mm256_i32gather_epi32((const int*)lut, _mm256_srli_epi32(bits, 16), 4);
  const __m256i ffff = _mm256_set1_epi32(0xFFFF);
  const __m256i low = _mm256_and_si256(_mm256_xor_si256(bits, _mm256_srai_epi32(bits, 31)), ffff);
  const __m256i above = _mm256_cmpgt_epi32(low, _mm256_and_si256(e, ffff));  // true lanes are -1
  return _mm256_sub_epi32(_mm256_srli_epi32(e, 16), above);
}

inline void quantize_block(const float* x, float absmax, const uint32_t* lut, uint8_t* codes) {
  const __m256 am = _mm256_set1_ps(absmax);
  const bool zero = !(absmax > 0.f);
  __m256i c[4];
  for (int64_t j = 0; j < kBlock; j += 32) {
    for (int k = 0; k < 4; ++k)
      c[k] = codes8(zero ? _mm256_setzero_ps() : _mm256_div_ps(_mm256_loadu_ps(x + j + 8 * k), am), lut);
    // The packs work within 128-bit halves: dwords come out as c0 c1 c2 c3 (low halves of each), then
    // the high halves; one permute puts the 32 bytes in order.
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i*)(codes + j), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

inline void quantize_range(const float* x, uint8_t* codes, float* absmax, const uint32_t* lut,
                           int64_t begin, int64_t end) {
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    __m256 mx = _mm256_setzero_ps();
    for (int64_t j = 0; j < kBlock; j += 8) mx = _mm256_max_ps(mx, abs8(_mm256_loadu_ps(x + b0 + j)));
    absmax[b0 / kBlock] = hmax8(mx);
    quantize_block(x + b0, absmax[b0 / kBlock], lut, codes + b0);
  }
}

template <int G, int O>
void adam8_range(const Ptrs8& a, const Coeffs8& cf, int64_t begin, int64_t end) {
  const K8 c{_mm256_set1_ps(cf.beta1), _mm256_set1_ps(cf.beta1_c), _mm256_set1_ps(cf.beta2),
             _mm256_set1_ps(cf.beta2_c), _mm256_set1_ps(cf.neg_step_size), _mm256_set1_ps(cf.inv_bc2_sqrt),
             _mm256_set1_ps(cf.eps), _mm256_set1_ps(cf.decay), _mm256_set1_ps(cf.l2), _mm256_set1_ps(cf.inv_scale),
             cf.scaled, cf.l2 != 0.f};
  const Ptrs8 r = a;  // locals: see avx512::K
  alignas(32) float mb[kBlock], vb[kBlock];
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t blk = b0 / kBlock;
    const __m256 m_abs = _mm256_set1_ps(r.ma[blk]), v_abs = _mm256_set1_ps(r.va[blk]);
    __m256 m_max = _mm256_setzero_ps(), v_max = _mm256_setzero_ps();
    for (int64_t j = 0; j < kBlock; j += 8) {
      const int64_t i = b0 + j;
      __m256 g = load_grad<G>(r.g, i);
      if (c.scaled) g = _mm256_mul_ps(g, c.inv_scale);
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(r.p + i), c.decay);
      if (c.has_l2) g = _mm256_add_ps(g, _mm256_mul_ps(p, c.l2));
      const __m256 m = _mm256_add_ps(_mm256_mul_ps(dequant8(r.mc + i, r.t.map[0], m_abs), c.beta1),
                                     _mm256_mul_ps(g, c.beta1_c));
      const __m256 v = _mm256_add_ps(_mm256_mul_ps(dequant8(r.vc + i, r.t.map[1], v_abs), c.beta2),
                                     _mm256_mul_ps(_mm256_mul_ps(g, g), c.beta2_c));
      const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), c.inv_bc2_sqrt), c.eps);
      p = _mm256_add_ps(p, _mm256_mul_ps(_mm256_div_ps(m, denom), c.neg_step_size));
      _mm256_storeu_ps(r.p + i, p);
      store_out<O>(r.out, i, p, r.stream_out);
      _mm256_store_ps(mb + j, m);
      _mm256_store_ps(vb + j, v);
      m_max = _mm256_max_ps(m_max, abs8(m));
      v_max = _mm256_max_ps(v_max, abs8(v));
    }
    const float m_new = hmax8(m_max), v_new = hmax8(v_max);
    r.ma[blk] = m_new;
    r.va[blk] = v_new;
    quantize_block(mb, m_new, r.t.lut[0], r.mc + b0);
    quantize_block(vb, v_new, r.t.lut[1], r.vc + b0);
  }
  if (r.stream_out) _mm_sfence();
}

OFFLOAD_DEFINE_DIGEST_RANGE

// The split master's record ([Note: split master] in offload/kernels/split.py), 8 elements a vector: the same
// bits as the scalar loops (tested against them and the torch reference), which the compiler does not vectorize.
inline void split_range(const uint32_t* m, uint16_t* low, uint8_t* ties, int64_t begin, int64_t end) {
  const __m256i halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i mask = _mm256_set1_epi32(0x1FFFF), tie = _mm256_set1_epi32(0x8000);
  for (int64_t i = begin; i < end; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + i));
    const __m256i lows = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, halves), 0x08);  // qwords 0, 2 first
    _mm_storeu_si128(reinterpret_cast<__m128i*>(low + i), _mm256_castsi256_si128(lows));
    const __m256i t = _mm256_cmpeq_epi32(_mm256_and_si256(x, mask), tie);
    ties[i / 8] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_castsi256_ps(t)));
  }
}

inline void join_range(const uint16_t* w, const uint16_t* low, const uint8_t* ties, uint32_t* out, int64_t begin,
                       int64_t end) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128), half = _mm256_set1_epi32(0x8000);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF), zero = _mm256_setzero_si256();
  for (int64_t i = begin; i < end; i += 8) {
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + i)));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    const __m256i no_tie = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(ties[i / 8]), bits), zero);
    const __m256i up = _mm256_or_si256(_mm256_cmpgt_epi32(lo, half),  // all ones (-1) where the rounding went up
                                       _mm256_and_si256(_mm256_cmpeq_epi32(lo, half), no_tie));
    const __m256i high = _mm256_and_si256(_mm256_add_epi32(hi, up), low16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_or_si256(_mm256_slli_epi32(high, 16), lo));
  }
}

}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // OFFLOAD_X86

// ---------------------------------------------------------------- dispatch

int best_isa() {
#ifdef OFFLOAD_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512bf16") ? AVX512BF16 : AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;  // F16C comes with both
#endif
  return SCALAR;
}

bool has_vbmi() {
#ifdef OFFLOAD_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

int resolve_isa(int64_t requested) {
  int best = best_isa();
  if (requested < 0) return best;
  TORCH_CHECK(requested <= best, "offload cpu_adam: ISA ", requested, " requested but this CPU supports at most ",
              best, " (0=scalar, 1=avx2, 2=avx512, 3=avx512bf16)");
  return static_cast<int>(requested);
}

template <int G, int O>
AdamFn pick_adam_isa(int isa) {
#ifdef OFFLOAD_X86
  if (isa == AVX512BF16) return avx512::adam_range_ne<G, O>;
  if (isa == AVX512) return avx512::adam_range<G, O>;
  if (isa == AVX2) return avx2::adam_range<G, O>;
#endif
  return scalar::adam_range<G, O>;
}

template <int G>
AdamFn pick_adam_out(int isa, int o) {
  if (o == BF16) return pick_adam_isa<G, BF16>(isa);
  if (o == F16) return pick_adam_isa<G, F16>(isa);
  return pick_adam_isa<G, NONE>(isa);
}

AdamFn pick_adam(int isa, int g, int o) {
  if (g == BF16) return pick_adam_out<BF16>(isa, o);
  if (g == F16) return pick_adam_out<F16>(isa, o);
  return pick_adam_out<F32>(isa, o);
}

template <int G>
SqFn pick_sq_isa(int isa) {
#ifdef OFFLOAD_X86
  if (isa >= AVX512) return avx512::sq_range<G>;
  if (isa == AVX2) return avx2::sq_range<G>;
#endif
  return scalar::sq_range<G>;
}

DigestFn pick_digest(int isa) {
#ifdef OFFLOAD_X86
  if (isa >= AVX512) return avx512::digest_range;
  if (isa == AVX2) return avx2::digest_range;
#endif
  return scalar::digest_range;
}

template <int G, int O>
Adam8Fn pick_adam8_isa(int isa) {
#ifdef OFFLOAD_X86
  if (isa == AVX512BF16)  // with VBMI where the CPU has it ([Note: map reads by byte planes])
    return has_vbmi() ? avx512vbmi::adam8_range<G, O> : avx512::adam8_range<G, O, (O == BF16)>;
  if (isa == AVX512) return avx512::adam8_range<G, O, false>;
  if (isa == AVX2) return avx2::adam8_range<G, O>;
#endif
  return scalar::adam8_range<G, O>;
}

template <int G>
Adam8Fn pick_adam8_out(int isa, int o) {
  if (o == BF16) return pick_adam8_isa<G, BF16>(isa);
  if (o == F16) return pick_adam8_isa<G, F16>(isa);
  return pick_adam8_isa<G, NONE>(isa);
}

Adam8Fn pick_adam8(int isa, int g, int o) {
  if (g == BF16) return pick_adam8_out<BF16>(isa, o);
  if (g == F16) return pick_adam8_out<F16>(isa, o);
  return pick_adam8_out<F32>(isa, o);
}

Quant8Fn pick_quant8(int isa) {
#ifdef OFFLOAD_X86
  if (isa >= AVX512) return avx512::quantize_range;
  if (isa == AVX2) return avx2::quantize_range;
#endif
  return scalar::quantize_range;
}

SqFn pick_sq(int isa, int g) {
  if (g == BF16) return pick_sq_isa<BF16>(isa);
  if (g == F16) return pick_sq_isa<F16>(isa);
  return pick_sq_isa<F32>(isa);
}

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    default: TORCH_CHECK(false, "offload cpu_adam: unsupported dtype ", t.scalar_type());
  }
  return NONE;
}

// [Note: chunks and threads]
// 64 Ki elements per chunk (256 KiB of each fp32 array) is big enough that the per-chunk atomic is
// noise and small enough that a core slowed by a neighbour (the machine is shared with I/O threads)
// leaves its remaining chunks to the others. Chunk boundaries are multiples of 32 (one 64-byte line of
// bf16 output), so only the last chunk has a vector tail and streaming stores stay line-aligned.
// Threads: min(num_threads, chunks), the caller plus helpers started for this call (a helper's start is
// small next to a chunk's work). Not at::parallel_for: its OpenMP body is compiled only with -fopenmp
// (torch's headers fall back to a serial loop without it), and linking a second OpenMP runtime beside
// torch's is worse. One core does not reach the host's memory bandwidth; two do (bench/RESULTS.md).
constexpr int64_t kChunkNumel = int64_t(1) << 16;

// [Note: streaming the weight output]
// `out` is written and not read by the step, so for large shards its stores bypass the cache
// (non-temporal): no read-for-ownership of the destination and no eviction of the state lines we
// are streaming through (measured faster: bench/RESULTS.md). Small shards keep normal stores
// so the weights are still in cache for whoever copies them next. p/m/v are rewritten in lines we
// just read, where streaming stores are slower (measured), so they stay normal stores.
constexpr int64_t kStreamOutNumel = int64_t(1) << 18;  // 512 KiB of bf16 output

// A chunk of the flat arrays; `block` is the swap block it lies in (0 without digests).
struct Chunk {
  int64_t begin, end, block;
};

// Chunks of at most kChunkNumel elements that never straddle a bound: bounds are the block starts
// followed by numel (just {0, numel} without digests), so a chunk starts on a block start or
// kChunkNumel after one.
std::vector<Chunk> make_chunks(const std::vector<int64_t>& bounds) {
  std::vector<Chunk> chunks;
  for (size_t b = 0; b + 1 < bounds.size(); ++b)
    for (int64_t s = bounds[b]; s < bounds[b + 1]; s += kChunkNumel)
      chunks.push_back({s, std::min(bounds[b + 1], s + kChunkNumel), static_cast<int64_t>(b)});
  return chunks;
}

template <typename Fn>
void run_chunks(const std::vector<Chunk>& chunks, int64_t num_threads, const Fn& fn) {
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(num_threads, 1), n_chunks);
  if (workers <= 1) {
    for (int64_t c = 0; c < n_chunks; ++c) fn(c, chunks[c]);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) fn(c, chunks[c]);
  };
  std::vector<std::thread> helpers;
  for (int64_t t = 1; t < workers; ++t) helpers.emplace_back(work);
  work();
  for (auto& t : helpers) t.join();
}

template <typename Fn>
void for_each_chunk(int64_t numel, int64_t num_threads, const Fn& fn) {
  run_chunks(make_chunks({0, numel}), num_threads, [&](int64_t c, const Chunk& k) { fn(c, k.begin, k.end); });
}

void check_flat(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "offload cpu_adam: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "offload cpu_adam: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "offload cpu_adam: ", name, " has ", t.numel(), " elements, expected ", numel);
}

Coeffs adam_coeffs(int64_t step, double lr, double beta1, double beta2, double eps, double wd, bool adamw,
                   double grad_scale) {
  Coeffs c;
  const double w = 1.0 - beta1;
  c.lerp_w = static_cast<float>(w);
  c.lerp_from_grad = std::abs(w) >= 0.5;
  c.beta2 = static_cast<float>(beta2);
  c.beta2_c = static_cast<float>(1.0 - beta2);
  c.neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  c.eps = static_cast<float>(eps);
  c.decay = adamw ? static_cast<float>(1.0 - lr * wd) : 1.f;
  c.l2 = adamw ? 0.f : static_cast<float>(wd);
  c.inv_scale = static_cast<float>(1.0 / grad_scale);
  c.scaled = grad_scale != 1.0;
  return c;
}

// ---------------------------------------------------------------- entry points (GIL released by the binding)

// The split master's record ([Note: split master] in offload/kernels/split.py): the low halves of the fp32
// masters, then one tie bit an element (low half 0x8000 on an even high half), 8 a byte. Scalar loops over
// 8 elements (a byte of tie bits) that the compiler vectorizes; memory-bound like the copies they replace.
void split_range(const uint32_t* m, uint16_t* low, uint8_t* ties, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 8) {
    uint32_t t = 0;
    for (int j = 0; j < 8; ++j) {
      const uint32_t x = m[i + j];
      low[i + j] = static_cast<uint16_t>(x);
      t |= static_cast<uint32_t>((x & 0x1FFFFu) == 0x8000u) << j;
    }
    ties[i / 8] = static_cast<uint8_t>(t);
  }
}

// The masters back from bf16 working weights `w` and a record: the rounding to nearest even went up (the
// high half is one less than the weight's) when the low half is above 0x8000, or 0x8000 without a tie bit.
void join_range(const uint16_t* w, const uint16_t* low, const uint8_t* ties, uint32_t* out, int64_t begin,
                int64_t end) {
  for (int64_t i = begin; i < end; i += 8) {
    const uint32_t t = ties[i / 8];
    for (int j = 0; j < 8; ++j) {
      const uint32_t lo = low[i + j];
      const uint32_t up = static_cast<uint32_t>(lo > 0x8000u) | (static_cast<uint32_t>(lo == 0x8000u) & ~(t >> j) & 1u);
      out[i + j] = (static_cast<uint32_t>(static_cast<uint16_t>(w[i + j] - up)) << 16) | lo;
    }
  }
}

// The record's low halves and tie bits (plain pointers: the lambdas that use them could capture a structured
// binding only from C++20).
void split_record(const at::Tensor& record, int64_t numel, uint16_t*& low, uint8_t*& ties) {
  TORCH_CHECK(numel % 8 == 0, "offload split master: ", numel, " elements is not a multiple of 8");
  TORCH_CHECK(record.scalar_type() == at::kByte, "offload split master: the record must be uint8");
  check_flat(record, "record", 2 * numel + numel / 8);
  uint8_t* r = record.data_ptr<uint8_t>();
  low = reinterpret_cast<uint16_t*>(r);
  ties = r + 2 * numel;
}

// A step over a split master ([Note: split master] in offload/kernels/split.py): `split` holds the elements'
// working weights, their records' low halves and tie bits; each chunk's masters are joined into `param` before
// its update and split back after it, while the chunk is in cache (param is scratch; the weights may be `out`:
// a chunk is joined whole before its update writes them).
using SplitFn = void (*)(const uint32_t*, uint16_t*, uint8_t*, int64_t, int64_t);
using JoinFn = void (*)(const uint16_t*, const uint16_t*, const uint8_t*, uint32_t*, int64_t, int64_t);

std::pair<SplitFn, JoinFn> pick_split(int isa) {
#ifdef OFFLOAD_X86
  if (isa >= AVX2) return {avx2::split_range, avx2::join_range};  // AVX-512 hosts run AVX2's too
#endif
  return {split_range, join_range};
}

struct SplitView {
  const uint16_t* w;
  uint16_t* low;
  uint8_t* ties;
  uint32_t* p;
  SplitFn split;
  JoinFn join;
};

std::optional<SplitView> split_view(const c10::optional<std::vector<at::Tensor>>& split, const at::Tensor& param,
                                    int64_t numel, int isa) {
  if (!split.has_value()) return std::nullopt;
  TORCH_CHECK(split->size() == 3 && numel % 8 == 0, "offload split master: (weights, low halves, tie bits) of a "
              "multiple of 8 elements");
  const at::Tensor &w = (*split)[0], &low = (*split)[1], &ties = (*split)[2];
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && low.scalar_type() == at::kShort && ties.scalar_type() == at::kByte,
              "offload split master: bf16 weights, int16 low halves and uint8 tie bits");
  check_flat(w, "weights", numel);
  check_flat(low, "low halves", numel);
  check_flat(ties, "tie bits", numel / 8);
  return SplitView{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                   reinterpret_cast<uint16_t*>(low.data_ptr<int16_t>()), ties.data_ptr<uint8_t>(),
                   reinterpret_cast<uint32_t*>(param.data_ptr<float>()), pick_split(isa).first,
                   pick_split(isa).second};
}

template <typename Fn>
void split_around(const std::optional<SplitView>& s, int64_t begin, int64_t end, const Fn& step) {
  if (s) s->join(s->w, s->low, s->ties, s->p, begin, end);
  step();
  if (s) s->split(s->p, s->low, s->ties, begin, end);
}


// [Note: swap digests in the step]
// With optimizer states on NVMe and swap checksums on, every state is hashed twice per step outside the
// step (verify after the read, record before the write): two more passes over 12 bytes per parameter
// that miss cache, on the cores the forward/backward compute needs. Given the swap blocks' element
// bounds, the step hashes each chunk of param/exp_avg/exp_avg_sq right before updating it (the loads
// that bring the chunk into cache) and right after (still in cache), and returns per block and array
// the (sum, xor) of the inputs and of the outputs, which the caller checks against the digests recorded
// at write time and hands to the next write. Same digest as swap.integrity.block_digest (tested).
at::Tensor adam_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                     c10::optional<at::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool adamw, double grad_scale, int64_t num_threads, int64_t isa,
                     c10::optional<at::Tensor> digest_bounds, c10::optional<std::vector<at::Tensor>> split) {
  const int64_t numel = param.numel();
  const std::optional<SplitView> sv = split_view(split, param, numel, resolve_isa(isa));
  TORCH_CHECK(!(sv && digest_bounds.has_value()), "offload cpu_adam: a split master's step is hashed beside it");
  check_flat(param, "param", numel);
  check_flat(grad, "grad", numel);
  check_flat(exp_avg, "exp_avg", numel);
  check_flat(exp_avg_sq, "exp_avg_sq", numel);
  TORCH_CHECK(param.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
                  exp_avg_sq.scalar_type() == at::kFloat,
              "offload cpu_adam: param, exp_avg and exp_avg_sq must be float32");
  TORCH_CHECK(step >= 1, "offload cpu_adam: step must be >= 1, got ", step);
  int o = NONE;
  void* out_ptr = nullptr;
  if (out.has_value()) {
    check_flat(*out, "out", numel);
    o = dtype_code(*out);
    TORCH_CHECK(o != F32, "offload cpu_adam: out must be bfloat16 or float16");
    out_ptr = out->data_ptr();
  }
  std::vector<int64_t> bounds{0, numel};
  if (digest_bounds.has_value()) {
    const at::Tensor b = digest_bounds->to(at::kLong).contiguous();
    bounds.assign(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + b.numel());
    TORCH_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == numel,
                "offload cpu_adam: digest_bounds must run from 0 to numel (", numel, ")");
    for (size_t i = 1; i < bounds.size(); ++i)
      TORCH_CHECK(bounds[i] > bounds[i - 1] && (i + 1 == bounds.size() || bounds[i] % 32 == 0),
                  "offload cpu_adam: digest_bounds must increase, block starts in multiples of 32 elements");
  }
  const int resolved = resolve_isa(isa);
  const AdamFn fn = pick_adam(resolved, dtype_code(grad), o);
  const Coeffs c = adam_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale);
  // Streaming stores of `out` cover 32 (AVX2) or 64 (AVX-512) bytes from chunk starts (multiples of 32
  // elements): aligned iff the base is.
  const uintptr_t align = resolved >= AVX512 ? 64 : 32;
  const bool stream_out = resolved != SCALAR && out_ptr != nullptr && numel >= kStreamOutNumel &&
                          reinterpret_cast<uintptr_t>(out_ptr) % align == 0;
  const Ptrs a{param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
               out_ptr, stream_out};
  const std::vector<Chunk> chunks = make_chunks(bounds);
  if (!digest_bounds.has_value()) {
    run_chunks(chunks, num_threads, [&](int64_t, const Chunk& k) {
      split_around(sv, k.begin, k.end, [&] { fn(a, c, k.begin, k.end); });
    });
    return at::Tensor();
  }
  // part[chunk][in/out][array][sum/xor], folded per block below (sums add, xors xor: order-free).
  const DigestFn digest = pick_digest(resolved);
  const float* arrays[3] = {a.p, a.m, a.v};
  std::vector<uint64_t> part(chunks.size() * 12, 0);
  run_chunks(chunks, num_threads, [&](int64_t i, const Chunk& k) {
    uint64_t* d = part.data() + i * 12;
    for (int j = 0; j < 3; ++j) digest(arrays[j], k.begin, k.end, d[2 * j], d[2 * j + 1]);
    fn(a, c, k.begin, k.end);
    for (int j = 0; j < 3; ++j) digest(arrays[j], k.begin, k.end, d[6 + 2 * j], d[6 + 2 * j + 1]);
  });
  const int64_t n_blocks = static_cast<int64_t>(bounds.size()) - 1;
  at::Tensor result = at::zeros({2, 3, n_blocks, 2}, at::kLong);  // [in/out][array][block][sum/xor]
  uint64_t* r = reinterpret_cast<uint64_t*>(result.data_ptr<int64_t>());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const uint64_t* d = part.data() + i * 12;
    for (int io = 0; io < 2; ++io)
      for (int j = 0; j < 3; ++j) {
        uint64_t* cell = r + ((io * 3 + j) * n_blocks + chunks[i].block) * 2;
        cell[0] += d[io * 6 + 2 * j];
        cell[1] ^= d[io * 6 + 2 * j + 1];
      }
  }
  return result;
}

static_assert(kChunkNumel % kBlock == 0, "a chunk must hold whole int8 blocks");

// The tables as offload.kernels.adam8.kernel_tables builds them: maps (2, 256) fp32 and luts
// (2, kLutNumel) int32. Codes are bytes and buckets 16 bits, so no content can make a read go out of
// bounds: wrong tables give wrong codes.
Tables8 check_tables(const std::vector<at::Tensor>& tables) {
  auto fits = [](const at::Tensor& t, at::ScalarType dtype, int64_t cols) {
    return t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == 2 &&
           t.size(1) == cols;
  };
  TORCH_CHECK(tables.size() == 2 && fits(tables[0], at::kFloat, 256) && fits(tables[1], at::kInt, kLutNumel),
              "offload adam8: tables must be offload.kernels.adam8.kernel_tables() (maps, luts)");
  Tables8 t;
  for (int s = 0; s < 2; ++s) {
    t.map[s] = tables[0].data_ptr<float>() + s * 256;
    t.lut[s] = reinterpret_cast<const uint32_t*>(tables[1].data_ptr<int32_t>()) + s * kLutNumel;
  }
  return t;
}

void check_int8_state(const at::Tensor& codes, const at::Tensor& absmax, const char* name, int64_t numel) {
  check_flat(codes, name, numel);
  check_flat(absmax, name, numel / kBlock);
  TORCH_CHECK(codes.scalar_type() == at::kByte && absmax.scalar_type() == at::kFloat, "offload adam8: ", name,
              " codes must be uint8 and its absmax float32");
}

Coeffs8 adam8_coeffs(int64_t step, double lr, double beta1, double beta2, double eps, double wd, bool adamw,
                     double grad_scale) {
  Coeffs8 c;
  c.beta1 = static_cast<float>(beta1);
  c.beta1_c = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.beta2_c = static_cast<float>(1.0 - beta2);
  c.neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  c.eps = static_cast<float>(eps);
  c.decay = adamw ? static_cast<float>(1.0 - lr * wd) : 1.f;
  c.l2 = adamw ? 0.f : static_cast<float>(wd);
  c.inv_scale = static_cast<float>(1.0 / grad_scale);
  c.scaled = grad_scale != 1.0;
  return c;
}

// The int8 step ([Note: the int8 step]): param fp32, grad fp32/bf16/fp16 and the uint8 codes of m and v
// hold numel elements, a multiple of kBlock; m_absmax and v_absmax (fp32) one per block; `out` (bf16/fp16)
// gets the new weight. Chunks start at multiples of kChunkNumel, so at block starts.
void adam8_step(at::Tensor param, at::Tensor grad, at::Tensor m_codes, at::Tensor m_absmax, at::Tensor v_codes,
                at::Tensor v_absmax, c10::optional<at::Tensor> out, std::vector<at::Tensor> tables, int64_t step,
                double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                double grad_scale, int64_t num_threads, int64_t isa, c10::optional<std::vector<at::Tensor>> split) {
  const int64_t numel = param.numel();
  const std::optional<SplitView> sv = split_view(split, param, numel, resolve_isa(isa));
  TORCH_CHECK(numel % kBlock == 0, "offload adam8: param has ", numel, " elements, not a multiple of ", kBlock,
              "; give whole blocks (see [Note: int8 optimizer states])");
  check_flat(param, "param", numel);
  check_flat(grad, "grad", numel);
  TORCH_CHECK(param.scalar_type() == at::kFloat, "offload adam8: param must be float32");
  check_int8_state(m_codes, m_absmax, "m", numel);
  check_int8_state(v_codes, v_absmax, "v", numel);
  TORCH_CHECK(step >= 1, "offload adam8: step must be >= 1, got ", step);
  int o = NONE;
  void* out_ptr = nullptr;
  if (out.has_value()) {
    check_flat(*out, "out", numel);
    o = dtype_code(*out);
    TORCH_CHECK(o != F32, "offload adam8: out must be bfloat16 or float16");
    out_ptr = out->data_ptr();
  }
  const Tables8 t = check_tables(tables);
  const int resolved = resolve_isa(isa);
  const Adam8Fn fn = pick_adam8(resolved, dtype_code(grad), o);
  const Coeffs8 c = adam8_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale);
  const uintptr_t align = resolved >= AVX512 ? 64 : 32;  // as adam_step's streaming stores
  const bool stream_out = resolved != SCALAR && out_ptr != nullptr && numel >= kStreamOutNumel &&
                          reinterpret_cast<uintptr_t>(out_ptr) % align == 0;
  const Ptrs8 a{param.data_ptr<float>(), grad.data_ptr(), m_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(),
                m_absmax.data_ptr<float>(), v_absmax.data_ptr<float>(), out_ptr, stream_out, t};
  for_each_chunk(numel, num_threads, [&](int64_t, int64_t b, int64_t e) {
    split_around(sv, b, e, [&] { fn(a, c, b, e); });
  });
}

// For tests: the step's quantization alone, of fp32 `x` into `codes` and `absmax` with map `which`
// (0 signed, 1 unsigned), at instruction set `isa`.
void quantize8(at::Tensor x, at::Tensor codes, at::Tensor absmax, int64_t which, std::vector<at::Tensor> tables,
               int64_t isa) {
  const int64_t numel = x.numel();
  TORCH_CHECK(numel % kBlock == 0 && x.scalar_type() == at::kFloat && (which == 0 || which == 1),
              "offload quantize8: x must be float32 in whole blocks of ", kBlock, ", which 0 or 1");
  check_flat(x, "x", numel);
  check_int8_state(codes, absmax, "x", numel);
  const Tables8 t = check_tables(tables);
  pick_quant8(resolve_isa(isa))(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                                t.lut[which], 0, numel);
}

void split_master(at::Tensor master, at::Tensor record, int64_t num_threads, int64_t isa) {
  const int64_t numel = master.numel();
  TORCH_CHECK(master.scalar_type() == at::kFloat, "offload split master: the master must be float32");
  check_flat(master, "master", numel);
  uint16_t* low = nullptr;
  uint8_t* ties = nullptr;
  split_record(record, numel, low, ties);
  const uint32_t* m = reinterpret_cast<const uint32_t*>(master.data_ptr<float>());
  const SplitFn fn = pick_split(resolve_isa(isa)).first;
  for_each_chunk(numel, num_threads, [&](int64_t, int64_t b, int64_t e) { fn(m, low, ties, b, e); });
}

void join_master(at::Tensor weight, at::Tensor record, at::Tensor out, int64_t num_threads, int64_t isa) {
  const int64_t numel = out.numel();
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kFloat,
              "offload split master: bf16 weights and a float32 output");
  check_flat(weight, "weight", numel);
  check_flat(out, "out", numel);
  uint16_t* low = nullptr;
  uint8_t* ties = nullptr;
  split_record(record, numel, low, ties);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  uint32_t* o = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  const JoinFn fn = pick_split(resolve_isa(isa)).second;
  for_each_chunk(numel, num_threads, [&](int64_t, int64_t b, int64_t e) { fn(w, low, ties, o, b, e); });
}

double grad_sq_sum(at::Tensor grad, int64_t num_threads, int64_t isa) {
  const int64_t numel = grad.numel();
  check_flat(grad, "grad", numel);
  const SqFn fn = pick_sq(resolve_isa(isa), dtype_code(grad));
  // One partial per chunk, summed in chunk order: the result does not depend on the thread count.
  std::vector<double> partial((numel + kChunkNumel - 1) / kChunkNumel, 0.0);
  const void* g = grad.data_ptr();
  for_each_chunk(numel, num_threads, [&](int64_t c, int64_t b, int64_t e) { partial[c] = fn(g, b, e); });
  double total = 0.0;
  for (double x : partial) total += x;
  return total;
}

// For tests: how many distinct threads ran the chunks of a `numel`-element call with `num_threads`
// (each chunk sleeps 1 ms so a helper cannot start too late to take one). A silently serial loop
// (what at::parallel_for compiles to here) returns 1.
int64_t threads_used(int64_t numel, int64_t num_threads) {
  std::mutex mu;
  std::set<std::thread::id> ids;
  for_each_chunk(numel, num_threads, [&](int64_t, int64_t, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(ids.size());
}

// The swap digest (sum, xor) of the 64-bit words in the `nbytes` (a multiple of 8) at `addr`: one pass
// where swap.integrity's numpy fallback makes two (swap.integrity.use_word_digest).
std::pair<uint64_t, uint64_t> word_digest(int64_t addr, int64_t nbytes, int64_t isa) {
  TORCH_CHECK(nbytes >= 0 && nbytes % 8 == 0, "offload word_digest: nbytes must be a multiple of 8, got ", nbytes);
  uint64_t s = 0, x = 0;
  pick_digest(resolve_isa(isa))(reinterpret_cast<const float*>(addr), 0, nbytes / 4, s, x);
  return {s, x};
}

std::string isa_name(int isa) {
  return isa == AVX512BF16 ? "avx512bf16" : isa == AVX512 ? "avx512" : isa == AVX2 ? "avx2" : "scalar";
}

}  // namespace

void bind_host_alloc(pybind11::module_& m);  // host_alloc.cpp: torch's CPU allocator on the CPU backend

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>());
  m.def("adam8_step", &adam8_step, py::call_guard<py::gil_scoped_release>());
  m.def("quantize8", &quantize8, py::call_guard<py::gil_scoped_release>());
  m.def("grad_sq_sum", &grad_sq_sum, py::call_guard<py::gil_scoped_release>());
  m.def("split_master", &split_master, py::call_guard<py::gil_scoped_release>());
  m.def("join_master", &join_master, py::call_guard<py::gil_scoped_release>());
  m.def("threads_used", &threads_used, py::call_guard<py::gil_scoped_release>());
  m.def("word_digest", &word_digest, py::call_guard<py::gil_scoped_release>());
  m.def("best_isa", &best_isa);
  m.def("isa_name", &isa_name);
  bind_host_alloc(m);
}
