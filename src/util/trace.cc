// Spans per thread, written as a Chrome trace at exit.

#include "util/trace.h"

#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "util/env.h"
#include "util/posix.h"

namespace loom::trace {

namespace {

// Past this many spans a thread records no more (a trace is for a few seconds of a run).
constexpr size_t kMaxSpansPerThread = size_t{1} << 20;

struct Event {
  const char* name;
  uint64_t arg;
  uint64_t start;  // ns, steady clock
  uint64_t end;
  int cpu;  // where the span began (threads sharing a CPU show as overlapping spans on it)
};

struct Buffer {
  std::mutex mutex;  // the owner appends, flush reads
  std::vector<Event> events;
  long tid = 0;
  uint64_t generation = 0;  // of the process that made it (a forked child starts anew)
};

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<Buffer>> buffers;
  std::string prefix;
  uint64_t generation = 0;  // bumped in a forked child
  // Spans recorded so far, and as of the last write: a process that makes and ends many
  // communicators rewrites its file only when something new was recorded.
  std::atomic<uint64_t> recorded{0};
  uint64_t written = ~uint64_t{0};
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: threads may record at exit
  return *r;
}

uint64_t now() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

Buffer& mine() {
  thread_local std::shared_ptr<Buffer> buffer;
  Registry& r = registry();
  if (!buffer || buffer->generation != r.generation) {
    buffer = std::make_shared<Buffer>();
    buffer->tid = static_cast<long>(::syscall(SYS_gettid));
    std::lock_guard<std::mutex> lock(r.mutex);
    buffer->generation = r.generation;
    r.buffers.push_back(buffer);
  }
  return *buffer;
}

void forgetParent() {
  Registry& r = registry();
  r.buffers.clear();  // the parent's spans are the parent's to write
  ++r.generation;
  r.recorded.store(0, std::memory_order_relaxed);
  r.written = ~uint64_t{0};
}

bool start() {
  const auto prefix = env::text("LOOM_TRACE");
  if (!prefix) return false;
  registry().prefix = *prefix;
  ::pthread_atfork(nullptr, nullptr, forgetParent);
  std::atexit(flush);
  return true;
}

}  // namespace

bool enabled() {
  static const bool on = start();
  return on;
}

void Span::begin(const char* name, uint64_t arg) {
  name_ = name;
  arg_ = arg;
  cpu_ = ::sched_getcpu();
  start_ = now();
}

void Span::end() {
  const uint64_t finish = now();
  Buffer& b = mine();
  std::lock_guard<std::mutex> lock(b.mutex);
  if (b.events.size() < kMaxSpansPerThread) {
    b.events.push_back({name_, arg_, start_, finish, cpu_});
    registry().recorded.fetch_add(1, std::memory_order_relaxed);  // after the push: see flush()
  }
}

void flush() {
  if (!enabled()) return;
  Registry& r = registry();
  std::vector<std::shared_ptr<Buffer>> buffers;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    const uint64_t recorded = r.recorded.load(std::memory_order_relaxed);
    if (recorded == r.written) return;
    r.written = recorded;
    buffers = r.buffers;
  }
  const long pid = static_cast<long>(::getpid());
  const std::string path = r.prefix + "." + std::to_string(pid) + ".json";
  // A prefix in a folder not made yet (LOOM_TRACE=/tmp/trace/run) gets its folder.
  FILE* out = posix::openMakingFolder(path, "w");
  if (!out) {
    std::fprintf(stderr, "loom: LOOM_TRACE: cannot write %s\n", path.c_str());
    return;
  }
  std::fprintf(out, "{\"traceEvents\":[\n");
  bool first = true;
  for (const auto& b : buffers) {
    std::lock_guard<std::mutex> lock(b->mutex);
    for (const Event& e : b->events) {
      std::fprintf(out,
                   "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%ld,\"tid\":%ld,\"ts\":%.3f,"
                   "\"dur\":%.3f,\"args\":{\"n\":%llu,\"cpu\":%d}}",
                   first ? "" : ",\n", e.name, pid, b->tid, e.start / 1e3, (e.end - e.start) / 1e3,
                   static_cast<unsigned long long>(e.arg), e.cpu);
      first = false;
    }
  }
  std::fprintf(out, "\n]}\n");
  std::fclose(out);
}

}  // namespace loom::trace
