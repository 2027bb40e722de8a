// resnet_step_bench: the per-step time of a ResNet training step on the CPU, the
// tandem half of bench/resnet_step_bench.sh (resnet_step_bench.py is the
// PyTorch half; the script interleaves them).
//
//   resnet_step_bench MODEL BATCH THREADS WARMUP STEPS
//
// MODEL: resnet18_cifar (10 classes, 3x32x32 inputs) or resnet50_cifar. One
// process, one thread of tandem's own, THREADS kernel threads; plain SGD (lr
// 0.01), cross-entropy, training mode, a fixed random batch. Prints one line:
// "tandem MODEL batch B threads T: median_us M min_us m losses l0 .. lN".
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "apps/models.h"
#include "nn/layers.h"
#include "nn/ops/matmul.h"
#include "nn/random.h"
#include "optim/sgd.h"

namespace {

namespace nn = ::tandem::nn;
namespace apps = ::tandem::apps;

int Usage() {
  std::fprintf(stderr, "usage: resnet_step_bench resnet18_cifar|resnet50_cifar BATCH THREADS "
                       "WARMUP STEPS\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) return Usage();
  const std::string model_name = argv[1];
  const int64_t batch = std::atoll(argv[2]);
  const int threads = std::atoi(argv[3]);
  const int warmup = std::atoi(argv[4]), steps = std::atoi(argv[5]);
  if (batch < 1 || threads < 1 || warmup < 0 || steps < 1) return Usage();
  nn::set_cpu_blas_threads(threads);
  nn::manual_seed(1);
  const apps::ResNetOptions options{.num_classes = 10, .cifar_stem = true};
  std::shared_ptr<nn::Module> model;
  if (model_name == "resnet18_cifar") {
    model = apps::MakeResNet18(options);
  } else if (model_name == "resnet50_cifar") {
    model = apps::MakeResNet50(options);
  } else {
    return Usage();
  }
  model->train();
  tandem::optim::SGD sgd(model->parameters(), tandem::optim::SGDOptions{.lr = 0.01});
  const nn::Tensor x = nn::randn({batch, 3, 32, 32});
  std::vector<int64_t> labels(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) labels[i] = i % 10;
  const nn::Tensor y = nn::from_vector(labels, {batch});
  nn::CrossEntropyLoss loss_fn;
  std::vector<double> times_us, losses;
  for (int step = 0; step < warmup + steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    sgd.zero_grad();
    nn::Tensor loss = loss_fn(model->forward(x), y);
    loss.backward();
    sgd.step();
    const double value = loss.item();
    const double us = std::chrono::duration<double, std::micro>(
                          std::chrono::steady_clock::now() - start).count();
    if (step >= warmup) {
      times_us.push_back(us);
      losses.push_back(value);
    }
  }
  std::vector<double> sorted = times_us;
  std::sort(sorted.begin(), sorted.end());
  std::printf("tandem %s batch %lld threads %d: median_us %.0f min_us %.0f losses %.4f .. %.4f\n",
              model_name.c_str(), static_cast<long long>(batch), threads,
              sorted[sorted.size() / 2], sorted.front(), losses.front(), losses.back());
  return 0;
}
