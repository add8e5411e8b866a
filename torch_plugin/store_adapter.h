#pragma once

// loom::Store over a c10d::Store, so communicators bootstrap through whatever store
// torch.distributed was initialised with (TCPStore, FileStore, PrefixStore, ...).

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "loom/store.h"

namespace loom::torch_plugin {

class StoreAdapter : public Store {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  bool erase(const std::string& key) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace loom::torch_plugin
