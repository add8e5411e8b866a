// Creating, running and tearing down a communicator.

#include "core/comm_state.h"

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <climits>
#include <map>
#include <new>
#include <optional>
#include <system_error>
#include <thread>

#include "algorithms/call_stamp.h"
#include "algorithms/network_context.h"

#include "core/flight_recorder.h"
#include "core/op_state.h"
#include "core/p2p_engine.h"
#include "core/placement.h"
#include "core/process_service.h"
#include "transport/shm/ring_link.h"
#include "util/deadline.h"
#include "util/trace.h"
#ifdef LOOM_HAVE_CUDA
#include "core/cuda_executor.h"
#endif
#ifdef LOOM_HAVE_NET
#include "transport/net/net_link.h"
#include "transport/net/net_service.h"
#endif

namespace loom::detail {

namespace {

using Clock = std::chrono::steady_clock;

// The connections between two ranks of different hosts, by channel.
constexpr uint32_t kPointToPoint = 0;
constexpr uint32_t kCollectives = 1;
constexpr uint32_t kControl = 2;
// How long a shutdown waits for its sends to be taken (see shutdown()).
constexpr std::chrono::seconds kShutdownSendGrace{10};
// Lane 0 of the collectives is kCollectives; lane l > 0, kControl + l.
uint32_t laneChannel(int lane) {
  return lane == 0 ? kCollectives : kControl + static_cast<uint32_t>(lane);
}
bool carriesCollectives(uint32_t channel) {
  return channel == kCollectives || channel > kControl;
}

#ifdef LOOM_HAVE_NET
// Collective links carry the bulk of the bytes: a window of 32 frames (4 MiB) keeps a fast
// link busy while the receiver copies frames out. With 8, measured on the 16-core host, a
// broadcast's sender waited for credits about half the time (64 MiB across 2 hosts: 33 ms
// with 8 frames, 20 ms with 32). Point-to-point and control links keep 8.
net::ChannelShape shapeOf(uint32_t channel) {
  net::ChannelShape shape;
  if (carriesCollectives(channel)) shape.frames = 32;
  return shape;
}
#endif

// What the flight record says about a collective.
FlightRecorder::Subject flightSubject(const CollectiveArgs& args, uint64_t seq) {
  FlightRecorder::Subject s;
  s.sequence = seq;
  s.operation = collectiveName(args.kind);
  if (args.kind == CollectiveKind::kBarrier) return s;
  s.count = args.count;
  s.type = static_cast<int8_t>(args.type);
  if (reduces(args.kind)) s.reduce = static_cast<int8_t>(args.op.kind());
  if (hasRoot(args.kind)) s.peer = args.root;
  return s;
}

// Opens this process to other hosts for the communicator of `roster` (its connections are
// accepted from now on) and returns the address its peers connect to.
std::string listenFor(const Roster& roster, int rank) {
#ifdef LOOM_HAVE_NET
  try {
    net::NetService& service = net::NetService::instance();
    service.expect(roster.id, roster.secret, shapeOf);
    return service.address();
  } catch (const Error& e) {
    if (e.rank() >= 0) throw;
    throw Error(e.code(), "create", rank, e.detail());  // the same, naming this rank
  } catch (const std::exception& e) {
    // Its thread that would not start (a pids limit) or memory: a cause the other ranks must
    // hear at once (exchangeRoster publishes it), not a raw exception and their timeout.
    throw Error(ErrorCode::kSystem, "create", rank, e.what());
  }
#else
  (void)roster;
  (void)rank;
  return "";  // requireSupportedLinks refuses the roster
#endif
}

// Both ends of a connection must put a segment on the same lane (network_context.h), so the
// ranks of a communicator across hosts agree on their number from the roster, which every
// rank sees alike: what LOOM_NET_LANES asks for if any rank sets it (then every rank must,
// to the same value, or every rank refuses), else the default for the rank with the fewest
// cores to itself (its machine's cores over the ranks that share them).
int agreedNetLanes(const Roster& roster, int rank) {
  const auto said = [](uint32_t lanes) {
    return lanes == 0 ? std::string("unset") : std::to_string(lanes);
  };
  const uint32_t first = roster.peers[0].netLanes;
  std::map<std::pair<HostId, uint64_t>, int> sharing;  // ranks per machine and CPU set
  for (size_t q = 0; q < roster.peers.size(); ++q) {
    const PeerInfo& peer = roster.peers[q];
    if (peer.netLanes != first) {
      throw Error(ErrorCode::kInvalidArgument, "create", rank,
                  "LOOM_NET_LANES is " + said(peer.netLanes) + " on rank " + std::to_string(q) +
                      " but " + said(first) +
                      " on rank 0; set the same value on every rank, or on none");
    }
    ++sharing[{peer.machine, peer.cpus}];
  }
  if (first != 0) return static_cast<int>(first);
  int fewestCores = INT_MAX;
  for (const PeerInfo& peer : roster.peers) {
    fewestCores =
        std::min(fewestCores, static_cast<int>(peer.cores) / sharing[{peer.machine, peer.cpus}]);
  }
  return defaultNetLanes(fewestCores);
}

}  // namespace

std::shared_ptr<CommState> CommState::createFromStore(int rank, int size, Store& store,
                                                      const CommOptions& options) {
  const auto deadline = deadlineAfter(options.timeout);
  // Until the state below owns it (its destructor forgets it), a creation that fails must
  // take back what listenFor registered with the process's network service.
  struct Registration {
    std::optional<CommId> id;
    int rank = 0;
    ~Registration() {
#ifdef LOOM_HAVE_NET
      if (id) net::NetService::instance().forget(*id, rank);
#endif
    }
  } registration;
  registration.rank = rank;
  const Roster roster = exchangeRoster(
      rank, size, store, deadline,
      [&registration, rank](const Roster& r) {
        std::string address = listenFor(r, rank);
        registration.id = r.id;
        return address;
      },
      options.name);
  const HostMap hosts = hostMapOf(roster);
  requireSupportedLinks(roster, hosts, rank);
  // Tunables that share out the host count this host's ranks (chunk sizes) or, for the
  // cores, every rank on this machine's kernel that may run on the same CPUs (threads):
  // namespace hosts on one machine share them, containers with CPU sets of their own do not.
  Config::Sharing sharing{hosts.localRanks(rank), 0, hosts.hosts() > 1};
  const PeerInfo& me = roster.peers[rank];
  for (const PeerInfo& peer : roster.peers) {
    sharing.machineRanks += peer.machine == me.machine && peer.cpus == me.cpus ? 1 : 0;
  }
  sharing.coreSharers = sharing.machineRanks;
  sharing.machineRanks = std::max(sharing.machineRanks, sharing.localRanks);
  if (sharing.spansHosts) sharing.netLanes = agreedNetLanes(roster, rank);
  Config config = Config::load(sharing);
  // Before join: the threads the communicator starts inherit the block.
  if (config.bindRanks) placeThisRank(roster, hosts, rank, config.tuning.threads);
  std::shared_ptr<CommState> state(new CommState(rank, roster, options, std::move(config)),
                                   &CommState::destroy);
  registration.id.reset();
  state->join(deadline, /*child=*/false, ParentWatch{});
  return state;
}

std::shared_ptr<CommState> CommState::createChild(CommState& parent,
                                                  const std::vector<int>& members,
                                                  const std::string& salt,
                                                  const CommOptions& options, bool watchParent) {
  Roster roster;
  roster.secret = parent.roster_.secret;
  std::string key = salt + "/";
  for (int q : members) {
    roster.peers.push_back(parent.roster_.peers[q]);
    key += std::to_string(q) + ",";
  }
  roster.id = deriveId(parent.roster_.id, key);
  int rank = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == parent.rank_) rank = static_cast<int>(i);
  }
  // Its own host layout sets the chunks, the algorithms and whether network threads run
  // beside the helpers (a child within one host of a parent across hosts has none); the
  // machine's cores are shared as the parent shares them.
  const HostMap hosts = hostMapOf(roster);
  Config config =
      Config::load(parent.config_.sharing.child(hosts.localRanks(rank), hosts.hosts() > 1));
  std::shared_ptr<CommState> state(new CommState(rank, roster, options, std::move(config)),
                                   &CommState::destroy);
  // A child across hosts registers here (a top-level one did in exchangeRoster): one
  // registration, which the state's destructor gives back.
  if (state->spansHosts()) listenFor(roster, rank);
  // Split and subset watch their parent: its failure meanwhile stops them where it concerns
  // a member (one aborted it instead of joining), not where it spares them all (a rank
  // outside the child died, another timed out): a member that came after such a failure
  // joins, and so must one already waiting. A shrink does not watch it: its parent has
  // failed, or is about to, for the ranks it leaves out (one that dies while the others
  // shrink made their shrink fail); a member that dies is seen by the join itself.
  ParentWatch watched;
  if (watchParent && parent.failures_) watched = {parent.failures_.get(), members};
  state->join(deadlineAfter(options.timeout), /*child=*/true, watched);
  return state;
}

