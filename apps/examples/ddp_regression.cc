// ddp_regression: OneFlow's DistributedDataParallel example (the data-parallel
// chapter of its docs) written with tandem. Two ranks fit y = x w, w (2x1)
// starting at zero, each on its own two samples:
//   rank 0: x = [[1, 2], [2, 3]], y = [[8], [13]]
//   rank 1: x = [[4, 6], [3, 1]], y = [[26], [9]]
// with MSELoss(reduction sum) and SGD at lr 0.01 for 500 iterations.
// DataParallel averages the two ranks' gradients, as OneFlow's DDP does, and
// every rank ends with w = [[2], [3]] (every sample has y = 2 x0 + 3 x1).
//
//   ddp_regression                # two CPU ranks
//   ddp_regression --gpus=0,1     # two GPUs
//
// Prints rank 0's loss every 50 iterations, then every rank's w. Exit status 1
// on a failure (the failing rank's error, or a bad --gpus), 2 on a stray argument
// or a bad --timeout_s.
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "apps/flag_check.h"
#include "nn/nn.h"
#include "optim/sgd.h"
#include "spawn/train/data_parallel.h"
#include "spawn/spawn.h"

ABSL_FLAG(std::string, gpus, "cpu", "The two ranks' devices: cpu, or two GPUs such as 0,1.");
ABSL_FLAG(double, timeout_s, 300, tandem::apps::kTimeoutHelp);

namespace {

namespace nn = ::tandem::nn;
namespace dist = ::tandem::dist;

struct Model : nn::Module {
  Model() : w(register_parameter("w", nn::zeros({2, 1}))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return nn::matmul(x, w); }  // x: (N, 2)
  nn::Tensor w;
};

// Runs on each rank; returns this rank's final w.
std::vector<float> Train(dist::Context& ctx) {
  const bool rank0 = ctx.rank() == 0;
  nn::Tensor x = nn::from_vector(rank0 ? std::vector<float>{1, 2, 2, 3}
                                       : std::vector<float>{4, 6, 3, 1}, {2, 2});
  nn::Tensor y = nn::from_vector(rank0 ? std::vector<float>{8, 13}
                                       : std::vector<float>{26, 9}, {2, 1});
  Model model;
  dist::DataParallel dp(model, ctx);
  nn::MSELoss loss_fn(nn::Reduction::kSum);
  tandem::optim::SGD sgd(dp.parameters(), {.lr = 0.01});
  for (int i = 0; i < 500; ++i) {
    nn::Tensor loss = loss_fn(dp(x), y);
    if (rank0 && i % 50 == 0) std::cout << "iter " << i << " loss " << loss.item() << "\n";
    loss.backward();
    sgd.step();
    sgd.zero_grad();
  }
  return model.w.to_vector<float>();
}

}  // namespace

int main(int argc, char** argv) {
  tandem::apps::SetUpHelp(
      "ddp_regression",
      "Fits y = x w (w: 2x1, starting at zero) by gradient descent on two ranks, each with "
      "its own two samples (OneFlow's DistributedDataParallel example, written with tandem): "
      "DataParallel averages the two ranks' gradients, so both keep the same w and end at "
      "w = [[2], [3]], the exact fit of all four samples. Prints rank 0's loss every 50 "
      "iterations, then each rank's w.\n\n"
      "Usage: ddp_regression [--gpus=cpu|0,1] [--timeout_s=S]");
  if (tandem::apps::ParseCommandLineOrExit("ddp_regression", argc, argv).size() > 1) {
    std::cerr << "ddp_regression: error: unexpected argument \"" << argv[1]
              << "\" (flags look like --name=value; see --help)\n";
    return 2;
  }
  dist::SpawnOptions options;
  options.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  if (std::optional<std::string> bad = tandem::apps::CheckTimeout(options.timeout_s)) {
    std::cerr << "ddp_regression: error: " << *bad << "\n";
    return 2;
  }
  absl::StatusOr<std::vector<std::vector<float>>> w =
      dist::spawn(Train, std::make_tuple(), /*nprocs=*/2, absl::GetFlag(FLAGS_gpus), options);
  if (!w.ok()) {
    std::cerr << "ddp_regression: " << w.status() << "\n";
    return 1;
  }
  for (size_t rank = 0; rank < w->size(); ++rank) {
    std::printf("rank %zu: w = [[%.4f], [%.4f]]\n", rank, (*w)[rank][0], (*w)[rank][1]);
  }
  return 0;
}
