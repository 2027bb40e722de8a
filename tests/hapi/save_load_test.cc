// hapi::Model::save / load with the optimizer state (Paddle's
// model.save(path, training) and model.load(path, reset_optimizer)): a fit
// after save, a new Model and load continues bit for bit as the unbroken fit
// (Adam, 1 and 2 ranks, ZeRO), weights only and reset_optimizer start the
// optimizer fresh (and so part from it), a load before prepare() waits for
// it, a fit that fails leaves the loaded state for the next one, inside
// ranks the process's first rank writes (once) for every rank, and an
// optimizer file of another type, parameter count or shapes, a corrupt,
// truncated or foreign file, or one next to other weights than it was saved
// with, is refused naming the file and what differs, leaving the Model as it
// was.
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/nn.h"
#include "nn/safetensors.h"
#include "nn/status_macros.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "testing/run.h"
#include "tests/hapi/classification.h"
#include "tests/hapi/hapi_test_util.h"
#include "tests/hapi/temporary_files.h"

namespace tandem::hapi {
namespace {

using Net = ::tandem::testing::TwoLayerNet;
using ::tandem::testing::Classification;
using test::Cpu;
using test::AdamFactory;
using test::Contains;

OptimizerFactory SgdFactory() {
  return [](std::vector<nn::Tensor> params) {
    return std::make_unique<optim::SGD>(std::move(params),
                                        optim::SGDOptions{.lr = 1e-2, .momentum = 0.9});
  };
}

// 4 features -> Linear(4, hidden) -> ReLU -> Linear(hidden, 3), and with
// `extra` a third Linear(3, 3): another shape or parameter count than Net's.
struct OtherNet : nn::Module {
  OtherNet(int64_t hidden, bool extra)
      : l1(register_module("l1", nn::Linear(4, hidden))),
        l2(register_module("l2", nn::Linear(hidden, 3))),
        l3(extra ? register_module("l3", nn::Linear(3, 3)) : nn::Linear(3, 3)),
        extra_(extra) {}
  nn::Tensor forward(const nn::Tensor& x) override {
    nn::Tensor y = l2(nn::relu(l1(x)));
    return extra_ ? l3(y) : y;
  }
  nn::Linear l1, l2, l3;
  bool extra_;
};

// A Model of Net on `ranks` CPU ranks prepared with Adam, its initial
// weights drawn from one seed (so every such Model starts alike).
std::unique_ptr<Model> Prepared(int ranks, OptimizerFactory optimizer = AdamFactory()) {
  auto model = std::make_unique<Model>([] { return std::make_shared<Net>(); }, Cpu(ranks));
  model->prepare(std::move(optimizer), CrossEntropy());
  return model;
}

void Seed(Model& model) {
  nn::manual_seed(11);
  ASSERT_TRUE(model.state_dict().ok());
}

FitOptions OneEpochOptions(int epochs, int ranks, bool zero) {
  // 24 examples, a global batch of 8: 3 steps an epoch, the same samples in the
  // same order every epoch (Paddle's and tandem's fit count epochs from 0 again).
  return {.epochs = epochs, .batch_size = 8 / ranks, .shuffle = false, .zero = zero};
}

// A Model of Net fitted one epoch (Adam, 1 rank) on `train`, saved to `path`
// with its optimizer file.
std::unique_ptr<Model> SavedAfterOneEpoch(const std::shared_ptr<const data::Dataset>& train,
                                          const std::string& path) {
  auto model = Prepared(1);
  EXPECT_TRUE(model->fit(train, OneEpochOptions(1, 1, false)).ok());
  EXPECT_TRUE(model->save(path).ok());
  EXPECT_TRUE(std::filesystem::exists(OptimizerStatePath(path)));
  return model;
}

bool SameBits(const nn::StateDict& a, const nn::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.to_vector<float>() != b[i].second.to_vector<float>())
      return false;
  }
  return true;
}

