// host_cost_bench: the host's cost per op of tandem's eager path, the tandem half
// of scripts/bench.sh host_cost (bench/torch_host_cost.py is the PyTorch half,
// bench/host_cost.py the driver that runs both and prints the table).
//
//   host_cost_bench --devices=cpu,cuda:0 --cases=add,relu --n=2000 --repetitions=5
//
// Every case is an op (or an op's forward and backward) on tensors so small that
// the arithmetic is negligible: what is timed is what the library does around
// the arithmetic (dispatch, autograd, allocation, stream bookkeeping, the CUDA
// calls). Per repetition: a device sync, the clock, --n iterations with no sync
// between them, the clock (host time: what the calling thread spent enqueueing),
// one sync, the clock (wall time). Reported per case and device: the median over
// --repetitions of both, in microseconds per iteration, after --warmup untimed
// iterations (which choose the cuDNN / cuBLASLt algorithms and fill the pools).
// On the CPU the two are the same work (there is no queue); on a GPU the host
// time is the number to drive down, and the wall time stays near it while the
// host is the bottleneck.
//
// Cases (float32; "grad" tensors require grad and have their .grad reset to
// undefined after every iteration, as zero_grad(set_to_none) does):
//   add             a + b, a and b (8, 8)
//   relu            relu(a), a (8, 8)
//   linear          linear(x, w, b): x (8, 32), w (16, 32), b (16); no grad
//   linear_fwd_bwd  the same with x, w, b grad, then backward(ones (8, 16))
//   conv2d          conv2d(x, w, b, padding 1): x (1, 4, 8, 8), w (8, 4, 3, 3),
//                   b (8); no grad
//   conv2d_fwd_bwd  the same with x, w, b grad, then backward(ones (1, 8, 8, 8))
// MobileNetV2-shaped cases (not tiny: on a GPU the device time may show in the
// wall time; the host time is still what the library spends enqueueing):
//   dwconv_fwd_bwd  depthwise conv2d, x (8, 32, 16, 16), w (32, 1, 3, 3), groups 32,
//                   padding 1, no bias; x, w grad; backward(ones)
//   conv1x1_fwd_bwd conv2d x (8, 32, 16, 16), w (64, 32, 1, 1), no bias; backward(ones)
//   bn_fwd_bwd      batch_norm2d in training mode, x (8, 32, 16, 16), weight and bias
//                   (32) grad, running statistics updated; backward(ones)
//
// Output: one line per case and device, key=value words (bench/host_cost.py
// reads them):
//   host_cost side=tandem device=cpu case=add threads=1 n=2000 host_us=0.91
//       wall_us=0.91 reps_host_us=0.90,0.91,... reps_wall_us=...
//   host_cost side=tandem device=cuda:0 case=add skipped="needs 1 CUDA device, 0 visible"
// A CUDA device that is not visible (or a build without CUDA) skips its rows with
// the reason; the CPU rows still run. Exit statuses: 0 ok, 1 a failure during the
// run, 2 a bad flag value.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nn/device.h"
#include "nn/ops/batch_norm.h"
#include "nn/ops/conv.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/matmul.h"
#include "nn/random.h"
#include "nn/tensor.h"

ABSL_FLAG(std::string, devices, "cpu,cuda:0", "comma-separated devices (cpu, cuda:N)");
ABSL_FLAG(std::string, cases,
          "add,relu,linear,linear_fwd_bwd,conv2d,conv2d_fwd_bwd,dwconv_fwd_bwd,conv1x1_fwd_bwd,"
          "bn_fwd_bwd",
          "comma-separated cases");
ABSL_FLAG(int, n, 2000, "timed iterations per repetition (one sync at the end)");
ABSL_FLAG(int, warmup, 200, "untimed iterations per case and device, before the repetitions");
ABSL_FLAG(int, repetitions, 5, "repetitions; the median is reported");
ABSL_FLAG(int, threads, 1, "CPU kernel threads (nn::set_cpu_blas_threads; torch.set_num_threads)");

