#pragma once

// loom's process groups as Python exits: `import loom` registers an exit handler that shuts
// every live group down before the interpreter finalises, while loom's threads may still take
// the GIL to end the calls left pending and free their tensors (during finalisation Python
// ends a thread that takes the GIL, and one inside a destructor aborts the process).

#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <string>

#include "loom/communicator.h"
#include "work_loom.h"

namespace loom::torch_plugin {

/// Remembers a process group, weakly, for shutDownLiveGroups().
void noteLiveGroup(const std::shared_ptr<Communicator>& comm,
                   const std::shared_ptr<GroupTies>& ties);

/// loom's exit handler: ProcessGroupLoom::shutdown() of every group still alive, in turn,
/// each given kExitGrace from when its shutdown begins; a group whose calls are still under
/// way then (a peer that never joins them, a call on a daemon thread) has them aborted, and
/// its peers fail at once naming this rank. Releases the GIL while it waits. Returns how many
/// groups it shut down.
size_t shutDownLiveGroups();

/// How long the exit handler waits for calls under way before it aborts them (as long as a
/// shutdown waits for a send to be taken).
inline constexpr std::chrono::seconds kExitGrace{10};

/// What an error `e` of the group of `ties` ends with once the exit handler has shut the
/// group down or aborted its calls, where that is why it failed (kAborted, this rank's own):
/// the reason and what to do. Empty otherwise.
std::string exitNote(const std::exception& e, const GroupTies* ties);

}  // namespace loom::torch_plugin
