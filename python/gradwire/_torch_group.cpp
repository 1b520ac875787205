// The torch backend's hot path in C++ (built at first use by gradwire/_torch_native.py).
//
// A call torch waits for at once (async_op=False) on contiguous CPU tensors goes from
// torch's C++ ProcessGroup entry point straight to gradwire's blocking C call, without the
// GIL: no trip through Python, ctypes or a Python work object (3.7-5.3 us per call, measured
// in one process on a 1-rank group). Every other call (async, CUDA, lists, non-contiguous
// tensors, an input overlapping the output other than in place, ops or dtypes gradwire
// lacks, sends and receives not yet started) goes to the Python group's method of the same
// name with a `_py_` prefix, exactly as before; so do its errors.
//
// FastGroup is torch's own trampoline (PyProcessGroup) with the hot calls overridden: the
// Python class ProcessGroupGradwire derives from it and keeps every other method. Its entry
// points (gradwire/torch.py, _gate) send async and CUDA calls to the Python methods before
// they reach C++, so those return the group's own work; what comes here otherwise is a
// blocking CPU call from Python, or any call torch's C++ makes itself (DDP's reducer).

#include <torch/extension.h>
// torch 2.12 moved the trampoline's header into py/.
#if __has_include(<torch/csrc/distributed/c10d/py/PyProcessGroup.hpp>)
#include <torch/csrc/distributed/c10d/py/PyProcessGroup.hpp>
#else
#include <torch/csrc/distributed/c10d/PyProcessGroup.hpp>
#endif

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <optional>

#include "gradwire.h"

#if !defined(TORCH_VERSION_MAJOR) || !defined(TORCH_VERSION_MINOR)
#error "torch's version macros are missing"
#endif

// torch before 2.12 names the tensor-form allgather and reduce-scatter by their older names
// (torch 2.12 on routes those to these).
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12
#define GRADWIRE_ALLGATHER_SINGLE _allgather_base
#define GRADWIRE_REDUCE_SCATTER_SINGLE _reduce_scatter_base
#else
#define GRADWIRE_ALLGATHER_SINGLE all_gather_single
#define GRADWIRE_REDUCE_SCATTER_SINGLE reduce_scatter_single
#endif

namespace {

using c10d::Work;

// The C calls, as the Python binding's ctypes library holds them (one library per process).
struct Calls {
  decltype(&gradwire_allreduce) allreduce = nullptr;
  decltype(&gradwire_broadcast) broadcast = nullptr;
  decltype(&gradwire_allgather) allgather = nullptr;
  decltype(&gradwire_reduce_scatter) reduce_scatter = nullptr;
};

// A blocking call's work: finished when made (torch waits on it at once).
class DoneWork : public Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> result) : result_(std::move(result)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::vector<at::Tensor> result_;
};

std::optional<gradwire_dtype_t> dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return GRADWIRE_FLOAT32;
    case at::kDouble: return GRADWIRE_FLOAT64;
    case at::kHalf: return GRADWIRE_FLOAT16;
    case at::kBFloat16: return GRADWIRE_BFLOAT16;
    case at::kChar: return GRADWIRE_INT8;
    case at::kByte: return GRADWIRE_UINT8;
    case at::kInt: return GRADWIRE_INT32;
    case at::kLong: return GRADWIRE_INT64;
    case at::kBool: return GRADWIRE_BOOL;
    default: return std::nullopt;
  }
}

std::optional<gradwire_op_t> op_of(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return GRADWIRE_SUM;
    case c10d::ReduceOp::AVG: return GRADWIRE_AVG;
    case c10d::ReduceOp::MIN: return GRADWIRE_MIN;
    case c10d::ReduceOp::MAX: return GRADWIRE_MAX;
    case c10d::ReduceOp::PRODUCT: return GRADWIRE_PRODUCT;
    default: return std::nullopt;  // refused by the Python method, on every rank alike
  }
}

