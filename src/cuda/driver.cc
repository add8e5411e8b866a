// Loading the CUDA driver at run time.

#include "cuda/driver.h"

#include <dlfcn.h>

#include <string>

#include "loom/error.h"

namespace loom::cuda {

namespace {

// The symbol cuda.h binds `name` to (cuMemcpyDtoDAsync is cuMemcpyDtoDAsync_v2, ...): the
// one whose signature the declaration has. (cuGetProcAddress would pick by version instead,
// and a base name can resolve to a newer variant with another signature.)
#define LOOM_CUDA_SYMBOL(name) LOOM_CUDA_STRINGIFY(name)
#define LOOM_CUDA_STRINGIFY(name) #name

Driver load() {
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    throw Error(ErrorCode::kUnsupported, "cuda", -1,
                std::string("no CUDA driver on this machine (libcuda.so.1: ") + ::dlerror() +
                    "); CUDA tensors need an NVIDIA GPU and its driver");
  }
  Driver d;
#define LOOM_CUDA_RESOLVE(name)                                                          \
  d.name = reinterpret_cast<decltype(d.name)>(::dlsym(library, LOOM_CUDA_SYMBOL(name))); \
  if (d.name == nullptr) {                                                               \
    throw Error(ErrorCode::kUnsupported, "cuda", -1,                                     \
                std::string("the CUDA driver lacks ") + LOOM_CUDA_SYMBOL(name) +         \
                    " (loom was built for CUDA " + std::to_string(CUDA_VERSION / 1000) + \
                    "); update the driver");                                             \
  }
  LOOM_CUDA_DRIVER_FUNCTIONS(LOOM_CUDA_RESOLVE)
#undef LOOM_CUDA_RESOLVE
  const CUresult init = d.cuInit(0);
  if (init != CUDA_SUCCESS) {
    const char* name = nullptr;
    d.cuGetErrorName(init, &name);
    throw Error(ErrorCode::kUnsupported, "cuda", -1,
                std::string("the CUDA driver did not initialise (") + (name ? name : "?") +
                    "); is a GPU visible to this process?");
  }
  return d;
}

}  // namespace

const Driver& Driver::get() {
  static const Driver driver = load();  // a failed load throws again on the next call
  return driver;
}

void check(CUresult result, std::string_view op, int rank, std::string_view what) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  const Driver& d = Driver::get();
  d.cuGetErrorName(result, &name);
  d.cuGetErrorString(result, &text);
  throw Error(ErrorCode::kSystem, op, rank,
              std::string(what) + " failed: " + (name ? name : "CUDA error") + " (" +
                  (text ? text : "no description") + ")");
}

ContextGuard::ContextGuard(CUcontext context) {
  const Driver& d = Driver::get();
  d.cuCtxGetCurrent(&previous_);
  if (previous_ != context) {
    check(d.cuCtxSetCurrent(context), "cuda", -1, "cuCtxSetCurrent");
    switched_ = true;
  }
}

ContextGuard::~ContextGuard() {
  if (switched_) Driver::get().cuCtxSetCurrent(previous_);
}

RelaxedCaptureGuard::RelaxedCaptureGuard() {
  check(Driver::get().cuThreadExchangeStreamCaptureMode(&previous_), "cuda", -1,
        "cuThreadExchangeStreamCaptureMode");
}

RelaxedCaptureGuard::~RelaxedCaptureGuard() {
  Driver::get().cuThreadExchangeStreamCaptureMode(&previous_);
}

}  // namespace loom::cuda