CommState::CommState(int rank, const Roster& roster, const CommOptions& options, Config config)
    : rank_(rank),
      size_(static_cast<int>(roster.peers.size())),
      name_(options.name),
      rankLegend_(options.rankLegend),
      roster_(roster),
      hosts_(hostMapOf(roster)),
      config_(std::move(config)),
      owner_(::getpid()),
      timeoutMs_(options.timeout.count()) {}

bool CommState::forkedAway() const {
  return ::getpid() != owner_;
}

void CommState::join(Clock::time_point deadline, bool child, const ParentWatch& parent) {
  const int localRank = hosts_.localIndex(rank_);
  const std::vector<int>& here = hosts_.ranksOn(hosts_.hostOf(rank_));
  JoinedSegment joined = joinSegment(deadline, child, parent);
  shm_ =
      std::make_unique<shm::ShmComm>(std::move(joined.segment), localRank, config_.backoff, here);
  layout_ = layoutOf(hosts_, rank_);
  failures_ = std::make_unique<FailureDomain>(*shm_, name_, rankLegend_, rank_, roster_, hosts_);
  shm_->setFailures(*failures_);
  if (joined.broken) {
    failures_->fail(ErrorCode::kPeerFailure, joined.broken->first, joined.broken->second);
    throw failures_->failureError("create");
  }
  shm_->attachSelf(static_cast<int>(::getpid()));
  if (config_.killAt.seq != 0) shm_->setKillPoint(config_.killAt.seq, config_.killAt.phase);
  if (config_.stallAt.seq != 0) {
    shm_->setStallPoint(config_.stallAt.seq, config_.stallAt.phase, config_.stallAt.pause);
  }
  watchPeers();
  worker_ = std::make_unique<Worker>("loom-worker", config_.backoff, /*serveItsOwnWaits=*/true);
  worker_->watchHolds([this] { return std::chrono::milliseconds(timeoutMs_.load()); },
                      [this](const Worker::Hold& hold) { queueHeld(hold); });
  if (spansHosts() && localRank < layout_.rails) startControlPlane(deadline);
}

