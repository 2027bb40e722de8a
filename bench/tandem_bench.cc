// tandem_bench: times training steps of the MLP, the LeNet and the ConvNet of
// apps/models.h on device-resident synthetic data, for PyTorch comparisons
// (the PyTorch side is bench/torch_bench.py, the driver that
// runs both and prints ratios is bench/compare.py).
//
//   tandem_bench --device=cpu --models=mlp --batch_sizes=32 --json=/tmp/b.json
//   tandem_bench --device=cuda:0 --tf32 --export_dir=/tmp/x   # then torch_bench.py
//
// For every cell (model x batch size x optimizer):
//  1. the model gets its initial weights (the same for every cell of a model:
//     seeded init, or --import_dir) and a fresh optimizer;
//  2. the first 10 steps run with the loss read after each (not timed): these
//     losses are what the PyTorch side must reproduce from the same weights;
//  3. --repetitions times: --warmup_steps steps, a device sync (reading the last
//     loss), the clock, --steps steps, a sync, the clock. One host read per
//     repetition, none per step; each step slices its batch from tensors
//     created on the device once (10 batches, cycled).
// Reported per cell: median / min / max microseconds per step over the
// repetitions, every repetition's value, samples/s at the median, the first
// losses; plus the configuration and the machine (JSON with --json).
//
// Exit statuses: 0 ok, 1 a failure during the run, 2 a bad flag value (one line
// naming the flag and the value).
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/exchange.h"
#include "bench/json_writer.h"
#include "apps/flag_check.h"
#include "apps/models.h"
#include "nn/graph.h"
#include "nn/nn.h"
#include "optim/adam.h"
#include "optim/sgd.h"

#if TANDEM_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

// OpenBLAS's build description, for the report (threads: nn::cpu_blas_threads).
extern "C" {
char* openblas_get_config(void);
}

ABSL_FLAG(std::string, device, "cpu", "Where to run: cpu, cuda or cuda:N.");
ABSL_FLAG(std::string, models, "mlp,lenet,convnet",
          "Comma-separated models: mlp (784-512-10), lenet (train_mnist's), convnet "
          "(train_cifar10's), mobilenet_v2 (train_cifar10 --model=mobilenet_v2's, dropout 0), "
          "resnet18, resnet50 (torchvision's, 10 classes, ImageNet stem, 3x32x32 inputs), "
          "resnet50_imagenet (torchvision's ResNet-50 on its benchmark shape: 1000 classes, "
          "3x224x224 inputs).");
ABSL_FLAG(std::string, batch_sizes, "32,128,512", "Comma-separated batch sizes (each >= 1).");
ABSL_FLAG(std::string, optimizers, "sgd,adam",
          "Comma-separated optimizers: sgd (plain, lr 0.01) and/or adam (lr 1e-3, betas "
          "(0.9, 0.999), eps 1e-8).");
ABSL_FLAG(std::string, warmup_steps, "5", "Untimed steps before each repetition (>= 0).");
ABSL_FLAG(std::string, steps, "20", "Timed steps per repetition (>= 1).");
ABSL_FLAG(std::string, data_batches, "10",
          "Batches of synthetic data per model (>= 1), cycled by the steps: the device holds "
          "data_batches x the largest batch images (resnet50_imagenet at batch 256: 10 take "
          "1.5 GB, and as much again in --export_dir).");
ABSL_FLAG(std::string, repetitions, "5",
          "Repetitions per cell (>= 5); the median of their microseconds per step is "
          "reported.");
ABSL_FLAG(bool, tf32, false,
          "Let float32 matmuls and convolutions on CUDA use TF32 tensor cores (no effect "
          "on the CPU).");
ABSL_FLAG(bool, bf16, false,
          "bfloat16 mixed precision: forward and loss under nn::AutocastGuard(kBFloat16) "
          "(nn/autocast.h): GEMMs and convolutions on bfloat16 operands with float32 "
          "accumulation, float32 parameters, gradients and optimizer (torch.autocast's "
          "contract).");
ABSL_FLAG(bool, cuda_graph, false,
          "CUDA only: run step 0 eagerly, capture one training step with nn::CudaGraph "
          "(nn/graph.h) and replay it for every later step, the batch copied into static "
          "input tensors first. The graph's node count is reported.");