// What gradwire takes as it is: a dense contiguous CPU tensor of one of its dtypes.
bool plain(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && t.is_contiguous() &&
         dtype_of(t).has_value();
}

// Whether `part` overlaps `whole` other than as its block `rank` (the in-place layout).
bool stray_overlap(const at::Tensor& whole, const at::Tensor& part, int rank) {
  auto w = reinterpret_cast<uintptr_t>(whole.data_ptr());
  auto p = reinterpret_cast<uintptr_t>(part.data_ptr());
  size_t wn = whole.nbytes(), pn = part.nbytes();
  bool overlap = wn > 0 && pn > 0 && w < p + pn && p < w + wn;
  return overlap && p != w + static_cast<uintptr_t>(rank) * pn;
}

class FastGroup : public c10d::PyProcessGroup {
 public:
  using PyProcessGroup::PyProcessGroup;

  // Joins the gradwire communicator `comm` (a live handle the Python group owns) and the C
  // calls at these addresses (the Python binding's library: one per process).
  void attach(uintptr_t comm, const std::map<std::string, uintptr_t>& calls) {
    auto at = [&](const char* name) {
      auto it = calls.find(name);
      TORCH_CHECK(it != calls.end() && it->second != 0, "gradwire: no address for ", name);
      return reinterpret_cast<void*>(it->second);
    };
    calls_.allreduce = reinterpret_cast<decltype(calls_.allreduce)>(at("gradwire_allreduce"));
    calls_.broadcast = reinterpret_cast<decltype(calls_.broadcast)>(at("gradwire_broadcast"));
    calls_.allgather = reinterpret_cast<decltype(calls_.allgather)>(at("gradwire_allgather"));
    calls_.reduce_scatter = reinterpret_cast<decltype(calls_.reduce_scatter)>(at("gradwire_reduce_scatter"));
    comm_.store(reinterpret_cast<gradwire_comm_t*>(comm));
  }

  // Before the communicator is finalized: every later call takes the Python path.
  void detach() { comm_.store(nullptr); }

  // Sends or receives are queued and not started: collectives take the Python path, which
  // starts them first (the engine runs them in program order).
  void set_p2p_pending(bool pending) { p2p_pending_.store(pending); }

  // How many calls took the fast path (the tests check which do).
  uint64_t fast_calls() const { return fast_calls_.load(std::memory_order_relaxed); }

  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override {
    auto comm = fast(opts.asyncOp);
    auto op = op_of(opts.reduceOp);
    if (comm != nullptr && op && tensors.size() == 1 && plain(tensors[0]) && !opts.sparseIndices) {
      auto& t = tensors[0];
      return done(calls_.allreduce(comm, t.data_ptr(), t.data_ptr(), t.numel(), *dtype_of(t), *op), tensors);
    }
    return python("_py_allreduce", tensors, opts);
  }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override {
    auto comm = fast(opts.asyncOp);
    if (comm != nullptr && tensors.size() == 1 && plain(tensors[0]) && opts.rootTensor == 0 && opts.rootRank >= 0 &&
        opts.rootRank < getSize()) {
      auto& t = tensors[0];
      return done(calls_.broadcast(comm, t.data_ptr(), t.numel(), *dtype_of(t), static_cast<int>(opts.rootRank)), tensors);
    }
    return python("_py_broadcast", tensors, opts);
  }

