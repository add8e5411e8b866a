#include "exit_shutdown.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "launch.h"
#include "loom/error.h"
#include "process_group_loom.h"

namespace loom::torch_plugin {
namespace {

// Every group this process made: held weakly, so a group destroyed meanwhile is skipped (and
// forgotten as the next is made).
struct LiveGroup {
  std::weak_ptr<Communicator> comm;
  std::weak_ptr<GroupTies> ties;
};
std::mutex gLiveMutex;
std::vector<LiveGroup> gLive;

std::atomic<bool> gExiting{false};  // the exit handler has begun

// The groups still alive, each with its ties (a stand-in where its work objects are gone).
using Group = std::pair<std::shared_ptr<Communicator>, std::shared_ptr<GroupTies>>;
std::vector<Group> liveGroups() {
  std::vector<LiveGroup> live;
  {
    std::lock_guard<std::mutex> lock(gLiveMutex);
    live = gLive;
  }
  std::vector<Group> groups;
  for (const LiveGroup& group : live) {
    std::shared_ptr<Communicator> comm = group.comm.lock();
    if (!comm) continue;
    std::shared_ptr<GroupTies> ties = group.ties.lock();
    if (!ties) ties = std::make_shared<GroupTies>();  // no work left: none was given up on
    groups.emplace_back(std::move(comm), std::move(ties));
  }
  return groups;
}

// Shuts `groups` down in order, counting in `done` those finished.
void shutDownInOrder(const std::vector<Group>& groups, std::atomic<size_t>& done) {
  for (const auto& [comm, ties] : groups) {
    try {
      ProcessGroupLoom::shutdownGroup(comm, *ties);
    } catch (const std::exception& e) {  // not expected off loom's threads; never lost
      std::fprintf(stderr, "loom: at exit, shutting group '%s' down failed: %s\n",
                   comm->name().c_str(), e.what());
    }
    done.fetch_add(1);
  }
}

}  // namespace

void noteLiveGroup(const std::shared_ptr<Communicator>& comm,
                   const std::shared_ptr<GroupTies>& ties) {
  std::lock_guard<std::mutex> lock(gLiveMutex);
  std::erase_if(gLive, [](const LiveGroup& g) { return g.comm.expired(); });
  gLive.push_back({comm, ties});
}

size_t shutDownLiveGroups() {
  const std::vector<Group> groups = liveGroups();
  if (groups.empty()) return 0;
  gExiting.store(true);
  releasingGil([&] {
    // The shutdowns run on a thread of their own, so this one can stop waiting for them:
    // a shutdown waits for every call under way, and at exit one may never end by itself.
    struct Progress {
      std::atomic<size_t> done{0};
      std::mutex mutex;
      std::condition_variable ended;
      bool over = false;
    };
    auto progress = std::make_shared<Progress>();
    std::thread closer;
    try {
      closer = std::thread([groups, progress] {
        shutDownInOrder(groups, progress->done);
        std::lock_guard<std::mutex> lock(progress->mutex);
        progress->over = true;
        progress->ended.notify_all();
      });
    } catch (const std::system_error&) {
      // No thread to be had: shut down here, however long it takes.
      shutDownInOrder(groups, progress->done);
      return;
    }
    const auto overWithin = [&](std::chrono::seconds limit) {
      std::unique_lock<std::mutex> lock(progress->mutex);
      return progress->ended.wait_for(lock, limit, [&] { return progress->over; });
    };
    if (!overWithin(kExitGrace)) {
      for (size_t i = progress->done.load(); i < groups.size(); ++i) {
        const Communicator& comm = *groups[i].first;
        std::fprintf(stderr,
                     "loom: Python is exiting, and calls of group '%s' (rank %d) were still "
                     "under way after %lld s (a peer that never joins them, or a call on a "
                     "thread Python does not wait for); aborting them: their peers fail now, "
                     "naming this rank\n",
                     comm.name().c_str(), comm.rank(), static_cast<long long>(kExitGrace.count()));
        groups[i].first->abort();
      }
      if (!overWithin(kExitGrace)) {
        // Aborted calls end at once; what still holds the shutdown is no call of loom's (a
        // completion callback that never returns keeps the group's thread): let it be, and
        // let Python exit.
        std::fprintf(stderr,
                     "loom: Python is exiting, and a group's shutdown still waits after its "
                     "calls were aborted (a completion callback that does not return?); "
                     "exiting without it\n");
        closer.detach();
        return;
      }
    }
    closer.join();
  });
  return groups.size();
}

std::string exitNote(const std::exception& e) {
  const auto* error = dynamic_cast<const Error*>(&e);
  if (error == nullptr || error->code() != ErrorCode::kAborted || !gExiting.load()) return {};
  return " (Python is exiting: loom's exit handler, registered by `import loom`, shut this "
         "process's groups down, aborting calls still under way after " +
         std::to_string(kExitGrace.count()) +
         " s; it runs before the exit handlers registered earlier, so register one that uses a "
         "group after importing loom)";
}

}  // namespace loom::torch_plugin
