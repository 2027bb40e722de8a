// Training-state checkpoints on CPU ranks: K steps, a checkpoint in the middle
// of an epoch, then a fresh model, optimizer, schedule and loader (another init
// seed) loaded from the file and K more steps end bit for bit where 2K straight
// steps end: parameters, optimizer state, losses, sampler position, step and
// generators. The model has dropout (so the generators matter), AdamW with a
// warm-up + cosine schedule, a shuffling DistributedBatchSampler and a loader
// with 2 workers. Then the errors: corrupt, truncated, missing and foreign
// files, another model, unmet expectations, world-size changes.
#include "spawn/train/checkpoint.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/reduce.h"
#include "nn/random.h"
#include "nn/status_macros.h"
#include "optim/adam.h"
#include "optim/lr_scheduler.h"
#include "spawn/train/data_parallel.h"
#include "spawn/train/sync_batch_norm.h"
#include "spawn/spawn.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

constexpr int64_t kExamples = 50;
constexpr int64_t kFeatures = 6;
constexpr int64_t kClasses = 3;
constexpr int64_t kPerRankBatch = 4;
// 1 rank: 13 batches per epoch; 2 ranks: 7. K = 10 stops in the middle of an
// epoch either way, and 2K crosses an epoch boundary after the checkpoint.
constexpr int kSteps = 10;

// x: (B, 6) -> (B, 3).
struct DropNet : nn::Module {
  explicit DropNet(int64_t hidden = 16)
      : l1(register_module("l1", nn::Linear(kFeatures, hidden))),
        drop(register_module("drop", nn::Dropout(0.3))),
        l2(register_module("l2", nn::Linear(hidden, kClasses))) {}
  Tensor forward(const Tensor& x) override { return l2(drop(nn::relu(l1(x)))); }
  nn::Linear l1;
  nn::Dropout drop;
  nn::Linear l2;
};

std::shared_ptr<const data::TensorDataset> Dataset() {
  // Built without the thread's generator (the ranks' generators are the point).
  static const auto* dataset = [] {
    std::vector<float> features;
    for (int64_t i = 0; i < kExamples * kFeatures; ++i) {
      features.push_back(2.0f * std::sin(0.37f * static_cast<float>(i) + 1.3f));
    }
    Tensor x = nn::from_vector<float>(features, {kExamples, kFeatures},
                                      {.device = nn::Device::CPU()});
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < kExamples; ++i) labels.push_back((i * 7) % kClasses);
    Tensor y = nn::from_vector<int64_t>(labels, {kExamples},
                                        {.dtype = nn::kInt64, .device = nn::Device::CPU()});
    return new std::shared_ptr<const data::TensorDataset>(
        std::make_shared<data::TensorDataset>(x, y));
  }();
  return *dataset;
}

// Everything a rank trains with, built from scratch (init from the calling
// thread's generator as it stands).
struct Trainer {
  Trainer(Context& ctx, int64_t hidden = 16)
      : net(std::make_shared<DropNet>(hidden)),
        dp(*net, ctx),
        optimizer(net->parameters(), {.lr = 0.05, .weight_decay = 0.01}),
        scheduler(optimizer, /*warmup_steps=*/3, /*start_factor=*/0.1,
                  std::make_unique<optim::CosineAnnealingLR>(optimizer, /*t_max=*/2 * kSteps,
                                                             /*eta_min=*/0.001)),
        sampler(std::make_shared<data::DistributedBatchSampler>(
            kExamples, kPerRankBatch, ctx.world_size(), ctx.rank(), /*shuffle=*/true,
            /*drop_last=*/false, /*seed=*/99)),
        loader(Dataset(), sampler, {.num_workers = 2, .prefetch = 3}) {}

  double Step() {
    std::optional<data::Batch> batch = loader.next();
    if (!batch) {  // epoch boundary
      loader.start_epoch();
      batch = loader.next();
    }
    Tensor loss = nn::cross_entropy(dp(batch->data), batch->target);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    scheduler.step();
    ++step;
    return loss.item();
  }