ABSL_FLAG(std::string, json, "", "When set, the report is written to this JSON file.");
ABSL_FLAG(std::string, export_dir, "",
          "When set, each model's initial weights, the data and the first 10 losses of "
          "every cell are written there (layout in bench/exchange.h) for "
          "bench/torch_bench.py.");
ABSL_FLAG(std::string, import_dir, "",
          "When set, the initial weights and the data are read from this exchange "
          "directory instead of being generated from --seed.");
ABSL_FLAG(std::string, threads, "0",
          "OpenBLAS threads for CPU matmuls and convolutions (0: OpenBLAS's default, "
          "OPENBLAS_NUM_THREADS or the core count). Recorded in the report.");
ABSL_FLAG(std::string, seed, "0", "Seed of the initial weights and the synthetic data.");
ABSL_FLAG(bool, list_devices, false,
          "Print {\"cuda_built\": .., \"cuda_devices\": N} on one line and exit 0 (the "
          "driver's probe).");

namespace {

namespace nn = ::tandem::nn;
namespace optim = ::tandem::optim;
namespace apps = ::tandem::apps;
using apps::bench::JsonWriter;

constexpr char kProgram[] = "tandem_bench";
constexpr int kExitFailure = 1;
constexpr int kExitBadFlag = 2;
constexpr int64_t kLossSteps = 10;    // losses recorded and compared per cell

// The optimizers' hyper-parameters: torch_bench.py reads them from the manifest.
constexpr double kSgdLr = 0.01;
constexpr double kAdamLr = 1e-3, kAdamBeta1 = 0.9, kAdamBeta2 = 0.999, kAdamEps = 1e-8;

[[noreturn]] void FlagError(const std::string& message) {
  std::cerr << kProgram << ": error: " << message << "\n";
  std::exit(kExitBadFlag);
}

struct ModelSpec {
  std::string name;
  std::function<std::shared_ptr<nn::Module>()> make;
  nn::Shape input;  // one example: (C, H, W)
  const char* description;
  int64_t classes = 10;
};

const std::vector<ModelSpec>& AllModels() {
  static const auto* models = new std::vector<ModelSpec>{
      {"mlp", apps::MakeMlp, {1, 28, 28}, "flatten, fc(784->512)+ReLU, fc(512->10)"},
      {"lenet", apps::MakeLeNet, {1, 28, 28},
       "conv5x5(20,pad2)+ReLU, maxpool2, conv5x5(20,pad2)+ReLU, maxpool2, fc(980->10)"},
      {"convnet", apps::MakeConvNet, {3, 32, 32},
       "conv3x3(32)+ReLU, maxpool2, conv3x3(64)+ReLU, maxpool2, conv3x3(64)+ReLU, "
       "fc(1024->64)+ReLU, fc(64->10)"},
      {"mobilenet_v2", [] { return apps::MakeMobileNetV2(/*dropout=*/0.0); }, {3, 32, 32},
       "torchvision's MobileNetV2 (width 1.0, 10 classes, BatchNorm in training mode), "
       "classifier Dropout p=0 so that both sides compute the same losses"},
      // The ImageNet stem on CIFAR-sized inputs (layer4 at 1x1), as for
      // mobilenet_v2: a step with many small kernels, where host time shows.
      {"resnet18", [] { return apps::MakeResNet18({.num_classes = 10}); }, {3, 32, 32},
       "torchvision's ResNet-18 (10 classes, conv1 7x7 stride 2 + maxpool, BatchNorm in "
       "training mode)"},
      {"resnet50", [] { return apps::MakeResNet50({.num_classes = 10}); }, {3, 32, 32},
       "torchvision's ResNet-50 (10 classes, conv1 7x7 stride 2 + maxpool, BatchNorm in "
       "training mode)"},
      // The shape of the published ResNet-50 training throughputs (ImageNet:
      // 224x224 crops, 1000 classes): a device-bound step of large convolutions.
      {"resnet50_imagenet", [] { return apps::MakeResNet50({.num_classes = 1000}); },
       {3, 224, 224},
       "torchvision's ResNet-50 (1000 classes, 3x224x224 inputs, BatchNorm in training mode)",
       1000},
  };
  return *models;
}

struct Config {
  nn::Device device;
  std::vector<const ModelSpec*> models;
  std::vector<int64_t> batch_sizes;
  std::vector<std::string> optimizers;
  int64_t warmup_steps = 0, steps = 0, repetitions = 0;
  int64_t data_batches = 0;  // batches of data per model, cycled by the steps
  bool tf32 = false;
  bool bf16 = false;
  bool cuda_graph = false;
  int threads = 0;  // as requested; 0: OpenBLAS's default
  uint64_t seed = 0;
  std::string json, export_dir, import_dir;
};

int64_t ParseInt(const std::string& flag, const std::string& text, int64_t min) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    FlagError(absl::StrCat("--", flag, "=", text, ": not an integer"));
  }
  if (value < min) FlagError(absl::StrCat("--", flag, "=", text, ": must be >= ", min));
  return value;
}

