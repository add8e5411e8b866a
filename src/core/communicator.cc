// The public Communicator: checks arguments, then hands the operation to CommState.

#include "loom/communicator.h"

#include <algorithm>
#include <set>

#include "core/comm_state.h"
#include "core/validate.h"
#include "loom/error.h"

namespace loom {

namespace {

using validate::Site;

// Checks a list of per-rank blocks: one entry per rank, a buffer wherever count > 0. The
// errors name the lists as the caller's parameters and the entry ("recvCounts[3]").
template <class Ptr>
void blocks(const Site& site, const char* what, std::span<Ptr const> ptrs, const char* countsName,
            std::span<const size_t> counts, DataType type) {
  validate::perRank(site, what, ptrs.size());
  validate::perRank(site, countsName, counts.size());
  for (size_t q = 0; q < ptrs.size(); ++q) {
    try {
      validate::bytesOf(site, countsName, counts[q], type);
      validate::buffer(site, what, ptrs[q], counts[q]);
    } catch (const Error&) {
      // Again with the entry in the names: nothing to build while the lists are right.
      const std::string at = "[" + std::to_string(q) + "]";
      validate::bytesOf(site, (countsName + at).c_str(), counts[q], type);
      validate::buffer(site, (what + at).c_str(), ptrs[q], counts[q]);
      throw;
    }
  }
}

// Checks that no two of the listed byte ranges overlap, except `allowed` pairs.
void disjoint(const Site& site, const char* what, std::span<void* const> ptrs,
              std::span<const size_t> counts, DataType type) {
  const size_t es = elementSize(type);
  for (size_t a = 0; a < ptrs.size(); ++a) {
    for (size_t b = a + 1; b < ptrs.size(); ++b) {
      validate::noPartialOverlap(site, what, ptrs[a], counts[a] * es, what, ptrs[b], counts[b] * es,
                                 false);
    }
  }
}

size_t sum(std::span<const size_t> counts) {
  size_t total = 0;
  for (size_t c : counts) total += c;
  return total;
}

// Which rank of communicator `parent` each rank of a child made of `members` is; empty where
// they are the same numbers.
std::string childLegend(const std::string& parent, const std::vector<int>& members) {
  bool same = true;
  for (size_t i = 0; i < members.size(); ++i) same = same && members[i] == static_cast<int>(i);
  if (same) return {};
  constexpr size_t kListed = 64;
  std::string s = "ranks of a communicator made from '" + parent + "'; its ranks 0 to " +
                  std::to_string(members.size() - 1) + " are ranks ";
  for (size_t i = 0; i < members.size() && i < kListed; ++i) {
    s += (i > 0 ? ", " : "") + std::to_string(members[i]);
  }
  if (members.size() > kListed) s += ", ... (" + std::to_string(members.size()) + " in all)";
  return s + " of '" + parent + "'";
}

// Makes the child of `parent` made of `members` (its ranks, in the child's order). Its
// creation's errors name the child's ranks, which its members do not know yet: where the
// caller gave no legend, they and the child's failure report say which rank of the parent
// each one is (a shrink's "rank 2 exited" would send its caller to leave out its own rank 2).
std::shared_ptr<Communicator> makeChild(detail::CommState& parent, const std::vector<int>& members,
                                        const std::string& salt, const CommOptions& options,
                                        bool watchParent) {
  CommOptions childOptions = options;
  const std::string legend = options.rankLegend.empty() ? childLegend(parent.name(), members) : "";
  if (!legend.empty()) childOptions.rankLegend = legend;
  try {
    return std::make_shared<Communicator>(
        detail::CommState::createChild(parent, members, salt, childOptions, watchParent));
  } catch (const Error& e) {
    // A split or subset stops for its parent's failure, whose message names the parent's ranks.
    if (legend.empty() || (watchParent && parent.isItsFailure(e))) throw;
    throw Error(e.code(), e.op(), e.rank(),
                e.detail() + " (ranks in this message are " + legend + ")");
  }
}

}  // namespace

Communicator::Communicator(std::shared_ptr<detail::CommState> state) : state_(std::move(state)) {}

Communicator::~Communicator() = default;

std::shared_ptr<Communicator> Communicator::create(int rank, int size, std::shared_ptr<Store> store,
                                                   const CommOptions& options) {
  const Site site{"create", rank, size};
  if (size < 1)
    validate::fail(site, "argument 'size' is " + std::to_string(size) + "; it must be at least 1");
  validate::rankInRange(site, "rank", rank);
  if (!store) validate::fail(site, "argument 'store' is null");
  if (options.timeout.count() <= 0) validate::fail(site, "the timeout must be positive");
  return std::make_shared<Communicator>(
      detail::CommState::createFromStore(rank, size, *store, options));
}

int Communicator::rank() const {
  return state_->rank();
}
int Communicator::size() const {
  return state_->size();
}
const std::string& Communicator::name() const {
  return state_->name();
}
uint64_t Communicator::lastSequence() const {
  return state_->lastSequence();
}

void Communicator::setTimeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    validate::fail({"set_timeout", rank(), size()}, "the timeout must be positive");
  }
  state_->setTimeout(timeout);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, const CommOptions& options) {
  if (options.timeout.count() <= 0)
    validate::fail({"split", rank(), size()}, "the timeout must be positive");
  state_->requireUsable("split");
  // Every rank learns every (color, key) through an all_gather on this communicator.
  const int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * static_cast<size_t>(size()));
  allGather(mine, all.data(), 2, DataType::kInt64).wait();
  const int number = state_->nextChildNumber("split");
  if (color < 0) return nullptr;
  std::vector<int> members;
  for (int q = 0; q < size(); ++q) {
    if (all[2 * q] == color) members.push_back(q);
  }
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  const std::string salt = "split/" + std::to_string(number) + "/" + std::to_string(color);
  return makeChild(*state_, members, salt, options, /*watchParent=*/true);
}

