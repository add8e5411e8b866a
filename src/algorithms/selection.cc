// Parsing LOOM_ALGO and picking algorithms by size.

#include "algorithms/selection.h"

#include "loom/error.h"
#include "util/env.h"

namespace loom {

std::string_view algorithmName(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kOneShot: return "one_shot";
    case Algorithm::kTwoShot: return "two_shot";
    case Algorithm::kLent: return "lent";
    case Algorithm::kPeerRead: return "peer_read";
  }
  return "unknown";
}

namespace {

std::vector<std::string> splitOn(const std::string& s, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t end = s.find(separator, start);
    parts.push_back(s.substr(start, end - start));
    if (end == std::string::npos) return parts;
    start = end + 1;
  }
}

[[noreturn]] void bad(const std::string& spec, const std::string& why) {
  throw Error(ErrorCode::kInvalidArgument, "config", -1,
              "LOOM_ALGO=\"" + spec + "\": " + why +
                  ". Expected op:algorithm:max_bytes[,algorithm:max_bytes...][;op:...] with op "
                  "all_reduce or reduce, algorithm one_shot or two_shot, max_bytes like 64K or "
                  "inf; the last entry of each op must be inf");
}

}  // namespace

Algorithm SelectionTable::pick(const std::vector<Entry>& entries, size_t bytes) {
  for (const Entry& e : entries) {
    if (bytes <= e.maxBytes) return e.algorithm;
  }
  return entries.back().algorithm;
}

SelectionTable::SelectionTable(int localRanks) {
  // Two ranks: the 32-core host's 4 KiB. Three or four: one-shot up to 1 KiB (a tie there,
  // two-shot 0.74-0.90x from 2 KiB). More: two-shot already 0.69-0.80x at 512 B at 8 and 16
  // ranks; 256 B keeps one-shot only below what was measured.
  const uint64_t oneShot = localRanks <= 2 ? 4 << 10 : localRanks <= 4 ? 1 << 10 : 256;
  allReduce_ = {{Algorithm::kOneShot, oneShot}, {Algorithm::kTwoShot, UINT64_MAX}};
}

SelectionTable SelectionTable::parse(const std::string& spec, SelectionTable defaults) {
  SelectionTable table = std::move(defaults);
  for (const std::string& clause : splitOn(spec, ';')) {
    if (clause.empty()) continue;
    const size_t colon = clause.find(':');
    if (colon == std::string::npos) bad(spec, "'" + clause + "' has no ':'");
    const std::string op = clause.substr(0, colon);
    std::vector<Entry>* target = op == "all_reduce" ? &table.allReduce_
                                 : op == "reduce"   ? &table.reduce_
                                                    : nullptr;
    if (target == nullptr) bad(spec, "unknown operation '" + op + "'");
    std::vector<Entry> entries;
    for (const std::string& item : splitOn(clause.substr(colon + 1), ',')) {
      const size_t sep = item.find(':');
      if (sep == std::string::npos) bad(spec, "'" + item + "' is not algorithm:max_bytes");
      const std::string name = item.substr(0, sep);
      const std::string bound = item.substr(sep + 1);
      Entry e{};
      if (name == "one_shot")
        e.algorithm = Algorithm::kOneShot;
      else if (name == "two_shot")
        e.algorithm = Algorithm::kTwoShot;
      else
        bad(spec, "unknown algorithm '" + name + "'");
      if (bound == "inf") {
        e.maxBytes = UINT64_MAX;
      } else if (auto v = env::parseBytes(bound)) {
        e.maxBytes = *v;
      } else {
        bad(spec, "'" + bound + "' is not a size");
      }
      if (!entries.empty() && e.maxBytes <= entries.back().maxBytes) {
        bad(spec, "bounds must increase");
      }
      entries.push_back(e);
    }
    if (entries.empty() || entries.back().maxBytes != UINT64_MAX) {
      bad(spec, "the entries for " + op + " must end with a bound of inf");
    }
    *target = std::move(entries);
  }
  return table;
}

SelectionTable SelectionTable::parse(const std::string& spec) {
  return parse(spec, SelectionTable());
}

SelectionTable SelectionTable::fromEnvironment(int localRanks) {
  const auto spec = env::text("LOOM_ALGO");
  const SelectionTable defaults(localRanks);
  return spec ? parse(*spec, defaults) : defaults;
}

}  // namespace loom
