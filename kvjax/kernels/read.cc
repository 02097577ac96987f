// The CPU decode read of one stored cache segment, as an XLA FFI custom call.
//
// For every (sequence, KV head) row n and its M query rows (query heads x new tokens),
// it scans the stored tokens [0, live) of one layer, skipping the slots the mask marks
// invalid, and returns that segment's online-softmax partial state: the running max m,
// the sum s of exp(logit - m) and the accumulator acc = sum exp(logit - m) * v. The
// caller merges it with the state of the other segments.
//
// Two scans do it, never through a widened copy of the cache in memory. The fused scan
// (head_dim 16, 32, 64, 96, 112 or 128 known at compile time: 96 and 112 are MLA rows'
// widths; K and V each read by functions compiled for
// their codec kind and scale layout, so any K codec meets any V codec) converts each code
// where it is used; whole-head scales and zero points are applied to the logits and
// probabilities, head_dim groups and per-channel scales to the converted codes in
// registers; integer codes with whole-head scales meet a 15-bit integer copy of the query
// in exact int16 multiply-adds. Where the CPU has AVX-512, whole-head leaves are read
// sixteen columns per register, and integer values meet each tile's probabilities rounded
// once to 15-bit integers (two tokens per int16 multiply-add), so a smaller code is also
// less arithmetic per token; head_dim groups of 16 columns or more and per-channel keys
// have sixteen-lane forms too. The generic scan (any other head_dim, more than 16 query
// rows, groups narrower than 8 elements) widens a tile of TILE tokens at a time into a
// float buffer that stays in L1, scales and zero points applied as it is widened. Rows
// are split across XLA's intra-op thread pool; when there are fewer rows than threads,
// each row's tokens are split too and the partial states are merged by log-sum-exp.
//
// Storage: a leaf is [L, B, K, S, W] (W code elements per token), read at `layer`, or a
// page pool [L, P, K, page, W] with a block table [B, S / page]; scales and zeros are
// bfloat16 bits (none: an empty buffer) laid out by the leaf's mode: whole-head
// [..., S, 1], head_dim groups [..., S, n] (n groups of D / n elements), or per channel
// [..., S / U, D] (one scale per channel per U consecutive tokens: KIVI's keys). The mask
// is [B, S].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int TILE = 64;
constexpr float MASKED = -1e30f;

enum Kind : int64_t { F32 = 0, BF16 = 1, F16 = 2, INT8 = 3, UINT4 = 4, UINT2 = 5, E4M3 = 6, E5M2 = 7 };
enum Mode : int64_t { WHOLE = 0, GROUPED = 1, CHANNEL = 2 };  // how a leaf's scales are laid out

inline float bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16(uint16_t h) {  // IEEE half to float: subnormals, infinities and NaN included
  uint32_t sign = uint32_t(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
  float f;
  if (e == 0) {
    f = std::ldexp(float(m), -24);
    return sign ? -f : f;
  }
  uint32_t u = sign | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
  std::memcpy(&f, &u, 4);
  return f;
}

struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (int b = 0; b < 256; ++b) {
      float sign = (b & 0x80) ? -1.f : 1.f;
      int e = (b >> 3) & 15, m = b & 7;  // e4m3fn: bias 7, no infinities, S.1111.111 is NaN
      e4m3[b] = (e == 15 && m == 7) ? NAN
                : sign * (e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6));
      int e5 = (b >> 2) & 31, m5 = b & 3;  // e5m2: bias 15, IEEE-like
      e5m2[b] = e5 == 31 ? (m5 ? NAN : sign * INFINITY)
                : sign * (e5 ? std::ldexp(1.f + m5 / 4.f, e5 - 15) : std::ldexp(m5 / 4.f, -14));
    }
  }
};
const Fp8Tables kFp8;

// 2^f on [-1/2, 1/2] (a float or eight lanes): the polynomial both exponentials share.
template <typename T>
inline T exp2_poly(T f) {
  T p = f * 0.f + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  return p * f + 1.0f;
}

// exp(x) for x <= 0 (x below -87 gives 0), written to vectorize: 2^(x log2 e) split into
// an integer power (exponent bits) and a polynomial on [-1/2, 1/2]; relative error ~2e-7.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  float y = x * 1.44269504088896341f;
  float n = std::nearbyint(y);
  float p = exp2_poly(y - n);
  int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

typedef float v8 __attribute__((vector_size(32)));  // GCC/Clang vector extension

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(v8 v) {
#ifdef __AVX2__
  __m256 a;
  std::memcpy(&a, &v, 32);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
#else
  float t = 0.f;
  for (int i = 0; i < 8; ++i) t += v[i];
  return t;
#endif
}

struct Leaf {  // one codec's storage of one layer: codes, scales, zeros
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* zero;
  int64_t kind, width;  // width: bytes per token row
  int64_t mode, groups, chan;  // GROUPED: n scales per token; CHANNEL: U tokens per scale row
  int gshift, cshift;          // log2 of a group's width and of U where they are powers of 2
  float half() const { return kind == UINT4 ? 7.5f : kind == UINT2 ? 1.5f : 0.f; }
};

// x[0..D) = s c + (z - h s) for stored token `tok` (its codes already in x), whichever the
// layout of the leaf's scales and zero points.
inline void scale_row(const Leaf& lf, int64_t tok, int D, float* __restrict x) {
  if (!lf.scale) return;
  const float h = lf.half();
  if (lf.mode == CHANNEL) {
    const int64_t at = (tok / lf.chan) * D;
    for (int d = 0; d < D; ++d) {
      float s = bf16(lf.scale[at + d]);
      x[d] = x[d] * s + (lf.zero ? bf16(lf.zero[at + d]) - h * s : 0.f);
    }
    return;
  }
  const int n = int(lf.groups), w = D / n;
  for (int g = 0; g < n; ++g) {
    float s = bf16(lf.scale[tok * n + g]);
    float a = lf.zero ? bf16(lf.zero[tok * n + g]) - h * s : 0.f;
    for (int d = g * w; d < (g + 1) * w; ++d) x[d] = x[d] * s + a;
  }
}

// Widen the n tokens whose storage indices are idx[0..n) into x[n][D]. DD: head_dim
// fixed at compile time (0: D at run time), so the loops over it unroll.
template <int DD>
void widen(const Leaf& lf, const int64_t* __restrict idx, int n, int Dr, float* __restrict x) {
  const int D = DD ? DD : Dr;
  for (int t = 0; t < n; ++t) {
    int64_t tok = idx[t];
    const uint8_t* r = lf.codes + tok * lf.width;
    float* o = x + t * D;
    switch (lf.kind) {
      case F32:
        std::memcpy(o, r, D * 4);
        break;
      case BF16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(r);
        for (int d = 0; d < D; ++d) o[d] = bf16(h[d]);
        break;
      }
      case F16: {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(r);
        for (int d = 0; d < D; ++d) o[d] = f16(h[d]);
        break;
      }
      case INT8: {
        const int8_t* c = reinterpret_cast<const int8_t*>(r);
        for (int d = 0; d < D; ++d) o[d] = float(c[d]);
        break;
      }
      case UINT4: {  // byte j: element j (low bits), element j + D/2 (high bits)
        int W = D / 2;
        for (int j = 0; j < W; ++j) o[j] = float(r[j] & 15), o[j + W] = float(r[j] >> 4);
        break;
      }
      case UINT2: {  // byte j: elements j + i D/4 at bits 2i
        int W = D / 4;
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < W; ++j) o[j + i * W] = float((r[j] >> (2 * i)) & 3);
        break;
      }
      case E4M3:
        for (int d = 0; d < D; ++d) o[d] = kFp8.e4m3[r[d]];
        break;
      case E5M2:
        for (int d = 0; d < D; ++d) o[d] = kFp8.e5m2[r[d]];
        break;
    }
    scale_row(lf, tok, D, o);
  }
}

// Whether any of the n slots of a tile holds a valid token (a tile of padding is skipped).
inline bool any_valid(const bool* mask, int n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (n <= 64) {  // one masked load (lanes past n are not read)
    __m512i v = _mm512_maskz_loadu_epi8(n == 64 ? ~0ULL : (1ULL << n) - 1, mask);
    return _mm512_test_epi8_mask(v, v) != 0;
  }
#endif
  bool any = false;
  for (int t = 0; t < n; ++t) any |= mask[t];
  return any;
}

// Where token t of a row lives: contiguous rows of S tokens, or pages of `page` tokens
// found through the row's sequence's block table (`pages`, null when contiguous).
// A block-table entry outside the pool (a slot no page backs: masked, but still read) is
// clamped into it, as the XLA read's gather clips, so the kernel never reads outside the
// pool's buffers.
struct Geometry {
  int64_t S, heads, page, pool;
  const int32_t* pages;  // [B, S / page]
  int64_t index(int64_t row, int64_t t) const {
    if (!pages) return row * S + t;
    int64_t b = row / heads, k = row % heads;
    int64_t pg = std::min<int64_t>(std::max<int64_t>(pages[b * (S / page) + t / page], 0),
                                   pool - 1);
    return (pg * heads + k) * page + t % page;
  }
};

