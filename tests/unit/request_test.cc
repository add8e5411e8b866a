// A Request's waits where one thread alone completes the operations (a CUDA executor's
// monitor, which also runs their completion callbacks): a callback there that waits for
// another of them would wait for itself; the wait is refused by name instead.

#include <gtest/gtest.h>

#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "core/op_state.h"
#include "loom/error.h"
#include "loom/request.h"

namespace loom {
namespace {

TEST(Request, AWaitOnTheThreadThatAloneCompletesItIsRefused) {
  const int monitor = 0;  // the mark of the thread that completes both operations
  auto first = std::make_shared<detail::OpState>(1);
  auto second = std::make_shared<detail::OpState>(2);
  first->completer = &monitor;
  second->completer = &monitor;
  std::string refused;
  bool callbackRan = false;
  Request(first).onComplete([&](const std::exception_ptr&) {
    callbackRan = true;
    try {
      Request(second).wait();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      refused = e.what();
    }
  });
  std::thread completer([&] {
    detail::markCompleting(&monitor);
    first->complete(nullptr);  // its callback runs here
  });
  completer.join();
  EXPECT_TRUE(callbackRan);
  EXPECT_NE(refused.find("loom wait"), std::string::npos) << refused;
  EXPECT_NE(refused.find("inside a completion callback"), std::string::npos) << refused;
  // Anywhere else the same wait waits, and ends when the operation does; so does a wait on
  // that thread for an operation already over.
  std::thread later([&] {
    detail::markCompleting(&monitor);
    second->complete(nullptr);
    Request(first).wait();
  });
  Request(second).wait();
  later.join();
}

}  // namespace
}  // namespace loom