std::string Dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/hapi_save_load_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// fit(2 epochs) against fit(1), save, a new Model, load, fit(1): the same
// second epoch's loss and the same weights, bit for bit, with Adam on 1 and 2
// ranks, with and without ZeRO (whose file holds the unsharded state). The
// same with the weights only, or with reset_optimizer, starts Adam's moments
// and step counts afresh: that second epoch differs (the check can fail).
TEST(SaveLoadTest, AFitAfterSaveAndLoadContinuesBitForBit) {
  auto train = Classification(24, 31);
  struct Case {
    int ranks;
    bool zero;
    bool load_before_prepare;
  };
  for (const Case c : {Case{1, false, false}, Case{2, false, false}, Case{2, true, false},
                       Case{1, true, false}, Case{2, false, true}}) {
    SCOPED_TRACE(::testing::Message() << c.ranks << " ranks, zero " << c.zero
                                      << ", load before prepare " << c.load_before_prepare);
    const std::string dir = Dir("continue");
    auto unbroken = Prepared(c.ranks);
    Seed(*unbroken);
    auto two = unbroken->fit(train, OneEpochOptions(2, c.ranks, c.zero));
    ASSERT_TRUE(two.ok()) << two.status();
    ASSERT_EQ(two->epochs.size(), 2u);
    auto unbroken_weights = unbroken->state_dict();
    ASSERT_TRUE(unbroken_weights.ok());

    auto first = Prepared(c.ranks);
    Seed(*first);
    auto one = first->fit(train, OneEpochOptions(1, c.ranks, c.zero));
    ASSERT_TRUE(one.ok()) << one.status();
    EXPECT_EQ(one->epochs[0].at("loss"), two->epochs[0].at("loss"));
    const std::string path = dir + "/model.safetensors";
    ASSERT_TRUE(first->save(path).ok());
    ASSERT_TRUE(std::filesystem::exists(OptimizerStatePath(path)));
    const std::string weights_only = dir + "/weights.safetensors";
    ASSERT_TRUE(first->save(weights_only, {.training = false}).ok());
    EXPECT_FALSE(std::filesystem::exists(OptimizerStatePath(weights_only)));

    // A new Model: nothing in memory from the first.
    auto second = std::make_unique<Model>([] { return std::make_shared<Net>(); }, Cpu(c.ranks));
    if (c.load_before_prepare) {
      ASSERT_TRUE(second->load(path).ok());
      second->prepare(AdamFactory(), CrossEntropy());
    } else {
      second->prepare(AdamFactory(), CrossEntropy());
      ASSERT_TRUE(second->load(path).ok());
    }
    auto resumed = second->fit(train, OneEpochOptions(1, c.ranks, c.zero));
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    EXPECT_EQ(resumed->epochs[0].at("loss"), two->epochs[1].at("loss"));
    auto resumed_weights = second->state_dict();
    ASSERT_TRUE(resumed_weights.ok());
    EXPECT_TRUE(SameBits(*resumed_weights, *unbroken_weights));

    // Fresh optimizer state: the same weights, another second epoch.
    for (int variant = 0; variant < 2; ++variant) {
      auto fresh = Prepared(c.ranks);
      ASSERT_TRUE((variant == 0 ? fresh->load(weights_only)
                                : fresh->load(path, {.reset_optimizer = true}))
                      .ok());
      auto h = fresh->fit(train, OneEpochOptions(1, c.ranks, c.zero));
      ASSERT_TRUE(h.ok()) << h.status();
      auto w = fresh->state_dict();
      ASSERT_TRUE(w.ok());
      EXPECT_FALSE(SameBits(*w, *unbroken_weights)) << "variant " << variant;
      EXPECT_NE(h->epochs[0].at("loss"), two->epochs[1].at("loss")) << "variant " << variant;
    }
  }
}

// With ZeRO the optimizer file holds the unsharded state: a 2-rank ZeRO
// fit's file holds the same entries as the same 2-rank fit's without ZeRO,
// and it continues on another world size, with ZeRO (3 ranks: uneven shards)
// or without, as that file does.
TEST(SaveLoadTest, AZeroFileIsUnshardedAndLoadsOnAnotherWorldSize) {
  auto train = Classification(24, 39);
  const std::string dir = Dir("zero_world");
  const std::string zero_path = dir + "/zero.safetensors";
  const std::string plain_path = dir + "/plain.safetensors";
  for (bool zero : {true, false}) {
    auto model = Prepared(2);
    Seed(*model);
    ASSERT_TRUE(model->fit(train, OneEpochOptions(1, 2, zero)).ok());
    ASSERT_TRUE(model->save(zero ? zero_path : plain_path).ok());
  }
  auto zero_file = nn::LoadCheckpoint(OptimizerStatePath(zero_path));
  auto plain_file = nn::LoadCheckpoint(OptimizerStatePath(plain_path));
  ASSERT_TRUE(zero_file.ok()) << zero_file.status();
  ASSERT_TRUE(plain_file.ok()) << plain_file.status();
  ASSERT_EQ(zero_file->tensors.size(), plain_file->tensors.size());
  for (const auto& [name, t] : plain_file->tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(zero_file->tensors.contains(name));
    EXPECT_EQ(zero_file->tensors.at(name).shape(), t.shape());
    if (t.dtype() == nn::kFloat32)
      EXPECT_EQ(zero_file->tensors.at(name).to_vector<float>(), t.to_vector<float>());
  }
  EXPECT_EQ(zero_file->metadata, plain_file->metadata);

  for (const auto& [ranks, zero] : std::vector<std::pair<int, bool>>{{1, false}, {1, true}, {3, true}}) {
    SCOPED_TRACE(::testing::Message() << ranks << " ranks, zero " << zero);
    std::vector<nn::StateDict> weights;
    for (const std::string& path : {zero_path, plain_path}) {
      auto model = Prepared(ranks);
      ASSERT_TRUE(model->load(path).ok());
      auto h = model->fit(train, {.epochs = 1, .batch_size = 24 / ranks / 3, .shuffle = false,
                                  .zero = zero});
      ASSERT_TRUE(h.ok()) << h.status();
      weights.push_back(*model->state_dict());
    }
    EXPECT_TRUE(SameBits(weights[0], weights[1]));
  }
}

