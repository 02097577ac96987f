// Products of a few float32 rows with weight matrices stored in bfloat16 or float32, as an
// XLA FFI custom call: y_i[M, N_i] = x[M, E] . W_i, each W_i stored [E, N_i] (a projection's
// kernel). Each weight is loaded (a bf16 one widened: it is the top half of a float32) in a
// register where it is used and read from memory once per call, so a decode step reads its
// weights at their stored bytes; XLA:CPU widens a bf16 matrix into a float32 copy first. One
// call takes every matrix that shares an input (q/k/v, gate/up), so they cost one dispatch
// over XLA's intra-op thread pool, split in one of two ways: by blocks of each W's rows,
// streamed in memory order, the blocks' partial sums added after, for one or two rows of x
// (batch-1 and -2 decode) and, on AVX-512 machines, for up to 16 rows where every N is a
// multiple of 32 (the products of 8 rows of x held in registers per 32 columns, so each
// weight is loaded once per 8 rows; one or two rows too where every weight is bf16, whose
// 64-byte loads halve the instructions a weight costs); otherwise by stripes of columns,
// each weight loaded once for every row of x. For the few rows of a decode step (M <= 16);
// longer inputs stay with XLA's dot. A second call (`MatvecT`) multiplies by a table
// stored [N, E] (a tied lm_head's embedding), row by row.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const uint16_t* w) {  // eight bf16 -> eight float32
  v8 v;
#ifdef __AVX2__
  __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
  std::memcpy(&v, &f, 32);
#else
  for (int i = 0; i < 8; ++i) {
    uint32_t u = uint32_t(w[i]) << 16;
    std::memcpy(&v[i], &u, 4);
  }
#endif
  return v;
}

inline v8 load8(const float* w) {
  v8 v;
  std::memcpy(&v, w, 32);
  return v;
}

inline float load1(uint16_t w) {
  uint32_t u = uint32_t(w) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float load1(float w) { return w; }

constexpr int CW = 256;  // [E, N]: most columns a stripe task owns
constexpr int PF = 8;    // weight rows prefetched ahead

// y[j][c0 : c0 + cw] for R rows of x: the task's stripe of every weight row in turn, four
// rows at a time, the accumulators in L1, the stripe PF rows ahead prefetched.
template <int R, typename T>
void nn_rows(const float* x, int64_t E, const T* w, int64_t N, int64_t c0, int cw, float* y) {
  alignas(32) float acc[R][CW];
  for (int j = 0; j < R; ++j) std::fill(acc[j], acc[j] + cw, 0.f);
  constexpr int LINE = 64 / sizeof(T);  // weights per cache line
  int64_t k = 0;
  for (; k + 4 <= E; k += 4) {
    const T* w0 = w + k * N + c0;
    float xs[R][4];
    for (int j = 0; j < R; ++j)
      for (int i = 0; i < 4; ++i) xs[j][i] = x[j * E + k + i];
    for (int c = 0; c < cw; c += 8) {
      if ((c % LINE) == 0 && k + PF + 4 <= E)
        for (int i = 0; i < 4; ++i) __builtin_prefetch(w0 + (PF + i) * N + c);
      v8 a0 = load8(w0 + c), a1 = load8(w0 + N + c), a2 = load8(w0 + 2 * N + c),
         a3 = load8(w0 + 3 * N + c);
      for (int j = 0; j < R; ++j) {
        v8 s;
        std::memcpy(&s, acc[j] + c, 32);
        s += xs[j][0] * a0 + xs[j][1] * a1 + xs[j][2] * a2 + xs[j][3] * a3;
        std::memcpy(acc[j] + c, &s, 32);
      }
    }
  }
  for (; k < E; ++k)
    for (int j = 0; j < R; ++j)
      for (int c = 0; c < cw; ++c) acc[j][c] += x[j * E + k] * load1(w[k * N + c0 + c]);
  for (int j = 0; j < R; ++j) std::memcpy(y + j * N + c0, acc[j], cw * 4);
}

// One stripe task: columns [c0, c0 + width) of every row (the last may be narrower).
template <typename T>
void nn_task(const float* x, int64_t M, int64_t E, const T* w, int64_t N, int64_t c0,
             int64_t width, float* y) {
  int cw = int(std::min<int64_t>(width, N - c0));
  if (cw % 8) {  // a ragged tail: plainly
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = c0; c < c0 + cw; ++c) {
        float s = 0.f;
        for (int64_t k = 0; k < E; ++k) s += x[m * E + k] * load1(w[k * N + c]);
        y[m * N + c] = s;
      }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    int R = int(std::min<int64_t>(4, M - m0));
    const float* xm = x + m0 * E;
    float* ym = y + m0 * N;
    switch (R) {
      case 4: nn_rows<4>(xm, E, w, N, c0, cw, ym); break;
      case 3: nn_rows<3>(xm, E, w, N, c0, cw, ym); break;
      case 2: nn_rows<2>(xm, E, w, N, c0, cw, ym); break;
      default: nn_rows<1>(xm, E, w, N, c0, cw, ym);
    }
  }
}