  TrainingState State() {
    return {.model = net.get(), .optimizer = &optimizer, .scheduler = &scheduler,
            .loader = &loader, .step = &step};
  }

  std::shared_ptr<DropNet> net;
  DataParallel dp;
  optim::AdamW optimizer;
  optim::LinearWarmup scheduler;
  std::shared_ptr<data::DistributedBatchSampler> sampler;
  data::DataLoader loader;
  int64_t step = 0;
};

void AppendBytes(const Tensor& t, std::vector<uint8_t>& out) {
  const Tensor host = t.to(nn::Device::CPU());
  const auto* p = static_cast<const uint8_t*>(host.data_ptr());
  out.insert(out.end(), p, p + host.nbytes());
}

// What must be identical after 2K straight steps and after K + load + K.
struct Snapshot {
  std::vector<double> losses;
  std::vector<uint8_t> params;           // raw bytes of every parameter, in order
  std::vector<uint8_t> optimizer_bytes;  // raw bytes of every optimizer state tensor
  std::map<std::string, double> optimizer_scalars;
  std::map<std::string, double> scheduler;
  int64_t sampler_epoch = 0, sampler_position = 0, step = 0;
  uint64_t seed = 0, stream = 0, offset = 0;
};

Snapshot Take(Trainer& t, std::vector<double> losses) {
  Snapshot s;
  s.losses = std::move(losses);
  for (const Tensor& p : t.net->parameters()) AppendBytes(p, s.params);
  const optim::StateDict opt = t.optimizer.state_dict();
  for (const auto& [name, tensor] : opt.tensors) AppendBytes(tensor, s.optimizer_bytes);
  s.optimizer_scalars = opt.scalars;
  s.scheduler = t.scheduler.state_dict();
  const data::SamplerState state = t.loader.get_state();
  s.sampler_epoch = state.epoch;
  s.sampler_position = state.position;
  s.step = t.step;
  s.seed = nn::thread_generator().seed;
  s.stream = nn::thread_generator().stream;
  s.offset = nn::thread_generator().offset;
  return s;
}

// The program's one directory for its files, made at first use.
const std::filesystem::path& TempDir() {
  static const std::filesystem::path dir = testing::MakeTempDir("tandem_spawn_checkpoint_test");
  return dir;
}

std::string TempPath(const std::string& name) { return (TempDir() / name).string(); }

// Removes the test's files when the program ends.
class TempDirCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(TempDir(), ec);
  }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new TempDirCleanup);

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

bool Contains(const std::string& text, const std::string& piece) {
  return text.find(piece) != std::string::npos;
}

class ResumeTest : public ::testing::TestWithParam<int> {
 protected:
  SpawnOptions options_{.seed = 7, .console = &console_};
  std::ostringstream console_;
};

