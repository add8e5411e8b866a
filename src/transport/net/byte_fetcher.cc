// Fetching byte ranges from other hosts' servers.

#include "transport/net/byte_fetcher.h"

#include <thread>
#include <vector>

#include "loom/error.h"

namespace loom::net {

namespace {

using Clock = std::chrono::steady_clock;

// Paces a wait on a connection: spins while bytes flow, then naps up to 100 us (the reader
// is waiting, so never long), throws Error(kAborted) once `stop` is set and Error(kTimeout)
// at the deadline.
class Pacer {
 public:
  Pacer(Clock::time_point deadline, int id, const std::atomic<bool>* stop)
      : deadline_(deadline), id_(id), stop_(stop) {}
  void moved() { pause_ = std::chrono::microseconds(0); }
  template <class Describe>
  void idle(const Describe& what) {
    if (stop_ != nullptr && stop_->load(std::memory_order_relaxed)) {
      throw Error(ErrorCode::kAborted, "fetch", id_, what() + " was stopped by its caller");
    }
    if (Clock::now() > deadline_) {
      throw Error(ErrorCode::kTimeout, "fetch", id_, what() + " took longer than the timeout");
    }
    if (pause_.count() > 0) std::this_thread::sleep_for(pause_);
    pause_ = std::min(std::chrono::microseconds(100), pause_ * 2 + std::chrono::microseconds(5));
  }

 private:
  const Clock::time_point deadline_;
  const int id_;
  const std::atomic<bool>* const stop_;
  std::chrono::microseconds pause_{0};
};

}  // namespace

struct ByteFetcher::Connection {
  std::timed_mutex mutex;  // one fetch at a time (timed: a waiting fetch may be stopped)
  std::string address;
  int server = 0;
  uint32_t requestChannel = 0;         // even; the replies come on the next
  std::unique_ptr<SendChannel> out;    // requests
  std::unique_ptr<ReceiveChannel> in;  // replies, once the server connected back
  uint64_t sequence = 0;
  uint64_t fetched = 0;                   // exchanges it finished
  Clock::time_point used = Clock::now();  // when its last fetch ended
  std::atomic<bool> broken{false};        // written under `mutex`, read under the fetcher's too
  std::string peer() const {
    return "the tensor-store server " + std::to_string(server) + " at " + address;
  }
};

ByteFetcher::ByteFetcher(NetService& service, Fabric& fabric, FetchIdentity identity,
                         ChannelShape shape)
    : service_(service), fabric_(fabric), identity_(identity), shape_(shape) {
  service_.expect(identity_.comm, identity_.secret, shape_);
}

ByteFetcher::~ByteFetcher() = default;

ByteFetcher& ByteFetcher::instance(const FetchIdentity& identity) {
  // Asked first on every call: it refuses a process forked from the one that made these.
  NetService& service = NetService::instance();
  // Made after NetService::instance(), so destroyed before it.
  static ByteFetcher fetcher(service, Fabric::instance(), identity);
  if (!(fetcher.identity_ == identity)) {
    throw Error(ErrorCode::kInvalidArgument, "fetch", identity.id,
                "this process already reads tensor-store buffers of another job (its Store "
                "gave other credentials); one process reads from one job");
  }
  return fetcher;
}

size_t ByteFetcher::connections() {
  std::lock_guard<std::mutex> lock(mutex_);
  return connections_.size();
}

std::shared_ptr<ByteFetcher::Connection> ByteFetcher::connection(const std::string& address,
                                                                 int server) {
  // The other connections no fetch is using, each held while it is looked at.
  std::vector<std::pair<std::shared_ptr<Connection>, std::unique_lock<std::timed_mutex>>> idle;
  std::shared_ptr<Connection> made;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = connections_[{address, server}];
    if (slot && !slot->broken) return slot;
    made = slot = std::make_shared<Connection>();
    made->address = address;
    made->server = server;
    made->requestChannel = 2 * made_.fetch_add(1, std::memory_order_relaxed);
    for (auto& [key, c] : connections_) {
      if (c == made) continue;
      // Only tried: a fetch holds its connection's mutex while it takes this one's (drop).
      std::unique_lock<std::timed_mutex> held(c->mutex, std::try_to_lock);
      if (held.owns_lock()) idle.emplace_back(c, std::move(held));
    }
  }
  // A new server: the connections to servers gone since are given up now, or a reader that
  // outlives many writers (a generator across a trainer's restarts) would keep two channels'
  // buffers and their sockets for every writer process it ever read.
  for (auto& [c, held] : idle) {
    if (gone(*c)) drop(c);
  }
  return made;
}

