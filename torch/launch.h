#pragma once

// The one path every ProcessGroupLoom operation takes from checked arguments to a Work.

#include <c10/util/Exception.h>

#include "loom/error.h"
#include "process_group_loom.h"

namespace loom::torch_plugin {

template <class Issue>
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::launch(const CallSite& site, c10d::OpType type,
                                                        const char* title,
                                                        std::vector<at::Tensor> outputs,
                                                        std::function<void()> finisher,
                                                        Issue&& issue) {
  std::vector<Request> requests;
  try {
    issue(requests);
  } catch (const Error& e) {
    // Bad arguments are the caller's to fix (RuntimeError, like Gloo's checks); anything else
    // (a failed or shut-down communicator) is a backend error.
    if (e.code() == ErrorCode::kInvalidArgument) TORCH_CHECK(false, e.what());
    C10_THROW_ERROR(DistBackendError, e.what());
  }
  auto work = c10::make_intrusive<WorkLoom>(rank_, type, title, site.op, std::move(outputs),
                                            std::move(finisher));
  {
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    if (coalescing_) coalesced_.insert(coalesced_.end(), requests.begin(), requests.end());
  }
  work->track(std::move(requests));
  return work;
}

}  // namespace loom::torch_plugin