std::vector<std::string> SplitList(const std::string& flag, const std::string& text) {
  std::vector<std::string> items = absl::StrSplit(text, ',', absl::SkipWhitespace());
  if (items.empty()) FlagError(absl::StrCat("--", flag, "=", text, ": empty list"));
  for (const std::string& item : items) {
    if (std::count(items.begin(), items.end(), item) > 1) {
      FlagError(absl::StrCat("--", flag, "=", text, ": \"", item, "\" is listed twice"));
    }
  }
  return items;
}

// --device, checked against the CUDA devices this process sees.
nn::Device ParseDeviceFlag(const std::string& device_text) {
  absl::StatusOr<nn::Device> device = nn::ParseDevice(device_text);
  if (!device.ok()) FlagError(absl::StrCat("--device=", device_text, ": ", device.status().message()));
  if (device->is_cuda()) {
    const int count = nn::cuda_device_count();
    if (!nn::cuda_built()) {
      FlagError(absl::StrCat("--device=", device_text, ": this binary was built without CUDA"));
    }
    if (device->index >= count) {
      FlagError(absl::StrCat("--device=", device_text, ": ", count,
                             " CUDA device(s) visible to this process"));
    }
  }
  return *device;
}

// The cells' axes: --models, --batch_sizes, --optimizers.
void ParseCellLists(Config& c) {
  const std::string models_text = absl::GetFlag(FLAGS_models);
  for (const std::string& name : SplitList("models", models_text)) {
    const ModelSpec* found = nullptr;
    for (const ModelSpec& spec : AllModels()) {
      if (spec.name == name) found = &spec;
    }
    if (found == nullptr) {
      FlagError(absl::StrCat("--models=", models_text, ": unknown model \"", name,
                             "\" (mlp, lenet, convnet, mobilenet_v2, resnet18, resnet50, "
                             "resnet50_imagenet)"));
    }
    c.models.push_back(found);
  }
  const std::string batches_text = absl::GetFlag(FLAGS_batch_sizes);
  for (const std::string& b : SplitList("batch_sizes", batches_text)) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(b, &value) || value < 1) {
      FlagError(absl::StrCat("--batch_sizes=", batches_text, ": \"", b,
                             "\" is not an integer >= 1"));
    }
    c.batch_sizes.push_back(value);
  }
  const std::string optimizers_text = absl::GetFlag(FLAGS_optimizers);
  for (const std::string& name : SplitList("optimizers", optimizers_text)) {
    if (name != "sgd" && name != "adam") {
      FlagError(absl::StrCat("--optimizers=", optimizers_text, ": unknown optimizer \"", name,
                             "\" (sgd, adam)"));
    }
    c.optimizers.push_back(name);
  }
}

// --json, --export_dir, --import_dir: present, creatable, writable, distinct.
void ParseFileFlags(Config& c) {
  c.json = absl::GetFlag(FLAGS_json);
  c.export_dir = absl::GetFlag(FLAGS_export_dir);
  c.import_dir = absl::GetFlag(FLAGS_import_dir);
  namespace fs = std::filesystem;
  if (!c.import_dir.empty() && !fs::is_directory(c.import_dir)) {
    FlagError(absl::StrCat("--import_dir=", c.import_dir, ": not a directory"));
  }
  if (!c.export_dir.empty()) {
    std::error_code ec;
    fs::create_directories(c.export_dir, ec);
    if (ec || !fs::is_directory(c.export_dir)) {
      FlagError(absl::StrCat("--export_dir=", c.export_dir, ": cannot create it",
                             ec ? absl::StrCat(" (", ec.message(), ")") : ""));
    }
    if (!c.import_dir.empty() && fs::equivalent(c.export_dir, c.import_dir, ec)) {
      FlagError(absl::StrCat("--export_dir=", c.export_dir,
                             ": the same directory as --import_dir (it would be overwritten "
                             "while read)"));
    }
  }
  if (!c.json.empty()) {
    std::ofstream probe(c.json, std::ios::app);
    if (!probe) FlagError(absl::StrCat("--json=", c.json, ": cannot open it for writing"));
  }
}

