// Accepting, proving and routing incoming connections.

#include "transport/net/net_service.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "loom/error.h"
#include "util/env.h"
#include "util/posix.h"

namespace loom::net {

namespace {

// Descriptors one accepted connection holds before it is proven: libfabric's endpoint, its
// queues and their wait objects (8 with libfabric 1.17's tcp provider, counted).
constexpr size_t kDescriptorsPerConnection = 8;

// The most connections that may wait unproven: `most`, and no more than take a quarter of
// the process's open-file limit. Strangers that connect and say nothing would otherwise use up
// the descriptors that members' connections, the process's own and its files need (40 at a
// limit of 160 did); those beyond wait in the listener's queue, holding none here.
size_t pendingBudget(size_t most) {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur == RLIM_INFINITY) return most;
  return std::clamp<size_t>(files.rlim_cur / 4 / kDescriptorsPerConnection, 1, most);
}

// The index of the connection waiting longest of those in `pending` that `which` picks, or
// pending.size() if it picks none.
template <class Pending, class Which>
size_t oldestOf(const std::vector<Pending>& pending, Which which) {
  size_t oldest = pending.size();
  for (size_t i = 0; i < pending.size(); ++i) {
    if (!which(*pending[i].channel)) continue;
    if (oldest == pending.size() || pending[i].since < pending[oldest].since) oldest = i;
  }
  return oldest;
}

}  // namespace

NetService& NetService::instance() {
  // Leaked on purpose, as the process service is: a communicator in static storage (made
  // before the first call here) is destroyed after this function's statics would be at exit,
  // and forgets its registration here as it goes. Its thread stops at exit, though, before
  // the libraries it polls (libfabric's providers) tear themselves down.
  static NetService* service = [] {
    Limits limits;
    limits.unexpectedHold =
        std::chrono::milliseconds(env::integer("LOOM_NET_HOLD_MS", 60'000, 100, 3'600'000));
    auto* made = new NetService(Fabric::instance(), limits);
    std::atexit([] { service->stop(); });  // a forked child's leaves its parent's thread be
    return made;
  }();
  Fabric::requireOpenedHere(service->owner_);  // a forked child has the object, not the thread
  return *service;
}

NetService::NetService(Fabric& fabric, Limits limits)
    : fabric_(fabric), limits_(limits), owner_(::getpid()) {
  thread_ = std::thread([this] {
    posix::nameThisThread("loom-net");
    run();
  });
}

NetService::~NetService() {
  stop();
}

void NetService::stop() {
  stopping_.store(true, std::memory_order_release);
  // A forked child has the object but not the thread (nor may it join the parent's).
  if (::getpid() == owner_ && thread_.joinable()) thread_.join();
}

void NetService::expect(const CommId& comm, const JobSecret& secret, ShapeOf shapeOf) {
  std::lock_guard<std::mutex> lock(mutex_);
  Expected& expected = expected_[comm];
  expected.secret = secret;
  expected.shapeOf = std::move(shapeOf);
  ++expected.users;
}

void NetService::forget(const CommId& comm, int receiver) {
  std::vector<std::unique_ptr<ReceiveChannel>> closing;  // closed outside the lock
  std::lock_guard<std::mutex> lock(mutex_);
  // A peer that has not heard yet that this rank left may still connect to it (a send's
  // first message): proven and filed here, nobody would read what it sends.
  const auto now = Clock::now();
  std::erase_if(departed_, [now](const auto& entry) { return entry.second < now; });
  departed_[{comm, receiver}] = now + limits_.handshake + limits_.unexpectedHold;
  // Ranks of this process that still use it keep it: closing their channels would tell
  // their peers they left.
  const auto expected = expected_.find(comm);
  const bool last = expected == expected_.end() || --expected->second.users <= 0;
  if (last && expected != expected_.end()) expected_.erase(expected);
  for (auto it = proven_.lower_bound(Key{comm, INT32_MIN, INT32_MIN, 0});
       it != proven_.end() && std::get<0>(it->first) == comm;) {
    if (!last && std::get<2>(it->first) != receiver) {
      ++it;
      continue;
    }
    closing.push_back(std::move(it->second));
    it = proven_.erase(it);
  }
}

void NetService::discard(const CommId& comm, int sender, int receiver, uint32_t channel) {
  std::unique_ptr<ReceiveChannel> closing;  // closed outside the lock
  std::lock_guard<std::mutex> lock(mutex_);
  const auto now = Clock::now();
  std::erase_if(discarded_, [now](const auto& entry) { return entry.second < now; });
  const Key key{comm, sender, receiver, channel};
  const auto it = proven_.find(key);
  if (it != proven_.end()) {
    closing = std::move(it->second);
    proven_.erase(it);
    return;
  }
  discarded_[key] = now + limits_.handshake + limits_.unexpectedHold;
}

std::unique_ptr<ReceiveChannel> NetService::claim(const CommId& comm, int sender, int receiver,
                                                  uint32_t channel) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = proven_.find(Key{comm, sender, receiver, channel});
  if (it == proven_.end()) return nullptr;
  auto found = std::move(it->second);
  proven_.erase(it);
  return found;
}

std::unique_ptr<ReceiveChannel> NetService::claimAny(const CommId& comm, int receiver,
                                                     bool (*accepted)(uint32_t channel)) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = proven_.lower_bound(Key{comm, INT32_MIN, INT32_MIN, 0});
       it != proven_.end() && std::get<0>(it->first) == comm; ++it) {
    if (std::get<2>(it->first) == receiver && accepted(std::get<3>(it->first))) {
      auto found = std::move(it->second);
      proven_.erase(it);
      return found;
    }
  }
  return nullptr;
}