// save() after a load carries the loaded optimizer state on: a chain of
// save and load is the same as one save.
TEST(SaveLoadTest, ALoadedStateIsSavedAgain) {
  auto train = Classification(24, 32);
  const std::string dir = Dir("chain");
  auto unbroken = Prepared(1);
  Seed(*unbroken);
  ASSERT_TRUE(unbroken->fit(train, OneEpochOptions(2, 1, false)).ok());
  auto first = Prepared(1);
  Seed(*first);
  ASSERT_TRUE(first->fit(train, OneEpochOptions(1, 1, false)).ok());
  ASSERT_TRUE(first->save(dir + "/a.safetensors").ok());
  auto middle = Prepared(1);
  ASSERT_TRUE(middle->load(dir + "/a.safetensors").ok());
  ASSERT_TRUE(middle->save(dir + "/b.safetensors").ok());
  auto last = Prepared(1);
  ASSERT_TRUE(last->load(dir + "/b.safetensors").ok());
  ASSERT_TRUE(last->fit(train, OneEpochOptions(1, 1, false)).ok());
  EXPECT_TRUE(SameBits(*last->state_dict(), *unbroken->state_dict()));
}

// A save of the weights only removes the optimizer file an earlier save left
// at the same path: it belongs to other weights.
TEST(SaveLoadTest, AWeightsOnlySaveRemovesAnEarlierOptimizerFile) {
  auto train = Classification(24, 33);
  const std::string dir = Dir("stale");
  const std::string path = dir + "/model.safetensors";
  auto model = SavedAfterOneEpoch(train, path);
  ASSERT_TRUE(model->save(path, {.training = false}).ok());
  EXPECT_FALSE(std::filesystem::exists(OptimizerStatePath(path)));
  // A model without optimizer state (never fitted) writes none either.
  ASSERT_TRUE(model->save(path).ok());
  ASSERT_TRUE(std::filesystem::exists(OptimizerStatePath(path)));
  auto unfitted = Prepared(1);
  ASSERT_TRUE(unfitted->save(path).ok());
  EXPECT_FALSE(std::filesystem::exists(OptimizerStatePath(path)));
}

// An optimizer file left next to other weights than the ones it was saved
// with (another writer of the weights' path: ModelCheckpoint's final.safetensors,
// nn::SaveSafetensors, a copy; or a save that failed between its weights and
// its optimizer file) is refused at load, before and after prepare(), naming
// both files; reset_optimizer takes the weights alone.
TEST(SaveLoadTest, AnOptimizerFileOfOtherWeightsIsRefused) {
  auto train = Classification(24, 37);
  const std::string dir = Dir("other_weights");
  const std::string path = dir + "/model.safetensors";
  auto saved = SavedAfterOneEpoch(train, path);
  // The same network fitted one more epoch, its weights alone over `path`.
  ASSERT_TRUE(saved->fit(train, OneEpochOptions(1, 1, false)).ok());
  Net network;
  ASSERT_TRUE(network.load_state_dict(*saved->state_dict()).ok());
  ASSERT_TRUE(nn::SaveSafetensors(path, network).ok());

  for (bool prepared : {true, false}) {
    SCOPED_TRACE(prepared ? "after prepare" : "before prepare");
    Model model([] { return std::make_shared<Net>(); }, Cpu(1));
    if (prepared) model.prepare(AdamFactory(), CrossEntropy());
    absl::Status s = model.load(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s, "hapi::Model::load: " + OptimizerStatePath(path) +
                                " was saved with other weights than " + path))
        << s;
    EXPECT_TRUE(model.load(path, {.reset_optimizer = true}).ok());
  }
}

