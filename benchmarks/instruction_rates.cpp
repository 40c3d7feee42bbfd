// The AVX2 instructions the q8 dot kernels (kernels/csrc/q8_cpu.h) are made of, each alone, in ns per
// instruction: eight independent chains, so that the figure is the core's issue rate for the
// instruction, not its latency (for those of latency <= 4 cycles; vpaddd's figure is bound by the
// loop's own issue, not by the instruction).
//
//     g++ -O2 -mavx2 -mfma benchmarks/instruction_rates.cpp -o /tmp/instruction_rates && /tmp/instruction_rates
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

volatile int seed[8] = {1, 2, 3, 4, 5, 6, 7, 8};  // distinct starts: the compiler cannot merge the chains
constexpr long kIterations = 100000000;

template <typename V, typename Op>
double ns_per_instruction(V (*make)(int), Op op) {
  V a0 = make(seed[0]), a1 = make(seed[1]), a2 = make(seed[2]), a3 = make(seed[3]);
  V a4 = make(seed[4]), a5 = make(seed[5]), a6 = make(seed[6]), a7 = make(seed[7]);
  const V b = make(3);
  const auto start = std::chrono::steady_clock::now();
  for (long n = 0; n < kIterations; ++n) {
    a0 = op(a0, b), a1 = op(a1, b), a2 = op(a2, b), a3 = op(a3, b);
    a4 = op(a4, b), a5 = op(a5, b), a6 = op(a6, b), a7 = op(a7, b);
    asm volatile("" : : "x"(a0), "x"(a1), "x"(a2), "x"(a3), "x"(a4), "x"(a5), "x"(a6), "x"(a7));
  }
  const auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(end - start).count() / (8.0 * kIterations);
}

__m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
__m256 floats(int v) { return _mm256_set1_ps(1.0f / static_cast<float>(v + 1)); }

}  // namespace

int main() {
  const double add = ns_per_instruction(bytes, [](__m256i a, __m256i b) { return _mm256_add_epi32(a, b); });
  std::printf("vpaddd      %.3f ns\n", add);
  std::printf("vpmaddubsw  %.3f ns\n", ns_per_instruction(bytes, [](__m256i a, __m256i b) { return _mm256_maddubs_epi16(a, b); }));
  std::printf("vpmaddwd    %.3f ns\n", ns_per_instruction(bytes, [](__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }));
  std::printf("vpsignb     %.3f ns\n", ns_per_instruction(bytes, [](__m256i a, __m256i b) { return _mm256_sign_epi8(a, b); }));
  std::printf("vphaddd     %.3f ns\n", ns_per_instruction(bytes, [](__m256i a, __m256i b) { return _mm256_hadd_epi32(a, b); }));
  std::printf("vpunpckldq  %.3f ns\n", ns_per_instruction(bytes, [](__m256i a, __m256i b) { return _mm256_unpacklo_epi32(a, b); }));
  std::printf("vpackssdw   %.3f ns\n", ns_per_instruction(bytes, [](__m256i a, __m256i b) { return _mm256_packs_epi32(a, b); }));
  std::printf("vfmadd231ps %.3f ns\n", ns_per_instruction(floats, [](__m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, b); }));
  std::printf("vcvtdq2ps   %.3f ns\n", ns_per_instruction(floats, [](__m256 a, __m256) {
    return _mm256_cvtepi32_ps(_mm256_castps_si256(a)); }));
}
