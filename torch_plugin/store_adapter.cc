// Forwarding loom's store calls to c10d.

#include "store_adapter.h"

#include "loom/error.h"

namespace loom::torch_plugin {

void StoreAdapter::set(const std::string& key, const Bytes& value) {
  store_->set(key, value);
}

Bytes StoreAdapter::get(const std::string& key, std::chrono::milliseconds timeout) {
  // c10d's wait() takes the timeout; get() then returns at once.
  try {
    store_->wait({key}, timeout);
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kTimeout, "store get", -1,
                "key '" + key + "' was not set within " + std::to_string(timeout.count()) +
                    " ms (" + e.what() + "); did every rank start?");
  }
  return store_->get(key);
}

int64_t StoreAdapter::add(const std::string& key, int64_t delta) {
  return store_->add(key, delta);
}

bool StoreAdapter::check(const std::string& key) {
  return store_->check({key});
}

bool StoreAdapter::erase(const std::string& key) {
  return store_->deleteKey(key);
}

}  // namespace loom::torch_plugin