constexpr int64_t ROW_SPLIT_MAX_N = 4096;  // the row-split form's widest output
constexpr int64_t ROW_SPLIT_MAX_M = 2;     // and most rows of x (each row re-reads W)
constexpr int64_t ROW_TILE_MAX_M = 16;    // AVX-512: the row split in register tiles up to here

#ifdef __AVX2__
// Sixteen columns of one weight row as two float32 vectors. bf16: one 32-byte load, whose
// even and odd halves become floats by one shift and one mask (no widening shuffle), so the
// pair holds the columns in even/odd order (`unpermute16` restores it); float32: two loads,
// in order.
inline void load16(const uint16_t* w, __m256& lo, __m256& hi) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}

inline void load16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

// The row-split form: rows [k0, k1) of W, every column, added into acc[M][N]. W is streamed
// front to back, KB rows at a time, the accumulators loaded and stored once per KB rows;
// rows PF_ROWS ahead are prefetched.
template <int KB, typename T>
void nn_rowblock(const float* x, int64_t M, int64_t E, const T* w, int64_t N, int64_t k0,
                 int64_t k1, float* acc) {
  constexpr int PF_ROWS = 32;
  constexpr int LINE = 64 / sizeof(T);
  for (int64_t k = k0; k + KB <= k1; k += KB) {
    const T* w0 = w + k * N;
    const bool pf = KB > 1 && k + PF_ROWS + KB <= k1;
    for (int64_t j = 0; j < M; ++j) {
      __m256 xs[KB];
      for (int i = 0; i < KB; ++i) xs[i] = _mm256_set1_ps(x[j * E + k + i]);
      float* a = acc + j * N;
      for (int64_t c = 0; c < N; c += 16) {
        if (pf && j == 0 && (c % LINE) == 0)
          for (int i = 0; i < KB; ++i) __builtin_prefetch(w0 + (PF_ROWS + i) * N + c);
        __m256 se = _mm256_loadu_ps(a + c), so = _mm256_loadu_ps(a + c + 8);
        for (int i = 0; i < KB; ++i) {
          __m256 lo, hi;
          load16(w0 + i * N + c, lo, hi);
          se = _mm256_fmadd_ps(xs[i], lo, se);
          so = _mm256_fmadd_ps(xs[i], hi, so);
        }
        _mm256_storeu_ps(a + c, se);
        _mm256_storeu_ps(a + c + 8, so);
      }
    }
  }
}