bool ByteFetcher::gone(Connection& c) {
  if (c.broken) return true;
  // The server has ended its session by now (ByteServer::kQuietLimit), or its host vanished.
  if (Clock::now() - c.used > ByteServer::kQuietLimit) return true;
  try {
    // A goodbye, or a connection the server's exit closed, is only seen when polled.
    if (c.out) c.out->progress();
    if (c.in) c.in->readable();
  } catch (const Error&) {
    return true;
  }
  return (c.out && c.out->peerLeft()) || (c.in && c.in->peerLeft());
}

ByteFetcher::Outcome ByteFetcher::fetch(const std::string& address, int server,
                                        const SourceId& source, uint64_t generation,
                                        std::span<const ByteRange> ranges, uint8_t* dst,
                                        uint64_t dstBytes, Clock::time_point deadline,
                                        const std::atomic<bool>* stop) {
  if (ranges.empty() || ranges.size() > kMaxRanges) {
    throw Error(ErrorCode::kInvalidArgument, "fetch", identity_.id,
                "a fetch takes 1 to " + std::to_string(kMaxRanges) + " ranges, not " +
                    std::to_string(ranges.size()));
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    const ByteRange& r = ranges[i];
    if (r.length == 0 || r.offset > dstBytes || r.length > dstBytes - r.offset ||
        (i > 0 && r.offset < ranges[i - 1].offset + ranges[i - 1].length)) {
      throw Error(ErrorCode::kInvalidArgument, "fetch", identity_.id,
                  "range " + std::to_string(i) + " (" + std::to_string(r.offset) + " + " +
                      std::to_string(r.length) + ") is empty, out of order or past the " +
                      std::to_string(dstBytes) + " bytes of the destination");
    }
  }
  std::optional<Error> closedBefore;  // a kept connection the server had closed, tried again
  for (;;) {
    const auto c = connection(address, server);
    // Behind another fetch of this server (one stalled on a vanished host, say), this one
    // still honours its own stop flag and deadline.
    std::unique_lock<std::timed_mutex> lock(c->mutex, std::defer_lock);
    Pacer pacer(deadline, identity_.id, stop);
    while (!lock.try_lock_for(std::chrono::milliseconds(1))) {
      pacer.idle([&] { return "waiting for another fetch from " + c->peer(); });
    }
    // The fetch this one waited for broke it: connection() now makes a new one.
    if (c->broken) continue;
    try {
      const Outcome outcome = exchange(*c, source, generation, ranges, dst, deadline, stop);
      ++c->fetched;
      c->used = Clock::now();
      return outcome;
    } catch (const Error& e) {
      const bool closed = (c->out && c->out->peerLeft()) || (c->in && c->in->peerLeft());
      // Whatever was under way is lost mid-stream: the next fetch starts a new connection.
      drop(c);
      if (e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kAborted) throw;
      Error broke(e.code(), "fetch", identity_.id,
                  "the connection to " + c->peer() + " broke: " + e.detail());
      // A server ends a reader's session after ByteServer::kQuietLimit without a word: a
      // connection kept since then is closed, and the fetch goes again on a new one, once (a
      // fetch only reads, so it may). A server that is gone fails that one too: then the
      // first reason is the one to give.
      if (closed && c->fetched > 0 && !closedBefore) {
        closedBefore = std::move(broke);
        continue;
      }
      if (closedBefore) throw *closedBefore;
      throw broke;
    }
  }
}

void ByteFetcher::drop(const std::shared_ptr<Connection>& c) {
  c->broken = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = connections_.find({c->address, c->server});
    if (it != connections_.end() && it->second == c) connections_.erase(it);
  }
  // Closed at once, so the server's session for it ends and lets go of the buffer it was
  // sending; the reply channel goes too, or, not claimed yet, is closed as it arrives.
  if (c->out) c->out->closeWithoutFlush();
  c->out.reset();
  if (c->in) {
    c->in.reset();
  } else {
    service_.discard(identity_.comm, c->server, identity_.id, c->requestChannel + 1);
  }
}