// The partial state of row `row` over tokens [t_begin, t_end): m[M], s[M], acc[M][D].
template <int DD>
void scan(const float* __restrict q, const Leaf& kl, const Leaf& vl,
          const bool* __restrict mask_row, int64_t row, const Geometry& geo, int64_t t_begin,
          int64_t t_end, int M, int Dr, float* __restrict m, float* __restrict s,
          float* __restrict acc) {
  const int D = DD ? DD : Dr;
  float x[TILE * 256], p[TILE], zero[256] = {0.f}, scratch[TILE];
  int64_t idx[TILE];
  std::vector<float> lt(size_t(M) * TILE);
  for (int i = 0; i < M; ++i) m[i] = MASKED, s[i] = 0.f;
  std::fill(acc, acc + size_t(M) * D, 0.f);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += TILE) {
    int n = int(std::min<int64_t>(TILE, t_end - t0));
    if (!any_valid(mask_row + t0, n)) continue;
    for (int t = 0; t < n; ++t) idx[t] = geo.index(row, t0 + t);
    widen<DD>(kl, idx, n, D, x);
    // Four query rows at a time, so each widened key is loaded once per four logits (a
    // row past M reads the zero row and writes to a scratch row).
    for (int i0 = 0; i0 < M; i0 += 4) {
      const float* qr[4];
      float* lr[4];
      for (int j = 0; j < 4; ++j) {
        qr[j] = i0 + j < M ? q + size_t(i0 + j) * D : zero;
        lr[j] = i0 + j < M ? lt.data() + size_t(i0 + j) * TILE : scratch;
      }
      for (int t = 0; t < n; ++t) {
        const float* __restrict xt = x + t * D;
        float a0, a1, a2, a3;
        if (D % 8 == 0) {  // eight columns a step in vector registers, one horizontal sum
          v8 s0 = {}, s1 = {}, s2 = {}, s3 = {};
          for (int d = 0; d < D; d += 8) {
            v8 v = load8(xt + d);
            s0 += load8(qr[0] + d) * v, s1 += load8(qr[1] + d) * v;
            s2 += load8(qr[2] + d) * v, s3 += load8(qr[3] + d) * v;
          }
          a0 = hsum(s0), a1 = hsum(s1), a2 = hsum(s2), a3 = hsum(s3);
        } else {
          a0 = a1 = a2 = a3 = 0.f;
          for (int d = 0; d < D; ++d) {
            float v = xt[d];
            a0 += qr[0][d] * v, a1 += qr[1][d] * v, a2 += qr[2][d] * v, a3 += qr[3][d] * v;
          }
        }
        bool ok = mask_row[t0 + t];
        lr[0][t] = ok ? a0 : MASKED, lr[1][t] = ok ? a1 : MASKED;
        lr[2][t] = ok ? a2 : MASKED, lr[3][t] = ok ? a3 : MASKED;
      }
    }
    widen<DD>(vl, idx, n, D, x);
    for (int i = 0; i < M; ++i) {  // the softmax step of each row over this tile
      float* li = lt.data() + size_t(i) * TILE;
      float mx = m[i];
      for (int t = 0; t < n; ++t) mx = std::max(mx, li[t]);
      float corr = fast_exp(m[i] - mx), sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < n; ++t) {  // p overwrites the row's logits
        float e = li[t] > 0.5f * MASKED ? fast_exp(li[t] - mx) : 0.f;
        li[t] = e;
        sum += e;
      }
      float* ai = acc + size_t(i) * D;
      for (int d = 0; d < D; ++d) ai[d] *= corr;
      s[i] = s[i] * corr + sum;
      m[i] = mx;
    }
    // acc += p x: four rows by 16 columns held in registers across the tile's tokens.
    for (int i0 = 0; i0 < M; i0 += 4) {
      const float* pr[4];
      float* ar[4];
      float sink[16];
      for (int j = 0; j < 4; ++j) {
        pr[j] = i0 + j < M ? lt.data() + size_t(i0 + j) * TILE : zero;
        ar[j] = i0 + j < M ? acc + size_t(i0 + j) * D : nullptr;
      }
      for (int d0 = 0; d0 < D; d0 += 16) {
        float a[4][16];
        for (int j = 0; j < 4; ++j)
          for (int c = 0; c < 16; ++c) a[j][c] = 0.f;
        int w = std::min(16, D - d0);
        for (int t = 0; t < n; ++t) {
          const float* __restrict xt = x + t * D + d0;
          float p0 = pr[0][t], p1 = pr[1][t], p2 = pr[2][t], p3 = pr[3][t];
          for (int c = 0; c < 16; ++c) {
            float v = c < w ? xt[c] : 0.f;
            a[0][c] += p0 * v, a[1][c] += p1 * v, a[2][c] += p2 * v, a[3][c] += p3 * v;
          }
        }
        for (int j = 0; j < 4; ++j) {
          float* dst = ar[j] ? ar[j] + d0 : sink;
          for (int c = 0; c < w; ++c) dst[c] += a[j][c];
        }
      }
    }
  }
}

// The fused scan: the same computation with each codec's reads compiled for its kind and
// scale layout. Each code is converted where it is used (no widened tile). Whole-head
// scales and zero points are applied to the logits and probabilities, never to the codes:
//   logit_t = s_t (q . c_t) + o_t sum(q),    acc += sum_t (p_t s_t) c_t + sum_t p_t o_t
// with x = o + s c the codec's value (o = z - h s for int4/int2, else 0; s = 1 for floats).
// Per-channel key scales (one row per U tokens) fold into the query once per U-token block:
//   q . (s_b c + o_b) = (q * s_b) . c + q . o_b;
// head_dim groups of 16 columns or more read their scale once per group and token, and on
// values fold into the probabilities (p (s c + o) = (p s) c + p o); narrower groups apply
// their scales to eight converted codes at a time (value8: x = s c + o in registers; a group
// is at least eight elements). Query rows go in groups
// of up to four (R, a template argument: no padded row); each token's R products are
// reduced eight tokens at a time; the softmax step runs over the tile's tokens in vector
// lanes. Integer codes with whole-head scales (int8, int4, int2) meet the query as 15-bit
// integers (each row rounded once, times its scale): one int16 multiply-add into int32 per
// two columns, exact, where the float route converts every code to float first.
template <int KIND>
inline v8 codes8(const uint8_t* __restrict r, int d, int D) {
  v8 v;
  if constexpr (KIND == F32) {
    std::memcpy(&v, r + 4 * d, 32);
  } else if constexpr (KIND == E4M3 || KIND == E5M2) {
#if defined(__F16C__) && defined(__AVX2__)
    // Through half precision, exactly: an e5m2 byte is the top byte of the half with its
    // value; an e4m3 byte's exponent and mantissa shifted into a half's are its value
    // times 2^-8 (subnormals land on half subnormals). e4m3's NaN code S.1111.111 reads
    // as 480 here: the codec stores it only for a group holding a NaN, whose scale it
    // stores as NaN too, so the value read is NaN all the same.
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + d)));
    __m256 f;
    if constexpr (KIND == E5M2) {
      f = _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    } else {
      __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                               _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
      f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
    }
    std::memcpy(&v, &f, 32);
#else
    const float* tab = KIND == E4M3 ? kFp8.e4m3 : kFp8.e5m2;
    for (int i = 0; i < 8; ++i) v[i] = tab[r[d + i]];
#endif
  } else if constexpr (KIND == F16) {
#ifdef __F16C__
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * d)));
    std::memcpy(&v, &f, 32);
#else
    for (int i = 0; i < 8; ++i) {
      uint16_t h;
      std::memcpy(&h, r + 2 * (d + i), 2);
      v[i] = f16(h);
    }
#endif
  } else {
#ifdef __AVX2__
    __m256i w;
    if constexpr (KIND == BF16) {
      w = _mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * d))), 16);
      __m256 f = _mm256_castsi256_ps(w);
      std::memcpy(&v, &f, 32);
      return v;
    } else if constexpr (KIND == INT8) {
      w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + d)));
    } else {
      constexpr int bits = KIND == UINT4 ? 4 : 2;
      const int W = D * bits / 8, plane = d / W;
      __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + (d - plane * W)));
      c = _mm_and_si128(_mm_srli_epi16(c, bits * plane), _mm_set1_epi8((1 << bits) - 1));
      w = _mm256_cvtepu8_epi32(c);
    }
    __m256 f = _mm256_cvtepi32_ps(w);
    std::memcpy(&v, &f, 32);
#else
    for (int i = 0; i < 8; ++i) {
      if constexpr (KIND == BF16) {
        uint16_t h;
        std::memcpy(&h, r + 2 * (d + i), 2);
        v[i] = bf16(h);
      } else if constexpr (KIND == INT8) {
        v[i] = float(int8_t(r[d + i]));
      } else {
        constexpr int bits = KIND == UINT4 ? 4 : 2;
        const int W = D * bits / 8, plane = (d + i) / W;
        v[i] = float((r[d + i - plane * W] >> (bits * plane)) & ((1 << bits) - 1));
      }
    }
#endif
  }
  return v;
}

inline v8 splat(float x) { return v8{} + x; }

inline v8 bf16x8(const uint16_t* p) {  // eight bfloat16 values as floats
  v8 v;
#ifdef __AVX2__
  __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  std::memcpy(&v, &f, 32);
#else
  for (int i = 0; i < 8; ++i) v[i] = bf16(p[i]);
#endif
  return v;
}

// Columns [d, d + 8) of stored token `tok` as values: the codes, with a head_dim group's or
// the channels' scales and zero points applied (MODE GROUPED / CHANNEL); WHOLE leaves the
// codes as they are (their scales are applied to logits and probabilities).
template <int KIND, int MODE>
inline v8 value8(const Leaf& lf, const uint8_t* __restrict r, int64_t tok, int d, int D) {
  constexpr bool asym = KIND == UINT4 || KIND == UINT2;  // the kinds with zero points
  constexpr float h = KIND == UINT4 ? 7.5f : 1.5f;
  v8 c = codes8<KIND>(r, d, D);
  if constexpr (MODE == GROUPED) {
    const int64_t at = tok * lf.groups + (d >> lf.gshift);
    float s = bf16(lf.scale[at]);
    return asym ? c * s + (bf16(lf.zero[at]) - h * s) : c * s;
  } else if constexpr (MODE == CHANNEL) {
    const int64_t at = (tok >> lf.cshift) * D + d;
    v8 s = bf16x8(lf.scale + at);
    return asym ? c * s + (bf16x8(lf.zero + at) - h * s) : c * s;
  }
  return c;
}

// The whole-head scale s and offset o of each of the TILE tokens idx[0..TILE) (1 and 0
// for a leaf without them, or whose scales `value8` applies).
// `run`: the TILE tokens are consecutive in storage (idx[t] = idx[0] + t), so their scales
// are read eight at a time.
inline void metas(const Leaf& lf, const int64_t* idx, bool run, float* s, float* o) {
  const float h = lf.half();
  if (lf.mode != WHOLE || !lf.scale) {
    for (int t = 0; t < TILE; ++t) s[t] = 1.f, o[t] = 0.f;
  } else if (run) {
    for (int t = 0; t < TILE; t += 8) {
      v8 sv = bf16x8(lf.scale + idx[0] + t);
      v8 ov = lf.zero ? bf16x8(lf.zero + idx[0] + t) - h * sv : v8{};
      std::memcpy(s + t, &sv, 32);
      std::memcpy(o + t, &ov, 32);
    }
  } else {
    for (int t = 0; t < TILE; ++t) s[t] = bf16(lf.scale[idx[t]]);
    for (int t = 0; t < TILE; ++t) o[t] = lf.zero ? bf16(lf.zero[idx[t]]) - h * s[t] : 0.f;
  }
}

