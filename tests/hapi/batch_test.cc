// Model::train_batch / eval_batch / predict_batch inside dist::spawn's
// function (each rank with its own Model), on CPU ranks: a train_batch loop
// over fit's batches ends with fit's weights and epoch losses bit for bit (1
// and 2 ranks); N ranks with batch B step as one rank with batch N * B, and
// so with update = false accumulating micro-batches;
// train_batch, save, load in a new Model, train_batch continues as the
// uninterrupted run; eval_batch and predict_batch equal evaluate and predict
// on the same batches (before and after training batches); state_dict and
// summary on one rank alone between steps leave the run; a load on one rank
// alone between steps fails (alone: a collective mismatch; after an evaluate:
// the optimizer states refused, as fit's); eval_batch takes a rank's empty
// share of a kUneven tail (0 rows); errors: from main, before
// prepare, mismatched shapes, a call on one rank alone named.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/nn.h"
#include "nn/status_macros.h"
#include "optim/adam.h"
#include "spawn/spawn.h"
#include "testing/run.h"
#include "tests/hapi/classification.h"
#include "tests/hapi/hapi_test_util.h"

namespace tandem::hapi {
namespace {

using Net = ::tandem::testing::TwoLayerNet;
using ::tandem::testing::Classification;
using test::Cpu;
using test::AdamFactory;
using test::Contains;

// Every Model of a test starts from the same weights, wherever it builds them.
NetworkFactory FixedNet(uint64_t seed) {
  nn::manual_seed(seed);
  auto weights = std::make_shared<nn::StateDict>(Net().state_dict());
  return [weights] {
    auto net = std::make_shared<Net>();
    EXPECT_TRUE(net->load_state_dict(*weights).ok());
    return net;
  };
}

void ExpectSameBits(const nn::StateDict& got, const nn::StateDict& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first) << where;
    EXPECT_EQ(got[i].second.to_vector<float>(), want[i].second.to_vector<float>())
        << where << ": " << got[i].first;
  }
}

// This rank's batches of fit's training sampler (kWrapGlobalBatch) in `epoch`.
std::vector<data::Batch> FitsBatches(dist::Context& ctx,
                                     const std::shared_ptr<const data::Dataset>& set,
                                     int64_t batch, bool shuffle, uint64_t seed, int epoch,
                                     data::DistributedTail tail =
                                         data::DistributedTail::kWrapGlobalBatch) {
  auto sampler = std::make_shared<data::DistributedBatchSampler>(data::DistributedOptions{
      .dataset_size = set->size(), .batch_size = batch, .num_replicas = ctx.world_size(),
      .rank = ctx.rank(), .shuffle = shuffle, .seed = seed, .tail = tail});
  sampler->set_epoch(epoch);
  data::DataLoader loader(set, sampler);
  std::vector<data::Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

// (1) The same batches as fit's, the same step: the same weights and epoch
// losses, bit for bit, on 1 and 2 ranks (shuffled, two epochs, a wrapped tail).
TEST(HapiBatchTest, ATrainBatchLoopEndsWithFitsWeights) {
  auto set = Classification(23, 71);
  const NetworkFactory factory = FixedNet(5);
  for (int ranks : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(ranks, " ranks"));
    Model fitted(factory, Cpu(ranks));
    fitted.prepare(AdamFactory(), CrossEntropy());
    absl::StatusOr<History> history =
        fitted.fit(set, {.epochs = 2, .batch_size = 4, .shuffle = true, .seed = 9});
    ASSERT_TRUE(history.ok()) << history.status();

    nn::StateDict weights;
    std::vector<double> epoch_loss(2, 0.0);
    absl::Status run = dist::spawn(
        [&](dist::Context& ctx) -> absl::Status {
          Model model(factory);
          model.prepare(AdamFactory(), CrossEntropy());
          for (int epoch = 0; epoch < 2; ++epoch) {
            std::vector<data::Batch> batches = FitsBatches(ctx, set, 4, true, 9, epoch);
            nn::Tensor sum = nn::zeros({}, {.dtype = nn::kFloat64});
            for (const data::Batch& b : batches) {
              ASSIGN_OR_RETURN(nn::Tensor loss, model.train_batch(b.data, b.target));
              EXPECT_EQ(loss.dim(), 0);
              EXPECT_FALSE(loss.requires_grad());
              sum = sum + loss.to(nn::kFloat64);
            }
            // fit's epoch loss: the mean over the steps and ranks.
            nn::Tensor both = nn::from_vector(std::vector<double>{sum.item(),
                                                                  double(batches.size())},
                                              {2}, {.dtype = nn::kFloat64});
            ctx.communicator().all_reduce(both, dist::ReduceOp::kSum);
            if (ctx.rank() == 0) epoch_loss[epoch] = both.to_vector<double>()[0] /
                                                     both.to_vector<double>()[1];
          }
          ASSIGN_OR_RETURN(nn::StateDict kept, model.state_dict());
          if (ctx.rank() == 0) weights = std::move(kept);
          return absl::OkStatus();
        },
        ranks, "cpu", testing::DefaultTestSpawnOptions());
    ASSERT_TRUE(run.ok()) << run;
    ExpectSameBits(weights, *fitted.state_dict(), "train_batch loop vs fit");
    for (int epoch = 0; epoch < 2; ++epoch)
      EXPECT_EQ(epoch_loss[epoch], history->epochs[epoch].at("loss")) << "epoch " << epoch;
  }
}

