// hf_specsample::small_rows_linear: y = x @ weight.T (+ bias) for a few rows of x, on the CPU.
//
// A decoding step streams every weight once; verifying K+1 positions should stream them once too. Here each weight
// element is loaded once, kept in a register, and multiplied into every row of x: a tile of MB rows of x and NB rows
// of the weight accumulates MB * NB dot products in fp32 vector registers.
//
// Vector paths, each compiled for its instruction set (target attributes) and chosen at run time by what the CPU
// supports, so that one binary serves every x86 CPU and the tests can run every path the machine has:
//   amx_bf16:    AMX tiles: 16 weight rows x 32 k's of the weight read straight from memory as one tile, times the
//                rows of x (a tile of k pairs), accumulated in fp32 tiles; flat in the rows up to 16 (bf16 weights);
//   avx512_bf16: vdpbf16ps, two bf16 products per fp32 lane per instruction (x read as bf16, no widening);
//   avx512_vnni: int8 weights only: each row of x rounded to int8 (its own scale), vpdpbusd sums four byte products
//                per int32 lane exactly;
//   avx512f:     16 fp32 lanes, bf16 weights widened by a shift;
//   avx2_fma:    8 fp32 lanes, bf16 weights widened by a shift;
//   scalar:      the loop every CPU runs (other architectures: only this one).
// Weight forms: bf16 (`small_rows_linear`); int8 with one fp32 scale per weight row (`small_rows_linear_int8`, a
// draft's quantized form: half the bytes; avx512f / avx2_fma / scalar paths); int4 with one fp32 scale per group of
// k's (`small_rows_linear_int4`: a quarter of the bytes; avx512_bf16, whose table lookup and pair products keep up
// with memory, and scalar).
//
// Batch invariance: every output y[m][n] is the same sum in the same order (vector lanes over k, masked zero lanes
// for the k tail, then a fixed reduction of the lanes) whatever M is and wherever row m sits in its tile: a row's
// result never depends on the other rows, so one position fed alone and among K+1 give bit-identical outputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HF_X86 1
#define HF_AVX2 __attribute__((target("avx2,fma")))
#define HF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define HF_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define HF_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define HF_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

enum Path : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4, kAvx512Vnni = 5 };
const char* const kPathNames[] = {"scalar", "avx2_fma", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni"};
constexpr Path kFastestFirst[] = {kAmx, kAvx512Bf16, kAvx512Vnni, kAvx512, kAvx2, kScalar};
// int4 weights: avx512_vnni first (two vpdpbusd per 128 products of a group, against four table lookups and four
// vdpbf16ps on avx512_bf16): on a Sapphire Rapids Xeon a (9728, 896) int4 weight at one row took 224 us there against
// 457 us (`python -m hf_specsample_bench.draft_weight_forms`). Python's `READS` lists each form's order.
constexpr Path kInt4FastestFirst[] = {kAvx512Vnni, kAvx512Bf16, kScalar};

// The weight forms, and which paths read each.
enum Form { kBf16Weights, kInt8Weights, kInt4Weights };
const char* const kFormNames[] = {"bf16", "int8", "int4"};

bool reads(Path path, Form form) {
  switch (form) {
    case kBf16Weights:
      return path != kAvx512Vnni;
    case kInt8Weights:
      return path == kScalar || path == kAvx2 || path == kAvx512 || path == kAvx512Vnni;
    case kInt4Weights:
      return path == kScalar || path == kAvx512Bf16 || path == kAvx512Vnni;
  }
  return false;
}

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_permitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
#else
  return false;
#endif
}

bool cpu_supports(Path path) {
#ifdef HF_X86
  switch (path) {
    case kScalar:
      return true;
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && cpu_supports(kAvx2);
    case kAvx512Bf16:
      return __builtin_cpu_supports("avx512bf16") && cpu_supports(kAvx512);
    case kAmx:
      return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && cpu_supports(kAvx512Bf16) &&
             amx_permitted();
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512vnni") && cpu_supports(kAvx512);
  }
  return false;
#else
  return path == kScalar;
#endif
}

// $HF_SPECSAMPLE_KERNEL_PATHS: path names, comma-separated. The kernel runs none but those (scalar always), as a
// lesser CPU would: the tests run as on each x86 class. Unset or empty: every path the CPU supports.
bool allowed(Path path) {
  static const std::string names = [] {
    const char* value = std::getenv("HF_SPECSAMPLE_KERNEL_PATHS");
    std::string listed = value == nullptr ? "" : value;
    listed.erase(std::remove(listed.begin(), listed.end(), ' '), listed.end());
    return listed.empty() ? listed : "," + listed + ",";
  }();
  return path == kScalar || names.empty() || names.find("," + std::string(kPathNames[path]) + ",") != std::string::npos;
}

bool cpu_has(Path path) { return allowed(path) && cpu_supports(path); }

// ----------------------------------------------------------------------------------------------------------------
// One tile: MB rows of x against NB weight rows, over all of K. x: row stride K; w: row stride K; y[i * N + j].
// Weight types: at::BFloat16 (dot products), int8_t (dot products, scaled by `scale[j]` after the sum).