typedef int32_t vi8 __attribute__((vector_size(32)));

inline v8 vmax(v8 a, v8 b) { return a > b ? a : b; }

inline float hmax(v8 v) {
  float r = v[0];
  for (int i = 1; i < 8; ++i) r = std::max(r, v[i]);
  return r;
}

// exp(x) for x <= 0, eight lanes: fast_exp's polynomial, rounding by the 1.5 * 2^23 trick.
inline v8 exp8(v8 x) {
  x = vmax(x, splat(-87.f));
  v8 y = x * 1.44269504088896341f;
  v8 n = (y + 12582912.f) - 12582912.f;
  v8 p = exp2_poly(y - n);
  vi8 bits = (__builtin_convertvector(n, vi8) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, 32);
  return p * scale;
}

// Eight accumulators (one per token) -> the eight tokens' sums, in token order.
inline v8 reduce8(const v8* a) {
#ifdef __AVX2__
  __m256 b[8];
  std::memcpy(b, a, sizeof b);
  __m256 h01 = _mm256_hadd_ps(b[0], b[1]), h23 = _mm256_hadd_ps(b[2], b[3]);
  __m256 h45 = _mm256_hadd_ps(b[4], b[5]), h67 = _mm256_hadd_ps(b[6], b[7]);
  __m256 h03 = _mm256_hadd_ps(h01, h23), h47 = _mm256_hadd_ps(h45, h67);
  __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20),
                           _mm256_permute2f128_ps(h03, h47, 0x31));
  v8 v;
  std::memcpy(&v, &r, 32);
  return v;
#else
  v8 v;
  for (int u = 0; u < 8; ++u) v[u] = hsum(a[u]);
  return v;
#endif
}

// The most blocks of a loop over `units` equal blocks at most `cap` wide: the largest
// divisor of units up to cap, so blocks never run past the row (head_dim 96 is six
// sixteen-column units: blocks of 3 or 6, never of 4).
constexpr int fit_blocks(int units, int cap) {
  for (int b = cap < units ? cap : units; b > 1; --b)
    if (units % b == 0) return b;
  return 1;
}

// What a tile's reads need of the query rows: the rows, their sums (for zero points) and,
// for integer keys, each row as 15-bit integers times a scale.
struct Rows {
  const float* q;
  const int16_t* q16;
  const float* qsc;
};

// acc[j] += sum_t p[j][t] x_t for R rows: C eight-column vectors of each row held in
// registers across the tile's tokens, R * C >= 8 independent sums where the registers
// allow, so the multiply-adds' latency is hidden.
template <int KIND, int MODE, int D, int R>
void pv_rows(const Leaf& vl, const int64_t* idx, int n, float (*p)[TILE], float* __restrict acc) {
  constexpr int C0 = R == 1 ? 8 : R == 4 ? 2 : 4;
  constexpr int C = fit_blocks(D / 8, C0);
  for (int d0 = 0; d0 < D; d0 += 8 * C) {
    v8 a[R][C] = {};
    for (int t = 0; t < n; ++t) {
      const uint8_t* r = vl.codes + idx[t] * vl.width;
      v8 pj[R];
      for (int j = 0; j < R; ++j) pj[j] = splat(p[j][t]);
      for (int k = 0; k < C; ++k) {  // each vector used as soon as it is converted
        v8 c = value8<KIND, MODE>(vl, r, idx[t], d0 + 8 * k, D);
        for (int j = 0; j < R; ++j) a[j][k] += pj[j] * c;
      }
    }
    for (int j = 0; j < R; ++j)
      for (int k = 0; k < C; ++k) {
        float* dst = acc + size_t(j) * D + d0 + 8 * k;
        v8 x = load8(dst) + a[j][k];
        std::memcpy(dst, &x, 32);
      }
  }
}

#ifdef __AVX2__
// Integer codes with whole-head scales against the 15-bit query: 16 codes widened to int16
// once per token serve every row; the query's scale joins the key's on the logit.
template <int KIND, int MODE, int D>
constexpr bool int_qk() {
  return MODE == WHOLE && ((KIND == INT8 && D % 16 == 0) || (KIND == UINT4 && (D / 2) % 16 == 0) ||
                           (KIND == UINT2 && (D / 4) % 16 == 0));
}

template <int KIND>
inline __m256i codes16(const uint8_t* __restrict r, int d, int D) {
  if constexpr (KIND == INT8) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d)));
  } else {
    constexpr int bits = KIND == UINT4 ? 4 : 2;
    const int W = D * bits / 8, plane = d / W;
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + (d - plane * W)));
    c = _mm_and_si128(_mm_srli_epi16(c, bits * plane), _mm_set1_epi8((1 << bits) - 1));
    return _mm256_cvtepu8_epi16(c);
  }
}

inline __m256 reduce8i(const __m256i* b) {
  __m256i h01 = _mm256_hadd_epi32(b[0], b[1]), h23 = _mm256_hadd_epi32(b[2], b[3]);
  __m256i h45 = _mm256_hadd_epi32(b[4], b[5]), h67 = _mm256_hadd_epi32(b[6], b[7]);
  __m256i h03 = _mm256_hadd_epi32(h01, h23), h47 = _mm256_hadd_epi32(h45, h67);
  __m256i r = _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20),
                               _mm256_permute2x128_si256(h03, h47, 0x31));
  return _mm256_cvtepi32_ps(r);
}

// lt[j][t] = (q16_j . c_t) * qsc_j (an exact integer sum, then its scale).
template <int KIND, int D, int R>
inline void qk_rows_int(const int16_t* __restrict q16, const float* qsc, const Leaf& kl,
                        const int64_t* idx, int n, float (*lt)[TILE]) {
  for (int t0 = 0; t0 < n; t0 += 8) {
    __m256i part[R][8];
    for (int u = 0; u < 8; ++u) {
      const uint8_t* r = kl.codes + idx[t0 + u < n ? t0 + u : 0] * kl.width;
      __m256i a[R];
      for (int j = 0; j < R; ++j) a[j] = _mm256_setzero_si256();
      for (int d = 0; d < D; d += 16) {
        __m256i c = codes16<KIND>(r, d, D);
        for (int j = 0; j < R; ++j)
          a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(c, _mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(q16 + j * D + d))));
      }
      for (int j = 0; j < R; ++j) part[j][u] = a[j];
    }
    for (int j = 0; j < R; ++j)
      _mm256_storeu_ps(lt[j] + t0, _mm256_mul_ps(reduce8i(part[j]), _mm256_set1_ps(qsc[j])));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// AVX-512 forms of the whole-head reads: sixteen columns per register, so a token costs
// half the instructions of the eight-lane forms above. Packed kinds need 16 columns (32 for
// the integer logits) within one bit plane.
template <int KIND, int D, int COLS>
constexpr bool in_plane() {
  if constexpr (KIND == UINT4 && D == 16 && COLS == 16) return true;  // both planes, one load
  if constexpr (KIND == UINT4) return (D / 2) % COLS == 0;
  else if constexpr (KIND == UINT2) return (D / 4) % COLS == 0;
  else return D % COLS == 0;
}

// Columns [d, d + 16) of a token's codes as floats.
template <int KIND>
inline __m512 codes16f(const uint8_t* __restrict r, int d, int D) {
  if constexpr (KIND == F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(r) + d);
  } else if constexpr (KIND == BF16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 2 * d));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (KIND == F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 2 * d)));
  } else if constexpr (KIND == E4M3 || KIND == E5M2) {  // through half precision, as codes8
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d)));
    if constexpr (KIND == E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    __m256i h = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  } else if constexpr (KIND == INT8) {
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  } else {
    constexpr int bits = KIND == UINT4 ? 4 : 2;
    const __m128i low = _mm_set1_epi8((1 << bits) - 1);
    if (KIND == UINT4 && D == 16) {  // the row's 8 bytes: columns 0-7 low, 8-15 high
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r));
      __m128i c = _mm_unpacklo_epi64(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
    }
    const int W = D * bits / 8, plane = d / W;
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + (d - plane * W)));
    c = _mm_and_si128(_mm_srli_epi16(c, bits * plane), low);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
  }
}

inline v8 fold16(__m512 a) {  // the two halves' sum
  __m256 s = _mm256_add_ps(_mm512_castps512_ps256(a),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  v8 v;
  std::memcpy(&v, &s, 32);
  return v;
}

// Integer codes against the 15-bit query, 32 codes widened to int16 per register.
template <int KIND>
inline __m256i bytes32(const uint8_t* __restrict r, int d, int D) {  // 32 columns' codes
  if constexpr (KIND == INT8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + d));
  } else {
    constexpr int bits = KIND == UINT4 ? 4 : 2;
    const int W = D * bits / 8, plane = d / W;
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + (d - plane * W)));
    return _mm256_and_si256(_mm256_srli_epi16(c, bits * plane), _mm256_set1_epi8((1 << bits) - 1));
  }
}

template <int KIND>
inline __m512i widen16(__m256i b) {
  if constexpr (KIND == INT8) return _mm512_cvtepi8_epi16(b);
  return _mm512_cvtepu8_epi16(b);
}

template <int KIND>
inline __m512i codes32(const uint8_t* __restrict r, int d, int D) {
  return widen16<KIND>(bytes32<KIND>(r, d, D));
}

template <int KIND, int D, int R>
void qk_rows_int32(const int16_t* __restrict q16, const float* qsc, const Leaf& kl,
                   const int64_t* idx, int n, float (*lt)[TILE]) {
  for (int t0 = 0; t0 < n; t0 += 8) {
    __m256i part[R][8];
    for (int u = 0; u < 8; ++u) {
      const uint8_t* r = kl.codes + idx[t0 + u < n ? t0 + u : 0] * kl.width;
      __m512i a[R];
      for (int j = 0; j < R; ++j) a[j] = _mm512_setzero_si512();
      for (int d = 0; d < D; d += 32) {
        __m512i c = codes32<KIND>(r, d, D);
        for (int j = 0; j < R; ++j) {
          __m512i qv = _mm512_loadu_si512(q16 + j * D + d);
#ifdef __AVX512VNNI__
          a[j] = _mm512_dpwssd_epi32(a[j], c, qv);
#else
          a[j] = _mm512_add_epi32(a[j], _mm512_madd_epi16(c, qv));
#endif
        }
      }
      for (int j = 0; j < R; ++j)
        part[j][u] = _mm256_add_epi32(_mm512_castsi512_si256(a[j]), _mm512_extracti64x4_epi64(a[j], 1));
    }
    for (int j = 0; j < R; ++j)
      _mm256_storeu_ps(lt[j] + t0, _mm256_mul_ps(reduce8i(part[j]), _mm256_set1_ps(qsc[j])));
  }
}