// The whole set's (x, y) as tensors, for slicing by rows.
std::pair<nn::Tensor, nn::Tensor> Tensors(const std::shared_ptr<const data::Dataset>& set) {
  auto sampler = std::make_shared<data::DistributedBatchSampler>(data::DistributedOptions{
      .dataset_size = set->size(), .batch_size = set->size(), .shuffle = false});
  data::DataLoader loader(set, sampler);
  data::Batch all = *loader.next();
  return {all.data, all.target};
}

// Weights after train_batch over rows [s * global, (s + 1) * global) for each
// step s, each rank taking its slice of `global / ranks` rows.
nn::StateDict TrainSlices(const NetworkFactory& factory, int ranks, int64_t global, int steps,
                          const nn::Tensor& x, const nn::Tensor& y) {
  nn::StateDict weights;
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model(factory);
        model.prepare(AdamFactory(), CrossEntropy());
        const int64_t rows = global / ctx.world_size();
        for (int s = 0; s < steps; ++s) {
          const int64_t begin = s * global + ctx.rank() * rows;
          RETURN_IF_ERROR(
              model.train_batch(x.slice(begin, begin + rows), y.slice(begin, begin + rows))
                  .status());
        }
        ASSIGN_OR_RETURN(nn::StateDict kept, model.state_dict());
        if (ctx.rank() == 0) weights = std::move(kept);
        return absl::OkStatus();
      },
      ranks, "cpu", testing::DefaultTestSpawnOptions());
  EXPECT_TRUE(run.ok()) << run;
  return weights;
}

// (2) DataParallel's equivalence through train_batch: 2 and 4 ranks with
// batch B end where one rank with batch N * B does (within float rounding:
// the all-reduce sums the ranks' gradients in another order).
TEST(HapiBatchTest, NRanksWithBatchBStepAsOneRankWithBatchNB) {
  auto set = Classification(48, 72);
  const auto [x, y] = Tensors(set);
  const NetworkFactory factory = FixedNet(6);
  const nn::StateDict one = TrainSlices(factory, 1, 16, 3, x, y);
  for (int ranks : {2, 4}) {
    const nn::StateDict many = TrainSlices(factory, ranks, 16, 3, x, y);
    ASSERT_EQ(many.size(), one.size());
    for (size_t i = 0; i < one.size(); ++i) {
      const std::vector<float> a = many[i].second.to_vector<float>();
      const std::vector<float> b = one[i].second.to_vector<float>();
      for (size_t k = 0; k < a.size(); ++k)
        ASSERT_NEAR(a[k], b[k], 1e-5) << ranks << " ranks, " << one[i].first << " [" << k << "]";
    }
  }
  // The test can fail: another split of the rows steps elsewhere.
  const nn::StateDict other = TrainSlices(factory, 1, 8, 3, x, y);
  EXPECT_NE(other[0].second.to_vector<float>(), one[0].second.to_vector<float>());
}