// y[0 : n] from acc in even/odd order per 16 columns (n a multiple of 16).
void unpermute16(const float* acc, int64_t n, float* y) {
  for (int64_t c = 0; c < n; c += 16) {
    __m256 e = _mm256_loadu_ps(acc + c), o = _mm256_loadu_ps(acc + c + 8);
    __m256 a = _mm256_unpacklo_ps(e, o), b = _mm256_unpackhi_ps(e, o);  // 0-3|8-11, 4-7|12-15
    _mm256_storeu_ps(y + c, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(y + c + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
}

template <typename T>
void rows_task(const float* x, int64_t M, int64_t E, const T* w, int64_t N, int64_t k0,
               int64_t k1, float* acc) {
  const int64_t k8 = k0 + (k1 - k0) / 8 * 8;
  nn_rowblock<8>(x, M, E, w, N, k0, k8, acc);
  nn_rowblock<1>(x, M, E, w, N, k8, k1, acc);
}
#endif

#ifdef __AVX512F__
// 32 columns of one weight row as two float32 vectors (AVX-512), as load16 does for 16.
inline void load32(const uint16_t* w, __m512& lo, __m512& hi) {
  __m512i v = _mm512_loadu_si512(w);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

inline void load32(const float* w, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(w);
  hi = _mm512_loadu_ps(w + 16);
}

#endif

#ifdef __AVX512F__
// The row split for 3 to 16 rows of x: rows [k0, k1) of W streamed in memory order, KB at a
// time; for each 32 columns the products of up to 8 rows of x are loaded from acc[M][N]
// into registers, KB weight rows added, and stored back, so each weight is loaded once per
// 8 rows of x. bf16 accumulators hold each 32 columns in even/odd order (unpermute32).
template <int R, int KB, typename T>
void rowtile(const float* x, int64_t E, const T* w, int64_t N, int64_t k, float* acc) {
  const T* w0 = w + k * N;
  constexpr int LINE = 64 / sizeof(T);
  const bool pf = k + 32 + KB <= E;
  for (int64_t c = 0; c < N; c += 32) {
    if (KB > 1 && pf)
      for (int i = 0; i < KB; ++i)
        for (int h = 0; h < 32; h += LINE) __builtin_prefetch(w0 + (32 + i) * N + c + h);
    __m512 a[R][2];
    for (int j = 0; j < R; ++j) {
      a[j][0] = _mm512_loadu_ps(acc + j * N + c);
      a[j][1] = _mm512_loadu_ps(acc + j * N + c + 16);
    }
    for (int i = 0; i < KB; ++i) {
      __m512 lo, hi;
      load32(w0 + i * N + c, lo, hi);
      for (int j = 0; j < R; ++j) {
        const __m512 xs = _mm512_set1_ps(x[j * E + k + i]);
        a[j][0] = _mm512_fmadd_ps(xs, lo, a[j][0]);
        a[j][1] = _mm512_fmadd_ps(xs, hi, a[j][1]);
      }
    }
    for (int j = 0; j < R; ++j) {
      _mm512_storeu_ps(acc + j * N + c, a[j][0]);
      _mm512_storeu_ps(acc + j * N + c + 16, a[j][1]);
    }
  }
}

template <int R, typename T>
void rowtile_rows(const float* x, int64_t E, const T* w, int64_t N, int64_t k0, int64_t k1,
                  float* acc) {
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) rowtile<R, 8>(x, E, w, N, k, acc);
  for (; k < k1; ++k) rowtile<R, 1>(x, E, w, N, k, acc);
}

template <typename T>
void rowtile_task(const float* x, int64_t M, int64_t E, const T* w, int64_t N, int64_t k0,
                  int64_t k1, float* acc) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xm = x + m0 * E;
    float* am = acc + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 8: rowtile_rows<8>(xm, E, w, N, k0, k1, am); break;
      case 7: rowtile_rows<7>(xm, E, w, N, k0, k1, am); break;
      case 6: rowtile_rows<6>(xm, E, w, N, k0, k1, am); break;
      case 5: rowtile_rows<5>(xm, E, w, N, k0, k1, am); break;
      case 4: rowtile_rows<4>(xm, E, w, N, k0, k1, am); break;
      case 3: rowtile_rows<3>(xm, E, w, N, k0, k1, am); break;
      case 2: rowtile_rows<2>(xm, E, w, N, k0, k1, am); break;
      default: rowtile_rows<1>(xm, E, w, N, k0, k1, am);
    }
  }
}