void Communicator::requireUsable(std::string_view op) const {
  state_->requireUsable(op);
}

void Communicator::requireMembersUsable(std::span<const int> members, std::string_view op) const {
  state_->requireMembersUsable(members, op);
}

std::shared_ptr<Communicator> Communicator::subset(std::span<const int> ranks,
                                                   const std::string& tag,
                                                   const CommOptions& options) {
  const Site site{"subset", rank(), size()};
  if (options.timeout.count() <= 0) validate::fail(site, "the timeout must be positive");
  std::set<int> seen;
  for (int q : ranks) {
    validate::rankInRange(site, "ranks", q);
    if (!seen.insert(q).second)
      validate::fail(site, "rank " + std::to_string(q) + " is listed twice");
  }
  // Made from a failed communicator too, where its failure spares the members (none died,
  // left or aborted it: a timeout, a death elsewhere), as torch users make new groups after
  // one with Gloo; the same rule stops the making if a failure lands meanwhile (createChild).
  state_->requireMembersUsable(ranks, "subset");
  if (seen.count(rank()) == 0) {
    validate::fail(site, "this rank (" + std::to_string(rank()) +
                             ") is not in 'ranks'; only the listed ranks call subset");
  }
  std::vector<int> members(ranks.begin(), ranks.end());
  std::string key = "subset/" + tag + "/";
  for (int q : members) key += std::to_string(q) + ",";
  const std::string salt = key + "#" + std::to_string(state_->nextChildNumber(key));
  return makeChild(*state_, members, salt, options, /*watchParent=*/true);
}

std::shared_ptr<Communicator> Communicator::shrink(std::span<const int> excluded,
                                                   const CommOptions& options, bool abortFirst) {
  // Unlike split and subset this works on a failed communicator: rebuilding without the
  // ranks that died is what it is for. Only the roster is used, never the shared segment.
  const Site site{"shrink", rank(), size()};
  state_->refuseInAFork("shrink");
  if (options.timeout.count() <= 0) validate::fail(site, "the timeout must be positive");
  std::set<int> gone;
  for (int q : excluded) {
    validate::rankInRange(site, "excluded", q);
    if (!gone.insert(q).second)
      validate::fail(site, "rank " + std::to_string(q) + " is listed twice in 'excluded'");
  }
  if (gone.empty()) validate::fail(site, "'excluded' is empty; name the ranks to leave out");
  if (gone.count(rank()) != 0) {
    validate::fail(site, "this rank (" + std::to_string(rank()) +
                             ") is in 'excluded'; only the ranks that remain call shrink");
  }
  if (abortFirst) abort();
  std::vector<int> members;
  std::string key = "shrink/";
  for (int q = 0; q < size(); ++q) {
    if (gone.count(q) != 0) continue;
    members.push_back(q);
    key += std::to_string(q) + ",";
  }
  const std::string salt = key + "#" + std::to_string(state_->nextChildNumber(key));
  return makeChild(*state_, members, salt, options, /*watchParent=*/false);
}