HostLayout CommState::layoutOf(const HostMap& hosts, int rank) {
  std::vector<std::vector<int>> ranksOn;
  for (int h = 0; h < hosts.hosts(); ++h) ranksOn.push_back(hosts.ranksOn(h));
  return HostLayout::of(std::move(ranksOn), rank);
}

void CommState::startControlPlane(Clock::time_point deadline) {
  std::vector<int> railPeers;
  for (int h = 0; h < hosts_.hosts(); ++h) {
    if (h != layout_.host) railPeers.push_back(hosts_.ranksOn(h)[layout_.localIndex]);
  }
  // This host's ranks that left, for the peers' ranks that wait on one over no link of its.
  auto departedHere = [this] {
    std::vector<int> departed;
    for (int q : hosts_.ranksOn(layout_.host)) {
      if (failures_->stateOf(q) == RankState::kDeparted) departed.push_back(q);
    }
    return departed;
  };
  control_ = std::make_unique<ControlPlane>(
      rank_, size_, railPeers, [this](int q) { return linkTo(q, kControl); },
      [this](int q) { return describeRemote(roster_, q); }, departedHere,
      [this](int a, int b) { return hosts_.hostOf(a) == hosts_.hostOf(b); }, *failures_,
      config_.netSilence);
  control_->awaitPeers(deadline);  // the hosts meet before the communicator is used
}

void CommState::watchPeers() {
  // Only this host's ranks: their pids mean something here (and only within one pid
  // namespace; elsewhere dead peers are found by the operation timeout instead). Ranks on
  // other hosts are watched through their connections.
  const PeerInfo& self = roster_.peers[rank_];
  for (int q : hosts_.ranksOn(hosts_.hostOf(rank_))) {
    const PeerInfo& peer = roster_.peers[q];
    if (q == rank_ || peer.pidNamespace != self.pidNamespace || peer.pid == self.pid) continue;
    FailureDomain* failures = failures_.get();
    watches_.push_back(
        ProcessService::instance().watch(peer.pid, [failures, q](int) { failures->markDead(q); }));
  }
}

