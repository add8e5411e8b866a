#pragma once

// The synchronisation protocol every shared-memory collective is built from.
//
// Each rank owns a phase counter `posted` (its RankLine) and two data halves. All ranks of
// a communicator walk through the same sequence of phases 1, 2, 3, ...; phase p uses half
// p % 2. In phase p a rank
//   1. beginWrite(p): waits until every rank has posted p - 1, i.e. has finished reading
//      phase p - 2, the last phase that used this half;
//   2. writes its half (and, in an operation's first phase, its OpDesc);
//   3. post(p): a release store of p, so its writes are visible to whoever acquires p;
//   4. waits for the ranks it reads from to post p (acquire), then reads their halves.
// Hence "rank q posted p" means: q's data for p is complete and q is done reading every
// phase before p. Two halves let a fast rank fill phase p + 1 while others still read p.
// beginWrite is free in the common case: a rank that waited for all ranks in phase p - 1
// already knows they posted it.
//
// Waits spin, then yield, then sleep on the counter's futex. Every wait also watches the
// communicator's shared failure record, so one rank's failure (a dead peer, a timeout, a
// mismatch, an abort) releases every rank's waiters at once. What a failure says is not
// decided here: waits that cannot go on report to the communicator's Failures, which also
// writes the record (through recordFailure) and reads it back (recordedFailure).

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "loom/error.h"
#include "transport/failures.h"
#include "transport/shm/lending.h"
#include "transport/shm/segment.h"
#include "util/backoff.h"

namespace loom::shm {

/// A rank's view of one communicator's segment: phase primitives, slots, descriptors and
/// the failure record.
class ShmComm {
 public:
  /// Rank `rank` of the segment's ranks, which are the communicator's ranks `ranks` (the
  /// ranks of this host, in order; empty: the segment holds the whole communicator). Failures
  /// are reported in the communicator's ranks.
  ShmComm(std::shared_ptr<Segment> segment, int rank, BackoffPolicy backoff,
          std::vector<int> ranks = {});

  /// Where waits report what stops them (a failure, a peer gone, the deadline); set once,
  /// before the first wait.
  void setFailures(Failures& failures) { failures_ = &failures; }

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The communicator's rank of the segment's rank q (failures and messages name those).
  int communicatorRank(int q) const { return ranks_[q]; }
  size_t chunkBytes() const { return layout_.chunkBytes; }
  const Segment& segment() const { return *segment_; }

  /// Rank q's data half for phase p (chunkBytes bytes).
  uint8_t* slot(int q, uint64_t phase) const {
    return base_ + layout_.slots + (static_cast<size_t>(q) * 2 + (phase & 1)) * layout_.chunkBytes;
  }
  /// Rank q's operation descriptor for the half of phase p.
  OpDesc& desc(int q, uint64_t phase) const {
    return reinterpret_cast<OpDesc*>(base_ +
                                     layout_.descs)[static_cast<size_t>(q) * 2 + (phase & 1)];
  }

  /// Rank q's signature text for the half of phase p (desync debug).
  OpSignature& signature(int q, uint64_t phase) const {
    return reinterpret_cast<OpSignature*>(
        base_ + layout_.signatures)[static_cast<size_t>(q) * 2 + (phase & 1)];
  }

  /// Where rank q's input for the operation in the half of phase p lies, if it lent it.
  LentBuffer& lent(int q, uint64_t phase) const {
    return reinterpret_cast<LentBuffer*>(base_ +
                                         layout_.lent)[static_cast<size_t>(q) * 2 + (phase & 1)];
  }
  /// Rank q's lent buffer `buffer` mapped into this process (read-only), or nullptr if it
  /// cannot be (q runs in another pid namespace, released the region, or the map failed).
  /// Mappings are kept for the next operation (see LentMappings).
  const uint8_t* mapLent(int q, const LentBuffer& buffer) {
    return lentMappings_.map(pidOf(q), buffer);
  }
  /// Unmaps the peers' regions their owners have let go of (LentMappings::dropClosed):
  /// before a call maps the regions it reads, never in between.
  void dropClosedLent() { lentMappings_.dropClosed(); }