template <int MB, int NB, typename W>
inline void tile_scalar(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N) {
  float sums[NB][MB] = {};
  for (int64_t k = 0; k < K; k++)
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < MB; i++) sums[j][i] += static_cast<float>(w[j * K + k]) * x[i * K + k];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = scale == nullptr ? sums[j][i] : sums[j][i] * scale[j];
}

// Int4Layout: a weight row of K int4 values is K / 2 bytes; in each chunk of 64 k's (32 bytes), byte j holds
// k = 64c + j in its low nibble and k = 64c + 32 + j in its high one, each as q + 8 (q in -8..7). One fp32 scale per
// group of `group` k's (a multiple of 64 dividing K): scale[n * (K / group) + g].
const uint16_t* int4_bf16_table() {
  // bf16 bits of -8.0 .. 7.0 (exact), twice: a 32-entry word table for vpermw
  static const auto table = [] {
    std::array<uint16_t, 32> bits{};
    for (int index = 0; index < 32; index++) {
      const float value = static_cast<float>(index % 16 - 8);
      uint32_t word;
      std::memcpy(&word, &value, sizeof(word));
      bits[index] = static_cast<uint16_t>(word >> 16);
    }
    return bits;
  }();
  return table.data();
}

template <int MB, int NB>
inline void tile_int4_scalar(const float* x, const uint8_t* w, const float* scale, float* y, int64_t K, int64_t N,
                             int64_t group) {
  const int64_t groups = K / group, row_bytes = K / 2;
  float acc[NB][MB] = {};
  for (int64_t g = 0; g < groups; g++) {
    float part[NB][MB] = {};
    for (int64_t k = g * group; k < (g + 1) * group; k += 64)
      for (int64_t b = 0; b < 32; b++)
        for (int j = 0; j < NB; j++) {
          const uint8_t byte = w[j * row_bytes + k / 2 + b];
          const float low = static_cast<float>((byte & 15) - 8), high = static_cast<float>((byte >> 4) - 8);
          for (int i = 0; i < MB; i++) {
            part[j][i] += low * x[i * K + k + b];
            part[j][i] += high * x[i * K + k + 32 + b];
          }
        }
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < MB; i++) acc[j][i] += part[j][i] * scale[j * groups + g];
  }
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = acc[j][i];
}

constexpr int64_t kColumnChunk = 16;  // weight rows a thread takes at a time (see for_blocks)

#ifdef HF_X86
// The weight one column chunk ahead, at the same k: the rows this thread reads next (for_blocks hands a thread
// consecutive chunks), asked into L2 while this tile is summed. Without it the loads of a few rows wait on memory
// and the sums wait on the loads; with it a 1.5B model's linears read their weights at 1.5-1.8x the rate at 5-9 rows
// and 1.1-1.25x at one (avx512_bf16 on a Zen 4 EPYC; avx512f and avx2_fma 1.2-2x: docs/benchmarks.md, 2026-11-27).
// A prefetch never faults: the last chunk's, past the weight's end, is harmless (its address is computed as an
// integer, so no pointer past the weight is ever formed).
template <typename W>
inline void prefetch_ahead(const W* row, int64_t K, int64_t k) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(row + k) + static_cast<uintptr_t>(kColumnChunk * K * sizeof(W));
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T1);
}

HF_AVX2 inline __m256 widen8(const at::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

HF_AVX2 inline __m256 widen8(const int8_t* p) {
  const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
}

HF_AVX2 inline float lanes8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

template <int MB, int NB, typename W>
HF_AVX2 inline void tile_avx2(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N) {
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) acc[j][i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NB];
    const bool new_line = (k * static_cast<int64_t>(sizeof(W))) % 64 == 0;  // one prefetch per 64 bytes of a row
    for (int j = 0; j < NB; j++) {
      if (new_line) prefetch_ahead(w + j * K, K, k);
      wv[j] = widen8(w + j * K + k);
    }
    for (int i = 0; i < MB; i++) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NB; j++) acc[j][i] = _mm256_fmadd_ps(wv[j], xv, acc[j][i]);
    }
  }
  float sums[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) sums[j][i] = lanes8(acc[j][i]);
  for (; k < K; k++)
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < MB; i++) sums[j][i] += static_cast<float>(w[j * K + k]) * x[i * K + k];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = scale == nullptr ? sums[j][i] : sums[j][i] * scale[j];
}

// Plain loads only in the k loops: with masked loads (void* builtins) GCC 12 keeps every accumulator in memory
// too, storing it at each step; the k tail is summed one by one after the lanes instead.
HF_AVX512 inline __m512 widen16(const at::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

HF_AVX512 inline __m512 widen16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

template <int MB, int NB, typename W>
HF_AVX512 inline void tile_avx512(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N) {
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) acc[j][i] = _mm512_setzero_ps();
  int64_t k = 0;  // whole steps of 16 k's, the lanes summed, then the k tail one by one
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NB];
    const bool new_line = (k * static_cast<int64_t>(sizeof(W))) % 64 == 0;  // one prefetch per 64 bytes of a row
    for (int j = 0; j < NB; j++) {
      if (new_line) prefetch_ahead(w + j * K, K, k);
      wv[j] = widen16(w + j * K + k);
    }
    for (int i = 0; i < MB; i++) {
      const __m512 xv = _mm512_loadu_ps(x + i * K + k);
      for (int j = 0; j < NB; j++) acc[j][i] = _mm512_fmadd_ps(wv[j], xv, acc[j][i]);
    }
  }
  float sums[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) sums[j][i] = _mm512_reduce_add_ps(acc[j][i]);
  for (; k < K; k++)
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < MB; i++) sums[j][i] += static_cast<float>(w[j * K + k]) * x[i * K + k];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = scale == nullptr ? sums[j][i] : sums[j][i] * scale[j];
}

