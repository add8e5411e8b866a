#pragma once

// Proving membership of a job on a network connection without sending the secret: each
// party proves with HMAC-SHA256(job secret, label, its role, both Hellos). Both Hellos carry
// fresh random nonces, so a proof is good for one connection only (no replay), and the
// prover's role is inside, so a proof cannot be reflected back to the party that made it.
// A stranger without the secret learns nothing it could use elsewhere.

#include <cstdint>
#include <span>

#include "transport/net/wire.h"

namespace loom::net {

/// A fresh random nonce from the operating system's generator (throws Error(kSystem) if it
/// cannot give one).
Nonce freshNonce();

/// The proof that party `prover` holds `secret`, on the connection whose two Hellos are
/// `initiator` and `acceptor`.
ProofBytes makeProof(std::span<const uint8_t> secret, Role prover, const Hello& initiator,
                     const Hello& acceptor);

/// True if `proof` is what `prover` must send on that connection; constant time.
bool checkProof(std::span<const uint8_t> secret, Role prover, const Hello& initiator,
                const Hello& acceptor, const ProofBytes& proof);

}  // namespace loom::net