ByteFetcher::Outcome ByteFetcher::exchange(Connection& c, const SourceId& source,
                                           uint64_t generation, std::span<const ByteRange> ranges,
                                           uint8_t* dst, Clock::time_point deadline,
                                           const std::atomic<bool>* stop) {
  Pacer pacer(deadline, identity_.id, stop);
  const auto violation = [&](const std::string& what) {
    throw Error(ErrorCode::kPeerFailure, "fetch", identity_.id, c.peer() + " " + what);
  };
  const auto requireOpen = [&] {
    if (c.out && c.out->peerLeft() && !c.in) {
      // Closed before its reply channel ever came: the writer left, or it could not connect
      // back to this reader (it drops the session then; its stderr says why).
      violation("closed before it connected back to this reader at " + service_.address() +
                ": its writer closed the store or exited, or it cannot reach that address "
                "(LOOM_NET_IFNAME chooses this host's interface)");
    }
    if ((c.out && c.out->peerLeft()) || (c.in && c.in->peerLeft())) {
      violation("closed: its writer closed the store or exited");
    }
  };
  // Writes one whole message on the request channel.
  const auto send = [&](FetchTag tag, const std::vector<uint8_t>& bytes, const char* what) {
    uint64_t done = 0;
    while (!c.out->write({static_cast<int>(tag), bytes.size()}, bytes.data(), done)) {
      requireOpen();
      pacer.idle([&] { return std::string("sending the ") + what + " to " + c.peer(); });
    }
    c.out->progress();
    pacer.moved();
  };
  // The next message's envelope on the reply channel (claimed once the server connected it).
  const auto next = [&](const char* what) {
    while (true) {
      c.out->progress();
      if (!c.in) {
        c.in = service_.claim(identity_.comm, c.server, identity_.id, c.requestChannel + 1);
      }
      if (c.in) {
        if (auto envelope = c.in->nextEnvelope()) {
          pacer.moved();
          return *envelope;
        }
      }
      requireOpen();
      pacer.idle([&] { return std::string("waiting for the ") + what + " from " + c.peer(); });
    }
  };
  // Reads `n` payload bytes of the current message into `out`.
  const auto read = [&](uint8_t* out, uint64_t n, const char* what) {
    for (uint64_t filled = 0; filled < n;) {
      const size_t got = c.in->read(out + filled, n - filled);
      filled += got;
      if (got > 0) {
        pacer.moved();
      } else {
        requireOpen();
        pacer.idle([&] { return std::string("receiving the ") + what + " from " + c.peer(); });
      }
    }
  };
  // A whole small message of kind `tag`.
  const auto receive = [&](FetchTag tag, uint64_t limit, const char* what) {
    const Envelope envelope = next(what);
    if (envelope.tag != static_cast<int>(tag) || envelope.bytes > limit) {
      violation("sent message " + std::to_string(envelope.tag) + " of " +
                std::to_string(envelope.bytes) + " bytes where the " + what + " belonged");
    }
    std::vector<uint8_t> bytes(envelope.bytes);
    read(bytes.data(), bytes.size(), what);
    return bytes;
  };

  if (!c.out) {
    Hello hello;
    hello.comm = identity_.comm;
    hello.sender = identity_.id;
    hello.receiver = c.server;
    hello.channel = c.requestChannel;
    c.out = std::make_unique<SendChannel>(fabric_, c.address, hello, identity_.secret, shape_);
    FetchIntroduction intro;
    intro.address = service_.address();
    intro.replyChannel = c.requestChannel + 1;
    send(FetchTag::kIntroduction, encodeIntroduction(intro), "introduction");
  }
  FetchRequest request;
  request.sequence = ++c.sequence;
  request.source = source;
  request.generation = generation;
  request.ranges.assign(ranges.begin(), ranges.end());
  send(FetchTag::kRequest, encodeRequest(request), "request");

  const auto reply = parseReply(receive(FetchTag::kReply, kReplyBytes, "reply"));
  if (!reply || reply->sequence != request.sequence) violation("sent a malformed reply");
  Outcome outcome;
  outcome.state = reply->state;
  outcome.generation = reply->generation;
  outcome.progress = reply->progress;
  if (reply->state != SourceState::kWhole) return outcome;
  for (const ByteRange& r : ranges) {
    // Data messages split a range where the server chooses: each envelope says how much.
    for (uint64_t at = 0; at < r.length;) {
      const Envelope envelope = next("bytes");
      if (envelope.tag != static_cast<int>(FetchTag::kData) || envelope.bytes == 0 ||
          envelope.bytes > r.length - at) {
        violation("sent " + std::to_string(envelope.bytes) + " bytes (message " +
                  std::to_string(envelope.tag) + ") where " + std::to_string(r.length - at) +
                  " bytes of a range were due");
      }
      read(dst + r.offset + at, envelope.bytes, "bytes");
      at += envelope.bytes;
    }
  }
  const auto trailer = parseTrailer(receive(FetchTag::kTrailer, kTrailerBytes, "trailer"));
  if (!trailer || trailer->sequence != request.sequence) violation("sent a malformed trailer");
  outcome.unchanged = trailer->unchanged;
  return outcome;
}

}  // namespace loom::net
