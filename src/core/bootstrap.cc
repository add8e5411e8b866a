// The store exchange that precedes every top-level communicator.

#include "core/bootstrap.h"

#include <unistd.h>

#include "core/config.h"
#include "core/placement.h"
#include "core/process_service.h"
#include "loom/error.h"
#include "util/bytes.h"
#include "util/posix.h"

namespace loom {

namespace {

constexpr size_t kMaxName = 1024;

std::chrono::milliseconds remaining(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

void writePeer(ByteWriter& w, const PeerInfo& peer) {
  w.raw(peer.host.data(), peer.host.size());
  w.raw(peer.machine.data(), peer.machine.size());
  w.integer(peer.pidNamespace);
  w.integer(peer.pid);
  w.string(peer.hostname);
  w.string(peer.address);
  w.string(peer.netAddress);
  w.integer(peer.cpus);
  w.integer(peer.cores);
  w.integer(peer.netLanes);
  w.string(peer.refusal);
  w.string(peer.making);
  w.integer(peer.makingSize);
  w.integer(peer.gaveUp);
}

bool readPeer(ByteReader& r, PeerInfo* peer) {
  return r.raw(peer->host.data(), peer->host.size()) &&
         r.raw(peer->machine.data(), peer->machine.size()) && r.integer(&peer->pidNamespace) &&
         r.integer(&peer->pid) && r.string(&peer->hostname, kMaxName) &&
         r.string(&peer->address, kMaxName) && r.string(&peer->netAddress, kMaxName) &&
         r.integer(&peer->cpus) && r.integer(&peer->cores) && r.integer(&peer->netLanes) &&
         r.string(&peer->refusal, kMaxName) && r.string(&peer->making, kMaxName) &&
         r.integer(&peer->makingSize) && r.integer(&peer->gaveUp);
}

}  // namespace

PeerInfo localPeer() {
  const HostInfo host = localHost();
  PeerInfo peer;
  peer.host = host.id;
  peer.machine = host.machine;
  peer.pidNamespace = host.pidNamespace;
  peer.pid = static_cast<int32_t>(::getpid());
  peer.hostname = host.hostname;
  peer.address = ProcessService::instance().address();
  peer.cpus = cpuFingerprint(processCpus());
  peer.cores = static_cast<uint32_t>(availableCores());
  peer.netLanes = static_cast<uint32_t>(netLanesRequested());
  return peer;
}

Bytes encodePeer(const PeerInfo& peer) {
  ByteWriter w;
  writePeer(w, peer);
  return std::move(w.bytes());
}

std::optional<PeerInfo> parsePeer(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  PeerInfo peer;
  if (!readPeer(r, &peer) || !r.atEnd()) return std::nullopt;
  return peer;
}

Bytes encodeRoster(const Roster& roster) {
  ByteWriter w;
  w.raw(roster.id.data(), roster.id.size());
  w.raw(roster.secret.data(), roster.secret.size());
  w.string(roster.refusal);
  w.integer(static_cast<uint32_t>(roster.refusalCode));
  w.integer(static_cast<uint32_t>(roster.peers.size()));
  for (const PeerInfo& peer : roster.peers) writePeer(w, peer);
  return std::move(w.bytes());
}

std::optional<Roster> parseRoster(std::span<const uint8_t> bytes, int size) {
  ByteReader r(bytes);
  Roster roster;
  uint32_t code = 0;
  uint32_t count = 0;
  if (!r.raw(roster.id.data(), roster.id.size()) ||
      !r.raw(roster.secret.data(), roster.secret.size()) || !r.string(&roster.refusal, kMaxName) ||
      !r.integer(&code) || code > static_cast<uint32_t>(ErrorCode::kInternal) ||
      !r.integer(&count) || count != (roster.refusal.empty() ? static_cast<uint32_t>(size) : 0)) {
    return std::nullopt;
  }
  roster.refusalCode = static_cast<ErrorCode>(code);
  roster.peers.resize(count);
  for (PeerInfo& peer : roster.peers) {
    if (!readPeer(r, &peer)) return std::nullopt;
  }
  if (!r.atEnd()) return std::nullopt;
  return roster;
}

namespace {

// The ranks whose record is not in the store yet, as "2, 5" (for timeout messages).
std::string missingRanks(Store& store, const std::string& prefix, int size) {
  std::string missing;
  for (int q = 0; q < size; ++q) {
    try {
      if (store.check(prefix + "peer/" + std::to_string(q))) continue;
    } catch (const Error&) {
      return "";  // the store itself is gone: nothing to add
    }
    missing += (missing.empty() ? "" : ", ") + std::to_string(q);
  }
  return missing;
}

}  // namespace

namespace {

// Marks a network-address record that says why its rank could not open the network (no
// address starts with it).
constexpr char kNoAddress = '\x01';

// The second round, for rosters that span hosts: every rank publishes where it listens, and
// rank 0 gathers the addresses into one record, as in the first round. A rank that could not
// open the network (`refusal`) publishes why instead, and every rank fails at once, naming
// it, rather than wait out the timeout for its address.
void exchangeNetAddresses(int rank, Roster& roster, Store& store, const std::string& prefix,
                          const std::string& mine, const std::string& refusal,
                          std::chrono::steady_clock::time_point deadline) {
  const int size = static_cast<int>(roster.peers.size());
  const std::string record = refusal.empty() ? mine : kNoAddress + refusal.substr(0, kMaxName / 2);
  store.set(prefix + "net/" + std::to_string(rank), Bytes(record.begin(), record.end()));
  const auto refused = [&](const std::string& why) {
    return Error(ErrorCode::kInvalidArgument, "create", rank, why);
  };
  const auto publishRefusal = [&](int q, const std::string& why) {
    ByteWriter refusedAll;
    const std::string text = "rank " + std::to_string(q) + " cannot open the network: " + why;
    refusedAll.string(kNoAddress + text.substr(0, kMaxName / 2));  // within the reader's limit
    store.set(prefix + "net/all", refusedAll.bytes());
  };
  if (!refusal.empty()) {  // the caller throws its own error; rank 0 tells the others first
    if (rank == 0) publishRefusal(0, refusal);
    return;
  }
  auto late = [&](const std::string& who) {
    return Error(ErrorCode::kTimeout, "create", rank,
                 who +
                     " did not publish its network address within the timeout; it joined "
                     "the roster, so it failed while opening the network (see its log)");
  };
  if (rank == 0) {
    ByteWriter all;
    for (int q = 0; q < size; ++q) {
      Bytes bytes;
      try {
        bytes = store.get(prefix + "net/" + std::to_string(q), remaining(deadline));
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout) throw;
        throw late("rank " + std::to_string(q));
      }
      std::string address(bytes.begin(), bytes.end());
      if (!address.empty() && address[0] == kNoAddress) {
        publishRefusal(q, address.substr(1));
        throw refused("rank " + std::to_string(q) +
                      " cannot open the network: " + address.substr(1));
      }
      roster.peers[q].netAddress = std::move(address);
      all.string(roster.peers[q].netAddress);
    }
    store.set(prefix + "net/all", all.bytes());
    return;
  }
  Bytes bytes;
  try {
    bytes = store.get(prefix + "net/all", remaining(deadline));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kTimeout) throw;
    throw late("a rank (rank 0 gathers them)");
  }
  ByteReader r(bytes);
  for (PeerInfo& peer : roster.peers) {
    if (!r.string(&peer.netAddress, kMaxName)) {
      throw Error(ErrorCode::kInternal, "create", rank, "malformed network address record");
    }
    if (!peer.netAddress.empty() && peer.netAddress[0] == kNoAddress) {
      throw refused(peer.netAddress.substr(1));
    }
  }
}

}  // namespace