// x and w in bf16: each vdpbf16ps adds two products per fp32 lane (pairs k, k+1 of 32 k's).
template <int MB, int NB>
HF_AVX512BF16 inline void tile_avx512_bf16(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t K,
                                           int64_t N) {
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) acc[j][i] = _mm512_setzero_ps();
  int64_t k = 0;  // whole steps of 32 k's, the lanes summed, then the k tail one by one (see widen16)
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; j++) {
      prefetch_ahead(w + j * K, K, k);
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
    }
    for (int i = 0; i < MB; i++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      for (int j = 0; j < NB; j++) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], wv[j], xv);
    }
  }
  float sums[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) sums[j][i] = _mm512_reduce_add_ps(acc[j][i]);
  for (; k < K; k++)
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < MB; i++) sums[j][i] += static_cast<float>(w[j * K + k]) * static_cast<float>(x[i * K + k]);
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = sums[j][i];
}

// int4 weights (see `Int4Layout`), x in bf16: 16 bf16 values (-8..7) looked up per nibble, two dot products per chunk.
template <int MB, int NB>
HF_AVX512BF16 inline void tile_int4_avx512_bf16(const at::BFloat16* x, const uint8_t* w, const float* scale,
                                                float* y, int64_t K, int64_t N, int64_t group) {
  const int64_t groups = K / group, row_bytes = K / 2;
  const __m512i table = _mm512_loadu_si512(int4_bf16_table());
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) acc[j][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 part[NB][MB];
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < MB; i++) part[j][i] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 64) {
      __m512bh low[NB], high[NB];
      const bool new_line = (k / 2) % 64 == 0;  // 32 bytes of a row per step
      for (int j = 0; j < NB; j++) {
        if (new_line) prefetch_ahead(w + j * row_bytes, row_bytes, k / 2);
        const __m512i bytes =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row_bytes + k / 2)));
        low[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, nibble), table);
        high[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
      }
      for (int i = 0; i < MB; i++) {
        const __m512bh x_low = (__m512bh)_mm512_loadu_si512(x + i * K + k);
        const __m512bh x_high = (__m512bh)_mm512_loadu_si512(x + i * K + k + 32);
        for (int j = 0; j < NB; j++) {
          part[j][i] = _mm512_dpbf16_ps(part[j][i], low[j], x_low);
          part[j][i] = _mm512_dpbf16_ps(part[j][i], high[j], x_high);
        }
      }
    }
    for (int j = 0; j < NB; j++) {
      const __m512 s = _mm512_set1_ps(scale[j * groups + g]);
      for (int i = 0; i < MB; i++) acc[j][i] = _mm512_fmadd_ps(part[j][i], s, acc[j][i]);
    }
  }
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = _mm512_reduce_add_ps(acc[j][i]);
}

// AMX: C (16 weight rows x M rows of x, fp32) += A (16 weight rows x 32 k's, bf16, straight from the weight with
// its row stride) . B (the 32 k's of every row of x as 16 rows of k pairs). Each output is its own sum over the
// k blocks in order, whatever M is: batch-invariant. Tiles: 0, 1 accumulate; 2, 3 hold weight blocks; 4 holds x.
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

HF_AMX void amx_configure(int64_t M) {
  alignas(64) TileConfig config;
  for (int tile = 0; tile < 5; tile++) {
    config.rows[tile] = 16;
    config.colsb[tile] = static_cast<uint16_t>(tile == 2 || tile == 3 ? 64 : M * 4);
  }
  // GCC 12 does not see ldtilecfg read its operand and drops the stores above as dead: make them visible.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// int8 weights against the rows of x rounded to int8 (`quantize_rows`: value + 128 as uint8): vpdpbusd adds four
// byte products per int32 lane, exactly, so every sum is exact whatever its order (batch-invariant by arithmetic).
template <int MB, int NB>
HF_VNNI inline void tile_vnni(const uint8_t* x, const int8_t* w, int32_t* y, int64_t K, int64_t N) {
  __m512i acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) acc[j][i] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int j = 0; j < NB; j++) prefetch_ahead(w + j * K, K, k);
    __m512i wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_si512(w + j * K + k);
    for (int i = 0; i < MB; i++) {
      const __m512i xv = _mm512_loadu_si512(x + i * K + k);
      for (int j = 0; j < NB; j++) acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], xv, wv[j]);
    }
  }
  int32_t sums[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) sums[j][i] = _mm512_reduce_add_epi32(acc[j][i]);
  for (; k < K; k++)
    for (int j = 0; j < NB; j++)
      for (int i = 0; i < MB; i++) sums[j][i] += static_cast<int32_t>(x[i * K + k]) * w[j * K + k];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = sums[j][i];
}