void unpermute32(const float* acc, int64_t n, float* y) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t c = 0; c < n; c += 32) {
    __m512 e = _mm512_loadu_ps(acc + c), o = _mm512_loadu_ps(acc + c + 16);
    _mm512_storeu_ps(y + c, _mm512_permutex2var_ps(e, lo, o));
    _mm512_storeu_ps(y + c + 16, _mm512_permutex2var_ps(e, hi, o));
  }
}
#endif

// One weight matrix [E, N] of a call and its output [M, N].
struct Product {
  const void* w;
  bool bf16;
  int64_t N;
  float* y;
};

// y_i = x . W_i for every matrix of the call, as one set of tasks over the pool, so the
// projections that share an input (q/k/v, gate/up) cost one dispatch.
//  - M <= ROW_SPLIT_MAX_M (batch-1 and -2 decode, where streaming W in memory order decides
//    the time): each matrix by blocks of its rows (a multiple of 8), one per thread, each
//    block's partial sums in its own buffer, added after (on AVX-512, bf16 weights in the
//    tile form's 32-column steps, float32 ones in the AVX2 16-column steps);
//  - otherwise by stripes of at most CW columns (a multiple of 8 wide, as many per matrix as
//    a multiple of the pool's threads where the columns allow: 576 columns are 4 stripes of
//    144 on 2 threads, not 3 of 256), each weight loaded once for every row of x.
void products(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t E,
              const std::vector<Product>& ps) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  struct Task {
    int p;
    int64_t a, b;  // rows [a, b) (row split) or columns [a, b) (stripes)
    float* acc;    // the row split's partial sums, [M, N]
  };
  std::vector<Task> tasks;
  bool split = M <= ROW_SPLIT_MAX_M;
#ifdef __AVX2__
  for (const Product& p : ps) split = split && p.N % 16 == 0 && p.N <= ROW_SPLIT_MAX_N;
#else
  split = false;
#endif
  bool tiled = false;
#ifdef __AVX512F__
  tiled = M <= ROW_TILE_MAX_M;
  bool all_bf16 = true;  // one or two rows: the tiles for bf16 weights, the AVX2 split for f32
  for (const Product& p : ps) {
    tiled = tiled && p.N % 32 == 0 && p.N <= ROW_SPLIT_MAX_N;
    all_bf16 = all_bf16 && p.bf16;
  }
  tiled = tiled && (M > ROW_SPLIT_MAX_M || all_bf16);
  split = split || tiled;
#endif
  std::vector<float> part;
  if (split) {
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, E / 8));
    const int64_t rows = (E / 8 + parts - 1) / parts * 8;
    size_t total = 0;
    for (const Product& p : ps) total += size_t(parts * M * p.N);
    part.assign(total, 0.f);
    float* at = part.data();
    for (int i = 0; i < int(ps.size()); ++i)
      for (int64_t t = 0; t < parts; ++t, at += M * ps[i].N) {
        const int64_t k0 = std::min<int64_t>(E, t * rows);
        tasks.push_back({i, k0, t + 1 == parts ? E : std::min<int64_t>(E, k0 + rows), at});
      }
  } else {
    for (int i = 0; i < int(ps.size()); ++i) {
      const int64_t N = ps[i].N, groups = (N + 7) / 8;
      int64_t n = std::max<int64_t>((N + CW - 1) / CW, threads);
      n = std::min<int64_t>((n + threads - 1) / threads * threads, groups);
      const int64_t width = (groups + n - 1) / n * 8;
      for (int64_t c = 0; c < N; c += width)
        tasks.push_back({i, c, std::min<int64_t>(N, c + width), nullptr});
    }
  }
  kvjax::parallel_for(pool, int64_t(tasks.size()), [&](int64_t it) {
    const Task& t = tasks[it];
    const Product& p = ps[t.p];
    auto run = [&](auto* w) {  // w: the matrix in its stored type
#ifdef __AVX512F__
      if (tiled) return rowtile_task(x, M, E, w, p.N, t.a, t.b, t.acc);
#endif
#ifdef __AVX2__
      if (split) return rows_task(x, M, E, w, p.N, t.a, t.b, t.acc);
#endif
      nn_task(x, M, E, w, p.N, t.a, t.b - t.a, p.y);
    };
    if (p.bf16)
      run(static_cast<const uint16_t*>(p.w));
    else
      run(static_cast<const float*>(p.w));
  });
