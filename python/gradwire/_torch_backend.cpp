// The "gradwire" torch.distributed backend: a c10d::Backend over gradwire's C interface.
//
// Built against the torch in use (gradwire/_torch_native.py) and registered by
// gradwire/torch.py, which does nothing else: torch makes the ProcessGroup, names it and
// registers this backend for CPU and CUDA tensors, as it does for gloo. Every op runs here,
// without the GIL (it is taken only to build the Python exception of a failed call, so that
// PeerLostError, MismatchError and DeadlineError reach the user as themselves).
//
// - A blocking call (torch's asyncOp false) runs gradwire's blocking call on the caller's
//   thread and returns completed work. An async one starts gradwire's non-blocking call and
//   returns an AsyncWork, which one completion thread per group completes in start order.
// - Sends and receives gather into one gradwire batch (gradwire_ip2p_batch), started when one
//   of them is waited for or polled, or before the group's next other call: a ring of sends
//   and receives completes, as on NCCL. Messages are matched by (peer, tag).
// - CUDA tensors run on the group's GPU communicator of their device (made at the first
//   call there), enqueued on torch's current stream as ProcessGroupNCCL's calls are.
// - The group's timeout is the communicator's deadline: a dead or late peer fails the call
//   naming the rank, never a hang.

#include <torch/extension.h>

#include <pybind11/chrono.h>

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "gradwire.h"

namespace {

using c10d::Work;
using Clock = std::chrono::steady_clock;
using Milliseconds = std::chrono::milliseconds;

// torch's default group timeout (default_pg_timeout).
constexpr Milliseconds kTorchDefaultTimeout(30 * 60 * 1000);

// ---- the C library -------------------------------------------------------------------

#define GRADWIRE_CALLS(X)                                                                                    \
  X(gradwire_get_unique_id) X(gradwire_comm_init_rank) X(gradwire_comm_init_rank_timeout) X(gradwire_finalize) \
  X(gradwire_allreduce) X(gradwire_iallreduce) X(gradwire_broadcast) X(gradwire_ibroadcast)                    \
  X(gradwire_allgather) X(gradwire_iallgather) X(gradwire_reduce_scatter) X(gradwire_ireduce_scatter)          \
  X(gradwire_reduce) X(gradwire_alltoall) X(gradwire_ialltoall) X(gradwire_ip2p_batch) X(gradwire_barrier)     \
  X(gradwire_wait) X(gradwire_test) X(gradwire_buffer_layout) X(gradwire_last_error)                           \
  X(gradwire_gpu_comm_create) X(gradwire_gpu_comm_free) X(gradwire_gpu_allreduce) X(gradwire_gpu_broadcast)    \
  X(gradwire_gpu_reduce) X(gradwire_gpu_reduce_scatter) X(gradwire_gpu_allgather) X(gradwire_gpu_alltoall)

// The library's calls, looked up once in the copy the Python binding loaded (the same
// process-wide state, so a communicator made here is one the binding can use).
struct Library {
#define GRADWIRE_FIELD(name) decltype(&::name) name = nullptr;
  GRADWIRE_CALLS(GRADWIRE_FIELD)
#undef GRADWIRE_FIELD
};

std::once_flag library_once;
Library library;

void load_library(const std::string& path) {
  std::string error;
  std::call_once(library_once, [&] {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      error = std::string("cannot load ") + path + ": " + dlerror();
      return;
    }
#define GRADWIRE_LOOKUP(name)                                                  \
  library.name = reinterpret_cast<decltype(&::name)>(dlsym(handle, #name));   \
  if (library.name == nullptr && error.empty()) error = path + " has no " #name " (an older libgradwire?)";
    GRADWIRE_CALLS(GRADWIRE_LOOKUP)
#undef GRADWIRE_LOOKUP
  });
  TORCH_CHECK(error.empty(), "gradwire: ", error);
  TORCH_CHECK(library.gradwire_wait != nullptr, "gradwire: the library failed to load earlier in this process");
}

const Library& lib() { return library; }

// ---- errors --------------------------------------------------------------------------

// The exception of a call that failed with `code`, as the Python binding raises it
// (gradwire._check: GradwireError of the code's kind with this thread's error text), kept
// so that torch rethrows it as itself wherever it waits (DDP's reducer: from backward).
std::exception_ptr failure_of(int code) {
  std::string text = lib().gradwire_last_error != nullptr ? lib().gradwire_last_error() : "";
  auto plain = [&] { return std::make_exception_ptr(std::runtime_error("gradwire: call failed with code " + std::to_string(code) + ": " + text)); };
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

// Lets go of the GIL for a wait, where the calling thread holds it: the completion thread
// takes it to build a failure's exception.
class WithoutGil {
 public:
  WithoutGil() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      release_.emplace();
    }
  }

 private:
  std::optional<py::gil_scoped_release> release_;
};

void check(int code) {
  if (code != GRADWIRE_OK) {
    std::rethrow_exception(failure_of(code));
  }
}

// ---- work ----------------------------------------------------------------------------

c10::intrusive_ptr<c10::ivalue::Future> tensor_future() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

// A call that finished when it returned (torch waits for a blocking call at once).
class DoneWork : public Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> result) : result_(std::move(result)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(Milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = tensor_future();
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::vector<at::Tensor> result_;
};

// An async call's work, completed once by the group's Completer. Its future is made with
// it (DDP's reducer asks for it at once and chains on it); wait() blocks on a condition,
// not on gradwire, so any number of threads may wait.
class AsyncWork : public Work {
 public:
  // `result` is what the call hands back; `keep` every other buffer it reads or writes;
  // `then` runs once the call succeeded, before the work completes (copies back).
  AsyncWork(std::vector<at::Tensor> result, std::vector<at::Tensor> keep, std::function<void()> then)
      : result_(std::move(result)), keep_(std::move(keep)), then_(std::move(then)), future_(tensor_future()) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  // kNoTimeout (0) waits until done (the group's deadline bounds that); a timeout that
  // passes first raises and leaves the work pending.
  bool wait(Milliseconds timeout) override {
    WithoutGil nogil;
    std::unique_lock<std::mutex> lock(mutex_);
    auto finished = [this] { return done_; };
    if (timeout.count() <= 0) {
      cv_.wait(lock, finished);
    } else if (!cv_.wait_for(lock, timeout, finished)) {
      TORCH_CHECK(false, "gradwire: Timed out after ", timeout.count(), " ms in Work.wait (the operation is still pending)");
    }
    auto error = error_;
    lock.unlock();
    // finish() marks the future a moment after done_ (its callbacks run on the completion
    // thread and may wait on this work: the future is marked before they run).
    future_->wait();
    if (error) {
      std::rethrow_exception(error);
    }
    return true;
  }

  // Called once, by the completion thread (or at once, for a call that never started).
  void finish(std::exception_ptr error) {
    if (!error && then_) {
      try {
        then_();
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = error;
    }
    cv_.notify_all();
    keep_.clear();
    then_ = nullptr;
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
  std::function<void()> then_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// One thread that waits for a group's async calls in the order they started (gradwire runs
// them in that order) and completes their work. Its state is shared with the thread, so a
// group dropped without shutdown (process exit) leaves the thread nothing freed.
class Completer {
 public:
  Completer() : state_(std::make_shared<State>()) { thread_ = std::thread(run, state_); }

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

  // Waits for every started call to complete, then ends the thread.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stop = true;
    }
    state_->cv.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    }
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::pair<gradwire_work_t*, c10::intrusive_ptr<AsyncWork>>> queue;
    bool stop = false;
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
      int code = lib().gradwire_wait(next.first, -1);  // bounded by the call's deadline; frees it
      try {
        next.second->finish(code == GRADWIRE_OK ? nullptr : failure_of(code));
      } catch (const std::exception& e) {
        // A future's callback that threw (torch runs them here): later works must still
        // complete; the callback's owner sees its own failure.
        TORCH_WARN("gradwire: a callback of a completed work failed: ", e.what());
      }
    }
  }

  std::shared_ptr<State> state_;
  std::thread thread_;
};