// acc[j] += sum_t p[j][t] c_t over codes with whole-head scales (folded into p by the
// caller): up to 24 sixteen-column sums held in registers across the tile's tokens, and
// two sets over alternate tokens where one set is too few to hide the multiply-adds'
// latency. Slots past n hold p = 0 and a valid token, so the pairs may run one past n.
template <int KIND, int D, int R>
void pv_rows16(const Leaf& vl, const int64_t* idx, int n, float (*p)[TILE], float* __restrict acc) {
  constexpr int V = D / 16, CB0 = R <= 3 ? 8 : 4, CB = fit_blocks(V, CB0);
  constexpr int U = R * CB >= 8 ? 1 : 2;
  for (int d0 = 0; d0 < D; d0 += 16 * CB) {
    __m512 a[U][R][CB];
    for (int e = 0; e < U; ++e)
      for (int j = 0; j < R; ++j)
        for (int k = 0; k < CB; ++k) a[e][j][k] = _mm512_setzero_ps();
    for (int t = 0; t < n; t += U) {
      for (int e = 0; e < U; ++e) {
        const uint8_t* r = vl.codes + idx[t + e] * vl.width;
        __m512 pj[R];
        for (int j = 0; j < R; ++j) pj[j] = _mm512_set1_ps(p[j][t + e]);
        for (int k = 0; k < CB; ++k) {
          __m512 c = codes16f<KIND>(r, d0 + 16 * k, D);
          for (int j = 0; j < R; ++j) a[e][j][k] = _mm512_fmadd_ps(pj[j], c, a[e][j][k]);
        }
      }
    }
    for (int j = 0; j < R; ++j)
      for (int k = 0; k < CB; ++k) {
        float* dst = acc + size_t(j) * D + d0 + 16 * k;
        __m512 x = a[0][j][k];
        if constexpr (U == 2) x = _mm512_add_ps(x, a[U - 1][j][k]);
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), x));
      }
  }
}

// P.V over integer codes with whole-head scales, as exact integer sums: each row's
// probabilities (the value scales already folded in) are rounded once per tile to 15-bit
// integers against the tile's largest (the same rounding as the query's for integer keys),
// two tokens' codes are interleaved byte by byte so one int16 multiply-add pairs them, and
// the int32 sums of a tile are scaled into the float accumulator. A unit of 32 columns
// comes out of the interleave in the order {0-7, 16-23}, {8-15, 24-31}, put back once per
// tile. A tile whose probabilities are not all finite takes the float form.
template <int KIND, int D>
constexpr bool int_pv() {
  return (KIND == INT8 && D % 32 == 0) || (KIND == UINT4 && (D / 2) % 32 == 0) ||
         (KIND == UINT2 && (D / 4) % 32 == 0);
}


// Each of R rows' probabilities as 15-bit integers against the row's largest (p16, its
// scale psc): false where a row holds a non-finite value (the caller keeps the float form).
template <int R>
inline bool p15(float (*p)[TILE], int16_t (*p16)[TILE], float* psc) {
  for (int j = 0; j < R; ++j) {
    __m512 mx = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
    for (int t = 0; t < TILE; t += 16) {
      __m512 x = _mm512_loadu_ps(p[j] + t);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
      sum = _mm512_add_ps(sum, x);
    }
    const float m = _mm512_reduce_max_ps(mx);
    if (!std::isfinite(_mm512_reduce_add_ps(sum)) || !std::isfinite(m)) return false;
    psc[j] = m / 32767.f;
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int t = 0; t < TILE; t += 16)
      _mm256_store_si256(reinterpret_cast<__m256i*>(p16[j] + t),
                         _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p[j] + t), inv))));
  }
  return true;
}

template <int KIND, int D, int R>
void pv_rows_int(const Leaf& vl, const int64_t* idx, int n, float (*p)[TILE], float* __restrict acc) {
  alignas(64) int16_t p16[R][TILE];
  float psc[R];
  if (!p15<R>(p, p16, psc)) {
    pv_rows16<KIND, D, R>(vl, idx, n, p, acc);
    return;
  }
  const int32_t* pp[R];  // (p_t, p_t+1) pairs
  for (int j = 0; j < R; ++j) pp[j] = reinterpret_cast<const int32_t*>(p16[j]);
  constexpr int UNITS = D / 32, UB0 = R == 1 ? 8 : R <= 3 ? 4 : 2, UB = fit_blocks(UNITS, UB0);
  for (int u0 = 0; u0 < UNITS; u0 += UB) {
    __m512i ax[R][UB], ay[R][UB];
    for (int j = 0; j < R; ++j)
      for (int k = 0; k < UB; ++k) ax[j][k] = ay[j][k] = _mm512_setzero_si512();
    for (int t = 0; t < n; t += 2) {  // slot n (n odd) holds p = 0 and a valid token
      const uint8_t* ra = vl.codes + idx[t] * vl.width;
      const uint8_t* rb = vl.codes + idx[t + 1] * vl.width;
      __m512i pv[R];
      for (int j = 0; j < R; ++j) pv[j] = _mm512_set1_epi32(pp[j][t / 2]);
      for (int k = 0; k < UB; ++k) {
        const int d = 32 * (u0 + k);
        __m256i a = bytes32<KIND>(ra, d, D), b = bytes32<KIND>(rb, d, D);
        __m512i x = widen16<KIND>(_mm256_unpacklo_epi8(a, b));
        __m512i y = widen16<KIND>(_mm256_unpackhi_epi8(a, b));
        for (int j = 0; j < R; ++j) {
#ifdef __AVX512VNNI__
          ax[j][k] = _mm512_dpwssd_epi32(ax[j][k], x, pv[j]);
          ay[j][k] = _mm512_dpwssd_epi32(ay[j][k], y, pv[j]);
#else
          ax[j][k] = _mm512_add_epi32(ax[j][k], _mm512_madd_epi16(x, pv[j]));
          ay[j][k] = _mm512_add_epi32(ay[j][k], _mm512_madd_epi16(y, pv[j]));
#endif
        }
      }
    }
    for (int j = 0; j < R; ++j) {
      const __m512 sc = _mm512_set1_ps(psc[j]);
      for (int k = 0; k < UB; ++k) {
        __m512 fx = _mm512_cvtepi32_ps(ax[j][k]), fy = _mm512_cvtepi32_ps(ay[j][k]);
        float* dst = acc + size_t(j) * D + 32 * (u0 + k);
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_shuffle_f32x4(fx, fy, 0x44), sc, _mm512_loadu_ps(dst)));
        _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_shuffle_f32x4(fx, fy, 0xEE), sc,
                                                   _mm512_loadu_ps(dst + 16)));
      }
    }
  }
}
#define KVJAX_AVX512 1
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
// Int4 at head_dim 16 (8 bytes a token), four tokens a register: a row's codes are too few
// to fill sixteen lanes, so the one-token forms spend most of their instructions on the
// nibble split and the lane sums. Here four tokens' 32 bytes split into low nibbles
// (columns 0-7) and high (8-15) once, and the integer products run over all four at once.
inline __m256i four_rows8(const uint8_t* __restrict codes, const int64_t* idx) {
  if (idx[3] - idx[0] == 3)  // consecutive tokens (a contiguous row): one load
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + idx[0] * 8));
  int64_t w[4];
  for (int u = 0; u < 4; ++u) std::memcpy(w + u, codes + idx[u] * 8, 8);
  return _mm256_set_epi64x(w[3], w[2], w[1], w[0]);
}

// lt[j][t] = (q16_j . c_t) * qsc_j: for four tokens at once, the low-nibble columns meet
// the row's columns 0-7 and the high ones 8-15 (each repeated in the four 128-bit lanes),
// leaving each token's four pair sums in its own lane; sixteen tokens' sums are transposed
// into place (unpacks, adds and one permute).
template <int R>
void qk_rows_int4_d16(const int16_t* __restrict q16, const float* qsc, const Leaf& kl,
                      const int64_t* idx, int n, float (*lt)[TILE]) {
  const __m256i low = _mm256_set1_epi8(15);
  __m512i ql[R], qh[R];
  for (int j = 0; j < R; ++j) {
    ql[j] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q16 + 16 * j)));
    qh[j] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q16 + 16 * j + 8)));
  }
  // lane 4u + g of the transposed sums holds token 4g + u
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (int t0 = 0; t0 < n; t0 += 16) {  // slots up to the tile's end hold valid tokens
    __m512i a[R][4];
    for (int g = 0; g < 4; ++g) {
      const __m256i x = four_rows8(kl.codes, idx + t0 + 4 * g);
      const __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(x, low));
      const __m512i hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(x, 4), low));
      for (int j = 0; j < R; ++j)
        a[j][g] = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, ql[j]), hi, qh[j]);
    }
    for (int j = 0; j < R; ++j) {
      const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[j][0], a[j][1]),
                                           _mm512_unpackhi_epi32(a[j][0], a[j][1]));
      const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[j][2], a[j][3]),
                                           _mm512_unpackhi_epi32(a[j][2], a[j][3]));
      const __m512i sum = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23),
                                           _mm512_unpackhi_epi64(s01, s23));
      _mm512_storeu_ps(lt[j] + t0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(order, sum)),
                                                 _mm512_set1_ps(qsc[j])));
    }
  }
}