CommState::~CommState() {
  if (forkedAway()) {
    // In a fork, the threads these own do not exist (joining them would wait forever) and
    // the segment and connections are the parent's: leave them all as they are, unfreed.
    (void)shm_.release();
    (void)failures_.release();
    (void)p2p_.release();
    (void)control_.release();
    for (auto& lane : lanes_) (void)lane.release();
    (void)cuda_.release();
    (void)worker_.release();
    return;
  }
  shutdown();
  for (uint64_t id : watches_) ProcessService::instance().unwatch(id);
  // Processes that end without running atexit handlers (Python's multiprocessing children
  // leave through os._exit) still leave their timeline: written at each communicator's end.
  trace::flush();
}

std::chrono::milliseconds CommState::timeoutFor(const OpOptions& options) const {
  return options.timeout.count() > 0 ? options.timeout
                                     : std::chrono::milliseconds(timeoutMs_.load());
}

void CommState::refuseIfShutDown(std::string_view op) const {
  if (shutDown_.load(std::memory_order_seq_cst)) {  // against Posting: see there
    throw Error(ErrorCode::kAborted, op, rank_,
                "communicator '" + name_ + "' has been shut down; create a new one");
  }
}

void CommState::refuseInAFork(std::string_view op) const {
  if (forkedAway()) {
    throw Error(ErrorCode::kUnsupported, op, rank_,
                "communicator '" + name_ + "' belongs to process " + std::to_string(owner_) +
                    ", and this process (pid " + std::to_string(::getpid()) +
                    ") is a fork of it: a forked process cannot use its parent's communicator; "
                    "make one of its own (init_process_group in the child)");
  }
}

void CommState::requireUsable(std::string_view op) {
  refuseInAFork(op);
  refuseIfShutDown(op);
  if (failures_->failed()) {
    // Failing at the call is a failure too: report it like one that ends a running operation.
    Error error = failures_->failureError(op);
    operationFailed(std::make_exception_ptr(error));
    throw error;
  }
}

void CommState::requireMembersUsable(std::span<const int> members, std::string_view op) {
  refuseInAFork(op);
  refuseIfShutDown(op);
  // A member that died, left or aborted would be waited for until the timeout: the
  // failure, which names it, is the answer now.
  if (failures_->spares(members)) return;
  Error error = failures_->sparingError(members, op);
  operationFailed(std::make_exception_ptr(error));  // reported as requireUsable reports
  throw error;
}

void CommState::execute(const CollectiveArgs& given, OpState& state,
                        std::chrono::milliseconds timeout, Clock::time_point start) {
  // A placed call (allGatherVPlaced) learns its buffers now, from the calls before it.
  std::optional<CollectiveArgs> placed;  // made only then: not on every small call's path
  if (given.place) placed.emplace();
  const CollectiveArgs& args = placed ? *placed : given;
  std::exception_ptr error;
  const std::string_view op = collectiveName(given.kind);
  const trace::Span span(op.data(), given.count * elementSize(given.type));
  FlightRecorder::instance().started(state.flightId, start);
  state.startedAt = start;
  shm_->noteStarted(state.seq, static_cast<uint8_t>(given.kind));
  try {
    const WaitSpec wait{op, state.seq, deadlineAfter(timeout, start), timeout};
    if (failures_->failed()) throw failures_->failureError(wait.op);
    if (placed) {
      *placed = given;
      given.place(*placed);
      FlightRecorder::instance().counted(state.flightId, placed->count);  // 0 at issue
    }
    if (spansHosts()) {
      executeAcrossHosts(args, wait, state.seq);
    } else {
      CollectiveContext ctx(*shm_, *failures_, wait, state.seq, phase_, config_.tuning);
      runCollective(ctx, args);
    }
    shm_->noteFinished(state.seq);
  } catch (...) {
    error = brokeOff(op, std::current_exception());
  }
  // Peers that time out waiting for this rank say it is in these callbacks (or outer ones).
  const bool outer = shm_->inCallbacks();
  shm_->noteInCallbacks(true);
  state.complete(error);
  shm_->noteInCallbacks(outer);
}