// ---- tensors as gradwire takes them ----------------------------------------------------

std::optional<gradwire_dtype_t> dtype_of(at::ScalarType type) {
  switch (type) {
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

// A contiguous tensor's elements as a call takes them.
struct Elements {
  void* data;
  size_t count;
  gradwire_dtype_t dtype;
};

// For moving data (broadcast, gathers, all-to-all, sends): any dtype, as bytes where
// gradwire has no type of its own (complex, uint16, float8, ...).
Elements moved(const at::Tensor& t) {
  if (auto dtype = dtype_of(t.scalar_type())) {
    return {t.data_ptr(), static_cast<size_t>(t.numel()), *dtype};
  }
  return {t.data_ptr(), static_cast<size_t>(t.nbytes()), GRADWIRE_UINT8};
}

enum class Reduction { kGradwire, kBitwise };

struct Op {
  Reduction kind;
  gradwire_op_t op;           // kGradwire
  c10d::ReduceOp::RedOpType bitwise;  // kBitwise
};

Op op_of(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return {Reduction::kGradwire, GRADWIRE_SUM, op.op_};
    case c10d::ReduceOp::AVG: return {Reduction::kGradwire, GRADWIRE_AVG, op.op_};
    case c10d::ReduceOp::MIN: return {Reduction::kGradwire, GRADWIRE_MIN, op.op_};
    case c10d::ReduceOp::MAX: return {Reduction::kGradwire, GRADWIRE_MAX, op.op_};
    case c10d::ReduceOp::PRODUCT: return {Reduction::kGradwire, GRADWIRE_PRODUCT, op.op_};
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR: return {Reduction::kBitwise, GRADWIRE_SUM, op.op_};
    default:
      break;
  }
  TORCH_CHECK_VALUE(false, "gradwire: reduce op ", static_cast<int>(op.op_), " is not supported (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR)");
}

// For reducing: gradwire's types, and complex ones as pairs of reals where the op acts on
// each part alone (SUM, AVG).
Elements reduced(const at::Tensor& t, const Op& op, const char* what) {
  if (t.is_complex()) {
    TORCH_CHECK_VALUE(op.op == GRADWIRE_SUM || op.op == GRADWIRE_AVG, "gradwire: ", what, ": ", t.scalar_type(),
                      " takes SUM and AVG only (complex values have no order, and a product mixes their parts)");
    auto real = at::view_as_real(t);
    return {real.data_ptr(), static_cast<size_t>(real.numel()), *dtype_of(real.scalar_type())};
  }
  auto dtype = dtype_of(t.scalar_type());
  TORCH_CHECK_VALUE(dtype.has_value(), "gradwire: ", what, ": dtype ", t.scalar_type(),
                    " is not supported (float32, float64, float16, bfloat16, int8, uint8, int32, int64, bool, complex64, complex128)");
  TORCH_CHECK_VALUE(op.op != GRADWIRE_AVG || t.is_floating_point(), "gradwire: ", what, ": AVG needs a floating-point tensor, got ", t.scalar_type());
  return {t.data_ptr(), static_cast<size_t>(t.numel()), *dtype};
}

// A contiguous tensor with t's values and a function that puts a result written into it
// back into t (nothing to do where t is contiguous already).
struct Dense {
  at::Tensor tensor;
  std::function<void()> back;
};

Dense dense(const at::Tensor& t) {
  if (t.is_contiguous()) {
    return {t, nullptr};
  }
  auto c = t.contiguous();
  return {c, [t, c]() mutable { t.copy_(c); }};
}

std::function<void()> then(std::function<void()> first, std::function<void()> second) {
  if (!first) return second;
  if (!second) return first;
  return [first, second] {
    first();
    second();
  };
}

at::Tensor flat_cat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) {
    flat.push_back(t.reshape(-1));
  }
  return at::cat(flat);
}

// Copies consecutive parts of `flat` into `tensors`.
void scatter_back(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t at = 0;
  for (auto& t : tensors) {
    t.copy_(flat.slice(0, at, at + t.numel()).view_as(t));
    at += t.numel();
  }
}

// Which device a call's tensors are on: CPU or one CUDA device, else a clear error.
bool on_cuda(const std::vector<at::Tensor>& tensors, const char* what) {
  std::optional<at::Device> device;
  for (const auto& t : tensors) {
    TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), "gradwire: ", what, ": tensor on ", t.device(), "; gradwire takes CPU and CUDA tensors");
    TORCH_CHECK_VALUE(!device || *device == t.device(), "gradwire: ", what, ": tensors on several devices (", *device, ", ", t.device(), ")");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, "gradwire: ", what, ": ", t.layout(), " tensors are not supported (dense tensors only)");
    device = t.device();
  }
  return device && device->is_cuda();
}

// torch's current stream on a CUDA device (no CUDA headers: through torch's device guard).
c10::Stream current_stream(at::Device device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
}

// An async call's work on CUDA tensors, queued on `device`'s current stream: as
// ProcessGroupNCCL's, wait() makes the caller's current stream wait for it (the host does
// not), isCompleted() asks the GPU, and the future completes on the stream.
class CudaWork : public Work {
 public:
  CudaWork(std::vector<at::Tensor> result, at::Device device)
      : result_(std::move(result)), device_(device), event_(c10::DeviceType::CUDA) {
    event_.record(current_stream(device_));
  }
  bool wait(Milliseconds /*timeout*/) override {
    event_.block(current_stream(device_));
    return true;
  }
  bool isCompleted() override { return event_.query(); }
  bool isSuccess() const override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device_});
    event_.block(current_stream(device_));
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::vector<at::Tensor> result_;
  at::Device device_;
  c10::Event event_;
};

// ---- the group's communicator ----------------------------------------------------------

// What a group's works and its sends' batches share: the communicator and its completion
// thread. A start is serialized with shutdown, so no call starts on a finalized one.
class Core {
 public:
  explicit Core(gradwire_comm_t* comm) : comm_(comm) {}

  gradwire_comm_t* comm() const { return comm_; }

