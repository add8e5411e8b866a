// ProcessGroupLoom's lifecycle: creation, splitting, coalescing, timeouts, abort.

#include "process_group_loom.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "loom/error.h"
#include "store_adapter.h"

namespace loom::torch_plugin {

namespace {

CommOptions commOptions(const c10d::Backend::Options& options) {
  CommOptions c;
  c.timeout = options.timeout;
  c.name = options.group_name.empty() ? "loom" : options.group_name;
  return c;
}

// Runs `f`, turning loom errors into torch errors for Python.
template <class F>
auto translated(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kInvalidArgument) TORCH_CHECK(false, e.what());
    C10_THROW_ERROR(DistBackendError, e.what());
  }
}

}  // namespace

ProcessGroupLoom::ProcessGroupLoom(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   c10::intrusive_ptr<Options> options)
    : c10d::Backend(rank, size), options_(std::move(options)) {
  comm_ = translated([&] {
    return Communicator::create(rank, size, std::make_shared<StoreAdapter>(store), commOptions(*options_));
  });
}

ProcessGroupLoom::ProcessGroupLoom(std::shared_ptr<Communicator> comm, c10::intrusive_ptr<Options> options)
    : c10d::Backend(comm->rank(), comm->size()), comm_(std::move(comm)), options_(std::move(options)) {}

ProcessGroupLoom::~ProcessGroupLoom() = default;

OpOptions ProcessGroupLoom::opOptions(std::chrono::milliseconds timeout) const {
  OpOptions o;
  if (timeout.count() > 0) o.timeout = timeout;  // kUnsetTimeout (-1) means the group's
  return o;
}

void ProcessGroupLoom::setTimeout(std::chrono::milliseconds timeout) {
  options_->timeout = timeout;
  translated([&] {
    comm_->setTimeout(timeout);
    return 0;
  });
}

void ProcessGroupLoom::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalesceMutex_);
  TORCH_CHECK(!coalescing_, "loom: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::endCoalescing() {
  std::vector<Request> requests;
  {
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    TORCH_CHECK(coalescing_, "loom: endCoalescing called without startCoalescing");
    coalescing_ = false;
    requests.swap(coalesced_);
  }
  // The operations were queued as they were called; this work completes with the last.
  auto work = c10::make_intrusive<WorkLoom>(rank_, c10d::OpType::COALESCED, "loom:coalesced", "coalesced",
                                            std::vector<at::Tensor>{}, nullptr);
  work->track(std::move(requests));
  return work;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupLoom::split(const c10::intrusive_ptr<c10d::Store>& /*store*/,
                                                          const std::vector<int>& ranks,
                                                          const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  // `ranks` are global ranks; map them to ranks of this group through the global ranks of
  // this group's members (known from this group's options).
  const auto& mine = options_->global_ranks_in_group;
  std::vector<int> members;
  for (int global : ranks) {
    int local = global;
    if (!mine.empty()) {
      auto it = std::find(mine.begin(), mine.end(), static_cast<uint64_t>(global));
      TORCH_CHECK(it != mine.end(), "loom split (rank ", rank_, "): global rank ", global,
                  " is not a member of the group being split");
      local = static_cast<int>(it - mine.begin());
    }
    members.push_back(local);
  }
  if (std::find(members.begin(), members.end(), rank_) == members.end()) return nullptr;
  auto childOptions = c10::make_intrusive<Options>(opts ? opts->timeout : options_->timeout);
  if (opts) {
    childOptions->group_name = opts->group_name;
    childOptions->group_desc = opts->group_desc;
  }
  childOptions->global_ranks_in_group.assign(ranks.begin(), ranks.end());
  const std::string tag = childOptions->group_name.empty() ? "split" : childOptions->group_name;
  auto child = translated([&] { return comm_->subset(members, tag, commOptions(*childOptions)); });
  return c10::make_intrusive<ProcessGroupLoom>(std::move(child), childOptions);
}

void ProcessGroupLoom::abort() { comm_->abort(); }

void ProcessGroupLoom::shutdown() { comm_->shutdown(); }

}  // namespace loom::torch_plugin