std::exception_ptr CommState::brokeOff(std::string_view op, std::exception_ptr error) {
  if (failures_->failed()) return error;  // a recorded failure, which every rank sees
  // Anything else (a helper thread or memory this rank could not get) broke the collective
  // off between two of its phases: its peers would wait for a phase it never posts, then
  // take its next call's for it and read its stale slots as results. So the communicator
  // fails, for every rank.
  ErrorCode code = ErrorCode::kInternal;
  std::string what;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    code = e.code();
    what = e.detail();
  } catch (const std::bad_alloc&) {
    code = ErrorCode::kSystem;
    what = "out of memory";
  } catch (const std::system_error& e) {
    code = ErrorCode::kSystem;
    what = e.what();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "an unknown exception";
  }
  failures_->fail(code, rank_,
                  std::string(op) + " broke off on rank " + std::to_string(rank_) + " (" +
                      what.substr(0, 200) +
                      "): its steps no longer match its peers', so the communicator cannot go "
                      "on; make a new one (if a limit on threads or memory was the cause, raise "
                      "it)");
  return std::make_exception_ptr(failures_->failureError(op));
}

void CommState::executeAcrossHosts(const CollectiveArgs& args, const WaitSpec& wait, uint64_t seq) {
  auto runLocal = [&](const CollectiveArgs& local) {
    const trace::Span span("local step", static_cast<uint64_t>(local.kind));
    CollectiveContext ctx(*shm_, *failures_, wait, seq, phase_, config_.tuning);
    runCollective(ctx, local);
  };
  auto describe = [this](int q) { return describeRemote(roster_, q); };
  // The lanes and their threads, made on first use (the send threads: every rank exchanges
  // with other hosts; the rail threads: rail ranks only).
  const int lanes = netLanes();
  std::vector<NetLane> net;
  for (int l = 0; l < lanes; ++l) {
    if (lanes_.size() <= static_cast<size_t>(l)) {
      auto lane = std::make_unique<Lane>();
      lane->links.resize(static_cast<size_t>(size_));
      // Thread names outlive this call (Worker keeps the pointer).
      static constexpr const char* kSendNames[] = {"loom-net-send", "loom-net-send-1",
                                                   "loom-net-send-2", "loom-net-send-3"};
      static constexpr const char* kRailNames[] = {"loom-rail", "loom-rail-1", "loom-rail-2",
                                                   "loom-rail-3"};
      static_assert(std::size(kSendNames) == Config::kMaxNetLanes);
      lane->sends = std::make_unique<Worker>(kSendNames[l], config_.backoff);
      if (layout_.localIndex < layout_.rails) {
        lane->rail = std::make_unique<Worker>(kRailNames[l], config_.backoff);
      }
      lanes_.push_back(std::move(lane));
    }
    Lane& lane = *lanes_[static_cast<size_t>(l)];
    auto linkTo = [this, &lane, l](int q) -> MessageLink& {
      auto& link = lane.links[static_cast<size_t>(q)];
      if (!link) link = this->linkTo(q, laneChannel(l));
      return *link;
    };
    net.push_back({linkTo, lane.sends.get(), lane.rail.get(), &lane.railScratch});
  }
  NetworkContext ctx(layout_, scratch_, runLocal, describe, *failures_, wait, callStamp(args, seq),
                     std::move(net));
  runAcrossHosts(ctx, args);
}

// A call of this communicator's on its way from its check to the engine: a send or receive,
// a CPU collective until it is queued on the worker (or has run on the caller's thread), or
// a CUDA call or group end on its way into the device executor. The count and shutDown_
// are a pair of flags (each side raises its own, then reads the other's, both sequentially
// consistent), so either shutdown sees the post and waits for it, or the post sees the
// shutdown and is refused. A completion callback run inside a post may call
// shutdown: the thread's chain of postings makes that refuse rather than wait for itself.
class CommState::Posting {
 public:
  explicit Posting(CommState& state) : state_(state), outer_(innermost_) {
    state_.posting_.fetch_add(1, std::memory_order_seq_cst);
    innermost_ = this;
  }
  ~Posting() {
    innermost_ = outer_;
    state_.posting_.fetch_sub(1, std::memory_order_release);
  }
  Posting(const Posting&) = delete;
  Posting& operator=(const Posting&) = delete;
  /// Whether this thread is posting on `state` (a callback inside one of its posts).
  static bool within(const CommState& state) {
    for (const Posting* p = innermost_; p != nullptr; p = p->outer_) {
      if (&p->state_ == &state) return true;
    }
    return false;
  }

 private:
  CommState& state_;
  const Posting* const outer_;
  static thread_local const Posting* innermost_;
};

thread_local const CommState::Posting* CommState::Posting::innermost_ = nullptr;