  // Starts a non-blocking call (`call` fills in its handle) and returns its work.
  template <typename Call>
  c10::intrusive_ptr<AsyncWork> start(Call call, std::vector<at::Tensor> result, std::vector<at::Tensor> keep,
                                      std::function<void()> then_) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(comm_ != nullptr, "gradwire: the group is shut down");
    gradwire_work_t* handle = nullptr;
    check(call(comm_, &handle));
    auto work = c10::make_intrusive<AsyncWork>(std::move(result), std::move(keep), std::move(then_));
    completer_.push(handle, work);
    return work;
  }

  // The communicator for a blocking call.
  gradwire_comm_t* live() const {
    TORCH_CHECK(comm_ != nullptr, "gradwire: the group is shut down");
    return comm_;
  }

  // Completes every started call, then finalizes the communicator (once).
  void shutdown() {
    WithoutGil nogil;
    gradwire_comm_t* comm = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::swap(comm, comm_);
    }
    completer_.stop();
    if (comm != nullptr) {
      lib().gradwire_finalize(comm);
    }
  }

 private:
  std::mutex mutex_;
  gradwire_comm_t* comm_;
  Completer completer_;
};

// Sends and receives issued and not yet started (see the file's head).
class P2PBatch {
 public:
  explicit P2PBatch(std::shared_ptr<Core> core) : core_(std::move(core)) {}

  // Adds ops; false (nothing added) once started, since a poll on another thread may
  // start it at any time.
  bool add(const std::vector<gradwire_p2p_op_t>& ops, const std::vector<at::Tensor>& keep, std::function<void()> back) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (work_) {
      return false;
    }
    ops_.insert(ops_.end(), ops.begin(), ops.end());
    keep_.insert(keep_.end(), keep.begin(), keep.end());
    back_ = then(back_, std::move(back));
    return true;
  }

  bool started() {
    std::lock_guard<std::mutex> lock(mutex_);
    return work_.defined();
  }

  // The batch's work, started at the first call.
  c10::intrusive_ptr<AsyncWork> start() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!work_) {
      auto ops = ops_;
      try {
        work_ = core_->start([&](gradwire_comm_t* comm, gradwire_work_t** w) { return lib().gradwire_ip2p_batch(comm, ops.data(), ops.size(), w); },
                             keep_, {}, back_);
      } catch (...) {
        // Failed to start: every send and receive of it sees the failure.
        work_ = c10::make_intrusive<AsyncWork>(keep_, std::vector<at::Tensor>{}, nullptr);
        work_->finish(std::current_exception());
      }
      ops_.clear();
      keep_.clear();
      back_ = nullptr;
    }
    return work_;
  }

 private:
  std::shared_ptr<Core> core_;
  std::mutex mutex_;
  std::vector<gradwire_p2p_op_t> ops_;
  std::vector<at::Tensor> keep_;
  std::function<void()> back_;
  c10::intrusive_ptr<AsyncWork> work_;
};

// A send's or receive's work: its batch's, which starts when this is waited for or polled.
class P2PWork : public Work {
 public:
  P2PWork(std::shared_ptr<P2PBatch> batch, std::vector<at::Tensor> tensors, int peer)
      : batch_(std::move(batch)), tensors_(std::move(tensors)), peer_(peer) {}
  bool wait(Milliseconds timeout) override { return batch_->start()->wait(timeout); }
  bool isCompleted() override { return batch_->start()->isCompleted(); }
  bool isSuccess() const override { return batch_->start()->isSuccess(); }
  std::exception_ptr exception() const override { return batch_->start()->exception(); }
  std::vector<at::Tensor> result() override { return tensors_; }
  int sourceRank() const override { return peer_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return batch_->start()->getFuture(); }

 private:
  std::shared_ptr<P2PBatch> batch_;
  std::vector<at::Tensor> tensors_;
  int peer_;
};

// ---- forming a group ------------------------------------------------------------------