// Threads that each save their own (equal) Model to one path at once, from
// outside spawn, as the processes of a job on a shared filesystem do (each
// process's first rank writes): a save, once it returns, leaves an optimizer
// file for its thread to load, whatever the other saves are doing (no save
// removes the file another has written).
TEST(SaveLoadTest, ConcurrentSavesToOnePathLeaveTheOptimizerFile) {
  auto train = Classification(24, 38);
  const std::string dir = Dir("concurrent");
  const std::string path = dir + "/model.safetensors";
  auto fitted = SavedAfterOneEpoch(train, path);
  constexpr int kRanks = 4;
  constexpr int kSaves = 40;
  std::vector<std::unique_ptr<Model>> models;
  for (int r = 0; r < kRanks; ++r) {
    models.push_back(Prepared(1));
    ASSERT_TRUE(models.back()->load(path).ok());
  }
  std::atomic<int> missing{0}, failed{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      for (int i = 0; i < kSaves; ++i) {
        if (!models[r]->save(path).ok()) ++failed;
        if (!std::filesystem::exists(OptimizerStatePath(path))) ++missing;
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(missing.load(), 0) << "of " << kRanks * kSaves << " saves";
  auto loaded = Prepared(1);
  EXPECT_TRUE(loaded->load(path).ok());
}

// Model::save inside a rank's function on 2 and 3 CPU ranks, each rank with its
// own Model: the process's first rank writes each file once (not once per
// rank), and every rank finds both files when its save returns and loads them.
TEST(SaveLoadTest, InsideRanksTheProcesssFirstRankWritesOnce) {
  auto train = Classification(24, 40);
  for (int ranks : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << ranks << " ranks");
    const std::string dir = Dir(absl::StrCat("inside_ranks_", ranks));
    const std::string path = dir + "/model.safetensors";
    testing::TemporaryFiles writes(dir);
    ASSERT_TRUE(writes.ok()) << "inotify: " << std::strerror(errno);
    std::atomic<int> missing{0};
    absl::Status run = dist::spawn(
        [&](dist::Context&) -> absl::Status {
          Model model([] { return std::make_shared<Net>(); });
          model.prepare(AdamFactory(), CrossEntropy());
          absl::StatusOr<History> h = model.fit(train, {.epochs = 1, .batch_size = 4});
          if (!h.ok()) return h.status();
          RETURN_IF_ERROR(model.save(path));
          if (!std::filesystem::exists(path) ||
              !std::filesystem::exists(OptimizerStatePath(path))) {
            ++missing;
          }
          return model.load(path);
        },
        ranks, "cpu", testing::DefaultTestSpawnOptions());
    ASSERT_TRUE(run.ok()) << run;
    EXPECT_EQ(missing.load(), 0);
    const std::map<std::string, testing::Writes> once = {{"model.safetensors", {1, 1}},
                                                         {"model.safetensors.optim", {1, 1}}};
    EXPECT_EQ(writes.Take(), once);
  }
}

// A save that fails inside ranks fails on every rank: the writer with its own
// error, the others naming the path and the failed writer.
TEST(SaveLoadTest, InsideRanksAFailedWriteIsAnErrorOnEveryRank) {
  const std::string path = Dir("failed_write") + "/no_such_dir/model.safetensors";
  std::vector<absl::Status> saved(2);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        saved[static_cast<size_t>(ctx.rank())] = model.save(path);
        return absl::OkStatus();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_TRUE(Contains(saved[0], path)) << saved[0];
  EXPECT_TRUE(Contains(saved[1], "hapi::Model::save: " + path + ": 1 rank failed to save it"))
      << saved[1];
}

// What the other rank does while rank 0 saves alone.
enum class Meanwhile { kReturns, kEvaluates, kFitsAgain, kWaitsInABarrier };

// A save on rank 0 alone inside the ranks' function (`if (rank == 0)
// save(path)`, as a PyTorch script saves) fails the run within seconds, not at
// the watchdog's timeout, naming Model::save and telling to call it on every rank,
// whatever rank 1 does meanwhile: return, or go on to another collective.
TEST(SaveLoadTest, InsideRanksASaveOnOneRankAloneFailsNamingSave) {
  auto train = Classification(24, 41);
  const std::string path = Dir("one_rank_alone") + "/model.safetensors";
  for (Meanwhile meanwhile : {Meanwhile::kReturns, Meanwhile::kEvaluates, Meanwhile::kFitsAgain,
                              Meanwhile::kWaitsInABarrier}) {
    SCOPED_TRACE(::testing::Message() << "rank 1's next step " << static_cast<int>(meanwhile));
    const auto start = std::chrono::steady_clock::now();
    absl::Status run = dist::spawn(
        [&](dist::Context& ctx) -> absl::Status {
          Model model([] { return std::make_shared<Net>(); });
          model.prepare(AdamFactory(), CrossEntropy());
          absl::StatusOr<History> h = model.fit(train, {.epochs = 1, .batch_size = 4});
          if (!h.ok()) return h.status();
          if (ctx.rank() == 0) return model.save(path);
          switch (meanwhile) {
            case Meanwhile::kReturns:
              return absl::OkStatus();
            case Meanwhile::kEvaluates:
              return model.evaluate(train).status();
            case Meanwhile::kFitsAgain:
              return model.fit(train, {.epochs = 1, .batch_size = 4}).status();
            case Meanwhile::kWaitsInABarrier:
              ctx.communicator().barrier();
              return absl::OkStatus();
          }
          return absl::OkStatus();
        },
        2, "cpu", testing::DefaultTestSpawnOptions());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(run.ok());
    EXPECT_TRUE(Contains(run, "from hapi::Model::save (inside a rank's function a collective: "
                              "call it on every rank, not under `if (rank == 0)`"))
        << run;
    EXPECT_LT(seconds, 10.0) << run;  // the watchdog's timeout_s is 60
  }
}

// Writes the optimizer file of a Model of `network` fitted one epoch with
// `optimizer` to `path`'s optimizer file (the weights of `path` stay).
void WriteOptimizerFileOf(NetworkFactory network, OptimizerFactory optimizer,
                          const std::string& path) {
  Model other(std::move(network), Cpu(1));
  other.prepare(std::move(optimizer), CrossEntropy());
  ASSERT_TRUE(other.fit(Classification(24, 34), OneEpochOptions(1, 1, false)).ok());
  const std::string scratch = path + ".other.safetensors";
  ASSERT_TRUE(other.save(scratch).ok());
  std::filesystem::copy_file(OptimizerStatePath(scratch), OptimizerStatePath(path),
                             std::filesystem::copy_options::overwrite_existing);
}

// An optimizer file that does not fit the prepared optimizer is refused at
// load, naming the file and what differs, and the Model is left as it was
// (its weights and its own optimizer state: its next fit is unchanged).
TEST(SaveLoadTest, AnOptimizerFileThatDoesNotFitIsRefusedNamingTheFileAndTheDifference) {
  auto train = Classification(24, 35);
  const std::string dir = Dir("mismatch");
  const std::string path = dir + "/model.safetensors";
  const std::string file = OptimizerStatePath(path);
  auto saved = SavedAfterOneEpoch(train, path);

  auto target = Prepared(1);
  Seed(*target);
  const nn::StateDict before = *target->state_dict();
  auto expect_refused = [&](const std::string& what, absl::StatusCode code,
                            std::vector<std::string> parts) {
    SCOPED_TRACE(what);
    absl::Status s = target->load(path);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_TRUE(Contains(s, file)) << s;
    for (const std::string& part : parts) EXPECT_TRUE(Contains(s, part)) << part << "\n" << s;
    EXPECT_TRUE(SameBits(*target->state_dict(), before));
  };

  // Another type: the file holds Adam's state, the Model is prepared with SGD.
  auto sgd = Prepared(1, SgdFactory());
  absl::Status s = sgd->load(path);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "hapi::Model::load: " + file +
                              " holds the state of an optimizer of type Adam; the prepared "
                              "optimizer is a SGD"))
      << s;

  // Other shapes: Adam's moments of a network with 16 hidden units.
  WriteOptimizerFileOf([] { return std::make_shared<OtherNet>(16, false); }, AdamFactory(), path);
  expect_refused("shapes", absl::StatusCode::kInvalidArgument,
                 {"does not fit the prepared optimizer", "has shape (16, 4)",
                  "the parameter has shape (8, 4)"});
  // Another parameter count: a third layer.
  WriteOptimizerFileOf([] { return std::make_shared<OtherNet>(8, true); }, AdamFactory(), path);
  expect_refused("count", absl::StatusCode::kInvalidArgument,
                 {"'group.0.num_params' is 6 but group 0 has 4 parameters"});

  // Corrupt: one byte of the payload flipped.
  saved->save(path).IgnoreError();
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_GT(bytes.size(), 100u);
  auto write = [&](const std::string& content) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << content;
  };
  std::string flipped = bytes;
  flipped[bytes.size() / 2] = static_cast<char>(flipped[bytes.size() / 2] ^ 0x5a);
  write(flipped);
  expect_refused("corrupt", absl::StatusCode::kDataLoss, {"checksum mismatch"});
  // Truncated.
  write(bytes.substr(0, bytes.size() / 2));
  expect_refused("truncated", absl::StatusCode::kDataLoss, {"truncated"});
  // A checkpoint file that is not an optimizer file.
  nn::Checkpoint foreign;
  foreign.metadata["step"] = int64_t{3};
  ASSERT_TRUE(nn::SaveCheckpoint(file, foreign).ok());
  expect_refused("foreign", absl::StatusCode::kInvalidArgument,
                 {"no string entry \"hapi.optimizer\""});

  // reset_optimizer does not read the file at all.
  EXPECT_TRUE(target->load(path, {.reset_optimizer = true}).ok());
}