std::string Communicator::progressReport() const {
  return state_->progressReport();
}

Request Communicator::allReduce(const void* input, void* output, size_t count, DataType type,
                                ReduceOp op, const OpOptions& options) {
  const Site site{"all_reduce", rank(), size()};
  validate::dataType(site, type);
  validate::reduction(site, op, type, options.device);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::buffer(site, "input", input, count);
  validate::buffer(site, "output", output, count);
  validate::noPartialOverlap(site, "input", input, bytes, "output", output, bytes, true);
  auto args = CollectiveArgs::of(CollectiveKind::kAllReduce, type, op, 0, count, input, output);
  return state_->submit(std::move(args), options);
}

Request Communicator::reduce(const void* input, void* output, size_t count, DataType type,
                             ReduceOp op, int root, const OpOptions& options) {
  const Site site{"reduce", rank(), size()};
  validate::dataType(site, type);
  validate::reduction(site, op, type, options.device);
  validate::rankInRange(site, "root", root);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::buffer(site, "input", input, count);
  if (rank() == root) {
    validate::buffer(site, "output", output, count);
    validate::noPartialOverlap(site, "input", input, bytes, "output", output, bytes, true);
  }
  auto args = CollectiveArgs::of(CollectiveKind::kReduce, type, op, root, count, input, output);
  return state_->submit(std::move(args), options);
}

Request Communicator::broadcast(const void* input, void* output, size_t count, DataType type,
                                int root, const OpOptions& options) {
  const Site site{"broadcast", rank(), size()};
  validate::dataType(site, type);
  validate::rankInRange(site, "root", root);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::buffer(site, "output", output, count);
  if (rank() == root) {
    validate::buffer(site, "input", input, count);
    validate::noPartialOverlap(site, "input", input, bytes, "output", output, bytes, true);
  }
  auto args =
      CollectiveArgs::of(CollectiveKind::kBroadcast, type, ReduceOp(), root, count, input, output);
  return state_->submit(std::move(args), options);
}

Request Communicator::allGather(const void* input, void* output, size_t count, DataType type,
                                const OpOptions& options) {
  const Site site{"all_gather", rank(), size()};
  validate::dataType(site, type);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::bytesOf(site, "count", count * static_cast<size_t>(size()), type);
  validate::buffer(site, "input", input, count);
  validate::buffer(site, "output", output, count);
  auto* out = static_cast<uint8_t*>(output);
  if (input != out + rank() * bytes) {
    validate::noPartialOverlap(site, "input", input, bytes, "output", output, bytes * size(),
                               false);
  }
  auto args =
      CollectiveArgs::of(CollectiveKind::kAllGather, type, ReduceOp(), 0, count, input, nullptr);
  for (int q = 0; q < size(); ++q) args.outputs.push_back(out + q * bytes);
  args.outputCounts.assign(static_cast<size_t>(size()), count);
  return state_->submit(std::move(args), options);
}

namespace {

// Checks an all_gather_v's buffers and counts, and puts them into `args`.
void gatherV(const Site& site, CollectiveArgs& args, std::span<void* const> outputs,
             std::span<const size_t> counts) {
  blocks<void*>(site, "outputs", outputs, "counts", counts, args.type);
  validate::buffer(site, "input", args.input, counts[site.rank]);
  disjoint(site, "outputs", outputs, counts, args.type);
  const size_t es = elementSize(args.type);
  for (int q = 0; q < site.size; ++q) {
    validate::noPartialOverlap(site, "input", args.input, counts[site.rank] * es, "outputs",
                               outputs[q], counts[q] * es, q == site.rank);
  }
  args.count = sum(counts);
  args.outputs.assign(outputs.begin(), outputs.end());
  args.outputCounts.assign(counts.begin(), counts.end());
  args.variable = true;
  args.countsHash = validate::hashCounts(counts);
}

}  // namespace

Request Communicator::allGatherV(const void* input, std::span<void* const> outputs,
                                 std::span<const size_t> counts, DataType type,
                                 const OpOptions& options) {
  const Site site{"all_gather_v", rank(), size()};
  validate::dataType(site, type);
  auto args =
      CollectiveArgs::of(CollectiveKind::kAllGather, type, ReduceOp(), 0, 0, input, nullptr);
  gatherV(site, args, outputs, counts);
  return state_->submit(std::move(args), options);
}