std::string random_hex(size_t bytes) {
  static thread_local std::random_device device;
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes; ++i) {
    auto b = device() & 0xff;
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

std::string text_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> bytes_of(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::vector<std::string> split_on(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t from = 0;
  for (;;) {
    auto at = text.find(separator, from);
    parts.push_back(text.substr(from, at == std::string::npos ? std::string::npos : at - from));
    if (at == std::string::npos) return parts;
    from = at + 1;
  }
}

// The unique id of the communicator a group's members form, handed from its rank 0 to the
// others through torch's store, within `timeout`.
//
// The store may hold keys of an earlier meeting whose ranks are gone (torchrun's agents keep
// one store across a job's restarts; a store is used again after destroy_process_group), and
// nothing tells attempts apart across nodes. So each meeting proves itself fresh: rank 0
// posts a new nonce and the meeting's keys live under it; each member answers there with a
// nonce of its own, and rank 0 posts the id beside every answer. A member takes the id only
// beside its own nonce, and answers again whenever rank 0's nonce changes.
gradwire_unique_id_t meet(c10d::Store& store, int rank, int size, Milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  const std::string mine = random_hex(16);
  gradwire_unique_id_t id;
  if (rank == 0) {
    store.set("gradwire/meet/leader", bytes_of(mine));
    std::vector<std::string> keys;
    for (int r = 1; r < size; ++r) {
      keys.push_back("gradwire/meet/" + mine + "/answer/" + std::to_string(r));
    }
    if (!keys.empty()) {
      try {
        store.wait(keys, std::max(Milliseconds(1), std::chrono::duration_cast<Milliseconds>(deadline - Clock::now())));
      } catch (const std::exception&) {
        std::string missing;
        for (int r = 1; r < size; ++r) {
          if (!store.check({keys[r - 1]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
        TORCH_CHECK(!missing.empty(), "gradwire: forming a group: the store failed while rank 0 waited for the others");
        TORCH_CHECK(false, "gradwire: forming a group timed out: rank(s) [", missing, "] of ", size, " did not join the group");
      }
    }
    std::string answers;
    for (const auto& key : keys) {
      answers += (answers.empty() ? "" : ",") + text_of(store.get(key));
    }
    check(lib().gradwire_get_unique_id(&id));
    auto value = bytes_of(answers + ":");
    const auto* raw = reinterpret_cast<const uint8_t*>(&id);
    value.insert(value.end(), raw, raw + sizeof(id));
    store.set("gradwire/meet/" + mine + "/id", value);
    return id;
  }
  std::string answered, rejected;
  for (;;) {
    if (store.check({"gradwire/meet/leader"})) {
      auto leader = text_of(store.get("gradwire/meet/leader"));
      if (leader != answered) {
        store.set("gradwire/meet/" + leader + "/answer/" + std::to_string(rank), bytes_of(mine));
        answered = leader;
      }
    }
    if (!answered.empty() && answered != rejected) {
      auto key = "gradwire/meet/" + answered + "/id";
      if (store.check({key})) {
        auto value = store.get(key);
        auto colon = std::find(value.begin(), value.end(), static_cast<uint8_t>(':'));
        auto nonces = split_on(std::string(value.begin(), colon), ',');
        if (colon != value.end() && static_cast<size_t>(value.end() - colon - 1) == sizeof(id) &&
            nonces.size() == static_cast<size_t>(size - 1) && nonces[rank - 1] == mine) {
          std::memcpy(&id, &*(colon + 1), sizeof(id));
          return id;
        }
        rejected = answered;  // another meeting's id (a leader of an earlier one)
      }
    }
    TORCH_CHECK(Clock::now() < deadline, "gradwire: forming a group timed out: rank 0 of the group did not hand out its id");
    std::this_thread::sleep_for(Milliseconds(10));
  }
}

// torch's default group timeout (30 minutes) would leave a stalled peer unreported for
// half an hour: where the group was given that, gradwire's own deadline
// (GRADWIRE_TIMEOUT_MS, default 60 s) applies; any other timeout is the deadline.
std::optional<int64_t> deadline_ms(Milliseconds timeout) {
  if (timeout.count() <= 0 || timeout == kTorchDefaultTimeout) {
    return std::nullopt;
  }
  return std::min<int64_t>(timeout.count(), int64_t{7} * 24 * 3600 * 1000);  // a year's means "never"
}

// ---- the backend -----------------------------------------------------------------------

class GradwireBackend : public c10d::Backend {
 public:
  // Meets the group's other members through `store` and joins the communicator they form.
  GradwireBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Milliseconds timeout)
      : Backend(rank, size), store_(store), timeout_(timeout) {
    TORCH_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "gradwire: rank ", rank, " is not a rank of a group of ", size);
    // Every rank is here before any joins: this wait is the group's timeout, at least a
    // minute (on a loaded machine ranks start seconds apart; a short timeout is meant for
    // the operations).
    auto id = meet(*store, rank, size, std::max(timeout.count() > 0 ? timeout : kTorchDefaultTimeout, Milliseconds(60000)));
    gradwire_comm_t* comm = nullptr;
    auto ms = deadline_ms(timeout);
    check(ms ? lib().gradwire_comm_init_rank_timeout(&comm, &id, size, rank, *ms) : lib().gradwire_comm_init_rank(&comm, &id, size, rank));
    core_ = std::make_shared<Core>(comm);
  }

  ~GradwireBackend() override {
    // Dropped without shutdown (process exit, a group torch never destroyed): the
    // communicator lives until the process ends, as NCCL's does.
  }

  const std::string getBackendName() const override { return "gradwire"; }
  bool supportsSplitting() const override { return true; }

  // Counts the group's calls, as gloo's does (torch's object collectives ask for it).
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return c10::make_intrusive<Options>("gradwire", timeout_); }

  // The address of the communicator (gradwire.Comm views it: the schemes run on a group).
  uintptr_t comm_address() const { return reinterpret_cast<uintptr_t>(core_->live()); }

  void shutdown() override {
    flush_p2p();
    std::lock_guard<std::mutex> lock(gpus_mutex_);
    for (auto& [index, gpu] : gpus_) {
      lib().gradwire_gpu_comm_free(gpu);
    }
    gpus_.clear();
    core_->shutdown();
  }

  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    auto at = std::find(ranks.begin(), ranks.end(), getRank());
    if (at == ranks.end()) {
      return nullptr;  // not a member: torch hands this rank no group
    }
    auto timeout = opts ? opts->timeout : timeout_;
    return c10::make_intrusive<GradwireBackend>(store, static_cast<int>(at - ranks.begin()), static_cast<int>(ranks.size()), timeout);
  }

  // --- collectives ---------------------------------------------------------------------

  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    flush_p2p();
    TORCH_CHECK_VALUE(!opts.sparseIndices, "gradwire: sparse allreduce is not supported");
    auto op = op_of(opts.reduceOp);
    if (tensors.size() != 1) {
      return coalesced(tensors, op, opts.asyncOp);
    }
    auto& t = tensors[0];
    if (op.kind == Reduction::kBitwise) {
      return bitwise(tensors, op, -1, "allreduce", opts.asyncOp);
    }
    if (on_cuda(tensors, "allreduce")) {
      auto d = dense(t);
      auto e = reduced(d.tensor, op, "allreduce");
      check(lib().gradwire_gpu_allreduce(gpu(t), e.data, e.data, e.count, e.dtype, op.op, stream(t)));
      if (d.back) d.back();
      return cuda_work(tensors, opts.asyncOp);
    }
    auto d = dense(t);
    auto e = reduced(d.tensor, op, "allreduce");
    return run(
        opts.asyncOp, [&](gradwire_comm_t* c, gradwire_work_t** w) { return lib().gradwire_iallreduce(c, e.data, e.data, e.count, e.dtype, op.op, w); },
        [&](gradwire_comm_t* c) { return lib().gradwire_allreduce(c, e.data, e.data, e.count, e.dtype, op.op); }, tensors, {d.tensor}, d.back);
  }

  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    flush_p2p();
    return coalesced(tensors, op_of(opts.reduceOp), opts.asyncOp);
  }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    flush_p2p();
    int root = checked_root(opts.rootRank, "broadcast");
    if (on_cuda(tensors, "broadcast")) {
      for (auto& t : tensors) {
        auto d = dense(t);
        auto e = moved(d.tensor);
        check(lib().gradwire_gpu_broadcast(gpu(t), e.data, e.count, e.dtype, root, stream(t)));
        if (d.back) d.back();
      }
      return cuda_work(tensors, opts.asyncOp);
    }
    if (tensors.size() == 1) {
      auto d = dense(tensors[0]);
      auto e = moved(d.tensor);
      return run(
          opts.asyncOp, [&](gradwire_comm_t* c, gradwire_work_t** w) { return lib().gradwire_ibroadcast(c, e.data, e.count, e.dtype, root, w); },
          [&](gradwire_comm_t* c) { return lib().gradwire_broadcast(c, e.data, e.count, e.dtype, root); }, tensors, {d.tensor}, d.back);
    }
    for (auto& t : tensors) {
      auto d = dense(t);
      auto e = moved(d.tensor);
      check(lib().gradwire_broadcast(core_->live(), e.data, e.count, e.dtype, root));
      if (d.back) d.back();
    }
    return done(tensors);
  }

  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    flush_p2p();
    auto op = op_of(opts.reduceOp);
    int root = checked_root(opts.rootRank, "reduce");
    if (op.kind == Reduction::kBitwise) {
      return bitwise(tensors, op, root, "reduce", opts.asyncOp);
    }
    bool cuda = on_cuda(tensors, "reduce");
    for (auto& t : tensors) {
      auto d = dense(t);
      auto e = reduced(d.tensor, op, "reduce");
      if (cuda) {
        check(lib().gradwire_gpu_reduce(gpu(t), e.data, e.data, e.count, e.dtype, op.op, root, stream(t)));
      } else {
        check(lib().gradwire_reduce(core_->live(), e.data, e.data, e.count, e.dtype, op.op, root));
      }
      if (d.back) d.back();
    }
    return cuda ? cuda_work(tensors, opts.asyncOp) : done(tensors);
  }

  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    flush_p2p();
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "gradwire: allgather: ", outputs.size(), " output lists for ", inputs.size(), " inputs");
    bool cuda = false;
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto& outs = outputs[i];
      auto& in = inputs[i];
      TORCH_CHECK_VALUE(outs.size() == static_cast<size_t>(getSize()), "gradwire: allgather needs ", getSize(), " output tensors, got ", outs.size());
      for (const auto& o : outs) {
        TORCH_CHECK_VALUE(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(), "gradwire: allgather outputs must match the input in size and dtype");
      }
      std::vector<at::Tensor> all(outs);
      all.push_back(in);
      cuda = on_cuda(all, "allgather");
      auto flat = gather_all(in.contiguous(), "allgather");
      scatter_back(flat, outs);
    }
    return cuda ? cuda_work(flatten(outputs), opts.asyncOp) : done(flatten(outputs));
  }

  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    // output_lists[r][i] receives rank r's input i.
    TORCH_CHECK_VALUE(output_lists.size() == static_cast<size_t>(getSize()), "gradwire: allgather_coalesced needs ", getSize(), " output lists");
    std::vector<std::vector<at::Tensor>> per_input(inputs.size());
    for (auto& outs : output_lists) {
      TORCH_CHECK_VALUE(outs.size() == inputs.size(), "gradwire: allgather_coalesced needs output lists of ", inputs.size(), " tensors");
      for (size_t i = 0; i < inputs.size(); ++i) {
        per_input[i].push_back(outs[i]);
      }
    }
    auto blocking = opts;
    blocking.asyncOp = false;
    allgather(per_input, inputs, blocking);
    auto all = flatten(output_lists);
    return !all.empty() && all[0].is_cuda() ? cuda_work(all, opts.asyncOp) : done(all);
  }

  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    flush_p2p();
    const char* what = "all_gather_into_tensor";
    bool cuda = on_cuda({output, input}, what);
    TORCH_CHECK_VALUE(output.numel() == input.numel() * getSize() && output.scalar_type() == input.scalar_type(), "gradwire: ", what,
                      " output must hold ", getSize(), " x ", input.numel(), " elements of ", input.scalar_type());
    auto out = dense(output);
    auto in = input.contiguous();
    // FSDP gathers in place (the input is the output's own part); any other overlap goes
    // in as a copy, on every rank alike.
    if (overlapping(GRADWIRE_CALL_ALLGATHER, in, out.tensor)) {
      in = in.clone();
    }
    auto s = moved(in);
    auto r = moved(out.tensor);
    if (cuda) {
      check(lib().gradwire_gpu_allgather(gpu(output), s.data, r.data, s.count, s.dtype, stream(output)));
      if (out.back) out.back();
      return cuda_work({output}, opts.asyncOp);
    }
    return run(
        opts.asyncOp, [&](gradwire_comm_t* c, gradwire_work_t** w) { return lib().gradwire_iallgather(c, s.data, r.data, s.count, s.dtype, w); },
        [&](gradwire_comm_t* c) { return lib().gradwire_allgather(c, s.data, r.data, s.count, s.dtype); }, {output}, {in, out.tensor}, out.back);
  }

  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) override {
    return each_pair(outputs, inputs, opts, "allgather_into_tensor_coalesced",
                     [&](at::Tensor& o, at::Tensor& i, const c10d::AllgatherOptions& each) { return _allgather_base(o, i, each); });
  }

  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override {
    flush_p2p();
    int root = checked_root(opts.rootRank, "gather");
    TORCH_CHECK_VALUE(inputs.size() == 1, "gradwire: gather takes one input tensor, got ", inputs.size());
    bool cuda = on_cuda(inputs, "gather");
    auto flat = gather_all(inputs[0].contiguous(), "gather");
    if (getRank() == root) {
      TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(getSize()), "gradwire: gather needs ", getSize(), " output tensors on the root");
      scatter_back(flat, outputs[0]);
    }
    return cuda ? cuda_work(flatten(outputs), opts.asyncOp) : done(flatten(outputs));
  }

  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    flush_p2p();
    int root = checked_root(opts.rootRank, "scatter");
    TORCH_CHECK_VALUE(outputs.size() == 1, "gradwire: scatter takes one output tensor, got ", outputs.size());
    auto& out = outputs[0];
    std::vector<at::Tensor> all{out};
    if (getRank() == root) {
      TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(getSize()), "gradwire: scatter needs ", getSize(), " input tensors on the root");
      all.insert(all.end(), inputs[0].begin(), inputs[0].end());
    }
    bool cuda = on_cuda(all, "scatter");
    // The root's inputs broadcast whole, each rank keeping its part (the bytes of a
    // broadcast, which gradwire runs near the link's rate).
    auto flat = getRank() == root ? flat_cat(inputs[0]) : at::empty({out.numel() * getSize()}, out.options());
    auto e = moved(flat);
    if (cuda) {
      check(lib().gradwire_gpu_broadcast(gpu(flat), e.data, e.count, e.dtype, root, stream(flat)));
    } else {
      check(lib().gradwire_broadcast(core_->live(), e.data, e.count, e.dtype, root));
    }
    out.copy_(flat.slice(0, getRank() * out.numel(), (getRank() + 1) * out.numel()).view_as(out));
    return cuda ? cuda_work(outputs, opts.asyncOp) : done(outputs);
  }

  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    flush_p2p();
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "gradwire: reduce_scatter: ", outputs.size(), " outputs for ", inputs.size(), " input lists");
    bool cuda = false;
    for (size_t i = 0; i < outputs.size(); ++i) {
      TORCH_CHECK_VALUE(inputs[i].size() == static_cast<size_t>(getSize()), "gradwire: reduce_scatter needs ", getSize(), " input tensors, got ", inputs[i].size());
      std::vector<at::Tensor> all(inputs[i]);
      all.push_back(outputs[i]);
      cuda = on_cuda(all, "reduce_scatter");
      auto flat = flat_cat(inputs[i]);
      auto out = outputs[i];
      auto blocking = opts;
      blocking.asyncOp = false;
      _reduce_scatter_base(out, flat, blocking);
    }
    return cuda ? cuda_work(outputs, opts.asyncOp) : done(outputs);
  }

  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    flush_p2p();
    const char* what = "reduce_scatter_tensor";
    auto op = op_of(opts.reduceOp);
    bool cuda = on_cuda({output, input}, what);
    TORCH_CHECK_VALUE(input.numel() == output.numel() * getSize() && output.scalar_type() == input.scalar_type(), "gradwire: ", what,
                      " input must hold ", getSize(), " x ", output.numel(), " elements of ", output.scalar_type());
    if (op.kind == Reduction::kBitwise) {
      // The whole input reduced (a copy), then this rank's block of it.
      std::vector<at::Tensor> whole{input.contiguous().clone()};
      bitwise(whole, op, -1, what, false);
      auto n = output.numel();
      output.copy_(whole[0].reshape(-1).slice(0, getRank() * n, (getRank() + 1) * n).view_as(output));
      return cuda ? cuda_work({output}, opts.asyncOp) : done({output});
    }
    auto in = input.contiguous();
    auto out = dense(output);
    // In place: the output is the input's own part. Any other overlap lands in a separate
    // tensor, copied back at the end.
    if (overlapping(GRADWIRE_CALL_REDUCE_SCATTER, in, out.tensor)) {
      auto target = out.tensor;
      out.tensor = at::empty_like(target);
      auto separate = out.tensor;
      out.back = then([target, separate]() mutable { target.copy_(separate); }, out.back);
    }
    auto s = reduced(in, op, what);
    auto r = reduced(out.tensor, op, what);
    if (cuda) {
      check(lib().gradwire_gpu_reduce_scatter(gpu(output), s.data, r.data, r.count, r.dtype, op.op, stream(output)));
      if (out.back) out.back();
      return cuda_work({output}, opts.asyncOp);
    }
    return run(
        opts.asyncOp, [&](gradwire_comm_t* c, gradwire_work_t** w) { return lib().gradwire_ireduce_scatter(c, s.data, r.data, r.count, r.dtype, op.op, w); },
        [&](gradwire_comm_t* c) { return lib().gradwire_reduce_scatter(c, s.data, r.data, r.count, r.dtype, op.op); }, {output}, {in, out.tensor}, out.back);
  }

  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) override {
    return each_pair(outputs, inputs, opts, "reduce_scatter_tensor_coalesced",
                     [&](at::Tensor& o, at::Tensor& i, const c10d::ReduceScatterOptions& each) { return _reduce_scatter_base(o, i, each); });
  }

  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    flush_p2p();
    const char* what = "all_to_all_single";
    bool cuda = on_cuda({output, input}, what);
    auto in = input.contiguous();
    auto out = dense(output);
    auto s = moved(in);
    auto r = moved(out.tensor);
    // Splits count rows of dim 0: elements (or bytes) per row times the split.
    auto counts = [&](const at::Tensor& t, const Elements& e, const std::vector<int64_t>& splits) {
      std::vector<size_t> c(getSize(), 0);
      size_t rows = t.dim() > 0 ? static_cast<size_t>(t.size(0)) : 1;
      size_t row = rows > 0 ? e.count / rows : 0;
      TORCH_CHECK_VALUE(splits.empty() || splits.size() == static_cast<size_t>(getSize()), "gradwire: ", what, ": ", splits.size(), " splits for ", getSize(), " ranks");
      for (int p = 0; p < getSize(); ++p) {
        c[p] = (splits.empty() ? rows / getSize() : static_cast<size_t>(splits[p])) * row;
      }
      return c;
    };
    bool split = !output_splits.empty() || !input_splits.empty();
    auto sc = std::make_shared<std::vector<size_t>>(split ? counts(in, s, input_splits) : std::vector<size_t>{});
    auto rc = std::make_shared<std::vector<size_t>>(split ? counts(out.tensor, r, output_splits) : std::vector<size_t>{});
    const size_t* scp = split ? sc->data() : nullptr;
    const size_t* rcp = split ? rc->data() : nullptr;
    size_t equal = split ? 0 : s.count / getSize();
    if (!split) {
      TORCH_CHECK_VALUE(s.count % getSize() == 0 && s.count == r.count, "gradwire: ", what, ": input and output must split evenly into ", getSize(), " blocks");
    }
    if (cuda) {
      check(lib().gradwire_gpu_alltoall(gpu(output), s.data, scp, r.data, rcp, equal, s.dtype, stream(output)));
      if (out.back) out.back();
      return cuda_work({output}, opts.asyncOp);
    }
    return run(
        opts.asyncOp, [&](gradwire_comm_t* c, gradwire_work_t** w) { return lib().gradwire_ialltoall(c, s.data, scp, r.data, rcp, equal, s.dtype, w); },
        [&](gradwire_comm_t* c) { return lib().gradwire_alltoall(c, s.data, scp, r.data, rcp, equal, s.dtype); }, {output}, {in, out.tensor},
        then([sc, rc] {}, out.back));
  }

  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllToAllOptions& opts) override {
    flush_p2p();
    const char* what = "all_to_all";
    TORCH_CHECK_VALUE(inputs.size() == static_cast<size_t>(getSize()) && outputs.size() == static_cast<size_t>(getSize()), "gradwire: ", what, " needs ", getSize(),
                      " input and output tensors");
    std::vector<at::Tensor> all(outputs);
    all.insert(all.end(), inputs.begin(), inputs.end());
    bool cuda = on_cuda(all, what);
    auto flat_in = flat_cat(inputs);
    int64_t total = 0;
    for (const auto& t : outputs) total += t.numel();
    auto flat_out = at::empty({total}, flat_in.options());
    auto s = moved(flat_in);
    auto r = moved(flat_out);
    size_t in_unit = s.count / std::max<int64_t>(flat_in.numel(), 1);
    size_t out_unit = r.count / std::max<int64_t>(total, 1);
    auto sc = std::make_shared<std::vector<size_t>>();
    auto rc = std::make_shared<std::vector<size_t>>();
    for (int p = 0; p < getSize(); ++p) {
      sc->push_back(inputs[p].numel() * in_unit);
      rc->push_back(outputs[p].numel() * out_unit);
    }
    auto back = [flat_out, outputs]() mutable { scatter_back(flat_out, outputs); };
    if (cuda) {
      check(lib().gradwire_gpu_alltoall(gpu(flat_in), s.data, sc->data(), r.data, rc->data(), 0, s.dtype, stream(flat_in)));
      back();
      return cuda_work(outputs, opts.asyncOp);
    }
    return run(
        opts.asyncOp, [&](gradwire_comm_t* c, gradwire_work_t** w) { return lib().gradwire_ialltoall(c, s.data, sc->data(), r.data, rc->data(), 0, s.dtype, w); },
        [&](gradwire_comm_t* c) { return lib().gradwire_alltoall(c, s.data, sc->data(), r.data, rc->data(), 0, s.dtype); }, outputs, {flat_in, flat_out},
        then([sc, rc] {}, back));
  }

  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    flush_p2p();
    // As ProcessGroupNCCL's: the work queued on this group's GPUs is done first.
    {
      std::lock_guard<std::mutex> lock(gpus_mutex_);
      for (auto& [index, gpu] : gpus_) {
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->synchronizeDevice(index);
      }
    }
    check(lib().gradwire_barrier(core_->live()));
    return done({});
  }

  // gloo's monitored barrier, through the group's store (where each rank's arrival is seen
  // on its own, whatever the others do): every rank checks in, rank 0 waits at most the
  // timeout in all and names the ranks that did not come (the first, or all with
  // `wait_all`), in gloo's words; then it releases the others, which wait as long for that.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all) override {
    flush_p2p();
    auto limit = opts.timeout.count() >= 0 ? opts.timeout : kTorchDefaultTimeout;  // kUnsetTimeout is negative
    auto deadline = Clock::now() + limit;
    int me = getRank();
    auto key = "gradwire/monitored_barrier/" + std::to_string(monitored_calls_++) + "/";
    store_->set(key + std::to_string(me), bytes_of("1"));
    auto ms = std::to_string(limit.count());
    if (me != 0) {
      auto failed = "[Rank " + std::to_string(me) + "]: Rank " + std::to_string(me) +
                    " successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0";
      try {
        store_->wait({key + "release"}, limit);
      } catch (const std::exception&) {
        TORCH_CHECK(false, failed, " (no answer within ", ms, " ms)");
      }
      TORCH_CHECK(text_of(store_->get(key + "release")) == "1", failed, " (rank 0 found ranks missing)");
      return;
    }
    std::vector<int> missing;
    for (int r = 1; r < getSize(); ++r) {
      auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now());
      if (left.count() <= 0 && !wait_all) {
        store_->set(key + "release", bytes_of("failed"));
        TORCH_CHECK(false, "[Rank 0]: Rank 0 timed out in monitoredBarrier after ", ms, " ms");
      }
      if (left.count() > 0) {
        try {
          store_->wait({key + std::to_string(r)}, left);
          continue;
        } catch (const std::exception&) {
        }
      }
      if (!store_->check({key + std::to_string(r)})) {
        missing.push_back(r);
        if (!wait_all) break;
      }
    }
    if (!missing.empty()) {
      std::string who = missing.size() == 1 ? "Rank " + std::to_string(missing[0]) : "Ranks ";
      for (size_t i = 0; missing.size() > 1 && i < missing.size(); ++i) {
        who += (i ? ", " : "") + std::to_string(missing[i]);
      }
      store_->set(key + "release", bytes_of("failed"));
      TORCH_CHECK(false, "[Rank 0]: ", who, " failed to pass monitoredBarrier in ", ms, " ms");
    }
    store_->set(key + "release", bytes_of("1"));
  }

  // --- point to point ------------------------------------------------------------------

  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return queue_p2p(tensors, dst, tag, GRADWIRE_P2P_SEND, "send");
  }

  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return queue_p2p(tensors, src, tag, GRADWIRE_P2P_RECV, "recv");
  }

  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& /*tensors*/, int /*tag*/) override {
    TORCH_CHECK(false, "gradwire: recv from any source is not supported (every message is matched to its sender): pass src");
  }

 private:
  int checked_root(int64_t root, const char* what) const {
    TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "gradwire: ", what, ": root ", root, " is not a rank (size ", getSize(), ")");
    return static_cast<int>(root);
  }

  static std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<at::Tensor> all;
    for (const auto& list : lists) all.insert(all.end(), list.begin(), list.end());
    return all;
  }

  c10::intrusive_ptr<Work> done(std::vector<at::Tensor> result) { return c10::make_intrusive<DoneWork>(std::move(result)); }

  // A call on CPU tensors: gradwire's blocking call (`blocking`) on this thread when torch
  // waits at once, else its non-blocking one (`nonblocking`), completed by the group's
  // completion thread. `then_` runs once it succeeded.
  template <typename NonBlocking, typename Blocking>
  c10::intrusive_ptr<Work> run(bool async, NonBlocking nonblocking, Blocking blocking, std::vector<at::Tensor> result,
                               std::vector<at::Tensor> keep, std::function<void()> then_) {
    if (!async) {
      check(blocking(core_->live()));
      if (then_) then_();
      return done(std::move(result));
    }
    return core_->start(nonblocking, std::move(result), std::move(keep), std::move(then_));
  }

  // The coalesced allreduce: the tensors (of one dtype) reduced as one.
  c10::intrusive_ptr<Work> coalesced(std::vector<at::Tensor>& tensors, const Op& op, bool async) {
    const char* what = "allreduce_coalesced";
    if (op.kind == Reduction::kBitwise) {
      return bitwise(tensors, op, -1, what, async);
    }
    if (tensors.empty()) {
      return done({});
    }
    bool cuda = on_cuda(tensors, what);
    for (const auto& t : tensors) {
      TORCH_CHECK_VALUE(t.scalar_type() == tensors[0].scalar_type(), "gradwire: ", what, " needs tensors of one dtype");
    }
    auto flat = flat_cat(tensors);
    auto e = reduced(flat, op, what);
    auto back = [flat, tensors]() mutable { scatter_back(flat, tensors); };
    if (cuda) {
      check(lib().gradwire_gpu_allreduce(gpu(flat), e.data, e.data, e.count, e.dtype, op.op, stream(flat)));
      back();
      return cuda_work(tensors, async);
    }
    return run(
        async, [&](gradwire_comm_t* c, gradwire_work_t** w) { return lib().gradwire_iallreduce(c, e.data, e.data, e.count, e.dtype, op.op, w); },
        [&](gradwire_comm_t* c) { return lib().gradwire_allreduce(c, e.data, e.data, e.count, e.dtype, op.op); }, tensors, {flat}, back);
  }

  // A bitwise reduction of each tensor over the ranks (into every rank's, or only `root`'s):
  // every rank's tensor gathered, then combined in rank order. gradwire's kernels and NCCL
  // have no bitwise reduction; these ops carry flags and masks, small tensors, where the
  // W-fold traffic of a gather costs nothing that matters.
  c10::intrusive_ptr<Work> bitwise(std::vector<at::Tensor>& tensors, const Op& op, int root, const char* what, bool async) {
    for (const auto& t : tensors) {
      TORCH_CHECK_VALUE(!t.is_floating_point() && !t.is_complex(), "gradwire: ", what, ": bitwise ops need integer or bool tensors, got ", t.scalar_type());
    }
    bool cuda = on_cuda(tensors, what);
    for (auto& t : tensors) {
      auto every = gather_all(t.contiguous(), what).view({getSize(), t.numel()});
      if (root < 0 || root == getRank()) {
        auto acc = every[0].clone();
        for (int r = 1; r < getSize(); ++r) {
          switch (op.bitwise) {
            case c10d::ReduceOp::BAND: acc.bitwise_and_(every[r]); break;
            case c10d::ReduceOp::BOR: acc.bitwise_or_(every[r]); break;
            default: acc.bitwise_xor_(every[r]); break;
          }
        }
        t.copy_(acc.view_as(t));
      }
    }
    return cuda ? cuda_work(tensors, async) : done(tensors);
  }

  // Every rank's `t` (contiguous) gathered, rank order, into a new flat tensor.
  at::Tensor gather_all(const at::Tensor& t, const char* what) {
    auto flat = at::empty({t.numel() * getSize()}, t.options());
    auto s = moved(t);
    auto r = moved(flat);
    if (t.is_cuda()) {
      check(lib().gradwire_gpu_allgather(gpu(t), s.data, r.data, s.count, s.dtype, stream(t)));
    } else {
      check(lib().gradwire_allgather(core_->live(), s.data, r.data, s.count, s.dtype));
    }
    (void)what;
    return flat;
  }

  // The tensor-coalesced forms (DTensor and FSDP call them) as one call per pair.
  template <typename Options, typename Single>
  c10::intrusive_ptr<Work> each_pair(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const Options& opts, const char* what,
                                     Single single) {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "gradwire: ", what, ": ", outputs.size(), " outputs for ", inputs.size(), " inputs");
    auto blocking = opts;
    blocking.asyncOp = false;
    for (size_t i = 0; i < outputs.size(); ++i) {
      single(outputs[i], inputs[i], blocking);
    }
    return !outputs.empty() && outputs[0].is_cuda() ? cuda_work(outputs, opts.asyncOp) : done(outputs);
  }

  // Whether gradwire refuses these buffers as they lie (shared other than in place as the
  // call allows: gradwire's rule, asked of it); the caller then copies, as gloo does.
  bool overlapping(unsigned int call, const at::Tensor& send, const at::Tensor& recv) {
    int layout = GRADWIRE_LAYOUT_OVERLAPPING;
    check(lib().gradwire_buffer_layout(core_->live(), call, send.data_ptr(), send.nbytes(), recv.data_ptr(), recv.nbytes(), &layout));
    return layout == GRADWIRE_LAYOUT_OVERLAPPING;
  }

  // --- CUDA ----------------------------------------------------------------------------

  // The GPU communicator of t's device, made (collectively) at its first call there.
  gradwire_gpu_comm_t* gpu(const at::Tensor& t) {
    auto index = t.device().index();
    std::lock_guard<std::mutex> lock(gpus_mutex_);
    auto it = gpus_.find(index);
    if (it != gpus_.end()) {
      return it->second;
    }
    gradwire_gpu_comm_t* gpu = nullptr;
    check(lib().gradwire_gpu_comm_create(core_->live(), index, &gpu));
    gpus_[index] = gpu;
    return gpu;
  }

  static void* stream(const at::Tensor& t) { return current_stream(t.device()).native_handle(); }

  // The work of a call queued on CUDA tensors: nothing left to do for a blocking call
  // (torch waits on the same stream), a CudaWork for an async one.
  c10::intrusive_ptr<Work> cuda_work(std::vector<at::Tensor> result, bool async) {
    if (!async || result.empty()) {
      return done(std::move(result));
    }
    auto device = result[0].device();
    return c10::make_intrusive<CudaWork>(std::move(result), device);
  }

  // --- point to point ------------------------------------------------------------------

  c10::intrusive_ptr<Work> queue_p2p(std::vector<at::Tensor>& tensors, int peer, int tag, unsigned int kind, const char* what) {
    TORCH_CHECK_VALUE(peer >= 0 && peer < getSize(), "gradwire: ", what, ": peer ", peer, " is not a rank (size ", getSize(), ")");
    TORCH_CHECK_VALUE(tag >= 0, "gradwire: ", what, ": tag ", tag, " is negative");
    for (const auto& t : tensors) {
      TORCH_CHECK_VALUE(t.device().is_cpu(), "gradwire: ", what, ": tensor on ", t.device(), "; sends and receives take CPU tensors");
    }
    std::vector<gradwire_p2p_op_t> ops;
    std::vector<at::Tensor> keep;
    std::function<void()> back;
    for (const auto& t : tensors) {
      auto d = dense(t);
      auto e = moved(d.tensor);
      ops.push_back(gradwire_p2p_op_t{kind, peer, static_cast<unsigned int>(tag), e.dtype, e.count, e.data});
      keep.push_back(d.tensor);
      if (kind == GRADWIRE_P2P_RECV) back = then(back, d.back);
    }
    sequence_.fetch_add(1);
    std::lock_guard<std::mutex> lock(p2p_mutex_);
    for (;;) {
      if (!open_ || open_->started()) {
        open_ = std::make_shared<P2PBatch>(core_);
      }
      if (open_->add(ops, keep, back)) {
        return c10::make_intrusive<P2PWork>(open_, tensors, peer);
      }
    }
  }

  // Starts the sends and receives issued so far, ahead of the call being made (gradwire runs
  // calls in the order they start).
  void flush_p2p() {
    sequence_.fetch_add(1);
    std::shared_ptr<P2PBatch> batch;
    {
      std::lock_guard<std::mutex> lock(p2p_mutex_);
      batch = std::move(open_);
    }
    if (batch) {
      batch->start();
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  Milliseconds timeout_;
  std::shared_ptr<Core> core_;
  std::mutex p2p_mutex_;
  std::shared_ptr<P2PBatch> open_;
  std::mutex gpus_mutex_;
  std::map<c10::DeviceIndex, gradwire_gpu_comm_t*> gpus_;
  uint64_t monitored_calls_ = 0;
  std::atomic<uint64_t> sequence_{0};
};

// The group torch is handed: torch's ProcessGroup with this backend for CPU and CUDA
// tensors, named "gradwire" where torch's C++ asks (DDP's logging; a group torch makes
// itself around a backend from outside torch says "custom").
class GradwireGroup : public c10d::ProcessGroup {
 public:
  GradwireGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Milliseconds timeout)
      : ProcessGroup(store, rank, size) {
    auto backend = c10::make_intrusive<GradwireBackend>(store, rank, size, timeout);
    setDefaultBackend(BackendType::CUSTOM);
    setBackend(c10::DeviceType::CPU, BackendType::CUSTOM, backend);
    setBackend(c10::DeviceType::CUDA, BackendType::CUSTOM, backend);
  }
  const std::string getBackendName() const override { return "gradwire"; }
};

