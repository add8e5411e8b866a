// Buffers, launching and checking for each benchmarked operation.

#include "bench_ops.h"

#include <cstring>
#include <functional>

#include "reference.h"

namespace loom::bench {

namespace {

constexpr BenchOp kAll[] = {BenchOp::kAllReduce, BenchOp::kAllGather, BenchOp::kReduceScatter,
                            BenchOp::kBroadcast, BenchOp::kAllToAll,  BenchOp::kReduce,
                            BenchOp::kGather,    BenchOp::kScatter};

// Counts elements of `got` that differ from want(offset, n), sampling when large.
size_t countWrong(const uint8_t* got, DataType type, size_t count,
                  const std::function<std::vector<uint8_t>(size_t, size_t)>& want) {
  const size_t es = elementSize(type);
  auto check = [&](size_t begin, size_t n) {
    const std::vector<uint8_t> expected = want(begin, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      bad += std::memcmp(got + (begin + i) * es, expected.data() + i * es, es) != 0;
    }
    return bad;
  };
  if (count <= (size_t{1} << 20)) return check(0, count);
  const size_t w = 4096;
  return check(0, w) + check(count / 2 - w / 2, w) + check(count - w, w);
}

}  // namespace

std::string_view opName(BenchOp op) {
  switch (op) {
    case BenchOp::kAllReduce: return "all_reduce";
    case BenchOp::kAllGather: return "all_gather";
    case BenchOp::kReduceScatter: return "reduce_scatter";
    case BenchOp::kBroadcast: return "broadcast";
    case BenchOp::kAllToAll: return "all_to_all";
    case BenchOp::kReduce: return "reduce";
    case BenchOp::kGather: return "gather";
    case BenchOp::kScatter: return "scatter";
  }
  return "?";
}

std::optional<BenchOp> parseOp(std::string_view name) {
  for (BenchOp op : kAll) {
    if (opName(op) == name) return op;
  }
  return std::nullopt;
}

CollectiveKind collectiveOf(BenchOp op) {
  switch (op) {
    case BenchOp::kAllReduce: return CollectiveKind::kAllReduce;
    case BenchOp::kAllGather: return CollectiveKind::kAllGather;
    case BenchOp::kReduceScatter: return CollectiveKind::kReduceScatter;
    case BenchOp::kBroadcast: return CollectiveKind::kBroadcast;
    case BenchOp::kAllToAll: return CollectiveKind::kAllToAll;
    case BenchOp::kReduce: return CollectiveKind::kReduce;
    case BenchOp::kGather: return CollectiveKind::kGather;
    case BenchOp::kScatter: return CollectiveKind::kScatter;
  }
  return CollectiveKind::kAllReduce;
}

double busFactor(BenchOp op, int ranks) {
  const double p = ranks;
  switch (op) {
    case BenchOp::kAllReduce: return 2 * (p - 1) / p;
    case BenchOp::kAllGather:
    case BenchOp::kReduceScatter:
    case BenchOp::kAllToAll: return (p - 1) / p;
    default: return 1;
  }
}

double trafficFactor(BenchOp op, int ranks, size_t bytes, const SelectionTable& table) {
  const double p = ranks;
  switch (op) {
    case BenchOp::kAllReduce:
      // One-shot: each rank copies in (2N) and reads every slot (PN) writing N.
      // Two-shot: copy in (2N), reduce a 1/P slice of P slots (N + N/P), gather (2N).
      return table.allReduce(bytes) == Algorithm::kOneShot ? p * (p + 3) : 5 * p + 1;
    case BenchOp::kReduce:
      return table.reduce(bytes) == Algorithm::kOneShot ? 2 * p + p + 1 : 3 * p + 1 + 2;
    case BenchOp::kAllGather: return 2 + 2 * p;      // N = whole output
    case BenchOp::kReduceScatter: return 3 * p + 1;  // N = whole input per rank
    case BenchOp::kBroadcast: return 2 * p;          // root copies in, others copy out
    case BenchOp::kAllToAll: return 4 * p;           // copy in and out, per rank
    case BenchOp::kGather:
    case BenchOp::kScatter: return 4 - 2 / p;  // N = whole root buffer
  }
  return 1;
}

double dramFactor(BenchOp op, int ranks) {
  const double p = ranks;
  switch (op) {
    case BenchOp::kAllReduce:
    case BenchOp::kAllToAll: return 2 * p;
    case BenchOp::kAllGather:             // N / P in, N out, per rank
    case BenchOp::kReduceScatter:         // N in, N / P out, per rank
    case BenchOp::kBroadcast:             // the root reads N, every rank writes N
    case BenchOp::kReduce: return p + 1;  // every rank reads N, the root writes N
    case BenchOp::kGather:
    case BenchOp::kScatter: return 2;  // N / P per rank one way, N at the root the other
  }
  return 1;
}

OpCase::OpCase(Communicator& comm, BenchOp op, DataType type, ReduceOp reduce, size_t bytes,
               bool inPlace, bool lent)
    : comm_(comm),
      op_(op),
      type_(type),
      reduce_(reduce),
      inPlace_(inPlace),
      input_(lent),
      output_(lent) {
  const size_t es = elementSize(type);
  const size_t p = static_cast<size_t>(comm.size());
  const int me = comm.rank();
  switch (op) {
    case BenchOp::kAllReduce:
    case BenchOp::kBroadcast:
    case BenchOp::kReduce:
      count_ = bytes / es;
      bytes_ = count_ * es;
      input_.resize(bytes_);
      output_.resize(inPlace ? 0 : bytes_);
      in_ = input_.data();
      out_ = inPlace ? in_ : output_.data();
      break;
    case BenchOp::kAllGather:
    case BenchOp::kGather:
      count_ = bytes / es / p;
      bytes_ = count_ * es * p;
      output_.resize(bytes_);
      input_.resize(inPlace ? 0 : count_ * es);
      in_ = inPlace ? output_.data() + me * count_ * es : input_.data();
      out_ = output_.data();
      for (size_t q = 0; q < p; ++q) outputs_.push_back(out_ + q * count_ * es);
      break;
    case BenchOp::kReduceScatter:
    case BenchOp::kScatter:
      count_ = bytes / es / p;
      bytes_ = count_ * es * p;
      input_.resize(bytes_);
      output_.resize(inPlace ? 0 : count_ * es);
      in_ = input_.data();
      out_ = inPlace ? in_ + me * count_ * es : output_.data();
      for (size_t q = 0; q < p; ++q) inputs_.push_back(in_ + q * count_ * es);
      break;
    case BenchOp::kAllToAll:
      count_ = bytes / es / p;
      bytes_ = count_ * es * p;
      input_.resize(bytes_);
      output_.resize(inPlace ? 0 : bytes_);
      in_ = input_.data();
      out_ = inPlace ? in_ : output_.data();
      break;
  }
  // Touch every page now: first-touch page faults must not land in the timed loop.
  refill(0);
}

void OpCase::refill(uint32_t salt) {
  const int me = comm_.rank();
  const size_t p = static_cast<size_t>(comm_.size());
  // The output first (in place, the input lies inside it): a pattern no rank's data
  // matches, so a result the call never wrote is counted wrong. Every rank's input is its
  // own: a non-root of a broadcast or a scatter, in place, must not start out holding the
  // root's data, or a call that moved nothing would pass.
  if (!output_.empty()) std::memset(output_.data(), 0xA5, output_.size());
  switch (op_) {
    case BenchOp::kAllReduce:
    case BenchOp::kReduce:
    case BenchOp::kBroadcast:
    case BenchOp::kAllGather:
    case BenchOp::kGather: testing::fillInput(in_, type_, count_, me, salt); break;
    case BenchOp::kReduceScatter:
    case BenchOp::kAllToAll:
    case BenchOp::kScatter: testing::fillInput(in_, type_, count_ * p, me, salt); break;
  }
}

Request OpCase::launch() {
  const int root = 0;
  // The blocking form: each call runs on this thread when nothing else is queued.
  OpOptions o;
  o.blocking = true;
  switch (op_) {
    case BenchOp::kAllReduce: return comm_.allReduce(in_, out_, count_, type_, reduce_, o);
    case BenchOp::kReduce: return comm_.reduce(in_, out_, count_, type_, reduce_, root, o);
    case BenchOp::kBroadcast: return comm_.broadcast(in_, out_, count_, type_, root, o);
    case BenchOp::kAllGather: return comm_.allGather(in_, out_, count_, type_, o);
    case BenchOp::kReduceScatter: return comm_.reduceScatter(in_, out_, count_, type_, reduce_, o);
    case BenchOp::kAllToAll: return comm_.allToAll(in_, out_, count_, type_, o);
    case BenchOp::kGather:
      return comm_.gather(
          in_, comm_.rank() == root ? std::span<void* const>(outputs_) : std::span<void* const>(),
          count_, type_, root, o);
    case BenchOp::kScatter:
      return comm_.scatter(comm_.rank() == root ? std::span<const void* const>(inputs_)
                                                : std::span<const void* const>(),
                           out_, count_, type_, root, o);
  }
  return Request();
}

size_t OpCase::wrong(uint32_t salt) {
  const int me = comm_.rank();
  const int p = comm_.size();
  const size_t es = elementSize(type_);
  using testing::inputBytes;
  using testing::referenceReduce;
  switch (op_) {
    case BenchOp::kAllReduce:
      return countWrong(out_, type_, count_, [&](size_t off, size_t n) {
        return referenceReduce(type_, reduce_, n, p, salt, off);
      });
    case BenchOp::kReduce:
      if (me != 0) return 0;
      return countWrong(out_, type_, count_, [&](size_t off, size_t n) {
        return referenceReduce(type_, reduce_, n, p, salt, off);
      });
    case BenchOp::kBroadcast:
      return countWrong(out_, type_, count_,
                        [&](size_t off, size_t n) { return inputBytes(type_, n, 0, salt, off); });
    case BenchOp::kAllGather:
    case BenchOp::kGather: {
      if (op_ == BenchOp::kGather && me != 0) return 0;
      size_t bad = 0;
      for (int q = 0; q < p; ++q) {
        bad += countWrong(out_ + q * count_ * es, type_, count_,
                          [&](size_t off, size_t n) { return inputBytes(type_, n, q, salt, off); });
      }
      return bad;
    }
    case BenchOp::kReduceScatter:
      return countWrong(out_, type_, count_, [&](size_t off, size_t n) {
        return referenceReduce(type_, reduce_, n, p, salt, me * count_ + off);
      });
    case BenchOp::kScatter:
      return countWrong(out_, type_, count_, [&](size_t off, size_t n) {
        return inputBytes(type_, n, 0, salt, me * count_ + off);
      });
    case BenchOp::kAllToAll: {
      size_t bad = 0;
      for (int q = 0; q < p; ++q) {
        bad += countWrong(out_ + q * count_ * es, type_, count_, [&](size_t off, size_t n) {
          return inputBytes(type_, n, q, salt, me * count_ + off);
        });
      }
      return bad;
    }
  }
  return 0;
}

}  // namespace loom::bench