// P.V for int4 values at head_dim 16, as pv_rows_int's exact integer sums: four tokens'
// nibbles are split once, one byte permute lays each pair of tokens' codes out column by
// column (t, t+1 adjacent), and one int16 multiply-add per pair meets their 15-bit
// probabilities; one int32 sum per column. Two sets of sums over alternate token blocks.
template <int R>
void pv_rows_int4_d16(const Leaf& vl, const int64_t* idx, int n, float (*p)[TILE],
                      float* __restrict acc) {
  alignas(64) int16_t p16[R][TILE];
  float psc[R];
  if (!p15<R>(p, p16, psc)) {
    pv_rows16<UINT4, 16, R>(vl, idx, n, p, acc);
    return;
  }
  // byte 32 P + 2 d + e of the permuted pair block: column d of token 2 P + e, from the low
  // nibbles (bytes 8 t + d) for d < 8, else the high ones (bytes 32 + 8 t + d - 8)
  alignas(64) uint8_t pick[64];
  for (int o = 0; o < 64; ++o) {
    const int t = 2 * (o / 32) + o % 2, d = (o % 32) / 2;
    pick[o] = uint8_t(d < 8 ? 8 * t + d : 32 + 8 * t + d - 8);
  }
  const __m512i perm = _mm512_load_si512(pick);
  const __m256i low = _mm256_set1_epi8(15);
  __m512i a[2][R];
  for (int e = 0; e < 2; ++e)
    for (int j = 0; j < R; ++j) a[e][j] = _mm512_setzero_si512();
  const int32_t* pp[R];  // (p_t, p_t+1) pairs
  for (int j = 0; j < R; ++j) pp[j] = reinterpret_cast<const int32_t*>(p16[j]);
  for (int t = 0; t < n; t += 4) {  // slots past n hold p = 0 and a valid token
    const __m256i x = four_rows8(vl.codes, idx + t);
    const __m512i z = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(x, low)),
        _mm256_and_si256(_mm256_srli_epi16(x, 4), low), 1);
    const __m512i y = _mm512_permutexvar_epi8(perm, z);
    const __m512i c01 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(y));
    const __m512i c23 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(y, 1));
    for (int j = 0; j < R; ++j) {
      a[0][j] = _mm512_dpwssd_epi32(a[0][j], c01, _mm512_set1_epi32(pp[j][t / 2]));
      a[1][j] = _mm512_dpwssd_epi32(a[1][j], c23, _mm512_set1_epi32(pp[j][t / 2 + 1]));
    }
  }
  for (int j = 0; j < R; ++j) {
    float* dst = acc + size_t(j) * 16;
    const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(a[0][j], a[1][j]));
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(f, _mm512_set1_ps(psc[j]), _mm512_loadu_ps(dst)));
  }
}
#define KVJAX_INT4_D16 1
#endif

// The key reads and the grouped value read at W lanes a register: eight (v8) everywhere,
// sixteen (__m512) where AVX-512 is. `fma_w` is a fused multiply-add at sixteen lanes and
// a multiply then an add at eight, as each form was written.
template <int W>
struct Lanes {
  using V = v8;
};
#ifdef KVJAX_AVX512
template <>
struct Lanes<16> {
  using V = __m512;
};
#endif

template <int KIND, int W>
inline typename Lanes<W>::V codes_w(const uint8_t* __restrict r, int d, int D) {
#ifdef KVJAX_AVX512
  if constexpr (W == 16) return codes16f<KIND>(r, d, D);
#endif
  if constexpr (W == 8) return codes8<KIND>(r, d, D);
}

template <int W>
inline typename Lanes<W>::V bf16_w(const uint16_t* p) {  // W bfloat16 values as floats
#ifdef KVJAX_AVX512
  if constexpr (W == 16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#endif
  if constexpr (W == 8) return bf16x8(p);
}

template <class V>
inline V load_w(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class V>
inline V fma_w(V a, V b, V c) {  // a b + c
#ifdef KVJAX_AVX512
  if constexpr (sizeof(V) == 64) return _mm512_fmadd_ps(a, b, c);
#endif
  if constexpr (sizeof(V) == 32) return a * b + c;
}

template <class V>
inline v8 fold_w(V a) {  // the eight-lane sum of a register's lanes
#ifdef KVJAX_AVX512
  if constexpr (sizeof(V) == 64) return fold16(a);
#endif
  if constexpr (sizeof(V) == 32) return a;
}

// The logits of R query rows over the n tokens idx[0..n) (n a multiple of 8 or the tile's
// tail, padded with token idx[0]), eight tokens at a time: dot(tok, a, off) adds token
// tok's R products into the W-lane sums a[0..R) and, where OFF, sets the offset off[0..R)
// its logits take; the eight tokens' sums are reduced into lt[j][t0..t0+8).
template <int R, bool OFF, int W, class Dot>
inline void logits(const int64_t* idx, int n, float (*lt)[TILE], Dot&& dot) {
  using V = typename Lanes<W>::V;
  for (int t0 = 0; t0 < n; t0 += 8) {
    v8 part[R][8];
    alignas(32) float off[R][8];
    for (int u = 0; u < 8; ++u) {
      V a[R];
      for (int j = 0; j < R; ++j) a[j] = V{};
      float o[R] = {};
      dot(idx[t0 + u < n ? t0 + u : 0], a, o);
      for (int j = 0; j < R; ++j) part[j][u] = fold_w(a[j]), off[j][u] = o[j];
    }
    for (int j = 0; j < R; ++j) {
      v8 v = reduce8(part[j]);
      if constexpr (OFF) v += load8(off[j]);
      std::memcpy(lt[j] + t0, &v, 32);
    }
  }
}

// lt[j][t] = q_j . x_t, x the values value8 gives (so whole-head scales are still to be
// applied by the caller); at sixteen lanes whole-head codes only.
template <int KIND, int MODE, int D, int R, int W = 8>
inline void qk_rows(const float* __restrict q, const Leaf& kl, const int64_t* idx, int n,
                    float (*lt)[TILE]) {
  using V = typename Lanes<W>::V;
  static_assert(W == 8 || MODE == WHOLE, "sixteen lanes: whole-head codes");
  logits<R, false, W>(idx, n, lt, [&](int64_t tok, V* a, float*) {
    const uint8_t* r = kl.codes + tok * kl.width;
    for (int d = 0; d < D; d += W) {
      V c;
      if constexpr (W == 8) c = value8<KIND, MODE>(kl, r, tok, d, D);
      else c = codes_w<KIND, W>(r, d, D);
      for (int j = 0; j < R; ++j) a[j] = fma_w(load_w<V>(q + j * D + d), c, a[j]);
    }
  });
}

// Logits of R query rows over keys with head_dim-group scales of exactly GW columns: each
// group's scale and offset are read once per token and applied to its GW / W converted
// vectors (value8 reads them for every vector).
template <int KIND, int D, int R, int GW, int W = 8>
void qk_rows_grouped(const Rows& rows, const Leaf& kl, const int64_t* idx, int n,
                     float (*lt)[TILE]) {
  using V = typename Lanes<W>::V;
  const float* __restrict q = rows.q;
  constexpr bool asym = KIND == UINT4 || KIND == UINT2;
  constexpr float h = KIND == UINT4 ? 7.5f : 1.5f;
  constexpr int G = D / GW;
  logits<R, false, W>(idx, n, lt, [&](int64_t tok, V* a, float*) {
    const uint8_t* r = kl.codes + tok * kl.width;
    for (int g = 0; g < G; ++g) {
      const float sg = bf16(kl.scale[tok * G + g]);
      const V sv = V{} + sg, ov = V{} + (asym ? bf16(kl.zero[tok * G + g]) - h * sg : 0.f);
      for (int d = g * GW; d < (g + 1) * GW; d += W) {
        V c = codes_w<KIND, W>(r, d, D);
        c = asym ? fma_w(c, sv, ov) : c * sv;
        for (int j = 0; j < R; ++j) a[j] = fma_w(load_w<V>(q + j * D + d), c, a[j]);
      }
    }
  });
}

// Logits over keys with per-channel scales (one scale row per U stored tokens), the scales
// folded into the query: for the tokens of one scale row b,
//   q_j . (s_b c + o_b) = (q_j * s_b) . c + q_j . o_b,
// so each row b met costs one scaled copy of the R query rows and their offset, and the
// tokens' inner loop is that of codes without scales. lt holds whole logits (the caller's
// whole-head scale is 1 and its offset 0 for such a leaf).
template <int KIND, int D, int R, int W = 8>
inline void qk_rows_chan(const float* __restrict q, const Leaf& kl, const int64_t* idx, int n,
                         float (*lt)[TILE]) {
  using V = typename Lanes<W>::V;
  constexpr bool asym = KIND == UINT4 || KIND == UINT2;
  constexpr float h = KIND == UINT4 ? 7.5f : 1.5f;
  alignas(64) float qf[R][D];
  float bias[R] = {};
  int64_t blk = -1;
  logits<R, true, W>(idx, n, lt, [&](int64_t tok, V* a, float* off) {
    if ((tok >> kl.cshift) != blk) {  // fold scale row b into the query rows
      blk = tok >> kl.cshift;
      V bo[R];
      for (int j = 0; j < R; ++j) bo[j] = V{};
      for (int d = 0; d < D; d += W) {
        const V sv = bf16_w<W>(kl.scale + blk * D + d);
        const V ov = asym ? bf16_w<W>(kl.zero + blk * D + d) - h * sv : V{};
        for (int j = 0; j < R; ++j) {
          const V qv = load_w<V>(q + j * D + d);
          const V x = qv * sv;
          std::memcpy(qf[j] + d, &x, sizeof x);
          if constexpr (asym) bo[j] = fma_w(qv, ov, bo[j]);
        }
      }
      for (int j = 0; j < R; ++j) bias[j] = asym ? hsum(fold_w(bo[j])) : 0.f;
    }
    const uint8_t* r = kl.codes + tok * kl.width;
    for (int d = 0; d < D; d += W) {
      V c = codes_w<KIND, W>(r, d, D);
      for (int j = 0; j < R; ++j) a[j] = fma_w(load_w<V>(qf[j] + d), c, a[j]);
    }
    for (int j = 0; j < R; ++j) off[j] = bias[j];
  });
}

// P.V over values with head_dim-group scales of exactly GW columns, the scales folded into
// the probabilities: for group g of token t, p (s c + o) = (p s) c + p o, so a group's
// columns meet the codes times one number per (row, token), and p o sums apart (off),
// added to the group's columns once per tile.
template <int KIND, int D, int R, int GW, int W = 8>
void pv_rows_grouped(const Leaf& vl, const int64_t* idx, int n, float (*p)[TILE],
                     float* __restrict acc) {
  using V = typename Lanes<W>::V;
  constexpr bool asym = KIND == UINT4 || KIND == UINT2;
  constexpr float h = KIND == UINT4 ? 7.5f : 1.5f;
  constexpr int G = D / GW;
  constexpr int C0 = W == 16 ? (R <= 3 ? 8 : 4) : R == 1 ? 8 : R == 4 ? 2 : 4;
  constexpr int C = C0 * W <= GW ? C0 : GW / W;  // a block of W C columns in one group
  for (int d0 = 0; d0 < D; d0 += W * C) {
    const int g = d0 / GW;
    V a[R][C];
    for (int j = 0; j < R; ++j)
      for (int k = 0; k < C; ++k) a[j][k] = V{};
    float off[R] = {};
    for (int t = 0; t < n; ++t) {
      const int64_t at = idx[t] * G + g;
      const float sg = bf16(vl.scale[at]);
      const uint8_t* r = vl.codes + idx[t] * vl.width;
      V pj[R];
      for (int j = 0; j < R; ++j) pj[j] = V{} + p[j][t] * sg;
      if constexpr (asym) {
        const float og = bf16(vl.zero[at]) - h * sg;
        for (int j = 0; j < R; ++j) off[j] += p[j][t] * og;
      }
      for (int k = 0; k < C; ++k) {
        V c = codes_w<KIND, W>(r, d0 + W * k, D);
        for (int j = 0; j < R; ++j) a[j][k] = fma_w(pj[j], c, a[j][k]);
      }
    }
    for (int j = 0; j < R; ++j)
      for (int k = 0; k < C; ++k) {
        float* dst = acc + size_t(j) * D + d0 + W * k;
        V x = load_w<V>(dst) + a[j][k] + off[j];
        std::memcpy(dst, &x, sizeof x);
      }
  }
}

#ifdef KVJAX_AVX512
// bfloat16 codes in pairs of registers: one 64-byte load holds 32 columns, whose even
// columns are each 32-bit lane's low half shifted up and whose odd columns are the lane
// with its low half cleared. A shift and a mask cost two simple operations per 32 columns,
// where widening sixteen columns in order takes a lane-crossing zero-extend and a shift
// each, and the zero-extend competes with the multiply-adds for a port on some cores. The
// columns come out split by parity, so the logits take the query rows split the same way
// (a sum's order is free) and P.V puts its sums back in column order once per tile.
template <int D>
constexpr bool bf16_pairs() {
  return D % 32 == 0;
}

inline void bf16_split(const uint8_t* __restrict r, int d, __m512* ev, __m512* od) {
  const __m512i x = _mm512_loadu_si512(r + 2 * d);
  *ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  *od = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xFFFF0000u))));
}

