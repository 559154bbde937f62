// A LayerNorm or RMSNorm (a norm over the whole row, wider than any tile) in the in-GEMM back end:
// fxg::RowMoments takes the statistics of the norm's input per (row, subtile of EpiN columns) in
// the GEMM's epilogue, from the float32 accumulators, and stores the input; fxg::normalize_rows
// merges a row's subtiles into the row's statistics and runs the norm, its weight and bias and the
// rest of the chain on the stored values, in place. The GEMM output is written once and read once,
// and no pass computes statistics from it (the row path's kernel reads cuBLAS's output for its
// statistics and normalizes it). See gemm_stages.cuh for the tree RowMoments is part of.
//
// A LayerNorm's subtile keeps its mean and M2 and stores each value as its standardized deviation
// in the subtile, in float16 where the output is 16-bit: gemm_batch_norm.cuh's reason, per row (a
// bfloat16 D of x holds x to 2^-9 of |x|, which normalizing turns into 2^-9 of |x| / std, far past
// the output's rounding where the row's mean is large against its spread; a deviation in
// [-sqrt(EpiN), sqrt(EpiN)] holds 2^-11 of itself). An RMSNorm subtracts nothing: its subtile
// keeps the sum of squares and stores the value itself, in the output's type, so that an infinite
// value gives eager's result (its row's sum is infinite, rsqrt of it 0: zeros, NaN at the
// infinity), where deviations would make the whole row NaN.
#pragma once

#include "column_moments.cuh"
#include "gemm_batch_norm.cuh"
#include "gemm_stages.cuh"

namespace fxg {

// The subtiles of a row of n columns, and the partials' floats: [2][M][subtiles] (the subtiles'
// means, then their M2) for a LayerNorm, [M][subtiles] (sums of squares) for an RMSNorm
template <int EpiN> CUTLASS_HOST_DEVICE int64_t row_subtiles(int64_t n) { return (n + EpiN - 1) / EpiN; }
template <int EpiN, bool Rms> CUTLASS_HOST_DEVICE int64_t row_norm_floats(int64_t m, int64_t n) {
  return (Rms ? 1 : 2) * m * row_subtiles<EpiN>(n);
}

// The type D is stored in: a LayerNorm's standardized deviations (DeviationOf), an RMSNorm's values
template <class Out, bool Rms> using RowStoredOf = cute::conditional_t<Rms, Out, DeviationOf<Out>>;

struct RowMomentsArguments {
  float* partials = nullptr;
  int64_t m = 0;
  int64_t n = 0;
};

// Per (row, EpiN-column subtile): the statistics of the values its child computed (float32), for
// fxg::normalize_rows; the values go on to the store (see above). By the WGMMA accumulator layout
// (fxg::SubtileCallbacks) a thread holds two rows 8 apart of the subtile, and its quad the rest of
// those rows' columns: a row's sums are its quad's, in two shuffles each (a + b == b + a, so every
// lane of the quad gets the same bits). Columns past N count for nothing; rows past M are not
// written.
template <int EpiN, bool Rms>
struct RowMoments : RegisterNode<RowMomentsArguments> {
  static constexpr int kBlocks = EpiN / 8;
  using RegisterNode::RegisterNode;  // (a base of no template parameter: its names need no using)

  template <class Coords>
  struct ConsumerStoreCallbacks : SubtileCallbacks<Coords, EpiN, Params> {
    using SubtileCallbacks<Coords, EpiN, Params>::SubtileCallbacks;

    CUTLASS_DEVICE static float quad_sum(float v) {
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      return v + __shfl_xor_sync(0xffffffffu, v, 2);
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      float value[2][kBlocks][2];  // (row slot, block, column of the pair)
      this->unpack(visit_results, value);
      const int64_t n = this->params.n, m = this->params.m;
      const int64_t col = this->first_col + static_cast<int64_t>(epi_n) * EpiN;  // the thread's first, this subtile
      const int64_t first = col - this->col_in_tile % EpiN;                      // the subtile's first column
      const int64_t valid = n - first < EpiN ? (n > first ? n - first : 0) : EpiN;
      const float count = static_cast<float>(valid);
      const int64_t subtiles = row_subtiles<EpiN>(n), subtile = first / EpiN;
      const bool writes = (threadIdx.x & 3) == 0 && valid > 0;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t row = this->first_row + static_cast<int64_t>(epi_m) * this->epi_rows + 8 * r;
        if constexpr (Rms) {
          float squares = 0.f;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) squares += col + 8 * j + e < n ? value[r][j][e] * value[r][j][e] : 0.f;
          }
          squares = quad_sum(squares);
          if (writes && row < m) this->params.partials[row * subtiles + subtile] = squares;
        } else {
          float sum = 0.f;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) sum += col + 8 * j + e < n ? value[r][j][e] : 0.f;
          }
          sum = quad_sum(sum);
          const float mean = valid > 0 ? sum / count : 0.f;
          float m2 = 0.f;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) {
              const float d = value[r][j][e] - mean;
              m2 += col + 8 * j + e < n ? d * d : 0.f;
            }
          }
          m2 = quad_sum(m2);
          const float s = standardizer(m2, count);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) value[r][j][e] = (value[r][j][e] - mean) * s;
          }
          if (writes && row < m) {
            this->params.partials[row * subtiles + subtile] = mean;
            this->params.partials[(m + row) * subtiles + subtile] = m2;
          }
        }
      }
      if constexpr (!Rms) this->pack(value, visit_results);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args, params);
  }
};

// normalize_rows' block: a row, 16 bytes of Out a thread at a time, kRowNormLoads loads in flight
constexpr int kRowNormThreads = 256;
constexpr int kRowNormLoads = 4;