template <int MB>
HF_VNNI void row_block_vnni(const uint8_t* x, const int8_t* w, int32_t* y, int64_t K, int64_t N, int64_t n0,
                            int64_t n1) {
  constexpr int NB = MB <= 2 ? 8 : (MB == 3 ? 6 : (MB == 4 ? 5 : 4));
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile_vnni<MB, NB>(x, w + n * K, y + n, K, N);
  for (; n < n1; n++) tile_vnni<MB, 1>(x, w + n * K, y + n, K, N);
}

// int4 weights (see Int4Layout, groups of 128 k's) against the rows of x rounded to int8 and reordered to match a
// 64-byte load of the packed weight: its low nibbles hold k's 0-31 and 64-95 of the group, its high ones 32-63 and
// 96-127 (`x_for_int4`). Per group, two vpdpbusd per row give an exact int32 sum, scaled into an fp32 sum.
template <int MB, int NB>
HF_VNNI inline void tile_int4_vnni(const uint8_t* x, const uint8_t* w, const float* scale, float* y, int64_t K,
                                   int64_t N) {
  const int64_t groups = K / 128, row_bytes = K / 2;
  const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) acc[j][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    for (int j = 0; j < NB; j++) prefetch_ahead(w + j * row_bytes, row_bytes, g * 64);
    __m512i low[NB], high[NB];
    for (int j = 0; j < NB; j++) {
      const __m512i bytes = _mm512_loadu_si512(w + j * row_bytes + g * 64);
      low[j] = _mm512_sub_epi8(_mm512_and_si512(bytes, nibble), eight);
      high[j] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble), eight);
    }
    for (int i = 0; i < MB; i++) {
      const __m512i x_low = _mm512_loadu_si512(x + i * K + g * 128);
      const __m512i x_high = _mm512_loadu_si512(x + i * K + g * 128 + 64);
      for (int j = 0; j < NB; j++) {
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x_low, low[j]), x_high,
                                                 high[j]);
        acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(scale[j * groups + g]), acc[j][i]);
      }
    }
  }
  for (int j = 0; j < NB; j++)
    for (int i = 0; i < MB; i++) y[i * N + j] = _mm512_reduce_add_ps(acc[j][i]);
}

template <int MB>
HF_VNNI void row_block_int4_vnni(const uint8_t* x, const uint8_t* w, const float* scale, float* y, int64_t K,
                                 int64_t N, int64_t n0, int64_t n1) {
  constexpr int NB = MB <= 2 ? 8 : (MB <= 4 ? 4 : 2);  // 2 NB weight and MB * NB accumulator registers of 32
  const int64_t groups = K / 128, row_bytes = K / 2;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile_int4_vnni<MB, NB>(x, w + n * row_bytes, scale + n * groups, y + n, K, N);
  for (; n < n1; n++) tile_int4_vnni<MB, 1>(x, w + n * row_bytes, scale + n * groups, y + n, K, N);
}

HF_AMX void amx_release() { _tile_release(); }

// Weight rows n .. n + 16 * BLOCKS - 1 (BLOCKS of 16) against every row of x; `pairs`: x as B tiles (see run_amx).
template <int BLOCKS>
HF_AMX void amx_rows(const uint32_t* pairs, const at::BFloat16* w, float* y, int64_t M, int64_t K, int64_t N,
                     int64_t n) {
  _tile_zero(0);
  if constexpr (BLOCKS == 2) _tile_zero(1);
  const int64_t stride = K * static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t block = 0; block < K / 32; block++) {
    _tile_loadd(4, pairs + block * 16 * M, M * 4);
    _tile_loadd(2, w + n * K + block * 32, stride);
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (BLOCKS == 2) {
      _tile_loadd(3, w + (n + 16) * K + block * 32, stride);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  alignas(64) float c[16 * 16];
  for (int b = 0; b < BLOCKS; b++) {
    if (b == 0) _tile_stored(0, c, M * 4);
    if constexpr (BLOCKS == 2) {
      if (b == 1) _tile_stored(1, c, M * 4);
    }
    for (int r = 0; r < 16; r++)
      for (int64_t m = 0; m < M; m++) y[m * N + n + b * 16 + r] = c[r * M + m];
  }
}
#endif

// ----------------------------------------------------------------------------------------------------------------
// MB rows of x against weight rows [n0, n1): NB weight rows at a time, NB as the path's registers allow.

template <int MB>
constexpr int weight_rows(Path path) {
  if (path == kAvx2 || path == kScalar) return MB <= 2 ? 4 : (MB == 3 ? 3 : 2);  // 16 ymm registers
  return MB <= 2 ? 8 : (MB == 3 ? 6 : (MB == 4 ? 5 : 4));                       // 32 zmm registers
}

template <Path P, int MB, typename X, typename W>
void row_block(const X* x, const W* w, const float* scale, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int NB = weight_rows<MB>(P);
  auto run = [&](auto nb, int64_t n) {
    constexpr int B = decltype(nb)::value;
    const float* s = scale == nullptr ? nullptr : scale + n;
    if constexpr (P == kScalar) tile_scalar<MB, B>(x, w + n * K, s, y + n, K, N);
#ifdef HF_X86
    if constexpr (P == kAvx2) tile_avx2<MB, B>(x, w + n * K, s, y + n, K, N);
    if constexpr (P == kAvx512) tile_avx512<MB, B>(x, w + n * K, s, y + n, K, N);
    if constexpr (P == kAvx512Bf16) tile_avx512_bf16<MB, B>(x, w + n * K, y + n, K, N);
#endif
  };
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) run(std::integral_constant<int, NB>{}, n);
  for (; n < n1; n++) run(std::integral_constant<int, 1>{}, n);
}