  /// Whether every rank's process had lendable memory at the last collective's opening (each
  /// rank says so in its fingerprint), so large all_gathers and reduce_scatters try lending.
  /// Every rank reads the same openings, so all agree; a process that never lends costs its
  /// peers nothing.
  bool everyRankLends() const { return everyRankLends_; }
  void setEveryRankLends(bool value) { everyRankLends_ = value; }

  /// Whether every rank can read every other's memory (peer_reads.h): unknown until the
  /// first collective that would read peers probes it in phases of its own, then the same
  /// on every rank.
  enum class PeerReads : uint8_t { kUnknown, kYes, kNo };
  PeerReads peerReads() const { return peerReads_; }
  void setPeerReads(PeerReads value) { peerReads_ = value; }

  /// The fingerprint of the descriptor rank q wrote for the half of phase p.
  uint64_t fingerprint(int q, uint64_t phase) const { return lines_[q].fingerprint[phase & 1]; }
  /// Publishes this rank's descriptor fingerprint for phase p (before post(p)).
  void setFingerprint(uint64_t phase, uint64_t value) {
    lines_[rank_].fingerprint[phase & 1] = value;
  }

  /// Waits until every rank has finished reading the half that phase p will overwrite.
  void beginWrite(uint64_t phase, const WaitSpec& spec) {
    if (allPosted_ + 1 < phase) waitAll(phase - 1, spec);
  }
  /// Publishes this rank's writes for phase p (release), waking sleepers.
  void post(uint64_t phase);
  /// Waits until rank q has posted phase p (acquire).
  void waitPeer(int q, uint64_t phase, const WaitSpec& spec) {
    if (lines_[q].posted.load(std::memory_order_acquire) < phase) slowWait(q, phase, spec);
  }
  /// Waits until every rank has posted phase p.
  void waitAll(uint64_t phase, const WaitSpec& spec);
  /// The last phase this rank posted.
  uint64_t lastPosted() const { return lines_[rank_].posted.load(std::memory_order_relaxed); }

  /// Publishes that this rank started collective `seq` of kind `kind` (for failure reports).
  void noteStarted(uint64_t seq, uint8_t kind) {
    lines_[rank_].startedKind.store(kind, std::memory_order_relaxed);
    lines_[rank_].startedSeq.store(seq, std::memory_order_relaxed);
    kill_.arm(seq, lastPosted());
    stall_.arm(seq, lastPosted());
  }
  /// Fault injection: die (SIGKILL) right after posting the `phase`-th phase of collective
  /// `seq` (see LOOM_FAULT_KILL_AT).
  void setKillPoint(uint64_t seq, uint64_t phase) { kill_ = {seq, phase}; }
  /// Fault injection: sleep for `pause` right after posting the `phase`-th phase of
  /// collective `seq` (see LOOM_FAULT_STALL_AT).
  void setStallPoint(uint64_t seq, uint64_t phase, std::chrono::milliseconds pause) {
    stall_ = {seq, phase};
    stallFor_ = pause;
  }
  /// Publishes that this rank finished collective `seq`.
  void noteFinished(uint64_t seq) {
    lines_[rank_].finishedSeq.store(seq, std::memory_order_relaxed);
  }
  /// Publishes whether this rank runs the completion callbacks of its last finished one.
  void noteInCallbacks(bool inside) {
    lines_[rank_].inCallbacks.store(inside ? 1 : 0, std::memory_order_relaxed);
  }
  /// What this rank last published with noteInCallbacks.
  bool inCallbacks() const {
    return lines_[rank_].inCallbacks.load(std::memory_order_relaxed) != 0;
  }
  /// What rank q last reported: (started seq, its kind, finished seq, in its callbacks).
  struct Progress {
    uint64_t started = 0;
    uint8_t kind = 0;
    uint64_t finished = 0;
    bool inCallbacks = false;
  };
  Progress progressOf(int q) const {
    return {lines_[q].startedSeq.load(std::memory_order_relaxed),
            lines_[q].startedKind.load(std::memory_order_relaxed),
            lines_[q].finishedSeq.load(std::memory_order_relaxed),
            lines_[q].inCallbacks.load(std::memory_order_relaxed) != 0};
  }