template <int D, int R>
void qk_rows_bf16(const float* __restrict q, const Leaf& kl, const int64_t* idx, int n,
                  float (*lt)[TILE]) {
  // Each row's 32-column blocks as even columns, then odd: two permutes a block and row,
  // once per tile.
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  alignas(64) float qs[R][D];
  for (int j = 0; j < R; ++j)
    for (int d = 0; d < D; d += 32) {
      const __m512 a = _mm512_loadu_ps(q + j * D + d), b = _mm512_loadu_ps(q + j * D + d + 16);
      _mm512_store_ps(qs[j] + d, _mm512_permutex2var_ps(a, even, b));
      _mm512_store_ps(qs[j] + d + 16, _mm512_permutex2var_ps(a, odd, b));
    }
  logits<R, false, 16>(idx, n, lt, [&](int64_t tok, __m512* a, float*) {
    const uint8_t* r = kl.codes + tok * kl.width;
    for (int d = 0; d < D; d += 32) {
      __m512 ev, od;
      bf16_split(r, d, &ev, &od);
      for (int j = 0; j < R; ++j) {
        a[j] = _mm512_fmadd_ps(_mm512_load_ps(qs[j] + d), ev, a[j]);
        a[j] = _mm512_fmadd_ps(_mm512_load_ps(qs[j] + d + 16), od, a[j]);
      }
    }
  });
}

// pv_rows16 for bfloat16 codes split by parity: sums of CB 32-column blocks per pass.
template <int D, int R>
void pv_rows_bf16(const Leaf& vl, const int64_t* idx, int n, float (*p)[TILE],
                  float* __restrict acc) {
  constexpr int B = D / 32, CB0 = R <= 2 ? 4 : 2, CB = fit_blocks(B, CB0);
  constexpr int U = R * CB * 2 >= 8 ? 1 : 2;
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (int d0 = 0; d0 < D; d0 += 32 * CB) {
    __m512 a[U][R][CB][2];
    for (int e = 0; e < U; ++e)
      for (int j = 0; j < R; ++j)
        for (int k = 0; k < CB; ++k) a[e][j][k][0] = a[e][j][k][1] = _mm512_setzero_ps();
    for (int t = 0; t < n; t += U) {
      for (int e = 0; e < U; ++e) {
        const uint8_t* r = vl.codes + idx[t + e] * vl.width;
        __m512 pj[R];
        for (int j = 0; j < R; ++j) pj[j] = _mm512_set1_ps(p[j][t + e]);
        for (int k = 0; k < CB; ++k) {
          __m512 ev, od;
          bf16_split(r, d0 + 32 * k, &ev, &od);
          for (int j = 0; j < R; ++j) {
            a[e][j][k][0] = _mm512_fmadd_ps(pj[j], ev, a[e][j][k][0]);
            a[e][j][k][1] = _mm512_fmadd_ps(pj[j], od, a[e][j][k][1]);
          }
        }
      }
    }
    for (int j = 0; j < R; ++j)
      for (int k = 0; k < CB; ++k) {
        __m512 ev = a[0][j][k][0], od = a[0][j][k][1];
        if constexpr (U == 2) ev = _mm512_add_ps(ev, a[1][j][k][0]), od = _mm512_add_ps(od, a[1][j][k][1]);
        float* dst = acc + size_t(j) * D + d0 + 32 * k;
        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_permutex2var_ps(ev, lo, od)));
        _mm512_storeu_ps(dst + 16,
                         _mm512_add_ps(_mm512_loadu_ps(dst + 16), _mm512_permutex2var_ps(ev, hi, od)));
      }
  }
}
#endif

// One tile's logits for R rows (lt[j][t] = q_j . x_t, whole-head scales still to apply),
// through the integer route where it applies.
template <int KIND, int MODE, int D, int R>
void qk_tile(const Rows& q, const Leaf& kl, const int64_t* idx, int n, float (*lt)[TILE]) {
#ifdef KVJAX_AVX512
#ifdef KVJAX_INT4_D16
  if constexpr (MODE == WHOLE && KIND == UINT4 && D == 16) {
    qk_rows_int4_d16<R>(q.q16, q.qsc, kl, idx, n, lt);
    return;
  }
#endif
  if constexpr (MODE == WHOLE && KIND >= INT8 && KIND <= UINT2 && in_plane<KIND, D, 32>()) {
    qk_rows_int32<KIND, D, R>(q.q16, q.qsc, kl, idx, n, lt);
    return;
  }
#endif
#ifdef __AVX2__
  if constexpr (int_qk<KIND, MODE, D>()) {
    qk_rows_int<KIND, D, R>(q.q16, q.qsc, kl, idx, n, lt);
    return;
  }
#endif
  if constexpr (MODE == CHANNEL) {
#ifdef KVJAX_AVX512
    if constexpr (in_plane<KIND, D, 16>()) {
      qk_rows_chan<KIND, D, R, 16>(q.q, kl, idx, n, lt);
      return;
    }
#endif
    qk_rows_chan<KIND, D, R>(q.q, kl, idx, n, lt);
    return;
  }
#ifdef KVJAX_AVX512
  if constexpr (MODE == WHOLE && KIND == BF16 && bf16_pairs<D>()) {
    qk_rows_bf16<D, R>(q.q, kl, idx, n, lt);
    return;
  }
  if constexpr (MODE == WHOLE && in_plane<KIND, D, 16>()) {
    qk_rows<KIND, WHOLE, D, R, 16>(q.q, kl, idx, n, lt);
    return;
  }
#endif
  qk_rows<KIND, MODE, D, R>(q.q, kl, idx, n, lt);
}

using QkFn = void (*)(const Rows&, const Leaf&, const int64_t*, int, float (*)[TILE]);
using PvFn = void (*)(const Leaf&, const int64_t*, int, float (*)[TILE], float*);

struct Fused {  // a leaf pair's reads for row groups of 1..4 (null: the generic scan)
  QkFn qk[4];
  PvFn pv[4];
};

// The softmax step of R rows over one tile: the logits lt (whole-head key scales applied
// here), the running state (m, s, acc) rescaled; lt becomes p * (whole-head value scale).
#ifdef KVJAX_AVX512
inline __m512 exp16(__m512 x) {  // exp8 on sixteen lanes
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 y = x * 1.44269504088896341f;
  __m512 n = (y + 12582912.f) - 12582912.f;
  __m512 p = exp2_poly(y - n);
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return p * _mm512_castsi512_ps(bits);
}
#endif

template <int D>
inline void softmax_rows(int R, float (*lt)[TILE], const float* ks, const float* ko,
                         const float* vs, const float* vo, const float* okf, const float* qsum,
                         float* m, float* s, float* acc) {
#ifdef KVJAX_AVX512
  for (int j = 0; j < R; ++j) {
    __m512 l[TILE / 16];
    __m512 mx16 = _mm512_set1_ps(m[j]);
    const __m512 masked = _mm512_set1_ps(MASKED), qs = _mm512_set1_ps(qsum[j]);
    for (int b = 0; b < TILE / 16; ++b) {
      __m512 x = _mm512_fmadd_ps(_mm512_load_ps(ks + 16 * b), _mm512_load_ps(lt[j] + 16 * b),
                                 _mm512_mul_ps(_mm512_load_ps(ko + 16 * b), qs));
      __mmask16 ok = _mm512_cmp_ps_mask(_mm512_load_ps(okf + 16 * b), _mm512_set1_ps(0.5f), _CMP_GT_OQ);
      l[b] = _mm512_mask_blend_ps(ok, masked, x);
      mx16 = _mm512_max_ps(mx16, l[b]);
    }
    const float mx = _mm512_reduce_max_ps(mx16);
    const float corr = fast_exp(m[j] - mx);
    __m512 sum = _mm512_setzero_ps(), po = _mm512_setzero_ps();
    for (int b = 0; b < TILE / 16; ++b) {
      __mmask16 live = _mm512_cmp_ps_mask(l[b], _mm512_set1_ps(0.5f * MASKED), _CMP_GT_OQ);
      __m512 e = _mm512_maskz_mov_ps(live, exp16(l[b] - mx));
      sum += e;
      po = _mm512_fmadd_ps(e, _mm512_load_ps(vo + 16 * b), po);
      _mm512_store_ps(lt[j] + 16 * b, e * _mm512_load_ps(vs + 16 * b));
    }
    const float pos = _mm512_reduce_add_ps(po);
    float* aj = acc + size_t(j) * D;
    if (corr != 1.f || pos != 0.f)  // else acc * 1 + 0 leaves it as it is
      for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(aj + d, _mm512_fmadd_ps(_mm512_loadu_ps(aj + d), _mm512_set1_ps(corr),
                                                 _mm512_set1_ps(pos)));
    s[j] = s[j] * corr + _mm512_reduce_add_ps(sum);
    m[j] = mx;
  }
  return;
#endif
  for (int j = 0; j < R; ++j) {
    v8 l[TILE / 8];
    v8 mx8 = splat(m[j]);
    for (int b = 0; b < TILE / 8; ++b) {
      v8 ok = load8(okf + 8 * b);  // 1 where the slot holds a token, else 0
      v8 x = load8(ks + 8 * b) * load8(lt[j] + 8 * b) + load8(ko + 8 * b) * qsum[j];
      l[b] = ok > 0.5f ? x : splat(MASKED);
      mx8 = vmax(mx8, l[b]);
    }
    float mx = hmax(mx8);
    float corr = fast_exp(m[j] - mx);
    v8 sum = {}, po = {};
    for (int b = 0; b < TILE / 8; ++b) {
      v8 e = exp8(l[b] - mx);
      e = l[b] > 0.5f * MASKED ? e : v8{};
      sum += e;
      po += e * load8(vo + 8 * b);
      v8 pe = e * load8(vs + 8 * b);
      std::memcpy(lt[j] + 8 * b, &pe, 32);
    }
    float pos = hsum(po);
    float* aj = acc + size_t(j) * D;
    for (int d = 0; d < D; d += 8) {
      v8 x = load8(aj + d) * corr + pos;
      std::memcpy(aj + d, &x, 32);
    }
    s[j] = s[j] * corr + hsum(sum);
    m[j] = mx;
  }
}

