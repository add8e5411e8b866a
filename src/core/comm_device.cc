// A communicator's device path: its executor, made by the first device call, and the
// device sends and receives it queues, one group (startGroup ... endGroup) at a time.

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/comm_state.h"
#include "core/fd_exchange.h"
#include "core/flight_recorder.h"
#include "core/op_state.h"
#include "util/comm_id.h"
#include "util/deadline.h"
#ifdef LOOM_HAVE_CUDA
#include "core/cuda_executor.h"
#endif

namespace loom::detail {

using Clock = std::chrono::steady_clock;

DeviceExecutor& CommState::deviceExecutor(const OpOptions& options, std::string_view op) {
  std::lock_guard<std::mutex> lock(deviceMutex_);
  if (cuda_) return *cuda_;
  if (cudaSetupFailure_) {
    throw Error(cudaSetupFailure_->code(), op, rank_,
                "setting up this communicator's CUDA path failed earlier (" +
                    cudaSetupFailure_->detail() + "); make a new communicator to try again");
  }
#ifdef LOOM_HAVE_CUDA
  if (spansHosts()) {
    throw Error(ErrorCode::kUnsupported, op, rank_,
                "CUDA collectives across hosts are not supported yet; keep the ranks of a "
                "communicator with CUDA tensors on one host, or use CPU tensors");
  }
  const std::vector<int>& here = hosts_.ranksOn(hosts_.hostOf(rank_));
  FdExchange exchange;
  exchange.id = deriveId(roster_.id, "cuda-workspaces");
  exchange.secret = roster_.secret;
  exchange.localRank = hosts_.localIndex(rank_);
  exchange.localSize = static_cast<int>(here.size());
  exchange.leaderAddress = roster_.peers[here[0]].address;
  exchange.op = std::string(op);
  exchange.rank = rank_;
  try {
    auto made = std::make_unique<CudaExecutor>(options.deviceIndex, config_.cuda, exchange,
                                               *failures_, deadlineAfter(timeoutFor(options)));
    cudaCompleter_.store(made.get());
    cuda_ = std::move(made);
  } catch (const Error& e) {
    cudaSetupFailure_ = e;
    if (e.op() == op) throw;
    throw Error(e.code(), op, rank_, e.detail());  // the driver's errors name no operation
  }
  return *cuda_;
#else
  // `options` names the device, which only a CUDA path uses.
  (void)options;
  throw Error(ErrorCode::kUnsupported, op, rank_,
              "this build of loom has no CUDA path (it was built without nvcc); rebuild it "
              "where the CUDA toolkit is installed, or use CPU tensors");
#endif
}

Request CommState::deviceTransfer(const Transfer& transfer, const OpOptions& options,
                                  uint64_t flightId, EndedUnqueued& refused) {
  const char* op = transfer.kind == Transfer::Kind::kSend ? "send" : "recv";
  auto refuse = [&](ErrorCode code, const std::string& detail) {
    Error e(code, op, rank_, detail);
    FlightRecorder::instance().ended(flightId, e.what());  // never queued
    throw e;
  };
  if (transfer.peer == kAnySource) {
    refuse(ErrorCode::kUnsupported,
           "receiving from any source is not supported on CUDA tensors (the GPU must know the "
           "sender when the receive is queued); name the source rank");
  }
  std::unique_lock<std::mutex> lock(groupMutex_);
  if (groupDepth_ > 0 && options.blocking) {
    refuse(ErrorCode::kInvalidArgument,
           "a blocking call inside a group would wait for the group's end; make it "
           "non-blocking, or issue it outside the group");
  }
  if (deviceMessages_.empty()) deviceMessages_.resize(static_cast<size_t>(size_));
  auto state = std::make_shared<OpState>(++deviceMessages_[static_cast<size_t>(transfer.peer)]);
  state->flightId = flightId;
  state->sink = this;
  state->startedAt = Clock::now();
  if (transfer.kind == Transfer::Kind::kRecv) state->source = transfer.peer;
  Request request(state);
  held_.push_back({transfer, std::move(state), options});
  if (groupDepth_ == 0) flushGroup(refused);
  return request;  // the caller settles a blocking one
}

void CommState::startGroup() {
  std::lock_guard<std::mutex> lock(groupMutex_);
  ++groupDepth_;
}

void CommState::EndedUnqueued::end(std::shared_ptr<OpState> state, std::exception_ptr failure) {
  OpState::Callbacks callbacks = state->finish(failure);
  ended.push_back({std::move(state), std::move(failure), std::move(callbacks)});
}

void CommState::EndedUnqueued::settle() {
  for (Ended& e : ended) OpState::runCallbacks(std::move(e.callbacks), e.failure, e.state->seq);
  ended.clear();
  if (thrown) std::rethrow_exception(std::exchange(thrown, nullptr));
}

void CommState::flushGroup(EndedUnqueued& refused) {
  std::vector<HeldTransfer> held;
  held.swap(held_);
  if (held.empty()) return;
  std::vector<Transfer> transfers;
  std::vector<std::shared_ptr<OpState>> states;
  std::chrono::milliseconds timeout{0};
  for (const HeldTransfer& h : held) {
    transfers.push_back(h.transfer);
    states.push_back(h.state);
    timeout = std::max(timeout, timeoutFor(h.options));
  }
  const OpOptions& options = held.front().options;
  const char* op = held.size() == 1 ? (transfers[0].kind == Transfer::Kind::kSend ? "send" : "recv")
                                    : "send/recv group";
  try {
    requireUsable(op);  // shut down meanwhile: refused, not queued on a new executor
    for (const HeldTransfer& h : held) {
      if (h.options.stream != options.stream || h.options.deviceIndex != options.deviceIndex) {
        throw Error(ErrorCode::kInvalidArgument, op, rank_,
                    "the sends and receives of one group must be on one device and stream");
      }
    }
    deviceExecutor(options, op).enqueueTransfers(transfers, states, options, timeout);
  } catch (...) {
    // Nothing was queued: every request of the group fails with the reason, which the call
    // throws once their callbacks ran (settle).
    refused.thrown = std::current_exception();
    for (const auto& state : states) refused.end(state, refused.thrown);
  }
}

}  // namespace loom::detail
