// train_two_ranks: a program of an outside project, built against the installed
// tandem package (tests/install/CMakeLists.txt builds and runs it). Two CPU ranks
// fit y = x w (w 2x1 from zero) with DataParallel and SGD, each on its own two
// samples, as apps/examples/ddp_regression.cc does; every sample has
// y = 2 x0 + 3 x1.
//
// Exits 0 when every rank's loss fell, the ranks ended with the same w bit for bit
// (DataParallel averaged their gradients) and w is [[2], [3]]; 1 otherwise.
#include <cmath>
#include <cstdio>
#include <vector>

#include "absl/status/statusor.h"
#include "nn/nn.h"
#include "optim/sgd.h"
#include "spawn/train/data_parallel.h"
#include "spawn/spawn.h"

namespace {

namespace nn = ::tandem::nn;
namespace dist = ::tandem::dist;

struct Model : nn::Module {
  Model() : w(register_parameter("w", nn::zeros({2, 1}))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return nn::matmul(x, w); }
  nn::Tensor w;
};

struct RankResult {
  float first_loss = 0;
  float last_loss = 0;
  std::vector<float> w;
};

RankResult Train(dist::Context& ctx) {
  const bool rank0 = ctx.rank() == 0;
  nn::Tensor x = nn::from_vector(rank0 ? std::vector<float>{1, 2, 2, 3}
                                       : std::vector<float>{4, 6, 3, 1}, {2, 2});
  nn::Tensor y = nn::from_vector(rank0 ? std::vector<float>{8, 13}
                                       : std::vector<float>{26, 9}, {2, 1});
  Model model;
  dist::DataParallel dp(model, ctx);
  nn::MSELoss loss_fn(nn::Reduction::kSum);
  tandem::optim::SGD sgd(dp.parameters(), {.lr = 0.01});
  RankResult result;
  constexpr int kSteps = 500;
  for (int step = 0; step < kSteps; ++step) {
    nn::Tensor loss = loss_fn(dp(x), y);
    if (step == 0) result.first_loss = loss.item();
    if (step == kSteps - 1) result.last_loss = loss.item();
    loss.backward();
    sgd.step();
    sgd.zero_grad();
  }
  result.w = model.w.to_vector<float>();
  return result;
}

}  // namespace

int main() {
  absl::StatusOr<std::vector<RankResult>> results = dist::spawn(Train, /*nprocs=*/2, "cpu");
  if (!results.ok()) {
    std::fprintf(stderr, "train_two_ranks: %s\n", results.status().ToString().c_str());
    return 1;
  }
  bool ok = results->size() == 2;
  for (size_t rank = 0; rank < results->size(); ++rank) {
    const RankResult& r = (*results)[rank];
    std::printf("rank %zu: loss %g -> %g, w = [[%.4f], [%.4f]]\n", rank, r.first_loss,
                r.last_loss, r.w[0], r.w[1]);
    if (!(r.last_loss < 1e-3f * r.first_loss)) {
      std::fprintf(stderr, "train_two_ranks: rank %zu's loss did not fall\n", rank);
      ok = false;
    }
    if (r.w != (*results)[0].w) {
      std::fprintf(stderr, "train_two_ranks: rank %zu's w differs from rank 0's\n", rank);
      ok = false;
    }
    if (std::fabs(r.w[0] - 2) > 1e-3f || std::fabs(r.w[1] - 3) > 1e-3f) {
      std::fprintf(stderr, "train_two_ranks: rank %zu's w is not [[2], [3]]\n", rank);
      ok = false;
    }
  }
  if (ok) std::printf("train_two_ranks: ok\n");
  return ok ? 0 : 1;
}
