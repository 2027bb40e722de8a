// hapi::Model::fit on one GPU rank (NCCL): FitOptions::cuda_graph (the step
// captured after the first full batch and replayed; the partial last batch of
// each epoch eager) ends with the eager fit's weights and epoch losses within
// 1e-6 relative (the replay runs the eager step's kernels; the bound leaves
// room for a kernel the capture may choose differently), and a fit with
// cuda_graph under an in-process restart (the graph dies with its attempt and
// is captured again; the step after the restart runs eagerly) ends within
// the same bound of the fault-free captured fit; a CrossEntropy class weight
// given on the CPU reaches the rank's GPU.
// Skipped, with the reason, without a GPU.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/layers.h"
#include "nn/nn.h"
#include "optim/adam.h"
#include "testing/run.h"
#include "tests/gpu_test_util.h"
#include "tests/hapi/classification.h"

namespace tandem::hapi {
namespace {

using ::tandem::testing::Classification;

struct Net : nn::Module {
  Net() : l1(register_module("l1", nn::Linear(4, 16))), l2(register_module("l2", nn::Linear(16, 3))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

std::unique_ptr<Model> OnGpu(int max_restarts, LossFunction loss = CrossEntropy()) {
  LaunchOptions launch{.gpus = "0", .nprocs = 1, .spawn = testing::DefaultTestSpawnOptions()};
  launch.spawn.restart = {.max_restarts = max_restarts};
  auto model = std::make_unique<Model>([] { return std::make_shared<Net>(); }, launch);
  model->prepare(
      [](std::vector<nn::Tensor> params) {
        return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = 1e-2});
      },
      std::move(loss), {MakeMetric<Accuracy>()});
  return model;
}

// The largest relative difference of two models' weights.
double LargestDifference(Model& a, Model& b) {
  absl::StatusOr<nn::StateDict> wa = a.state_dict(), wb = b.state_dict();
  EXPECT_TRUE(wa.ok() && wb.ok());
  if (!wa.ok() || !wb.ok()) return INFINITY;
  double largest = 0;
  for (size_t i = 0; i < wa->size(); ++i) {
    const std::vector<double> x = (*wa)[i].second.to_vector<double>();
    const std::vector<double> y = (*wb)[i].second.to_vector<double>();
    for (size_t j = 0; j < x.size(); ++j)
      largest = std::max(largest, std::abs(x[j] - y[j]) / (1 + std::abs(y[j])));
  }
  return largest;
}

class FitGpuTest : public testing::GpuTest {};

// A class weight given on the CPU reaches the GPU rank (copied once, at its first,
// eager step, before a capture), eager and captured alike.
TEST_F(FitGpuTest, CrossEntropyWeightOnTheCpuIsCopiedToTheRankDevice) {
  auto train = Classification(70, 5);
  const nn::CrossEntropyOptions options{
      .weight = nn::from_vector(std::vector<float>{1.0f, 2.0f, 0.5f}, {3}),
      .label_smoothing = 0.1};
  auto eager = OnGpu(0, CrossEntropy(options)), captured = OnGpu(0, CrossEntropy(options));
  absl::StatusOr<History> a = eager->fit(train, {.epochs = 2, .batch_size = 8, .seed = 1});
  absl::StatusOr<History> b =
      captured->fit(train, {.epochs = 2, .batch_size = 8, .seed = 1, .cuda_graph = true});
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  for (size_t e = 0; e < a->epochs.size(); ++e) {
    EXPECT_NEAR(b->epochs[e].at("loss"), a->epochs[e].at("loss"),
                1e-6 * (1 + std::abs(a->epochs[e].at("loss"))))
        << "epoch " << e;
  }
}

// 70 examples in batches of 8: 8 full batches and a partial one of 6 per epoch.
TEST_F(FitGpuTest, CapturedStepEndsAsTheEagerFit) {
  auto train = Classification(70, 5);
  auto eager = OnGpu(0), captured = OnGpu(0);
  absl::StatusOr<History> a = eager->fit(train, {.epochs = 3, .batch_size = 8, .seed = 1});
  absl::StatusOr<History> b =
      captured->fit(train, {.epochs = 3, .batch_size = 8, .seed = 1, .cuda_graph = true});
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  ASSERT_EQ(a->epochs.size(), b->epochs.size());
  for (size_t e = 0; e < a->epochs.size(); ++e) {
    EXPECT_NEAR(b->epochs[e].at("loss"), a->epochs[e].at("loss"),
                1e-6 * (1 + std::abs(a->epochs[e].at("loss"))))
        << "epoch " << e;
  }
  const double difference = LargestDifference(*captured, *eager);
  std::printf("fit with cuda_graph vs eager, one GPU rank, 3 epochs: weights within %.3g\n",
              difference);
  EXPECT_LE(difference, 1e-6);
}

TEST_F(FitGpuTest, CapturedStepUnderARestartEndsAsTheFaultFreeFit) {
  struct ThrowAt11 : Callback {
    std::string name() const override { return "ThrowAt11"; }
    void on_train_batch_end(RunState& s) override {
      if (s.ctx->attempt() == 0 && s.step == 11) throw Error("injected");
    }
  };
  auto train = Classification(70, 5);
  FitOptions options{.epochs = 3, .batch_size = 8, .seed = 1, .cuda_graph = true,
                     .snapshot_every_steps = 1};
  auto straight = OnGpu(1);
  absl::StatusOr<History> a = straight->fit(train, options);
  auto faulted = OnGpu(1);
  options.callbacks = {MakeCallback<ThrowAt11>()};
  absl::StatusOr<History> b = faulted->fit(train, options);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(b->restored_snapshot_step, 10);
  EXPECT_EQ(b->steps, a->steps);
  const double difference = LargestDifference(*faulted, *straight);
  std::printf("fit with cuda_graph, a fault after step 11 and a restart vs the fault-free "
              "fit: weights within %.3g\n", difference);
  EXPECT_LE(difference, 1e-6);
}

}  // namespace
}  // namespace tandem::hapi
