// fxg::GroupNorm: GroupNorm of groups inside the epilogue subtile, statistics in registers, in the
// in-GEMM epilogue (see gemm_stages.cuh for the tree it is part of).
#pragma once

#include "gemm_stages.cuh"

namespace fxg {

template <class Post>
struct GroupNormArguments {
  int32_t group = 0;  // columns of a group: a multiple of 8 dividing EpiN (N / groups)
  float eps = 0.f;
  typename Post::Arguments post{};
};

// Whether groups of `group` columns, of N = n, lie whole inside spans of `span` accumulators (a
// subtile's columns, a swapped tile's rows) of 8-column blocks
CUTLASS_HOST_DEVICE constexpr bool groups_fit(int group, int span, int64_t n) {
  return group >= 8 && group % 8 == 0 && span % group == 0 && n % group == 0;
}

// GroupNorm of groups that lie inside the epilogue subtile (EpiN columns), on the float32 values
// of the stages before it, then the rest of the chain (Post): per (row, group) mean and variance in
// registers, two passes (mean, then squared deviations), one store.
//
// It runs in the epilogue's reduce step, which sees the whole subtile's visited values. The
// statistics rely on the SM90 WGMMA accumulator layout (PTX ISA, wgmma fragments): a thread holds
// two rows 8 apart and, in each 8-column block of the subtile, two adjacent columns; the four
// lanes of a quad hold the rest of those blocks. So a group of a multiple of 8 columns is summed
// per thread over its blocks, then over the quad (two shuffles). The layout is checked where it is
// read: relative coordinates outside it stop the kernel (the checks fold away when it holds).
//
// Post (generated): Arguments (the parameters' pointers), Scalars scalars(Arguments const&) (the
// scalar parameters, read once a subtile) and float apply(Arguments const&, Scalars const&,
// int64_t n, float x) -- the normalized value x at column n through the norm's affine parameters
// and the stages after it.
template <class Post, int EpiN>
struct GroupNorm : RegisterNode<GroupNormArguments<Post>> {
  static_assert(EpiN % 8 == 0, "the subtile is a whole number of 8-column blocks");
  static constexpr int kBlocks = EpiN / 8;
  using Base = RegisterNode<GroupNormArguments<Post>>;
  using typename Base::Arguments;
  using typename Base::Params;
  using Base::Base;
  using Base::params;

  template <class Problem>
  static bool can_implement(Problem const& problem, Arguments const& args) {
    return groups_fit(args.group, EpiN, get<1>(problem));
  }

  template <class Coords>
  struct ConsumerStoreCallbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Coords coords, int64_t first_col, int64_t n, int col_in_tile,
                                          Params const& params)
        : coords(coords), first_col(first_col), n(n), col_in_tile(col_in_tile), params(params) {}

    Coords coords;    // (R2S, R2S_M, R2S_N, EPI_M, EPI_N) -> (m, n) relative to the thread's first value
    int64_t first_col;  // the column of the thread's first value
    int64_t n;          // N
    int col_in_tile;    // the thread's first column within the CTA tile
    Params params;      // a copy: pointers and sizes in registers, not read through memory per value

