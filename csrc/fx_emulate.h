// Host emulation of a CUDA launch for the CPU tests (built only with FX_EMULATE).
//
// Every thread of a block is a fiber (ucontext) on one OS thread, run round-robin until it reaches a
// barrier. Block barriers (__syncthreads) and warp barriers (used to emulate __shfl_xor_sync) need
// every thread of their scope; a barrier that some threads never reach, a thread that finishes
// while others wait, or a shuffle partner outside the warp is reported as an error instead of
// hanging, so divergent synchronisation in the kernels fails the tests. Shared memory starts as
// NaN so a read before a write shows up in the results.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fx {
namespace emu {

constexpr size_t kStackBytes = 256 * 1024;

struct Barrier {
  int participants = 0;
  int count = 0;
  unsigned generation = 0;
};

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;  // uninitialised: pages are touched only as the fiber uses them
  enum State { kRunnable, kWaiting, kDone } state = kRunnable;
  int wait_barrier = -1;
  unsigned wait_generation = 0;
};

struct Block {
  int bid = 0, bdim = 0, gdim = 0;
  std::vector<Fiber> fibers;
  std::vector<Barrier> barriers;  // [0]: the block; [1 + w]: warp w
  std::vector<float> lanes;       // shuffle exchange, one slot a thread
  ucontext_t scheduler;
  int current = -1;
  const std::function<void(int)>* body = nullptr;
  std::string error;
};

inline Block*& current_block() {
  static thread_local Block* block = nullptr;
  return block;
}

inline void arrive(int barrier) {
  Block& b = *current_block();
  Barrier& bar = b.barriers[barrier];
  Fiber& f = b.fibers[b.current];
  const unsigned gen = bar.generation;
  if (++bar.count == bar.participants) {
    bar.count = 0;
    ++bar.generation;
  } else {
    f.state = Fiber::kWaiting;
    f.wait_barrier = barrier;
    f.wait_generation = gen;
  }
  swapcontext(&f.ctx, &b.scheduler);
}

inline void fiber_main() {
  Block& b = *current_block();
  const int tid = b.current;
  try {
    (*b.body)(tid);
  } catch (const std::exception& e) {
    if (b.error.empty()) b.error = e.what();
  }
  b.fibers[tid].state = Fiber::kDone;
  // returning resumes uc_link (the scheduler)
}

// Runs `body(tid)` for tid in [0, bdim) as the threads of one block.
inline void run_block(Block& b, const std::function<void(int)>& body) {
  if (b.bdim % 32 != 0) throw std::runtime_error("fx emulator: block size must be a multiple of 32");
  b.body = &body;
  b.error.clear();
  b.barriers.assign(1 + b.bdim / 32, Barrier{});
  b.barriers[0].participants = b.bdim;
  for (size_t w = 1; w < b.barriers.size(); ++w) b.barriers[w].participants = 32;
  b.lanes.assign(b.bdim, NAN);
  if ((int)b.fibers.size() != b.bdim) b.fibers = std::vector<Fiber>(b.bdim);
  for (int t = 0; t < b.bdim; ++t) {
    Fiber& f = b.fibers[t];
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
    f.state = Fiber::kRunnable;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &b.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
  }
  Block* saved = current_block();
  current_block() = &b;
  int done = 0;
  while (done < b.bdim) {
    bool progressed = false;
    done = 0;
    for (int t = 0; t < b.bdim; ++t) {
      Fiber& f = b.fibers[t];
      if (f.state == Fiber::kDone) { ++done; continue; }
      if (f.state == Fiber::kWaiting) {
        if (b.barriers[f.wait_barrier].generation == f.wait_generation) continue;
        f.state = Fiber::kRunnable;
      }
      b.current = t;
      swapcontext(&b.scheduler, &f.ctx);
      progressed = true;
      if (f.state == Fiber::kDone) ++done;
    }
    if (!progressed && done < b.bdim) {
      current_block() = saved;
      if (!b.error.empty()) throw std::runtime_error(b.error);
      throw std::runtime_error("fx emulator: deadlock in block " + std::to_string(b.bid) +
                               ": a barrier or shuffle is not reached by all threads of its scope");
    }
  }
  current_block() = saved;
  if (!b.error.empty()) throw std::runtime_error(b.error);
}

}  // namespace emu

// One emulated CUDA thread, as the kernel bodies see it.
struct Thread {
  int tid_, bid_, bdim_, gdim_;
  mutable int red_set = 0;  // the set of slots Row::allreduce takes next (it alternates)
  int tid() const { return tid_; }
  int bid() const { return bid_; }
  int bdim() const { return bdim_; }
  int gdim() const { return gdim_; }
  void sync() const { emu::arrive(0); }
  float shfl_xor(float v, int mask) const {
    emu::Block& b = *emu::current_block();
    const int partner = tid_ ^ mask;
    if (mask <= 0 || mask >= 32 || partner >= bdim_)
      throw std::runtime_error("fx emulator: shuffle partner outside the warp");
    const int warp = 1 + tid_ / 32;
    b.lanes[tid_] = v;
    emu::arrive(warp);
    const float r = b.lanes[partner];
    emu::arrive(warp);
    return r;
  }
};

// Emulates kernel<<<grid, block, smem_bytes>>>: body(thread, dynamic smem, static smem[FX_RED_FLOATS]).
template <class Body>
void emulate_launch(int64_t grid, int block, size_t smem_bytes, const Body& body) {
  emu::Block b;
  b.bdim = block;
  b.gdim = (int)grid;
  std::vector<float> dyn(smem_bytes / sizeof(float) + 1);
  std::vector<float> red(FX_RED_FLOATS);
  for (int64_t g = 0; g < grid; ++g) {
    b.bid = (int)g;
    for (float& f : dyn) f = NAN;
    for (float& f : red) f = NAN;
    const std::function<void(int)> fn = [&](int tid) {
      Thread t{tid, (int)g, block, (int)grid};
      body(t, dyn.data(), red.data());
    };
    emu::run_block(b, fn);
  }
}

}  // namespace fx