constexpr int kMaxBlock = 6;

// fn(m, rows, n, end) for every block of rows m .. m + rows - 1 of x (balanced, at most kMaxBlock: 9 rows are 5 + 4)
// and every chunk n .. end - 1 of weight rows, in parallel over the chunks. A thread runs every row block over its
// chunk before moving on: the chunk is read from memory once, later row blocks find it in cache.
template <typename F>
void for_blocks(int64_t M, int64_t N, const F& fn) {
  const int64_t blocks = (M + kMaxBlock - 1) / kMaxBlock;
  at::parallel_for(0, (N + kColumnChunk - 1) / kColumnChunk, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t n = c0 * kColumnChunk; n < std::min(N, c1 * kColumnChunk); n += kColumnChunk) {
      const int64_t end = std::min(N, n + kColumnChunk);
      int64_t m = 0;
      for (int64_t b = 0; b < blocks; b++) {
        const int64_t rows = (M - m) / (blocks - b);
        fn(m, rows, n, end);
        m += rows;
      }
    }
  });
}

// fn(std::integral_constant<int, rows>) for rows in 1 .. kMaxBlock: a row block's size as a template argument.
template <typename F>
void with_rows(int64_t rows, const F& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    default: return fn(std::integral_constant<int, 6>{});
  }
}

template <Path P, typename X, typename W>
void run_rows(const X* x, const W* w, const float* scale, float* y, int64_t M, int64_t K, int64_t N) {
  for_blocks(M, N, [&](int64_t m, int64_t rows, int64_t n, int64_t end) {
    with_rows(rows, [&](auto mb) { row_block<P, decltype(mb)::value>(x + m * K, w, scale, y + m * N, K, N, n, end); });
  });
}

template <Path P, int MB, typename X>
void row_block_int4(const X* x, const uint8_t* w, const float* scale, float* y, int64_t K, int64_t N, int64_t n0,
                    int64_t n1, int64_t group) {
  constexpr int NB = MB <= 2 ? 4 : 2;
  const int64_t groups = K / group, row_bytes = K / 2;
  auto run = [&](auto nb, int64_t n) {
    constexpr int B = decltype(nb)::value;
    if constexpr (P == kScalar) tile_int4_scalar<MB, B>(x, w + n * row_bytes, scale + n * groups, y + n, K, N, group);
#ifdef HF_X86
    if constexpr (P == kAvx512Bf16)
      tile_int4_avx512_bf16<MB, B>(x, w + n * row_bytes, scale + n * groups, y + n, K, N, group);
#endif
  };
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) run(std::integral_constant<int, NB>{}, n);
  for (; n < n1; n++) run(std::integral_constant<int, 1>{}, n);
}

template <Path P, typename X>
void run_rows_int4(const X* x, const uint8_t* w, const float* scale, float* y, int64_t M, int64_t K, int64_t N,
                   int64_t group) {
  for_blocks(M, N, [&](int64_t m, int64_t rows, int64_t n, int64_t end) {
    with_rows(rows, [&](auto mb) {
      row_block_int4<P, decltype(mb)::value>(x + m * K, w, scale, y + m * N, K, N, n, end, group);
    });
  });
}

// Each row of x rounded to int8 with its own scale (max |x| / 127), stored as value + 128 (uint8, for vpdpbusd).
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, uint8_t* out, float* scales) {
  for (int64_t m = 0; m < M; m++) {
    float largest = 0.0f;
    for (int64_t k = 0; k < K; k++) largest = std::max(largest, std::abs(static_cast<float>(x[m * K + k])));
    const float scale = largest > 0.0f ? largest / 127.0f : 1.0f;
    scales[m] = scale;
    for (int64_t k = 0; k < K; k++) {
      const float value = std::nearbyint(static_cast<float>(x[m * K + k]) / scale);
      out[m * K + k] = static_cast<uint8_t>(static_cast<int32_t>(std::clamp(value, -127.0f, 127.0f)) + 128);
    }
  }
}

// For the avx512_vnni int4 path (see run_int4_vnni): per weight row, 128 * sum_g scale[n][g] * the group's sum.
std::vector<float> int4_corrections(const uint8_t* w, const float* scale, int64_t K, int64_t N) {
  const int64_t groups = K / 128;
  std::vector<float> corrections(N, 0.0f);  // 128 * sum_g scale[n][g] * sum of the group's weights
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; g++) {
        int32_t sum = 0;
        for (int64_t b = 0; b < 64; b++) {
          const uint8_t byte = w[n * (K / 2) + g * 64 + b];
          sum += (byte & 15) + (byte >> 4) - 16;
        }
        total += scale[n * groups + g] * static_cast<float>(128 * sum);
      }
      corrections[n] = total;
    }
  });
  return corrections;
}

