// Forward + backward time of the layers the apps train, on the CPU and, when a
// GPU is visible, on CUDA device 0 (a microbenchmark). Not a ctest: run
// by hand,
//   scripts/bench.sh ops      # build-cpu/bench/nn_ops_bench --benchmark_repetitions=5 ...
// Cases, each at batch 64 and 512:
//   Linear784x512    nn::Linear(784, 512) on data x (grads: weight, bias)
//   Conv1x20k5       LeNet's first conv, 1 -> 20, 5x5, padding 2, on 28x28 data
//   Conv32x64k3      a hidden conv, 32 -> 64, 3x3, padding 1, on 16x16 (grads: x, weight, bias)
//   CrossEntropy10   cross_entropy of (N, 10) logits (grad: logits)
//   CrossEntropy10Options  the same with a class weight, ignored labels, smoothing 0.1
// and, at batch 32, 128 and 512, the other convs of the apps' models (grads: x,
// weight, bias, except where x is the data):
//   LeNetConv2       20 -> 20, 5x5, padding 2, on 14x14
//   CifarConv1       3 -> 32, 3x3, on 32x32 data
//   CifarConv2       32 -> 64, 3x3, on 15x15
//   CifarConv3       64 -> 64, 3x3, on 6x6
//   LeNetConv2F64    LeNetConv2 in float64
// and, at batch 32 and 64, ResNet-18's (CIFAR stem) stride-1 3x3 layers, padding 1
// (grads: x, weight, bias; kAuto runs them on the Winograd kernels, "/dnnl_blocked"
// rows on oneDNN's direct ones):
//   ResNetConv64     64 -> 64 on 32x32
//   ResNetConv128    128 -> 128 on 16x16
//   ResNetConv256    256 -> 256 on 8x8
//   ResNetConv512    512 -> 512 on 4x4
// and, at batch 32 and 128, the models' max_pool2d 2x2 (stride 2) and relu (grad: x):
//   MaxPool20x28     20 channels of 28x28 (LeNet's first pool)
//   MaxPool64x30     64 channels of 30x30 (a ConvNet-sized pool)
//   MaxPool64x30F64  MaxPool64x30 in float64
//   Relu32x30        relu on 32 channels of 30x30 (ConvNet's first activation)
// and, at batch 32, 128 and 512, the models' 2x2 pools (grad: x), each float32
// pool with "/own", "/dnnl_plain", "/dnnl_nhwc" and "/dnnl_blocked" rows where
// tandem is built with oneDNN (PoolPaths):
//   MaxPoolLeNet1    20 channels, 28x28 -> 14x14 (LeNet)
//   MaxPoolLeNet2    20 channels, 14x14 -> 7x7 (LeNet)
//   MaxPoolCifar1    32 channels, 30x30 -> 15x15 (ConvNet)
//   MaxPoolCifar2    64 channels, 13x13 -> 6x6 (ConvNet)
//   AvgPoolLeNet1, AvgPoolCifar1  avg_pool2d on the LeNet1 / Cifar1 shapes
// and, at batch 32 and 128, LeNet's conv + ReLU + 2x2 max-pool blocks as
// conv2d_relu_max_pool2d and, "/unfused" rows, as conv2d_relu then max_pool2d:
//   LeNetBlock1      1 -> 20, 5x5, padding 2, on 28x28 data
//   LeNetBlock2      20 -> 20, 5x5, padding 2, on 14x14 (grads: x, weight, bias)
// One iteration is forward, backward from a fixed output gradient (ones; the
// loss's own 1 for cross_entropy) and zero_grad. On CUDA each iteration ends
// with a synchronisation of the thread's stream, so the time is the whole step's
// wall time, launches included. Two untimed warm-up steps first choose the
// cuBLASLt / cuDNN algorithms and fill the memory pool. Times are real (wall)
// time; items/s is samples/s. TF32 stays off (the library's default).
// CPU matmuls use OpenBLAS with its default threads (OPENBLAS_NUM_THREADS sets them);
// float32 CPU convs run on oneDNN (same thread count, blocked layouts) where
// tandem is built with it, and each float32 conv case then also has an "/im2col"
// row (the im2col + OpenBLAS kernels) and a "/dnnl_plain" row (oneDNN on NCHW)
// on the same case (compare them interleaved with
// --benchmark_enable_random_interleaving=true --benchmark_repetitions=N).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "nn/device.h"
#include "nn/layers.h"
#include "nn/ops/conv.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/matmul_kernels.h"
#include "nn/ops/internal/pool_kernels.h"
#include "nn/ops/matmul.h"
#include "nn/ops/pool.h"
#include "nn/random.h"
#include "nn/tensor.h"
#if TANDEM_WITH_CUDA
#include "nn/cuda/context.h"
#endif