TEST_P(ResumeTest, FreshObjectsLoadedMidEpochContinueBitForBit) {
  const int world = GetParam();
  const std::string path = TempPath("resume-" + std::to_string(world) + ".ckpt");

  auto straight = spawn(
      [](Context& ctx) {
        Trainer t(ctx);
        std::vector<double> losses;
        for (int k = 0; k < 2 * kSteps; ++k) losses.push_back(t.Step());
        return Take(t, losses);
      },
      world, "cpu", options_);
  ASSERT_TRUE(straight.ok()) << straight.status();

  auto first = spawn(
      [&](Context& ctx) {
        Trainer t(ctx);
        std::vector<double> losses;
        for (int k = 0; k < kSteps; ++k) losses.push_back(t.Step());
        // The loader has prefetched batches past the checkpoint: they must not count.
        TrainingState state = t.State();
        state.extra["program"] = std::string("checkpoint_test");
        state.extra["best_accuracy"] = 0.25;
        const absl::Status s = SaveTrainingCheckpoint(ctx, path, state);
        EXPECT_TRUE(s.ok()) << s;
        return Take(t, losses);
      },
      world, "cpu", options_);
  ASSERT_TRUE(first.ok()) << first.status();

  auto resumed = spawn(
      [&](Context& ctx) {
        nn::manual_seed(4242, ctx.rank());  // another init than the saved run's
        Trainer t(ctx);
        std::vector<uint8_t> fresh;
        for (const Tensor& p : t.net->parameters()) AppendBytes(p, fresh);
        TrainingState state = t.State();
        const absl::Status s = LoadTrainingCheckpoint(
            ctx, path, state, {.expect = {{"program", std::string("checkpoint_test")}}});
        EXPECT_TRUE(s.ok()) << s;
        EXPECT_EQ(state.extra.size(), 2u);
        EXPECT_EQ(ExtraValue<double>(state.extra, "best_accuracy", path).value_or(-1), 0.25);
        EXPECT_EQ(t.step, kSteps);
        std::vector<uint8_t> loaded;
        for (const Tensor& p : t.net->parameters()) AppendBytes(p, loaded);
        EXPECT_NE(fresh, loaded) << "the fresh model already had the saved weights";
        std::vector<double> losses;
        for (int k = 0; k < kSteps; ++k) losses.push_back(t.Step());
        return Take(t, losses);
      },
      world, "cpu", options_);
  ASSERT_TRUE(resumed.ok()) << resumed.status();

  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Snapshot& a = (*straight)[r];
    const Snapshot& b = (*resumed)[r];
    ASSERT_EQ(a.losses.size(), static_cast<size_t>(2 * kSteps));
    // The first K straight losses are the saving run's (the same run so far).
    EXPECT_EQ(std::vector<double>(a.losses.begin(), a.losses.begin() + kSteps), (*first)[r].losses);
    ASSERT_EQ(b.losses.size(), static_cast<size_t>(kSteps));
    for (int k = 0; k < kSteps; ++k) {
      EXPECT_EQ(std::memcmp(&a.losses[kSteps + k], &b.losses[k], sizeof(double)), 0)
          << "loss of step " << kSteps + k + 1 << ": " << a.losses[kSteps + k] << " vs "
          << b.losses[k];
    }
    ASSERT_EQ(a.params.size(), b.params.size());
    EXPECT_EQ(std::memcmp(a.params.data(), b.params.data(), a.params.size()), 0) << "parameters";
    ASSERT_EQ(a.optimizer_bytes.size(), b.optimizer_bytes.size());
    ASSERT_FALSE(a.optimizer_bytes.empty());
    EXPECT_EQ(std::memcmp(a.optimizer_bytes.data(), b.optimizer_bytes.data(),
                          a.optimizer_bytes.size()),
              0)
        << "optimizer state";
    EXPECT_EQ(a.optimizer_scalars, b.optimizer_scalars);
    EXPECT_EQ(a.scheduler, b.scheduler);
    EXPECT_EQ(a.sampler_epoch, b.sampler_epoch);
    EXPECT_EQ(a.sampler_position, b.sampler_position);
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.seed, b.seed);
    EXPECT_EQ(a.stream, b.stream);
    EXPECT_EQ(a.offset, b.offset);
    // The run really crossed into another epoch after the checkpoint.
    EXPECT_GT(a.sampler_epoch, (*first)[r].sampler_epoch);
    EXPECT_GT((*first)[r].sampler_position, 0);
  }
  std::filesystem::remove(path);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ResumeTest, ::testing::Values(1, 2));

class CheckpointErrorTest : public ::testing::Test {
 protected:
  // Writes a 2-rank checkpoint of a default Trainer after 3 steps to `path`.
  void WriteGood(const std::string& path) {
    auto s = spawn(
        [&](Context& ctx) {
          Trainer t(ctx);
          for (int k = 0; k < 3; ++k) t.Step();
          TrainingState state = t.State();
          state.extra["program"] = std::string("checkpoint_test");
          return SaveTrainingCheckpoint(ctx, path, state);
        },
        2, "cpu", options_);
    ASSERT_TRUE(s.ok()) << s;
  }

