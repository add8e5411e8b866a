// The Python module loom._C: the ProcessGroupLoom type (a subclass of torch's Backend, so
// torch.distributed can hold it) and a few facts about the build.

#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "exit_shutdown.h"
#include "finished_work.h"
#include "kernels/reduce.h"
#include "loom/flight_recorder.h"
#include "process_group_loom.h"
#include "transport/shm/lending.h"
#include "transport/shm/peer_reads.h"
#include "work_loom.h"

namespace py = pybind11;
using loom::torch_plugin::ProcessGroupLoom;

namespace loom::torch_plugin {
void bindTensorStore(py::module_& m);  // tensor_store_bindings.cc
void bindByteCopy(py::module_& m);     // byte_copy.cc
void bindEagerOps(py::module_& m);     // direct_ops.cc
}  // namespace loom::torch_plugin

PYBIND11_MODULE(_C, m) {
  m.doc() = "loom's native c10d backend";
  // torch registers the Backend and Store types with pybind; importing its module first makes
  // them known here.
  py::module_::import("torch._C._distributed_c10d");
  loom::torch_plugin::bindTensorStore(m);
  loom::torch_plugin::bindByteCopy(m);
  loom::torch_plugin::bindEagerOps(m);

  // Known to pybind, a loom Work returned by a c10d call is cast to Python by its own type
  // rather than after a failed lookup of it and a fall back to the base (every call pays it).
  py::class_<loom::torch_plugin::WorkLoom, c10d::Work,
             c10::intrusive_ptr<loom::torch_plugin::WorkLoom>>(m, "WorkLoom");
  py::class_<loom::torch_plugin::FinishedWork, c10d::Work,
             c10::intrusive_ptr<loom::torch_plugin::FinishedWork>>(m, "FinishedWork");

  py::class_<ProcessGroupLoom, c10d::Backend, c10::intrusive_ptr<ProcessGroupLoom>> group(
      m, "ProcessGroupLoom");
  // The backend's options as their own type, which copies: torch's split_group (and so any
  // device mesh of two or more dimensions on a group bound to a GPU) deep-copies the parent's
  // options, which torch's base type refuses ("cannot pickle"), as NCCL's type does not.
  using Options = ProcessGroupLoom::Options;
  py::class_<Options, c10d::Backend::Options, c10::intrusive_ptr<Options>>(
      group, "Options", "loom's backend options: torch's (timeout, group name, ...), copyable.")
      .def(py::init([](std::chrono::milliseconds timeout) {
             return c10::make_intrusive<Options>(timeout);
           }),
           py::arg("timeout") = kBackendDefaultTimeout)
      .def("__copy__", [](const Options& self) { return c10::make_intrusive<Options>(self); })
      .def(
          "__deepcopy__",
          [](const Options& self, const py::dict&) { return c10::make_intrusive<Options>(self); },
          py::arg("memo"));
  group
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, const std::string& groupName,
                       const std::vector<uint64_t>& globalRanks, bool torchFactory) {
             auto options = c10::make_intrusive<ProcessGroupLoom::Options>(timeout);
             options->group_name = groupName;
             options->global_ranks_in_group = globalRanks;
             return c10::make_intrusive<ProcessGroupLoom>(
                 store, rank, size, options,
                 torchFactory ? ProcessGroupLoom::Maker::kTorch : ProcessGroupLoom::Maker::kUser);
           }),
           py::arg("store").none(false), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("group_name") = "", py::arg("global_ranks") = std::vector<uint64_t>{},
           py::kw_only(), py::arg("_torch_factory") = false,
           py::call_guard<py::gil_scoped_release>(),
           "Joins a loom communicator of `size` ranks through a c10d store: a group of its own,\n"
           "apart from torch's world (`_torch_factory` is for loom's factory that torch calls).")
      .def_property_readonly("options", &ProcessGroupLoom::getBackendOptions,
                             "The backend options (split_group copies them for children).")
      .def_property_readonly("last_sequence",
                             [](ProcessGroupLoom& pg) { return pg.communicator().lastSequence(); })
      .def(
          "progress_report",
          [](ProcessGroupLoom& pg) { return pg.communicator().progressReport(); },
          "What every rank of this group last started and finished (read from shared memory).")
      // torch's new_group on a group bound to a device (init_process_group(device_id=...))
      // calls this on the ranks left out of the new group, for NCCL's split, in which every
      // rank must take part. loom's split needs only the members (Communicator::subset).
      .def(
          "perform_nocolor_split", [](ProcessGroupLoom&, const at::Device&) {},
          "Nothing to do: ranks outside a new group take no part in loom's split.");

  m.def("_shut_down_live_groups", &loom::torch_plugin::shutDownLiveGroups,
        "Shuts down every loom group of this process still alive (loom's exit handler).");
  m.def(
      "flight_record",
      [] {
        py::list out;
        for (const loom::FlightRecord& r : loom::flightRecord()) {
          py::dict d;
          d["id"] = r.id;
          d["communicator"] = r.communicator;
          d["rank"] = r.rank;
          d["size"] = r.size;
          d["sequence"] = r.sequence;
          d["operation"] = r.operation;
          d["arguments"] = r.arguments;
          d["state"] = loom::flightStateName(r.state);
          d["issued"] = std::chrono::duration<double>(r.issued.time_since_epoch()).count();
          d["queued_ms"] = r.queuedMs;
          d["ran_ms"] = r.ranMs;
          d["error"] = r.error;
          out.append(std::move(d));
        }
        return out;
      },
      "This process's recent loom operations, oldest first, as dicts.");
  m.def(
      "format_flight_record", [] { return loom::formatFlightRecord(loom::flightRecord()); },
      "This process's recent loom operations as a table.");

  m.def(
      "lent_collectives", [] { return loom::shm::lentCollectives(); },
      "How many collectives this process ran reading lent inputs in place (allocate_tensor).");
  m.def(
      "peer_read_collectives", [] { return loom::shm::peerReadCollectives(); },
      "How many collectives this process ran copying out of its peers' memory (all_to_all "
      "from LOOM_PEER_READ_BYTES).");
  m.def(
      "kernel_isa", [] { return std::string(loom::kernels::isaName(loom::kernels::activeIsa())); },
      "The instruction set loom's reduction kernels use on this CPU.");
  m.attr("__torch_version__") = TORCH_VERSION;  // the torch this build was compiled against
}