Config ParseConfig() {
  Config c;
  const std::string device_text = absl::GetFlag(FLAGS_device);
  c.device = ParseDeviceFlag(device_text);
  ParseCellLists(c);
  c.warmup_steps = ParseInt("warmup_steps", absl::GetFlag(FLAGS_warmup_steps), 0);
  c.steps = ParseInt("steps", absl::GetFlag(FLAGS_steps), 1);
  c.data_batches = ParseInt("data_batches", absl::GetFlag(FLAGS_data_batches), 1);
  c.repetitions = ParseInt("repetitions", absl::GetFlag(FLAGS_repetitions), 5);
  c.threads = static_cast<int>(ParseInt("threads", absl::GetFlag(FLAGS_threads), 0));
  if (c.threads > 1024) FlagError(absl::StrCat("--threads=", c.threads, ": must be <= 1024"));
  const std::string seed_text = absl::GetFlag(FLAGS_seed);
  if (!absl::SimpleAtoi(seed_text, &c.seed)) {
    FlagError(absl::StrCat("--seed=", seed_text, ": not a non-negative integer"));
  }
  c.tf32 = absl::GetFlag(FLAGS_tf32);
  c.bf16 = absl::GetFlag(FLAGS_bf16);
  c.cuda_graph = absl::GetFlag(FLAGS_cuda_graph);
  if (c.cuda_graph && !c.device.is_cuda()) {
    FlagError(absl::StrCat("--cuda_graph: needs a CUDA device, but --device=", device_text));
  }
  ParseFileFlags(c);
  return c;
}

// --- Data and models -------------------------------------------------------------

struct Data {
  nn::Tensor images;  // (N, C, H, W) float32, on the device
  nn::Tensor labels;  // (N) int64 in [0, spec.classes), on the device
};

// N = --data_batches x the largest batch: standard normal images, uniform labels, drawn on
// the CPU from (seed, stream 1) and copied to the device once. The same for
// models with the same input shape.
Data MakeData(const ModelSpec& spec, int64_t n, uint64_t seed, nn::Device device) {
  nn::manual_seed(seed, 1);
  nn::Shape shape{n};
  shape.insert(shape.end(), spec.input.begin(), spec.input.end());
  const nn::TensorOptions cpu{.device = nn::Device::CPU()};
  nn::Tensor images = nn::randn(shape, cpu);
  const std::vector<float> u = nn::rand({n}, cpu).to_vector<float>();
  std::vector<int64_t> labels(n);
  for (int64_t i = 0; i < n; ++i) {
    labels[i] = std::min<int64_t>(spec.classes - 1,
                                  static_cast<int64_t>(u[i] * static_cast<float>(spec.classes)));
  }
  return {images.to(device),
          nn::from_vector<int64_t>(labels, {n}, {.dtype = nn::kInt64, .device = device})};
}

absl::StatusOr<Data> ImportData(const ModelSpec& spec, const std::string& dir, int64_t n_min,
                                int64_t data_batches, nn::Device device) {
  const std::string base = absl::StrCat(dir, "/", spec.name, "/");
  absl::StatusOr<nn::Tensor> images = apps::bench::ReadRawRows(base + "images.bin", spec.input,
                                                               nn::kFloat32);
  if (!images.ok()) return images.status();
  const int64_t n = images->size(0);
  if (n < n_min) {
    return absl::InvalidArgumentError(absl::StrCat(base, "images.bin: ", n, " images, but ",
                                                   data_batches, " batches of the largest batch "
                                                   "size need ", n_min));
  }
  absl::StatusOr<nn::Tensor> labels = apps::bench::ReadRawTensor(base + "labels.bin", {n}, nn::kInt64);
  if (!labels.ok()) return labels.status();
  for (int64_t label : labels->to_vector<int64_t>()) {
    if (label < 0 || label >= spec.classes) {
      return absl::InvalidArgumentError(absl::StrCat(base, "labels.bin: label ", label,
                                                     " is outside [0, ", spec.classes, ")"));
    }
  }
  return Data{images->to(device), labels->to(device)};
}