// A torch Future that completes with `tensor` once gradwire's non-blocking in-place
// allreduce of it on the communicator at `comm` has (what a DDP communication hook
// returns: gradwire.ddp's hook over a communicator of the user's).
std::shared_ptr<torch::jit::PythonFutureWrapper> allreduce_future(uintptr_t comm, const at::Tensor& tensor, const std::string& op_name) {
  static const std::map<std::string, gradwire_op_t> ops{
      {"sum", GRADWIRE_SUM}, {"avg", GRADWIRE_AVG}, {"min", GRADWIRE_MIN}, {"max", GRADWIRE_MAX}, {"product", GRADWIRE_PRODUCT}};
  auto op = ops.find(op_name);
  TORCH_CHECK_VALUE(op != ops.end(), "gradwire: op ", op_name, " is not one of sum, avg, min, max, product");
  TORCH_CHECK_VALUE(tensor.device().is_cpu() && tensor.is_contiguous(), "gradwire: the allreduce hook takes contiguous CPU tensors");
  auto e = reduced(tensor, {Reduction::kGradwire, op->second, c10d::ReduceOp::SUM}, "allreduce");
  // One completion thread for every hook's futures (the communicator is the user's).
  static std::mutex mutex;
  static std::unique_ptr<Completer> completer;
  gradwire_work_t* handle = nullptr;
  {
    py::gil_scoped_release nogil;
    check(lib().gradwire_iallreduce(reinterpret_cast<gradwire_comm_t*>(comm), e.data, e.data, e.count, e.dtype, op->second, &handle));
  }
  auto work = c10::make_intrusive<AsyncWork>(std::vector<at::Tensor>{tensor}, std::vector<at::Tensor>{}, nullptr);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!completer) completer = std::make_unique<Completer>();
    completer->push(handle, work);
  }
  return std::make_shared<torch::jit::PythonFutureWrapper>(work->getFuture());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("load_library", &load_library, py::arg("path"), "Looks up gradwire's C calls in the library at `path` (the one the Python binding loaded).");
  py::class_<GradwireBackend, c10d::Backend, c10::intrusive_ptr<GradwireBackend>>(m, "GradwireBackend")
      .def_property_readonly("comm_address", &GradwireBackend::comm_address);
  py::class_<GradwireGroup, c10d::ProcessGroup, c10::intrusive_ptr<GradwireGroup>>(m, "GradwireGroup")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, Milliseconds>(), py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout"), py::call_guard<py::gil_scoped_release>());
  m.def("allreduce_future", &allreduce_future, py::arg("comm"), py::arg("tensor"), py::arg("op"));
}