// A load before prepare() keeps the file's state until a prepare(); the next
// fit checks it against that optimizer: another type is a FailedPrecondition
// naming the file and both types, and a prepare() with the right one fits.
TEST(SaveLoadTest, ALoadBeforePrepareIsCheckedAtTheNextFit) {
  auto train = Classification(24, 36);
  const std::string dir = Dir("before_prepare");
  const std::string path = dir + "/model.safetensors";
  auto saved = SavedAfterOneEpoch(train, path);

  Model model([] { return std::make_shared<Net>(); }, Cpu(1));
  ASSERT_TRUE(model.load(path).ok());
  // predict needs no prepare and no optimizer.
  ASSERT_TRUE(model.predict(train).ok());
  model.prepare(SgdFactory(), CrossEntropy());
  auto h = model.fit(train, OneEpochOptions(1, 1, false));
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition) << h.status();
  EXPECT_TRUE(Contains(h.status(), "hapi::Model::fit: the optimizer state that load() read "
                                   "before prepare() does not fit the prepared optimizer"))
      << h.status();
  EXPECT_TRUE(Contains(h.status(), OptimizerStatePath(path) +
                                       " holds the state of an optimizer of type Adam; the "
                                       "prepared optimizer is a SGD"))
      << h.status();
  model.prepare(AdamFactory(), CrossEntropy());
  EXPECT_TRUE(model.fit(train, OneEpochOptions(1, 1, false)).ok());
  // Once checked, a new prepare() starts the optimizer fresh, as it always did.
  model.prepare(SgdFactory(), CrossEntropy());
  EXPECT_TRUE(model.fit(train, OneEpochOptions(1, 1, false)).ok());
}