// Paddle's update = false: two micro-batches per step, the first only
// accumulating (no all-reduce, no step). 2 ranks with micro-batches of 4 rows
// end where one rank with micro-batches of 8 (both ranks' rows) does; the
// network is unchanged after an update = false call, which enters no collective.
nn::StateDict TrainAccumulated(const NetworkFactory& factory, int ranks, int steps,
                               const nn::Tensor& x, const nn::Tensor& y, bool accumulate) {
  nn::StateDict weights;
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model(factory);
        model.prepare(AdamFactory(), CrossEntropy());
        const int64_t rows = 8 / ctx.world_size();
        for (int s = 0; s < steps; ++s) {
          for (int m = 0; m < 2; ++m) {
            const int64_t begin = s * 16 + m * 8 + ctx.rank() * rows;
            const nn::Tensor probe = x.slice(0, 2);
            ASSIGN_OR_RETURN(nn::Tensor before, model.predict_batch(probe));
            before = before.clone();
            const bool update = !accumulate || m == 1;
            const uint64_t entered = ctx.communicator().collectives_entered();
            RETURN_IF_ERROR(model
                                .train_batch(x.slice(begin, begin + rows),
                                             y.slice(begin, begin + rows), {.update = update})
                                .status());
            ASSIGN_OR_RETURN(nn::Tensor after, model.predict_batch(probe));
            if (update) {
              EXPECT_NE(after.to_vector<float>(), before.to_vector<float>()) << "step " << s;
            } else {
              EXPECT_EQ(after.to_vector<float>(), before.to_vector<float>()) << "step " << s;
              // No all-reduce (no_sync); the first call also builds the run.
              if (s > 0) EXPECT_EQ(ctx.communicator().collectives_entered(), entered);
            }
          }
        }
        ASSIGN_OR_RETURN(nn::StateDict kept, model.state_dict());
        if (ctx.rank() == 0) weights = std::move(kept);
        return absl::OkStatus();
      },
      ranks, "cpu", testing::DefaultTestSpawnOptions());
  EXPECT_TRUE(run.ok()) << run;
  return weights;
}

TEST(HapiBatchTest, UpdateFalseAccumulatesAsOneRankWithTheUnionOfTheBatches) {
  auto set = Classification(48, 78);
  const auto [x, y] = Tensors(set);
  const NetworkFactory factory = FixedNet(11);
  const nn::StateDict one = TrainAccumulated(factory, 1, 3, x, y, true);
  const nn::StateDict two = TrainAccumulated(factory, 2, 3, x, y, true);
  ASSERT_EQ(two.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i) {
    const std::vector<float> a = two[i].second.to_vector<float>();
    const std::vector<float> b = one[i].second.to_vector<float>();
    for (size_t k = 0; k < a.size(); ++k)
      ASSERT_NEAR(a[k], b[k], 1e-5) << one[i].first << " [" << k << "]";
  }
  // Stepping on every micro-batch goes elsewhere: the test can fail.
  const nn::StateDict every = TrainAccumulated(factory, 2, 3, x, y, false);
  EXPECT_NE(every[0].second.to_vector<float>(), one[0].second.to_vector<float>());
}

