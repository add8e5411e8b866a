#pragma once

// The writer's side of the byte-fetch protocol (fetch_wire.h): serves the bytes of the
// sources this process publishes (the tensor store's buffers) to readers on other hosts.
// One thread takes each reader's proven request channel from the NetService and hands the
// reader's session to a worker thread (one per reader, up to kMaxWorkers; beyond, readers
// share them in turn), which connects the reply channel back to the address the reader
// introduces and answers its requests one at a time, sending straight from the source (the
// channel copies into its frames). Each connection's sends cost a core's time in the
// provider, so readers served by threads of their own fetch side by side. A reader that dies
// or breaks the protocol loses its session and nothing else; the sources stay the
// publisher's.

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "transport/net/channel.h"
#include "transport/net/fetch_wire.h"
#include "transport/net/net_service.h"

namespace loom::net {

/// Bytes a ByteServer sends, under a sequence lock: the generation is odd while the owner
/// rewrites them and even when they are whole (transport/shm/region.h).
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  /// Bytes a request may read.
  virtual uint64_t capacity() const = 0;
  virtual uint64_t generation() const = 0;
  /// Bytes of the write under way already written.
  virtual uint64_t progress() const = 0;
  /// True if no write began since `generation` (call after sending the bytes).
  virtual bool unchangedSince(uint64_t generation) const = 0;
  /// Where a source stages bytes it cannot send in place. Each reader's session holds its
  /// own, since the server sends from several sessions' chunks of one source at once.
  class Staging {
   public:
    virtual ~Staging() = default;
  };
  /// Host memory holding the first bytes of [offset, offset + length): in place, or staged
  /// into `staging` (which the source makes on first need): then fewer, valid until the next
  /// call with that staging. Safe to call from several threads with different stagings.
  virtual std::span<const uint8_t> bytes(uint64_t offset, uint64_t length,
                                         std::unique_ptr<Staging>& staging) = 0;
};

/// Who a ByteServer or ByteFetcher is in the job: the traffic its channels announce and the
/// secret they prove. `id` is unique among the job's servers and fetchers.
struct FetchIdentity {
  CommId comm{};
  JobSecret secret{};
  int id = 0;
  bool operator==(const FetchIdentity&) const = default;
};

class ByteServer {
 public:
  /// How long a reader's session may go without moving a byte or a request before it ends:
  /// a reader whose host vanished (no goodbye, no reset) would otherwise hold its session,
  /// its staging and the source it was sent forever. A live reader whose session ended
  /// this way connects again on its next fetch.
  static constexpr std::chrono::milliseconds kQuietLimit{60000};

  /// Serves over `service` (which it tells to expect the identity's traffic); sessions end
  /// after `quietLimit` without a word.
  ByteServer(NetService& service, Fabric& fabric, FetchIdentity identity,
             ChannelShape shape = defaultShape(),
             std::chrono::milliseconds quietLimit = kQuietLimit);
  /// Stops the thread; readers' sessions close (their fetches fail as the writer's leaving).
  ~ByteServer();
  ByteServer(const ByteServer&) = delete;
  ByteServer& operator=(const ByteServer&) = delete;

  /// This process's server over NetService::instance(), started on the first call. Throws
  /// Error(kInvalidArgument) if a later call names another identity, Error(kUnsupported) if
  /// the fabric cannot open here.
  static ByteServer& instance(const FetchIdentity& identity);
  /// The channels' window: 32 frames of 256 KiB.
  static ChannelShape defaultShape() { return {size_t{256} << 10, 32}; }
  /// Worker threads at most (readers beyond share them).
  static constexpr size_t kMaxWorkers = 8;

  /// Where readers connect ("ip:port").
  const std::string& address() const { return service_.address(); }
  const FetchIdentity& identity() const { return identity_; }
  /// Serves `source` as `id` (replacing any source of that id).
  void publish(const SourceId& id, std::shared_ptr<ByteSource> source);
  /// Stops serving `id`: later requests find kUnknown (one being answered finishes).
  void withdraw(const SourceId& id);
  /// Requests answered so far, and readers' sessions open now (tests, reports).
  uint64_t answered() const { return answered_.load(std::memory_order_relaxed); }
  size_t sessions() const { return sessionCount_.load(std::memory_order_relaxed); }

 private:
  struct Session;
  struct Worker;
  /// The acceptor: new readers' sessions to workers.
  void run();
  /// A worker: its readers' sessions, in turn.
  void serve(Worker& worker);
  /// Starts one more worker; false (reported once) where no thread can be had.
  bool addWorker();
  /// Moves one session along; true if anything moved. Throws Error when its reader is gone
  /// or broke the protocol.
  bool advance(Session& session);
  bool readRequest(Session& session);
  void startReply(Session& session, const FetchRequest& request);
  bool writeReply(Session& session);

  NetService& service_;
  Fabric& fabric_;
  const FetchIdentity identity_;
  const ChannelShape shape_;
  const std::chrono::milliseconds quietLimit_;
  std::mutex mutex_;
  std::map<SourceId, std::shared_ptr<ByteSource>> sources_;  // guarded by mutex_
  std::vector<std::unique_ptr<Worker>> workers_;             // the acceptor's (and ~ByteServer's)
  size_t nextWorker_ = 0;
  bool threadShortageReported_ = false;  // the acceptor's
  std::atomic<uint64_t> answered_{0};
  std::atomic<size_t> sessionCount_{0};
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace loom::net
