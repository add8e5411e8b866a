#pragma once

// libfabric, as loom uses it: connected (FI_EP_MSG) endpoints of one provider (tcp by
// default; LOOM_NET_PROVIDER picks another), on one interface of this host
// (LOOM_NET_IFNAME, else the first that is not loopback). A process has one Fabric: a
// domain and a listening endpoint whose address the bootstrap publishes. Each Endpoint is
// one connection with its own completion and event queues, polled by whoever drives it.

#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

struct fi_info;
struct fid_fabric;
struct fid_domain;
struct fid_eq;
struct fid_cq;
struct fid_ep;
struct fid_pep;

namespace loom::net {

/// One finished send or receive.
struct Completion {
  void* context = nullptr;  ///< what was passed when it was posted
  size_t length = 0;        ///< receives: bytes that arrived
  bool isReceive = false;
};

/// One connection.
class Endpoint {
 public:
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  /// Makes the connection (connects or accepts). Post the first receives before this, so
  /// nothing the peer sends first finds no buffer.
  void start();
  /// True once the connection is up; false while it is being made. Throws
  /// Error(kPeerFailure) if it was refused or has closed.
  bool connected();
  /// Offers `buffer` for the next incoming message; `context` comes back in its Completion.
  void postReceive(void* buffer, size_t bytes, void* context);
  /// Sends the gathered `parts` as one message; false if the provider is busy (try again
  /// after polling). The parts must stay untouched until the Completion.
  bool postSend(std::span<const iovec> parts, void* context);
  /// Sends a message of at most injectLimit() bytes, copied at once, with no Completion.
  bool inject(const void* data, size_t bytes);
  size_t injectLimit() const { return injectLimit_; }
  /// Most parts postSend() takes in one message.
  size_t iovLimit() const { return iovLimit_; }
  /// Moves up to `out.size()` completions into `out`; returns how many. Throws
  /// Error(kPeerFailure) if an operation failed or the connection closed.
  size_t poll(std::span<Completion> out);
  /// Who is at the other end ("address:port"), for messages.
  const std::string& peer() const { return peer_; }

 private:
  friend class Fabric;
  Endpoint() = default;
  [[noreturn]] void failClosed(const std::string& why);
  /// Takes a pending connection event, if any: notes the connection's coming up, throws if
  /// it was refused or closed.
  void takeEvent();

  fid_ep* ep_ = nullptr;
  fi_info* connectTo_ = nullptr;  // initiators: the peer's address until start()
  fid_cq* cq_ = nullptr;
  fid_eq* eq_ = nullptr;
  bool connected_ = false;
  size_t injectLimit_ = 0;
  size_t iovLimit_ = 1;
  std::string peer_;
};

/// This process's fabric.
class Fabric {
 public:
  /// The fabric, opened on first use. Throws Error(kUnsupported) if no interface offers the
  /// provider, naming what was tried and the variables that choose, or in a process forked
  /// from the one that opened it (requireOpenedHere).
  static Fabric& instance();
  /// Throws Error(kUnsupported) in a process forked from `opener` after it opened the
  /// network: libfabric's state (its providers' locks, perhaps held by a thread the child
  /// does not have; the listener's socket) is the parent's and half-made in the child.
  static void requireOpenedHere(pid_t opener);
  ~Fabric();
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  /// Where other processes connect to this one ("address:port").
  const std::string& address() const { return address_; }
  /// The provider and interface in use, for messages ("tcp on eth0").
  const std::string& description() const { return description_; }

  /// An endpoint that will connect to `address` once started (Endpoint::start, then poll
  /// Endpoint::connected() until it is up). Throws Error(kInvalidArgument) for an address
  /// that does not resolve.
  std::unique_ptr<Endpoint> connect(const std::string& address);
  /// The next incoming connection request as an endpoint that accepts it once started, or
  /// nullptr if none arrives within `wait`.
  std::unique_ptr<Endpoint> acceptNext(std::chrono::milliseconds wait);

 private:
  Fabric();
  std::unique_ptr<Endpoint> open(fi_info* info, std::string peer);
  fi_info* hints() const;
  /// Closes what the constructor opened (the destructor, or a constructor that failed).
  void closeAll() noexcept;

  const pid_t opener_;       // the process that opened it
  fi_info* info_ = nullptr;  // the chosen interface's
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_eq* listenEq_ = nullptr;
  fid_pep* listener_ = nullptr;
  std::string address_;
  std::string description_;
};

}  // namespace loom::net
