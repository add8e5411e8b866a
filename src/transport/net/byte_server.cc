// Answering readers' byte-fetch requests, readers in turn.

#include "transport/net/byte_server.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <system_error>

#include "loom/error.h"
#include "util/posix.h"

namespace loom::net {

namespace {

// The most bytes one Data message carries: big enough that per-message costs vanish, small
// enough that a staged source needs little host memory.
constexpr uint64_t kDataMessageBytes = uint64_t{16} << 20;

using Clock = std::chrono::steady_clock;

// A reader whose session ends so sees only its request channel close (its error names that
// cause among others): said here, where the cause is known.
void sayCannotConnectBack(int server, int reader, const std::string& address, const Error& e) {
  std::fprintf(stderr,
               "loom: tensor store server %d could not connect back to reader %d at %s (the "
               "address it introduced): %s\n",
               server, reader, address.c_str(), e.what());
}

}  // namespace

struct ByteServer::Session {
  explicit Session(std::unique_ptr<ReceiveChannel> channel) : in(std::move(channel)) {}
  int reader() const { return in->announced().sender; }

  std::chrono::steady_clock::time_point lastMoved = std::chrono::steady_clock::now();
  std::unique_ptr<ReceiveChannel> in;  // the reader's requests
  std::unique_ptr<SendChannel> out;    // the replies, once the reader introduced itself
  bool replied = false;                // a reply went out on `out`: it reached the reader
  // The message being read.
  std::optional<Envelope> incoming;
  std::vector<uint8_t> message;
  size_t filled = 0;
  // The answer being written.
  enum class Stage { kIdle, kReply, kData, kTrailer } stage = Stage::kIdle;
  std::vector<uint8_t> head;  // the Reply or Trailer
  uint64_t done = 0;          // bytes of the current message handed over
  FetchRequest request;
  std::shared_ptr<ByteSource> source;            // while its bytes are sent
  std::unique_ptr<ByteSource::Staging> staging;  // the source's, for this session alone
  size_t range = 0;                              // the range being sent
  uint64_t sent = 0;                             // bytes of it in whole Data messages
  std::span<const uint8_t> chunk;                // the Data message being written
};

struct ByteServer::Worker {
  std::mutex mutex;
  std::vector<std::unique_ptr<Session>> arriving;  // guarded by mutex: handed over by the acceptor
  std::thread thread;
};

ByteServer::ByteServer(NetService& service, Fabric& fabric, FetchIdentity identity,
                       ChannelShape shape, std::chrono::milliseconds quietLimit)
    : service_(service),
      fabric_(fabric),
      identity_(identity),
      shape_(shape),
      quietLimit_(quietLimit) {
  service_.expect(identity_.comm, identity_.secret, shape_);
  thread_ = std::thread([this] {
    posix::nameThisThread("loom-bytes");
    run();
  });
}

ByteServer::~ByteServer() {
  stopping_.store(true, std::memory_order_release);
  thread_.join();
  for (auto& worker : workers_) worker->thread.join();
}

ByteServer& ByteServer::instance(const FetchIdentity& identity) {
  // Asked first on every call: it refuses a process forked from the one that made these.
  NetService& service = NetService::instance();
  // Made after NetService::instance(), so destroyed before it.
  static ByteServer server(service, Fabric::instance(), identity);
  if (!(server.identity() == identity)) {
    throw Error(ErrorCode::kInvalidArgument, "serve", identity.id,
                "this process already serves its tensor-store buffers to another job (its "
                "Store gave other credentials); one process serves one job");
  }
  return server;
}

void ByteServer::publish(const SourceId& id, std::shared_ptr<ByteSource> source) {
  std::lock_guard<std::mutex> lock(mutex_);
  sources_[id] = std::move(source);
}

void ByteServer::withdraw(const SourceId& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  sources_.erase(id);
}

void ByteServer::run() {
  while (!stopping_.load(std::memory_order_acquire)) {
    while (auto in = service_.claimAny(identity_.comm, identity_.id, isRequestChannel)) {
      size_t w = nextWorker_++ % kMaxWorkers;  // never past workers_.size()
      if (w == workers_.size() && !addWorker()) {
        // No thread to be had (a pids limit): the workers there are take the reader, from
        // the first on, and another is tried after them; with none, its connection closes
        // here and its fetch fails naming this host.
        nextWorker_ = workers_.empty() ? 0 : 1;
        if (workers_.empty()) continue;
        w = 0;
      }
      std::lock_guard<std::mutex> lock(workers_[w]->mutex);
      workers_[w]->arriving.push_back(std::make_unique<Session>(std::move(in)));
      sessionCount_.fetch_add(1, std::memory_order_relaxed);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // readers arrive seldom
  }
}

bool ByteServer::addWorker() {
  workers_.push_back(std::make_unique<Worker>());
  Worker& worker = *workers_.back();
  try {
    worker.thread = std::thread([this, &worker] {
      posix::nameThisThread("loom-bytes-send");
      serve(worker);
    });
    return true;
  } catch (const std::system_error& e) {
    workers_.pop_back();
    if (!threadShortageReported_) {
      threadShortageReported_ = true;
      std::fprintf(stderr,
                   "loom: the tensor-store server of process %d could not start a sending "
                   "thread (%s); its %zu threads serve every reader (raise the process or "
                   "pids limit)\n",
                   static_cast<int>(::getpid()), e.what(), workers_.size());
    }
    return false;
  }
}

void ByteServer::serve(Worker& worker) {
  std::vector<std::unique_ptr<Session>> sessions;
  auto idleSince = Clock::now();
  while (!stopping_.load(std::memory_order_acquire)) {
    bool moved = false;
    {
      std::lock_guard<std::mutex> lock(worker.mutex);
      for (auto& s : worker.arriving) sessions.push_back(std::move(s));
      moved = !worker.arriving.empty();
      worker.arriving.clear();
    }
    const auto now = Clock::now();
    for (size_t i = 0; i < sessions.size();) {
      bool drop = false;
      Session& s = *sessions[i];
      try {
        if (advance(s)) {
          moved = true;
          s.lastMoved = now;
        }
        // The reader closed normally: either of its channels says so (one waiting for a
        // reply is not read until the reply is out, which the reader no longer takes).
        drop = s.in->peerLeft() || (s.out && s.out->peerLeft());
        if (!drop && now - s.lastMoved > quietLimit_) {
          // Quiet too long: idle, or a reply no credits come back for. Its reader's host may
          // be gone without a word (no FIN over a cut link); a live reader connects again.
          // Not flushed: its frames would wait out a vanished reader.
          drop = true;
          if (s.out) s.out->closeWithoutFlush();
        }
      } catch (const Error& e) {
        drop = true;  // the reader died or broke the protocol: its session alone ends
        // Connecting back to it failed (the reply channel's errors name its peer, the address
        // the reader introduced; the request channel's the reader's own end).
        if (s.out && !s.replied && e.detail().find(s.out->peer()) != std::string::npos) {
          sayCannotConnectBack(identity_.id, s.reader(), s.out->peer(), e);
        }
      }
      if (drop) {
        sessions.erase(sessions.begin() + static_cast<std::ptrdiff_t>(i));
        sessionCount_.fetch_sub(1, std::memory_order_relaxed);
        continue;
      }
      ++i;
    }
    // Idle, the worker naps: briefly while readers are fetching (their next request follows
    // soon), longer the longer nothing comes.
    if (moved) {
      idleSince = now;
      continue;
    }
    const auto idle = now - idleSince;
    std::this_thread::sleep_for(
        sessions.empty() || idle > std::chrono::seconds(1) ? std::chrono::microseconds(2000)
        : idle > std::chrono::milliseconds(10)             ? std::chrono::microseconds(500)
                                                           : std::chrono::microseconds(50));
  }
  sessionCount_.fetch_sub(sessions.size(), std::memory_order_relaxed);
}

bool ByteServer::advance(Session& s) {
  bool moved = false;
  if (s.out) s.out->progress();
  if (s.stage == Session::Stage::kIdle) moved |= readRequest(s);
  if (s.stage != Session::Stage::kIdle) moved |= writeReply(s);
  return moved;
}

bool ByteServer::readRequest(Session& s) {
  const auto violation = [&](const std::string& what) {
    throw Error(ErrorCode::kPeerFailure, "serve", identity_.id,
                "reader " + std::to_string(s.reader()) + " at " + s.in->peer() + " " + what);
  };
  if (!s.incoming) {
    s.incoming = s.in->nextEnvelope();
    if (!s.incoming) return false;
    const size_t limit = s.out ? kMaxRequestBytes : 4 + 4 + kMaxAddressBytes + 4;
    if (s.incoming->bytes > limit) {
      violation("sent a message of " + std::to_string(s.incoming->bytes) + " bytes");
    }
    s.message.resize(s.incoming->bytes);
    s.filled = 0;
  }
  s.filled += s.in->read(s.message.data() + s.filled, s.message.size() - s.filled);
  if (s.filled < s.message.size()) return s.filled > 0;
  const auto tag = static_cast<FetchTag>(s.incoming->tag);
  s.incoming.reset();
  if (!s.out) {
    const auto intro = tag == FetchTag::kIntroduction ? parseIntroduction(s.message) : std::nullopt;
    if (!intro || intro->replyChannel != s.in->announced().channel + 1) {
      violation("began with something other than an introduction");
    }
    Hello hello;
    hello.comm = identity_.comm;
    hello.sender = identity_.id;
    hello.receiver = s.reader();
    hello.channel = intro->replyChannel;
    try {
      s.out =
          std::make_unique<SendChannel>(fabric_, intro->address, hello, identity_.secret, shape_);
    } catch (const Error& e) {
      sayCannotConnectBack(identity_.id, s.reader(), intro->address, e);
      throw;
    }
    return true;
  }
  auto request = tag == FetchTag::kRequest ? parseRequest(s.message) : std::nullopt;
  if (!request) violation("sent something other than a well-formed request");
  startReply(s, *request);
  return true;
}

void ByteServer::startReply(Session& s, const FetchRequest& request) {
  std::shared_ptr<ByteSource> source;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = sources_.find(request.source);
    if (it != sources_.end()) source = it->second;
  }
  FetchReply reply;
  reply.sequence = request.sequence;
  if (source) {
    const ByteRange& last = request.ranges.back();  // ascending: the furthest
    if (last.offset + last.length > source->capacity()) {
      throw Error(ErrorCode::kPeerFailure, "serve", identity_.id,
                  "reader " + std::to_string(s.reader()) + " asked for bytes up to " +
                      std::to_string(last.offset + last.length) + " of a source of " +
                      std::to_string(source->capacity()));
    }
    // The first look of the sequence lock: the generation before the bytes are read.
    const uint64_t now = source->generation();
    reply.generation = now;
    reply.progress = source->progress();
    const uint64_t want = request.generation;
    reply.state = now == want       ? SourceState::kWhole
                  : now + 1 == want ? SourceState::kWriting
                  : now < want      ? SourceState::kPending
                                    : SourceState::kReplaced;
  }
  s.head = encodeReply(reply);
  s.done = 0;
  s.stage = Session::Stage::kReply;
  s.request = request;
  s.source = reply.state == SourceState::kWhole ? std::move(source) : nullptr;
  s.staging.reset();  // made by the source it serves
  s.range = 0;
  s.sent = 0;
  s.chunk = {};
}

bool ByteServer::writeReply(Session& s) {
  using Stage = Session::Stage;
  bool moved = false;
  const auto writeHead = [&](FetchTag tag) {
    const uint64_t before = s.done;
    const bool whole = s.out->write({static_cast<int>(tag), s.head.size()}, s.head.data(), s.done);
    moved |= s.done != before;
    return whole;
  };
  if (s.stage == Stage::kReply) {
    if (!writeHead(FetchTag::kReply)) return moved;
    s.replied = true;
    s.done = 0;
    if (!s.source) {
      s.stage = Stage::kIdle;
      answered_.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    s.stage = Stage::kData;
  }
  if (s.stage == Stage::kData) {
    while (s.range < s.request.ranges.size()) {
      const ByteRange& r = s.request.ranges[s.range];
      if (s.chunk.empty()) {
        s.chunk = s.source->bytes(r.offset + s.sent, std::min(r.length - s.sent, kDataMessageBytes),
                                  s.staging);
        s.done = 0;
        if (s.chunk.empty()) {
          throw Error(ErrorCode::kInternal, "serve", identity_.id, "a source gave no bytes");
        }
      }
      const uint64_t before = s.done;
      const bool whole =
          s.out->write({static_cast<int>(FetchTag::kData), s.chunk.size()}, s.chunk.data(), s.done);
      moved |= s.done != before;
      if (!whole) return moved;
      s.sent += s.chunk.size();
      s.chunk = {};
      if (s.sent == r.length) {
        ++s.range;
        s.sent = 0;
      }
    }
    // The second look: the bytes are in the channel's frames, so whatever the owner writes
    // from here on cannot reach them.
    FetchTrailer trailer;
    trailer.sequence = s.request.sequence;
    trailer.unchanged = s.source->unchangedSince(s.request.generation);
    s.source.reset();
    s.staging.reset();
    s.head = encodeTrailer(trailer);
    s.done = 0;
    s.stage = Stage::kTrailer;
  }
  if (s.stage == Stage::kTrailer) {
    if (!writeHead(FetchTag::kTrailer)) return moved;
    s.stage = Stage::kIdle;
    answered_.fetch_add(1, std::memory_order_relaxed);
    moved = true;
  }
  return moved;
}

}  // namespace loom::net