#ifdef __AVX2__
  if (!split) return;
  size_t first = 0;  // each matrix's first partial buffer: the others are added into it
  for (int i = 0; i < int(ps.size()); ++i) {
    const int64_t n = M * ps[i].N;
    size_t count = 0;
    for (const Task& t : tasks) count += t.p == i;
    float* acc = tasks[first].acc;
    for (size_t t = first + 1; t < first + count; ++t)
      for (int64_t e = 0; e < n; ++e) acc[e] += tasks[t].acc[e];
    for (int64_t j = 0; j < M; ++j) {
#ifdef __AVX512F__
      if (tiled && ps[i].bf16) {
        unpermute32(acc + j * ps[i].N, ps[i].N, ps[i].y + j * ps[i].N);
        continue;
      }
#endif
      if (ps[i].bf16)
        unpermute16(acc + j * ps[i].N, ps[i].N, ps[i].y + j * ps[i].N);
      else
        std::memcpy(ps[i].y + j * ps[i].N, acc + j * ps[i].N, ps[i].N * 4);
    }
    first += count;
  }
#endif
}

// x [M, E] and one or more weight matrices [E, N_i] (bfloat16 or float32), their products
// [M, N_i] in order.
ffi::Error Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                  ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("kvjax_matvec: x must be [M, E]");
  const int64_t M = xd[0], E = xd[1];
  if (ws.size() == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("kvjax_matvec: one output per weight matrix");
  std::vector<Product> ps;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("kvjax_matvec: bad operand");
    auto wd = w->dimensions();
    if (wd.size() != 2 || wd[0] != E)
      return ffi::Error::InvalidArgument("kvjax_matvec: each w must be [E, N]");
    const auto t = w->element_type();
    if (t != ffi::DataType::BF16 && t != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("kvjax_matvec: w must be bfloat16 or float32");
    auto yd = (*y)->dimensions();
    if (yd.size() != 2 || yd[0] != M || yd[1] != wd[1])
      return ffi::Error::InvalidArgument("kvjax_matvec: each y must be [M, N]");
    ps.push_back({w->untyped_data(), t == ffi::DataType::BF16, wd[1], (*y)->typed_data()});
  }
  products(pool, x.typed_data(), M, E, ps);
  return ffi::Error::Success();
}

// y[m][v] = x[m] . T[v] for rows [v0, v1) of a table T [V, E], bfloat16 or float32 (a tied
// lm_head's embedding, whose rows are contiguous): each row is read once, from memory in
// order, and stays in L1 while every row of x is multiplied by it, four accumulators a dot.
template <typename T>
void nt_rows(const float* x, int64_t M, int64_t E, const T* t, int64_t V, int64_t v0,
             int64_t v1, float* y) {
  for (int64_t v = v0; v < v1; ++v) {
    const T* row = t + v * E;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * E;
      v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      int64_t e = 0;
      for (; e + 32 <= E; e += 32) {
        v8 x0, x1, x2, x3;
        std::memcpy(&x0, xm + e, 32);
        std::memcpy(&x1, xm + e + 8, 32);
        std::memcpy(&x2, xm + e + 16, 32);
        std::memcpy(&x3, xm + e + 24, 32);
        a0 += x0 * load8(row + e);
        a1 += x1 * load8(row + e + 8);
        a2 += x2 * load8(row + e + 16);
        a3 += x3 * load8(row + e + 24);
      }
      v8 a = (a0 + a1) + (a2 + a3);
      float sum = 0.f;
      for (int i = 0; i < 8; ++i) sum += a[i];
      for (; e < E; ++e) sum += xm[e] * load1(row[e]);
      y[m * V + v] = sum;
    }
  }
}

