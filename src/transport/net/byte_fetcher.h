#pragma once

// The reader's side of the byte-fetch protocol (fetch_wire.h): copies byte ranges of a
// source of another process's ByteServer into this process's memory. One connection pair
// per server, made on the first fetch from it and kept (those whose server has left go when
// the reader next connects to a new one); a fetch from it waits for the one before. Whoever
// calls fetch() drives the connection; nothing runs in the background but the NetService
// that accepts the servers' reply channels.

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include "transport/net/byte_server.h"
#include "transport/net/fetch_wire.h"

namespace loom::net {

class ByteFetcher {
 public:
  /// Fetches over `service` (which it tells to expect the identity's traffic).
  ByteFetcher(NetService& service, Fabric& fabric, FetchIdentity identity,
              ChannelShape shape = ByteServer::defaultShape());
  ~ByteFetcher();
  ByteFetcher(const ByteFetcher&) = delete;
  ByteFetcher& operator=(const ByteFetcher&) = delete;

  /// This process's fetcher over NetService::instance(), made on the first call (same rules
  /// as ByteServer::instance).
  static ByteFetcher& instance(const FetchIdentity& identity);

  /// What a fetch found.
  struct Outcome {
    SourceState state = SourceState::kUnknown;
    uint64_t generation = 0;  ///< the source's generation when the server looked
    uint64_t progress = 0;    ///< of the write under way (kWriting)
    bool unchanged = false;   ///< kWhole: the bytes are those of the generation asked for
  };

  /// Asks server `server` at `address` for `ranges` (merged, ascending) of `source` as of
  /// `generation`; if the source holds that generation whole, its bytes land in `dst` at
  /// their offsets (`dst` holds `dstBytes`). Throws Error(kTimeout) at `deadline`,
  /// Error(kPeerFailure) if the server is unreachable, gone, or breaks the protocol, and
  /// Error(kAborted) once `stop` (if given) is set while it waits (the connection is then
  /// dropped, and the next fetch, or one waiting for this one, makes a new one).
  Outcome fetch(const std::string& address, int server, const SourceId& source, uint64_t generation,
                std::span<const ByteRange> ranges, uint8_t* dst, uint64_t dstBytes,
                std::chrono::steady_clock::time_point deadline,
                const std::atomic<bool>* stop = nullptr);

  /// Connections open now (tests).
  size_t connections();

 private:
  struct Connection;
  std::shared_ptr<Connection> connection(const std::string& address, int server);
  /// Whether an idle connection (its mutex held) leads nowhere any more: its server said
  /// goodbye, its connection broke, or it sat unused past the servers' quiet limit.
  bool gone(Connection& c);
  /// Gives up a broken connection (its mutex held): closes both channels, and forgets it.
  void drop(const std::shared_ptr<Connection>& c);
  Outcome exchange(Connection& c, const SourceId& source, uint64_t generation,
                   std::span<const ByteRange> ranges, uint8_t* dst,
                   std::chrono::steady_clock::time_point deadline, const std::atomic<bool>* stop);

  NetService& service_;
  Fabric& fabric_;
  const FetchIdentity identity_;
  const ChannelShape shape_;
  std::atomic<uint32_t> made_{0};  // connections made so far (their channel numbers)
  std::mutex mutex_;
  std::map<std::pair<std::string, int>, std::shared_ptr<Connection>> connections_;
};

}  // namespace loom::net
