// The random collective stream of stress_driver.h.

#include "stress_driver.h"

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "algorithms/collective.h"
#include "reference.h"

namespace loom::testing {

namespace {

// The engine's own list of collectives, kAllReduce (1) to kBarrier (the last).
constexpr unsigned kKinds = static_cast<unsigned>(CollectiveKind::kBarrier);

struct Case {
  CollectiveKind kind;
  DataType type;
  ReduceOp op;
  size_t count;
  int root;
  bool inPlace;
  uint32_t salt;
};

Case draw(std::mt19937& rng, int size, uint32_t salt) {
  Case c{};
  c.kind = static_cast<CollectiveKind>(1 + rng() % kKinds);
  c.type = static_cast<DataType>(rng() % kNumDataTypes);
  const auto ops = reductionsFor(c.type);
  c.op = ops[rng() % ops.size()];
  // Log-uniform sizes from 0 to about three 16 KiB chunks.
  const int bits = static_cast<int>(rng() % 16);
  c.count = bits == 0 ? 0 : (size_t{1} << (bits - 1)) + rng() % (size_t{1} << (bits - 1));
  c.count = std::min<size_t>(c.count, 3 * (16 << 10) / elementSize(c.type) + 5);
  c.root = static_cast<int>(rng() % static_cast<unsigned>(size));
  c.inPlace = rng() % 2 == 0;
  c.salt = salt;
  return c;
}

// An operation in flight, its buffers, and the check to run once it completes.
struct Pending {
  Request request;
  std::vector<std::vector<uint8_t>> buffers;
  std::function<std::string()> check;
};

std::unique_ptr<Pending> issue(Communicator& comm, const Case& c) {
  auto p = std::make_unique<Pending>();
  const int me = comm.rank();
  const int size = comm.size();
  const size_t es = elementSize(c.type);
  const size_t n = c.count;
  auto& bufs = p->buffers;
  Pending* self = p.get();
  switch (c.kind) {
    case CollectiveKind::kAllReduce: {
      bufs = {inputBytes(c.type, n, me, c.salt), std::vector<uint8_t>(n * es)};
      uint8_t* out = c.inPlace ? bufs[0].data() : bufs[1].data();
      p->request = comm.allReduce(bufs[0].data(), out, n, c.type, c.op);
      p->check = [=] {
        return firstDifference(out, referenceReduce(c.type, c.op, n, size, c.salt).data(), c.type,
                               n);
      };
      break;
    }
    case CollectiveKind::kReduce: {
      bufs = {inputBytes(c.type, n, me, c.salt), std::vector<uint8_t>(n * es)};
      uint8_t* out = c.inPlace ? bufs[0].data() : bufs[1].data();
      p->request = comm.reduce(bufs[0].data(), out, n, c.type, c.op, c.root);
      p->check = [=] {
        if (me != c.root) return std::string();
        return firstDifference(out, referenceReduce(c.type, c.op, n, size, c.salt).data(), c.type,
                               n);
      };
      break;
    }
    case CollectiveKind::kBroadcast: {
      bufs = {inputBytes(c.type, n, c.root, c.salt), std::vector<uint8_t>(n * es)};
      uint8_t* out = c.inPlace && me == c.root ? bufs[0].data() : bufs[1].data();
      p->request = comm.broadcast(bufs[0].data(), out, n, c.type, c.root);
      p->check = [=] {
        return firstDifference(out, inputBytes(c.type, n, c.root, c.salt).data(), c.type, n);
      };
      break;
    }
    case CollectiveKind::kAllGather: {
      bufs = {inputBytes(c.type, n, me, c.salt), std::vector<uint8_t>(n * es * size)};
      const uint8_t* in = bufs[0].data();
      if (c.inPlace) {
        // An empty vector's data() may be null, and memcpy must not see null even for 0 bytes.
        if (n != 0) std::memcpy(bufs[1].data() + me * n * es, in, n * es);
        in = bufs[1].data() + me * n * es;
      }
      p->request = comm.allGather(in, bufs[1].data(), n, c.type);
      p->check = [=] {
        for (int q = 0; q < size; ++q) {
          auto d = firstDifference(self->buffers[1].data() + q * n * es,
                                   inputBytes(c.type, n, q, c.salt).data(), c.type, n);
          if (!d.empty()) return "block " + std::to_string(q) + ": " + d;
        }
        return std::string();
      };
      break;
    }
    case CollectiveKind::kReduceScatter: {
      bufs = {inputBytes(c.type, n * size, me, c.salt), std::vector<uint8_t>(n * es)};
      uint8_t* out = c.inPlace ? bufs[0].data() + me * n * es : bufs[1].data();
      p->request = comm.reduceScatter(bufs[0].data(), out, n, c.type, c.op);
      p->check = [=] {
        return firstDifference(out, referenceReduce(c.type, c.op, n, size, c.salt, me * n).data(),
                               c.type, n);
      };
      break;
    }
    case CollectiveKind::kAllToAll: {
      bufs = {inputBytes(c.type, n * size, me, c.salt), std::vector<uint8_t>(n * es * size)};
      uint8_t* out = c.inPlace ? bufs[0].data() : bufs[1].data();
      p->request = comm.allToAll(bufs[0].data(), out, n, c.type);
      p->check = [=] {
        for (int q = 0; q < size; ++q) {
          auto d = firstDifference(out + q * n * es,
                                   inputBytes(c.type, n, q, c.salt, me * n).data(), c.type, n);
          if (!d.empty()) return "from " + std::to_string(q) + ": " + d;
        }
        return std::string();
      };
      break;
    }
    case CollectiveKind::kGather: {
      bufs = {inputBytes(c.type, n, me, c.salt), std::vector<uint8_t>(n * es * size)};
      std::vector<void*> outs;
      if (me == c.root) {
        for (int q = 0; q < size; ++q) outs.push_back(bufs[1].data() + q * n * es);
      }
      p->request = comm.gather(bufs[0].data(), outs, n, c.type, c.root);
      p->check = [=] {
        for (int q = 0; me == c.root && q < size; ++q) {
          auto d = firstDifference(self->buffers[1].data() + q * n * es,
                                   inputBytes(c.type, n, q, c.salt).data(), c.type, n);
          if (!d.empty()) return "from " + std::to_string(q) + ": " + d;
        }
        return std::string();
      };
      break;
    }
    case CollectiveKind::kScatter: {
      bufs = {inputBytes(c.type, n * size, c.root, c.salt), std::vector<uint8_t>(n * es)};
      std::vector<const void*> ins;
      if (me == c.root) {
        for (int q = 0; q < size; ++q) ins.push_back(bufs[0].data() + q * n * es);
      }
      p->request = comm.scatter(ins, bufs[1].data(), n, c.type, c.root);
      p->check = [=] {
        return firstDifference(self->buffers[1].data(),
                               inputBytes(c.type, n, c.root, c.salt, me * n).data(), c.type, n);
      };
      break;
    }
    case CollectiveKind::kBarrier:
      p->request = comm.barrier();
      p->check = [] { return std::string(); };
      break;
  }
  return p;
}

}  // namespace

std::string driveRandomCollectives(Communicator& comm, int ops, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::unique_ptr<Pending>> inFlight;
  try {
    for (int i = 0; i < ops;) {
      const int batch = 1 + static_cast<int>(rng() % 4);
      for (int b = 0; b < batch && i < ops; ++b, ++i) {
        inFlight.push_back(
            issue(comm, draw(rng, comm.size(), seed * 100003u + static_cast<uint32_t>(i))));
      }
      for (auto& p : inFlight) {
        p->request.wait();
        const std::string d = p->check();
        if (!d.empty()) return "operation " + std::to_string(i) + ": " + d;
      }
      inFlight.clear();
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TimedDrive driveRandomCollectivesUntil(Communicator& comm,
                                       std::chrono::steady_clock::time_point deadline, int batchOps,
                                       uint32_t seed,
                                       const std::function<void(int, long)>& afterBatch) {
  TimedDrive result;
  for (;;) {
    result.failure =
        driveRandomCollectives(comm, batchOps, seed + static_cast<uint32_t>(result.batches));
    if (!result.failure.empty()) {
      result.failure = "batch " + std::to_string(result.batches) + ": " + result.failure;
      return result;
    }
    result.operations += batchOps;
    ++result.batches;
    // Every member votes; all get the same maximum, so all leave after this same batch.
    int32_t timeUp = std::chrono::steady_clock::now() >= deadline ? 1 : 0;
    try {
      comm.allReduce(&timeUp, &timeUp, 1, DataType::kInt32, ReduceKind::kMax).wait();
    } catch (const std::exception& e) {
      result.failure = "agreement after batch " + std::to_string(result.batches) + ": " + e.what();
      return result;
    }
    if (timeUp != 0 && timeUp != 1) {
      result.failure = "agreement after batch " + std::to_string(result.batches) + " gave " +
                       std::to_string(timeUp) + ", not 0 or 1";
      return result;
    }
    if (afterBatch) afterBatch(result.batches, result.operations);
    if (timeUp == 1) return result;
  }
}

}  // namespace loom::testing