// (3) train_batch, save, load into a new Model, train_batch: Adam continues as
// the uninterrupted run (its moments and step count travel), bit for bit; a
// fit after train_batch continues from the trained weights and optimizer too.
TEST(HapiBatchTest, SaveAfterTrainBatchKeepsWeightsAndAdamState) {
  auto set = Classification(24, 73);
  const auto [x, y] = Tensors(set);
  const NetworkFactory factory = FixedNet(7);
  const std::string dir = ::testing::TempDir() + "/hapi_batch_save";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  auto step = [&](Model& model, dist::Context& ctx, int s) {
    const int64_t begin = s * 4 + ctx.rank() * 2;
    return model.train_batch(x.slice(begin, begin + 2), y.slice(begin, begin + 2)).status();
  };
  nn::StateDict uninterrupted, resumed, saved_weights;
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        {
          Model model(factory);
          model.prepare(AdamFactory(), CrossEntropy());
          for (int s = 0; s < 6; ++s) RETURN_IF_ERROR(step(model, ctx, s));
          ASSIGN_OR_RETURN(nn::StateDict w, model.state_dict());
          if (ctx.rank() == 0) uninterrupted = std::move(w);
        }
        {
          Model model(factory);
          model.prepare(AdamFactory(), CrossEntropy());
          for (int s = 0; s < 3; ++s) RETURN_IF_ERROR(step(model, ctx, s));
          RETURN_IF_ERROR(model.save(path));
          ASSIGN_OR_RETURN(nn::StateDict w, model.state_dict());
          if (ctx.rank() == 0) saved_weights = std::move(w);
        }
        Model model(factory);
        model.prepare(AdamFactory(), CrossEntropy());
        RETURN_IF_ERROR(model.load(path));
        for (int s = 3; s < 6; ++s) RETURN_IF_ERROR(step(model, ctx, s));
        ASSIGN_OR_RETURN(nn::StateDict w, model.state_dict());
        if (ctx.rank() == 0) resumed = std::move(w);
        return absl::OkStatus();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_TRUE(std::filesystem::exists(OptimizerStatePath(path)));
  ExpectSameBits(resumed, uninterrupted, "save/load between train_batch calls");
  // The file holds the weights after three steps, not the factory's.
  EXPECT_NE(saved_weights[0].second.to_vector<float>(),
            factory()->state_dict()[0].second.to_vector<float>());
  // Without the optimizer state (reset_optimizer) Adam starts again: not the same.
  nn::StateDict reset;
  run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model(factory);
        model.prepare(AdamFactory(), CrossEntropy());
        RETURN_IF_ERROR(model.load(path, {.reset_optimizer = true}));
        for (int s = 3; s < 6; ++s) RETURN_IF_ERROR(step(model, ctx, s));
        ASSIGN_OR_RETURN(nn::StateDict w, model.state_dict());
        if (ctx.rank() == 0) reset = std::move(w);
        return absl::OkStatus();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_NE(reset[0].second.to_vector<float>(), uninterrupted[0].second.to_vector<float>());
}