  /// Records this rank's pid and marks it alive (once, when it attaches).
  void attachSelf(int pid);
  /// Marks this rank as having left normally: waits that still need it fail at once.
  void depart();
  /// Marks rank q dead if it is alive (not if it departed normally); true if this call made
  /// the change. Wakes nobody: the caller records why first, then wakes. Safe from any
  /// thread.
  bool markDead(int q);
  /// Rank q's liveness.
  RankState stateOf(int q) const {
    return static_cast<RankState>(lines_[q].state.load(std::memory_order_acquire));
  }
  /// Rank q's pid as it recorded it.
  int pidOf(int q) const { return lines_[q].pid; }
  /// Nonzero once communicator rank q, on another host, said goodbye on its control link:
  /// the rail rank here that holds the link sets it, every rank here reads it.
  std::atomic<uint8_t>& goodbye(int q) const {
    return reinterpret_cast<std::atomic<uint8_t>*>(base_ + layout_.goodbyes)[q];
  }

  /// True once any rank has recorded a failure.
  bool failed() const { return header_.failure.state.load(std::memory_order_acquire) != 0; }
  /// Writes the failure record unless another rank claimed it first, then wakes every waiter.
  void recordFailure(ErrorCode code, int culprit, std::string_view message);
  /// The failure record as read back; `complete` is false if its writer died mid-way.
  struct RecordedFailure {
    bool complete = false;
    ErrorCode code = ErrorCode::kInternal;
    int reporter = -1;
    int culprit = -1;
    std::string message;
  };
  RecordedFailure recordedFailure() const;
  /// Wakes every sleeper on this segment (phase counters and doorbells).
  void wakeAll();
  /// Ranks whose counter is below `phase` (for messages).
  std::vector<int> laggards(uint64_t phase) const;

  /// Point-to-point plumbing (see ring_link and core/p2p_engine). Rank q's doorbell wakes
  /// its engine: senders ring it after writing into q's inbound rings, receivers after
  /// freeing space in q's outbound rings.
  /// Rings rank q's doorbell, waking its engine if it sleeps.
  void ringDoorbell(int q);
  /// How often this rank's doorbell has rung (compare before sleeping).
  uint32_t doorbellRings() const { return doorbell(rank_).rings.load(std::memory_order_acquire); }
  /// Sleeps at most `slice` unless this rank's doorbell rang since `seen`.
  void sleepOnDoorbell(uint32_t seen, std::chrono::nanoseconds slice);
  RingControl& ring(int src, int dst) const {
    return reinterpret_cast<RingControl*>(base_ + layout_.ringControls)[src * size_ + dst];
  }
  uint8_t* ringData(int src, int dst) const {
    return base_ + layout_.rings + (static_cast<size_t>(src) * size_ + dst) * layout_.ringBytes;
  }
  size_t ringBytes() const { return layout_.ringBytes; }
  const BackoffPolicy& backoff() const { return backoff_; }

 private:
  void slowWait(int q, uint64_t phase, const WaitSpec& spec);
  Doorbell& doorbell(int q) const {
    return reinterpret_cast<Doorbell*>(base_ + layout_.doorbells)[q];
  }

  std::shared_ptr<Segment> segment_;
  uint8_t* base_;
  const Layout& layout_;
  SegmentHeader& header_;
  RankLine* lines_;
  int rank_;
  std::vector<int> ranks_;  // the communicator rank of each of the segment's ranks
  int size_;
  BackoffPolicy backoff_;
  Failures* failures_ = nullptr;
  uint64_t allPosted_ = 0;  // every rank is known to have posted at least this
  // Fault injection: the `offset`-th phase of collective `seq` (0: none), and once that
  // collective starts, the absolute phase after which to act.
  struct FaultPoint {
    uint64_t seq = 0;
    uint64_t offset = 0;
    uint64_t phase = 0;
    void arm(uint64_t started, uint64_t lastPosted) {
      if (seq == started) phase = lastPosted + offset;
    }
  };
  FaultPoint kill_;   // die there
  FaultPoint stall_;  // sleep there for stallFor_
  std::chrono::milliseconds stallFor_{0};
  LentMappings lentMappings_;
  bool everyRankLends_ = false;
  PeerReads peerReads_ = PeerReads::kUnknown;
};

}  // namespace loom::shm