namespace {

namespace nn = ::tandem::nn;
using nn::Tensor;

using StepFn = std::function<void()>;

// Tensors of one case live in the closure; `grad` makes x, w, b require grad.
StepFn Elementwise(bool relu, nn::Device device) {
  const Tensor a = nn::randn({8, 8}, {.device = device});
  const Tensor b = nn::randn({8, 8}, {.device = device});
  if (relu) return [a] { Tensor y = nn::relu(a); };
  return [a, b] { Tensor y = a + b; };
}

// The gradients of x, w, b go back to undefined (PyTorch: .grad = None).
void ResetGrads(const Tensor& x, const Tensor& w, const Tensor& b) {
  x.set_grad(Tensor());
  w.set_grad(Tensor());
  b.set_grad(Tensor());
}

StepFn Linear(bool grad, nn::Device device) {
  const Tensor x = nn::randn({8, 32}, {.device = device, .requires_grad = grad});
  const Tensor w = nn::randn({16, 32}, {.device = device, .requires_grad = grad});
  const Tensor b = nn::randn({16}, {.device = device, .requires_grad = grad});
  if (!grad) return [x, w, b] { Tensor y = nn::linear(x, w, b); };
  const Tensor dy = nn::ones({8, 16}, {.device = device});
  return [x, w, b, dy] {
    nn::linear(x, w, b).backward(dy);
    ResetGrads(x, w, b);
  };
}

StepFn Conv(bool grad, nn::Device device) {
  const Tensor x = nn::randn({1, 4, 8, 8}, {.device = device, .requires_grad = grad});
  const Tensor w = nn::randn({8, 4, 3, 3}, {.device = device, .requires_grad = grad});
  const Tensor b = nn::randn({8}, {.device = device, .requires_grad = grad});
  const nn::Conv2dParams params{.padding = {1, 1}};
  if (!grad) return [x, w, b, params] { Tensor y = nn::conv2d(x, w, b, params); };
  const Tensor dy = nn::ones({1, 8, 8, 8}, {.device = device});
  return [x, w, b, dy, params] {
    nn::conv2d(x, w, b, params).backward(dy);
    ResetGrads(x, w, b);
  };
}

// x (8, 32, 16, 16) through a depthwise 3x3 or a 1x1 convolution, no bias.
StepFn MobileConv(bool depthwise, nn::Device device) {
  const Tensor x = nn::randn({8, 32, 16, 16}, {.device = device, .requires_grad = true});
  const Tensor w = depthwise
                       ? nn::randn({32, 1, 3, 3}, {.device = device, .requires_grad = true})
                       : nn::randn({64, 32, 1, 1}, {.device = device, .requires_grad = true});
  const nn::Conv2dParams params = depthwise ? nn::Conv2dParams{.padding = {1, 1}, .groups = 32}
                                            : nn::Conv2dParams{};
  const Tensor dy = nn::ones({8, depthwise ? 32 : 64, 16, 16}, {.device = device});
  return [x, w, dy, params] {
    nn::conv2d(x, w, Tensor(), params).backward(dy);
    x.set_grad(Tensor());
    w.set_grad(Tensor());
  };
}

StepFn BatchNorm(nn::Device device) {
  const Tensor x = nn::randn({8, 32, 16, 16}, {.device = device, .requires_grad = true});
  const Tensor weight = nn::ones({32}, {.device = device, .requires_grad = true});
  const Tensor bias = nn::zeros({32}, {.device = device, .requires_grad = true});
  const Tensor mean = nn::zeros({32}, {.device = device});
  const Tensor var = nn::ones({32}, {.device = device});
  const Tensor dy = nn::ones({8, 32, 16, 16}, {.device = device});
  return [x, weight, bias, mean, var, dy] {
    nn::batch_norm2d(x, weight, bias, mean, var, /*training=*/true).backward(dy);
    ResetGrads(x, weight, bias);
  };
}

StepFn MakeCase(const std::string& name, nn::Device device) {
  if (name == "add") return Elementwise(false, device);
  if (name == "relu") return Elementwise(true, device);
  if (name == "linear") return Linear(false, device);
  if (name == "linear_fwd_bwd") return Linear(true, device);
  if (name == "conv2d") return Conv(false, device);
  if (name == "conv2d_fwd_bwd") return Conv(true, device);
  if (name == "dwconv_fwd_bwd") return MobileConv(true, device);
  if (name == "conv1x1_fwd_bwd") return MobileConv(false, device);
  if (name == "bn_fwd_bwd") return BatchNorm(device);
  return nullptr;
}

[[noreturn]] void FlagError(const std::string& message) {
  std::cerr << "host_cost_bench: " << message << "\n";
  std::exit(2);
}

// Why `device` cannot run here, or "".
std::string Unavailable(nn::Device device) {
  if (device.is_cpu()) return "";
  const int visible = nn::cuda_device_count();
  if (device.index < visible) return "";
  return absl::StrCat("needs CUDA device ", device.index, ", ", visible, " visible (this binary ",
                      nn::cuda_built() ? "has" : "was built without", " the CUDA backend)");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string Join(const std::vector<double>& v) {
  return absl::StrJoin(v, ",", [](std::string* out, double x) {
    absl::StrAppend(out, absl::StrFormat("%.3f", x));
  });
}

void RunCase(const std::string& name, nn::Device device, int n, int warmup, int repetitions,
             int threads) {
  const std::string row =
      absl::StrCat("host_cost side=tandem device=", device.ToString(), " case=", name);
  if (const std::string why = Unavailable(device); !why.empty()) {
    std::printf("%s skipped=\"%s\"\n", row.c_str(), why.c_str());
    return;
  }
  nn::manual_seed(1);
  const StepFn step = MakeCase(name, device);
  for (int i = 0; i < warmup; ++i) step();
  std::vector<double> host_us, wall_us;
  using Clock = std::chrono::steady_clock;
  for (int r = 0; r < repetitions; ++r) {
    nn::Synchronize(device);
    const Clock::time_point start = Clock::now();
    for (int i = 0; i < n; ++i) step();
    const Clock::time_point enqueued = Clock::now();
    nn::Synchronize(device);
    const Clock::time_point done = Clock::now();
    host_us.push_back(std::chrono::duration<double, std::micro>(enqueued - start).count() / n);
    wall_us.push_back(std::chrono::duration<double, std::micro>(done - start).count() / n);
  }
  std::printf("%s threads=%d n=%d host_us=%.3f wall_us=%.3f reps_host_us=%s reps_wall_us=%s\n",
              row.c_str(), threads, n, Median(host_us), Median(wall_us), Join(host_us).c_str(),
              Join(wall_us).c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("host time per op of tandem's eager path (see the file's header)");
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_n), warmup = absl::GetFlag(FLAGS_warmup);
  const int repetitions = absl::GetFlag(FLAGS_repetitions), threads = absl::GetFlag(FLAGS_threads);
  if (n < 1) FlagError(absl::StrCat("--n=", n, ": must be >= 1"));
  if (warmup < 0) FlagError(absl::StrCat("--warmup=", warmup, ": must be >= 0"));
  if (repetitions < 1) FlagError(absl::StrCat("--repetitions=", repetitions, ": must be >= 1"));
  if (threads < 1) FlagError(absl::StrCat("--threads=", threads, ": must be >= 1"));
  std::vector<nn::Device> devices;
  for (const std::string& text :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_devices), ','))) {
    absl::StatusOr<nn::Device> device = nn::ParseDevice(text);
    if (!device.ok()) FlagError(absl::StrCat("--devices: ", device.status().message()));
    devices.push_back(*device);
  }
  const std::vector<std::string> cases = absl::StrSplit(absl::GetFlag(FLAGS_cases), ',');
  for (const std::string& name : cases) {
    if (MakeCase(name, nn::Device::CPU()) == nullptr) {
      FlagError(absl::StrCat("--cases: unknown case \"", name, "\""));
    }
  }
  nn::set_cpu_blas_threads(threads);
  try {
    for (const nn::Device& device : devices) {
      for (const std::string& name : cases) RunCase(name, device, n, warmup, repetitions, threads);
    }
  } catch (const std::exception& e) {
    std::cerr << "host_cost_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
