#pragma once

// Many hosts in one process, for the algorithms across hosts: each rank is a thread with a
// MemoryContext. Network messages go through in-memory queues (copied on send, so sends
// never wait: deadlock freedom is the schedule checker's job, see algorithms/schedule.h);
// a host's local collectives are computed by the last of its ranks to arrive, with a plain
// reference of each collective (rank order, kernels::reduce), so the hierarchical
// compositions are tested on layouts that network namespaces would make slow: up to
// seventeen hosts, uneven, interleaved.

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "algorithms/across_hosts.h"

namespace loom::testing {

/// The queues and local meeting points of one simulated job.
class MemoryHosts {
 public:
  /// `lanes`: what every context's lanes() says (their rail jobs still run at once: only the
  /// order of a pipeline's steps and its buffers change).
  explicit MemoryHosts(std::vector<std::vector<int>> ranksOn, int lanes = 1);

  const std::vector<std::vector<int>>& ranksOn() const { return ranksOn_; }
  int size() const { return size_; }

  /// Runs body(ctx) on every rank at once, each on its own thread with its own context,
  /// and returns when all are done. The first failure on any rank (an exception) is
  /// rethrown; ranks waiting for the failed one give up at once.
  void run(const std::function<void(AcrossHostsContext& ctx)>& body);

 private:
  friend class MemoryContext;
  struct Message {
    int tag;
    std::vector<uint8_t> bytes;
  };
  struct Host {
    std::vector<const CollectiveArgs*> arrived;
    int count = 0;
    uint64_t generation = 0;
  };
  void send(int from, const NetTransfer& t);
  Message receive(int from, int to);
  void meet(int host, int localIndex, const CollectiveArgs& args);

  std::vector<std::vector<int>> ranksOn_;
  int lanes_ = 1;
  int size_ = 0;
  std::mutex mutex_;
  std::vector<std::condition_variable> arrivals_;  // per rank: a message or a local result
  std::map<std::pair<int, int>, std::deque<Message>> queues_;  // (from, to)
  std::vector<Host> hosts_;
  bool failed_ = false;  // a rank has failed: the others stop waiting
};

/// Computes a collective among `ranks` (every local rank's arguments, by local index) the
/// plain way, writing every output only after all inputs are read (arguments may alias).
void runLocalReference(const std::vector<const CollectiveArgs*>& ranks);

}  // namespace loom::testing
