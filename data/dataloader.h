// DataLoader: turns a Dataset and a BatchSampler into batches of stacked tensors,
// produced by worker threads ahead of the caller.
//
//   DataLoader loader(dataset, sampler, {.num_workers = 2, .prefetch = 4});
//   for (int epoch = 0; epoch < 3; ++epoch)
//     for (const Batch& batch : loader) { ... batch.data, batch.target ... }
//
// Order: batches come out in the sampler's order whatever the number of workers.
// At most `prefetch` batches are in flight (queued, being built, or finished but
// not yet taken). With num_workers = 0 the caller builds each batch itself.
//
// Collation: example data (and targets) must share shape and dtype; batch.data
// is (B, ...) stacked along a new first dimension, batch.target likewise (a 0-dim
// label per example gives targets (B)).
//
// Device: with options.device set, each batch is copied there by the caller
// (Tensor::to, on the caller's stream for CUDA).
// pin_memory: with a CUDA options.device, the workers (or the caller, with
// num_workers = 0) collate straight into pinned host memory, and the caller's
// copy to the device is asynchronous (no host wait: the batch arrives on the
// caller's stream before any op enqueued after next() reads it). The pinned
// blocks come from nn's process-wide cache and are reused once their copy is
// done. If tandem was built without CUDA or sees no GPU, a CUDA device with
// pin_memory throws tandem::Error from the constructor. With a CPU device or no
// device, pin_memory is a documented no-op: batches stay in ordinary host
// memory (pinning only speeds up copies to a GPU). The workers, which reach
// CUDA only through the pinned cache (cudaHostAlloc, cudaEventQuery), select
// the loader's device for the CUDA runtime first (nn::SetThreadCudaDevice:
// their current_device() stays the CPU), so that they never create a context
// on GPU 0 when the loader's device is another GPU; if selecting it fails, the
// batches that worker takes fail with the reason.
//
// Epochs: each example is read with Dataset::get_in_epoch(index, e), e the
// pass's epoch (the sampler's), so random per-example draws change per epoch.
//
// Errors: an exception while loading or collating sample i (in a worker or in the
// caller) is rethrown from next() as tandem::Error "DataLoader: sample i: <message>"
// when its batch's turn comes.
//
// Lifetime: destroying the loader (or starting a new epoch) mid-epoch stops its
// workers after their current sample and joins them.
// Thread-safety: one loader is driven by one thread; the dataset's
// get_in_epoch() is called from the workers concurrently.
#ifndef TANDEM_DATA_DATALOADER_H_
#define TANDEM_DATA_DATALOADER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "data/dataset.h"
#include "data/sampler.h"
#include "nn/device.h"
#include "nn/tensor.h"

namespace tandem::data {

struct Batch {
  nn::Tensor data;    // (B, ...) on options.device
  nn::Tensor target;  // (B, ...) on options.device
  std::vector<int64_t> indices;  // dataset indices of the B examples
};

struct DataLoaderOptions {
  int num_workers = 0;
  int prefetch = 2;  // batches in flight; raised to num_workers when smaller
  bool pin_memory = false;  // see the file comment
  std::optional<nn::Device> device;  // unset: batches stay on the host
  // Applied to each collated batch.data (B, ...) on the host, where the batch is
  // built (a worker, or the caller with num_workers = 0), before the device copy:
  // e.g. data::ToFloatNormalize, so a dataset kept in uint8 is converted per
  // batch. Must be deterministic (it gets a generator it should not draw from).
  // With pin_memory its result is moved to pinned memory if it is not there.
  std::shared_ptr<const Transform> batch_transform;
};

// Stacks examples into a batch (see the file comment), in pinned host memory
// when `pinned` (nn::TensorOptions::pinned; throws where there is none). Throws
// tandem::Error on mismatched shapes or dtypes, naming the offending sample.
Batch Collate(const std::vector<Example>& examples, const std::vector<int64_t>& indices,
              bool pinned = false);

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<BatchSampler> sampler,
             DataLoaderOptions options = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Starts a pass (sampler->reset()), abandoning any unfinished one.
  void start_epoch();
  // The next batch of the pass (starting one if none is running), or nullopt at its end.
  std::optional<Batch> next();
  int64_t num_batches() const { return sampler_->num_batches(); }

  // (epoch, batches handed to the caller in it), for checkpoints. Batches
  // prefetched but not yet taken do not count.
  SamplerState get_state() const;
  // Resumes at `state` with the next start_epoch() / begin().
  void set_state(const SamplerState& state);

  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Iterator() = default;
    explicit Iterator(DataLoader* loader) : loader_(loader) { ++*this; }
    const Batch& operator*() const { return *batch_; }
    const Batch* operator->() const { return &*batch_; }
    Iterator& operator++() {
      batch_ = loader_->next();
      return *this;
    }
    bool operator==(const Iterator& other) const { return !batch_ && !other.batch_; }

   private:
    DataLoader* loader_ = nullptr;
    std::optional<Batch> batch_;
  };
  // Starts a new pass and iterates it.
  Iterator begin() {
    start_epoch();
    return Iterator(this);
  }
  Iterator end() { return Iterator(); }

 private:
  struct Task {
    int64_t sequence;
    std::vector<int64_t> indices;
    int64_t epoch;  // the pass's, for Dataset::get_in_epoch
  };
  struct Result {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };

  // Builds one batch on the calling thread; errors are captured, not thrown.
  // Gives up (empty result) once `cancel_` is set.
  Result Build(const std::vector<int64_t>& indices, int64_t epoch) const;
  void WorkerLoop();
  // Hands sampler batches to the workers until `prefetch` are in flight.
  void Dispatch();
  void StopWorkers();
  void StartWorkers();
  Batch ToDevice(Batch batch) const;

  std::shared_ptr<const Dataset> dataset_;
  std::shared_ptr<BatchSampler> sampler_;
  DataLoaderOptions options_;
  bool pin_ = false;           // collate into pinned memory (pin_memory and a CUDA device)
  bool started_ = false;       // a pass has begun since construction / set_state
  bool ended_ = false;         // the current pass has delivered its last batch
  bool sampler_done_ = false;  // the sampler has no more batches this pass
  int64_t dispatched_ = 0;     // sequence numbers handed out this pass
  int64_t delivered_ = 0;      // batches returned to the caller this pass
  SamplerState pass_start_;    // the sampler's state when the pass began

  std::mutex mu_;
  std::condition_variable work_cv_;    // workers wait for tasks or stop
  std::condition_variable result_cv_;  // the caller waits for results
  std::deque<Task> tasks_;             // guarded by mu_
  std::map<int64_t, Result> results_;  // by sequence; guarded by mu_
  bool stop_ = false;                  // guarded by mu_
  std::atomic<bool> cancel_{false};    // workers abandon their current batch
  std::vector<std::thread> workers_;
};

}  // namespace tandem::data

#endif  // TANDEM_DATA_DATALOADER_H_