    // The column whose parameters a value at `col` reads: its own, or past N (not stored) the
    // last column's, so that the loads need no branch and the unrolled loops issue them together
    CUTLASS_DEVICE int64_t parameter_col(int64_t col) const { return col < n ? col : n - 1; }

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&, int, int, int,
                                         cutlass::Array<ElementInput, F> const& input) {
      return cutlass::NumericArrayConverter<float, ElementInput, F>{}(input);
    }

    // Per (row slot, block): the sum over the group holding the block, of the thread's values
    // (a butterfly over the blocks of a group: groups are 1, 2, 4 or 8 blocks), then its quad's:
    // one pair of shuffles a (row slot, group), whose blocks then hold the same bits (a + b ==
    // b + a), not a pair a block (shuffles issue one warp a clock on an SM, and a subtile's two
    // passes took 64 of them a warp, where groups of 64 columns need 8). The groups' width is
    // a launch's (N / groups): each width is its own unrolled code, chosen by a uniform branch.
    template <int BlocksPerGroup = 1>
    CUTLASS_DEVICE static void group_sums(float (&sums)[2][kBlocks], int blocks_per_group) {
      if constexpr (BlocksPerGroup < kBlocks) {
        if (blocks_per_group > BlocksPerGroup) {
          group_sums<2 * BlocksPerGroup>(sums, blocks_per_group);
          return;
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int step = 1; step < BlocksPerGroup; step *= 2) {
        float partner[2][kBlocks];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) partner[r][j] = sums[r][j ^ step];
        }
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) sums[r][j] += partner[r][j];
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < kBlocks; g += BlocksPerGroup) {
          float s = sums[r][g];
          s += __shfl_xor_sync(0xffffffffu, s, 1);
          s += __shfl_xor_sync(0xffffffffu, s, 2);
          CUTLASS_PRAGMA_UNROLL
          for (int j = g; j < g + BlocksPerGroup; ++j) sums[r][j] = s;
        }
      }
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int epi_n, bool, VTensor visit_results) {
      using Fragment = typename cute::remove_cvref_t<VTensor>::value_type;
      constexpr int F = Fragment::kElements;
      constexpr int V = decltype(size(visit_results))::value;
      auto relative = coords(_, _, _, _0{}, _0{});  // the same in every subtile
      if (col_in_tile % EpiN >= 8 || col_in_tile % 8 > 6) __trap();  // the layout above
      const int blocks_per_group = params.group / 8;
      const float inv_group = 1.f / static_cast<float>(params.group);
      const int64_t subtile_col = first_col + static_cast<int64_t>(epi_n) * EpiN;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kBlocks; ++j) {  // Post's columns, on their way while the statistics run
        const int64_t col = subtile_col + 8 * j;
        Post::prefetch(params.post, parameter_col(col));
      }

      float mean[2][kBlocks], rstd[2][kBlocks];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) mean[r][j] = rstd[r][j] = 0.f;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < V; ++v) {
        CUTLASS_PRAGMA_UNROLL
        for (int f = 0; f < F; ++f) {
          auto c = relative(v * F + f);
          const int r = get<0>(c) / 8, j = get<1>(c) / 8;
          if (r < 0 || r > 1 || j < 0 || j >= kBlocks) __trap();
          mean[r][j] += visit_results(v)[f];
        }
      }
      group_sums(mean, blocks_per_group);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) mean[r][j] *= inv_group;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < V; ++v) {
        CUTLASS_PRAGMA_UNROLL
        for (int f = 0; f < F; ++f) {
          auto c = relative(v * F + f);
          const int r = get<0>(c) / 8, j = get<1>(c) / 8;
          const float d = visit_results(v)[f] - mean[r][j];
          rstd[r][j] += d * d;
        }
      }
      group_sums(rstd, blocks_per_group);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) rstd[r][j] = rsqrtf(rstd[r][j] * inv_group + params.eps);
      }
      const auto scalars = Post::scalars(params.post);
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < V; ++v) {
        CUTLASS_PRAGMA_UNROLL
        for (int f = 0; f < F; ++f) {
          auto c = relative(v * F + f);
          const int r = get<0>(c) / 8, j = get<1>(c) / 8;
          const int64_t col = subtile_col + get<1>(c);
          const float x = (visit_results(v)[f] - mean[r][j]) * rstd[r][j];
          visit_results(v)[f] = Post::apply(params.post, scalars, parameter_col(col), x);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    static_assert(decltype(size<1>(args.epi_tile))::value == EpiN, "the subtile the norm was built for");
    const int64_t n = get<1>(args.problem_shape_mnkl);
    const int64_t first_col = n - get<1>(args.residue_tCcD);
    const int col_in_tile = static_cast<int>(get<1>(args.residue_cD) - get<1>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args.tCcD, first_col, n, col_in_tile, params);
  }
};

// GroupNorm in a swapped GEMM (fxg::Swapped, for few rows: the output's columns run along the
// tile's 64 rows, its rows along the TileN columns): a group of 8-64 output columns is 8-64
// consecutive rows of the tile at each of its columns. By the WGMMA layout a warp holds 16 rows of
// the tile, a thread two rows 8 apart (its slots) and two adjacent columns of each 8-column block,
// and the 8 lanes of one lane % 4 hold the warp's other rows of those columns. So a group's sum is
// the thread's values (one slot for groups of 8, both for more) summed over those 8 lanes (three
// shuffles), then for groups of 32 and 64 over 2 and 4 warps through shared memory: the epilogue's
// D staging buffer, free until the subtile is copied into it (CUTLASS's reduce step hands it to
// the nodes for this). Two passes (mean, then squared deviations), then Post, one store: the
// arithmetic of GroupNorm above in another order of summation.
template <class Post, int TileN>
struct SwappedGroupNorm : RegisterNode<GroupNormArguments<Post>> {
  static constexpr int kTileM = 64;  // one consumer warp group's rows: 4 warps of 16
  static constexpr int kBlocks = TileN / 8;
  using Base = RegisterNode<GroupNormArguments<Post>>;
  using typename Base::Arguments;
  using typename Base::Params;
  using Base::Base;
  using Base::params;