// A fit after train_batch continues the batch run's weights and Adam state:
// three train_batch steps then a fit of one epoch over the next three
// batches equal six train_batch steps.
TEST(HapiBatchTest, FitAfterTrainBatchContinuesIt) {
  auto set = Classification(24, 74);
  const auto [x, y] = Tensors(set);
  const NetworkFactory factory = FixedNet(8);
  const nn::StateDict six = TrainSlices(factory, 1, 4, 6, x, y);
  auto tail = std::make_shared<data::TensorDataset>(x.slice(12, 24), y.slice(12, 24));
  nn::StateDict continued;
  absl::Status run = dist::spawn(
      [&](dist::Context&) -> absl::Status {
        Model model(factory);
        model.prepare(AdamFactory(), CrossEntropy());
        for (int s = 0; s < 3; ++s)
          RETURN_IF_ERROR(model.train_batch(x.slice(s * 4, s * 4 + 4), y.slice(s * 4, s * 4 + 4))
                              .status());
        RETURN_IF_ERROR(model.fit(tail, {.epochs = 1, .batch_size = 4, .shuffle = false}).status());
        ASSIGN_OR_RETURN(continued, model.state_dict());
        return absl::OkStatus();
      },
      1, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  ExpectSameBits(continued, six, "train_batch x3 then fit vs train_batch x6");
}

// A rank's own reads between train_batch calls (state_dict, summary: no
// collective, e.g. under `if (rank == 0)` to log) leave the batch run as it
// is: the ranks' next steps still meet, and end where the loop without them
// does; state_dict returns the run's current weights.
TEST(HapiBatchTest, ALocalReadOnOneRankKeepsTheBatchRun) {
  auto set = Classification(24, 79);
  const auto [x, y] = Tensors(set);
  const NetworkFactory factory = FixedNet(12);
  const nn::StateDict straight = TrainSlices(factory, 2, 4, 6, x, y);
  for (const std::string read : {"state_dict", "summary"}) {
    SCOPED_TRACE(read);
    nn::StateDict weights, at_three;
    absl::Status run = dist::spawn(
        [&](dist::Context& ctx) -> absl::Status {
          Model model(factory);
          model.prepare(AdamFactory(), CrossEntropy());
          for (int s = 0; s < 6; ++s) {
            if (s == 3 && ctx.rank() == 0) {
              if (read == "state_dict") {
                ASSIGN_OR_RETURN(at_three, model.state_dict());
              } else {
                RETURN_IF_ERROR(model.summary({2, 4}).status());
              }
            }
            const int64_t begin = s * 4 + ctx.rank() * 2;
            RETURN_IF_ERROR(
                model.train_batch(x.slice(begin, begin + 2), y.slice(begin, begin + 2)).status());
          }
          ASSIGN_OR_RETURN(nn::StateDict w, model.state_dict());
          if (ctx.rank() == 0) weights = std::move(w);
          return absl::OkStatus();
        },
        2, "cpu", testing::DefaultTestSpawnOptions());
    ASSERT_TRUE(run.ok()) << run;
    ExpectSameBits(weights, straight, read + " on rank 0 between train_batch calls");
    if (read == "state_dict") {
      // The weights after three steps: trained, not yet the final ones.
      ASSERT_EQ(at_three.size(), straight.size());
      EXPECT_NE(at_three[0].second.to_vector<float>(),
                factory()->state_dict()[0].second.to_vector<float>());
      EXPECT_NE(at_three[0].second.to_vector<float>(), straight[0].second.to_vector<float>());
    }
  }
}

// load() on rank 0 alone between train_batch calls: that rank alone drops its
// batch run, so the next train_batch fails on every rank within seconds,
// naming train_batch (no hang). An evaluate on every rank after it gives
// every rank rank 0's loaded weights, but rank 0 alone holds the loaded Adam
// state (the others their own): the next train_batch or fit is refused on
// every rank, as without the evaluate, rather than stepping the ranks apart.
// A load on every rank continues as the uninterrupted run.
TEST(HapiBatchTest, ALoadOnOneRankBetweenTrainBatchCalls) {
  auto set = Classification(24, 81);
  const auto [x, y] = Tensors(set);
  const NetworkFactory factory = FixedNet(13);
  const std::string dir = ::testing::TempDir() + "/hapi_batch_load_alone";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  auto eval_set = std::make_shared<data::TensorDataset>(x.slice(0, 8), y.slice(0, 8));
  auto tail = std::make_shared<data::TensorDataset>(x.slice(12, 24), y.slice(12, 24));
  auto step = [&](Model& model, dist::Context& ctx, int s) {
    const int64_t begin = s * 4 + ctx.rank() * 2;
    return model.train_batch(x.slice(begin, begin + 2), y.slice(begin, begin + 2)).status();
  };
  // 0: load on rank 0 alone, then train_batch; 1: load on every rank; 2 and
  // 3: load on rank 0 alone, evaluate on every rank, then train_batch (2) or fit (3).
  for (int mode : {0, 1, 2, 3}) {
    SCOPED_TRACE(absl::StrCat("mode ", mode));
    std::vector<nn::StateDict> weights(2);
    const auto start = std::chrono::steady_clock::now();
    absl::Status run = dist::spawn(
        [&](dist::Context& ctx) -> absl::Status {
          Model model(factory);
          model.prepare(AdamFactory(), CrossEntropy());
          for (int s = 0; s < 3; ++s) RETURN_IF_ERROR(step(model, ctx, s));
          RETURN_IF_ERROR(model.save(path));
          RETURN_IF_ERROR(step(model, ctx, 3));  // moves away from the file
          if (mode == 1 || ctx.rank() == 0) RETURN_IF_ERROR(model.load(path));
          if (mode >= 2) RETURN_IF_ERROR(model.evaluate(eval_set, {.batch_size = 4}).status());
          if (mode == 3) {
            RETURN_IF_ERROR(model.fit(tail, {.epochs = 1, .batch_size = 2}).status());
          } else {
            for (int s = 3; s < 6; ++s) RETURN_IF_ERROR(step(model, ctx, s));
          }
          ASSIGN_OR_RETURN(weights[ctx.rank()], model.state_dict());
          return absl::OkStatus();
        },
        2, "cpu", testing::DefaultTestSpawnOptions());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (mode == 1) {
      ASSERT_TRUE(run.ok()) << run;
      ExpectSameBits(weights[1], weights[0], "rank 1 vs rank 0");
      ExpectSameBits(weights[0], TrainSlices(factory, 2, 4, 6, x, y),
                     "load on every rank vs the uninterrupted run");
      continue;
    }
    ASSERT_FALSE(run.ok()) << (weights[0].empty() || weights[1].empty() ||
                                       weights[0][0].second.to_vector<float>() ==
                                           weights[1][0].second.to_vector<float>()
                                   ? "the ranks end with the same weights"
                                   : "the ranks end with different weights");
    EXPECT_LT(seconds, 10.0) << run;  // the watchdog's timeout_s is 60
    if (mode == 0) {
      EXPECT_TRUE(Contains(run, "collective mismatch")) << run;
      EXPECT_TRUE(Contains(run, "from hapi::Model::train_batch (a collective")) << run;
    } else {
      EXPECT_TRUE(Contains(run, mode == 2 ? "hapi::Model::train_batch: rank 0 loaded an optimizer"
                                          : "hapi::Model::fit: rank 0 loaded an optimizer"))
          << run;
      EXPECT_TRUE(Contains(run, "state (a load() there alone) while rank 1 keeps its own"))
          << run;
    }
  }
}

// (4) eval_batch on each rank's batch equals evaluate over a set of those
// batches ("loss" / "eval_loss", "acc" / "eval_acc"), before and after
// train_batch steps; predict_batch equals predict's rows of the rank's batch.
TEST(HapiBatchTest, EvalBatchAndPredictBatchEqualEvaluateAndPredict) {
  auto set = Classification(11, 75);
  auto train = Classification(16, 76);
  const auto [tx, ty] = Tensors(train);
  const NetworkFactory factory = FixedNet(9);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model(factory);
        model.prepare(AdamFactory(), CrossEntropy(), {MakeMetric<Accuracy>()});
        // evaluate's kUneven share of batch 6: one batch per rank (6 and 5 rows).
        std::vector<data::Batch> mine =
            FitsBatches(ctx, set, 6, false, 0, 0, data::DistributedTail::kUneven);
        EXPECT_EQ(mine.size(), 1u);
        for (int round = 0; round < 2; ++round) {
          SCOPED_TRACE(round == 0 ? "before training" : "after train_batch");
          if (round == 1) {
            for (int s = 0; s < 2; ++s) {
              const int64_t begin = s * 8 + ctx.rank() * 4;
              RETURN_IF_ERROR(
                  model.train_batch(tx.slice(begin, begin + 4), ty.slice(begin, begin + 4))
                      .status());
            }
          }
          ASSIGN_OR_RETURN(Logs batch_logs, model.eval_batch(mine[0].data, mine[0].target));
          ASSIGN_OR_RETURN(nn::Tensor predicted, model.predict_batch(mine[0].data));
          EXPECT_EQ(predicted.shape(), (nn::Shape{mine[0].data.size(0), 3}));
          // evaluate and predict fold the batch run first: the same weights.
          ASSIGN_OR_RETURN(Logs logs, model.evaluate(set, {.batch_size = 6}));
          ASSIGN_OR_RETURN(nn::Tensor all, model.predict(set, {.batch_size = 6}));
          EXPECT_EQ(batch_logs.size(), 2u);
          EXPECT_EQ(batch_logs.at("loss"), logs.at("eval_loss"));
          EXPECT_EQ(batch_logs.at("acc"), logs.at("eval_acc"));
          const std::vector<float> got = predicted.to_vector<float>();
          const std::vector<float> want = all.to_vector<float>();
          for (size_t i = 0; i < mine[0].indices.size(); ++i)
            for (size_t c = 0; c < 3; ++c)
              EXPECT_EQ(got[i * 3 + c], want[mine[0].indices[i] * 3 + c]) << "row " << i;
        }
        return absl::OkStatus();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
}

// (4b) evaluate's kUneven share can leave a rank without a batch (13 rows,
// batch 6, 2 ranks: a tail of 1 row, rank 1's share empty): that rank takes
// part in eval_batch with 0 rows, and the logs are evaluate's over the set.
TEST(HapiBatchTest, EvalBatchTakesARanksEmptyShare) {
  auto set = Classification(13, 78);
  const NetworkFactory factory = FixedNet(12);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model(factory);
        model.prepare(AdamFactory(), CrossEntropy({.weight = nn::from_vector(
                                                        std::vector<float>{1, 2, 0.5}, {3})}),
                      {MakeMetric<Accuracy>()});
        std::vector<data::Batch> mine =
            FitsBatches(ctx, set, 6, false, 0, 0, data::DistributedTail::kUneven);
        EXPECT_EQ(mine.size(), ctx.rank() == 0 ? 2u : 1u);
        double loss_sum = 0, correct = 0;
        for (size_t k = 0; k < 2; ++k) {
          const nn::Tensor x = k < mine.size() ? mine[k].data : mine[0].data.slice(0, 0);
          const nn::Tensor y = k < mine.size() ? mine[k].target : mine[0].target.slice(0, 0);
          ASSIGN_OR_RETURN(Logs logs, model.eval_batch(x, y));
          const double rows = k == 0 ? 12 : 1;  // every rank's rows in this call
          correct += logs.at("acc") * rows;
          if (k == 1) loss_sum = logs.at("loss");  // the tail's row alone
        }
        ASSIGN_OR_RETURN(Logs whole, model.evaluate(set, {.batch_size = 6}));
        EXPECT_DOUBLE_EQ(correct / 13, whole.at("eval_acc"));
        EXPECT_TRUE(std::isfinite(loss_sum)) << loss_sum;
        // 0 rows on every rank: nothing to evaluate, refused on every rank.
        absl::Status none =
            model.eval_batch(mine[0].data.slice(0, 0), mine[0].target.slice(0, 0)).status();
        EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument) << none;
        EXPECT_TRUE(Contains(none, "eval_batch: every rank passed 0 rows")) << none;
        return absl::OkStatus();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
}

