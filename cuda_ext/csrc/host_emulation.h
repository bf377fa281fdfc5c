// Runs the CUDA kernels of graph_attention_kernels.cuh on a CPU, for tests without a GPU.
//
// A warp is 32 lane fibers (ucontext) on one thread, run round-robin: threadIdx/blockIdx
// are set for the running lane, and __shfl_xor_sync has each lane write its value, meet the
// others at a barrier, read its partner's value and meet again. A barrier is a switch to
// the next lane, which is exact when every lane reaches the same barriers: the warp-uniform
// control flow the kernels promise (checked at the end of every warp). Warps run one after
// another, which is exact for kernels without shared memory or inter-warp communication.
// A launch outside a device guard (GA_DEVICE_GUARD, a CUDAGuard on the GPU) throws: on a GPU
// it would run on the current device instead of the inputs'.
#pragma once

#include <ucontext.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace host_emulation {

inline thread_local dim3 thread_index, block_index;

// Open device guards on this thread (GA_DEVICE_GUARD).
inline thread_local int device_guards = 0;

struct DeviceGuard {
  template <typename Device>
  explicit DeviceGuard(const Device& /*device*/) { ++device_guards; }
  ~DeviceGuard() { --device_guards; }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

class Warp {
 public:
  static constexpr int kLanes = 32;

  // Runs body() as the 32 lanes of one warp, to completion.
  template <typename Body>
  void run(Body& body) {
    body_ = [](void* b) { (*static_cast<Body*>(b))(); };
    body_arg_ = &body;
    for (int lane = 0; lane < kLanes; ++lane) {
      barriers_[lane] = 0;
      getcontext(&lanes_[lane]);
      lanes_[lane].uc_stack.ss_sp = stacks_.get() + lane * kStackBytes;
      lanes_[lane].uc_stack.ss_size = kStackBytes;
      lanes_[lane].uc_link = nullptr;
      makecontext(&lanes_[lane], &Warp::lane_main, 0);
    }
    current_ = this;
    lane_ = 0;
    thread_index.x = 0;
    swapcontext(&caller_, &lanes_[0]);
    for (int lane = 1; lane < kLanes; ++lane) {
      if (barriers_[lane] != barriers_[0])
        throw std::runtime_error("host emulation: lanes of a warp met different numbers of "
                                 "shuffles (divergent control flow around __shfl_xor_sync)");
    }
  }

  // All lanes write their slot, then meet, then read: one exchange of __shfl_xor_sync.
  float exchange(float value, int lane_mask) {
    slots_[lane_] = value;
    barrier();
    const float other = slots_[lane_ ^ lane_mask];
    barrier();
    return other;
  }

  static Warp* current() { return current_; }

 private:
  static constexpr size_t kStackBytes = 64 * 1024;

  static void lane_main() {
    Warp* warp = current_;
    warp->body_(warp->body_arg_);
    // lanes finish in order 0..31 when they all met the same barriers
    const int lane = warp->lane_;
    if (lane == kLanes - 1) {
      setcontext(&warp->caller_);
    } else {
      warp->switch_to(lane + 1, /*save=*/false);
    }
  }

  void barrier() {
    ++barriers_[lane_];
    switch_to((lane_ + 1) % kLanes, /*save=*/true);
  }

  void switch_to(int next, bool save) {
    const int previous = lane_;
    lane_ = next;
    thread_index.x = static_cast<unsigned>(next);
    if (save) {
      swapcontext(&lanes_[previous], &lanes_[next]);
    } else {
      setcontext(&lanes_[next]);
    }
  }

  static inline thread_local Warp* current_ = nullptr;
  std::unique_ptr<char[]> stacks_{new char[kLanes * kStackBytes]};
  std::array<ucontext_t, kLanes> lanes_{};
  ucontext_t caller_{};
  std::array<float, kLanes> slots_{};
  std::array<int64_t, kLanes> barriers_{};
  int lane_ = 0;
  void (*body_)(void*) = nullptr;
  void* body_arg_ = nullptr;
};

// kernel<<<grid, block>>>(args...) with block.x == 32: every warp of every block in turn.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) {
  if (block.x != Warp::kLanes || block.z != 1)
    throw std::invalid_argument("host emulation: blocks must be 32 x warps");
  if (device_guards == 0)
    throw std::logic_error("host emulation: a kernel launched outside GA_DEVICE_GUARD");
  static thread_local Warp warp;
  std::tuple<Params...> arguments(std::forward<Args>(args)...);
  auto body = [&] { std::apply(kernel, arguments); };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        for (unsigned w = 0; w < block.y; ++w) {
          block_index = dim3(x, y, z);
          thread_index = dim3(0, w, 0);
          warp.run(body);
        }
}

}  // namespace host_emulation

#define threadIdx host_emulation::thread_index
#define blockIdx host_emulation::block_index

inline float __shfl_xor_sync(unsigned /*mask*/, float value, int lane_mask) {
  return host_emulation::Warp::current()->exchange(value, lane_mask);
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }

#define GA_DEVICE_GUARD(tensor) const host_emulation::DeviceGuard device_guard((tensor).device())
#define GA_LAUNCH(kernel, grid, block, ...) host_emulation::launch(kernel, grid, block, __VA_ARGS__)
