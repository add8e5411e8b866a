// Many hosts in one process: in-memory queues between threads, and local collectives
// computed plainly.

#include "memory_hosts.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

#include "kernels/reduce.h"

namespace loom::testing {

namespace {

constexpr auto kPatience = std::chrono::seconds(60);

using Bytes = std::vector<uint8_t>;

Bytes read(const void* p, size_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  return Bytes(b, b + bytes);
}

}  // namespace

class MemoryContext final : public AcrossHostsContext {
 public:
  MemoryContext(MemoryHosts& hosts, const HostLayout& layout, ScratchArena& arena)
      : AcrossHostsContext(layout, arena), hosts_(hosts) {}

  int lanes() const override { return hosts_.lanes_; }

  void runLocal(const CollectiveArgs& args) override {
    hosts_.meet(layout().host, layout().localIndex, args);
  }

  void exchange(std::span<const NetTransfer> sends,
                std::span<const NetTransfer> receives) override {
    for (const NetTransfer& t : sends) hosts_.send(layout().rank, t);
    for (const NetTransfer& t : receives) {
      MemoryHosts::Message m = hosts_.receive(t.peer, layout().rank);
      if (m.tag != t.tag || m.bytes.size() != t.bytes) {
        throw std::runtime_error(
            "rank " + std::to_string(layout().rank) + " expected " + std::to_string(t.bytes) +
            " bytes for step " + std::to_string(t.tag) + " from rank " + std::to_string(t.peer) +
            " but got " + std::to_string(m.bytes.size()) + " for step " + std::to_string(m.tag));
      }
      if (t.bytes != 0) std::memcpy(t.data, m.bytes.data(), t.bytes);
    }
  }

