// Products of a few float32 rows with a bfloat16 weight matrix, as an XLA FFI custom
// call: y[M, N] = x[M, E] . W, W stored [E, N] (a projection's kernel). Each weight is
// widened in a register where it is used (bf16 is the top half of a float32) and read from
// memory once per call, so a decode step reads its weights at their stored bytes; XLA:CPU
// widens a bf16 matrix into a float32 copy first. Column stripes are split across XLA's
// intra-op thread pool. For the few rows of a decode step (M <= 16); longer inputs stay
// with XLA's dot.

#include <algorithm>
#include <cstdint>
#include <cstring>

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

constexpr int CW = 256;  // [E, N]: columns a task owns (512 contiguous bytes of each row)
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

// One task: columns [c0, c0 + CW) of every row (the last task may be narrower).
void nn_task(const float* x, int64_t M, int64_t E, const uint16_t* w, int64_t N, int64_t c0,
             float* y) {
  int cw = int(std::min<int64_t>(CW, N - c0));
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
  kvjax::parallel_for(pool, (N + CW - 1) / CW, [&](int64_t it) {
    nn_task(xp, M, E, wp, N, it * CW, yp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatvec, Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
