// What the host pays per driver call on a small CUDA collective's path, without loom: a
// launch by the size of its parameters (loom's kernels take 1-2.6 KB: FusedParams 1768 B,
// ReduceParams 2128, CopyParams 2608), plain and cooperative, and the other calls a fused
// call makes (event record, stream capture query, stream memory operations, context push
// and pop). Each is timed on the host only: batches of 64 calls between synchronizes, the
// median of the batches' time per call. Run by hand on a GPU host (docs/PERFORMANCE.md, "A
// small CUDA call's host path"); set CUDA_MPS_PIPE_DIRECTORY to run it as an MPS client.
//
//   nvcc -O2 -std=c++20 -arch=native -o /tmp/launch_cost tests/cuda/launch_cost_probe.cu -lcuda
//   /tmp/launch_cost [batches=400]

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {

template <int N>
struct Params {
  unsigned char bytes[N];
};

// Reads one byte of its parameters so they cannot be dropped; writes only on a value the
// probe never passes.
template <int N>
__global__ void touch(Params<N> p, int* sink) {
  if (p.bytes[N - 1] == 0xAB && threadIdx.x == 0) *sink = 1;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void check(CUresult e, const char* what) {
  if (e != CUDA_SUCCESS) {
    std::fprintf(stderr, "%s: driver error %d\n", what, static_cast<int>(e));
    std::exit(1);
  }
}

constexpr int kPerBatch = 64;

// Median microseconds per call of `call`, timed on the host in batches of kPerBatch calls,
// the stream synchronized (untimed) after each batch so launches never wait for queue room.
double medianUs(cudaStream_t stream, int batches, const std::function<void()>& call) {
  std::vector<double> per;
  for (int b = 0; b < batches + 20; ++b) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kPerBatch; ++i) call();
    const auto t1 = std::chrono::steady_clock::now();
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (b >= 20)
      per.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kPerBatch);
  }
  std::sort(per.begin(), per.end());
  return per[per.size() / 2];
}

template <int N>
void launches(cudaStream_t stream, int batches, int* sink) {
  Params<N> p{};
  void* args[] = {&p, &sink};
  const void* fn = reinterpret_cast<const void*>(&touch<N>);
  for (const auto& [blocks, threads] : {std::pair{1, 32}, std::pair{128, 512}}) {
    const double plain = medianUs(stream, batches, [&] {
      check(cudaLaunchKernel(fn, blocks, threads, args, 0, stream), "cudaLaunchKernel");
    });
    const double coop = medianUs(stream, batches, [&] {
      check(cudaLaunchCooperativeKernel(fn, blocks, threads, args, 0, stream),
            "cudaLaunchCooperativeKernel");
    });
    std::printf(
        "launch, %5d B of parameters, %3d x %3d threads: plain %6.2f us, cooperative %6.2f us\n", N,
        blocks, threads, plain, coop);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int batches = argc > 1 ? std::atoi(argv[1]) : 400;
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  int* sink = nullptr;
  check(cudaMalloc(&sink, 4096), "cudaMalloc");
  int mps = 0;
  CUdevice dev = 0;
  check(cuDeviceGet(&dev, 0), "cuDeviceGet");
  check(cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev), "cuDeviceGetAttribute");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("%s, MPS client: %s, %d batches of %d calls\n", prop.name, mps ? "yes" : "no",
              batches, kPerBatch);

  launches<64>(stream, batches, sink);
  launches<512>(stream, batches, sink);
  launches<1024>(stream, batches, sink);
  launches<1768>(stream, batches, sink);
  launches<2608>(stream, batches, sink);
  launches<4096>(stream, batches, sink);

  CUstream cu = reinterpret_cast<CUstream>(stream);
  CUevent event = nullptr;
  check(cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  std::printf("cuEventRecord: %.2f us\n",
              medianUs(stream, batches, [&] { check(cuEventRecord(event, cu), "cuEventRecord"); }));
  CUstreamCaptureStatus status{};
  cuuint64_t id = 0;
  std::printf("cuStreamGetCaptureInfo: %.2f us\n", medianUs(stream, batches, [&] {
                check(cuStreamGetCaptureInfo(cu, &status, &id, nullptr, nullptr, nullptr, nullptr),
                      "cuStreamGetCaptureInfo");
              }));
  unsigned long long streamId = 0;
  std::printf("cuStreamGetId: %.2f us\n", medianUs(stream, batches, [&] {
                check(cuStreamGetId(cu, &streamId), "cuStreamGetId");
              }));
  CUcontext ctx = nullptr;
  check(cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  std::printf("cuCtxPushCurrent + cuCtxPopCurrent: %.2f us\n", medianUs(stream, batches, [&] {
                check(cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
                CUcontext popped = nullptr;
                check(cuCtxPopCurrent(&popped), "cuCtxPopCurrent");
              }));
  // A write the stream's next wait is satisfied by, so the waits never hold it.
  CUdeviceptr flag = reinterpret_cast<CUdeviceptr>(sink);
  for (int ops : {1, 3}) {
    std::vector<CUstreamBatchMemOpParams> p(static_cast<size_t>(ops));
    for (auto& op : p) {
      op = {};
      op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
      op.waitValue.address = flag + 8;
      op.waitValue.value64 = 0;
      op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    }
    std::printf("cuStreamBatchMemOp of %d waits: %.2f us\n", ops, medianUs(stream, batches, [&] {
                  check(cuStreamBatchMemOp(cu, static_cast<unsigned>(ops), p.data(), 0),
                        "cuStreamBatchMemOp");
                }));
  }
  std::vector<unsigned char> host(4096);
  std::printf("cuMemcpyHtoDAsync of 2 KiB from pageable memory: %.2f us\n",
              medianUs(stream, batches, [&] {
                check(cuMemcpyHtoDAsync(flag, host.data(), 2048, cu), "cuMemcpyHtoDAsync");
              }));
  return 0;
}