  // Each rank's LoadTrainingCheckpoint status (as text, "OK" when fine) for a
  // Trainer whose first layer has `hidden` units.
  std::vector<std::string> LoadMessages(const std::string& path, int world, int64_t hidden = 16,
                                        LoadOptions load_options = {}) {
    auto result = spawn(
        [&](Context& ctx) {
          Trainer t(ctx, hidden);
          TrainingState state = t.State();
          return LoadTrainingCheckpoint(ctx, path, state, load_options).ToString();
        },
        world, "cpu", options_);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : std::vector<std::string>{};
  }

  SpawnOptions options_{.seed = 7, .console = &console_};
  std::ostringstream console_;
};

// The optimizer's entries keep the layout checkpoints have always had
// ("optim.<state name>" tensors, "optim.<key>" double scalars, nothing else
// under "optim."), so files written before PutOptimizerEntries still load: a
// file rebuilt with those entries laid out by hand is byte for byte the one
// SaveTrainingCheckpoint wrote, and OptimizerEntriesOf reads the state back.
TEST_F(CheckpointErrorTest, TheOptimizerEntriesKeepTheirLayout) {
  const std::string path = TempPath("layout.ckpt");
  const std::string rebuilt = TempPath("layout-by-hand.ckpt");
  auto result = spawn(
      [&](Context& ctx) -> absl::Status {
        Trainer t(ctx);
        for (int k = 0; k < 3; ++k) t.Step();
        RETURN_IF_ERROR(SaveTrainingCheckpoint(ctx, path, t.State()));
        ASSIGN_OR_RETURN(nn::Checkpoint ck, nn::LoadCheckpoint(path));
        const optim::StateDict opt = t.optimizer.state_dict();
        std::erase_if(ck.tensors, [](const auto& e) { return e.first.starts_with("optim."); });
        std::erase_if(ck.metadata, [](const auto& e) { return e.first.starts_with("optim."); });
        for (const auto& [name, tensor] : opt.tensors) ck.tensors["optim." + name] = tensor;
        for (const auto& [key, value] : opt.scalars) ck.metadata["optim." + key] = value;
        RETURN_IF_ERROR(nn::SaveCheckpoint(rebuilt, ck));
        ASSIGN_OR_RETURN(optim::StateDict back, OptimizerEntriesOf(ck, rebuilt));
        EXPECT_EQ(back.scalars, opt.scalars);
        EXPECT_EQ(back.tensors.size(), opt.tensors.size());
        return absl::OkStatus();
      },
      1, "cpu", options_);
  ASSERT_TRUE(result.ok()) << result;
  EXPECT_EQ(ReadFile(rebuilt), ReadFile(path));
  for (const std::string& m : LoadMessages(rebuilt, 1)) EXPECT_EQ(m, "OK");
}

TEST_F(CheckpointErrorTest, CorruptAndTruncatedFilesNameTheFileAndTheProblem) {
  const std::string path = TempPath("good.ckpt");
  WriteGood(path);
  const std::string bytes = ReadFile(path);
  ASSERT_GT(bytes.size(), 100u);

  const std::string corrupt = TempPath("corrupt.ckpt");
  std::string flipped = bytes;
  flipped[bytes.size() / 2] = static_cast<char>(flipped[bytes.size() / 2] ^ 0x5a);
  WriteFile(corrupt, flipped);
  for (const std::string& m : LoadMessages(corrupt, 2)) {
    EXPECT_TRUE(Contains(m, corrupt) && Contains(m, "checksum mismatch")) << m;
  }

  const std::string truncated = TempPath("truncated.ckpt");
  WriteFile(truncated, bytes.substr(0, bytes.size() - 40));
  for (const std::string& m : LoadMessages(truncated, 2)) {
    EXPECT_TRUE(Contains(m, truncated) && Contains(m, "truncated")) << m;
  }

  const std::string missing = TempPath("does-not-exist.ckpt");
  for (const std::string& m : LoadMessages(missing, 1)) {
    EXPECT_TRUE(Contains(m, missing) && Contains(m, "cannot open")) << m;
  }

  // A valid nn checkpoint that is not a training state.
  const std::string foreign = TempPath("foreign.ckpt");
  nn::Checkpoint plain;
  plain.tensors["w"] = nn::zeros({2}, {.device = nn::Device::CPU()});
  ASSERT_TRUE(nn::SaveCheckpoint(foreign, plain).ok());
  for (const std::string& m : LoadMessages(foreign, 1)) {
    EXPECT_TRUE(Contains(m, foreign) && Contains(m, "training_state.version") &&
                Contains(m, "not a training-state checkpoint"))
        << m;
  }
}