bool NetService::departedNow(const CommId& comm, int receiver) {
  const auto it = departed_.find({comm, receiver});
  if (it == departed_.end()) return false;
  if (it->second >= Clock::now()) return true;
  departed_.erase(it);
  return false;
}

std::optional<Expectation> NetService::lookup(const Hello& hello) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (departedNow(hello.comm, hello.receiver)) {
    // Closed unanswered: the initiator connects again until its own communicator hears of
    // the departure (the goodbye on its control link) and fails what it meant to send.
    throw Error(ErrorCode::kPeerFailure, "connect", hello.receiver,
                "this rank has destroyed its communicator; connections to it are turned away");
  }
  const auto it = expected_.find(hello.comm);
  if (it == expected_.end()) return std::nullopt;
  return Expectation{it->second.secret, it->second.shapeOf(hello.channel)};
}

void NetService::run() {
  while (!stopping_.load(std::memory_order_acquire)) {
    const size_t most = pendingBudget(limits_.maxPending);
    if (pending_.size() >= most) makeRoom(Clock::now());
    if (pending_.size() >= most) {
      // Full: new requests wait in the listener's queue, unanswered but not dropped (a large
      // job's connections may all arrive at once), until a handshake ends or makes room.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      advance(Clock::now());
      continue;
    }
    // Idle, the thread sleeps in the listener's wait; with handshakes under way it polls.
    const auto wait = std::chrono::milliseconds(pending_.empty() ? 100 : 1);
    std::unique_ptr<Endpoint> endpoint;
    try {
      endpoint = fabric_.acceptNext(wait);
    } catch (const Error& e) {
      refused_.fetch_add(1, std::memory_order_relaxed);  // the request could not be accepted
      reportRefusal(e);
      makeRoomForShortage(e);
    }
    if (endpoint) {
      try {
        pending_.push_back({std::make_unique<ReceiveChannel>(
                                std::move(endpoint), [this](const Hello& h) { return lookup(h); }),
                            Clock::now()});
      } catch (const Error& e) {
        refused_.fetch_add(1, std::memory_order_relaxed);
        reportRefusal(e);
        makeRoomForShortage(e);
      }
    }
    advance(Clock::now());
  }
}