namespace tandem::nn {
namespace {

// One training step's work on tensors built once; called once per iteration.
using StepFn = std::function<void()>;
// Builds a step's tensors and modules at `batch` on the current device.
using MakeStepFn = StepFn (*)(int64_t batch);

StepFn Linear784x512(int64_t batch) {
  Linear fc(784, 512);
  Tensor x = randn({batch, 784});
  Tensor dy = ones({batch, 512});
  return [fc, x, dy]() mutable {
    fc(x).backward(dy);
    fc->zero_grad();
  };
}

StepFn Conv1x20k5(int64_t batch) {
  Conv2d conv(1, 20, 5, {.padding = {2, 2}});
  Tensor x = randn({batch, 1, 28, 28});
  Tensor dy = ones({batch, 20, 28, 28});
  return [conv, x, dy]() mutable {
    conv(x).backward(dy);
    conv->zero_grad();
  };
}

StepFn Conv32x64k3(int64_t batch) {
  Conv2d conv(32, 64, 3, {.padding = {1, 1}});
  Tensor x = randn({batch, 32, 16, 16}).set_requires_grad(true);
  Tensor dy = ones({batch, 64, 16, 16});
  return [conv, x, dy]() mutable {
    conv(x).backward(dy);
    conv->zero_grad();
    x.set_grad(Tensor());
  };
}

// conv2d with `in` -> `out` channels, k x k, padding `pad` on (batch, in, hw, hw),
// weight and bias requiring grad (as Conv2d's); x too when `x_grad`.
StepFn ConvStep(int64_t batch, int64_t in, int64_t out, int64_t k, int64_t hw, int64_t pad,
                bool x_grad, DType dtype = kFloat32) {
  Tensor w = randn({out, in, k, k}, {.dtype = dtype}).set_requires_grad(true);
  Tensor b = randn({out}, {.dtype = dtype}).set_requires_grad(true);
  Tensor x = randn({batch, in, hw, hw}, {.dtype = dtype}).set_requires_grad(x_grad);
  const int64_t ohw = hw + 2 * pad - k + 1;
  Tensor dy = ones({batch, out, ohw, ohw}, {.dtype = dtype});
  const Conv2dParams params{.padding = {pad, pad}};
  return [w, b, x, dy, params]() mutable {
    conv2d(x, w, b, params).backward(dy);
    w.set_grad(Tensor());
    b.set_grad(Tensor());
    x.set_grad(Tensor());
  };
}
StepFn LeNetConv2(int64_t batch) { return ConvStep(batch, 20, 20, 5, 14, 2, true); }
StepFn CifarConv1(int64_t batch) { return ConvStep(batch, 3, 32, 3, 32, 0, false); }
StepFn CifarConv2(int64_t batch) { return ConvStep(batch, 32, 64, 3, 15, 0, true); }
StepFn CifarConv3(int64_t batch) { return ConvStep(batch, 64, 64, 3, 6, 0, true); }
StepFn ResNetConv64(int64_t batch) { return ConvStep(batch, 64, 64, 3, 32, 1, true); }
StepFn ResNetConv128(int64_t batch) { return ConvStep(batch, 128, 128, 3, 16, 1, true); }
StepFn ResNetConv256(int64_t batch) { return ConvStep(batch, 256, 256, 3, 8, 1, true); }
StepFn ResNetConv512(int64_t batch) { return ConvStep(batch, 512, 512, 3, 4, 1, true); }
StepFn LeNetConv2F64(int64_t batch) {
  return ConvStep(batch, 20, 20, 5, 14, 2, true, kFloat64);
}

// max_pool2d 2x2 on (batch, channels, hw, hw) requiring grad.
StepFn MaxPoolStep(int64_t batch, int64_t channels, int64_t hw, DType dtype = kFloat32) {
  Tensor x = randn({batch, channels, hw, hw}, {.dtype = dtype}).set_requires_grad(true);
  Tensor dy = ones({batch, channels, hw / 2, hw / 2}, {.dtype = dtype});
  return [x, dy]() mutable {
    max_pool2d(x).backward(dy);
    x.set_grad(Tensor());
  };
}
StepFn MaxPool20x28(int64_t batch) { return MaxPoolStep(batch, 20, 28); }
StepFn MaxPool64x30(int64_t batch) { return MaxPoolStep(batch, 64, 30); }
StepFn MaxPool64x30F64(int64_t batch) { return MaxPoolStep(batch, 64, 30, kFloat64); }

// A conv (in -> out, 5x5, padding 2, on (batch, in, hw, hw)) + ReLU + 2x2 max
// pool, fused (conv2d_relu_max_pool2d) or not.
StepFn ConvReluPoolStep(int64_t batch, int64_t in, int64_t hw, bool fused) {
  constexpr int64_t kOut = 20;
  Tensor w = randn({kOut, in, 5, 5}).set_requires_grad(true);
  Tensor b = randn({kOut}).set_requires_grad(true);
  Tensor x = randn({batch, in, hw, hw}).set_requires_grad(in > 1);
  Tensor dy = randn({batch, kOut, hw / 2, hw / 2});
  const Conv2dParams conv{.padding = {2, 2}};
  return [w, b, x, dy, conv, fused]() mutable {
    (fused ? conv2d_relu_max_pool2d(x, w, b, conv, {}) : max_pool2d(conv2d_relu(x, w, b, conv)))
        .backward(dy);
    w.set_grad(Tensor());
    b.set_grad(Tensor());
    x.set_grad(Tensor());
  };
}
StepFn LeNetBlock1(int64_t batch) { return ConvReluPoolStep(batch, 1, 28, true); }
StepFn LeNetBlock2(int64_t batch) { return ConvReluPoolStep(batch, 20, 14, true); }
StepFn LeNetBlock1Unfused(int64_t batch) { return ConvReluPoolStep(batch, 1, 28, false); }
StepFn LeNetBlock2Unfused(int64_t batch) { return ConvReluPoolStep(batch, 20, 14, false); }

// max_pool2d (or avg_pool2d) 2x2 stride 2 on (batch, channels, hw, hw)
// requiring grad: the pools of the apps' models (apps/models.cc).
StepFn PoolStep(int64_t batch, int64_t channels, int64_t hw, bool max) {
  Tensor x = randn({batch, channels, hw, hw}).set_requires_grad(true);
  Tensor dy = ones({batch, channels, hw / 2, hw / 2});
  return [x, dy, max]() mutable {
    (max ? max_pool2d(x) : avg_pool2d(x)).backward(dy);
    x.set_grad(Tensor());
  };
}
StepFn MaxPoolLeNet1(int64_t batch) { return PoolStep(batch, 20, 28, true); }
StepFn MaxPoolLeNet2(int64_t batch) { return PoolStep(batch, 20, 14, true); }
StepFn MaxPoolCifar1(int64_t batch) { return PoolStep(batch, 32, 30, true); }
StepFn MaxPoolCifar2(int64_t batch) { return PoolStep(batch, 64, 13, true); }
StepFn AvgPoolLeNet1(int64_t batch) { return PoolStep(batch, 20, 28, false); }
StepFn AvgPoolCifar1(int64_t batch) { return PoolStep(batch, 32, 30, false); }

StepFn Relu32x30(int64_t batch) {
  Tensor x = randn({batch, 32, 30, 30}).set_requires_grad(true);
  Tensor dy = ones({batch, 32, 30, 30});
  return [x, dy]() mutable {
    relu(x).backward(dy);
    x.set_grad(Tensor());
  };
}

StepFn CrossEntropy10(int64_t batch) {
  Tensor logits = randn({batch, 10}).set_requires_grad(true);
  std::vector<int64_t> label_values(batch);
  for (int64_t i = 0; i < batch; ++i) label_values[i] = (i * 7) % 10;
  Tensor labels = from_vector(label_values, {batch});
  return [logits, labels]() {
    cross_entropy(logits, labels).backward();
    logits.set_grad(Tensor());
  };
}

// CrossEntropy10 with every option: a class weight, every eighth label ignored
// (-100), label smoothing 0.1 (what the options cost over the default path).
StepFn CrossEntropy10Options(int64_t batch) {
  Tensor logits = randn({batch, 10}).set_requires_grad(true);
  std::vector<int64_t> label_values(batch);
  for (int64_t i = 0; i < batch; ++i) label_values[i] = i % 8 == 3 ? -100 : (i * 7) % 10;
  Tensor labels = from_vector(label_values, {batch});
  const CrossEntropyOptions options{.weight = rand({10}), .label_smoothing = 0.1};
  return [logits, labels, options]() {
    cross_entropy(logits, labels, options).backward();
    logits.set_grad(Tensor());
  };
}

// Waits until the thread's stream on `device` has finished (nothing on the CPU).
void Sync(Device device) {
#if TANDEM_WITH_CUDA
  if (device.is_cuda()) {
    TANDEM_CHECK_CUDA(cudaStreamSynchronize(internal::ThreadStream(device)), device);
  }
#else
  (void)device;
#endif
}

using ops::internal::CpuConvPath;
using ops::internal::CpuPoolPath;

void RunStep(benchmark::State& state, Device device, MakeStepFn make, int64_t batch,
             CpuConvPath path, CpuPoolPath pool_path) {
  ops::internal::SetCpuConvPath(path);
  ops::internal::SetCpuPoolPath(pool_path);
  // The im2col rows are the kernels before oneDNN: OpenBLAS GEMMs too.
  ops::internal::SetCpuGemmPath(path == CpuConvPath::kIm2col ? ops::internal::CpuGemmPath::kOpenBlas
                                                             : ops::internal::CpuGemmPath::kAuto);
  DeviceGuard guard(device);
  manual_seed(1);
  StepFn step = make(batch);
  for (int i = 0; i < 2; ++i) step();
  Sync(device);
  for (auto _ : state) {
    step();
    Sync(device);
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

// The float32 CPU conv implementations to compare: the build's default, and
// with oneDNN built, im2col + OpenBLAS ("/im2col"), oneDNN in plain, channels-last
// and blocked layouts ("/dnnl_plain", "/dnnl_nhwc", "/dnnl_blocked") and Winograd
// wherever it applies ("/winograd"). --benchmark_enable_random_interleaving=true
// alternates them run by run.
// `float32_conv`: the case is a float32 convolution (else: one default row).
std::vector<std::pair<std::string, CpuConvPath>> ConvPaths(Device device, bool float32_conv) {
  std::vector<std::pair<std::string, CpuConvPath>> paths = {{"", CpuConvPath::kAuto}};
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  if (float32_conv && device.is_cpu() && ops::internal::CpuConvUsesDnnl()) {
    paths.emplace_back("/im2col", CpuConvPath::kIm2col);
    paths.emplace_back("/dnnl_plain", CpuConvPath::kDnnl);
    paths.emplace_back("/dnnl_nhwc", CpuConvPath::kDnnlNhwc);
    paths.emplace_back("/dnnl_blocked", CpuConvPath::kDnnlBlocked);
    paths.emplace_back("/winograd", CpuConvPath::kWinograd);
  }
  return paths;
}

// The float32 CPU pooling implementations to compare: the build's default
// (kAuto) and, with oneDNN built, our loops ("/own") and oneDNN on NCHW
// ("/dnnl_plain"), NHWC ("/dnnl_nhwc") and nChw16c ("/dnnl_blocked"), the
// latter two reordered from and to NCHW inside each call.
std::vector<std::pair<std::string, CpuPoolPath>> PoolPaths(Device device) {
  std::vector<std::pair<std::string, CpuPoolPath>> paths = {{"", CpuPoolPath::kAuto}};
  if (device.is_cpu() && ops::internal::CpuPoolDnnlBuilt()) {
    paths.emplace_back("/own", CpuPoolPath::kOwn);
    paths.emplace_back("/dnnl_plain", CpuPoolPath::kDnnl);
    paths.emplace_back("/dnnl_nhwc", CpuPoolPath::kDnnlNhwc);
    paths.emplace_back("/dnnl_blocked", CpuPoolPath::kDnnlBlocked);
  }
  return paths;
}

struct Case {
  const char* name;
  MakeStepFn make;
};

// BM_<name><path suffix>/<device>/batch:<b> for each batch and conv path.
void RegisterOnConvPaths(Device device, const Case& c, std::initializer_list<int64_t> batches,
                         bool float32_conv) {
  for (int64_t batch : batches) {
    for (const auto& [suffix, path] : ConvPaths(device, float32_conv)) {
      const std::string name = std::string("BM_") + c.name + suffix + "/" + device.ToString() +
                               "/batch:" + std::to_string(batch);
      benchmark::RegisterBenchmark(name.c_str(), RunStep, device, c.make, batch, path,
                                   CpuPoolPath::kAuto)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

void Register(Device device) {
  const Case cases[] = {{"Linear784x512", Linear784x512},
                        {"Conv1x20k5", Conv1x20k5},
                        {"Conv32x64k3", Conv32x64k3},
                        {"CrossEntropy10", CrossEntropy10},
                        {"CrossEntropy10Options", CrossEntropy10Options}};
  for (const Case& c : cases) {
    // Linear: "/im2col" = OpenBLAS.
    RegisterOnConvPaths(device, c, {64, 512},
                        !std::string(c.name).starts_with("CrossEntropy10"));
  }
  const Case convs[] = {{"LeNetConv2", LeNetConv2},
                        {"CifarConv1", CifarConv1},
                        {"CifarConv2", CifarConv2},
                        {"CifarConv3", CifarConv3},
                        {"LeNetConv2F64", LeNetConv2F64}};
  for (const Case& c : convs) {
    const bool f64 = std::string(c.name).find("F64") != std::string::npos;
    RegisterOnConvPaths(device, c, {32, 128, 512}, !f64);
  }
  const Case resnet_convs[] = {{"ResNetConv64", ResNetConv64},
                               {"ResNetConv128", ResNetConv128},
                               {"ResNetConv256", ResNetConv256},
                               {"ResNetConv512", ResNetConv512}};
  for (const Case& c : resnet_convs) RegisterOnConvPaths(device, c, {32, 64}, true);
  const Case model_pools[] = {{"MaxPoolLeNet1", MaxPoolLeNet1}, {"MaxPoolLeNet2", MaxPoolLeNet2},
                              {"MaxPoolCifar1", MaxPoolCifar1}, {"MaxPoolCifar2", MaxPoolCifar2},
                              {"AvgPoolLeNet1", AvgPoolLeNet1}, {"AvgPoolCifar1", AvgPoolCifar1}};
  for (const Case& c : model_pools) {
    for (int64_t batch : {32, 128, 512}) {
      for (const auto& [suffix, path] : PoolPaths(device)) {
        const std::string name = std::string("BM_") + c.name + suffix + "/" + device.ToString() +
                                 "/batch:" + std::to_string(batch);
        benchmark::RegisterBenchmark(name.c_str(), RunStep, device, c.make, batch,
                                     CpuConvPath::kAuto, path)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  const Case small[] = {{"MaxPool20x28", MaxPool20x28},
                        {"MaxPool64x30", MaxPool64x30},
                        {"MaxPool64x30F64", MaxPool64x30F64},
                        {"Relu32x30", Relu32x30},
                        {"LeNetBlock1", LeNetBlock1},
                        {"LeNetBlock1/unfused", LeNetBlock1Unfused},
                        {"LeNetBlock2", LeNetBlock2},
                        {"LeNetBlock2/unfused", LeNetBlock2Unfused}};
  for (const Case& c : small) {
    for (int64_t batch : {32, 128}) {
      const std::string name = std::string("BM_") + c.name + "/" + device.ToString() +
                               "/batch:" + std::to_string(batch);
      benchmark::RegisterBenchmark(name.c_str(), RunStep, device, c.make, batch,
                                   CpuConvPath::kAuto, CpuPoolPath::kAuto)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace
}  // namespace tandem::nn

int main(int argc, char** argv) {
  namespace nn = ::tandem::nn;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  nn::set_allow_tf32(false);
  benchmark::AddCustomContext("tf32", nn::allow_tf32() ? "on" : "off");
  nn::Register(nn::Device::CPU());
  const int gpus = nn::cuda_device_count();
  if (gpus > 0) {
    nn::Register(nn::Device::CUDA(0));
  } else {
    std::cerr << "nn_ops_bench: CUDA benchmarks skipped: "
              << (nn::cuda_built() ? "no CUDA device visible" : "this binary was built without CUDA")
              << "\n";
  }
  try {
    benchmark::RunSpecifiedBenchmarks();
  } catch (const tandem::Error& e) {
    std::cerr << "nn_ops_bench: " << e.what() << "\n";
    return 1;
  }
  benchmark::Shutdown();
  return 0;
}
