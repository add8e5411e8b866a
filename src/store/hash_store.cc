// HashStore: an in-process Store for tests that run ranks as threads.

#include <optional>
#include <string>

#include "loom/error.h"
#include "loom/store.h"
#include "store/store_protocol.h"
#include "util/deadline.h"

namespace loom {

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    data_[key] = value;
  }
  changed_.notify_all();
}

Bytes HashStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!changed_.wait_until(lock, deadlineAfter(timeout), [&] { return data_.count(key) != 0; })) {
    throw Error(ErrorCode::kTimeout, "store get", -1,
                "key '" + key + "' was not set within " + std::to_string(timeout.count()) +
                    " ms; did every rank start?");
  }
  return data_[key];
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Bytes& bytes = data_[key];
    const std::optional<int64_t> current = store::parseCounter(bytes);
    if (!current) {
      throw Error(ErrorCode::kInvalidArgument, "store add", -1,
                  "key '" + key + "' holds a value that is not a counter");
    }
    value = *current + delta;
    const std::string text = std::to_string(value);
    bytes.assign(text.begin(), text.end());
  }
  changed_.notify_all();
  return value;
}

bool HashStore::check(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.count(key) != 0;
}

bool HashStore::erase(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.erase(key) != 0;
}

}  // namespace loom