// Copies of the module's parameters and buffers (not views of them).
nn::StateDict Snapshot(const nn::Module& model) {
  nn::StateDict copy;
  for (const auto& [name, tensor] : model.state_dict()) copy.emplace_back(name, tensor.clone());
  return copy;
}

absl::Status ExportModel(const ModelSpec& spec, const std::string& dir, const nn::Module& model,
                         const Data& data) {
  const std::string base = absl::StrCat(dir, "/", spec.name);
  std::error_code ec;
  std::filesystem::create_directories(base, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", base, ": ", ec.message()));
  for (const auto& [name, tensor] : model.state_dict()) {
    absl::Status s = apps::bench::WriteRawTensor(absl::StrCat(base, "/", name, ".bin"), tensor);
    if (!s.ok()) return s;
  }
  absl::Status s = apps::bench::WriteRawTensor(base + "/images.bin", data.images);
  if (!s.ok()) return s;
  return apps::bench::WriteRawTensor(base + "/labels.bin", data.labels);
}

std::unique_ptr<optim::Optimizer> MakeOptimizer(const std::string& name,
                                                std::vector<nn::Tensor> params) {
  if (name == "sgd") return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = kSgdLr});
  return std::make_unique<optim::Adam>(
      std::move(params),
      optim::AdamOptions{.lr = kAdamLr, .betas = {kAdamBeta1, kAdamBeta2}, .eps = kAdamEps});
}

// --- One cell ---------------------------------------------------------------------

struct Cell {
  std::string model, optimizer;
  int64_t batch = 0;
  std::vector<double> losses;  // the first kLossSteps
  std::vector<double> rep_us;  // microseconds per step, per repetition
  double median_us = 0, min_us = 0, max_us = 0, samples_per_s = 0;
  int64_t graph_nodes = -1;  // with --cuda_graph
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Cell RunCell(const Config& config, const ModelSpec& spec, nn::Module& model,
             const nn::StateDict& initial, const Data& data, int64_t batch,
             const std::string& optimizer_name) {
  Cell cell{.model = spec.name, .optimizer = optimizer_name, .batch = batch};
  absl::Status loaded = model.load_state_dict(initial);
  TANDEM_CHECK(loaded.ok(), "reloading the initial weights: ", loaded.ToString());
  model.zero_grad();
  model.train();
  std::unique_ptr<optim::Optimizer> optimizer = MakeOptimizer(optimizer_name, model.parameters());

  // The loss of one batch; under --bf16 the forward runs under autocast. The loss
  // is float32 either way (cross_entropy computes in float32 under autocast).
  auto forward_loss = [&](const nn::Tensor& images, const nn::Tensor& labels) {
    nn::AutocastGuard autocast(config.bf16 ? nn::kBFloat16 : nn::kFloat32);
    return nn::cross_entropy(model.forward(images), labels);
  };
  int64_t next_batch = 0;
  auto batch_of = [&](const nn::Tensor& all, int64_t b) {
    return all.slice(b * batch, (b + 1) * batch);
  };
  // One eager training step on the next of the data's batches; returns the
  // loss without reading it (no host synchronisation).
  auto eager_step = [&]() {
    const int64_t b = next_batch++ % config.data_batches;
    optimizer->zero_grad();
    nn::Tensor loss = forward_loss(batch_of(data.images, b), batch_of(data.labels, b));
    loss.backward();
    optimizer->step();
    return loss;
  };
  // --cuda_graph: the step captured once on static inputs, then per step two
  // device-to-device copies of the batch into them and one graph launch.
  std::unique_ptr<nn::CudaGraph> graph;
  nn::Tensor static_images, static_labels, graph_loss;
  auto graph_step = [&]() {
    const int64_t b = next_batch++ % config.data_batches;
    static_images.copy_(batch_of(data.images, b));
    static_labels.copy_(batch_of(data.labels, b));
    graph->Replay();
    return graph_loss;
  };
  auto step = [&]() { return graph != nullptr ? graph_step() : eager_step(); };

  // The first kLossSteps losses; with --cuda_graph step 0 is the eager warm-up
  // the capture needs and steps 1.. are replays, so these losses check the graph.
  nn::Tensor loss;
  for (int64_t i = 0; i < kLossSteps; ++i) {
    loss = step();
    cell.losses.push_back(loss.item());
    if (i == 0 && config.cuda_graph) {
      static_images = nn::empty_like(batch_of(data.images, 0));
      static_labels = nn::empty_like(batch_of(data.labels, 0));
      graph = std::make_unique<nn::CudaGraph>(config.device);
      graph->Capture([&] {
        optimizer->zero_grad();
        graph_loss = forward_loss(static_images, static_labels);
        graph_loss.backward();
        optimizer->step();
      });
      cell.graph_nodes = graph->num_nodes();
    }
  }
  using Clock = std::chrono::steady_clock;
  for (int64_t r = 0; r < config.repetitions; ++r) {
    for (int64_t i = 0; i < config.warmup_steps; ++i) loss = step();
    (void)loss.item();  // the device is idle from here
    const Clock::time_point start = Clock::now();
    for (int64_t i = 0; i < config.steps; ++i) loss = step();
    (void)loss.item();  // waits for the last step
    const Clock::time_point end = Clock::now();
    cell.rep_us.push_back(std::chrono::duration<double, std::micro>(end - start).count() /
                          static_cast<double>(config.steps));
  }
  cell.median_us = Median(cell.rep_us);
  cell.min_us = *std::min_element(cell.rep_us.begin(), cell.rep_us.end());
  cell.max_us = *std::max_element(cell.rep_us.begin(), cell.rep_us.end());
  cell.samples_per_s = static_cast<double>(batch) * 1e6 / cell.median_us;
  return cell;
}

// --- Reports ---------------------------------------------------------------------

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown";
}

