// The torch backend's hot path in C++ (built at first use by gradwire/_torch_native.py).
//
// A call torch waits for at once (async_op=False) on contiguous CPU tensors goes from
// torch's C++ ProcessGroup entry point straight to gradwire's blocking C call, without the
// GIL: no trip through Python, ctypes or a Python work object (3.7-5.3 us per call, measured
// in one process on a 1-rank group). An async call that torch's C++ makes itself (DDP's
// reducer: its buckets' allreduce, its broadcasts) on such tensors starts gradwire's
// non-blocking call here and returns an AsyncWork, which the group's completion thread
// completes without the GIL (it takes the GIL only to build the Python exception of a
// failed call). Every other call (async calls from Python, CUDA, lists, non-contiguous
// tensors, an input overlapping the output other than in place, ops or dtypes gradwire
// lacks, sends and receives not yet started) goes to the Python group's method of the same
// name with a `_py_` prefix, exactly as before; so do its errors.
//
// FastGroup is torch's own trampoline (PyProcessGroup) with the hot calls overridden: the
// Python class ProcessGroupGradwire derives from it and keeps every other method. Its entry
// points (gradwire/torch.py, _gate) send async and CUDA calls from Python to the Python
// methods before they reach C++, so those return the group's own work, with every Python
// method; what comes here otherwise is a blocking CPU call from Python, or any call
// torch's C++ makes itself.

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
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

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
  decltype(&gradwire_iallreduce) iallreduce = nullptr;
  decltype(&gradwire_ibroadcast) ibroadcast = nullptr;
  decltype(&gradwire_iallgather) iallgather = nullptr;
  decltype(&gradwire_ireduce_scatter) ireduce_scatter = nullptr;
  decltype(&gradwire_wait) wait = nullptr;
  decltype(&gradwire_buffer_layout) buffer_layout = nullptr;
};

// The exception of a call that failed with `code`, as the Python binding raises it
// (gradwire._check: GradwireError of the code's kind with the calling thread's error text,
// so on the thread that made the failed call), kept so that torch rethrows it as itself
// wherever it waits (DDP's reducer: PeerLostError from backward).
std::exception_ptr failure_of(int code) {
  auto plain = [code] { return std::make_exception_ptr(std::runtime_error("gradwire: call failed with code " + std::to_string(code))); };
  if (!Py_IsInitialized()) {
    return plain();  // the interpreter is gone (process exit): no Python exception to build
  }
  py::gil_scoped_acquire gil;
  try {
    py::module_::import("gradwire").attr("_check")(code);
  } catch (py::error_already_set& e) {
    e.restore();
    python_error kept;
    kept.persist();  // takes the error just restored, leaving none set
    return std::make_exception_ptr(std::move(kept));
  }
  return plain();
}

// An async call's work, completed by the group's Completer. Its future is made with it
// (DDP's reducer asks for it at once and chains on it); wait() blocks on a condition, not
// on gradwire, so any number of threads may wait.
class AsyncWork : public Work {
 public:
  // `result` is what the call hands back; `keep` every other buffer it reads or writes.
  AsyncWork(std::vector<at::Tensor> result, std::vector<at::Tensor> keep)
      : result_(std::move(result)),
        keep_(std::move(keep)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  // Done once its future is: who saw it done may read the future's value at once.
  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // kNoTimeout (0) waits until done (gradwire's own deadline bounds that); a timeout that
  // passes first raises and leaves the work pending, as the Python group's work does.
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    auto finished = [this] { return done_; };
    if (timeout.count() <= 0) {
      cv_.wait(lock, finished);
    } else if (!cv_.wait_for(lock, timeout, finished)) {
      TORCH_CHECK(false, "gradwire: Timed out after ", timeout.count(), " ms in Work.wait (the operation is still pending)");
    }
    auto error = error_;
    lock.unlock();
    // finish() marks the future a moment after done_ (the future's callbacks run on the
    // completion thread, and may wait on this work: the future is marked before they run).
    future_->wait();
    if (error) {
      std::rethrow_exception(error);
    }
    return true;
  }

  // Called once, by the completion thread.
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = error;
    }
    cv_.notify_all();
    keep_.clear();
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(result_));
    }
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<at::Tensor> result_;
  std::vector<at::Tensor> keep_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// One thread per group that waits for the group's async calls in the order they started
// (gradwire runs them in that order) and completes their work. Its state is shared with the
// thread, so a group dropped without shutdown (process exit) leaves the thread nothing freed.
class Completer {
 public:
  explicit Completer(decltype(&gradwire_wait) wait) : state_(std::make_shared<State>()) {
    state_->wait = wait;
    thread_ = std::thread(run, state_);
  }