TEST_F(CheckpointErrorTest, AnotherModelNamesTheKeyAndBothShapes) {
  const std::string path = TempPath("model.ckpt");
  WriteGood(path);
  for (const std::string& m : LoadMessages(path, 2, /*hidden=*/8)) {
    EXPECT_TRUE(Contains(m, path) && Contains(m, "model: ") && Contains(m, "l1.weight") &&
                Contains(m, "(16, 6)") && Contains(m, "(8, 6)"))
        << m;
  }
}

TEST_F(CheckpointErrorTest, ExpectationsAndWorldSize) {
  const std::string path = TempPath("expect.ckpt");
  WriteGood(path);  // 2 ranks
  for (const std::string& m :
       LoadMessages(path, 2, 16, {.expect = {{"program", std::string("train_mnist")}}})) {
    EXPECT_TRUE(Contains(m, path) && Contains(m, "FAILED_PRECONDITION") &&
                Contains(m, "\"program\" is \"checkpoint_test\", expected \"train_mnist\""))
        << m;
  }
  for (const std::string& m :
       LoadMessages(path, 2, 16, {.expect = {{"epoch", int64_t{3}}}})) {
    EXPECT_TRUE(Contains(m, path) && Contains(m, "missing entry \"epoch\"")) << m;
  }
  // One rank loads a 2-rank file: loaded, generators left alone, a warning.
  EXPECT_EQ(LoadMessages(path, 1), std::vector<std::string>{"OK"});
  EXPECT_TRUE(Contains(console_.str(), "written by 2 rank(s), this run has 1")) << console_.str();
  const std::vector<std::string> strict =
      LoadMessages(path, 1, 16, {.require_same_world_size = true});
  ASSERT_EQ(strict.size(), 1u);
  EXPECT_TRUE(Contains(strict[0], path) && Contains(strict[0], "written by 2 rank(s)"))
      << strict[0];
}

TEST_F(CheckpointErrorTest, MissingPartsAndBadSaves) {
  const std::string path = TempPath("parts.ckpt");
  // Saved with only the model and the step: loading an optimizer from it fails.
  auto saved = spawn(
      [&](Context& ctx) {
        DropNet net;
        int64_t step = 5;
        return SaveTrainingCheckpoint(ctx, path, {.model = &net, .step = &step});
      },
      1, "cpu", options_);
  ASSERT_TRUE(saved.ok()) << saved;
  for (const std::string& m : LoadMessages(path, 1)) {
    EXPECT_TRUE(Contains(m, path) && Contains(m, "optim.num_groups")) << m;
  }
  // A reserved name among the app entries: every rank gets an error, rank 0 the cause.
  auto bad = spawn(
      [&](Context& ctx) {
        DropNet net;
        TrainingState state{.model = &net};
        state.extra["step"] = int64_t{1};
        return SaveTrainingCheckpoint(ctx, TempPath("bad.ckpt"), state).ToString();
      },
      2, "cpu", options_);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_TRUE(Contains((*bad)[0], "extra entry \"step\"")) << (*bad)[0];
  EXPECT_TRUE(Contains((*bad)[1], "rank 0 could not write it")) << (*bad)[1];
  EXPECT_FALSE(std::filesystem::exists(TempPath("bad.ckpt")));
}