Roster exchangeRoster(int rank, int size, Store& store,
                      std::chrono::steady_clock::time_point deadline, const Listen& listen,
                      const std::string& name) {
  Roster roster = exchangeRosterOnly(rank, size, store, deadline, name);
  if (hostMapOf(roster).hosts() > 1) {
    std::string address;
    std::exception_ptr failure;
    std::string refusal;
    try {
      address = listen(roster);
    } catch (const std::exception& e) {  // loom's errors, and any other cause, are published
      failure = std::current_exception();
      refusal = e.what();
    }
    exchangeNetAddresses(rank, roster, store, roster.storePrefix, address, refusal, deadline);
    if (failure) std::rethrow_exception(failure);  // rank 0 refuses in the exchange
  }
  return roster;
}

Roster exchangeRosterOnly(int rank, int size, Store& store,
                          std::chrono::steady_clock::time_point deadline, const std::string& name) {
  // Several communicators may bootstrap through one store one after another: each rank
  // counts its own creations, and the n-th creation of every rank uses round n's keys.
  const int64_t round = store.add("loom/rounds/" + std::to_string(rank), 1);
  const std::string prefix = "loom/" + std::to_string(round) + "/";
  // A rank whose own settings are bad still publishes its record, saying why, and then
  // fails; rank 0 passes the reason on in place of the roster. Every rank then refuses at
  // once, naming it, instead of waiting out the timeout for a rank that never joins.
  PeerInfo me;
  try {
    me = localPeer();
    Config::load(Config::Sharing{});  // the LOOM_* variables' checks, before anyone waits
  } catch (const Error& e) {
    me.refusal = std::string(e.what()).substr(0, kMaxName / 2);  // fits the roster's string
  } catch (const std::exception& e) {
    // Not loom's own words (a library's or the standard library's): the peers learn it all
    // the same, rather than wait out the timeout for a rank that never joins.
    me.refusal =
        ("loom create (rank " + std::to_string(rank) + "): " + e.what()).substr(0, kMaxName / 2);
  }
  // What it makes: threads of one process that make communicators through one store at
  // once number their rounds in their own order, and a round would join one thread's
  // communicator on one rank to another's elsewhere, silently.
  me.making = name.substr(0, kMaxName / 2);
  me.makingSize = static_cast<uint32_t>(size);
  store.set(prefix + "peer/" + std::to_string(rank), encodePeer(me));
  const auto refuse = [&](int q, const std::string& why,
                          ErrorCode code = ErrorCode::kInvalidArgument) {
    Roster refused;
    refused.refusal = "rank " + std::to_string(q) + " cannot join: " + why;
    refused.refusalCode = code;
    store.set(prefix + "roster", encodeRoster(refused));
    throw Error(code, "create", rank, refused.refusal);
  };
  if (!me.refusal.empty() && rank != 0) {
    throw Error(ErrorCode::kInvalidArgument, "create", rank, me.refusal);
  }
  if (rank == 0) {
    if (!me.refusal.empty()) refuse(0, me.refusal);
    Roster roster;
    posix::randomBytes(roster.id.data(), roster.id.size());
    posix::randomBytes(roster.secret.data(), roster.secret.size());
    for (int q = 0; q < size; ++q) {
      Bytes bytes;
      try {
        bytes = store.get(prefix + "peer/" + std::to_string(q), remaining(deadline));
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout) throw;
        const std::string why = "rank(s) " + missingRanks(store, prefix, size) +
                                " did not join within the timeout; check that all " +
                                std::to_string(size) + " ranks start and use the same store";
        // The round is over. A rank that joins it later learns so at once, rather than wait
        // out its own timeout for a roster that never comes; and its next creation takes the
        // next round, as rank 0's does (the rounds are counted per rank: without this a
        // late rank stayed a round behind for every creation after).
        Roster abandoned;
        abandoned.refusal = ("rank 0 gave up making communicator '" + me.making +
                             "' at its timeout: " + why + "; then create again on every rank")
                                .substr(0, kMaxName);
        abandoned.refusalCode = ErrorCode::kTimeout;
        try {
          store.set(prefix + "roster", encodeRoster(abandoned));
        } catch (const Error&) {
          // The store itself failing: the late ranks learn it from their own calls.
        }
        throw Error(ErrorCode::kTimeout, "create", rank, why);
      }
      auto peer = parsePeer(bytes);
      if (!peer) {
        throw Error(ErrorCode::kInternal, "create", rank,
                    "rank " + std::to_string(q) +
                        " published a malformed record (mixed loom "
                        "versions?)");
      }
      if (!peer->refusal.empty()) refuse(q, peer->refusal);
      if (peer->gaveUp != 0) {
        refuse(q,
               "it gave this creation up at its timeout, before rank 0 came; create again on "
               "every rank",
               ErrorCode::kTimeout);
      }
      if (peer->making != me.making || peer->makingSize != me.makingSize) {
        refuse(q, "it makes communicator '" + peer->making + "' of " +
                      std::to_string(peer->makingSize) + " ranks where rank 0 makes '" + me.making +
                      "' of " + std::to_string(size) +
                      " in the same round of their store; make communicators that share a store "
                      "one at a time, in the same order on every rank, or give each its own "
                      "prefix (PrefixStore)");
      }
      roster.peers.push_back(std::move(*peer));
    }
    store.set(prefix + "roster", encodeRoster(roster));
    roster.storePrefix = prefix;
    return roster;
  }
  Bytes bytes;
  try {
    bytes = store.get(prefix + "roster", remaining(deadline));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kTimeout) throw;
    // Said in its record, so that a rank 0 that comes later refuses the round at once (its
    // peers in it with it) rather than make a communicator this rank will never join.
    me.gaveUp = 1;
    try {
      store.set(prefix + "peer/" + std::to_string(rank), encodePeer(me));
    } catch (const Error&) {
      // The store itself failing: the others learn it from their own calls.
    }
    const std::string missing = missingRanks(store, prefix, size);
    throw Error(ErrorCode::kTimeout, "create", rank,
                missing.empty()
                    ? "rank 0 did not publish the roster within the timeout although every "
                      "rank joined; did rank 0 fail?"
                    : "rank(s) " + missing + " did not join within the timeout; check that all " +
                          std::to_string(size) + " ranks start and use the same store");
  }
  auto roster = parseRoster(bytes, size);
  if (!roster) {
    throw Error(ErrorCode::kInvalidArgument, "create", rank,
                "the roster rank 0 published does not describe " + std::to_string(size) +
                    " ranks; do all ranks pass the same size (and run the same loom version)?");
  }
  if (!roster->refusal.empty()) throw Error(roster->refusalCode, "create", rank, roster->refusal);
  roster->storePrefix = prefix;
  return std::move(*roster);
}

