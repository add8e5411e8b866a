// Forwarding loom's store calls to c10d, its errors turned into loom's.

#include "store_adapter.h"

#include <c10/util/Exception.h>

#include "loom/error.h"

namespace loom::torch_plugin {

namespace {

/// The connection to torch's store is gone: what its error is in loom's words.
Error lostStore(const char* op, const std::string& key, const c10::Error& e) {
  return Error(ErrorCode::kPeerFailure, op, -1,
               "lost torch's store while asking for key '" + key + "' (" +
                   e.what_without_backtrace() +
                   "); the store lives in the process of rank 0 (or at MASTER_ADDR): did it exit?");
}

/// Runs `f`, one call on torch's store: a lost connection, and any other failure of the
/// store, become loom errors naming the call and the key.
template <class F>
auto forwarded(const char* op, const std::string& key, F&& f) {
  try {
    return f();
  } catch (const c10::DistNetworkError& e) {
    throw lostStore(op, key, e);
  } catch (const c10::Error& e) {
    throw Error(ErrorCode::kSystem, op, -1,
                "torch's store failed on key '" + key + "': " + e.what_without_backtrace());
  }
}

}  // namespace

void StoreAdapter::set(const std::string& key, const Bytes& value) {
  forwarded("store set", key, [&] {
    store_->set(key, value);
    return 0;
  });
}

Bytes StoreAdapter::get(const std::string& key, std::chrono::milliseconds timeout) {
  // c10d's wait() takes the timeout; get() then returns at once.
  try {
    store_->wait({key}, timeout);
  } catch (const c10::DistNetworkError& e) {
    throw lostStore("store get", key, e);
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kTimeout, "store get", -1,
                "key '" + key + "' was not set within " + std::to_string(timeout.count()) +
                    " ms (" + e.what() + "); did every rank start?");
  }
  return forwarded("store get", key, [&] { return store_->get(key); });
}

int64_t StoreAdapter::add(const std::string& key, int64_t delta) {
  return forwarded("store add", key, [&] { return store_->add(key, delta); });
}

bool StoreAdapter::check(const std::string& key) {
  return forwarded("store check", key, [&] { return store_->check({key}); });
}

bool StoreAdapter::erase(const std::string& key) {
  return forwarded("store erase", key, [&] { return store_->deleteKey(key); });
}

}  // namespace loom::torch_plugin
