#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace loom {

/// Bytes stored under a key.
using Bytes = std::vector<uint8_t>;

/// A small key-value store that every rank of a job can reach, used only to bootstrap
/// communicators. Implementations: HashStore (one process), TcpStore (a job), and the
/// PyTorch plugin's adapter over c10d::Store.
class Store {
 public:
  virtual ~Store() = default;
  /// Sets `key` to `value`, waking anyone blocked in get(key).
  virtual void set(const std::string& key, const Bytes& value) = 0;
  /// Returns the value of `key`, waiting up to `timeout` for it to be set; throws
  /// Error(kTimeout) naming the key if it is not.
  virtual Bytes get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  /// Adds `delta` to the integer stored under `key` (0 if unset) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// True if `key` is set now; never waits.
  virtual bool check(const std::string& key) = 0;
  /// Removes `key`; returns whether it existed.
  virtual bool erase(const std::string& key) = 0;
};

/// A thread-safe in-process store, for tests that run several ranks as threads.
class HashStore : public Store {
 public:
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  bool erase(const std::string& key) override;

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, Bytes> data_;
};

/// Prepends "<prefix>/" to every key of an underlying store, so that several communicators
/// can bootstrap through one store without their keys meeting.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> inner);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  bool erase(const std::string& key) override;

 private:
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  std::string prefix_;
  std::shared_ptr<Store> inner_;
};

}  // namespace loom