template <int D>
void scan_fused(const float* __restrict q, const Leaf& kl, const Leaf& vl, const Fused& fn,
                const bool* __restrict mask_row, int64_t row, const Geometry& geo,
                int64_t t_begin, int64_t t_end, int M, float* __restrict m,
                float* __restrict s, float* __restrict acc) {
  static_assert(D % 16 == 0, "fused scan: head_dim a multiple of 16");
  alignas(64) float ks[TILE], ko[TILE], vs[TILE], vo[TILE], okf[TILE], lt[4][TILE];
  float qsum[16], qsc[16];
  alignas(32) int16_t q16[16 * D];
  int64_t idx[TILE];
  for (int i = 0; i < M; ++i) {  // and each row as 15-bit integers times a scale
    m[i] = MASKED, s[i] = 0.f, qsum[i] = 0.f;
    float mx = 0.f;
    for (int d = 0; d < D; ++d) qsum[i] += q[i * D + d], mx = std::max(mx, std::fabs(q[i * D + d]));
    qsc[i] = mx > 0.f ? mx / 32767.f : 1.f;
    for (int d = 0; d < D; ++d) q16[i * D + d] = int16_t(std::nearbyint(q[i * D + d] / qsc[i]));
  }
  std::fill(acc, acc + size_t(M) * D, 0.f);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += TILE) {
    int n = int(std::min<int64_t>(TILE, t_end - t0));
    if (!any_valid(mask_row + t0, n)) continue;
    // Slots past the tail are masked and read token idx[0].
    if (!geo.pages) {
      const int64_t base = row * geo.S + t0;
      for (int t = 0; t < TILE; ++t) idx[t] = base + (t < n ? t : 0);
    } else {
      for (int t = 0; t < TILE; ++t) idx[t] = geo.index(row, t0 + (t < n ? t : 0));
    }
#ifdef KVJAX_AVX512
    for (int b = 0; b < TILE / 16; ++b) {  // 1 where the slot holds a token, else 0
      const int lim = n - 16 * b;
      const __mmask16 in = lim >= 16 ? 0xFFFF : lim <= 0 ? 0 : __mmask16((1u << lim) - 1);
      __m128i mb = _mm_maskz_loadu_epi8(in, mask_row + t0 + 16 * b);
      _mm512_store_ps(okf + 16 * b, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mb)));
    }
#else
    for (int t = 0; t < TILE; ++t) okf[t] = t < n && mask_row[t0 + t] ? 1.f : 0.f;
#endif
    const bool run = n == TILE && idx[TILE - 1] - idx[0] == TILE - 1;
    metas(kl, idx, run, ks, ko);
    metas(vl, idx, run, vs, vo);
    // Rows in groups of at most 4, as even as they go (9 rows: 3 + 3 + 3, not 4 + 4 + 1,
    // whose last group of one has too few independent sums to hide the multiply-adds)
    for (int i0 = 0, groups = (M + 3) / 4; i0 < M; --groups) {
      const int R = (M - i0 + groups - 1) / groups;
      Rows rows{q + size_t(i0) * D, q16 + i0 * D, qsc + i0};
      float* ai = acc + size_t(i0) * D;
      fn.qk[R - 1](rows, kl, idx, n, lt);
      softmax_rows<D>(R, lt, ks, ko, vs, vo, okf, qsum + i0, m + i0, s + i0, ai);
      fn.pv[R - 1](vl, idx, n, lt, ai);
      i0 += R;
    }
  }
}

using ScanFn = void (*)(const float*, const Leaf&, const Leaf&, const Fused&, const bool*,
                        int64_t, const Geometry&, int64_t, int64_t, int, float*, float*, float*);

template <int KIND, int MODE, int D>
void set_qk(Fused& f) {
  f.qk[0] = qk_tile<KIND, MODE, D, 1>, f.qk[1] = qk_tile<KIND, MODE, D, 2>;
  f.qk[2] = qk_tile<KIND, MODE, D, 3>, f.qk[3] = qk_tile<KIND, MODE, D, 4>;
}

template <int KIND, int MODE, int D>
void set_pv(Fused& f) {
#ifdef KVJAX_AVX512
#ifdef KVJAX_INT4_D16
  if constexpr (MODE == WHOLE && KIND == UINT4 && D == 16) {
    f.pv[0] = pv_rows_int4_d16<1>, f.pv[1] = pv_rows_int4_d16<2>;
    f.pv[2] = pv_rows_int4_d16<3>, f.pv[3] = pv_rows_int4_d16<4>;
    return;
  }
#endif
  if constexpr (MODE == WHOLE && int_pv<KIND, D>()) {
    f.pv[0] = pv_rows_int<KIND, D, 1>, f.pv[1] = pv_rows_int<KIND, D, 2>;
    f.pv[2] = pv_rows_int<KIND, D, 3>, f.pv[3] = pv_rows_int<KIND, D, 4>;
    return;
  }
  if constexpr (MODE == WHOLE && KIND == BF16 && bf16_pairs<D>()) {
    f.pv[0] = pv_rows_bf16<D, 1>, f.pv[1] = pv_rows_bf16<D, 2>;
    f.pv[2] = pv_rows_bf16<D, 3>, f.pv[3] = pv_rows_bf16<D, 4>;
    return;
  }
  if constexpr (MODE == WHOLE && in_plane<KIND, D, 16>()) {
    f.pv[0] = pv_rows16<KIND, D, 1>, f.pv[1] = pv_rows16<KIND, D, 2>;
    f.pv[2] = pv_rows16<KIND, D, 3>, f.pv[3] = pv_rows16<KIND, D, 4>;
    return;
  }
#endif
  f.pv[0] = pv_rows<KIND, MODE, D, 1>, f.pv[1] = pv_rows<KIND, MODE, D, 2>;
  f.pv[2] = pv_rows<KIND, MODE, D, 3>, f.pv[3] = pv_rows<KIND, MODE, D, 4>;
}

// Head_dim groups of GW columns: scales read once per group and token (keys) or folded
// into the probabilities (values).
template <int KIND, int D, int GW>
void set_grouped(Fused& f, bool key) {
#ifdef KVJAX_AVX512
  if constexpr (GW % 16 == 0 && in_plane<KIND, D, 16>()) {
    if (key) {
      f.qk[0] = qk_rows_grouped<KIND, D, 1, GW, 16>, f.qk[1] = qk_rows_grouped<KIND, D, 2, GW, 16>;
      f.qk[2] = qk_rows_grouped<KIND, D, 3, GW, 16>, f.qk[3] = qk_rows_grouped<KIND, D, 4, GW, 16>;
    } else {
      f.pv[0] = pv_rows_grouped<KIND, D, 1, GW, 16>, f.pv[1] = pv_rows_grouped<KIND, D, 2, GW, 16>;
      f.pv[2] = pv_rows_grouped<KIND, D, 3, GW, 16>, f.pv[3] = pv_rows_grouped<KIND, D, 4, GW, 16>;
    }
    return;
  }
#endif
  if (key) {
    f.qk[0] = qk_rows_grouped<KIND, D, 1, GW>, f.qk[1] = qk_rows_grouped<KIND, D, 2, GW>;
    f.qk[2] = qk_rows_grouped<KIND, D, 3, GW>, f.qk[3] = qk_rows_grouped<KIND, D, 4, GW>;
  } else {
    f.pv[0] = pv_rows_grouped<KIND, D, 1, GW>, f.pv[1] = pv_rows_grouped<KIND, D, 2, GW>;
    f.pv[2] = pv_rows_grouped<KIND, D, 3, GW>, f.pv[3] = pv_rows_grouped<KIND, D, 4, GW>;
  }
}

template <int KIND, int D>
bool grouped_reads(const Leaf& lf, bool key, Fused& f) {
  switch (D / lf.groups) {  // the group's width, where the leaf's groups are whole vectors
    case 16: if constexpr (D >= 16) { set_grouped<KIND, D, 16>(f, key); return true; } break;
    case 32: if constexpr (D >= 32) { set_grouped<KIND, D, 32>(f, key); return true; } break;
    case 64: if constexpr (D >= 64) { set_grouped<KIND, D, 64>(f, key); return true; } break;
    case 128: if constexpr (D >= 128) { set_grouped<KIND, D, 128>(f, key); return true; } break;
  }
  return false;
}

