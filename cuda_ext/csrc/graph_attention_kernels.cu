// The kernels of graph_attention_kernels.cuh compiled for the GPU: launches on torch's
// current stream of the inputs' device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define GA_DEVICE_GUARD(tensor) const c10::cuda::CUDAGuard device_guard((tensor).device())
#define GA_LAUNCH(kernel, grid, block, ...)                                          \
  do {                                                                               \
    kernel<<<(grid), (block), 0, c10::cuda::getCurrentCUDAStream()>>>(__VA_ARGS__); \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                  \
  } while (0)

#include "graph_attention_kernels.cuh"