Request CommState::submit(CollectiveArgs args, const OpOptions& options) {
  requireUsable(collectiveName(args.kind));
  if (!options.signature.empty()) args.signature = options.signature;
  // A completion callback of this communicator's issues a call, and may wait for it (see
  // Worker): what is queued runs first, then this call, on this thread and in issue order.
  // The queue runs before the call takes its number: callbacks of the calls run there issue
  // calls of their own, which so come first in number as in time.
  const bool fromOwnCallback =
      options.device == DeviceKind::kCpu && Worker::current() == worker_.get();
  if (fromOwnCallback) worker_->runQueuedHere();
  auto state = std::make_shared<OpState>(seq_.fetch_add(1, std::memory_order_relaxed) + 1);
  FlightRecorder::Subject subject = flightSubject(args, state->seq);
  subject.communicator = name_;
  subject.rank = rank_;
  subject.size = size_;
  // One clock read for the issue mark and, when the call runs here at once, its start.
  const auto issuedAt = Clock::now();
  state->flightId = FlightRecorder::instance().issued(subject, issuedAt);
  state->sink = this;
  const auto timeout = timeoutFor(options);
  Request request(state);
  if (options.device != DeviceKind::kCpu) {
    state->startedAt = issuedAt;  // queued on its stream now
    if (options.blocking && onCudaMonitor()) {
      throw Error(ErrorCode::kInvalidArgument, collectiveName(args.kind), rank_,
                  "a blocking CUDA call inside a completion callback of this communicator's "
                  "CUDA calls would wait for the thread running the callback, which completes "
                  "them; issue it without blocking, or from another thread");
    }
    try {
      // Queued before a shutdown on another thread resets the executor, or refused after it
      // (Posting): the executor must not go while this call is on its way into it.
      Posting posting(*this);
      requireUsable(collectiveName(args.kind));
      deviceExecutor(options, collectiveName(args.kind)).enqueue(args, state, options, timeout);
    } catch (const Error& e) {
      FlightRecorder::instance().ended(state->flightId, e.what());  // refused: never ran
      throw;
    }
    if (options.blocking) settle(request);
    return request;
  }
  if (fromOwnCallback) {
    execute(args, *state, timeout, issuedAt);
    return request;
  }
  {
    // Run here or queued before a shutdown on another thread drains the worker, or refused
    // once it has begun (Posting): one queued after the drain would run after this rank left.
    Posting posting(*this);
    try {
      refuseIfShutDown(collectiveName(args.kind));
    } catch (const Error& e) {
      FlightRecorder::instance().ended(state->flightId, e.what());  // refused: never ran
      throw;
    }
    if (options.blocking &&
        worker_->runHereIfIdle([&] { execute(args, *state, timeout, issuedAt); })) {
      return request;
    }
    state->queuedOn = worker_.get();
    const std::string_view op = collectiveName(args.kind);
    state->queuedAs = worker_->submit(
        [this, args = std::move(args), state, timeout] {
          execute(args, *state, timeout, Clock::now());
        },
        [this, state, op]() -> Worker::Job {
          // Ended now; its callbacks run once the calls given up with it
          // have ended too (one may wait for a later one).
          const std::exception_ptr failure = heldError(op, state->seq);
          return [state, failure, callbacks = state->finish(failure)]() mutable {
            detail::OpState::runCallbacks(std::move(callbacks), failure, state->seq);
          };
        });
  }
  if (options.blocking) settle(request);
  return request;
}

void CommState::settle(const Request& request) {
  try {
    request.wait();
  } catch (...) {
    // The failure stays in the request; the caller's wait() reports it.
  }
}

std::unique_ptr<MessageLink> CommState::linkTo(int q, uint32_t channel) {
  if (hosts_.link(rank_, q) != Link::kNetwork) {
    return std::make_unique<shm::RingLink>(*shm_, hosts_.localIndex(q));
  }
#ifdef LOOM_HAVE_NET
  // The connection is made on the first send.
  const Roster& roster = roster_;
  const int me = rank_;
  auto connect = [&roster, me, q, channel] {
    net::Hello hello;
    hello.comm = roster.id;
    hello.sender = me;
    hello.receiver = q;
    hello.channel = channel;
    return std::make_unique<net::SendChannel>(net::Fabric::instance(), roster.peers[q].netAddress,
                                              hello, roster.secret, shapeOf(channel));
  };
  auto claim = [id = roster_.id, me, q, channel] {
    return net::NetService::instance().claim(id, q, me, channel);
  };
  // Collective links may have their directions driven by two threads.
  const auto drivers =
      carriesCollectives(channel) ? net::NetLink::Drivers::kTwo : net::NetLink::Drivers::kOne;
  // Data links of a failed communicator close without delivering what they hold; the
  // control link delivers the failure it forwards, so it closes as usual.
  net::NetLink::Failed failed;
  if (channel != kControl) failed = [failures = failures_.get()] { return failures->failed(); };
  return std::make_unique<net::NetLink>(connect, claim, describeRemote(roster_, q), drivers,
                                        std::move(failed));
#else
  throw Error(ErrorCode::kInternal, "send/recv", rank_, "no network transport in this build");
#endif
}