#ifdef HF_X86
// int8 weights on avx512_vnni: y[m][n] = (sum_k q[m][k] * w[n][k] - 128 * row_sum[n]) * x_scale[m] * scale[n]
// (+ bias[n]), x, bias and y in one dtype X (bf16 or fp32: no converted copy of x, no fp32 copy of y). The fp32
// value is rounded to X once, after the bias, as `finish` rounds the other paths' outputs.
template <typename X>
void run_vnni(const X* x, const int8_t* w, const float* scale, const int32_t* row_sums, const X* bias, X* y,
              int64_t M, int64_t K, int64_t N) {
  std::vector<uint8_t> quantized(M * K);
  std::vector<float> x_scales(M);
  quantize_rows(x, M, K, quantized.data(), x_scales.data());
  std::vector<int32_t> sums(M * N);
  for_blocks(M, N, [&](int64_t m, int64_t rows, int64_t n, int64_t end) {
    with_rows(rows, [&](auto mb) {
      row_block_vnni<decltype(mb)::value>(quantized.data() + m * K, w, sums.data() + m * N, K, N, n, end);
    });
  });
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      float value = static_cast<float>(sums[m * N + n] - 128 * row_sums[n]) * x_scales[m] * scale[n];
      if (bias != nullptr) value += static_cast<float>(bias[n]);
      y[m * N + n] = static_cast<X>(value);
    }
}

// int4 weights on avx512_vnni (groups of 128): x rounded to int8 per row, reordered per group as the packed weight's
// nibbles hold it; y[m][n] = x_scale[m] * sum_g scale[n][g] * sum_k (q[m][k] + 128 - 128) * w[n][k], the 128 of
// the unsigned x taken back with the weight groups' sums (`int4_corrections`; the layer keeps them).
void run_int4_vnni(const float* x, const uint8_t* w, const float* scale, const float* corrections, float* y,
                   int64_t M, int64_t K, int64_t N) {
  const int64_t groups = K / 128;
  std::vector<uint8_t> quantized(M * K), ordered(M * K);
  std::vector<float> x_scales(M);
  quantize_rows(x, M, K, quantized.data(), x_scales.data());
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++)
      for (int part = 0; part < 4; part++) {  // k's 0-31, 64-95 (low nibbles), then 32-63, 96-127 (high ones)
        const int64_t from = g * 128 + (part == 0 ? 0 : part == 1 ? 64 : part == 2 ? 32 : 96);
        std::memcpy(&ordered[m * K + g * 128 + part * 32], &quantized[m * K + from], 32);
      }
  for_blocks(M, N, [&](int64_t m, int64_t rows, int64_t n, int64_t end) {
    with_rows(rows, [&](auto mb) {
      row_block_int4_vnni<decltype(mb)::value>(ordered.data() + m * K, w, scale, y + m * N, K, N, n, end);
    });
  });
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) y[m * N + n] = (y[m * N + n] - corrections[n]) * x_scales[m];
}

// AMX for bf16 weights: weight rows in blocks of 32 (then 16) per tile pass; the last N % 16 rows, and the k tail
// (K % 32), by the avx512_bf16 tile's sums: which sum an output gets depends on N and K alone, never on M.
HF_AMX void run_amx(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = K / 32, main_k = blocks * 32;
  // Rows of x in balanced groups of at most 16 (a tile's columns), each as B tiles:
  // pairs[g][(block * 16 + p) * rows + m] = x[first + m][32 block + 2p, + 1].
  const int64_t groups = (M + 15) / 16;
  std::vector<int64_t> first(groups + 1, 0);
  for (int64_t g = 0; g < groups; g++) first[g + 1] = first[g] + (M - first[g]) / (groups - g);
  std::vector<std::vector<uint32_t>> pairs(groups);
  for (int64_t g = 0; g < groups; g++) {
    const int64_t rows = first[g + 1] - first[g];
    pairs[g].resize(blocks * 16 * rows);
    for (int64_t m = 0; m < rows; m++)
      for (int64_t block = 0; block < blocks; block++)
        for (int p = 0; p < 16; p++)
          std::memcpy(&pairs[g][(block * 16 + p) * rows + m], x + (first[g] + m) * K + block * 32 + 2 * p, 4);
  }
  const int64_t tiled = N / 16 * 16;
  constexpr int64_t chunk = 32;  // weight rows per pass: read from memory once, from cache by the other groups
  at::parallel_for(0, (tiled + chunk - 1) / chunk, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t n = c0 * chunk; n < std::min(tiled, c1 * chunk); n += chunk) {
      for (int64_t g = 0; g < groups; g++) {
        const int64_t rows = first[g + 1] - first[g];
        amx_configure(rows);
        float* out = y + first[g] * N;
        if (n + 32 <= tiled) {
          amx_rows<2>(pairs[g].data(), w, out, rows, K, N, n);
        } else {
          amx_rows<1>(pairs[g].data(), w, out, rows, K, N, n);
        }
      }
    }
    amx_release();
  });
  if (main_k < K) {  // the k tail, one by one, after the tiles' sums
    at::parallel_for(0, tiled, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
          float sum = y[m * N + n];
          for (int64_t k = main_k; k < K; k++)
            sum += static_cast<float>(w[n * K + k]) * static_cast<float>(x[m * K + k]);
          y[m * N + n] = sum;
        }
    });
  }
  for (int64_t n = tiled; n < N; n++)  // the last rows: one dot product each
    for (int64_t m = 0; m < M; m++) tile_avx512_bf16<1, 1>(x + m * K, w + n * K, y + m * N + n, K, N);
}
#endif

