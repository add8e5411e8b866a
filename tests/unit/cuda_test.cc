// The CUDA path where there is no GPU (the development and CI machines): collectives on
// CUDA buffers fail at the call with an error naming the operation and what to do, and the
// communicator goes on working on host memory. The path itself is tested on a GPU host by
// tests/cuda/check_cuda.py (scripts/cuda_check.sh).

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "loom/communicator.h"
#include "loom/error.h"
#include "loom/store.h"

namespace loom {
namespace {

bool haveCudaDriver() {
  void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver != nullptr) ::dlclose(driver);
  return driver != nullptr;
}

// A one-rank communicator and options that put a call on CUDA; skipped where there is a
// driver (there the CUDA path runs for real).
class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (haveCudaDriver()) {
      GTEST_SKIP() << "this machine has a CUDA driver: scripts/cuda_check.sh tests the CUDA path";
    }
    onGpu.device = DeviceKind::kCuda;
  }
  std::shared_ptr<Communicator> comm = Communicator::create(0, 1, std::make_shared<HashStore>());
  float x = 2.0f;
  OpOptions onGpu;
};

TEST_F(Cuda, WithoutAGpuCollectivesOnCudaBuffersFailWithAClearError) {
  for (int attempt = 0; attempt < 2; ++attempt) {  // the second call must not crash either
    try {
      comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum, onGpu);
      FAIL() << "a collective on CUDA buffers ran without a GPU";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
      EXPECT_EQ(e.op(), "all_reduce") << e.what();
      EXPECT_EQ(e.rank(), 0) << e.what();
      EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
    }
  }
  comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
  EXPECT_EQ(x, 2.0f);
}

TEST_F(Cuda, WithoutAGpuSendsOnCudaBuffersFailAndGroupsKeepTheirPromises) {
  // Alone: refused at the call, naming the operation.
  try {
    comm->send(&x, 1, DataType::kFloat32, 0, 7, onGpu);
    FAIL() << "a send of CUDA buffers ran without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    EXPECT_EQ(e.op(), "send") << e.what();
  }
  // From any source: refused whatever the machine.
  EXPECT_THROW(comm->recv(&x, 1, DataType::kFloat32, kAnySource, 0, onGpu), Error);
  // In a group: held, then at endGroup every request fails with the reason, which is thrown.
  comm->startGroup();
  Request send = comm->send(&x, 1, DataType::kFloat32, 0, 1, onGpu);
  Request recv = comm->recv(&x, 1, DataType::kFloat32, 0, 1, onGpu);
  EXPECT_FALSE(send.test());
  EXPECT_THROW(comm->endGroup(), Error);
  for (const Request& r : {send, recv}) {
    ASSERT_TRUE(r.test());
    try {
      r.wait();
      FAIL() << "a held transfer succeeded without a GPU";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    }
  }
  EXPECT_THROW(comm->endGroup(), Error);  // no group open
  // Shut down inside a group: the held transfer fails instead of waiting forever.
  comm->startGroup();
  Request held = comm->send(&x, 1, DataType::kFloat32, 0, 2, onGpu);
  comm->shutdown();
  ASSERT_TRUE(held.test());
  try {
    held.wait();
    FAIL() << "a transfer held across shutdown succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    EXPECT_NE(std::string(e.what()).find("endGroup"), std::string::npos) << e.what();
  }
}

// The callbacks of a group's transfers that end unqueued run once all of them have ended,
// outside the group's lock: one that waits on another transfer of the group, or starts a
// group, returns. They used to run one transfer at a time under the lock: the send's
// callback waited for the receive for good (endGroup never returned), and one that started a
// group locked the lock again.
TEST_F(Cuda, TheCallbacksOfAGroupEndedUnqueuedSeeEveryTransferEndedAndMayStartAGroup) {
  for (const bool shutDown : {false, true}) {
    comm = Communicator::create(0, 1, std::make_shared<HashStore>());
    comm->startGroup();
    Request send = comm->send(&x, 1, DataType::kFloat32, 0, 1, onGpu);
    Request recv = comm->recv(&x, 1, DataType::kFloat32, 0, 1, onGpu);
    bool recvEnded = false;
    bool groupStarted = false;
    send.onComplete([&, recv](std::exception_ptr) {
      recvEnded = recv.test();  // a wait here used to wait for good
      comm->startGroup();       // locked the group's lock again
      groupStarted = true;
    });
    if (shutDown) {
      comm->shutdown();
    } else {
      EXPECT_THROW(comm->endGroup(), Error);
    }
    EXPECT_TRUE(recvEnded) << "the send's callback ran before the receive had ended";
    EXPECT_TRUE(groupStarted);
  }
}

}  // namespace
}  // namespace loom