P2pEngine& CommState::p2p() {
  std::lock_guard<std::mutex> lock(p2pMutex_);
  if (!p2p_) {
    std::vector<std::unique_ptr<MessageLink>> links;
    for (int q = 0; q < size_; ++q) links.push_back(linkTo(q, kPointToPoint));
    p2p_ = std::make_unique<P2pEngine>(rank_, *shm_, *failures_, std::move(links), this);
  }
  return *p2p_;
}

Request CommState::send(const void* data, size_t bytes, int peer, int tag,
                        const OpOptions& options) {
  return transfer({Transfer::Kind::kSend, peer, tag, const_cast<void*>(data), bytes}, options);
}

Request CommState::recv(void* data, size_t bytes, int peer, int tag, const OpOptions& options) {
  return transfer({Transfer::Kind::kRecv, peer, tag, data, bytes}, options);
}

Request CommState::transfer(const Transfer& t, const OpOptions& options) {
  const bool sends = t.kind == Transfer::Kind::kSend;
  const char* op = sends ? "send" : "recv";
  EndedUnqueued refused;
  Request request = [&] {
    Posting posting(*this);
    requireUsable(op);
    const uint64_t flightId = FlightRecorder::instance().issued(
        {name_, rank_, size_, 0, op, t.bytes, -1, -1, t.peer, t.tag, true});
    if (options.device != DeviceKind::kCpu) return deviceTransfer(t, options, flightId, refused);
    P2pEngine& engine = p2p();
    const auto timeout = timeoutFor(options);
    return sends ? engine.send(t.data, t.bytes, t.peer, t.tag, timeout, flightId)
                 : engine.recv(t.data, t.bytes, t.peer, t.tag, timeout, flightId);
  }();
  refused.settle();  // a group this call ended unqueued: its callbacks, then its failure
  if (options.blocking) settle(request);  // after the posting: shutdown need not wait for it
  return request;
}

void CommState::connectDevice(DeviceKind device, int deviceIndex) {
  if (device == DeviceKind::kCpu) return;
  Posting posting(*this);  // a shutdown meanwhile neither resets nor sees a half-made executor
  requireUsable("connect_device");
  OpOptions options;
  options.device = device;
  options.deviceIndex = deviceIndex;
  deviceExecutor(options, "connect_device");
}

void CommState::endGroup() {
  EndedUnqueued refused;
  {
    Posting posting(*this);  // the transfers it queues reach the executor before a shutdown
    std::lock_guard<std::mutex> lock(groupMutex_);
    if (groupDepth_ == 0) {
      throw Error(ErrorCode::kInvalidArgument, "end_group", rank_,
                  "endGroup without a matching startGroup");
    }
    if (--groupDepth_ == 0) flushGroup(refused);
  }
  refused.settle();  // outside the lock and the posting: a callback may start a group
}

int CommState::nextChildNumber(const std::string& key) {
  std::lock_guard<std::mutex> lock(childMutex_);
  return childCounts_[key]++;
}

void CommState::abort() {
  if (!failures_ || forkedAway()) return;
  std::lock_guard<std::mutex> lock(leaving_);
  if (!departed_) failures_->abort();
}

void CommState::destroy(CommState* state) {
  // Its last reference dropped in one of its own completion callbacks: destruction waits
  // for that thread, so it happens on another (or, if no thread can be made, never).
  if (state->onOwnThread()) {
    try {
      std::thread([state] { delete state; }).detach();
    } catch (const std::system_error&) {
    }
    return;
  }
  delete state;
}

bool CommState::onOwnThread() {
  if (forkedAway()) return false;
  if (worker_ && (Worker::current() == worker_.get() || Worker::watchingHere() == worker_.get())) {
    return true;
  }
  if (onCudaMonitor()) return true;
  std::lock_guard<std::mutex> lock(p2pMutex_);
  return p2p_ && p2p_->onItsThread();
}