void NetService::reportRefusal(const Error& e) {
  // A peer failure is the initiator's (it left mid-request); anything else happened here,
  // where nobody else learns of it: the initiator sees its connection refused and names
  // this rank's process, which must say why.
  if (e.code() == ErrorCode::kPeerFailure) return;
  const auto now = Clock::now();
  if (lastReport_ != Clock::time_point{} && now - lastReport_ < std::chrono::seconds(10)) return;
  lastReport_ = now;
  std::fprintf(stderr,
               "loom: the network service of process %d could not accept a connection: %s "
               "(its peer is turned away; if descriptors ran out, raise the open-file limit: "
               "ulimit -n)\n",
               static_cast<int>(::getpid()), e.detail().c_str());
}

void NetService::makeRoomForShortage(const Error& e) {
  // This process out of descriptors or memory (kSystem; a peer's failure is the peer's):
  // the connection waiting longest that has said nothing goes at once (or else the oldest
  // waiting for its communicator), so that the next may be a member's. One in the middle
  // of its handshake stays: closing it would fail a member's communicator.
  if (e.code() != ErrorCode::kSystem) return;
  size_t oldest = oldestOf(pending_, [](const ReceiveChannel& c) { return c.saidNothing(); });
  if (oldest == pending_.size()) {
    oldest = oldestOf(pending_, [](const ReceiveChannel& c) { return c.awaitingLookup(); });
  }
  if (oldest != pending_.size()) closePending(oldest);
}

void NetService::closePending(size_t i) {
  refused_.fetch_add(1, std::memory_order_relaxed);
  pending_[i] = std::move(pending_.back());
  pending_.pop_back();
}

void NetService::makeRoom(Clock::time_point now) {
  // Strangers that connect and never say anything would otherwise hold every slot for the
  // handshake's 10 s: when crowded, the oldest of them past the crowded hold goes. One that
  // named a communicator this process does not know yet may be a member whose process
  // registers it late (a child communicator made a little later on this host): those go
  // only where no silent one is past the hold, oldest first, for anyone can name an unknown
  // communicator, and a stranger renewing such Hellos would otherwise hold every slot and
  // stall every new connection of the job (a young silent one must not shield them either).
  // A member's connection closed so is turned away and made again (NetLink), a little later.
  // One in the middle of its handshake for a known communicator stays, as where descriptors
  // run short: its initiator may have the reply and have sent its proof, and would read the
  // closing as this rank lost; the handshake's own limit ends it.
  const auto pastHold = [&](size_t i) { return now - pending_[i].since > limits_.crowdedHold; };
  size_t oldest = oldestOf(pending_, [](const ReceiveChannel& c) { return c.saidNothing(); });
  if (oldest == pending_.size() || !pastHold(oldest)) {
    oldest = oldestOf(pending_, [](const ReceiveChannel& c) { return c.awaitingLookup(); });
  }
  if (oldest != pending_.size() && pastHold(oldest)) closePending(oldest);
}

void NetService::advance(Clock::time_point now) {
  for (size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    bool done = false;
    bool drop = false;
    try {
      done = p.channel->ready();
    } catch (const Error&) {
      drop = true;  // refused: the channel's message said why; the initiator learns by closure
    }
    if (!done && !drop) {
      // The handshake has its own time once the communicator is known.
      if (p.channel->awaitingLookup()) {
        p.waited = true;
        drop = now - p.since > limits_.unexpectedHold;
      } else {
        if (p.waited) {
          p.waited = false;
          p.since = now;
        }
        drop = now - p.since > limits_.handshake;
      }
    }
    if (done) {
      const Hello& h = p.channel->announced();
      const Key key{h.comm, h.sender, h.receiver, h.channel};
      std::lock_guard<std::mutex> lock(mutex_);
      // Otherwise it closes with its entry below, outside the lock (its receiver may have
      // left while it proved itself: nobody would claim it).
      if (discarded_.erase(key) == 0 && expected_.count(h.comm) &&
          !departedNow(h.comm, h.receiver)) {
        proven_[key] = std::move(p.channel);
      }
    }
    if (done || drop) {
      if (drop) refused_.fetch_add(1, std::memory_order_relaxed);
      pending_[i] = std::move(pending_.back());
      pending_.pop_back();
      continue;
    }
    ++i;
  }
}

}  // namespace loom::net
