// HashStore, PrefixStore, TcpStore and the store wire format.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

#include "loom/error.h"
#include "loom/tcp_store.h"
#include "store/store_protocol.h"

namespace loom {
namespace {

Bytes bytes(const std::string& s) {
  return Bytes(s.begin(), s.end());
}

// The contract every Store implementation keeps.
void exerciseStore(Store& store) {
  store.set("a", bytes("1"));
  EXPECT_EQ(store.get("a", std::chrono::seconds(1)), bytes("1"));
  EXPECT_TRUE(store.check("a"));
  EXPECT_FALSE(store.check("missing"));
  EXPECT_EQ(store.add("counter", 5), 5);
  EXPECT_EQ(store.add("counter", -2), 3);
  EXPECT_TRUE(store.erase("a"));
  EXPECT_FALSE(store.erase("a"));
  store.set("blob", Bytes(100000, 7));
  EXPECT_EQ(store.get("blob", std::chrono::seconds(1)).size(), 100000u);
  store.set("empty", {});
  EXPECT_TRUE(store.get("empty", std::chrono::seconds(1)).empty());
  // get waits for a key set later, from another thread.
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    store.set("late", bytes("x"));
  });
  EXPECT_EQ(store.get("late", std::chrono::seconds(10)), bytes("x"));
  setter.join();
  // get of a key never set times out with a clear error.
  try {
    store.get("never", std::chrono::milliseconds(50));
    ADD_FAILURE() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("never"), std::string::npos);
  }
  // add on a non-counter is refused, not a crash.
  store.set("text", bytes("abc"));
  EXPECT_THROW(store.add("text", 1), Error);
}

TEST(HashStore, KeepsTheStoreContract) {
  HashStore store;
  exerciseStore(store);
}

TEST(PrefixStore, KeepsTheContractAndSeparatesKeys) {
  auto inner = std::make_shared<HashStore>();
  PrefixStore store("job", inner);
  exerciseStore(store);
  store.set("k", bytes("v"));
  EXPECT_TRUE(inner->check("job/k"));
  EXPECT_FALSE(inner->check("k"));
}

TEST(TcpStore, KeepsTheStoreContract) {
  TcpStoreServer server("127.0.0.1", 0);
  server.start();
  TcpStore store("127.0.0.1", server.port());
  exerciseStore(store);
}

TEST(TcpStore, ServesManyClientsAndSurvivesGarbage) {
  TcpStoreServer server("127.0.0.1", 0);
  server.start();
  {
    // A client that sends garbage and one that sends an oversized frame get disconnected;
    // the server goes on serving everyone else.
    TcpStore a("127.0.0.1", server.port());
    a.set("k", bytes("v"));
  }
  std::vector<std::thread> clients;
  for (int c = 0; c < 8; ++c) {
    clients.emplace_back([&, c] {
      TcpStore store("127.0.0.1", server.port());
      for (int i = 0; i < 50; ++i) store.add("shared", 1);
      store.set("client" + std::to_string(c), bytes("done"));
    });
  }
  for (auto& t : clients) t.join();
  TcpStore check("127.0.0.1", server.port());
  EXPECT_EQ(check.add("shared", 0), 400);
  EXPECT_EQ(check.get("k", std::chrono::seconds(1)), bytes("v"));
}

// The CPU time (user + system, in clock ticks) process `pid` has used so far.
long cpuTicksOf(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  std::istringstream fields(line.substr(line.rfind(')') + 2));  // past "pid (comm) "
  std::string field;
  long utime = 0, stime = 0;
  for (int i = 3; fields >> field; ++i) {  // field 3 is the state
    if (i == 14) utime = std::stol(field);
    if (i == 15) {
      stime = std::stol(field);
      break;
    }
  }
  return utime + stime;
}

// A server out of file descriptors (a job of more ranks than its process's limit) pauses
// accepting and leaves later clients in the listener's backlog, rather than spin a core
// on a listener it cannot drain (it took a whole core: 199 ticks in 2 s); once clients
// leave, a waiting one is served.
TEST(TcpStore, AServerOutOfDescriptorsWaitsInsteadOfSpinning) {
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    const rlimit few{32, 32};
    ::setrlimit(RLIMIT_NOFILE, &few);
    TcpStoreServer server("127.0.0.1", 0);
    server.start();
    const uint16_t port = server.port();
    [[maybe_unused]] ssize_t k = ::write(ready[1], &port, sizeof port);
    ::pause();  // until killed
    ::_exit(0);
  }
  uint16_t port = 0;
  ASSERT_EQ(::read(ready[0], &port, sizeof port), static_cast<ssize_t>(sizeof port));
  std::vector<int> connections;  // each takes one of the server's descriptors, or waits
  for (int i = 0; i < 40; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    connections.push_back(fd);
  }
  const long before = cpuTicksOf(child);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const long spent = cpuTicksOf(child) - before;
  for (int i = 0; i < 20; ++i) ::close(connections[i]);
  {
    TcpStore store("127.0.0.1", port);
    store.set("k", bytes("v"));
    EXPECT_EQ(store.get("k", std::chrono::seconds(10)), bytes("v"));
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  for (int i = 20; i < 40; ++i) ::close(connections[i]);
  ::close(ready[0]);
  ::close(ready[1]);
  // A spinning server takes the whole second; a waiting one next to nothing.
  EXPECT_LT(spent, ::sysconf(_SC_CLK_TCK) / 2) << "the server spun: " << spent << " ticks in 1 s";
}