std::vector<int64_t> paths();

// The fastest of the `offered` paths that reads `form` (scalar reads every form): the default path's choice. Pure, so
// that a test can ask it for CPUs it does not have (the operator `fastest_path`; Python's `fastest_path` mirrors it).
Path fastest(at::IntArrayRef offered, Form form) {
  const auto first_of = [&](const auto& order) {
    for (Path path : order)
      if (reads(path, form) && std::find(offered.begin(), offered.end(), path) != offered.end()) return path;
    return kScalar;
  };
  return form == kInt4Weights ? first_of(kInt4FastestFirst) : first_of(kFastestFirst);
}

Path chosen(int64_t requested, Form form) {
  if (requested < 0) {  // the fastest path this CPU runs for this weight form
    static const std::vector<int64_t> here = paths();
    return fastest(here, form);
  }
  TORCH_CHECK(requested >= 0 && requested <= kAvx512Vnni, "small_rows_linear: unknown path ", requested);
  const Path path = static_cast<Path>(requested);
  TORCH_CHECK(reads(path, form), "small_rows_linear: the ", kPathNames[path], " path does not read ",
              kFormNames[form], " weights");
  TORCH_CHECK(cpu_has(path), "small_rows_linear: this CPU cannot run the ", kPathNames[path], " path");
  return path;
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_rows_linear: x (M, K) and weight (N, K) expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous() && weight.device().is_cpu() && x.device().is_cpu(),
              "small_rows_linear: a contiguous CPU weight and a CPU x expected");
}

at::Tensor finish(at::Tensor y, const std::optional<at::Tensor>& bias, const at::Tensor& x) {
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y.to(x.scalar_type());
}

at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             int64_t requested) {
  check_inputs(x, weight);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "small_rows_linear: bf16 weight expected");
  const Path path = chosen(requested, kBf16Weights);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* wp = weight.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  if (path == kAvx512Bf16 || path == kAmx) {
#ifdef HF_X86
    const at::Tensor xb = x.to(at::kBFloat16).contiguous();
    if (path == kAmx) {
      run_amx(xb.data_ptr<at::BFloat16>(), wp, yp, M, K, N);
    } else {
      run_rows<kAvx512Bf16>(xb.data_ptr<at::BFloat16>(), wp, nullptr, yp, M, K, N);
    }
#endif
  } else {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const float* xp = xf.data_ptr<float>();
    if (path == kScalar) run_rows<kScalar>(xp, wp, nullptr, yp, M, K, N);
#ifdef HF_X86
    if (path == kAvx2) run_rows<kAvx2>(xp, wp, nullptr, yp, M, K, N);
    if (path == kAvx512) run_rows<kAvx512>(xp, wp, nullptr, yp, M, K, N);
#endif
  }
  return finish(y, bias, x);
}

at::Tensor small_rows_linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                                  const std::optional<at::Tensor>& bias, int64_t requested,
                                  const std::optional<at::Tensor>& row_sums) {
  check_inputs(x, weight);
  TORCH_CHECK(weight.scalar_type() == at::kChar, "small_rows_linear_int8: int8 weight expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == weight.size(0),
              "small_rows_linear_int8: one fp32 scale per weight row expected");
  const Path path = chosen(requested, kInt8Weights);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
#ifdef HF_X86
  if (path == kAvx512Vnni) {
    // the weight rows' sums (the layer keeps them; computed here otherwise, at the cost of reading the weight twice)
    const at::Tensor sums = row_sums.has_value() && row_sums->defined()
                                ? row_sums->to(at::kInt).contiguous()
                                : weight.sum(1, /*keepdim=*/false, at::kInt).contiguous();
    TORCH_CHECK(sums.numel() == N, "small_rows_linear_int8: one row sum per weight row expected");
    const bool has_bias = bias.has_value() && bias->defined();
    const auto kind = x.scalar_type();
    const bool direct = (kind == at::kBFloat16 || kind == at::kFloat) &&
                        (!has_bias || (bias->scalar_type() == kind && bias->is_contiguous()));
    const at::Tensor xc = direct ? x.contiguous() : x.to(at::kFloat).contiguous();
    const at::Tensor bc = has_bias ? (direct ? *bias : bias->to(at::kFloat).contiguous()) : at::Tensor();
    at::Tensor y = at::empty({M, N}, xc.options());
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "small_rows_linear_int8", [&] {
      run_vnni<scalar_t>(xc.data_ptr<scalar_t>(), weight.data_ptr<int8_t>(), scale.data_ptr<float>(),
                         sums.data_ptr<int32_t>(), has_bias ? bc.data_ptr<scalar_t>() : nullptr,
                         y.data_ptr<scalar_t>(), M, K, N);
    });
    return direct ? y : y.to(x.scalar_type());
  }
