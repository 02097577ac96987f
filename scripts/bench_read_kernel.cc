// One thread of the CPU read kernel's fused scan (kvjax/kernels/read.cc), without jax: the
// time per stored token and per (token, query row) of one layer's read for a K/V codec
// pair, so the kernel's arithmetic can be measured apart from the rest of a decode step.
//
// Build and run (`make bench-read-kernel ARGS="24 3 4096 64"` does the same):
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -std=c++17 -w \
//       -I "$(python -c 'import jax; print(jax.ffi.include_dir())')" \
//       scripts/bench_read_kernel.cc -o /tmp/bench_read_kernel && /tmp/bench_read_kernel
// Arguments (all optional): rows query_rows tokens head_dim. Prints one line per setting.
// The codes are random bytes; scales and zero points are 1, so the times (not the values)
// are what it measures. Medians over REPEATS passes; run it on an idle machine.

#include "../kvjax/kernels/read.cc"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

namespace {

struct Setting {
  const char* name;
  int64_t k_kind, v_kind, k_mode, k_param, v_mode, v_param;
};

int64_t bytes_per_row(int64_t kind, int D) {
  return kind == F32 ? 4 * D : (kind == BF16 || kind == F16) ? 2 * D
         : kind == UINT4 ? D / 2 : kind == UINT2 ? D / 4 : D;
}

int shift_of(int64_t x) { return __builtin_ctzll(uint64_t(x)); }

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 1 ? std::atoi(argv[1]) : 24;
  const int M = argc > 2 ? std::atoi(argv[2]) : 3;
  const int64_t T = argc > 3 ? std::atoll(argv[3]) : 4096;
  const int D = argc > 4 ? std::atoi(argv[4]) : 64;
  const int REPEATS = 9;
  const Setting settings[] = {
      {"fp32", F32, F32, WHOLE, 1, WHOLE, 1},      {"bf16", BF16, BF16, WHOLE, 1, WHOLE, 1},
      {"fp16", F16, F16, WHOLE, 1, WHOLE, 1},      {"fp8_e4m3", E4M3, E4M3, WHOLE, 1, WHOLE, 1},
      {"int8", INT8, INT8, WHOLE, 1, WHOLE, 1},    {"int4", UINT4, UINT4, WHOLE, 1, WHOLE, 1},
      {"int2", UINT2, UINT2, WHOLE, 1, WHOLE, 1},  {"k8v4", INT8, UINT4, WHOLE, 1, WHOLE, 1},
      {"int4_g32", UINT4, UINT4, GROUPED, D / 32, GROUPED, D / 32},
      {"int4_kivi", UINT4, UINT4, CHANNEL, 32, GROUPED, D / 32},
      {"int2_kivi", UINT2, UINT2, CHANNEL, 32, GROUPED, D / 32},
  };
  std::mt19937 gen(0);
  std::vector<uint16_t> ones(size_t(rows) * T * 64, 0x3f80);  // bfloat16 1.0
  std::vector<float> q(size_t(rows) * M * D);
  for (auto& x : q) x = float(gen() % 1000) / 1000.f - 0.5f;
  std::vector<char> mask(T, 1);
  std::vector<float> m(M), s(M), acc(size_t(M) * D);
  std::printf("rows %d, query rows %d, tokens %lld, head_dim %d, one thread\n", rows, M,
              (long long)T, D);
  for (const Setting& st : settings) {
    if ((st.k_mode == GROUPED && st.k_param < 1) || (st.v_mode == GROUPED && st.v_param < 1))
      continue;  // head_dim below one 32-column group
    auto codes = [&](int64_t kind) {
      std::vector<uint8_t> c(size_t(rows) * T * bytes_per_row(kind, D));
      // fp16 bit patterns of moderate normal values; fp8 bytes with normal exponents (no
      // subnormals, NaN or infinities, which a scaled cache rarely holds).
      bool fp8 = kind == E4M3 || kind == E5M2;
      for (auto& b : c) b = uint8_t(fp8 ? 0x30 + gen() % 0x40 : gen() & 0x3f);
      if (kind == BF16 || kind == F32) {  // normal floats in [-1, 1): random bytes would
        size_t esz = kind == F32 ? 4 : 2;  // hold subnormals, which the float units pay for
        for (size_t i = 0; i + esz <= c.size(); i += esz) {
          float f = float(gen() % 20000) / 10000.f - 1.f;
          uint32_t u;
          std::memcpy(&u, &f, 4);
          uint16_t h = uint16_t(u >> 16);
          std::memcpy(&c[i], esz == 4 ? static_cast<void*>(&u) : static_cast<void*>(&h), esz);
        }
      }
      return c;
    };
    std::vector<uint8_t> kc = codes(st.k_kind), vc = codes(st.v_kind);
    auto leaf = [&](const std::vector<uint8_t>& c, int64_t kind, int64_t mode, int64_t param) {
      bool scaled = kind != F32 && kind != BF16 && kind != F16;
      bool zeros = kind == UINT4 || kind == UINT2;
      Leaf lf{c.data(), scaled ? ones.data() : nullptr, zeros ? ones.data() : nullptr, kind,
              bytes_per_row(kind, D), mode, mode == GROUPED ? param : 1,
              mode == CHANNEL ? param : 1, mode == GROUPED ? shift_of(D / param) : 0,
              mode == CHANNEL ? shift_of(param) : 0};
      return lf;
    };
    Leaf kl = leaf(kc, st.k_kind, st.k_mode, st.k_param);
    Leaf vl = leaf(vc, st.v_kind, st.v_mode, st.v_param);
    Geometry geo{T, 1, 0, 0, nullptr};
    Fused fns{};
    ScanFn scan = fused(kl, vl, D, M, fns);
    if (!scan) {
      std::printf("%-10s not taken by the fused scan\n", st.name);
      continue;
    }
    std::vector<double> ms;
    for (int rep = 0; rep < REPEATS; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < rows; ++r)
        scan(q.data() + size_t(r) * M * D, kl, vl, fns, reinterpret_cast<bool*>(mask.data()),
             r, geo, 0, T, M, m.data(), s.data(), acc.data());
      ms.push_back(std::chrono::duration<double, std::milli>(
                       std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    double med = ms[ms.size() / 2], per_token = med * 1e6 / (double(rows) * T);
    std::printf("%-10s %8.3f ms  %6.1f ns/token  %6.1f ns/token-row\n", st.name, med,
                per_token, per_token / M);
  }
  return 0;
}