TEST(TcpStore, ConnectTimesOutWithAClearError) {
  uint16_t port;
  {
    TcpStoreServer server("127.0.0.1", 0);  // bound, never started, then closed
    port = server.port();
  }
  try {
    TcpStore store("127.0.0.1", port, std::chrono::milliseconds(100));
    ADD_FAILURE() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  }
}

TEST(TcpStore, AServerThatNeverAnswersFailsEachRequestNamingIt) {
  // A listening socket nobody serves: connections complete in its backlog and requests are
  // taken in, but no reply ever comes, as from a server whose host is gone without a word.
  const int silent = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  ASSERT_EQ(::bind(silent, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(::listen(silent, 16), 0);
  ASSERT_EQ(::getsockname(silent, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const uint16_t port = ntohs(address.sin_port);
  TcpStore store("127.0.0.1", port, std::chrono::seconds(5), std::chrono::milliseconds(200));
  auto expectTimeout = [&](const std::function<void()>& request, const char* op,
                           const std::string& within) {
    try {
      request();
      ADD_FAILURE() << op << " returned though the server never answered";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
      EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("did not answer within " + within + " ms"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos)
          << e.what();
    }
  };
  expectTimeout([&] { store.set("k", bytes("v")); }, "store set", "200");
  expectTimeout([&] { store.add("n", 1); }, "store add", "200");
  // A get may be held by the server for its own timeout: the margin comes on top of it.
  expectTimeout([&] { store.get("k", std::chrono::milliseconds(300)); }, "store get", "500");
  // A margin of nothing (which the socket would read as no bound at all) is refused.
  EXPECT_THROW(TcpStore("127.0.0.1", port, std::chrono::seconds(5), std::chrono::milliseconds(0)),
               Error);
  ::close(silent);
}

TEST(StoreProtocol, RoundTripsEveryCommand) {
  store::Request set = store::Request::of(store::Command::kSet, "key");
  set.value = bytes("value");
  store::Request get = store::Request::of(store::Command::kGet, "key");
  get.timeoutMs = 1234;
  store::Request add = store::Request::of(store::Command::kAdd, "key");
  add.delta = -99;
  for (const store::Request& r : {set, get, add, store::Request::of(store::Command::kCheck, "k"),
                                  store::Request::of(store::Command::kErase, "k")}) {
    const Bytes frame = store::encodeRequest(r);
    ASSERT_EQ(store::readLength(frame.data()), frame.size() - 4);
    const auto parsed = store::parseRequest(std::span<const uint8_t>(frame).subspan(4));
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(parsed->command, r.command);
    EXPECT_EQ(parsed->key, r.key);
    EXPECT_EQ(parsed->value, r.value);
    EXPECT_EQ(parsed->delta, r.delta);
    EXPECT_EQ(parsed->timeoutMs, r.timeoutMs);
  }
}

TEST(StoreProtocol, RejectsMalformedBodies) {
  store::Request set = store::Request::of(store::Command::kSet, "key");
  set.value = bytes("value");
  const Bytes frame = store::encodeRequest(set);
  const std::span<const uint8_t> body = std::span<const uint8_t>(frame).subspan(4);
  // Every truncation fails cleanly.
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_FALSE(store::parseRequest(body.first(n)).has_value()) << n;
  }
  // Trailing bytes, unknown commands, empty or huge keys.
  Bytes longer(body.begin(), body.end());
  longer.push_back(0);
  EXPECT_FALSE(store::parseRequest(longer).has_value());
  Bytes unknown(body.begin(), body.end());
  unknown[0] = 99;
  EXPECT_FALSE(store::parseRequest(unknown).has_value());
  Bytes hugeKey = {1, 0xff, 0xff, 0xff, 0x7f};
  std::string why;
  EXPECT_FALSE(store::parseRequest(hugeKey, &why).has_value());
  EXPECT_FALSE(why.empty());
}

TEST(StoreProtocol, ParsesCounters) {
  EXPECT_EQ(store::parseCounter({}), 0);
  EXPECT_EQ(store::parseCounter(bytes("-42")), -42);
  EXPECT_FALSE(store::parseCounter(bytes("4x")).has_value());
  EXPECT_FALSE(store::parseCounter(bytes("99999999999999999999999")).has_value());
}

}  // namespace
}  // namespace loom