// Fails the fit on rank 1, in on_train_batch_end at step 2 or, with
// `at_end`, in on_train_end: after every collective, when rank 0 has finished
// its fit and kept its weights.
struct FailOnRankOne : Callback {
  explicit FailOnRankOne(bool at_end) : at_end(at_end) {}
  std::string name() const override { return "FailOnRankOne"; }
  void on_train_batch_end(RunState& s) override {
    if (!at_end && s.ctx->rank() == 1 && s.step == 2) throw std::runtime_error("injected");
  }
  void on_train_end(RunState& s, const Logs&) override {
    if (at_end && s.ctx->rank() == 1) throw std::runtime_error("injected");
  }
  bool at_end;
};

// A fit that fails after the optimizer file's check (a step in, or after
// rank 0 kept its weights) changes nothing: the loaded weights and optimizer
// state stay the Model's, a prepare() after it keeps the loaded state as it
// would have before the failed fit, and the next fit ends bit for bit where
// load, prepare, fit does. Either order of load and prepare; 2 CPU ranks.
TEST(SaveLoadTest, AFailedFitLeavesTheLoadedStateForTheNextFit) {
  auto train = Classification(24, 39);
  const std::string dir = Dir("failed_fit");
  const std::string path = dir + "/model.safetensors";
  auto saved = SavedAfterOneEpoch(train, path);
  auto reference = Prepared(2);
  ASSERT_TRUE(reference->load(path).ok());
  auto ref_fit = reference->fit(train, OneEpochOptions(1, 2, false));
  ASSERT_TRUE(ref_fit.ok()) << ref_fit.status();
  auto loaded_weights = saved->state_dict();
  ASSERT_TRUE(loaded_weights.ok());
  for (bool load_before_prepare : {true, false}) {
    for (bool at_end : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "load before prepare " << load_before_prepare
                                      << ", failing at " << (at_end ? "train end" : "step 2"));
      Model model([] { return std::make_shared<Net>(); }, Cpu(2));
      if (!load_before_prepare) model.prepare(AdamFactory(), CrossEntropy());
      ASSERT_TRUE(model.load(path).ok());
      if (load_before_prepare) model.prepare(AdamFactory(), CrossEntropy());
      FitOptions failing = OneEpochOptions(1, 2, false);
      failing.callbacks = {MakeCallback<FailOnRankOne>(at_end)};
      auto failed = model.fit(train, failing);
      ASSERT_FALSE(failed.ok());
      EXPECT_TRUE(Contains(failed.status(), "callback FailOnRankOne failed")) << failed.status();
      auto after = model.state_dict();
      ASSERT_TRUE(after.ok());
      EXPECT_TRUE(SameBits(*after, *loaded_weights)) << "the failed fit's weights were kept";
      // As after load and prepare (load before prepare), or after prepare and
      // load (a prepare after that load starts fresh: none here).
      if (load_before_prepare) model.prepare(AdamFactory(), CrossEntropy());
      auto h = model.fit(train, OneEpochOptions(1, 2, false));
      ASSERT_TRUE(h.ok()) << h.status();
      EXPECT_EQ(h->epochs[0].at("loss"), ref_fit->epochs[0].at("loss"));
      EXPECT_TRUE(SameBits(*model.state_dict(), *reference->state_dict()));
    }
  }
}

