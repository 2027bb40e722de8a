#include "data/dataloader.h"

#include <cstring>
#include <exception>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "nn/error.h"

namespace tandem::data {
namespace {

// Stacks `parts` (same shape and dtype, host) into (B, ...).
nn::Tensor Stack(const std::vector<nn::Tensor>& parts, const std::vector<int64_t>& indices,
                 const char* what, bool pinned) {
  const nn::Tensor& first = parts.front();
  TANDEM_CHECK(first.defined(), "sample ", indices.front(), ": undefined ", what);
  nn::Shape shape = first.shape();
  shape.insert(shape.begin(), static_cast<int64_t>(parts.size()));
  nn::Tensor out =
      nn::empty(shape, {.dtype = first.dtype(), .device = nn::Device::CPU(), .pinned = pinned});
  const int64_t bytes = first.nbytes();
  char* dst = static_cast<char*>(out.host_ptr());
  for (size_t k = 0; k < parts.size(); ++k) {
    const nn::Tensor& t = parts[k];
    TANDEM_CHECK(t.defined(), "sample ", indices[k], ": undefined ", what);
    TANDEM_CHECK(t.shape() == first.shape() && t.dtype() == first.dtype(), "sample ", indices[k],
                 ": ", what, " ", t.ToString(), " does not match the batch's first ", what, " ",
                 first.ToString());
    TANDEM_CHECK(t.device().is_cpu(), "sample ", indices[k], ": ", what, " is on ",
                 t.device().ToString(), "; datasets must return host tensors");
    if (bytes > 0) std::memcpy(dst + k * bytes, t.host_ptr(), static_cast<size_t>(bytes));
  }
  return out;
}

}  // namespace

Batch Collate(const std::vector<Example>& examples, const std::vector<int64_t>& indices,
              bool pinned) {
  TANDEM_CHECK(!examples.empty() && examples.size() == indices.size(),
               "Collate: ", examples.size(), " examples for ", indices.size(), " indices");
  std::vector<nn::Tensor> data, targets;
  data.reserve(examples.size());
  targets.reserve(examples.size());
  for (const Example& e : examples) {
    data.push_back(e.data);
    targets.push_back(e.target);
  }
  return {Stack(data, indices, "data", pinned), Stack(targets, indices, "target", pinned), indices};
}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<BatchSampler> sampler,
                       DataLoaderOptions options)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), options_(options) {
  TANDEM_CHECK(dataset_ != nullptr && sampler_ != nullptr, "DataLoader: null dataset or sampler");
  TANDEM_CHECK(options_.num_workers >= 0, "DataLoader: num_workers ", options_.num_workers, " < 0");
  TANDEM_CHECK(options_.prefetch >= 1, "DataLoader: prefetch ", options_.prefetch, " must be >= 1");
  // pin_memory matters only for copies to a GPU; with a CPU device (or none) it
  // is a no-op (see the header).
  pin_ = options_.pin_memory && options_.device && options_.device->is_cuda();
  if (pin_) {
    // nn decides whether pinned memory can be had (an empty pinned tensor
    // allocates nothing); here its reason only gets the loader's context.
    try {
      nn::empty({0}, {.device = nn::Device::CPU(), .pinned = true});
    } catch (const Error& e) {
      Fail("DataLoader: pin_memory with device ", options_.device->ToString(), ": ", e.what());
    }
  }
  options_.prefetch = std::max(options_.prefetch, options_.num_workers);
}

DataLoader::~DataLoader() { StopWorkers(); }

DataLoader::Result DataLoader::Build(const std::vector<int64_t>& indices, int64_t epoch) const {
  Result result;
  int64_t current = -1;
  try {
    std::vector<Example> examples;
    examples.reserve(indices.size());
    for (int64_t index : indices) {
      if (cancel_.load(std::memory_order_relaxed)) return result;
      current = index;
      examples.push_back(dataset_->get_in_epoch(index, epoch));
    }
    current = -1;
    result.batch = Collate(examples, indices, pin_);
    if (options_.batch_transform) {
      nn::Generator unused{};
      result.batch->data = (*options_.batch_transform)(result.batch->data, unused);
      if (pin_) result.batch->data = result.batch->data.pin_memory();
    }
  } catch (const std::exception& e) {
    // Collate names the sample itself; a dataset error gets the index here.
    result.error = std::make_exception_ptr(Error(
        current >= 0 ? absl::StrCat("DataLoader: sample ", current, ": ", e.what())
                     : absl::StrCat("DataLoader: ", e.what())));
  } catch (...) {
    result.error = std::make_exception_ptr(
        Error(absl::StrCat("DataLoader: sample ", current, ": unknown exception")));
  }
  return result;
}