Request Communicator::allGatherVPlaced(const void* input, std::function<Placement()> place,
                                       DataType type, const OpOptions& options) {
  const Site site{"all_gather_v", rank(), size()};
  validate::dataType(site, type);
  if (!place) validate::fail(site, "'place' is empty; pass the function that says the outputs");
  if (options.device != DeviceKind::kCpu) {
    throw Error(ErrorCode::kUnsupported, site.op, rank(),
                "a placed all_gather_v takes host memory only; gather device memory with "
                "allGatherV once the counts are known");
  }
  auto args =
      CollectiveArgs::of(CollectiveKind::kAllGather, type, ReduceOp(), 0, 0, input, nullptr);
  args.variable = true;
  // Checked as the call starts: a refusal then fails the communicator (CommState::execute),
  // since the peers are in the call already.
  args.place = [site, place = std::move(place)](CollectiveArgs& a) {
    const Placement placed = place();
    gatherV(site, a, placed.outputs, placed.counts);
  };
  return state_->submit(std::move(args), options);
}

Request Communicator::reduceScatter(const void* input, void* output, size_t count, DataType type,
                                    ReduceOp op, const OpOptions& options) {
  const Site site{"reduce_scatter", rank(), size()};
  validate::dataType(site, type);
  validate::reduction(site, op, type, options.device);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::bytesOf(site, "count", count * static_cast<size_t>(size()), type);
  validate::buffer(site, "input", input, count);
  validate::buffer(site, "output", output, count);
  const auto* in = static_cast<const uint8_t*>(input);
  if (output != in + rank() * bytes) {
    validate::noPartialOverlap(site, "input", input, bytes * size(), "output", output, bytes,
                               false);
  }
  auto args =
      CollectiveArgs::of(CollectiveKind::kReduceScatter, type, op, 0, count, nullptr, output);
  for (int q = 0; q < size(); ++q) args.inputs.push_back(in + q * bytes);
  args.inputCounts.assign(static_cast<size_t>(size()), count);
  return state_->submit(std::move(args), options);
}

Request Communicator::reduceScatterV(std::span<const void* const> inputs, void* output,
                                     std::span<const size_t> counts, DataType type, ReduceOp op,
                                     const OpOptions& options) {
  const Site site{"reduce_scatter_v", rank(), size()};
  validate::dataType(site, type);
  validate::reduction(site, op, type, options.device);
  blocks<const void*>(site, "inputs", inputs, "counts", counts, type);
  validate::buffer(site, "output", output, counts[rank()]);
  const size_t es = elementSize(type);
  for (int q = 0; q < size(); ++q) {
    validate::noPartialOverlap(site, "inputs", inputs[q], counts[q] * es, "output", output,
                               counts[rank()] * es, q == rank());
  }
  auto args =
      CollectiveArgs::of(CollectiveKind::kReduceScatter, type, op, 0, sum(counts), nullptr, output);
  args.inputs.assign(inputs.begin(), inputs.end());
  args.inputCounts.assign(counts.begin(), counts.end());
  args.variable = true;
  args.countsHash = validate::hashCounts(counts);
  return state_->submit(std::move(args), options);
}

Request Communicator::allToAll(const void* input, void* output, size_t count, DataType type,
                               const OpOptions& options) {
  const Site site{"all_to_all", rank(), size()};
  validate::dataType(site, type);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::bytesOf(site, "count", count * static_cast<size_t>(size()), type);
  validate::buffer(site, "input", input, count);
  validate::buffer(site, "output", output, count);
  validate::noPartialOverlap(site, "input", input, bytes * size(), "output", output, bytes * size(),
                             true);
  auto args =
      CollectiveArgs::of(CollectiveKind::kAllToAll, type, ReduceOp(), 0, count, nullptr, nullptr);
  for (int q = 0; q < size(); ++q) {
    args.inputs.push_back(static_cast<const uint8_t*>(input) + q * bytes);
    args.outputs.push_back(static_cast<uint8_t*>(output) + q * bytes);
  }
  args.inputCounts.assign(static_cast<size_t>(size()), count);
  args.outputCounts.assign(static_cast<size_t>(size()), count);
  return state_->submit(std::move(args), options);
}

