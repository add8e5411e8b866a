// PrefixStore: a namespace inside another store.

#include "loom/store.h"

namespace loom {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> inner)
    : prefix_(std::move(prefix)), inner_(std::move(inner)) {}

void PrefixStore::set(const std::string& key, const Bytes& value) {
  inner_->set(full(key), value);
}

Bytes PrefixStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return inner_->get(full(key), timeout);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return inner_->add(full(key), delta);
}

bool PrefixStore::check(const std::string& key) {
  return inner_->check(full(key));
}

bool PrefixStore::erase(const std::string& key) {
  return inner_->erase(full(key));
}

}  // namespace loom