  template <class Problem>
  static bool can_implement(Problem const& problem, Arguments const& args) {
    return groups_fit(args.group, kTileM, get<0>(problem));  // N, the output's columns: the swapped GEMM's M
  }

  template <class Coords>
  struct ConsumerStoreCallbacks : SubtileCallbacks<Coords, TileN, Params> {
    using Callbacks = SubtileCallbacks<Coords, TileN, Params>;
    template <class Args>
    CUTLASS_DEVICE ConsumerStoreCallbacks(Args const& args, Params const& params)
        : Callbacks(args, params), columns(get<0>(args.problem_shape_mnkl)) {}

    int64_t columns;  // the output's columns, N: the swapped GEMM's M
    using Value = float[2][kBlocks][2];  // [slot][block][column of the pair], as unpack gives them

    // Each value replaced by the sum over its group of the values at its column: `scratch` holds
    // a warp's 16-row sums ([warp][column]) where a group spans warps; `sync` orders its uses.
    template <class SyncFn>
    CUTLASS_DEVICE void group_sums(Value& s, int warp, int pair, float* scratch, SyncFn const& sync) const {
      const int group = this->params.group;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) {
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) {
            float v = s[r][j][e];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            s[r][j][e] = v;
          }
        }
      }
      if (group < 16) return;  // uniform over the warp group, as are the branches below
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kBlocks; ++j) {
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < 2; ++e) s[0][j][e] = s[1][j][e] = s[0][j][e] + s[1][j][e];
      }
      if (group < 32) return;
      if (threadIdx.x % 32 < 4) {  // the first row's lanes: the warp's sums of their columns
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) {
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) scratch[warp * TileN + 8 * j + 2 * pair + e] = s[0][j][e];
        }
      }
      sync();
      const int first = warp & ~(group / 16 - 1);  // the group's first warp
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kBlocks; ++j) {
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < 2; ++e) {
          float t = 0.f;
          CUTLASS_PRAGMA_UNROLL
          for (int w = 0; w < kTileM / 16; ++w) {
            if ((w & ~(group / 16 - 1)) == first) t += scratch[w * TileN + 8 * j + 2 * pair + e];
          }
          s[0][j][e] = s[1][j][e] = t;
        }
      }
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&& smem, SyncFn const& sync, int, int, bool, VTensor visit_results) {
      static_assert(sizeof(smem(_0{})) * decltype(size(smem))::value >= 2 * kTileM / 16 * TileN * sizeof(float),
                    "the D staging buffer holds both passes' warp sums");
      Value value, mean, rstd;
      this->unpack(visit_results, value);
      const int row_in_tile = static_cast<int>(this->first_row % kTileM);
      const int warp = row_in_tile / 16, pair = this->col_in_tile / 2;
      if (row_in_tile % 16 >= 8 || warp != static_cast<int>(threadIdx.x % 128) / 32) __trap();  // the layout above
      float* scratch = reinterpret_cast<float*>(raw_pointer_cast(smem.data()));
      const float inv_group = 1.f / static_cast<float>(this->params.group);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) {
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) mean[r][j][e] = value[r][j][e];
        }
      }
      group_sums(mean, warp, pair, scratch, sync);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) {
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) {
            mean[r][j][e] *= inv_group;
            const float d = value[r][j][e] - mean[r][j][e];
            rstd[r][j][e] = d * d;
          }
        }
      }
      group_sums(rstd, warp, pair, scratch + kTileM / 16 * TileN, sync);  // the second half: no wait
      const bool spans_warps = this->params.group >= 32;
      if (spans_warps) sync();  // every warp has read the buffer before the subtile is copied there
      const auto scalars = Post::scalars(this->params.post);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t col = this->first_row + 8 * r;  // the output's column
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) {
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) {
            const float x = (value[r][j][e] - mean[r][j][e]) * rsqrtf(rstd[r][j][e] * inv_group + this->params.eps);
            value[r][j][e] = Post::apply(this->params.post, scalars, col < columns ? col : columns - 1, x);
          }
        }
      }
      this->pack(value, visit_results);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    static_assert(decltype(size<0>(args.epi_tile))::value == kTileM, "the whole tile's rows in one subtile");
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args, params);
  }
};

// The group norm node of a tree over Frame: groups along the tile's N, or along its M where the
// GEMM is swapped
template <class Frame, class Post, int EpiN>
using GroupNormFor = cute::conditional_t<Frame::kSwapped,
                                         SwappedGroupNorm<Post, decltype(size<1>(typename Frame::Tile{}))::value>,
                                         GroupNorm<Post, EpiN>>;

}  // namespace fxg
