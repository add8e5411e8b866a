// HMAC-SHA256 proofs through OpenSSL's libcrypto.

#include "transport/net/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <string_view>
#include <vector>

#include "loom/error.h"

namespace loom::net {

namespace {

constexpr std::string_view kLabel = "loom network proof v1";

}  // namespace

Nonce freshNonce() {
  Nonce nonce{};
  if (RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1) {
    throw Error(ErrorCode::kSystem, "connect", -1,
                "the system's random generator gave no bytes for a connection nonce");
  }
  return nonce;
}

ProofBytes makeProof(std::span<const uint8_t> secret, Role prover, const Hello& initiator,
                     const Hello& acceptor) {
  std::vector<uint8_t> message(kLabel.begin(), kLabel.end());
  message.push_back(static_cast<uint8_t>(prover));
  const auto a = encodeHello(initiator);
  const auto b = encodeHello(acceptor);
  message.insert(message.end(), a.begin(), a.end());
  message.insert(message.end(), b.begin(), b.end());
  ProofBytes proof{};
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(),
           message.size(), proof.data(), &length) == nullptr ||
      length != proof.size()) {
    throw Error(ErrorCode::kInternal, "connect", -1, "HMAC-SHA256 failed");
  }
  return proof;
}

bool checkProof(std::span<const uint8_t> secret, Role prover, const Hello& initiator,
                const Hello& acceptor, const ProofBytes& proof) {
  const ProofBytes expected = makeProof(secret, prover, initiator, acceptor);
  return CRYPTO_memcmp(expected.data(), proof.data(), proof.size()) == 0;
}

}  // namespace loom::net