std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buffer;
}

void WriteMachine(JsonWriter& w, const Config& config) {
  w.Key("machine").BeginObject();
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  utsname uts{};
  ::uname(&uts);
  w.Field("hostname", host);
  w.Field("os", absl::StrCat(uts.sysname, " ", uts.release, " ", uts.machine));
  w.Field("cpu_model", CpuModel());
  w.Field("logical_cpus", static_cast<int64_t>(std::thread::hardware_concurrency()));
  w.Field("compiler", __VERSION__);
  w.Field("openblas_config", openblas_get_config());
  w.Field("openblas_threads", nn::cpu_blas_threads());
  w.Field("cuda_built", nn::cuda_built());
  w.Field("cuda_devices", nn::cuda_device_count());
#if TANDEM_WITH_CUDA
  if (config.device.is_cuda()) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, config.device.index) == cudaSuccess) {
      w.Field("gpu_name", prop.name);
      w.Field("gpu_memory_bytes", static_cast<int64_t>(prop.totalGlobalMem));
      w.Field("gpu_sm_count", prop.multiProcessorCount);
      w.Field("gpu_compute_capability", absl::StrCat(prop.major, ".", prop.minor));
    }
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    w.Field("cuda_driver_version", driver);
    w.Field("cuda_runtime_version", runtime);
  }
#else
  (void)config;
#endif
  w.EndObject();
}

void WriteOptimizers(JsonWriter& w) {
  w.Key("optimizers").BeginObject();
  w.Key("sgd").BeginObject();
  w.Field("lr", kSgdLr).Field("momentum", 0.0).Field("dampening", 0.0);
  w.Field("weight_decay", 0.0).Field("nesterov", false);
  w.EndObject();
  w.Key("adam").BeginObject();
  w.Field("lr", kAdamLr).Field("betas", std::vector<double>{kAdamBeta1, kAdamBeta2});
  w.Field("eps", kAdamEps).Field("weight_decay", 0.0).Field("amsgrad", false);
  w.EndObject();
  w.EndObject();
}

void WriteCell(JsonWriter& w, const Config& config, const Cell& cell) {
  w.BeginObject();
  w.Field("side", "tandem").Field("mode", "tandem");
  w.Field("model", cell.model).Field("batch", cell.batch).Field("optimizer", cell.optimizer);
  w.Field("device", config.device.ToString()).Field("tf32", config.tf32);
  w.Field("bf16", config.bf16).Field("graph", cell.graph_nodes >= 0).Key("graph_nodes");
  if (cell.graph_nodes >= 0) {
    w.Int(cell.graph_nodes);
  } else {
    w.Null();
  }
  w.Key("skipped").Null();
  w.Field("median_us_per_step", cell.median_us).Field("samples_per_s", cell.samples_per_s);
  w.Field("min_us_per_step", cell.min_us).Field("max_us_per_step", cell.max_us);
  w.Field("rep_us_per_step", cell.rep_us);
  w.Field("losses", cell.losses, 9);
  w.EndObject();
}

