#pragma once

// Device events that CUDA works reuse. Making an event and destroying it are a driver call
// each, and every CUDA call's work marks its end with one (docs/PERFORMANCE.md, "A small
// CUDA call's host path"); a work hands its event back here when it dies, and the next
// work records it anew. Shared by a group and its works, which may outlive it.

#include <c10/core/Event.h>

#include <iterator>
#include <mutex>
#include <vector>

namespace loom::torch_plugin {

class EventPool {
 public:
  /// An event for a stream on `device`: a spare one that was last recorded there (or never
  /// recorded), else a new one.
  c10::Event take(const c10::Device& device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = spares_.rbegin(); it != spares_.rend(); ++it) {
        // An event stays on the device it was first recorded on.
        if (it->device_type() == device.type() &&
            (it->device_index() == device.index() || it->device_index() == -1)) {
          c10::Event event = std::move(*it);
          spares_.erase(std::next(it).base());
          return event;
        }
      }
    }
    return c10::Event(device.type());
  }

  /// Takes `event` back once nothing will wait for it or ask it any more (a stream that
  /// was made to wait for it already keeps its own copy of that wait).
  void give(c10::Event&& event) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (spares_.size() < kMostSpares) spares_.push_back(std::move(event));
  }

 private:
  // More works than this alive at once are rare; beyond it, events are destroyed as before.
  static constexpr size_t kMostSpares = 256;
  std::mutex mutex_;
  std::vector<c10::Event> spares_;
};

}  // namespace loom::torch_plugin