// Fails the fit on every rank in on_train_batch_end at step 2.
struct FailAtStepTwo : Callback {
  std::string name() const override { return "FailAtStepTwo"; }
  void on_train_batch_end(RunState& s) override {
    if (s.step == 2) throw std::runtime_error("injected");
  }
};

// Inside a rank's function a fit that throws (caught by the rank's own code)
// leaves a state that load() read before prepare() waiting, as from main: a
// prepare() after it keeps the state, and the next fit ends bit for bit where
// load, prepare, fit does. 2 CPU ranks, each with its own Model.
TEST(SaveLoadTest, InsideRanksAFitThatThrowsLeavesTheLoadedStateWaiting) {
  auto train = Classification(24, 42);
  const std::string path = Dir("inside_ranks_failed_fit") + "/model.safetensors";
  SavedAfterOneEpoch(train, path);
  const FitOptions options = OneEpochOptions(1, 2, false);
  std::vector<int> same(2, 0);
  std::vector<std::string> failures(2);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model reference([] { return std::make_shared<Net>(); });
        RETURN_IF_ERROR(reference.load(path));
        reference.prepare(AdamFactory(), CrossEntropy());
        RETURN_IF_ERROR(reference.fit(train, options).status());
        Model model([] { return std::make_shared<Net>(); });
        RETURN_IF_ERROR(model.load(path));
        model.prepare(AdamFactory(), CrossEntropy());
        FitOptions failing = options;
        failing.callbacks = {MakeCallback<FailAtStepTwo>()};
        try {
          (void)model.fit(train, failing);
        } catch (const Error& e) {
          failures[static_cast<size_t>(ctx.rank())] = e.what();
        }
        model.prepare(AdamFactory(), CrossEntropy());  // keeps the state still waiting
        RETURN_IF_ERROR(model.fit(train, options).status());
        ASSIGN_OR_RETURN(nn::StateDict got, model.state_dict());
        ASSIGN_OR_RETURN(nn::StateDict want, reference.state_dict());
        same[static_cast<size_t>(ctx.rank())] = SameBits(got, want) ? 1 : 0;
        return absl::OkStatus();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(failures[r].find("callback FailAtStepTwo failed"), std::string::npos) << failures[r];
    EXPECT_EQ(same[r], 1) << "rank " << r << ": the loaded optimizer state was not kept";
  }
}

// Inside a rank's function, a save before any fit writes rank 0's fresh
// weights and every rank keeps them (each rank's factory draws its own from
// the rank's generator): its state_dict() and predict() afterwards are those
// of the file, on every rank, as after a first fit, which takes rank 0's.
TEST(SaveLoadTest, InsideRanksASaveBeforeAnyFitKeepsRankZerosWeightsOnEveryRank) {
  auto data = Classification(24, 43);
  const std::string path = Dir("inside_ranks_fresh") + "/model.safetensors";
  std::vector<nn::StateDict> kept(2);
  std::vector<nn::Tensor> predicted(2);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        RETURN_IF_ERROR(model.save(path));
        ASSIGN_OR_RETURN(kept[static_cast<size_t>(ctx.rank())], model.state_dict());
        ASSIGN_OR_RETURN(predicted[static_cast<size_t>(ctx.rank())],
                         model.predict(data, {.batch_size = 4}));
        return absl::OkStatus();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  Model loaded([] { return std::make_shared<Net>(); }, Cpu(1));
  ASSERT_TRUE(loaded.load(path).ok());
  absl::StatusOr<nn::StateDict> file = loaded.state_dict();
  absl::StatusOr<nn::Tensor> want = loaded.predict(data, {.batch_size = 4});
  ASSERT_TRUE(file.ok() && want.ok());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(SameBits(kept[r], *file)) << "rank " << r << " kept other weights than it saved";
    EXPECT_EQ(predicted[r].to_vector<float>(), want->to_vector<float>())
        << "rank " << r << ": predict mixed other weights than the file's";
  }
}