Request Communicator::allToAllV(std::span<const void* const> inputs,
                                std::span<const size_t> sendCounts, std::span<void* const> outputs,
                                std::span<const size_t> recvCounts, DataType type,
                                const OpOptions& options) {
  const Site site{"all_to_all_v", rank(), size()};
  validate::dataType(site, type);
  blocks<const void*>(site, "inputs", inputs, "sendCounts", sendCounts, type);
  blocks<void*>(site, "outputs", outputs, "recvCounts", recvCounts, type);
  disjoint(site, "outputs", outputs, recvCounts, type);
  auto args =
      CollectiveArgs::of(CollectiveKind::kAllToAll, type, ReduceOp(), 0, 0, nullptr, nullptr);
  args.inputs.assign(inputs.begin(), inputs.end());
  args.inputCounts.assign(sendCounts.begin(), sendCounts.end());
  args.outputs.assign(outputs.begin(), outputs.end());
  args.outputCounts.assign(recvCounts.begin(), recvCounts.end());
  args.variable = true;
  args.countsHash = kUnevenAllToAllHash;
  return state_->submit(std::move(args), options);
}

Request Communicator::gather(const void* input, std::span<void* const> outputs, size_t count,
                             DataType type, int root, const OpOptions& options) {
  const Site site{"gather", rank(), size()};
  validate::dataType(site, type);
  validate::rankInRange(site, "root", root);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::buffer(site, "input", input, count);
  auto args =
      CollectiveArgs::of(CollectiveKind::kGather, type, ReduceOp(), root, count, input, nullptr);
  if (rank() == root) {
    const std::vector<size_t> counts(static_cast<size_t>(size()), count);
    blocks<void*>(site, "outputs", outputs, "count", counts, type);
    disjoint(site, "outputs", outputs, counts, type);
    for (int q = 0; q < size(); ++q) {
      validate::noPartialOverlap(site, "input", input, bytes, "outputs", outputs[q], bytes,
                                 q == root);
    }
    args.outputs.assign(outputs.begin(), outputs.end());
  }
  return state_->submit(std::move(args), options);
}

Request Communicator::scatter(std::span<const void* const> inputs, void* output, size_t count,
                              DataType type, int root, const OpOptions& options) {
  const Site site{"scatter", rank(), size()};
  validate::dataType(site, type);
  validate::rankInRange(site, "root", root);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::buffer(site, "output", output, count);
  auto args =
      CollectiveArgs::of(CollectiveKind::kScatter, type, ReduceOp(), root, count, nullptr, output);
  if (rank() == root) {
    const std::vector<size_t> counts(static_cast<size_t>(size()), count);
    blocks<const void*>(site, "inputs", inputs, "count", counts, type);
    for (int q = 0; q < size(); ++q) {
      validate::noPartialOverlap(site, "inputs", inputs[q], bytes, "output", output, bytes,
                                 q == root);
    }
    args.inputs.assign(inputs.begin(), inputs.end());
  }
  return state_->submit(std::move(args), options);
}

Request Communicator::barrier(const OpOptions& options) {
  return state_->submit(CollectiveArgs::of(CollectiveKind::kBarrier, DataType::kUInt8, ReduceOp(),
                                           0, 0, nullptr, nullptr),
                        options);
}

Request Communicator::send(const void* data, size_t count, DataType type, int peer, int tag,
                           const OpOptions& options) {
  const Site site{"send", rank(), size()};
  validate::dataType(site, type);
  validate::rankInRange(site, "peer", peer);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::buffer(site, "data", data, count);
  return state_->send(data, bytes, peer, tag, options);
}

Request Communicator::recv(void* data, size_t count, DataType type, int peer, int tag,
                           const OpOptions& options) {
  const Site site{"recv", rank(), size()};
  validate::dataType(site, type);
  if (peer != kAnySource) validate::rankInRange(site, "peer", peer);
  const size_t bytes = validate::bytesOf(site, "count", count, type);
  validate::buffer(site, "data", data, count);
  return state_->recv(data, bytes, peer, tag, options);
}

void Communicator::startGroup() {
  state_->startGroup();
}

void Communicator::endGroup() {
  state_->endGroup();
}

void Communicator::connectDevice(DeviceKind device, int deviceIndex) {
  state_->connectDevice(device, deviceIndex);
}

void Communicator::abort() {
  state_->abort();
}

void Communicator::shutdown() {
  state_->shutdown();
}

}  // namespace loom
