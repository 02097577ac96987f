// Products of a few float32 rows with a bfloat16 weight matrix, as an XLA FFI custom
// call: y[M, N] = x[M, E] . W, W stored [E, N] (a projection's kernel). Each weight is
// widened in a register where it is used (bf16 is the top half of a float32) and read from
// memory once per call, so a decode step reads its weights at their stored bytes; XLA:CPU
// widens a bf16 matrix into a float32 copy first. The work is split across XLA's intra-op
// thread pool in one of two ways: for one or two rows of x (batch-1 and -2 decode, where
// streaming W in memory order decides the time) by blocks of W's rows, each thread's
// partial sums added after; otherwise by stripes of columns, each weight widened once for
// every row of x. For the few rows of a decode step (M <= 16); longer inputs stay with
// XLA's dot. A second call (`MatvecT`) multiplies by a table stored [N, E] (a tied
// lm_head's embedding), row by row.

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

inline v8 widen8(const uint16_t* w) {  // eight bf16 -> eight float32
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

inline float widen1(uint16_t w) {
  uint32_t u = uint32_t(w) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

constexpr int CW = 256;  // [E, N]: most columns a task owns (512 contiguous bytes of each row)
constexpr int PF = 8;    // weight rows prefetched ahead

// y[j][c0 : c0 + cw] for R rows of x: the task's stripe of every weight row in turn, four
// rows at a time, the accumulators in L1, the stripe PF rows ahead prefetched.
template <int R>
void nn_rows(const float* x, int64_t E, const uint16_t* w, int64_t N, int64_t c0, int cw,
             float* y) {
  alignas(32) float acc[R][CW];
  for (int j = 0; j < R; ++j) std::fill(acc[j], acc[j] + cw, 0.f);
  int64_t k = 0;
  for (; k + 4 <= E; k += 4) {
    const uint16_t* w0 = w + k * N + c0;
    float xs[R][4];
    for (int j = 0; j < R; ++j)
      for (int i = 0; i < 4; ++i) xs[j][i] = x[j * E + k + i];
    for (int c = 0; c < cw; c += 8) {
      if ((c & 31) == 0 && k + PF + 4 <= E)
        for (int i = 0; i < 4; ++i) __builtin_prefetch(w0 + (PF + i) * N + c);
      v8 a0 = widen8(w0 + c), a1 = widen8(w0 + N + c), a2 = widen8(w0 + 2 * N + c),
         a3 = widen8(w0 + 3 * N + c);
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
      for (int c = 0; c < cw; ++c) acc[j][c] += x[j * E + k] * widen1(w[k * N + c0 + c]);
  for (int j = 0; j < R; ++j) std::memcpy(y + j * N + c0, acc[j], cw * 4);
}

// One task: columns [c0, c0 + width) of every row (the last task may be narrower).
void nn_task(const float* x, int64_t M, int64_t E, const uint16_t* w, int64_t N, int64_t c0,
             int64_t width, float* y) {
  int cw = int(std::min<int64_t>(width, N - c0));
  if (cw % 8) {  // a ragged tail: plainly
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = c0; c < c0 + cw; ++c) {
        float s = 0.f;
        for (int64_t k = 0; k < E; ++k) s += x[m * E + k] * widen1(w[k * N + c]);
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
constexpr int64_t ROW_SPLIT_MAX_M = 2;     // and most rows of x (each row re-widens W)

#ifdef __AVX2__
// The row-split form: rows [k0, k1) of W, every column, added into acc[M][N], which holds
// each 16 columns in even/odd order (unpermute16 restores it). W is streamed front to
// back, KB rows at a time: one 32-byte load is 16 bf16, whose even and odd halves become
// floats by one shift and one mask (no widening shuffle), and the accumulators are loaded
// and stored once per KB rows. Rows PF_ROWS ahead are prefetched.
template <int KB>
void nn_rowblock(const float* x, int64_t M, int64_t E, const uint16_t* w, int64_t N,
                 int64_t k0, int64_t k1, float* acc) {
  constexpr int PF_ROWS = 32;
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t k = k0; k + KB <= k1; k += KB) {
    const uint16_t* w0 = w + k * N;
    const bool pf = KB > 1 && k + PF_ROWS + KB <= k1;
    for (int64_t j = 0; j < M; ++j) {
      __m256 xs[KB];
      for (int i = 0; i < KB; ++i) xs[i] = _mm256_set1_ps(x[j * E + k + i]);
      float* a = acc + j * N;
      for (int64_t c = 0; c < N; c += 16) {
        if (pf && j == 0 && (c & 31) == 0)
          for (int i = 0; i < KB; ++i) __builtin_prefetch(w0 + (PF_ROWS + i) * N + c);
        __m256 se = _mm256_loadu_ps(a + c), so = _mm256_loadu_ps(a + c + 8);
        for (int i = 0; i < KB; ++i) {
          __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + i * N + c));
          se = _mm256_fmadd_ps(xs[i], _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), se);
          so = _mm256_fmadd_ps(xs[i], _mm256_castsi256_ps(_mm256_and_si256(v, high)), so);
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

// y = x . W by row blocks of W, one per thread (a multiple of 8 rows each), the threads'
// partial sums added after: for one or two rows of x, where each weight is used once or
// twice and streaming W in order is what decides the time.
void row_split(ffi::ThreadPool& pool, int64_t threads, const float* x, int64_t M, int64_t E,
               const uint16_t* w, int64_t N, float* y) {
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads, E / 8));
  const int64_t rows = (E / 8 + tasks - 1) / tasks * 8;
  std::vector<float> part(size_t(tasks) * M * N, 0.f);
  kvjax::parallel_for(pool, tasks, [&](int64_t t) {
    const int64_t k0 = std::min<int64_t>(E, t * rows);
    const int64_t k1 = t + 1 == tasks ? E : std::min<int64_t>(E, k0 + rows);
    float* acc = part.data() + t * M * N;
    const int64_t k8 = k0 + (k1 - k0) / 8 * 8;
    nn_rowblock<8>(x, M, E, w, N, k0, k8, acc);
    nn_rowblock<1>(x, M, E, w, N, k8, k1, acc);
  });
  for (int64_t t = 1; t < tasks; ++t) {
    const float* p = part.data() + t * M * N;
    for (int64_t i = 0; i < M * N; ++i) part[i] += p[i];
  }
  for (int64_t j = 0; j < M; ++j) unpermute16(part.data() + j * N, N, y + j * N);
}
#endif

ffi::Error Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("kvjax_matvec: x must be [M, E] and w two-dimensional");
  const int64_t M = xd[0], E = xd[1], N = wd[1];
  if (wd[0] != E) return ffi::Error::InvalidArgument("kvjax_matvec: E differs");
  if (w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("kvjax_matvec: w must be bfloat16");
  const float* xp = x.typed_data();
  const uint16_t* wp = static_cast<const uint16_t*>(w.untyped_data());  // bf16 bits
  float* yp = y->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
#ifdef __AVX2__
  if (M <= ROW_SPLIT_MAX_M && N % 16 == 0 && N <= ROW_SPLIT_MAX_N) {
    row_split(pool, threads, xp, M, E, wp, N, yp);
    return ffi::Error::Success();
  }
#endif
  // Stripes of at most CW columns, a multiple of 8 wide, as many as a multiple of the
  // pool's threads where the columns allow: a projection of 576 columns is 4 stripes of
  // 144 on 2 threads, not 3 of 256 with one thread doing two.
  const int64_t groups = (N + 7) / 8;
  int64_t parts = std::max<int64_t>((N + CW - 1) / CW, threads);
  parts = std::min<int64_t>((parts + threads - 1) / threads * threads, groups);
  const int64_t width = (groups + parts - 1) / parts * 8;
  kvjax::parallel_for(pool, (N + width - 1) / width, [&](int64_t it) {
    nn_task(xp, M, E, wp, N, it * width, width, yp);
  });
  return ffi::Error::Success();
}

// y[m][v] = x[m] . T[v] for rows [v0, v1) of a bfloat16 table T [V, E] (a tied lm_head's
// embedding, whose rows are contiguous): each row is read once, from memory in order, and
// stays in L1 while every row of x is multiplied by it, four accumulators per dot.
void nt_rows(const float* x, int64_t M, int64_t E, const uint16_t* t, int64_t V, int64_t v0,
             int64_t v1, float* y) {
  for (int64_t v = v0; v < v1; ++v) {
    const uint16_t* row = t + v * E;
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
        a0 += x0 * widen8(row + e);
        a1 += x1 * widen8(row + e + 8);
        a2 += x2 * widen8(row + e + 16);
        a3 += x3 * widen8(row + e + 24);
      }
      v8 a = (a0 + a1) + (a2 + a3);
      float sum = 0.f;
      for (int i = 0; i < 8; ++i) sum += a[i];
      for (; e < E; ++e) sum += xm[e] * widen1(row[e]);
      y[m * V + v] = sum;
    }
  }
}

ffi::Error MatvecT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer t,
                   ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), td = t.dimensions();
  if (xd.size() != 2 || td.size() != 2)
    return ffi::Error::InvalidArgument("kvjax_matvec_t: x must be [M, E] and t [V, E]");
  const int64_t M = xd[0], E = xd[1], V = td[0];
  if (td[1] != E) return ffi::Error::InvalidArgument("kvjax_matvec_t: E differs");
  if (t.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("kvjax_matvec_t: t must be bfloat16");
  const float* xp = x.typed_data();
  const uint16_t* tp = static_cast<const uint16_t*>(t.untyped_data());
  float* yp = y->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(V, 8 * threads));
  const int64_t rows = (V + chunks - 1) / chunks;
  kvjax::parallel_for(pool, (V + rows - 1) / rows, [&](int64_t it) {
    nt_rows(xp, M, E, tp, V, it * rows, std::min<int64_t>(V, (it + 1) * rows), yp);
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