  ~Completer() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stop = true;
    }
    state_->cv.notify_all();
    if (thread_.joinable()) {
      thread_.detach();  // stop() joined it already unless the group is dropped at exit
    }
  }

  void push(gradwire_work_t* handle, c10::intrusive_ptr<AsyncWork> work) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->queue.emplace_back(handle, std::move(work));
    }
    state_->cv.notify_all();
  }

  // Waits for every started call to complete, then ends the thread (before the
  // communicator is finalized). The caller must not hold the GIL: a failure takes it.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stop = true;
    }
    state_->cv.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::pair<gradwire_work_t*, c10::intrusive_ptr<AsyncWork>>> queue;
    bool stop = false;
    decltype(&gradwire_wait) wait = nullptr;
  };

  static void run(std::shared_ptr<State> state) {
    for (;;) {
      std::pair<gradwire_work_t*, c10::intrusive_ptr<AsyncWork>> next;
      {
        std::unique_lock<std::mutex> lock(state->mutex);
        state->cv.wait(lock, [&] { return state->stop || !state->queue.empty(); });
        if (state->queue.empty()) {
          return;  // stopped, nothing left
        }
        next = std::move(state->queue.front());
        state->queue.pop_front();
      }
      // Bounded by the operation's own deadline; frees the handle.
      int code = state->wait(next.first, -1);
      try {
        next.second->finish(code == 0 ? nullptr : failure_of(code));
      } catch (const std::exception& e) {
        // A future's callback that threw (torch runs them here): the later works must
        // still complete; the callback's owner sees its own failure.
        TORCH_WARN("gradwire: a callback of a completed work failed: ", e.what());
      }
    }
  }

  std::shared_ptr<State> state_;
  std::thread thread_;
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
    calls_.iallreduce = reinterpret_cast<decltype(calls_.iallreduce)>(at("gradwire_iallreduce"));
    calls_.ibroadcast = reinterpret_cast<decltype(calls_.ibroadcast)>(at("gradwire_ibroadcast"));
    calls_.iallgather = reinterpret_cast<decltype(calls_.iallgather)>(at("gradwire_iallgather"));
    calls_.ireduce_scatter = reinterpret_cast<decltype(calls_.ireduce_scatter)>(at("gradwire_ireduce_scatter"));
    calls_.wait = reinterpret_cast<decltype(calls_.wait)>(at("gradwire_wait"));
    calls_.buffer_layout = reinterpret_cast<decltype(calls_.buffer_layout)>(at("gradwire_buffer_layout"));
    completer_ = std::make_unique<Completer>(calls_.wait);
    comm_.store(reinterpret_cast<gradwire_comm_t*>(comm));
  }

  // Before the communicator is finalized: every later call takes the Python path, and the
  // async calls started here complete first. Called without the GIL.
  void detach() {
    {
      std::lock_guard<std::mutex> lock(start_mutex_);
      comm_.store(nullptr);  // no call starts after this
    }
    // Not under the lock: a completing work's callback may try to start a call, and must
    // fail rather than wait for this.
    if (completer_) {
      completer_->stop();
    }
  }

  // Sends or receives are queued and not started: collectives take the Python path, which
  // starts them first (the engine runs them in program order).
  void set_p2p_pending(bool pending) { p2p_pending_.store(pending); }

  // How many calls took the fast path (the tests check which do).
  uint64_t fast_calls() const { return fast_calls_.load(std::memory_order_relaxed); }

  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override {
    auto comm = fast();
    auto op = op_of(opts.reduceOp);
    if (comm != nullptr && op && tensors.size() == 1 && plain(tensors[0]) && !opts.sparseIndices) {
      auto& t = tensors[0];
      if (opts.asyncOp) {
        return start([&](gradwire_work_t** w) { return calls_.iallreduce(comm, t.data_ptr(), t.data_ptr(), t.numel(), *dtype_of(t), *op, w); }, tensors, {});
      }
      return done(calls_.allreduce(comm, t.data_ptr(), t.data_ptr(), t.numel(), *dtype_of(t), *op), tensors);
    }
    return python("_py_allreduce", tensors, opts);
  }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override {
    auto comm = fast();
    if (comm != nullptr && tensors.size() == 1 && plain(tensors[0]) && opts.rootTensor == 0 && opts.rootRank >= 0 &&
        opts.rootRank < getSize()) {
      auto& t = tensors[0];
      auto root = static_cast<int>(opts.rootRank);
      if (opts.asyncOp) {
        return start([&](gradwire_work_t** w) { return calls_.ibroadcast(comm, t.data_ptr(), t.numel(), *dtype_of(t), root, w); }, tensors, {});
      }
      return done(calls_.broadcast(comm, t.data_ptr(), t.numel(), *dtype_of(t), root), tensors);
    }
    return python("_py_broadcast", tensors, opts);
  }

  c10::intrusive_ptr<Work> GRADWIRE_ALLGATHER_SINGLE(at::Tensor& output, at::Tensor& input,
                                             const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override {
    auto comm = fast();
    if (comm != nullptr && plain(output) && plain(input) && output.scalar_type() == input.scalar_type() &&
        output.numel() == input.numel() * getSize() && takes(comm, GRADWIRE_CALL_ALLGATHER, input, output)) {
      if (opts.asyncOp) {
        return start([&](gradwire_work_t** w) { return calls_.iallgather(comm, input.data_ptr(), output.data_ptr(), input.numel(), *dtype_of(input), w); }, {output}, {input});
      }
      return done(calls_.allgather(comm, input.data_ptr(), output.data_ptr(), input.numel(), *dtype_of(input)), {output});
    }
    return python("_py_all_gather_single", output, input, opts);
  }

  c10::intrusive_ptr<Work> GRADWIRE_REDUCE_SCATTER_SINGLE(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override {
    auto comm = fast();
    auto op = op_of(opts.reduceOp);
    if (comm != nullptr && op && plain(output) && plain(input) && output.scalar_type() == input.scalar_type() &&
        input.numel() == output.numel() * getSize() && takes(comm, GRADWIRE_CALL_REDUCE_SCATTER, input, output)) {
      if (opts.asyncOp) {
        return start([&](gradwire_work_t** w) { return calls_.ireduce_scatter(comm, input.data_ptr(), output.data_ptr(), output.numel(), *dtype_of(output), *op, w); }, {output}, {input});
      }
      return done(calls_.reduce_scatter(comm, input.data_ptr(), output.data_ptr(), output.numel(), *dtype_of(output), *op), {output});
    }
    return python("_py_reduce_scatter_single", output, input, opts);
  }

  // Rank and size as the group was made with (the trampoline would ask Python for them).
  int getRank() const override { return ProcessGroup::getRank(); }
  int getSize() const override { return ProcessGroup::getSize(); }

 private:
  // The communicator, if this call may take the fast path (no send or receive queued
  // before it). Async calls from Python never come here (the entry points send them to the
  // Python methods), so an async one is torch's C++ calling.
  // Whether gradwire takes these buffers as they lie (apart, or in place as the call
  // allows: gradwire's rule, asked of it); any other overlap goes to the Python method,
  // which copies, as gloo does.
  bool takes(gradwire_comm_t* comm, unsigned int call, const at::Tensor& send, const at::Tensor& recv) const {
    int layout = GRADWIRE_LAYOUT_OVERLAPPING;
    return calls_.buffer_layout(comm, call, send.data_ptr(), send.nbytes(), recv.data_ptr(), recv.nbytes(), &layout) == GRADWIRE_OK &&
           layout != GRADWIRE_LAYOUT_OVERLAPPING;
  }

  gradwire_comm_t* fast() const {
    if (p2p_pending_.load(std::memory_order_relaxed)) {
      return nullptr;
    }
    return comm_.load(std::memory_order_acquire);
  }

  // Starts a non-blocking call (`call` fills in its handle) whose work holds `result` and
  // `keep` (every buffer of the call) until the completion thread completes it. The start
  // is serialized with detach(), so no call starts on a finalized communicator.
  template <typename Call>
  c10::intrusive_ptr<Work> start(Call call, std::vector<at::Tensor> result, std::vector<at::Tensor> keep) {
    gradwire_work_t* handle = nullptr;
    c10::intrusive_ptr<AsyncWork> work;
    int code = 0;
    {
      std::lock_guard<std::mutex> lock(start_mutex_);
      TORCH_CHECK(comm_.load(std::memory_order_acquire) != nullptr, "gradwire: the group is shut down");
      code = call(&handle);
      if (code == 0) {
        work = c10::make_intrusive<AsyncWork>(std::move(result), std::move(keep));
        completer_->push(handle, work);
      }
    }
    if (code != 0) {
      done(code, {});  // raises
    }
    fast_calls_.fetch_add(1, std::memory_order_relaxed);
    return work;
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
  std::mutex start_mutex_;
  std::unique_ptr<Completer> completer_;
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

// What torch's group registry holds for a gradwire group on each of its devices (its name
// and devices: DeviceMesh, FSDP2; gradwire/torch.py, _registry_entry). Python can derive
// one from torch's Backend only where that binding has a constructor, which torch 2.11's
// lacks; this one serves every torch the extension builds for. Calls torch sends to the
// entry itself take Backend's defaults, which refuse, naming "gradwire".
class RegistryEntry : public c10d::Backend {
 public:
  RegistryEntry(int rank, int size) : c10d::Backend(rank, size) {}
  const std::string getBackendName() const override { return "gradwire"; }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto entry = py::class_<RegistryEntry, c10d::Backend, c10::intrusive_ptr<RegistryEntry>>(m, "RegistryEntry")
                   .def(py::init<int, int>(), py::arg("rank"), py::arg("size"));
  py::class_<FastGroup, c10d::ProcessGroup, c10::intrusive_ptr<FastGroup>>(m, "FastGroup")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"))
      .def("_attach", &FastGroup::attach, py::arg("comm"), py::arg("calls"))
      .def("_detach", &FastGroup::detach, py::call_guard<py::gil_scoped_release>())
      .def("_set_p2p_pending", &FastGroup::set_p2p_pending, py::arg("pending"))
      .def("_fast_calls", &FastGroup::fast_calls)
      .def_static("_fail_future", &fail_future, py::arg("future"), py::arg("error"))
      .attr("_registry_entry") = entry;  // found through the class gradwire/torch.py is given
}