std::string Report(const Config& config, const std::vector<Cell>& cells, int threads_used) {
  JsonWriter w;
  w.BeginObject();
  w.Field("schema", "tandem-bench/1").Field("side", "tandem").Field("date_utc", UtcNow());
  w.Key("config").BeginObject();
  w.Field("device", config.device.ToString());
  w.Key("models").BeginArray();
  for (const ModelSpec* spec : config.models) w.String(spec->name);
  w.EndArray();
  w.Field("batch_sizes", config.batch_sizes);
  w.Key("optimizer_names").BeginArray();
  for (const std::string& name : config.optimizers) w.String(name);
  w.EndArray();
  w.Field("warmup_steps", config.warmup_steps).Field("steps", config.steps);
  w.Field("data_batches", config.data_batches);
  w.Field("repetitions", config.repetitions).Field("loss_steps", kLossSteps);
  w.Field("tf32", config.tf32).Field("bf16", config.bf16).Field("graph", config.cuda_graph);
  w.Field("threads_requested", config.threads).Field("threads", threads_used);
  w.Field("seed", static_cast<int64_t>(config.seed));
  w.Field("import_dir", config.import_dir).Field("export_dir", config.export_dir);
  w.Field("zero_grad", "in place (optimizer.zero_grad())");
  w.Field("timing", "per repetition: warmup steps, loss.item() (device sync), clock, steps, "
                    "loss.item(), clock; median over repetitions");
  WriteOptimizers(w);
  w.EndObject();
  WriteMachine(w, config);
  w.Key("cells").BeginArray();
  for (const Cell& cell : cells) WriteCell(w, config, cell);
  w.EndArray();
  w.EndObject();
  return w.str() + "\n";
}

