// The LOOM_CUDA_* settings every rank of a host must share: see cuda_settings.h.

#include "core/cuda_settings.h"

#include <array>
#include <climits>
#include <string>
#include <type_traits>
#include <vector>

namespace loom::detail {

namespace {

// One shared setting: its key in the note, its environment variable, and its value as text.
struct Shared {
  const char* key;
  const char* variable;
  std::string (*value)(const CudaTuning&);
};

template <class T>
std::string text(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "1" : "0";
  } else {
    return std::to_string(v);
  }
}

template <class T>
std::string text(const std::optional<T>& v) {
  return v ? text(*v) : "unset";
}

// A CudaTuning field as text.
template <auto Field>
std::string valueOf(const CudaTuning& t) {
  return text(t.*Field);
}

// Every CudaTuning field but fusedTrace (a debug record each rank may keep or not). Values
// are decimal and keys one letter, so that all of them at their widest fit in a note.
const std::array<Shared, 10>& sharedSettings() {
  static const std::array<Shared, 10> all{{
      {"c", "LOOM_CUDA_CHUNK_BYTES", valueOf<&CudaTuning::chunkBytes>},
      {"o", "LOOM_CUDA_ONE_SHOT_BYTES", valueOf<&CudaTuning::oneShotBytes>},
      {"p", "LOOM_CUDA_PIPELINE", valueOf<&CudaTuning::pipelined>},
      {"f", "LOOM_CUDA_FUSED", valueOf<&CudaTuning::fused>},
      {"s", "LOOM_CUDA_FUSED_SHARED_GPU_BYTES", valueOf<&CudaTuning::fusedSharedGpuBytes>},
      {"b", "LOOM_CUDA_FUSED_BLOCKS", valueOf<&CudaTuning::fusedBlocks>},
      {"t", "LOOM_CUDA_FUSED_TWO_SHOT_BYTES", valueOf<&CudaTuning::fusedTwoShotBytes>},
      {"u", "LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES",
       valueOf<&CudaTuning::fusedTwoShotBroadcastBytes>},
      {"v", "LOOM_CUDA_FUSED_CHAIN_BROADCAST_BYTES",
       valueOf<&CudaTuning::fusedChainBroadcastBytes>},
      {"r", "LOOM_CUDA_FUSED_RING_ALL_REDUCE_BYTES", valueOf<&CudaTuning::fusedRingAllReduceBytes>},
  }};
  return all;
}

constexpr const char* kMpsClient = "mps";

// The note's words after the MPS word, in sharedSettings() order ("key=value" each).
std::vector<std::string> settingWords(const std::string& note) {
  // Split by hand: no string streams in what the torch extension links
  // (tests/lint/check_messages.py).
  std::vector<std::string> words;
  size_t at = note.find_first_not_of(' ');
  at = note.find(' ', at);  // past the MPS word
  while (at != std::string::npos) {
    const size_t begin = note.find_first_not_of(' ', at);
    if (begin == std::string::npos) break;
    at = note.find(' ', begin);
    words.push_back(note.substr(begin, at == std::string::npos ? std::string::npos : at - begin));
  }
  return words;
}

}  // namespace

std::string cudaSettingsNote(const CudaTuning& tuning, bool mpsClient, int residentFusedBlocks) {
  // The first word is the rank's own facts ("mps:264"), the others the shared settings.
  std::string note = std::string(mpsClient ? kMpsClient : "-") + ":" + text(residentFusedBlocks);
  for (const Shared& s : sharedSettings()) note += std::string(" ") + s.key + "=" + s.value(tuning);
  return note;
}

bool notesMpsClient(const std::string& note) {
  return note.compare(0, note.find_first_of(": "), kMpsClient) == 0;
}

int notesResidentFusedBlocks(const std::string& note) {
  const size_t colon = note.find(':');
  if (colon == std::string::npos || colon > note.find(' ')) return 0;
  int blocks = 0;
  for (size_t i = colon + 1; i < note.size() && note[i] >= '0' && note[i] <= '9'; ++i) {
    const int digit = note[i] - '0';
    if (blocks > (INT_MAX - digit) / 10) return 0;  // no GPU keeps that many: not a count
    blocks = blocks * 10 + digit;
  }
  return blocks;
}

std::optional<std::string> cudaSettingsDisagree(std::span<const std::string> notes) {
  if (notes.empty()) return std::nullopt;
  const std::vector<std::string> first = settingWords(notes[0]);
  for (size_t q = 1; q < notes.size(); ++q) {
    const std::vector<std::string> theirs = settingWords(notes[q]);
    for (size_t i = 0; i < sharedSettings().size(); ++i) {
      const std::string a = i < first.size() ? first[i] : "?";
      const std::string b = i < theirs.size() ? theirs[i] : "?";
      if (a == b) continue;
      auto valueOf = [](const std::string& word) {
        const size_t eq = word.find('=');
        return eq == std::string::npos ? word : word.substr(eq + 1);
      };
      return "rank " + std::to_string(q) + "'s " + sharedSettings()[i].variable + " is " +
             valueOf(b) + " but rank 0's is " + valueOf(a) +
             ": the CUDA settings lay out every rank's CUDA workspace and choose the "
             "kernels all ranks run together, so set them alike on every rank of a host (or "
             "leave them unset)";
    }
  }
  return std::nullopt;
}

}  // namespace loom::detail