HostMap hostMapOf(const Roster& roster) {
  std::vector<HostId> ids;
  ids.reserve(roster.peers.size());
  for (const PeerInfo& peer : roster.peers) ids.push_back(peer.host);
  return HostMap(ids);
}

void requireSupportedLinks(const Roster& roster, const HostMap& hosts, int rank) {
#ifdef LOOM_HAVE_NET
  (void)roster, (void)hosts, (void)rank;  // every pair has a link: shared memory or the network
#else
  for (int q = 0; q < static_cast<int>(roster.peers.size()); ++q) {
    if (hosts.link(rank, q) != Link::kNetwork) continue;
    throw Error(ErrorCode::kUnsupported, "create", rank,
                "rank " + std::to_string(q) + " runs on host '" + roster.peers[q].hostname +
                    "' and this rank on '" + roster.peers[rank].hostname +
                    "' (different kernels or network namespaces), but this build of loom has "
                    "no network transport: libfabric and OpenSSL were not found when it was "
                    "built. Install libfabric-dev, libssl-dev and pkg-config and rebuild, or "
                    "run all ranks on one host");
  }
#endif
}

std::string describeRemote(const Roster& roster, int q) {
  const PeerInfo& peer = roster.peers[q];
  return "rank " + std::to_string(q) + " (host '" + peer.hostname + "'" +
         (peer.netAddress.empty() ? std::string() : ", " + peer.netAddress) + ")";
}

}  // namespace loom