  c10::intrusive_ptr<Work> GRADWIRE_ALLGATHER_SINGLE(at::Tensor& output, at::Tensor& input,
                                             const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override {
    auto comm = fast(opts.asyncOp);
    if (comm != nullptr && plain(output) && plain(input) && output.scalar_type() == input.scalar_type() &&
        output.numel() == input.numel() * getSize() && !stray_overlap(output, input, getRank())) {
      return done(calls_.allgather(comm, input.data_ptr(), output.data_ptr(), input.numel(), *dtype_of(input)), {output});
    }
    return python("_py_all_gather_single", output, input, opts);
  }

  c10::intrusive_ptr<Work> GRADWIRE_REDUCE_SCATTER_SINGLE(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override {
    auto comm = fast(opts.asyncOp);
    auto op = op_of(opts.reduceOp);
    if (comm != nullptr && op && plain(output) && plain(input) && output.scalar_type() == input.scalar_type() &&
        input.numel() == output.numel() * getSize() && !stray_overlap(input, output, getRank())) {
      return done(calls_.reduce_scatter(comm, input.data_ptr(), output.data_ptr(), output.numel(), *dtype_of(output), *op), {output});
    }
    return python("_py_reduce_scatter_single", output, input, opts);
  }

  // Rank and size as the group was made with (the trampoline would ask Python for them).
  int getRank() const override { return ProcessGroup::getRank(); }
  int getSize() const override { return ProcessGroup::getSize(); }

 private:
  // The communicator, if this call may take the fast path (blocking, nothing queued).
  gradwire_comm_t* fast(bool async_op) const {
    if (async_op || p2p_pending_.load(std::memory_order_relaxed)) {
      return nullptr;
    }
    return comm_.load(std::memory_order_acquire);
  }

  // The finished work of a fast call that returned `code`; a failure is raised as the Python
  // binding raises it (gradwire._check: GradwireError of the code's kind, with the calling
  // thread's error text, so on this thread).
  c10::intrusive_ptr<Work> done(int code, std::vector<at::Tensor> result) {
    if (code != 0) {
      py::gil_scoped_acquire gil;
      py::module_::import("gradwire").attr("_check")(code);
      throw std::runtime_error("gradwire: call failed with code " + std::to_string(code));
    }
    fast_calls_.fetch_add(1, std::memory_order_relaxed);
    return c10::make_intrusive<DoneWork>(std::move(result));
  }

  // The Python group's method `name` (as torch's trampoline calls an override).
  template <typename... Args>
  c10::intrusive_ptr<Work> python(const char* name, Args&... args) {
    py::gil_scoped_acquire gil;
    py::function method = py::get_override(static_cast<const c10d::ProcessGroup*>(this), name);
    TORCH_CHECK(method, "gradwire: the group has no method ", name);
    auto work = method(args...);
    if (work.is_none()) {
      return c10::intrusive_ptr<Work>();
    }
    return c10::make_intrusive<PyProcessGroup::PyWorkHolder>(std::move(work));
  }

  std::atomic<gradwire_comm_t*> comm_{nullptr};
  std::atomic<bool> p2p_pending_{false};
  std::atomic<uint64_t> fast_calls_{0};
  Calls calls_;
};

// Fails `future` (a torch.futures.Future) with the Python exception `error`, kept as itself:
// torch's C++ (DDP's reducer, the autograd engine) rethrows it, and Python sees the same
// exception (PeerLostError, MismatchError) wherever torch waits. Future.set_exception cannot
// do this: it completes the future with the exception as its value, which C++ reads as a
// result. The callbacks run on this thread, without the GIL (they may take it themselves).
void fail_future(const py::object& future, const py::object& error) {
  auto wrapper = future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>();
  TORCH_CHECK(PyExceptionInstance_Check(error.ptr()), "gradwire: fail_future needs an exception");
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  python_error kept;
  kept.persist();  // takes the error just set, leaving none set
  auto failure = std::make_exception_ptr(std::move(kept));
  py::gil_scoped_release release;
  wrapper->fut->setError(failure);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<FastGroup, c10d::ProcessGroup, c10::intrusive_ptr<FastGroup>>(m, "FastGroup")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"))
      .def("_attach", &FastGroup::attach, py::arg("comm"), py::arg("calls"))
      .def("_detach", &FastGroup::detach)
      .def("_set_p2p_pending", &FastGroup::set_p2p_pending, py::arg("pending"))
      .def("_fast_calls", &FastGroup::fast_calls)
      .def_static("_fail_future", &fail_future, py::arg("future"), py::arg("error"));
}