std::string Manifest(const Config& config, const std::vector<Cell>& cells,
                     const std::vector<std::pair<const ModelSpec*, std::pair<nn::StateDict, int64_t>>>&
                         exported) {
  JsonWriter w;
  w.BeginObject();
  w.Field("format", "tandem-bench-exchange").Field("version", 1);
  w.Field("byte_order", "little");
  w.Field("layout", "each file: the tensor's elements in C (row-major) order, raw, no header");
  w.Field("seed", static_cast<int64_t>(config.seed)).Field("loss_steps", kLossSteps);
  w.Field("data_batches", config.data_batches);
  w.Field("device", config.device.ToString()).Field("tf32", config.tf32);
  WriteOptimizers(w);
  w.Key("models").BeginObject();
  for (const auto& [spec, state_and_n] : exported) {
    const auto& [state, n] = state_and_n;
    w.Key(spec->name).BeginObject();
    w.Field("description", spec->description);
    w.Field("input_shape", spec->input);
    w.Key("params").BeginArray();
    for (const auto& [name, tensor] : state) {
      w.BeginObject();
      w.Field("name", name).Field("dtype", nn::DTypeName(tensor.dtype()));
      w.Field("shape", tensor.shape()).Field("file", absl::StrCat(spec->name, "/", name, ".bin"));
      w.EndObject();
    }
    w.EndArray();
    nn::Shape image_shape{n};
    image_shape.insert(image_shape.end(), spec->input.begin(), spec->input.end());
    w.Key("images").BeginObject();
    w.Field("dtype", "float32").Field("shape", image_shape);
    w.Field("file", absl::StrCat(spec->name, "/images.bin")).EndObject();
    w.Key("labels").BeginObject();
    w.Field("dtype", "int64").Field("shape", std::vector<int64_t>{n});
    w.Field("file", absl::StrCat(spec->name, "/labels.bin")).EndObject();
    w.EndObject();
  }
  w.EndObject();
  w.Key("losses").BeginArray();
  for (const Cell& cell : cells) {
    w.BeginObject();
    w.Field("model", cell.model).Field("batch", cell.batch).Field("optimizer", cell.optimizer);
    w.Field("losses", cell.losses, 9);
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  return w.str() + "\n";
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

void Check(const absl::Status& status) {
  if (!status.ok()) tandem::Fail(status.ToString());
}

int Run(const Config& config) {
  nn::DeviceGuard device_guard(config.device);
  if (config.threads > 0) nn::set_cpu_blas_threads(config.threads);
  const int threads_used = nn::cpu_blas_threads();
  nn::set_allow_tf32(config.tf32);
  const int64_t max_batch = *std::max_element(config.batch_sizes.begin(), config.batch_sizes.end());
  const int64_t n = config.data_batches * max_batch;
  std::cerr << kProgram << ": device " << config.device.ToString()
            << (config.cuda_graph ? " (CUDA graph)" : "") << ", OpenBLAS threads "
            << threads_used << ", tf32 " << (config.tf32 ? "on" : "off") << ", bf16 "
            << (config.bf16 ? "autocast" : "off") << ", warm-up "
            << config.warmup_steps << " + " << config.steps << " timed steps x "
            << config.repetitions << " repetitions\n";

  std::vector<Cell> cells;
  std::vector<std::pair<const ModelSpec*, std::pair<nn::StateDict, int64_t>>> exported;
  for (const ModelSpec* spec : config.models) {
    nn::manual_seed(config.seed, 0);
    std::shared_ptr<nn::Module> model = spec->make();
    Data data;
    if (config.import_dir.empty()) {
      data = MakeData(*spec, n, config.seed, config.device);
    } else {
      Check(apps::bench::ReadModelState(config.import_dir, spec->name, *model));
      absl::StatusOr<Data> imported = ImportData(*spec, config.import_dir, n, config.data_batches,
                                                      config.device);
      Check(imported.status());
      data = *imported;
    }
    const nn::StateDict initial = Snapshot(*model);
    if (!config.export_dir.empty()) {
      Check(ExportModel(*spec, config.export_dir, *model, data));
      exported.push_back({spec, {model->state_dict(), data.images.size(0)}});
    }
    for (int64_t batch : config.batch_sizes) {
      for (const std::string& optimizer : config.optimizers) {
        cells.push_back(RunCell(config, *spec, *model, initial, data, batch, optimizer));
        const Cell& c = cells.back();
        std::cerr << absl::StrFormat(
            "%-17s batch %4d %-4s %s: %10.1f us/step (min %.1f, max %.1f), %10.0f samples/s, "
            "losses %.6f .. %.6f\n",
            c.model, c.batch, c.optimizer, config.device.ToString(), c.median_us, c.min_us,
            c.max_us, c.samples_per_s, c.losses.front(), c.losses.back());
      }
    }
  }
  if (!config.export_dir.empty()) {
    Check(WriteFile(config.export_dir + "/manifest.json", Manifest(config, cells, exported)));
    std::cerr << kProgram << ": wrote " << config.export_dir << "/manifest.json\n";
  }
  if (!config.json.empty()) {
    Check(WriteFile(config.json, Report(config, cells, threads_used)));
    std::cerr << kProgram << ": wrote " << config.json << "\n";
  }
  std::cout << absl::StrFormat("%-17s %6s %-5s %12s %12s %12s %14s\n", "model", "batch", "optim",
                               "us/step", "min", "max", "samples/s");
  for (const Cell& c : cells) {
    std::cout << absl::StrFormat("%-17s %6d %-5s %12.1f %12.1f %12.1f %14.0f\n", c.model, c.batch,
                                 c.optimizer, c.median_us, c.min_us, c.max_us, c.samples_per_s);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  apps::SetUpHelp(
      "tandem_bench",
      "Times training steps of the MLP, LeNet and ConvNet on device-resident synthetic data "
      "(median of repetitions), for the PyTorch comparison of bench/compare.py.\n\n"
      "Usage: tandem_bench [--flag=value ...]");
  std::vector<char*> positional = apps::ParseCommandLineOrExit(kProgram, argc, argv);
  if (positional.size() > 1) {
    FlagError(absl::StrCat("unexpected argument \"", positional[1], "\" (flags are --name=value)"));
  }
  if (absl::GetFlag(FLAGS_list_devices)) {
    std::cout << "{\"cuda_built\": " << (nn::cuda_built() ? "true" : "false")
              << ", \"cuda_devices\": " << nn::cuda_device_count() << "}\n";
    return 0;
  }
  const Config config = ParseConfig();
  try {
    return Run(config);
  } catch (const std::exception& e) {
    std::cerr << kProgram << ": error: " << e.what() << "\n";
    return kExitFailure;
  }
}
