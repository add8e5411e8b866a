#pragma once

// Several hosts on one machine for multi-host tests and benchmarks (loom-bench --hosts):
// network namespaces, each with one interface (eth0, address 10.77.0.<h+1>/24) whose veth
// peer sits on a bridge in a hub namespace of its own. Nothing is added to the machine's own
// namespace, and everything is removed again by the destructor (the names carry this
// process's pid). Needs root and iproute2 (`ip`, and `tc` to shape links).

#include <string>
#include <vector>

namespace loom::testing {

class NetnsHosts {
 public:
  /// Why hosts cannot be made here ("not root", "no ip command"), or empty if they can.
  static std::string unavailableReason();

  /// Makes `hosts` hosts; throws std::runtime_error with the failing command's output.
  explicit NetnsHosts(int hosts);
  ~NetnsHosts();
  NetnsHosts(const NetnsHosts&) = delete;
  NetnsHosts& operator=(const NetnsHosts&) = delete;

  int size() const { return static_cast<int>(names_.size()); }
  /// Moves the calling thread into host h's namespace (call first thing in a forked rank;
  /// threads it starts later inherit it). Sockets opened before stay where they were.
  void enter(int h) const;
  /// Host h's address ("10.77.0.1").
  std::string address(int h) const;
  /// Takes host h's link to the bridge down (false) or up again.
  void setLink(int h, bool up) const;
  /// Hosts a and b can no longer reach each other (each sends the other's packets to an
  /// address nobody has), while both still reach every other host.
  void cutBetween(int a, int b) const;
  /// Limits host h's link to `gbit` Gb/s in each direction (a tc token bucket on both ends
  /// of its veth pair, as a NIC of that speed would).
  void shape(int h, double gbit) const;

 private:
  void removeAll();
  /// Waits until every host's eth0 is operationally up (throws after 10 s).
  void awaitRunning() const;

  std::string hub_;
  std::vector<std::string> names_;
};

}  // namespace loom::testing