// Row blockIdx.x of out (M x N, row-major, holding the GEMM's D) in place. The row's statistics
// first: thread t merges the partials of subtiles t, t + 256, ... in order, then the threads'
// merge in a fixed tree (deterministic); a LayerNorm's subtile s then gets the scale and shift that
// take its stored deviations to the normalized value, rstd / standardizer_s and (mean_s - mean) *
// rstd (shared memory: 2 floats a subtile); an RMSNorm's values are multiplied by rstd. Then the
// norm's weight and bias (Affine) and the stages after it (After), as Out. N is a multiple of 16
// bytes of Out (the GEMM's TMA store needs that too).
template <class Affine, class After, class Out, bool Rms, int EpiN>
__global__ void __launch_bounds__(kRowNormThreads)
    normalize_rows(Out* out, const float* partials, int64_t m, int64_t n, float eps, typename After::Arguments args) {
  using D = RowStoredOf<Out, Rms>;
  static_assert(sizeof(D) == sizeof(Out), "D is stored where the output goes");
  constexpr int kVec = 16 / static_cast<int>(sizeof(Out));
  static_assert(EpiN % kVec == 0, "a 16-byte access lies in one subtile");
  extern __shared__ float scale_shift[];  // a LayerNorm's: [2][subtiles]
  __shared__ fx::Moments parts[Rms ? 1 : kRowNormThreads];
  __shared__ float sums[Rms ? kRowNormThreads : 1];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x, subtiles = row_subtiles<EpiN>(n);
  const float* row_parts = partials + row * subtiles;
  float rstd;
  if constexpr (Rms) {
    float squares = 0.f;
    for (int64_t s = tid; s < subtiles; s += kRowNormThreads) squares += __ldg(row_parts + s);
    sums[tid] = squares;
    __syncthreads();
    for (int stride = kRowNormThreads / 2; stride > 0; stride /= 2) {
      if (tid < stride) sums[tid] += sums[tid + stride];
      __syncthreads();
    }
    rstd = rsqrtf(sums[0] / static_cast<float>(n) + eps);
  } else {
    const float* row_m2 = partials + (m + row) * subtiles;
    fx::Moments acc{0, 0.f, 0.f};
    for (int64_t s = tid; s < subtiles; s += kRowNormThreads) {
      const int64_t valid = n - s * EpiN < EpiN ? n - s * EpiN : EpiN;
      fx::merge(acc, valid, __ldg(row_parts + s), __ldg(row_m2 + s));
    }
    parts[tid] = acc;
    __syncthreads();
    for (int stride = kRowNormThreads / 2; stride > 0; stride /= 2) {
      if (tid < stride) {
        const fx::Moments other = parts[tid + stride];
        fx::merge(parts[tid], other.n, other.mean, other.m2);
      }
      __syncthreads();
    }
    const float mean = parts[0].mean;
    rstd = rsqrtf(parts[0].m2 / static_cast<float>(n) + eps);
    for (int64_t s = tid; s < subtiles; s += kRowNormThreads) {
      const int64_t valid = n - s * EpiN < EpiN ? n - s * EpiN : EpiN;
      const float standardizer_s = standardizer(__ldg(row_m2 + s), static_cast<float>(valid));
      scale_shift[s] = standardizer_s > 0.f ? rstd / standardizer_s : 0.f;
      scale_shift[subtiles + s] = (__ldg(row_parts + s) - mean) * rstd;
    }
    __syncthreads();
  }
  const auto scalars = After::scalars(args);
  Out* line = out + row * n;
  constexpr int64_t kStride = static_cast<int64_t>(kRowNormThreads) * kVec;
  for (int64_t base = static_cast<int64_t>(tid) * kVec; base < n; base += kStride * kRowNormLoads) {
    uint4 chunk[kRowNormLoads];  // the loads in flight before the math
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRowNormLoads; ++i) {
      if (base + i * kStride < n) chunk[i] = *reinterpret_cast<const uint4*>(line + base + i * kStride);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRowNormLoads; ++i) {
      const int64_t col = base + i * kStride;
      if (col >= n) continue;
      float a = rstd, b = 0.f;
      if constexpr (!Rms) {
        a = scale_shift[col / EpiN];
        b = scale_shift[subtiles + col / EpiN];
      }
      const D* stored = reinterpret_cast<const D*>(&chunk[i]);
      Out* values = reinterpret_cast<Out*>(&chunk[i]);
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < kVec; ++v) {
        const float x = static_cast<float>(stored[v]) * a + b;
        const float y = x * Affine::weight(args, col + v) + Affine::bias(args, col + v);
        values[v] = static_cast<Out>(After::apply(args, scalars, col + v, y));
      }
      *reinterpret_cast<uint4*>(line + col) = chunk[i];
    }
  }
}

// The launch after the GEMM: a block a row. Affine, After (generated): the norm's weight and
// bias, and the stages after the norm; their Arguments are one.
template <class Affine, class After, class Out, bool Rms, int EpiN>
inline void launch_row_norm(const float* partials, Out* out, int64_t m, int64_t n, float eps,
                            typename After::Arguments args, cudaStream_t stream) {
  const size_t smem = Rms ? 0 : 2 * static_cast<size_t>(row_subtiles<EpiN>(n)) * sizeof(float);
  normalize_rows<Affine, After, Out, Rms, EpiN>
      <<<static_cast<unsigned>(m), kRowNormThreads, smem, stream>>>(out, partials, m, n, eps, args);
}

// The largest N normalize_rows takes: a LayerNorm's scales and shifts within 48 KiB of shared memory
constexpr int64_t kRowNormMaxN = int64_t{1} << 18;

}  // namespace fxg