// predict() before any other call keeps the network it built, as evaluate()
// does: inside a rank's function (whose generator moves on) a second predict,
// and the weights state_dict() gives, are those of the first.
TEST(SaveLoadTest, APredictBeforeAnyOtherCallKeepsItsWeights) {
  auto data = Classification(24, 44);
  std::vector<float> first, second, after;
  absl::Status run = dist::spawn(
      [&](dist::Context&) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        ASSIGN_OR_RETURN(nn::Tensor p1, model.predict(data, {.batch_size = 4}));
        ASSIGN_OR_RETURN(nn::Tensor p2, model.predict(data, {.batch_size = 4}));
        RETURN_IF_ERROR(model.state_dict().status());
        ASSIGN_OR_RETURN(nn::Tensor p3, model.predict(data, {.batch_size = 4}));
        first = p1.to_vector<float>();
        second = p2.to_vector<float>();
        after = p3.to_vector<float>();
        return absl::OkStatus();
      },
      1, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_EQ(second, first);
  EXPECT_EQ(after, first);
}

// Inside a rank's function, weights that state_dict() drew on a rank (every
// rank, or rank 1 alone) give way at the next evaluate() or predict() to rank
// 0's on every rank, as at a first fit: afterwards both ranks hold the same
// weights, and rank 0 those it drew (or, where rank 1 alone drew, its fresh
// network's), with no rank left in a broadcast the others skip.
TEST(SaveLoadTest, InsideRanksWeightsAStateDictDrewBecomeRankZerosAtTheNextEvaluateOrPredict) {
  auto data = Classification(24, 45);
  for (const bool every_rank : {true, false}) {
    for (const bool evaluate : {true, false}) {
      SCOPED_TRACE(absl::StrCat(every_rank ? "every rank" : "rank 1 alone", " drew, then ",
                                evaluate ? "evaluate" : "predict"));
      std::vector<nn::StateDict> drawn(2), kept(2);
      absl::Status run = dist::spawn(
          [&](dist::Context& ctx) -> absl::Status {
            const auto r = static_cast<size_t>(ctx.rank());
            Model model([] { return std::make_shared<Net>(); });
            model.prepare(AdamFactory(), CrossEntropy());
            if (every_rank || r == 1) {
              ASSIGN_OR_RETURN(drawn[r], model.state_dict());
            }
            if (evaluate) {
              RETURN_IF_ERROR(model.evaluate(data, {.batch_size = 4}).status());
            } else {
              RETURN_IF_ERROR(model.predict(data, {.batch_size = 4}).status());
            }
            ASSIGN_OR_RETURN(kept[r], model.state_dict());
            return absl::OkStatus();
          },
          2, "cpu", testing::DefaultTestSpawnOptions());
      ASSERT_TRUE(run.ok()) << run;
      EXPECT_FALSE(SameBits(drawn[1], kept[1])) << "rank 1 kept the weights it drew itself";
      EXPECT_TRUE(SameBits(kept[0], kept[1])) << "the ranks hold different weights";
      if (every_rank) EXPECT_TRUE(SameBits(kept[0], drawn[0])) << "rank 0 did not keep its own";
    }
  }
}

// From main, as evaluate() does, a predict() before any other call keeps the
// network its ranks ran (rank 0's draw): a save() afterwards writes that
// network, not one drawn anew on main's thread.
TEST(SaveLoadTest, FromMainASaveAfterAPredictWritesThePredictedNetwork) {
  auto data = Classification(24, 46);
  const std::string path = Dir("from_main_predict") + "/model.safetensors";
  Model model([] { return std::make_shared<Net>(); }, Cpu(2));
  absl::StatusOr<nn::Tensor> predicted = model.predict(data, {.batch_size = 4});
  ASSERT_TRUE(predicted.ok()) << predicted.status();
  ASSERT_TRUE(model.save(path).ok());
  Model loaded([] { return std::make_shared<Net>(); }, Cpu(1));
  ASSERT_TRUE(loaded.load(path).ok());
  absl::StatusOr<nn::Tensor> again = loaded.predict(data, {.batch_size = 4});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->to_vector<float>(), predicted->to_vector<float>());
}

}  // namespace
}  // namespace tandem::hapi