// The compiled reads of one leaf at head_dim D: false where there are none (the fp kinds
// have no scales to lay out; per-channel scales are compiled for keys only).
template <int D>
bool reads_for(const Leaf& lf, bool key, Fused& f) {
#define KVJAX_CASE(KIND, MODE) \
  case KIND: key ? set_qk<KIND, MODE, D>(f) : set_pv<KIND, MODE, D>(f); return true;
  if (lf.mode == WHOLE || !lf.scale) {
    switch (lf.kind) {
      KVJAX_CASE(F32, WHOLE) KVJAX_CASE(BF16, WHOLE) KVJAX_CASE(F16, WHOLE)
      KVJAX_CASE(INT8, WHOLE) KVJAX_CASE(UINT4, WHOLE) KVJAX_CASE(UINT2, WHOLE)
      KVJAX_CASE(E4M3, WHOLE) KVJAX_CASE(E5M2, WHOLE)
    }
  } else if (lf.mode == GROUPED) {
    switch (lf.kind) {  // groups of 16 columns or more: their own reads
      case INT8: if (grouped_reads<INT8, D>(lf, key, f)) return true; break;
      case UINT4: if (grouped_reads<UINT4, D>(lf, key, f)) return true; break;
      case UINT2: if (grouped_reads<UINT2, D>(lf, key, f)) return true; break;
      case E4M3: if (grouped_reads<E4M3, D>(lf, key, f)) return true; break;
      case E5M2: if (grouped_reads<E5M2, D>(lf, key, f)) return true; break;
    }
    switch (lf.kind) {
      KVJAX_CASE(INT8, GROUPED) KVJAX_CASE(UINT4, GROUPED) KVJAX_CASE(UINT2, GROUPED)
      KVJAX_CASE(E4M3, GROUPED) KVJAX_CASE(E5M2, GROUPED)
    }
  } else if (key) {
    switch (lf.kind) {
      case INT8: set_qk<INT8, CHANNEL, D>(f); return true;
      case UINT4: set_qk<UINT4, CHANNEL, D>(f); return true;
      case UINT2: set_qk<UINT2, CHANNEL, D>(f); return true;
    }
  }
#undef KVJAX_CASE
  return false;
}

// Whether the fused reads take this leaf at head_dim D: codes8 reads eight columns from
// one bit plane (int2 planes below head_dim 32, int4 below 16 are narrower), and a head_dim
// group must hold whole eight-column vectors.
bool fusable(const Leaf& lf, int D) {
  if ((lf.kind == UINT2 && D < 32) || (lf.kind == UINT4 && D < 16)) return false;
  if (!lf.scale) return true;
  if (lf.mode == GROUPED) return D % lf.groups == 0 && D / lf.groups >= 8 && lf.gshift >= 0;
  return lf.mode != CHANNEL || lf.cshift >= 0;
}

// The fused scan for this (K leaf, V leaf, head_dim, rows), or null: the generic scan then.
ScanFn fused(const Leaf& kl, const Leaf& vl, int D, int M, Fused& f) {
  if (M > 16 || !fusable(kl, D) || !fusable(vl, D)) return nullptr;
  switch (D) {
    case 16: return reads_for<16>(kl, true, f) && reads_for<16>(vl, false, f) ? scan_fused<16> : nullptr;
    case 32: return reads_for<32>(kl, true, f) && reads_for<32>(vl, false, f) ? scan_fused<32> : nullptr;
    case 64: return reads_for<64>(kl, true, f) && reads_for<64>(vl, false, f) ? scan_fused<64> : nullptr;
    case 128: return reads_for<128>(kl, true, f) && reads_for<128>(vl, false, f) ? scan_fused<128> : nullptr;
    // the widths of MLA rows (a latent and its rotated key columns, read as one head)
    case 96: return reads_for<96>(kl, true, f) && reads_for<96>(vl, false, f) ? scan_fused<96> : nullptr;
    case 112: return reads_for<112>(kl, true, f) && reads_for<112>(vl, false, f) ? scan_fused<112> : nullptr;
  }
  return nullptr;
}

// Fold the partial state (m2, s2, acc2) into (m1, s1, acc1).
void merge(int M, int D, float* m1, float* s1, float* a1, const float* m2, const float* s2,
           const float* a2) {
  for (int i = 0; i < M; ++i) {
    float mx = std::max(m1[i], m2[i]);
    float c1 = fast_exp(m1[i] - mx), c2 = fast_exp(m2[i] - mx);
    s1[i] = s1[i] * c1 + s2[i] * c2;
    for (int d = 0; d < D; ++d) a1[i * D + d] = a1[i * D + d] * c1 + a2[i * D + d] * c2;
    m1[i] = mx;
  }
}

// One leaf read at layer offset `off` tokens: `mode` lays out its scales, `param` is
// their count per token (GROUPED) or the tokens each scale row covers (CHANNEL, U).
Leaf leaf(const ffi::AnyBuffer& codes, const ffi::AnyBuffer& scale, const ffi::AnyBuffer& zero,
          int64_t kind, int64_t width, int64_t mode, int64_t param, int D, int64_t off) {
  Leaf lf;
  size_t esz = kind == F32 ? 4 : (kind == BF16 || kind == F16) ? 2 : 1;  // bytes per element
  lf.kind = kind;
  lf.width = width * esz;
  lf.mode = mode;
  lf.groups = mode == GROUPED ? std::max<int64_t>(param, 1) : 1;
  lf.chan = mode == CHANNEL ? std::max<int64_t>(param, 1) : 1;
  auto log2_of = [](int64_t x) {  // -1 unless a power of two
    int k = 0;
    while ((int64_t(1) << k) < x) ++k;
    return (int64_t(1) << k) == x ? k : -1;
  };
  lf.gshift = D % lf.groups ? -1 : log2_of(D / lf.groups);
  lf.cshift = log2_of(lf.chan);
  // Scale elements before this layer's: per token, n per token, or D per U tokens.
  int64_t meta_off = mode == CHANNEL ? off / lf.chan * D : off * lf.groups;
  lf.codes = static_cast<const uint8_t*>(codes.untyped_data()) + off * lf.width;
  lf.scale = scale.element_count()
                 ? static_cast<const uint16_t*>(scale.untyped_data()) + meta_off : nullptr;
  lf.zero = zero.element_count()
                ? static_cast<const uint16_t*>(zero.untyped_data()) + meta_off : nullptr;
  return lf;
}

ffi::Error Read(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc,
                ffi::AnyBuffer ks, ffi::AnyBuffer kz, ffi::AnyBuffer vc, ffi::AnyBuffer vs,
                ffi::AnyBuffer vz, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> pages,
                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> m_out,
                ffi::ResultBuffer<ffi::F32> s_out, ffi::ResultBuffer<ffi::F32> acc_out,
                int64_t k_kind, int64_t v_kind, int64_t k_width, int64_t v_width,
                int64_t k_mode, int64_t k_param, int64_t v_mode, int64_t v_param,
                int64_t n_layers, int64_t batch, int64_t heads, int64_t seq,
                int64_t page, int64_t pool_rows) {
  auto qd = q.dimensions();
  if (qd.size() != 3) return ffi::Error::InvalidArgument("kvjax_read: q must be [N, M, D]");
  const int64_t N = qd[0];
  const int M = int(qd[1]), D = int(qd[2]);
  if (N != batch * heads) return ffi::Error::InvalidArgument("kvjax_read: N != batch * heads");
  if (D > 256) return ffi::Error::InvalidArgument("kvjax_read: head_dim above 256");
  int64_t L = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), n_layers - 1);
  int64_t T = std::min<int64_t>(std::max<int64_t>(live.typed_data()[0], 0), seq);
  // Tokens per layer of the store: B rows of S (contiguous) or P pages of `page` tokens.
  int64_t off = L * heads * (page ? pool_rows * page : batch * seq);
  Geometry geo{seq, heads, page, pool_rows, page ? pages.typed_data() : nullptr};
  Leaf kl = leaf(kc, ks, kz, k_kind, k_width, k_mode, k_param, D, off);
  Leaf vl = leaf(vc, vs, vz, v_kind, v_width, v_mode, v_param, D, off);
  const bool* mk = mask.typed_data();
  const float* qp = q.typed_data();
  float* mo = m_out->typed_data();
  float* so = s_out->typed_data();
  float* ao = acc_out->typed_data();

  Fused fns{};
  ScanFn fast = getenv("KVJAX_KERNEL_GENERIC") ? nullptr : fused(kl, vl, D, M, fns);
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Split each row's tokens when rows alone cannot keep every thread busy.
  int64_t splits = std::max<int64_t>(1, std::min<int64_t>((2 * threads + N - 1) / N, (T + 255) / 256));
  int64_t chunk = (T + splits - 1) / splits;
  int64_t items = N * splits;
  std::vector<float> part(size_t(items > N ? items - N : 0) * M * (D + 2));
  auto run = [&](int64_t it) {
    int64_t row = it / splits, sp = it % splits;
    int64_t b = row / heads;
    float *m, *s, *a;
    if (sp == 0) {
      m = mo + row * M, s = so + row * M, a = ao + row * M * D;
    } else {
      float* base = part.data() + size_t(row * (splits - 1) + sp - 1) * M * (D + 2);
      m = base, s = base + M, a = base + 2 * M;
    }
    int64_t t0 = sp * chunk, t1 = std::min(T, t0 + chunk);
    if (fast) {
      fast(qp + row * M * D, kl, vl, fns, mk + b * seq, row, geo, t0, std::max(t0, t1), M, m, s, a);
      return;
    }
    auto f = D == 64 ? scan<64> : D == 128 ? scan<128> : D == 32 ? scan<32> : scan<0>;
    f(qp + row * M * D, kl, vl, mk + b * seq, row, geo, t0, std::max(t0, t1), M, D, m, s, a);
  };
  kvjax::parallel_for(pool, items, run);
  for (int64_t row = 0; row < N; ++row)
    for (int64_t sp = 1; sp < splits; ++sp) {
      const float* base = part.data() + size_t(row * (splits - 1) + sp - 1) * M * (D + 2);
      merge(M, D, mo + row * M, so + row * M, ao + row * M * D, base, base + M, base + 2 * M);
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxRead, Read,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k_kind")
                                  .Attr<int64_t>("v_kind")
                                  .Attr<int64_t>("k_width")
                                  .Attr<int64_t>("v_width")
                                  .Attr<int64_t>("k_mode")
                                  .Attr<int64_t>("k_param")
                                  .Attr<int64_t>("v_mode")
                                  .Attr<int64_t>("v_param")
                                  .Attr<int64_t>("n_layers")
                                  .Attr<int64_t>("batch")
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("seq")
                                  .Attr<int64_t>("page")
                                  .Attr<int64_t>("pool_rows"));
