// hf_specsample::small_rows_linear: y = x @ weight.T (+ bias) for a few rows of x, on the CPU, bf16 weights.
//
// A decoding step streams every weight once; verifying K+1 positions should stream them once too. Eager PyTorch's
// bf16 GEMM on CPUs without native bf16 (AVX2) costs about K+1 steps for K+1 rows. Here each weight element is
// loaded once (bf16 -> fp32 by a shift), kept in a register, and multiplied into every row of x: a tile of MB rows
// of x and NB rows of the weight accumulates MB * NB dot products in fp32 registers.
//
// Every output y[m][n] is the same sum in the same order (8 fp32 lanes over k, then the lanes, then the k tail)
// whatever M is and wherever row m sits in its tile: the result of a row never depends on the other rows (batch
// invariance), so one position fed alone and the same position fed among K+1 give bit-identical outputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HF_SPECSAMPLE_AVX2 1
#endif

namespace {

#ifdef HF_SPECSAMPLE_AVX2
inline __m256 load_bf16(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#endif

// x: MB rows (fp32, row stride K); w: NB rows (bf16, row stride K); y[i * N + j] = dot(x[i], w[j]).
template <int MB, int NB>
inline void tile(const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t N) {
  float sums[NB][MB] = {};
  int64_t k = 0;
#ifdef HF_SPECSAMPLE_AVX2
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) acc[j][i] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = load_bf16(w + j * K + k);
    for (int i = 0; i < MB; i++) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NB; j++) acc[j][i] = _mm256_fmadd_ps(wv[j], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) sums[j][i] = lane_sum(acc[j][i]);
#endif
  for (; k < K; k++)
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < MB; i++) sums[j][i] += static_cast<float>(w[j * K + k]) * x[i * K + k];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = sums[j][i];
}

// MB rows of x against weight rows [n0, n1): NB weight rows at a time (as many as the 16 AVX2 registers hold).
template <int MB>
void row_block(const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NB = MB <= 2 ? 4 : (MB == 3 ? 3 : 2);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile<MB, NB>(x, w + n * K, y + n, K, N);
  for (; n < n1; n++) tile<MB, 1>(x, w + n * K, y + n, K, N);
}

using RowBlock = void (*)(const float*, const at::BFloat16*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr int kMaxBlock = 6;
constexpr RowBlock kRowBlock[kMaxBlock + 1] = {nullptr,       row_block<1>, row_block<2>, row_block<3>,
                                               row_block<4>, row_block<5>, row_block<6>};
constexpr int64_t kColumnChunk = 16;  // weight rows a thread takes at a time

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_rows_linear: x (M, K) and weight (N, K) expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.device().is_cpu(),
              "small_rows_linear: a contiguous bf16 CPU weight expected");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  // Row blocks of at most 6, balanced (9 rows: 5 + 4). A thread runs every row block over its chunk of weight rows
  // before moving on: the chunk is read from memory once, later row blocks find it in L1.
  const int64_t blocks = (M + kMaxBlock - 1) / kMaxBlock;
  at::parallel_for(0, (N + kColumnChunk - 1) / kColumnChunk, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t n = c0 * kColumnChunk; n < std::min(N, c1 * kColumnChunk); n += kColumnChunk) {
      const int64_t end = std::min(N, n + kColumnChunk);
      int64_t m = 0;
      for (int64_t b = 0; b < blocks; b++) {
        const int64_t rows = (M - m) / (blocks - b);
        kRowBlock[rows](xp + m * K, wp, yp + m * N, K, N, n, end);
        m += rows;
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y.to(x.scalar_type());
}

bool vectorized() {
#ifdef HF_SPECSAMPLE_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(hf_specsample, m) {
  m.def("small_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("vectorized() -> bool", &vectorized);  // whether the AVX2 path was compiled (else the scalar loop)
}

TORCH_LIBRARY_IMPL(hf_specsample, CPU, m) {
  m.impl("small_rows_linear", &small_rows_linear);
}
