#include "exit_shutdown.h"

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

// How the closer (the thread that shuts the groups down, in order) is getting on, under
// `mutex`: `done` groups shut down, `over` once all are.
struct Progress {
  std::mutex mutex;
  std::condition_variable changed;
  size_t done = 0;
  bool over = false;
};

void shutDownInOrder(const std::vector<Group>& groups, Progress& progress) {
  for (const auto& [comm, ties] : groups) {
    ties->atExit.store(ExitMark::kShutDown);
    try {
      ProcessGroupLoom::shutdownGroup(comm, *ties);
    } catch (const std::exception& e) {  // not expected off loom's threads; never lost
      std::fprintf(stderr, "loom: at exit, shutting group '%s' down failed: %s\n",
                   comm->name().c_str(), e.what());
    }
    std::lock_guard<std::mutex> lock(progress.mutex);
    ++progress.done;
    progress.changed.notify_all();
  }
  std::lock_guard<std::mutex> lock(progress.mutex);
  progress.over = true;
  progress.changed.notify_all();
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
  releasingGil([&] {
    // The shutdowns run on a thread of their own, so this one can stop waiting for them:
    // a shutdown waits for every call under way, and at exit one may never end by itself.
    auto progress = std::make_shared<Progress>();
    std::thread closer;
    try {
      closer = std::thread([groups, progress] { shutDownInOrder(groups, *progress); });
    } catch (const std::system_error&) {
      shutDownInOrder(groups, *progress);  // no thread to be had: here, however long it takes
      return;
    }
    // Each group gets kExitGrace from when its shutdown began; one still shutting down then
    // has its calls aborted (only that one: the next may have nothing under way, and an abort
    // fails the communicator for every rank), and kExitGrace more to end.
    std::unique_lock<std::mutex> lock(progress->mutex);
    size_t watched = groups.size();
    bool aborted = false;
    auto since = std::chrono::steady_clock::now();
    while (!progress->over) {
      if (progress->done != watched) {
        watched = progress->done;
        aborted = false;
        since = std::chrono::steady_clock::now();
      }
      const size_t current = watched;
      if (progress->changed.wait_until(lock, since + kExitGrace, [&] {
            return progress->over || progress->done != current;
          })) {
        continue;
      }
      const auto& [comm, ties] = groups[current];
      if (aborted) {
        // Aborted calls end at once: what still holds this shutdown is no call of loom's (a
        // completion callback that never returns keeps the group's thread). Let Python exit.
        std::fprintf(stderr,
                     "loom: Python is exiting, and group '%s' still has not shut down %lld s "
                     "after its calls were aborted (a completion callback that does not "
                     "return?); exiting without waiting for it\n",
                     comm->name().c_str(), static_cast<long long>(kExitGrace.count()));
        lock.unlock();
        closer.detach();
        return;
      }
      std::fprintf(stderr,
                   "loom: Python is exiting, and calls of group '%s' (rank %d) were still under "
                   "way %lld s after its shutdown began (a peer that never joins them, or a call "
                   "on a thread Python does not wait for); aborting them: their peers fail now, "
                   "naming this rank\n",
                   comm->name().c_str(), comm->rank(), static_cast<long long>(kExitGrace.count()));
      ties->atExit.store(ExitMark::kAborted);
      comm->abort();  // under the lock: the closer cannot move past this group meanwhile
      aborted = true;
      since = std::chrono::steady_clock::now();
    }
    lock.unlock();
    closer.join();
  });
  return groups.size();
}

std::string exitNote(const std::exception& e, const GroupTies* ties) {
  const ExitMark mark = ties != nullptr ? ties->atExit.load() : ExitMark::kNone;
  const auto* error = dynamic_cast<const Error*>(&e);
  if (mark == ExitMark::kNone || error == nullptr || error->code() != ErrorCode::kAborted) {
    return {};
  }
  // Another rank's failure or abort, its report quoted: not this handler's doing.
  if (error->detail().starts_with("the communicator failed on rank ")) return {};
  if (mark == ExitMark::kAborted) {
    return " (Python is exiting: loom's exit handler aborted this group's calls still under way " +
           std::to_string(kExitGrace.count()) + " s after it began to shut the group down)";
  }
  return " (Python is exiting: loom's exit handler, registered by `import loom`, has shut this "
         "group down; it runs before the exit handlers registered earlier, so register one that "
         "uses a group after importing loom)";
}

}  // namespace loom::torch_plugin
