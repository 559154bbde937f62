// The kernel bodies, shared by the CUDA kernels and the host emulator: walking a block's rows,
// the apply pass, the statistics pass and the BatchNorm column moments and their combine.
#pragma once

#include "row_core.cuh"

namespace fx {

// ---------------------------------------------------------------------------------------------
// Kernel bodies (shared by the CUDA kernels and the emulator)

// Walks the rows (row segments) of this block; `f(row)` sees every slot, active or not.
template <class Prog, typename T, int ITEMS, bool ALIGNED, class F>
FX_DEVICE void for_each_row(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red, F f) {
  using R = Row<Prog, T, ITEMS, ALIGNED>;
  const int lt = t.tid() % a.rt;
  const int lr = t.tid() / a.rt;
  float* scratch = dyn + static_cast<int64_t>(lr) * a.scratch_stride;
  const int64_t units = a.m * a.segs;
  const int64_t stride = static_cast<int64_t>(t.gdim()) * a.rpc;
  for (int64_t base = static_cast<int64_t>(t.bid()) * a.rpc; base < units; base += stride) {
    R r(a, t, red, scratch, lt, lr, base + lr);
    r.load();
    f(r);
  }
}

template <class Prog, typename T, int ITEMS, bool ALIGNED>
FX_DEVICE void apply_body(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red) {
  for_each_row<Prog, T, ITEMS, ALIGNED>(a, t, dyn, red, [](Row<Prog, T, ITEMS, ALIGNED>& r) {
    Prog::prefix(r);
    Prog::rest(r);
  });
}

// Column moments of a set of rows: count, mean, sum of squared deviations.
struct Moments {
  int64_t n;
  float mean;
  float m2;
};

// acc += (nb, mb, m2b) (Chan et al.); order-dependent, so callers merge in a fixed order
FX_DEVICE void merge(Moments& acc, int64_t nb, float mb, float m2b) {
  if (nb == 0) return;
  if (acc.n == 0) {
    acc = Moments{nb, mb, m2b};
    return;
  }
  const int64_t total = acc.n + nb;
  const float wb = static_cast<float>(nb) / static_cast<float>(total);
  const float d = mb - acc.mean;
  acc.mean += d * wb;
  acc.m2 += m2b + d * d * (static_cast<float>(acc.n) * wb);
  acc.n = total;
}

// Column moments (Welford) of the values entering the BatchNorm stage (rounded to T like the
// normalisation's input; for float32 exactly the reference's), per strip of rows. Strip q (of
// a.chunks) holds rows q, q + chunks, q + 2 chunks, ...; the grid is segs x chunks blocks, block
// (q, s) walking segment s of strip q's rows with its rpc lanes in turn (lane l: the strip's l-th,
// (l + rpc)-th, ... row), then merging its lanes' moments in lane order. A row-local program's
// segments are a warp wide (Launcher::stats_plan): a short, wide output (1024 x 8192) still
// spreads over the whole device, and the partials stay a few rows of the output, not its size.
// Shared memory: rpc * scratch_stride floats during the walk, 2 * rpc * rt * ITEMS * VEC after.
template <class Prog, typename T, int ITEMS, bool ALIGNED>
FX_DEVICE void stats_body(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red) {
  using R = Row<Prog, T, ITEMS, ALIGNED>;
  constexpr int VEC = chunk_elements<Prog, T>();
  const int lt = t.tid() % a.rt;
  const int lr = t.tid() / a.rt;
  const int64_t seg = t.bid() % a.segs;
  const int64_t strip = t.bid() / a.segs;
  const int64_t rows = strip < a.m ? (a.m - 1 - strip) / a.chunks + 1 : 0;  // the strip's
  const int64_t steps = (rows + a.rpc - 1) / a.rpc;  // block-uniform: every lane reaches every barrier
  if (steps == 0) return;
  // lane lr's k-th row as a unit of the walk (past the strip's rows: row m, inactive)
  const auto unit = [&](int64_t k) {
    const int64_t j = lr + k * a.rpc;
    return (j < rows ? strip + j * a.chunks : a.m) * a.segs + seg;
  };
  float* scratch = dyn + static_cast<int64_t>(lr) * a.scratch_stride;
  float mean[ITEMS][VEC];
  float m2[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) mean[i][e] = m2[i][e] = 0.0f;
  int64_t count = 0;
  const auto add = [&](R& r) {
    Prog::prefix(r);  // ends with the BatchNorm's input, as batch_norm_train() sees it
    if (!r.active) return;
    ++count;
    const float inv = 1.0f / static_cast<float>(count);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float x = r.v[i][e];
        const float d = x - mean[i][e];
        mean[i][e] += d * inv;
        m2[i][e] += d * (x - mean[i][e]);
      }
  };
  if constexpr (ITEMS * VEC <= 16) {  // the next row in registers meanwhile: only for short ones
    R r(a, t, red, scratch, lt, lr, unit(0));
    r.load();
    for (int64_t k = 0; k < steps; ++k) {
      R next(a, t, red, scratch, lt, lr, unit(k + 1));
      next.load();
      add(r);
      r.take(next);
    }
  } else {
    for (int64_t k = 0; k < steps; ++k) {
      R r(a, t, red, scratch, lt, lr, unit(k));
      r.load();
      add(r);
    }
  }
  const int width = a.rt * ITEMS * VEC;  // a segment's columns
  if (a.rpc > 1) {  // the lanes' moments through shared memory to lane 0, merged in lane order
    t.sync();  // the walk's scratch is free
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int j = (i * a.rt + lt) * VEC + e;
        dyn[(2 * lr) * width + j] = mean[i][e];
        dyn[(2 * lr + 1) * width + j] = m2[i][e];
      }
    t.sync();
    if (lr != 0) return;
  }
  const int64_t first = seg * width;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int j = (i * a.rt + lt) * VEC + e;
      Moments acc{count, mean[i][e], m2[i][e]};
      for (int l = 1; l < a.rpc; ++l) {
        merge(acc, rows > l ? (rows - 1 - l) / a.rpc + 1 : 0, dyn[(2 * l) * width + j], dyn[(2 * l + 1) * width + j]);
      }
      const int64_t c = first + j;
      if (c < a.n) {
        a.part_mean[strip * a.n + c] = acc.mean;
        a.part_m2[strip * a.n + c] = acc.m2;
      }
    }
}