// Checkpoints written before BatchNorm2d kept PyTorch's num_batches_tracked
// lack that entry: they still load (strictly otherwise), with the count at 0.
TEST_F(CheckpointErrorTest, ModelWithoutBatchNormCountsLoads) {
  const std::string path = TempPath("no-batch-count.ckpt");
  std::vector<float> running_mean;
  auto saved = spawn(
      [&](Context& ctx) {
        nn::Sequential net({nn::Conv2d(1, 2, 1), nn::BatchNorm2d(2)});
        net(nn::randn({2, 1, 3, 3}));
        running_mean = net->state_dict()[4].second.to_vector<float>();
        int64_t step = 1;
        return SaveTrainingCheckpoint(ctx, path, {.model = net.get(), .step = &step});
      },
      1, "cpu", options_);
  ASSERT_TRUE(saved.ok()) << saved;
  absl::StatusOr<nn::Checkpoint> ck = nn::LoadCheckpoint(path);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_EQ(ck->tensors.erase("model.1.num_batches_tracked"), 1u);
  ASSERT_TRUE(nn::SaveCheckpoint(path, *ck).ok());
  auto loaded = spawn(
      [&](Context& ctx) {
        nn::Sequential net({nn::Conv2d(1, 2, 1), nn::BatchNorm2d(2)});
        auto* bn = static_cast<nn::BatchNorm2dImpl*>((*net)[1].get());
        bn->num_batches_tracked.fill_(5);
        int64_t step = 0;
        TrainingState state{.model = net.get(), .step = &step};
        const absl::Status s = LoadTrainingCheckpoint(ctx, path, state);
        EXPECT_EQ(bn->running_mean.to_vector<float>(), running_mean);
        EXPECT_EQ(bn->num_batches_tracked.item(), 0.0);
        return s.ToString();
      },
      1, "cpu", options_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, std::vector<std::string>{"OK"});
  // A missing running statistic is still an error naming it.
  ck->tensors.erase("model.1.running_var");
  ASSERT_TRUE(nn::SaveCheckpoint(path, *ck).ok());
  auto broken = spawn(
      [&](Context& ctx) {
        nn::Sequential net({nn::Conv2d(1, 2, 1), nn::BatchNorm2d(2)});
        int64_t step = 0;
        TrainingState state{.model = net.get(), .step = &step};
        return LoadTrainingCheckpoint(ctx, path, state).ToString();
      },
      1, "cpu", options_);
  ASSERT_TRUE(broken.ok()) << broken.status();
  EXPECT_TRUE(Contains((*broken)[0], "missing key '1.running_var'")) << (*broken)[0];
}

