// The Python module lockstep_torch._C: what torch.distributed calls to create a group on the
// lockstep backend, and the Python type of that group (a torch ProcessGroup).
//
// torch passes the group's c10d store (a PrefixStore over the TCPStore of env:// or tcp://, or a
// FileStore); it serves here only to announce the lockstep store of groups that no launcher
// hosts, and to learn the master's host, which decides the address that store binds.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/utils/pybind.h>

#include "group_store.h"
#include "lockstep/base/log.h"
#include "lockstep/comm/backends.h"
#include "process_group.h"

namespace py = pybind11;

namespace lockstep::torch_backend {
namespace {

// The host of the TCPStore under torch's prefixes; MASTER_ADDR or loopback for other stores.
std::string master_host(c10::intrusive_ptr<c10d::Store> store, const Settings& settings) {
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get())) store = prefixed->getUnderlyingStore();
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get())) return tcp->getHost();
  return settings.master_addr.empty() ? std::string("127.0.0.1") : settings.master_addr;
}

Announcer announcer_for(const c10::intrusive_ptr<c10d::Store>& store) {
  return Announcer{[store](const std::string& key, const std::string& value) {
                     store->set(key, std::vector<std::uint8_t>(value.begin(), value.end()));
                   },
                   [store](const std::string& key) {
                     const std::vector<std::uint8_t> value = store->get(key);
                     return std::string(value.begin(), value.end());
                   }};
}

c10::intrusive_ptr<ProcessGroupLockstep> create_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                              int rank, int size, double timeout_seconds,
                                                              const std::string& group_id,
                                                              const std::vector<int>& global_ranks) {
  const Settings settings = settings_from_env();
  // Outside lockstep run (whose launcher prefixes every line with the rank) lockstep's log
  // lines name the rank themselves, as the C++ rendezvous arranges.
  if (settings.launcher_host.empty() && log::rank() < 0)
    log::set_rank(global_ranks.empty() ? rank : global_ranks[static_cast<std::size_t>(rank)]);
  GroupPlace place;
  place.rank = rank;
  place.size = size;
  place.group_id = group_id;
  place.master_host = master_host(store, settings);
  place.timeout = comm::Seconds(timeout_seconds);
  auto group_store = std::make_unique<GroupStore>(settings, place, announcer_for(store));
  return c10::make_intrusive<ProcessGroupLockstep>(settings, place, std::move(group_store));
}

}  // namespace

void without_gil(const std::function<void()>& f) {
  if (Py_IsInitialized() && !_Py_IsFinalizing() && PyGILState_Check()) {
    py::gil_scoped_release release;
    f();
  } else {
    f();
  }
}

}  // namespace lockstep::torch_backend

PYBIND11_MODULE(_C, m) {
  using lockstep::torch_backend::ProcessGroupLockstep;
  m.doc() = "lockstep's Communicator as a torch.distributed ProcessGroup (see lockstep_torch)";
  // Registers the Python type of our base (ProcessGroup or Backend: c10d_compat.h).
  py::module::import("torch.distributed");
  py::class_<ProcessGroupLockstep, lockstep::torch_backend::CollectiveBase, c10::intrusive_ptr<ProcessGroupLockstep>>(
      m, "ProcessGroupLockstep",
      "A torch.distributed process group on lockstep's Communicator. Created by "
      "torch.distributed.init_process_group('lockstep') and new_group(); not constructed directly.")
      .def_property_readonly("comm_backend", &ProcessGroupLockstep::comm_backend,
                             "The lockstep backend the group runs on: shm, gloo, hier, mpi or nccl.")
      .def_property_readonly("group_id", &ProcessGroupLockstep::group_id, "torch's name for the group.");
  m.def("create_process_group", &lockstep::torch_backend::create_process_group, py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout"), py::arg("group_id"), py::arg("global_ranks"),
        py::call_guard<py::gil_scoped_release>(),
        "Collective over the group's members: connects to (or hosts) the lockstep store and creates the "
        "communicator. `timeout` in seconds.");
  m.def(
      "quiesce",
      [](double seconds) {
        lockstep::torch_backend::CompletionPool::quiesce_all(
            std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000)));
      },
      py::arg("timeout") = 10.0, py::call_guard<py::gil_scoped_release>(),
      "Waits until no lockstep group is completing a collective (atexit calls it: pool threads must not "
      "touch Python objects once the interpreter finalizes).");
  m.attr("backend_api") = lockstep::torch_backend::kBackendApi;
  m.def("available_backends", &lockstep::comm::available_backends,
        "The lockstep backends built into this extension, e.g. ['shm', 'gloo', 'hier', 'mpi'].");
}