// (5) Errors: from main, before prepare, shapes that do not match, a batch
// call on one rank alone (the first, which builds the run, and a later one).
TEST(HapiBatchTest, BadCallsAreNamed) {
  auto set = Classification(8, 77);
  const auto [x, y] = Tensors(set);
  Model from_main(FixedNet(10), Cpu(1));
  from_main.prepare(AdamFactory(), CrossEntropy());
  for (const absl::Status& s :
       {from_main.train_batch(x, y).status(), from_main.eval_batch(x, y).status(),
        from_main.predict_batch(x).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(Contains(s, "called from main (outside dist::spawn)")) << s;
    EXPECT_TRUE(Contains(s, "use fit / evaluate / predict from main")) << s;
  }
  absl::Status run = dist::spawn(
      [&](dist::Context&) -> absl::Status {
        Model model(FixedNet(10));
        absl::Status s = model.train_batch(x, y).status();
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
        EXPECT_TRUE(Contains(s, "hapi::Model::train_batch: call prepare(")) << s;
        s = model.eval_batch(x, y).status();
        EXPECT_TRUE(Contains(s, "hapi::Model::eval_batch: call prepare(")) << s;
        model.prepare(AdamFactory(), CrossEntropy());
        s = model.train_batch(x, y.slice(0, 6)).status();
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
        EXPECT_TRUE(Contains(s, "inputs of shape (8, 4) and labels of shape (6)")) << s;
        s = model.train_batch(x.slice(0, 0), y.slice(0, 0)).status();
        EXPECT_TRUE(Contains(s, "inputs of shape (0, 4): a batch needs dim 0")) << s;
        s = model.predict_batch(nn::Tensor()).status();
        EXPECT_TRUE(Contains(s, "hapi::Model::predict_batch: inputs is undefined")) << s;
        return absl::OkStatus();
      },
      1, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;

  for (const std::string call : {"train_batch", "eval_batch"}) {
    for (int together : {0, 1}) {
      SCOPED_TRACE(absl::StrCat(call, ", ", together, " call(s) on every rank first"));
      const auto start = std::chrono::steady_clock::now();
      run = dist::spawn(
          [&](dist::Context& ctx) -> absl::Status {
            Model model(FixedNet(10));
            model.prepare(AdamFactory(), CrossEntropy());
            auto call_it = [&] {
              return call == "train_batch" ? model.train_batch(x, y).status()
                                           : model.eval_batch(x, y).status();
            };
            for (int i = 0; i < together; ++i) RETURN_IF_ERROR(call_it());
            if (ctx.rank() == 1) return absl::OkStatus();
            return call_it();
          },
          2, "cpu", testing::DefaultTestSpawnOptions());
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      ASSERT_FALSE(run.ok());
      EXPECT_TRUE(Contains(run, absl::StrCat("from hapi::Model::", call, " (a collective"))) << run;
      EXPECT_LT(seconds, 10.0) << run;  // the watchdog's timeout_s is 60
    }
  }
}

}  // namespace
}  // namespace tandem::hapi