#ifdef __AVX2__
// nt_rows for a bfloat16 table, with each row of x given in the even/odd order of every 16
// elements (`xd`, [M, E16], E16 = E rounded down to 16): one 32-byte load of a table row
// becomes two float vectors by one shift and one mask, as in the row-split form. The
// elements past E16 are added from x plainly.
void nt_rows_bf16(const float* xd, const float* x, int64_t M, int64_t E, const uint16_t* t,
                  int64_t V, int64_t v0, int64_t v1, float* y) {
  const int64_t E16 = E / 16 * 16;
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  auto even = [](__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); };
  auto odd = [&](__m256i w) { return _mm256_castsi256_ps(_mm256_and_si256(w, high)); };
  for (int64_t v = v0; v < v1; ++v) {
    const uint16_t* row = t + v * E;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = xd + m * E16;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t e = 0;
      for (; e + 32 <= E16; e += 32) {
        __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + e));
        __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + e + 16));
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + e), even(w0), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + e + 8), odd(w0), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + e + 16), even(w1), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + e + 24), odd(w1), a3);
      }
      if (e < E16) {
        __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + e));
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + e), even(w0), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xm + e + 8), odd(w0), a1);
      }
      __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      float sum = _mm_cvtss_f32(h);
      for (e = E16; e < E; ++e) sum += x[m * E + e] * load1(row[e]);
      y[m * V + v] = sum;
    }
  }
}
#endif

ffi::Error MatvecT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer t,
                   ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), td = t.dimensions();
  if (xd.size() != 2 || td.size() != 2)
    return ffi::Error::InvalidArgument("kvjax_matvec_t: x must be [M, E] and t [V, E]");
  const int64_t M = xd[0], E = xd[1], V = td[0];
  if (td[1] != E) return ffi::Error::InvalidArgument("kvjax_matvec_t: E differs");
  const bool bf16 = t.element_type() == ffi::DataType::BF16;
  if (!bf16 && t.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("kvjax_matvec_t: t must be bfloat16 or float32");
  const float* xp = x.typed_data();
  const void* tp = t.untyped_data();
  float* yp = y->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(V, 8 * threads));
  const int64_t rows = (V + chunks - 1) / chunks;
#ifdef __AVX2__
  const int64_t E16 = E / 16 * 16;
  std::vector<float> xeo(size_t(M * E16));  // x in even/odd order per 16 (nt_rows_bf16)
  if (bf16)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t e = 0; e < E16; e += 16)
        for (int i = 0; i < 8; ++i) {
          xeo[m * E16 + e + i] = xp[m * E + e + 2 * i];
          xeo[m * E16 + e + 8 + i] = xp[m * E + e + 2 * i + 1];
        }
#endif
  kvjax::parallel_for(pool, (V + rows - 1) / rows, [&](int64_t it) {
    const int64_t v0 = it * rows, v1 = std::min<int64_t>(V, (it + 1) * rows);
#ifdef __AVX2__
    if (bf16) return nt_rows_bf16(xeo.data(), xp, M, E, static_cast<const uint16_t*>(tp), V, v0,
                                  v1, yp);
#endif
    if (bf16)
      nt_rows(xp, M, E, static_cast<const uint16_t*>(tp), V, v0, v1, yp);
    else
      nt_rows(xp, M, E, static_cast<const float*>(tp), V, v0, v1, yp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatvecT, MatvecT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatvec, Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
