// loom._C.Region: the tensor store's shared-memory regions (src/transport/shm/region.h) as a
// Python type whose bytes are a torch tensor; and, where loom has its network transport,
// loom._C.ByteServer and loom._C.fetch_bytes, the byte fetch that reads them across hosts
// (src/transport/net/byte_server.h). python/loom/tensor_store builds on them.

#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include <atomic>
#include <chrono>
#include <cstring>

#include "core/topology.h"
#include "loom/error.h"
#include "transport/shm/region.h"
#ifdef LOOM_HAVE_NET
#include "transport/net/byte_fetcher.h"
#include "transport/net/byte_server.h"
#include "transport/net/region_source.h"
#endif

namespace py = pybind11;
using loom::shm::Region;

namespace loom::torch_plugin {

/// loom._C.StopFlag: set by a cancelled tensor-store read, so that its fetch from another
/// host stops waiting (and gives up its connection) instead of holding on to its deadline.
struct StopFlag {
  std::atomic<bool> set{false};
};

#ifdef LOOM_HAVE_NET
namespace {

// The job's credentials for the byte fetch: 32 bytes from the Store (the traffic's id, then
// the secret) and this process's id among the job's servers and readers.
net::FetchIdentity identityOf(const std::string& credentials, int id) {
  net::FetchIdentity identity;
  if (credentials.size() != identity.comm.size() + identity.secret.size()) {
    throw std::invalid_argument("loom tensor store: credentials must be 32 bytes");
  }
  std::memcpy(identity.comm.data(), credentials.data(), identity.comm.size());
  std::memcpy(identity.secret.data(), credentials.data() + identity.comm.size(),
              identity.secret.size());
  identity.id = id;
  return identity;
}

// A buffer in device memory as a ByteSource: its bytes are staged through pinned host memory
// a slice at a time, on the server's thread, into each reader's session's own staging (the
// region is its header alone, carrying the sequence lock).
class DeviceSource final : public net::RegionLockedSource {
 public:
  DeviceSource(std::shared_ptr<Region> region, at::Tensor data)
      : RegionLockedSource(std::move(region)), data_(std::move(data)) {}
  uint64_t capacity() const override { return static_cast<uint64_t>(data_.numel()); }
  std::span<const uint8_t> bytes(uint64_t offset, uint64_t length,
                                 std::unique_ptr<Staging>& staging) override {
    constexpr int64_t kStage = int64_t{16} << 20;
    if (!staging) {
      // Torch's pinned allocator caches the block, so a session's next reply reuses it.
      auto pinned = std::make_unique<PinnedStaging>();
      pinned->buffer =
          at::empty({kStage}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      staging = std::move(pinned);
    }
    at::Tensor& buffer = static_cast<PinnedStaging&>(*staging).buffer;  // made here, above
    const int64_t n = std::min<int64_t>(kStage, static_cast<int64_t>(length));
    buffer.narrow(0, 0, n).copy_(data_.narrow(0, static_cast<int64_t>(offset), n));
    return {buffer.data_ptr<uint8_t>(), static_cast<size_t>(n)};
  }

 private:
  struct PinnedStaging final : Staging {
    at::Tensor buffer;
  };
  at::Tensor data_;
};

const char* stateName(net::SourceState state) {
  switch (state) {
    case net::SourceState::kWhole: return "whole";
    case net::SourceState::kWriting: return "writing";
    case net::SourceState::kPending: return "pending";
    case net::SourceState::kReplaced: return "replaced";
    case net::SourceState::kUnknown: return "unknown";
  }
  return "unknown";
}

void bindByteFetch(py::module_& m) {
  py::class_<net::ByteServer, std::unique_ptr<net::ByteServer, py::nodelete>>(
      m, "ByteServer", "This process's server of its tensor-store buffers to other hosts.")
      .def_static(
          "start",
          [](const py::bytes& credentials, int id) {
            const net::FetchIdentity identity = identityOf(credentials, id);
            py::gil_scoped_release unlocked;
            return &net::ByteServer::instance(identity);
          },
          py::arg("credentials"), py::arg("id"), py::return_value_policy::reference,
          "Starts (once per process) serving over loom's network transport; raises if the "
          "fabric cannot open here.")
      .def_property_readonly("address", &net::ByteServer::address)
      .def(
          "publish",
          [](net::ByteServer& server, const std::shared_ptr<Region>& region) {
            server.publish(region->id(), std::make_shared<net::RegionSource>(region));
          },
          py::arg("region"), "Serves the region's bytes (under its sequence lock).")
      .def(
          "publish_device",
          [](net::ByteServer& server, const std::shared_ptr<Region>& region,
             const at::Tensor& data) {
            if (data.scalar_type() != at::kByte || data.dim() != 1 || !data.is_contiguous()) {
              throw std::invalid_argument("publish_device: data must be a contiguous uint8 vector");
            }
            server.publish(region->id(), std::make_shared<DeviceSource>(region, data));
          },
          py::arg("region"), py::arg("data"),
          "Serves device memory `data` under region's sequence lock, staged through the host.")
      .def(
          "withdraw",
          [](net::ByteServer& server, const std::string& id) {
            server.withdraw(loom::shm::regionIdFromHex(id));
          },
          py::arg("region_id"), "Stops serving a region.")
      .def_property_readonly("sessions", &net::ByteServer::sessions);
  m.def(
      "fetch_bytes",
      [](const py::bytes& credentials, int id, const std::string& address, int server,
         const std::string& source, uint64_t generation,
         const std::vector<std::pair<uint64_t, uint64_t>>& ranges, const at::Tensor& dst,
         double timeout, const std::shared_ptr<StopFlag>& stop) {
        if (dst.device().type() != c10::kCPU || dst.scalar_type() != at::kByte ||
            !dst.is_contiguous()) {
          throw std::invalid_argument("fetch_bytes: dst must be a contiguous CPU uint8 tensor");
        }
        const net::FetchIdentity identity = identityOf(credentials, id);
        std::vector<net::ByteRange> wanted;
        wanted.reserve(ranges.size());
        for (const auto& [offset, length] : ranges) wanted.push_back({offset, length});
        const auto sourceId = loom::shm::regionIdFromHex(source);
        auto* out = static_cast<uint8_t*>(dst.data_ptr());
        const auto bytes = static_cast<uint64_t>(dst.numel());
        const auto deadline = std::chrono::steady_clock::now() +
                              std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                  std::chrono::duration<double>(timeout));
        net::ByteFetcher::Outcome outcome;
        std::string failure;  // a timeout or a lost server is the caller's to word
        const char* state = nullptr;
        {
          py::gil_scoped_release unlocked;
          try {
            outcome = net::ByteFetcher::instance(identity).fetch(
                address, server, sourceId, generation, wanted, out, bytes, deadline,
                stop ? &stop->set : nullptr);
            state = stateName(outcome.state);
          } catch (const Error& e) {
            if (e.code() == ErrorCode::kAborted && stop && stop->set) {
              state = "stopped";
            } else if (e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kPeerFailure) {
              state = e.code() == ErrorCode::kTimeout ? "timeout" : "failed";
            } else {
              throw;
            }
            failure = e.detail();
          }
        }
        return py::make_tuple(state, outcome.generation, outcome.progress, outcome.unchanged,
                              failure);
      },
      py::arg("credentials"), py::arg("id"), py::arg("address"), py::arg("server"),
      py::arg("source"), py::arg("generation"), py::arg("ranges"), py::arg("dst"),
      py::arg("timeout"), py::arg("stop") = nullptr,
      "Copies `ranges` of region `source` of the server at `address` into `dst` at their "
      "offsets if it holds `generation` whole; returns (state, generation now, progress, "
      "unchanged, why): state 'whole', 'writing', 'pending', 'replaced' or 'unknown', "
      "'timeout' / 'failed' (the server unreachable or gone) with `why` saying more, or "
      "'stopped' once `stop` (a StopFlag) was set while it waited.");
}

}  // namespace
#endif

void bindTensorStore(py::module_& m) {
  py::class_<StopFlag, std::shared_ptr<StopFlag>>(
      m, "StopFlag", "Set to stop a fetch_bytes waiting on the network (a cancelled read).")
      .def(py::init<>())
      .def(
          "set", [](StopFlag& f) { f.set = true; }, "Stops the fetches given this flag.")
      .def("is_set", [](const StopFlag& f) { return f.set.load(); });
#ifdef LOOM_HAVE_NET
  m.attr("has_network") = true;
  bindByteFetch(m);
#else
  m.attr("has_network") = false;
#endif
  m.def(
      "host_identity",
      [] {
        // loom's host (kernel and network namespace) plus the pid namespace, in which
        // /proc/<pid> names a region's owner.
        const HostInfo host = localHost();
        return loom::shm::regionIdHex(host.id) + "/pid:" + std::to_string(host.pidNamespace);
      },
      "What processes that can read each other's regions share (loom's host identity and "
      "the pid namespace).");
  m.def(
      "tensors_signature",
      [](const std::vector<at::Tensor>& tensors) {
        // Per tensor: where its data starts (its TensorImpl for one without storage, such as
        // a DTensor's wrapper), device, dtype, then its sizes and strides.
        std::vector<int64_t> words;
        words.reserve(tensors.size() * 8);
        for (const at::Tensor& t : tensors) {
          words.push_back(t.has_storage() ? reinterpret_cast<int64_t>(t.data_ptr())
                                          : reinterpret_cast<int64_t>(t.unsafeGetTensorImpl()));
          words.push_back(static_cast<int64_t>(t.device().type()) << 16 | t.device().index());
          words.push_back(static_cast<int64_t>(t.scalar_type()) << 16 | t.dim());
          for (const int64_t size : t.sizes()) words.push_back(size);
          for (const int64_t stride : t.strides()) words.push_back(stride);
        }
        return py::bytes(reinterpret_cast<const char*>(words.data()),
                         words.size() * sizeof(int64_t));
      },
      py::arg("tensors"),
      "Bytes that change when any tensor's address, device, dtype, sizes or strides do (what "
      "a lend plan depends on).");
  py::class_<Region, std::shared_ptr<Region>>(
      m, "Region", "A sealed memfd whose bytes peers of this host read in place.")
      .def_static(
          "create",
          [](size_t capacity) { return std::shared_ptr<Region>(Region::create(capacity)); },
          py::arg("capacity"), py::call_guard<py::gil_scoped_release>(),
          "A new region of `capacity` data bytes, owned (writable) by this process.")
      .def_static(
          "open",
          [](int pid, int fd, const std::string& id, size_t capacity) {
            return std::shared_ptr<Region>(
                Region::open(pid, fd, loom::shm::regionIdFromHex(id), capacity));
          },
          py::arg("pid"), py::arg("fd"), py::arg("id"), py::arg("capacity"),
          py::call_guard<py::gil_scoped_release>(),
          "Maps region `id` (descriptor `fd` of process `pid`) read-only.")
      .def_property_readonly("fd", &Region::fd)
      .def_property_readonly("id", [](const Region& r) { return loom::shm::regionIdHex(r.id()); })
      .def_property_readonly("capacity", &Region::capacity)
      .def_property_readonly("writable", &Region::writable)
      .def("begin_write", &Region::beginWrite, "Owner: the bytes are being rewritten.")
      .def("set_progress", &Region::setProgress, py::arg("bytes"),
           "Owner, while writing: the first `bytes` bytes hold the new data.")
      .def("progress", &Region::progress, "Bytes the write in progress has finished.")
      .def("end_write", &Region::endWrite, "Owner: the bytes are whole; returns the generation.")
      .def("abandon_write", &Region::abandonWrite,
           "Owner, after a failed write: skips the generation it would have ended at.")
      .def("generation", &Region::generation, "The generation now (even: whole).")
      .def("unchanged_since", &Region::unchangedSince, py::arg("generation"),
           "Reader, after copying: True if no write began since `generation`.")
      .def(
          "tensor",
          [](const std::shared_ptr<Region>& r) {
            // The tensor keeps the mapping alive: its deleter holds the region.
            return torch::from_blob(
                r->data(), {static_cast<int64_t>(r->capacity())}, [r](void*) {},
                torch::TensorOptions().dtype(torch::kUInt8));
          },
          "The data bytes as a uint8 tensor (read-only memory on a reader: never write).");
}

}  // namespace loom::torch_plugin