void DataLoader::WorkerLoop() {
  // A worker touches CUDA only through the pinned host cache (cudaHostAlloc,
  // cudaEventQuery); with the loader's device current it never creates a
  // context on GPU 0, the runtime's default. Its current_device() stays the
  // CPU, so datasets still make host tensors.
  // If selecting the device fails, every batch this worker takes fails with the
  // reason: a worker that left after one batch would leave the later batches
  // of the queue to no one (every worker fails alike), and next() would wait
  // for them for good.
  std::exception_ptr device_error;
  if (pin_) {
    try {
      nn::SetThreadCudaDevice(*options_.device);
    } catch (const std::exception& e) {
      device_error = std::make_exception_ptr(Error(
          absl::StrCat("DataLoader: worker on ", options_.device->ToString(), ": ", e.what())));
    }
  }
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (stop_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    Result result;
    if (device_error) {
      result.error = device_error;
    } else {
      result = Build(task.indices, task.epoch);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      results_.emplace(task.sequence, std::move(result));
    }
    result_cv_.notify_all();
  }
}

void DataLoader::StopWorkers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cancel_.store(true);
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
  std::lock_guard<std::mutex> lock(mu_);
  tasks_.clear();
  results_.clear();
}

void DataLoader::StartWorkers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
  }
  cancel_.store(false);
  for (int i = 0; i < options_.num_workers; ++i) {
    try {
      workers_.emplace_back([this] { WorkerLoop(); });
    } catch (const std::system_error& e) {
      // The system's thread limit or memory for stacks: name the count, not
      // only errno's text ("Resource temporarily unavailable").
      // No pass is running: the next next() starts the same pass again (and
      // fails alike) rather than waiting for batches no worker would build.
      StopWorkers();
      sampler_->set_state(pass_start_);
      started_ = false;
      ::tandem::Fail("DataLoader: num_workers ", options_.num_workers,
                     ": could not start worker thread ", i + 1, ": ", e.what(),
                     " (too many threads for this system: use fewer workers)");
    }
  }
}

void DataLoader::start_epoch() {
  StopWorkers();
  sampler_->reset();
  pass_start_ = sampler_->get_state();
  started_ = true;
  ended_ = false;
  sampler_done_ = false;
  dispatched_ = 0;
  delivered_ = 0;
  StartWorkers();
}

void DataLoader::Dispatch() {
  int added = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!sampler_done_ && dispatched_ - delivered_ < options_.prefetch) {
      std::optional<std::vector<int64_t>> indices = sampler_->next();
      if (!indices) {
        sampler_done_ = true;
        break;
      }
      tasks_.push_back({dispatched_++, std::move(*indices), pass_start_.epoch});
      ++added;
    }
  }
  if (added > 0) work_cv_.notify_all();
}

Batch DataLoader::ToDevice(Batch batch) const {
  if (options_.device && *options_.device != nn::Device::CPU()) {
    batch.data = batch.data.to(*options_.device);
    batch.target = batch.target.to(*options_.device);
  }
  return batch;
}

std::optional<Batch> DataLoader::next() {
  if (!started_) start_epoch();
  if (ended_) return std::nullopt;
  Result result;
  if (options_.num_workers == 0) {
    std::optional<std::vector<int64_t>> indices = sampler_->next();
    if (!indices) {
      ended_ = true;
      return std::nullopt;
    }
    ++dispatched_;
    result = Build(*indices, pass_start_.epoch);
  } else {
    Dispatch();
    if (sampler_done_ && delivered_ == dispatched_) {
      ended_ = true;
      return std::nullopt;
    }
    std::unique_lock<std::mutex> lock(mu_);
    result_cv_.wait(lock, [&] { return results_.count(delivered_) > 0; });
    auto it = results_.find(delivered_);
    result = std::move(it->second);
    results_.erase(it);
  }
  ++delivered_;
  if (result.error) {
    // The pass cannot go on in order past a failed batch.
    ended_ = true;
    std::rethrow_exception(result.error);
  }
  return ToDevice(std::move(*result.batch));
}

SamplerState DataLoader::get_state() const {
  if (!started_) return sampler_->get_state();
  SamplerState state{pass_start_.epoch, pass_start_.position + delivered_};
  if (state.position >= sampler_->num_batches()) state = {state.epoch + 1, 0};
  return state;
}

void DataLoader::set_state(const SamplerState& state) {
  StopWorkers();
  sampler_->set_state(state);
  started_ = false;
  ended_ = false;
}

}  // namespace tandem::data
