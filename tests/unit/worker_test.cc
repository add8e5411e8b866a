// Worker's hold watch: jobs queued behind completion callbacks that do not return are given
// up once they have waited the watch's patience, and only then.

#include "util/worker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace loom {
namespace {

using namespace std::chrono_literals;

// What a test's watch saw and what became of its jobs.
struct Seen {
  std::mutex mutex;
  std::vector<Worker::Hold> holds;
  std::vector<int> ran;
  std::vector<int> abandoned;
  void note(std::vector<int>& list, int id) {
    std::lock_guard<std::mutex> lock(mutex);
    list.push_back(id);
  }
};

std::unique_ptr<Worker> watchedWorker(Seen& seen, std::chrono::milliseconds patience) {
  auto worker = std::make_unique<Worker>("test-worker", BackoffPolicy{}, /*serveItsOwnWaits=*/true);
  worker->watchHolds([patience] { return patience; },
                     [&seen](const Worker::Hold& hold) {
                       std::lock_guard<std::mutex> lock(seen.mutex);
                       seen.holds.push_back(hold);
                     });
  return worker;
}

TEST(WorkerHolds, AJobQueuedBehindCallbacksThatNeverReturnIsGivenUpAfterThePatience) {
  Seen seen;
  auto worker = watchedWorker(seen, 200ms);
  std::promise<void> callbacksIn;
  std::promise<void> release;  // kept back until the job behind is given up
  std::shared_future<void> released = release.get_future().share();
  worker->submit([&] {
    seen.note(seen.ran, 1);
    const Worker::CallbackFrame frame(41);
    callbacksIn.set_value();
    released.wait();
  });
  callbacksIn.get_future().wait();
  const auto queuedAt = std::chrono::steady_clock::now();
  std::promise<void> givenUp;
  worker->submit([&] { seen.note(seen.ran, 2); },
                 [&] {
                   seen.note(seen.abandoned, 2);
                   givenUp.set_value();
                   return Worker::Job{};
                 });
  givenUp.get_future().wait();
  EXPECT_GE(std::chrono::steady_clock::now() - queuedAt, 200ms);
  // While the callbacks still hold the queue, a new job is given up at once, on the caller;
  // one that cannot be given up (no abandon) waits for them.
  worker->submit([&] { seen.note(seen.ran, 3); },
                 [&] {
                   seen.note(seen.abandoned, 3);
                   return Worker::Job{};
                 });
  worker->submit([&] { seen.note(seen.ran, 5); });
  {
    std::lock_guard<std::mutex> lock(seen.mutex);
    ASSERT_EQ(seen.holds.size(), 1u);
    EXPECT_EQ(seen.holds[0].tag, 41u);
    EXPECT_EQ(seen.holds[0].jobs, 1u);
    EXPECT_GE(seen.holds[0].waited, 200ms);
    EXPECT_EQ(seen.abandoned, (std::vector<int>{2, 3}));
  }
  release.set_value();
  worker->drain();  // the callbacks have returned
  // Then jobs run again.
  worker->submit([&] { seen.note(seen.ran, 4); });
  worker->drain();
  std::lock_guard<std::mutex> lock(seen.mutex);
  EXPECT_EQ(seen.ran, (std::vector<int>{1, 5, 4}));
  EXPECT_EQ(seen.holds.size(), 1u);
}

// Jobs given up together all end before any of their callbacks run: job 2's callback waits
// for job 3, which it could do on the worker (the queue runs on for it), and which only the
// watch's thread ends once the queue is given up. Ended one after the other, job 2's callback
// waited on that very thread for good, and with it the queue's drain.
TEST(WorkerHolds, JobsGivenUpTogetherAllEndBeforeAnyOfTheirCallbacksRun) {
  Seen seen;
  auto worker = watchedWorker(seen, 200ms);
  std::promise<void> callbacksIn;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  worker->submit([&] {
    const Worker::CallbackFrame frame(7);
    callbacksIn.set_value();
    released.wait();
  });
  callbacksIn.get_future().wait();
  std::atomic<bool> thirdEnded{false};
  std::promise<bool> secondsCallback;  // whether job 3 had ended when job 2's callback ran
  worker->submit([] {},
                 [&]() -> Worker::Job {
                   return [&] {
                     const auto until = std::chrono::steady_clock::now() + 5s;
                     while (!thirdEnded.load() && std::chrono::steady_clock::now() < until) {
                       std::this_thread::sleep_for(1ms);
                     }
                     secondsCallback.set_value(thirdEnded.load());
                   };
                 });
  worker->submit([] {},
                 [&] {
                   thirdEnded = true;
                   return Worker::Job{};
                 });
  EXPECT_TRUE(secondsCallback.get_future().get()) << "job 2's callback ran before job 3 ended";
  release.set_value();
  worker->drain();
}

TEST(WorkerHolds, APatienceOfForeverNeverGivesUp) {
  // milliseconds::max() is deadline.h's "never"; in nanoseconds it wrapped into "at once".
  Seen seen;
  auto worker = watchedWorker(seen, std::chrono::milliseconds::max());
  worker->submit([&] {
    const Worker::CallbackFrame frame(1);
    std::this_thread::sleep_for(300ms);
  });
  worker->submit([&] { seen.note(seen.ran, 2); },
                 [&] {
                   seen.note(seen.abandoned, 2);
                   return Worker::Job{};
                 });
  worker->drain();
  std::lock_guard<std::mutex> lock(seen.mutex);
  EXPECT_EQ(seen.ran, (std::vector<int>{2}));
  EXPECT_TRUE(seen.holds.empty());
}

TEST(WorkerHolds, CallbacksThatReturnWithinThePatienceHoldNothing) {
  Seen seen;
  auto worker = watchedWorker(seen, 300ms);
  for (int i = 0; i < 3; ++i) {
    worker->submit([&, i] {
      seen.note(seen.ran, i);
      const Worker::CallbackFrame frame(static_cast<uint64_t>(i));
      std::this_thread::sleep_for(100ms);  // slower than a job is queued behind it
    });
  }
  worker->drain();
  std::lock_guard<std::mutex> lock(seen.mutex);
  EXPECT_EQ(seen.ran, (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(seen.holds.empty());
}

TEST(WorkerHolds, CallbacksThatRunTheQueueThemselvesHoldNothing) {
  // As torch's PowerSGD hook does: a callback waits for the queue to reach a later job,
  // which runs on its thread (runQueuedHere); a long job run so is a job, not a hold.
  Seen seen;
  auto worker = watchedWorker(seen, 150ms);
  std::promise<void> laterQueued;
  std::shared_future<void> queued = laterQueued.get_future().share();
  worker->submit([&] {
    const Worker::CallbackFrame frame(1);
    queued.wait();
    EXPECT_EQ(Worker::current()->runQueuedHere(), 1u);
    seen.note(seen.ran, 1);
  });
  worker->submit([&] {
    std::this_thread::sleep_for(400ms);
    seen.note(seen.ran, 2);
  });
  laterQueued.set_value();
  worker->drain();
  std::lock_guard<std::mutex> lock(seen.mutex);
  EXPECT_EQ(seen.ran, (std::vector<int>{2, 1}));
  EXPECT_TRUE(seen.holds.empty());
}

TEST(WorkerHolds, AWorkerNotWatchedWaitsForItsCallbacks) {
  Worker worker("test-worker", BackoffPolicy{}, /*serveItsOwnWaits=*/true);
  std::atomic<int> ran{0};
  worker.submit([&] {
    const Worker::CallbackFrame frame(1);
    std::this_thread::sleep_for(100ms);
    ++ran;
  });
  worker.submit([&] { ++ran; },
                [] {
                  ADD_FAILURE() << "given up without a watch";
                  return Worker::Job{};
                });
  worker.drain();
  EXPECT_EQ(ran.load(), 2);
}

}  // namespace
}  // namespace loom