// Rank 0's save states how each model buffer relates to the other ranks'
// (broadcast_buffers on / off, SyncBatchNorm, one rank, no DataParallel); the
// statement reads back from the file; a file without it (written before)
// still loads and says it does not state its buffers.
TEST_F(CheckpointErrorTest, SaveStatesWhichBuffersItHolds) {
  const std::vector<std::string> kBuffers = {"1.running_mean", "1.running_var",
                                             "1.num_batches_tracked"};
  enum class Setup { kBroadcastOn, kBroadcastOff, kSyncBatchNorm, kNoDataParallel };
  auto save = [&](const std::string& path, int world, Setup setup) {
    auto s = spawn(
        [&](Context& ctx) {
          nn::Sequential net({nn::Conv2d(1, 2, 1), nn::BatchNorm2d(2)});
          if (setup == Setup::kSyncBatchNorm) ConvertSyncBatchNorm(*net);
          std::optional<DataParallel> dp;
          if (setup != Setup::kNoDataParallel) {
            dp.emplace(*net, ctx,
                       DataParallelOptions{.broadcast_buffers = setup != Setup::kBroadcastOff});
            nn::mean((*dp)(nn::randn({2, 1, 3, 3}))).backward();
          }
          int64_t step = 1;
          return SaveTrainingCheckpoint(ctx, path, {.model = net.get(), .step = &step});
        },
        world, "cpu", options_);
    ASSERT_TRUE(s.ok()) << s;
  };
  auto read = [](const std::string& path) {
    absl::StatusOr<SavedBuffers> b = ReadSavedBuffers(path);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *b : SavedBuffers{};
  };
  auto expect_all = [&](const SavedBuffers& b, BufferSync sync) {
    EXPECT_TRUE(b.stated);
    ASSERT_EQ(b.buffers.size(), kBuffers.size());
    for (size_t i = 0; i < kBuffers.size(); ++i) {
      std::vector<std::string> names;
      for (const SavedBuffer& saved : b.buffers) names.push_back(saved.name);
      EXPECT_NE(std::find(names.begin(), names.end(), kBuffers[i]), names.end()) << kBuffers[i];
      EXPECT_EQ(b.buffers[i].sync, sync) << b.buffers[i].name;
    }
  };
  const std::string on = TempPath("buffers-on.ckpt");
  save(on, 2, Setup::kBroadcastOn);
  const SavedBuffers b_on = read(on);
  expect_all(b_on, BufferSync::kBroadcastFromRank0);
  EXPECT_TRUE(Contains(DescribeSavedBuffers(b_on),
                       "3 buffers rank 0's, broadcast to every rank at each synchronised step "
                       "(broadcast_buffers on)"))
      << DescribeSavedBuffers(b_on);
  const std::string off = TempPath("buffers-off.ckpt");
  save(off, 2, Setup::kBroadcastOff);
  const SavedBuffers b_off = read(off);
  expect_all(b_off, BufferSync::kRank0Only);
  EXPECT_TRUE(Contains(DescribeSavedBuffers(b_off),
                       "rank 0's own, the other ranks' differ (broadcast_buffers off): "
                       "1.num_batches_tracked, 1.running_mean, 1.running_var"))
      << DescribeSavedBuffers(b_off);
  const std::string sync = TempPath("buffers-sync.ckpt");
  save(sync, 2, Setup::kSyncBatchNorm);
  expect_all(read(sync), BufferSync::kSyncBatchNorm);
  const std::string none = TempPath("buffers-no-dp.ckpt");
  save(none, 2, Setup::kNoDataParallel);
  expect_all(read(none), BufferSync::kUnknown);
  const std::string one = TempPath("buffers-one.ckpt");
  save(one, 1, Setup::kBroadcastOff);
  expect_all(read(one), BufferSync::kOneRank);

  // A file without the statement (as written before it existed): loads, not stated.
  absl::StatusOr<nn::Checkpoint> ck = nn::LoadCheckpoint(on);
  ASSERT_TRUE(ck.ok()) << ck.status();
  std::erase_if(ck->metadata,
                [](const auto& entry) { return entry.first.starts_with("training_state.buffer"); });
  const std::string old = TempPath("buffers-old.ckpt");
  ASSERT_TRUE(nn::SaveCheckpoint(old, *ck).ok());
  const SavedBuffers b_old = read(old);
  EXPECT_FALSE(b_old.stated);
  EXPECT_EQ(DescribeSavedBuffers(b_old),
            "not stated (written before checkpoints stated their buffers)");
  auto loaded = spawn(
      [&](Context& ctx) {
        nn::Sequential net({nn::Conv2d(1, 2, 1), nn::BatchNorm2d(2)});
        int64_t step = 0;
        TrainingState state{.model = net.get(), .step = &step};
        const absl::Status s = LoadTrainingCheckpoint(ctx, old, state);
        EXPECT_TRUE(state.extra.empty());  // the statement is the library's, never extra
        return s.ToString();
      },
      2, "cpu", options_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, (std::vector<std::string>{"OK", "OK"}));
  // A model without buffers states none.
  const std::string linear = TempPath("buffers-linear.ckpt");
  ASSERT_TRUE(spawn(
                  [&](Context& ctx) {
                    nn::Linear net(2, 2);
                    DataParallel dp(*net, ctx);
                    int64_t step = 1;
                    return SaveTrainingCheckpoint(ctx, linear, {.model = net.get(), .step = &step});
                  },
                  2, "cpu", options_)
                  .ok());
  EXPECT_EQ(DescribeSavedBuffers(read(linear)), "no buffers");
}

}  // namespace
}  // namespace tandem::dist