 private:
  MemoryHosts& hosts_;
};

MemoryHosts::MemoryHosts(std::vector<std::vector<int>> ranksOn, int lanes)
    : ranksOn_(std::move(ranksOn)), lanes_(lanes) {
  for (const auto& ranks : ranksOn_) {
    size_ += static_cast<int>(ranks.size());
    hosts_.push_back(Host{std::vector<const CollectiveArgs*>(ranks.size(), nullptr)});
  }
  arrivals_ = std::vector<std::condition_variable>(static_cast<size_t>(size_));
}

void MemoryHosts::run(const std::function<void(AcrossHostsContext& ctx)>& body) {
  std::exception_ptr first;  // the first failure; the ranks waiting on it give up
  std::vector<std::thread> threads;
  for (int r = 0; r < size_; ++r) {
    threads.emplace_back([&, r] {
      try {
        const HostLayout layout = HostLayout::of(ranksOn_, r);
        ScratchArena arena;
        MemoryContext ctx(*this, layout, arena);
        body(ctx);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!failed_) first = std::current_exception();
        failed_ = true;
        for (auto& cv : arrivals_) cv.notify_all();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

void MemoryHosts::send(int from, const NetTransfer& t) {
  std::lock_guard<std::mutex> lock(mutex_);
  queues_[{from, t.peer}].push_back({t.tag, read(t.data, t.bytes)});
  arrivals_[t.peer].notify_all();
}

MemoryHosts::Message MemoryHosts::receive(int from, int to) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto& queue = queues_[{from, to}];
  if (!arrivals_[to].wait_for(lock, kPatience, [&] { return !queue.empty() || failed_; }) ||
      failed_) {
    throw std::runtime_error("rank " + std::to_string(to) + " waited in vain for rank " +
                             std::to_string(from));
  }
  Message m = std::move(queue.front());
  queue.pop_front();
  return m;
}

void MemoryHosts::meet(int host, int localIndex, const CollectiveArgs& args) {
  std::unique_lock<std::mutex> lock(mutex_);
  Host& h = hosts_[host];
  h.arrived[localIndex] = &args;
  const uint64_t generation = h.generation;
  if (++h.count == static_cast<int>(h.arrived.size())) {
    runLocalReference(h.arrived);
    h.count = 0;
    ++h.generation;
    for (int q : ranksOn_[host]) arrivals_[q].notify_all();
    return;
  }
  const int me = ranksOn_[host][localIndex];
  if (!arrivals_[me].wait_for(lock, kPatience,
                              [&] { return h.generation != generation || failed_; }) ||
      failed_) {
    throw std::runtime_error("host " + std::to_string(host) +
                             ": not every rank came to a local collective");
  }
}

void runLocalReference(const std::vector<const CollectiveArgs*>& ranks) {
  const int n = static_cast<int>(ranks.size());
  const CollectiveArgs& a0 = *ranks[0];
  for (const CollectiveArgs* a : ranks) {
    if (a->kind != a0.kind || a->type != a0.type || a->op.kind() != a0.op.kind() ||
        a->root != a0.root || a->count != a0.count || a->countsHash != a0.countsHash ||
        a->variable != a0.variable) {
      throw std::runtime_error("local ranks issued different collectives");
    }
  }
  const size_t es = elementSize(a0.type);
  const kernels::ReduceSpec spec{a0.type, a0.op, n};
  // (destination, bytes) pairs, written once everything has been read.
  std::vector<std::pair<void*, Bytes>> writes;
  auto reduceOver = [&](auto&& sourceOf, size_t count) {
    Bytes out(count * es);
    std::vector<Bytes> copies;
    std::vector<const void*> srcs;
    for (int j = 0; j < n; ++j) copies.push_back(read(sourceOf(j), count * es));
    for (const Bytes& c : copies) srcs.push_back(c.data());
    if (count != 0) kernels::reduce(out.data(), srcs.data(), n, count, spec);
    return out;
  };
  switch (a0.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduce: {
      const Bytes result = reduceOver([&](int j) { return ranks[j]->input; }, a0.count);
      for (int j = 0; j < n; ++j) {
        if (a0.kind == CollectiveKind::kAllReduce || j == a0.root)
          writes.emplace_back(ranks[j]->output, result);
      }
      break;
    }
    case CollectiveKind::kBroadcast: {
      const Bytes data = read(ranks[a0.root]->input, a0.count * es);
      for (int j = 0; j < n; ++j) writes.emplace_back(ranks[j]->output, data);
      break;
    }
    case CollectiveKind::kAllGather:
      for (int j = 0; j < n; ++j) {
        const Bytes data = read(ranks[j]->input, a0.outputCounts[j] * es);
        for (int k = 0; k < n; ++k) writes.emplace_back(ranks[k]->outputs[j], data);
      }
      break;
    case CollectiveKind::kReduceScatter:
      for (int j = 0; j < n; ++j) {
        writes.emplace_back(ranks[j]->output, reduceOver([&](int k) { return ranks[k]->inputs[j]; },
                                                         a0.inputCounts[j]));
      }
      break;
    case CollectiveKind::kAllToAll:
      for (int j = 0; j < n; ++j) {
        for (int k = 0; k < n; ++k) {
          if (ranks[k]->outputCounts[j] != ranks[j]->inputCounts[k]) {
            throw std::runtime_error("local all_to_all counts disagree");
          }
          // The equal form's phases are those of one count: every block must have it.
          if (!a0.variable && ranks[j]->inputCounts[k] != a0.count) {
            throw std::runtime_error("local all_to_all of equal blocks with another count");
          }
          writes.emplace_back(ranks[k]->outputs[j],
                              read(ranks[j]->inputs[k], ranks[j]->inputCounts[k] * es));
        }
      }
      break;
    case CollectiveKind::kGather:
      for (int j = 0; j < n; ++j) {
        writes.emplace_back(ranks[a0.root]->outputs[j], read(ranks[j]->input, a0.count * es));
      }
      break;
    case CollectiveKind::kScatter:
      for (int j = 0; j < n; ++j) {
        writes.emplace_back(ranks[j]->output, read(ranks[a0.root]->inputs[j], a0.count * es));
      }
      break;
    case CollectiveKind::kBarrier: break;
  }
  for (auto& [dst, bytes] : writes) {
    if (!bytes.empty()) std::memcpy(dst, bytes.data(), bytes.size());
  }
}

}  // namespace loom::testing
