// loom._C.Region: the tensor store's shared-memory regions (src/transport/shm/region.h) as a
// Python type whose bytes are a torch tensor; python/loom/tensor_store builds on it.

#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "core/topology.h"
#include "transport/shm/region.h"

namespace py = pybind11;
using loom::shm::Region;

namespace loom::torch_plugin {

void bindTensorStore(py::module_& m) {
  m.def(
      "host_identity",
      [] {
        // loom's host (kernel and network namespace) plus the pid namespace, in which
        // /proc/<pid> names a region's owner.
        const HostInfo& host = localHost();
        return loom::shm::regionIdHex(host.id) + "/pid:" + std::to_string(host.pidNamespace);
      },
      "What processes that can read each other's regions share (loom's host identity and "
      "the pid namespace).");
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
