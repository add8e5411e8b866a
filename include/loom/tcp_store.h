#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom/store.h"

namespace loom {

/// The server side of TcpStore: one thread answering many clients with poll(). It binds in
/// the constructor and serves once start() is called, so a launcher can bind, fork its ranks
/// and only then start the thread (fork and threads do not mix).
class TcpStoreServer {
 public:
  /// Binds and listens on host:port; port 0 picks a free port. Throws Error(kSystem).
  TcpStoreServer(const std::string& host, uint16_t port);
  /// Stops the thread and closes every socket.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  /// The port actually bound.
  uint16_t port() const { return port_; }
  /// Starts serving on a background thread.
  void start();
  /// In a forked child: forget the listening socket without serving or touching the parent's.
  void closeInChild();

 private:
  void serve();
  int listenFd_ = -1;
  int wakeFd_ = -1;  // eventfd that tells the thread to stop
  uint16_t port_ = 0;
  std::thread thread_;
};

/// A client of TcpStoreServer. Thread-safe: each request takes an idle connection from a
/// small pool (opening one if none is idle), so a get() blocked on a missing key never
/// holds up another thread's set().
class TcpStore : public Store {
 public:
  /// Connects to host:port, retrying until `timeout` (the server may start after the client).
  /// A reply that takes `replyMargin` (positive) longer than the request asks the server to
  /// wait (a get's timeout; nothing for the others) fails the request as a lost peer
  /// (kPeerFailure, naming the server): a server whose host died or was cut off sends
  /// nothing, not even a closing.
  TcpStore(const std::string& host, uint16_t port,
           std::chrono::milliseconds timeout = std::chrono::seconds(60),
           std::chrono::milliseconds replyMargin = std::chrono::seconds(60));
  ~TcpStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  bool erase(const std::string& key) override;

 private:
  /// Sends `request` and reads its reply, which the server may hold up to `serverWait`.
  Bytes roundTrip(const Bytes& request, const char* what,
                  std::chrono::milliseconds serverWait = std::chrono::milliseconds(0));
  int connectOnce(std::chrono::milliseconds timeout);
  std::string host_;
  uint16_t port_;
  std::string endpoint_;
  std::chrono::milliseconds replyMargin_;
  std::mutex mutex_;
  std::vector<int> idle_;  // connected sockets not in use; guarded by mutex_
};

}  // namespace loom
