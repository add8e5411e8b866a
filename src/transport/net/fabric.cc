// libfabric endpoints over the process's one domain.

#include "transport/net/fabric.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <vector>

#include "loom/error.h"
#include "util/env.h"

namespace loom::net {

namespace {

// Debian's libfabric links its PSM provider, whose libinfinipath installs handlers for
// SIGINT, SIGTERM, SIGSEGV, SIGABRT, SIGBUS and SIGILL as it loads: they print a backtrace
// and exit(1), so Ctrl-C stopped interrupting, a crash or a kill read as exit status 1
// (torchrun reported exitcode 1 for a SIGSEGV), and exit() inside a handler can hang. This
// runs as loom loads, after the libraries it depends on, and before a program's main
// installs its own handlers: each of those signals whose handler lies in libinfinipath gets
// the default back. (Python's import of loom sets IPATH_NO_BACKTRACE first, which keeps
// libinfinipath from installing any, the interpreter's own being in place by then.)
__attribute__((constructor)) void restoreSignalsInfinipathTook() {
  for (const int sig : {SIGINT, SIGTERM, SIGSEGV, SIGABRT, SIGBUS, SIGILL}) {
    struct sigaction current {};
    if (::sigaction(sig, nullptr, &current) != 0) continue;
    void* handler = (current.sa_flags & SA_SIGINFO) != 0
                        ? reinterpret_cast<void*>(current.sa_sigaction)
                        : reinterpret_cast<void*>(current.sa_handler);
    if (handler == reinterpret_cast<void*>(SIG_DFL) || handler == reinterpret_cast<void*>(SIG_IGN))
      continue;
    Dl_info where{};
    if (::dladdr(handler, &where) == 0 || where.dli_fname == nullptr) continue;
    if (std::strstr(where.dli_fname, "libinfinipath") != nullptr) std::signal(sig, SIG_DFL);
  }
}

constexpr uint32_t kApiVersion = FI_VERSION(1, 17);
constexpr size_t kQueueDepth = 256;

std::string fiError(int rc) {
  return std::string(fi_strerror(-rc)) + " (" + std::to_string(rc) + ")";
}

// Whether a provider's error is this process running short (descriptors, memory), not
// anything the peer did: reported as this rank's failure.
bool shortHere(int rc) {
  return rc == -FI_EMFILE || rc == -FI_ENOMEM || rc == -ENFILE;
}

[[noreturn]] void fail(std::string_view what, int rc) {
  throw Error(ErrorCode::kSystem, "network", -1, std::string(what) + " failed: " + fiError(rc));
}

void check(int rc, std::string_view what) {
  if (rc != 0) fail(what, rc);
}

// "a.b.c.d:port" or "[v6]:port" for a socket address.
std::string addressText(const void* addr, size_t length) {
  char host[INET6_ADDRSTRLEN] = {};
  const auto* sa = static_cast<const sockaddr*>(addr);
  if (sa->sa_family == AF_INET && length >= sizeof(sockaddr_in)) {
    const auto* in = static_cast<const sockaddr_in*>(addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    return std::string(host) + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (sa->sa_family == AF_INET6 && length >= sizeof(sockaddr_in6)) {
    const auto* in6 = static_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(in6->sin6_port));
  }
  return "(an address of family " + std::to_string(sa->sa_family) + ")";
}

// Splits "host:port" / "[v6]:port"; false if malformed.
bool splitAddress(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return !host->empty();
}

}  // namespace

// ---- Endpoint ----

Endpoint::~Endpoint() {
  if (ep_) {
    if (connected_) fi_shutdown(ep_, 0);
    fi_close(&ep_->fid);
  }
  if (cq_) fi_close(&cq_->fid);
  if (eq_) fi_close(&eq_->fid);
  if (connectTo_) fi_freeinfo(connectTo_);
}

void Endpoint::failClosed(const std::string& why) {
  throw Error(ErrorCode::kPeerFailure, "network", -1, "connection with " + peer_ + " " + why);
}

void Endpoint::start() {
  if (connectTo_) {
    const int rc = fi_connect(ep_, connectTo_->dest_addr, nullptr, 0);
    fi_freeinfo(connectTo_);
    connectTo_ = nullptr;
    if (shortHere(rc)) fail("fi_connect", rc);
    if (rc != 0) failClosed("could not be started: " + fiError(rc));
  } else {
    const int rc = fi_accept(ep_, nullptr, 0);
    if (shortHere(rc)) fail("fi_accept", rc);
    if (rc != 0) failClosed("could not be accepted: " + fiError(rc));
  }
}

void Endpoint::takeEvent() {
  fi_eq_cm_entry entry{};
  uint32_t event = 0;
  const ssize_t rc = fi_eq_read(eq_, &event, &entry, sizeof entry, 0);
  if (rc == -FI_EAGAIN) return;
  if (rc == -FI_EAVAIL) {
    fi_eq_err_entry err{};
    fi_eq_readerr(eq_, &err, 0);
    failClosed(std::string(connected_ ? "failed: " : "was refused: ") + fi_strerror(err.err));
  }
  if (rc < 0) failClosed("failed: " + fiError(static_cast<int>(rc)));
  if (event == FI_CONNECTED) {
    connected_ = true;
  } else if (event == FI_SHUTDOWN) {
    const bool wasUp = connected_;
    connected_ = false;
    failClosed(wasUp ? "was closed by the peer" : "was closed by the peer while connecting");
  }
}

bool Endpoint::connected() {
  if (!connected_) takeEvent();
  return connected_;
}

void Endpoint::postReceive(void* buffer, size_t bytes, void* context) {
  // Callers post at most their few buffers, well under the queue's depth, so the provider
  // has no reason to refuse one.
  const ssize_t rc = fi_recv(ep_, buffer, bytes, nullptr, FI_ADDR_UNSPEC, context);
  if (shortHere(static_cast<int>(rc))) fail("fi_recv", static_cast<int>(rc));
  if (rc != 0) failClosed("refused a receive buffer: " + fiError(static_cast<int>(rc)));
}

bool Endpoint::postSend(std::span<const iovec> parts, void* context) {
  const ssize_t rc = fi_sendv(ep_, parts.data(), nullptr, parts.size(), FI_ADDR_UNSPEC, context);
  if (rc == 0) return true;
  if (rc == -FI_EAGAIN) return false;
  failClosed("failed to send: " + fiError(static_cast<int>(rc)));
}

bool Endpoint::inject(const void* data, size_t bytes) {
  const ssize_t rc = fi_inject(ep_, data, bytes, FI_ADDR_UNSPEC);
  if (rc == 0) return true;
  if (rc == -FI_EAGAIN) return false;
  failClosed("failed to send: " + fiError(static_cast<int>(rc)));
}

size_t Endpoint::poll(std::span<Completion> out) {
  fi_cq_msg_entry entries[16];
  const size_t want = std::min(out.size(), std::size(entries));
  const ssize_t rc = fi_cq_read(cq_, entries, want);
  if (rc > 0) {
    for (ssize_t i = 0; i < rc; ++i) {
      out[i].context = entries[i].op_context;
      out[i].length = entries[i].len;
      out[i].isReceive = (entries[i].flags & FI_RECV) != 0;
    }
    return static_cast<size_t>(rc);
  }
  if (rc == -FI_EAVAIL) {
    fi_cq_err_entry err{};
    fi_cq_readerr(cq_, &err, 0);
    // The provider cancels what is still posted when the other end goes away, or fails it
    // as not (or no longer) connected when the other end closed in the middle of it.
    if (err.err == FI_ECANCELED || err.err == FI_ENOTCONN || err.err == FI_ECONNRESET ||
        err.err == FI_ECONNABORTED) {
      failClosed("was closed by the peer");
    }
    failClosed("lost an operation: " + std::string(fi_strerror(err.err)));
  }
  if (rc != -FI_EAGAIN) failClosed("failed: " + fiError(static_cast<int>(rc)));
  takeEvent();  // nothing finished: check that the connection still stands
  return 0;
}

// ---- Fabric ----

Fabric& Fabric::instance() {
  // Leaked on purpose: endpoints of communicators destroyed late at exit close against it.
  static Fabric* fabric = new Fabric;
  requireOpenedHere(fabric->opener_);
  return *fabric;
}

void Fabric::requireOpenedHere(pid_t opener) {
  if (opener == ::getpid()) return;
  throw Error(ErrorCode::kUnsupported, "create", -1,
              "this process was forked from process " + std::to_string(opener) +
                  " after that one had opened loom's network (a communicator across hosts, or "
                  "the tensor store across hosts), whose state does not survive a fork; make "
                  "communicators across hosts in processes started afresh (torchrun, or "
                  "multiprocessing's 'spawn' start method), or fork before the first one");
}

fi_info* Fabric::hints() const {
  fi_info* hints = fi_allocinfo();
  if (!hints) throw Error(ErrorCode::kSystem, "network", -1, "out of memory for fi_info");
  hints->ep_attr->type = FI_EP_MSG;
  hints->caps = FI_MSG;
  hints->mode = 0;
  hints->domain_attr->mr_mode = 0;  // sends and receives from any memory, no registration
  hints->domain_attr->threading = FI_THREAD_SAFE;
  hints->fabric_attr->prov_name = strdup(env::text("LOOM_NET_PROVIDER").value_or("tcp").c_str());
  return hints;
}

Fabric::Fabric() : opener_(::getpid()) {
  fi_info* want = hints();
  fi_info* all = nullptr;
  // A process's first fi_getinfo initialises every provider libfabric was built with, the
  // asked one or not: Debian's 1.20 spends about 0.26 s there on a 2-core machine, its verbs
  // provider reading /proc/kallsyms (strace -k), and FI_PROVIDER does not skip that. loom
  // pays it once per process, on the first communicator that spans hosts.
  const int rc = fi_getinfo(kApiVersion, nullptr, nullptr, 0, want, &all);
  const std::string provider = want->fabric_attr->prov_name;
  fi_freeinfo(want);
  const std::string ifname = env::text("LOOM_NET_IFNAME").value_or("");
  std::vector<std::string> seen;
  fi_info* chosen = nullptr;
  for (fi_info* i = rc == 0 ? all : nullptr; i; i = i->next) {
    const std::string name = i->domain_attr->name ? i->domain_attr->name : "";
    if (i->addr_format != FI_SOCKADDR_IN && i->addr_format != FI_SOCKADDR_IN6) continue;
    seen.push_back(name);
    const bool wanted = ifname.empty() ? name != "lo" : name == ifname;
    if (wanted &&
        (!chosen || (chosen->addr_format == FI_SOCKADDR_IN6 && i->addr_format == FI_SOCKADDR_IN))) {
      chosen = i;  // IPv4 first: link-local IPv6 addresses need a scope to be reached
    }
  }
  if (!chosen && ifname.empty()) {
    for (fi_info* i = rc == 0 ? all : nullptr; i && !chosen; i = i->next) {
      if (i->addr_format == FI_SOCKADDR_IN && i->domain_attr->name &&
          std::string(i->domain_attr->name) == "lo") {
        chosen = i;  // a host with loopback only: ranks of other namespaces cannot reach it
      }
    }
  }
  if (!chosen) {
    std::string list;
    for (const auto& s : seen) list += (list.empty() ? "" : ", ") + s;
    if (all) fi_freeinfo(all);
    throw Error(
        ErrorCode::kUnsupported, "network", -1,
        "libfabric provider '" + provider + "' offers " +
            (ifname.empty() ? std::string("no interface") : "no interface named '" + ifname + "'") +
            (list.empty() ? std::string(" here") : " (it offers: " + list + ")") +
            "; set LOOM_NET_IFNAME to one of this host's interfaces, or "
            "LOOM_NET_PROVIDER to another provider (fi_info -l lists them)");
  }
  info_ = fi_dupinfo(chosen);
  fi_freeinfo(all);
  description_ = provider + " on " + info_->domain_attr->name;

  try {
    check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
    check(fi_domain(fabric_, info_, &domain_, nullptr), "fi_domain");
    fi_eq_attr eqAttr{};
    eqAttr.wait_obj = FI_WAIT_UNSPEC;
    check(fi_eq_open(fabric_, &eqAttr, &listenEq_, nullptr), "fi_eq_open");
    check(fi_passive_ep(fabric_, info_, &listener_, nullptr), "fi_passive_ep");
    check(fi_pep_bind(listener_, &listenEq_->fid, 0), "fi_pep_bind");
    check(fi_listen(listener_), "fi_listen");
    std::vector<uint8_t> name(128);
    size_t length = name.size();
    check(fi_getname(&listener_->fid, name.data(), &length), "fi_getname");
    address_ = addressText(name.data(), length);
  } catch (...) {
    // No destructor runs for a constructor that throws, and instance() tries again on the
    // next call: what was opened so far is closed here, or each try would leak it.
    closeAll();
    throw;
  }
}

Fabric::~Fabric() {
  closeAll();
}

void Fabric::closeAll() noexcept {
  if (listener_) fi_close(&listener_->fid);
  if (listenEq_) fi_close(&listenEq_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
  listener_ = nullptr;
  listenEq_ = nullptr;
  domain_ = nullptr;
  fabric_ = nullptr;
  info_ = nullptr;
}

std::unique_ptr<Endpoint> Fabric::open(fi_info* info, std::string peer) {
  std::unique_ptr<Endpoint> ep(new Endpoint());
  ep->peer_ = std::move(peer);
  ep->injectLimit_ = info->tx_attr ? info->tx_attr->inject_size : 0;
  ep->iovLimit_ = info->tx_attr ? std::max<size_t>(info->tx_attr->iov_limit, 1) : 1;
  fi_eq_attr eqAttr{};
  eqAttr.wait_obj = FI_WAIT_UNSPEC;
  check(fi_eq_open(fabric_, &eqAttr, &ep->eq_, nullptr), "fi_eq_open");
  fi_cq_attr cqAttr{};
  cqAttr.size = kQueueDepth;
  cqAttr.format = FI_CQ_FORMAT_MSG;
  cqAttr.wait_obj = FI_WAIT_NONE;
  check(fi_cq_open(domain_, &cqAttr, &ep->cq_, nullptr), "fi_cq_open");
  check(fi_endpoint(domain_, info, &ep->ep_, nullptr), "fi_endpoint");
  check(fi_ep_bind(ep->ep_, &ep->eq_->fid, 0), "fi_ep_bind (events)");
  check(fi_ep_bind(ep->ep_, &ep->cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind (completions)");
  check(fi_enable(ep->ep_), "fi_enable");
  return ep;
}

std::unique_ptr<Endpoint> Fabric::connect(const std::string& address) {
  std::string host, port;
  if (!splitAddress(address, &host, &port)) {
    throw Error(ErrorCode::kInvalidArgument, "connect", -1,
                "'" + address + "' is not a network address (host:port)");
  }
  fi_info* want = hints();
  want->fabric_attr->name = strdup(info_->fabric_attr->name);
  want->domain_attr->name = strdup(info_->domain_attr->name);
  fi_info* peer = nullptr;
  int rc = fi_getinfo(kApiVersion, host.c_str(), port.c_str(), 0, want, &peer);
  if (rc != 0) {
    // A peer outside this interface's subnet: any route will do.
    free(want->fabric_attr->name);
    want->fabric_attr->name = nullptr;
    rc = fi_getinfo(kApiVersion, host.c_str(), port.c_str(), 0, want, &peer);
  }
  fi_freeinfo(want);
  if (shortHere(rc)) fail("fi_getinfo", rc);
  if (rc != 0) {
    throw Error(ErrorCode::kPeerFailure, "connect", -1,
                "cannot reach " + address + " from " + description_ + ": " + fiError(rc));
  }
  std::unique_ptr<Endpoint> ep;
  try {
    ep = open(peer, address);
  } catch (...) {
    fi_freeinfo(peer);
    throw;
  }
  ep->connectTo_ = peer;
  return ep;
}

std::unique_ptr<Endpoint> Fabric::acceptNext(std::chrono::milliseconds wait) {
  fi_eq_cm_entry entry{};
  uint32_t event = 0;
  const ssize_t rc =
      fi_eq_sread(listenEq_, &event, &entry, sizeof entry, static_cast<int>(wait.count()), 0);
  if (rc == -FI_EAGAIN || rc == -FI_ETIMEDOUT) return nullptr;
  if (rc == -FI_EAVAIL) {
    fi_eq_err_entry err{};
    fi_eq_readerr(listenEq_, &err, 0);
    return nullptr;  // a connection attempt that failed before it reached us
  }
  if (rc < 0) fail("fi_eq_sread (listener)", static_cast<int>(rc));
  if (event != FI_CONNREQ) {
    if (entry.info) fi_freeinfo(entry.info);
    return nullptr;
  }
  const std::string peer = entry.info->dest_addr
                               ? addressText(entry.info->dest_addr, entry.info->dest_addrlen)
                               : "an unknown address";
  std::unique_ptr<Endpoint> ep;
  try {
    ep = open(entry.info, peer);
  } catch (...) {
    fi_reject(listener_, entry.info->handle, nullptr, 0);
    fi_freeinfo(entry.info);
    throw;
  }
  fi_freeinfo(entry.info);
  return ep;
}

}  // namespace loom::net
