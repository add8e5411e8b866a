#pragma once

// Peer reads: a rank copies straight out of another process's memory with Linux's
// cross-memory attach (process_vm_readv), so a large collective on ordinary buffers moves
// each byte once instead of staging it through the shared slots (what Open MPI's and Intel
// MPI's shared-memory transports call single copy).
//
// The kernel allows it where the reader may ptrace the owner (same user and, under Yama's
// ptrace_scope 1, a declared tracer; docs/SECURITY.md). loom changes no process's ptrace
// settings: it probes. Each rank publishes a probe (the address of a word of its memory and
// the random value there); a peer that reads the same value back from that address in the
// process its pid names has reached the right process with the right rights (a pid from
// another pid namespace names another process, or none, and fails the check).

#include <cstddef>
#include <cstdint>

namespace loom::shm {

/// The address of a word in this process and the value it holds.
struct ReadProbe {
  uint64_t address = 0;
  uint64_t token = 0;
};

/// This process's probe (its token drawn once, at first use).
ReadProbe ownProbe();

/// True if reading `probe.address` in process `pid` gives back `probe.token`.
bool canReadFrom(int pid, const ReadProbe& probe);

/// Copies `bytes` from address `remote` of process `pid` into `local`. Returns 0, or the
/// errno of the read that failed (a partial read is continued, not reported).
int readFrom(int pid, void* local, const void* remote, size_t bytes);

/// Collectives this process ran that read peers' memory (tests and benchmarks check with it
/// that the path was taken), and the call that counts one.
uint64_t peerReadCollectives();
void countPeerReadCollective();

}  // namespace loom::shm