bool CommState::onCudaMonitor() const {
  const void* here = completingHere();
  return here != nullptr && here == cudaCompleter_.load();
}

void CommState::shutdown() {
  if (onOwnThread() || Posting::within(*this)) {
    throw Error(ErrorCode::kInvalidArgument, "shutdown", rank_,
                "called from a completion callback of this communicator's (on its own thread, "
                "or inside one of its calls on its way in), where it would wait for the callback "
                "itself; shut the communicator down once the callback has returned, from "
                "another thread");
  }
  if (shutDown_.exchange(true) || forkedAway()) return;
  // Sends and receives that passed their check before this reach the engine (or the group)
  // first; later ones are refused. A post is short: it queues, and takes a turn at most. But
  // the first CUDA call sets the device path up (the driver, workspaces shared with the
  // host's ranks), and a blocking collective run on the caller's thread lasts as long as it
  // takes: past a millisecond the wait sleeps, longer each time (to 5 ms), leaving the core.
  const auto yieldUntil = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
  auto nap = std::chrono::microseconds(100);
  while (posting_.load(std::memory_order_seq_cst) != 0) {
    if (std::chrono::steady_clock::now() < yieldUntil) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(2 * nap, std::chrono::microseconds(5000));
    }
  }
  if (worker_) {
    // The network lanes close on the worker (where collectives run), after the calls queued:
    // ranks on other hosts that wait for this one see their links' goodbye at once, not
    // only when the last handle goes.
    worker_->submit([this] { lanes_.clear(); });
    worker_->drain();
  }
  {
    // Device transfers of a group never ended were never queued: they fail.
    std::vector<HeldTransfer> held;
    {
      std::lock_guard<std::mutex> lock(groupMutex_);
      held.swap(held_);
      groupDepth_ = 0;
    }
    EndedUnqueued unqueued;  // every one ended before any callback runs
    for (const HeldTransfer& h : held) {
      const char* op = h.transfer.kind == Transfer::Kind::kSend ? "send" : "recv";
      unqueued.end(h.state, std::make_exception_ptr(
                                Error(ErrorCode::kAborted, op, rank_,
                                      "the communicator was shut down inside a group (startGroup "
                                      "without endGroup), so this transfer was never queued")));
    }
    unqueued.settle();
  }
  {
    std::lock_guard<std::mutex> lock(deviceMutex_);
    cuda_.reset();  // waits for the queued CUDA collectives
    cudaCompleter_.store(nullptr);
  }
  P2pEngine* p2p = nullptr;
  {
    std::lock_guard<std::mutex> lock(p2pMutex_);
    p2p = p2p_.get();
  }
  // Sends issued before end as they would have (a send then a shutdown is how a rank hands
  // its last message on): delivered, or at their deadlines, for at most kShutdownSendGrace
  // (a receiver that never posts its receive must not hold the shutdown, nor its own
  // collective waiting for this rank, for the whole timeout). Receives still pending end now
  // (kAborted): nobody waited for them before shutting down.
  if (p2p != nullptr) p2p->waitForSends(kShutdownSendGrace);
  std::unique_ptr<P2pEngine> ending;
  {
    std::lock_guard<std::mutex> lock(p2pMutex_);
    ending = std::move(p2p_);
  }
  // Outside the lock: a callback on the engine's thread, which this joins, may ask
  // onOwnThread() (a shutdown of its own is refused by the flag above).
  ending.reset();
  // Nothing of this rank's runs any more: peers waiting for it fail now, naming a rank that
  // left, instead of at their timeout (torch's destroy_process_group shuts a group down while
  // Python may hold it, and its communicator is destroyed only with the last reference).
#ifdef LOOM_HAVE_NET
  // Before the goodbye below: a peer that has not heard it yet and connects to send is turned
  // away (its message would be taken in and lost), and connects again until it hears.
  if (spansHosts()) net::NetService::instance().forget(roster_.id, rank_);
#endif
  {
    std::lock_guard<std::mutex> lock(leaving_);
    if (shm_) shm_->depart();
    departed_ = true;
  }
  control_.reset();  // last: a failure while draining still reaches the other hosts
}

std::string CommState::progressReport() const {
  return failures_->progressReport();
}

void CommState::operationFailed(const std::exception_ptr& failure) {
  // A send or receive that timed out or lost its peer fails alone, the communicator goes
  // on: no report that says it failed (it would also use up the one its real failure gets).
  if (failures_->failed()) failures_->report(failure);
}

}  // namespace loom::detail
