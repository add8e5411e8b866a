#pragma once

/// loom: collective communication for the processes of one host, through shared memory.
/// Include this header for the whole public API.

#include "loom/communicator.h"     // IWYU pragma: export
#include "loom/error.h"            // IWYU pragma: export
#include "loom/flight_recorder.h"  // IWYU pragma: export
#include "loom/request.h"          // IWYU pragma: export
#include "loom/store.h"            // IWYU pragma: export
#include "loom/tcp_store.h"        // IWYU pragma: export
#include "loom/types.h"            // IWYU pragma: export