#endif
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const auto* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (path == kScalar) run_rows<kScalar>(xp, wp, sp, yp, M, K, N);
#ifdef HF_X86
  if (path == kAvx2) run_rows<kAvx2>(xp, wp, sp, yp, M, K, N);
  if (path == kAvx512) run_rows<kAvx512>(xp, wp, sp, yp, M, K, N);
#endif
  return finish(y, bias, x);
}

at::Tensor small_rows_linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                  int64_t group, const std::optional<at::Tensor>& bias, int64_t requested,
                                  const std::optional<at::Tensor>& corrections) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  x.size(1) == 2 * packed.size(1) && x.device().is_cpu() && packed.device().is_cpu(),
              "small_rows_linear_int4: x (M, K) and packed int4 weights (N, K / 2) uint8 on the CPU expected");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(group > 0 && group % 64 == 0 && K % group == 0, "small_rows_linear_int4: the group (", group,
              ") must be a multiple of 64 dividing K (", K, ")");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N * (K / group),
              "small_rows_linear_int4: one fp32 scale per weight row and group expected");
  // avx512_vnni reads groups of 128 k's; other group sizes take the next path
  const Path path = requested < 0 && group != 128 && chosen(-1, kInt4Weights) == kAvx512Vnni
                        ? (cpu_has(kAvx512Bf16) ? kAvx512Bf16 : kScalar)
                        : chosen(requested, kInt4Weights);
  TORCH_CHECK(path != kAvx512Vnni || group == 128, "small_rows_linear_int4: the avx512_vnni path reads groups of 128");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (path == kAvx512Bf16) {
#ifdef HF_X86
    const at::Tensor xb = x.to(at::kBFloat16).contiguous();
    run_rows_int4<kAvx512Bf16>(xb.data_ptr<at::BFloat16>(), wp, sp, yp, M, K, N, group);
#endif
  } else if (path == kAvx512Vnni) {
#ifdef HF_X86
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    std::vector<float> computed;
    const float* cp = nullptr;
    if (corrections.has_value() && corrections->defined()) {
      TORCH_CHECK(corrections->scalar_type() == at::kFloat && corrections->numel() == N &&
                      corrections->is_contiguous(), "small_rows_linear_int4: one fp32 correction per weight row");
      cp = corrections->data_ptr<float>();
    } else {
      computed = int4_corrections(wp, sp, K, N);
      cp = computed.data();
    }
    run_int4_vnni(xf.data_ptr<float>(), wp, sp, cp, yp, M, K, N);
#endif
  } else {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    run_rows_int4<kScalar>(xf.data_ptr<float>(), wp, sp, yp, M, K, N, group);
  }
  return finish(y, bias, x);
}

// The paths this CPU runs (and $HF_SPECSAMPLE_KERNEL_PATHS allows), best first (their names: `path_name`).
std::vector<int64_t> paths() {
  std::vector<int64_t> out;
  for (Path path : kFastestFirst)
    if (cpu_has(path)) out.push_back(path);
  return out;
}

std::string path_name(int64_t path) {
  TORCH_CHECK(path >= kScalar && path <= kAvx512Vnni, "small_rows_linear: unknown path ", path);
  return kPathNames[path];
}

}  // namespace

TORCH_LIBRARY(hf_specsample, m) {
  m.def("small_rows_linear(Tensor x, Tensor weight, Tensor? bias, int path=-1) -> Tensor");
  m.def("small_rows_linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias, int path=-1, "
        "Tensor? row_sums=None) -> Tensor");
  m.def("small_rows_linear_int4(Tensor x, Tensor packed, Tensor scale, int group, Tensor? bias, int path=-1, "
        "Tensor? corrections=None) -> Tensor");
  // the corrections the avx512_vnni int4 path needs, to keep with the weight (`Int4Linear`)
  m.def("int4_corrections(Tensor packed, Tensor scale) -> Tensor", [](const at::Tensor& packed, const at::Tensor& scale) {
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && scale.scalar_type() == at::kFloat &&
                    scale.is_contiguous() && scale.numel() == packed.size(0) * (packed.size(1) * 2 / 128),
                "int4_corrections: packed (N, K / 2) uint8 and scales (N, K / 128) fp32 expected");
    const int64_t N = packed.size(0), K = packed.size(1) * 2;
    std::vector<float> values = int4_corrections(packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), K, N);
    return at::tensor(values, at::kFloat);
  });
  m.def("paths() -> int[]", &paths);          // the paths this CPU runs, best first
  m.def("path_name(int path) -> str", &path_name);
  // the path the kernel runs by default for a weight form (0 bf16, 1 int8, 2 int4) on a CPU offering these paths
  m.def("fastest_path(int[] offered, int form) -> int", [](at::IntArrayRef offered, int64_t form) -> int64_t {
    TORCH_CHECK(form >= kBf16Weights && form <= kInt4Weights, "fastest_path: unknown weight form ", form);
    return fastest(offered, static_cast<Form>(form));
  });
}

TORCH_LIBRARY_IMPL(hf_specsample, CPU, m) {
  m.impl("small_rows_linear", &small_rows_linear);
  m.impl("small_rows_linear_int8", &small_rows_linear_int8);
  m.impl("small_rows_linear_int4", &small_rows_linear_int4);
}