constexpr int kCombineColumns = 32;  // a block: 32 columns x (block / 32) ranges of chunks
constexpr int kCombineBlock = 512;

// Per column: merge the chunks' moments in order, in kCombineBlock / 32 fixed consecutive ranges
// then the ranges in order; write the (2, n) stats output [mean, unbiased var] and the mean and
// 1 / sqrt(var + eps) the row kernel normalises with. Shared memory: kCombineBlock Moments.
template <class Prog>
FX_DEVICE void combine_body(const Args<Prog::kParamSlots>& a, const Thread& t, Moments* parts) {
  const int lane = t.tid() % kCombineColumns;
  const int part = t.tid() / kCombineColumns;
  const int nparts = t.bdim() / kCombineColumns;
  const int64_t c = static_cast<int64_t>(t.bid()) * kCombineColumns + lane;
  const int64_t used = a.chunks < a.m ? a.chunks : a.m;  // chunks that hold rows
  const int64_t per = (used + nparts - 1) / nparts;
  const int64_t k0 = part * per;
  const int64_t k1 = k0 + per < used ? k0 + per : used;
  Moments acc{0, 0.0f, 0.0f};
  if (c < a.n) {
    constexpr int kDepth = 4;  // loads in flight a thread: the merges wait on memory otherwise
    for (int64_t k = k0; k < k1; k += kDepth) {
      float mb[kDepth], m2b[kDepth];
#pragma unroll
      for (int j = 0; j < kDepth; ++j) {
        mb[j] = k + j < k1 ? a.part_mean[(k + j) * a.n + c] : 0.0f;
        m2b[j] = k + j < k1 ? a.part_m2[(k + j) * a.n + c] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kDepth; ++j)
        if (k + j < k1) merge(acc, (a.m - 1 - (k + j)) / a.chunks + 1, mb[j], m2b[j]);
    }
  }
  parts[t.tid()] = acc;
  t.sync();
  if (part != 0 || c >= a.n) return;
  Moments total{0, 0.0f, 0.0f};
  for (int p = 0; p < nparts; ++p) {
    const Moments& q = parts[p * kCombineColumns + lane];
    merge(total, q.n, q.mean, q.m2);
  }
  const float m = static_cast<float>(a.m);
  a.stats[c] = total.mean;
  a.stats[a.n + c] = total.m2 / (m - 1.0f);
  a.bn_mean[c] = total.mean;
  a.bn_rstd[c] = 1.0f / sqrtf(total.m2 / m + Prog::kBatchEps);
}

}  // namespace fx
