// Several processes, one job: run under mpirun (ctest does: label mpi), e.g.
//   tests/spawn/mpirun.sh -np 2 build-cpu/tests/spawn/spawn_mpi_test
// Every process runs every test in the same order; each test's spawn joins all
// processes into one world. References are computed in each process by a
// single-process spawn (SpawnOptions::processes = kOff).
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

// mpi.h here only to read MPI_COMM_WORLD's error handler after the runs (the
// C API only, as spawn/comm/mpi/mpi_transport.cc).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include "gtest/gtest.h"
#include "nn/status_macros.h"
#include "optim/adam.h"
#include "spawn/train/checkpoint.h"
#include "spawn/train/checkpoint_manager.h"
#include "spawn/signals.h"
#include "spawn/spawn.h"
#include "tests/spawn/mpi_fixture.h"
#include "tests/gpu_test_util.h"
#include "tests/spawn/train/dp_models.h"

namespace tandem::dist {
namespace {

using testing::LaunchedIndex;
using testing::LaunchedProcesses;

class MpiTest : public testing::MpiFixture {};

// Deterministic per-rank data: value depends on the global rank and the index,
// with magnitudes that make the summation order visible in float32.
Tensor RankData(int rank, int64_t n, nn::DType dtype) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] =
        dtype == nn::kInt64 ? static_cast<double>((rank + 1) * 1000 + i % 97 - 50)
                            : std::sin(0.37 * i + rank) * std::pow(10.0, (i + rank) % 7 - 3);
  }
  Tensor t = nn::from_vector<double>(v, {n}, {.dtype = nn::kFloat64});
  return t.to(dtype);
}

TEST_F(MpiTest, GlobalWorldRanksInProcessOrder) {
  const int processes = LaunchedProcesses();
  auto placement = spawn(
      [](Context& ctx) {
        return std::vector<int>{ctx.rank(), ctx.world_size(), ctx.local_rank(),
                                ctx.process_index(), ctx.process_count(),
                                ctx.host().empty() ? 0 : 1};
      },
      2, "cpu", Options());
  ASSERT_TRUE(placement.ok()) << placement.status();
  ASSERT_EQ(placement->size(), 2u);
  for (int l = 0; l < 2; ++l) {
    const std::vector<int>& p = (*placement)[l];
    EXPECT_EQ(p[0], LaunchedIndex() * 2 + l);
    EXPECT_EQ(p[1], processes * 2);
    EXPECT_EQ(p[2], l);
    EXPECT_EQ(p[3], LaunchedIndex());
    EXPECT_EQ(p[4], processes);
    EXPECT_EQ(p[5], 1) << "host name empty";
  }
  if (LaunchedIndex() == 0) {
    // spawn's one-line start (SpawnOptions::verbose would print the table).
    EXPECT_NE(console_.str().find(absl::StrCat("distributed environment: world_size ",
                                               processes * 2, ", ", processes,
                                               " processes (this is process 0)")),
              std::string::npos)
        << console_.str();
  }
}

// P processes x 1 rank == 1 process x P ranks, bit for bit, for every op and dtype.
TEST_F(MpiTest, AllReduceOneRankPerProcessHasTheInProcessBits) {
  const int world = LaunchedProcesses();
  for (nn::DType dtype : {nn::kFloat32, nn::kFloat64, nn::kInt64}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (int64_t n : {1, 7, 1001}) {
        auto body = [&](Context& ctx) {
          Tensor x = RankData(ctx.rank(), n, dtype);
          ctx.communicator().all_reduce(x, op);
          return x.to(nn::kFloat64).to_vector<double>();
        };
        auto across = spawn(body, 1, "cpu", Options());
        auto local = spawn(body, world, "cpu", Local());
        ASSERT_TRUE(across.ok() && local.ok()) << across.status() << local.status();
        const std::vector<double>& a = (*across)[0];
        const std::vector<double>& b = (*local)[0];
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i) {
          ASSERT_EQ(a[i], b[i]) << nn::DTypeName(dtype) << " " << ReduceOpName(op) << " n=" << n
                                << " element " << i;
        }
      }
    }
  }
}

// Two ranks per process: the tree is (in-process fold) then (process fold).
TEST_F(MpiTest, AllReduceSeveralRanksPerProcessFollowsTheHierarchicalTree) {
  const int processes = LaunchedProcesses();
  const int local = 2;
  const int64_t n = 513;
  auto result = spawn(
      [&](Context& ctx) {
        Tensor x = RankData(ctx.rank(), n, nn::kFloat32);
        ctx.communicator().all_reduce(x, ReduceOp::kAvg);
        return x.to_vector<float>();
      },
      local, "cpu", Options());
  ASSERT_TRUE(result.ok()) << result.status();
  std::vector<float> expected(n);
  for (int64_t i = 0; i < n; ++i) {
    float total = 0;
    for (int p = 0; p < processes; ++p) {
      float partial = RankData(p * local, n, nn::kFloat32).to_vector<float>()[i];
      for (int l = 1; l < local; ++l) {
        partial = partial + RankData(p * local + l, n, nn::kFloat32).to_vector<float>()[i];
      }
      total = p == 0 ? partial : total + partial;
    }
    expected[i] = total / static_cast<float>(processes * local);
  }
  for (int l = 0; l < local; ++l) {
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ((*result)[l][i], expected[i]) << "element " << i;
  }
}

TEST_F(MpiTest, BroadcastAllGatherReduceScatterBarrierAndAsync) {
  auto result = spawn(
      [](Context& ctx) {
        const int world = ctx.world_size();
        Communicator& comm = ctx.communicator();
        std::vector<double> out;
        for (int root = 0; root < world; ++root) {  // every global root
          Tensor b = RankData(ctx.rank(), 5, nn::kFloat64);
          comm.broadcast(b, root);
          TANDEM_CHECK(b.to_vector<double>() == RankData(root, 5, nn::kFloat64).to_vector<double>(),
                       "broadcast from root ", root);
        }
        Tensor gathered = comm.all_gather(RankData(ctx.rank(), 3, nn::kFloat64));
        for (int r = 0; r < world; ++r) {
          TANDEM_CHECK(gathered.slice(r, r + 1).flatten(0).to_vector<double>() ==
                           RankData(r, 3, nn::kFloat64).to_vector<double>(),
                       "all_gather row ", r);
        }
        // reduce_scatter: rank r gets the sum over ranks of rows [2r, 2r+2).
        Tensor input = nn::full({2 * world}, static_cast<double>(ctx.rank() + 1),
                                {.dtype = nn::kFloat64});
        Tensor mine = comm.reduce_scatter(input, ReduceOp::kSum);
        TANDEM_CHECK(mine.numel() == 2, "reduce_scatter size");
        comm.barrier();
        // Several async all-reduces in flight at once, waited in order.
        std::vector<Tensor> xs;
        std::vector<std::shared_ptr<Work>> works;
        for (int k = 0; k < 4; ++k) {
          xs.push_back(nn::full({100}, static_cast<double>(k + ctx.rank()), {.dtype = nn::kFloat64}));
          works.push_back(comm.all_reduce_async(xs.back(), ReduceOp::kSum));
        }
        for (auto& w : works) w->wait();
        for (const Tensor& x : xs) out.push_back(x.to_vector<double>()[99]);
        out.push_back(mine.to_vector<double>()[0]);
        return out;
      },
      2, "cpu", Options());
  ASSERT_TRUE(result.ok()) << result.status();
  const int world = 2 * LaunchedProcesses();
  const double rank_sum = world * (world - 1) / 2.0;
  for (const std::vector<double>& out : *result) {
    for (int k = 0; k < 4; ++k) EXPECT_EQ(out[k], world * k + rank_sum);
    EXPECT_EQ(out[4], rank_sum + world);
  }
}

class MpiEquivalenceTest : public MpiTest, public ::testing::WithParamInterface<int> {};

// P processes x L ranks on batch B == 1 rank on P*L*B (DataParallel, overlapping buckets).
TEST_P(MpiEquivalenceTest, LinearNetAndConvNetMatchOneRankOnTheWholeBatch) {
  const int local = GetParam();
  const int world = LaunchedProcesses() * local;
  auto one = spawn([&](Context& ctx) { return Train<LinearNet>(ctx, {10}, 1, 4 * world, 5); }, 1,
                   "cpu", Local());
  auto many = spawn([&](Context& ctx) { return Train<LinearNet>(ctx, {10}, 1, 4, 5); }, local,
                    "cpu", Options());
  ASSERT_TRUE(one.ok() && many.ok()) << one.status() << many.status();
  for (int l = 0; l < local; ++l) ExpectClose((*many)[l], (*one)[0], "LinearNet");
  auto one_conv = spawn(
      [&](Context& ctx) { return Train<ConvNet>(ctx, {1, 6, 6}, 2, 2 * world, 4); }, 1, "cpu",
      Local());
  auto many_conv = spawn([&](Context& ctx) { return Train<ConvNet>(ctx, {1, 6, 6}, 2, 2, 4); },
                         local, "cpu", Options());
  ASSERT_TRUE(one_conv.ok() && many_conv.ok()) << one_conv.status() << many_conv.status();
  for (int l = 0; l < local; ++l) ExpectClose((*many_conv)[l], (*one_conv)[0], "ConvNet");
}

// With one rank per process, DataParallel's cross-process run has the bits of
// the single-process run with as many ranks.
TEST_F(MpiTest, DataParallelOneRankPerProcessHasTheInProcessBits) {
  const int world = LaunchedProcesses();
  auto across = spawn([&](Context& ctx) { return Train<ConvNet>(ctx, {1, 6, 6}, 2, 2, 4); }, 1,
                      "cpu", Options());
  auto local = spawn([&](Context& ctx) { return Train<ConvNet>(ctx, {1, 6, 6}, 2, 2, 4); }, world,
                     "cpu", Local());
  ASSERT_TRUE(across.ok() && local.ok()) << across.status() << local.status();
  EXPECT_EQ((*across)[0], (*local)[0]);
}

INSTANTIATE_TEST_SUITE_P(LocalRanks, MpiEquivalenceTest, ::testing::Values(1, 2));

TEST_F(MpiTest, DisagreeingFlagIsAnErrorNamingValueHostAndProcess) {
  SpawnOptions options = Options();
  options.must_agree = {{"--batch_size", LaunchedIndex() == 0 ? "64" : "32"},
                        {"--lr", "0.1"}};
  absl::Status s = spawn([](Context&) {}, 1, "cpu", options);
  ASSERT_FALSE(s.ok());
  const std::string text(s.message());
  EXPECT_NE(text.find("--batch_size: 64 on host "), std::string::npos) << text;
  EXPECT_NE(text.find("(process 0), 32 on host "), std::string::npos) << text;
  EXPECT_NE(text.find("(process 1)"), std::string::npos) << text;
  EXPECT_EQ(text.find("--lr"), std::string::npos) << text;
  // The job goes on: the next run agrees.
  options.must_agree = {{"--batch_size", "64"}};
  EXPECT_TRUE(spawn([](Context&) {}, 1, "cpu", options).ok());
}

// A run sets MPI_ERRORS_RETURN on MPI_COMM_WORLD (Open MPI reports a failed
// non-blocking collective through it) and puts the handler it found back at its
// end: after a run that trained and after one refused at the join.
TEST_F(MpiTest, WorldErrorHandlerIsPutBackAfterTheRun) {
  auto world_handler_is_fatal = [] {
    MPI_Errhandler handler;
    MPI_Comm_get_errhandler(MPI_COMM_WORLD, &handler);
    const bool fatal = handler == MPI_ERRORS_ARE_FATAL;
    MPI_Errhandler_free(&handler);
    return fatal;
  };
  ASSERT_TRUE(spawn([](Context& ctx) { ctx.communicator().barrier(); }, 1, "cpu", Options()).ok());
  EXPECT_TRUE(world_handler_is_fatal()) << "after a run that trained";
  SpawnOptions refused = Options();
  refused.must_agree = {{"--batch_size", LaunchedIndex() == 0 ? "64" : "32"}};
  ASSERT_FALSE(spawn([](Context&) {}, 1, "cpu", refused).ok());
  EXPECT_TRUE(world_handler_is_fatal()) << "after a run refused at the join";
}

TEST_F(MpiTest, ValueReturningSpawnReturnsThisProcesssRanks) {
  auto ranks = spawn([](Context& ctx) { return ctx.rank(); }, 3, "cpu", Options());
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  EXPECT_EQ(*ranks, (std::vector<int>{LaunchedIndex() * 3, LaunchedIndex() * 3 + 1,
                                      LaunchedIndex() * 3 + 2}));
}

TEST_F(MpiTest, WorkerLogsAreNamedByGlobalRank) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/mpi_logs_", getppid());
  SpawnOptions options = Options();
  options.log_dir = dir;
  ASSERT_TRUE(spawn([](Context& ctx) { ctx.log().Info("hello from {}", ctx.rank()); }, 2, "cpu",
                    options)
                  .ok());
  for (int l = 0; l < 2; ++l) {
    const int rank = LaunchedIndex() * 2 + l;
    std::ifstream file(absl::StrCat(dir, "/workerlog.", rank));
    std::stringstream text;
    text << file.rdbuf();
    EXPECT_NE(text.str().find(absl::StrCat("hello from ", rank)), std::string::npos)
        << "workerlog." << rank << ": " << text.str();
  }
}

// Each process has its own checkpoint directory (as on hosts without a shared
// file system): rank 0 writes into process 0's, the load broadcasts its bytes,
// and the resumed run ends with the bits of the uninterrupted one (weights,
// Adam state, every rank's generator).
TEST_F(MpiTest, CheckpointResumesBitIdenticallyWithoutASharedDirectory) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/mpi_ckpt_", getppid(), "_", LaunchedIndex());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/state.ckpt";
  auto run = [&](int steps, bool load_first, bool save_at_end) {
    return spawn(
        [&](Context& ctx) {
          LinearNet net;
          DataParallel dp(net, ctx);
          optim::Adam adam(dp.parameters(), {.lr = 1e-2});
          int64_t step = 0;
          TrainingState state{.model = &net, .optimizer = &adam, .step = &step};
          if (load_first) {
            const absl::Status s = LoadTrainingCheckpoint(ctx, path, state);
            TANDEM_CHECK(s.ok(), "load: ", s.ToString());
          }
          for (int k = 0; k < steps; ++k, ++step) {
            Tensor loss = nn::mse_loss(dp(nn::randn({4, 10})), nn::randn({4, 1}));
            loss.backward();
            adam.step();
            adam.zero_grad();
          }
          if (save_at_end) {
            const absl::Status s = SaveTrainingCheckpoint(ctx, path, state);
            TANDEM_CHECK(s.ok(), "save: ", s.ToString());
          }
          std::vector<float> out = FlatParams(net);
          out.push_back(static_cast<float>(step));
          return out;
        },
        1, "cpu", Options());
  };
  auto straight = run(6, false, false);
  auto first = run(3, false, true);
  ASSERT_TRUE(straight.ok() && first.ok()) << straight.status() << first.status();
  EXPECT_EQ(std::filesystem::exists(path), LaunchedIndex() == 0)
      << "only global rank 0 writes: " << path;
  auto resumed = run(3, true, false);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ((*resumed)[0], (*straight)[0]);
  EXPECT_NE((*first)[0], (*straight)[0]);
  std::filesystem::remove_all(dir);
}

// The graceful stop across processes (spawn/signals.h): SIGTERM raised in one
// process stops every rank of every process at one step boundary, after which
// collectives still work (a save's would); spawn returns IsStopped with that
// step in every process, and the others name the signal of the one that got
// it. A save proposed by global rank 0 falls on one step everywhere too.
// A load that fails on one rank only (out of memory for the bytes' buffers, or
// rank 0's read), by fault injection: every rank takes the same collectives,
// returns at once, and names the failing rank and its cause.
TEST_F(MpiTest, CheckpointLoadFailingOnOneRankIsReportedByEveryRank) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/mpi_ckpt_fault_", getppid(), "_", LaunchedIndex());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/state.ckpt";
  auto run = [&](bool load) {
    return spawn(
        [&](Context& ctx) {
          LinearNet net;
          int64_t step = 0;
          TrainingState state{.model = &net, .step = &step};
          return (load ? LoadTrainingCheckpoint(ctx, path, state)
                       : SaveTrainingCheckpoint(ctx, path, state))
              .ToString();
        },
        1, "cpu", Options());
  };
  auto saved = run(false);
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_EQ((*saved)[0], "OK");
  const int last = LaunchedProcesses() - 1;
  for (const std::string& fault : {absl::StrCat("buffer:", last), std::string("read:0")}) {
    const int failing = fault == "read:0" ? 0 : last;
    setenv("TANDEM_TEST_CHECKPOINT_LOAD_FAULT", fault.c_str(), 1);
    const auto start = std::chrono::steady_clock::now();
    auto loaded = run(true);
    const double took_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    unsetenv("TANDEM_TEST_CHECKPOINT_LOAD_FAULT");
    ASSERT_TRUE(loaded.ok()) << fault << ": " << loaded.status();
    const std::string& text = (*loaded)[0];
    // The failing rank's own message (its process's path: each has its own directory).
    EXPECT_NE(text.find("/state.ckpt: std::bad_alloc"), std::string::npos) << fault << ": "
                                                                           << text;
    if (LaunchedIndex() != failing) {
      EXPECT_NE(text.find(absl::StrCat("rank ", failing, " could not load the checkpoint: ")),
                std::string::npos)
          << fault << ": " << text;
    }
    EXPECT_LT(took_s, 5.0) << fault << ": no rank may wait for a collective the others skipped";
  }
  std::filesystem::remove_all(dir);
}

TEST_F(MpiTest, StopSignalToOneProcessStopsEveryProcessAtOneStep) {
  const int processes = LaunchedProcesses();
  for (int trial = 0; trial < 4; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    const int sender = trial % processes;
    const int64_t at = 1 + 3 * trial;  // steps after the save
    std::vector<int64_t> stopped(2, -1), saved(2, -1);
    bool sent = false;
    const absl::Status s = spawn(
        [&](Context& ctx) {
          std::mt19937 jitter(static_cast<uint32_t>(trial * 100 + ctx.rank()));
          for (int64_t step = 1; step < 1000000; ++step) {
            Tensor x = nn::ones({4});
            ctx.communicator().all_reduce(x, ReduceOp::kSum);
            ::usleep(jitter() % 1500);
            // After the save (a stop would pre-empt a save not yet agreed on).
            if (ctx.process_index() == sender && ctx.local_rank() == 0 && saved[0] >= 0 &&
                !sent) {
              sent = step >= saved[0] + at;
              if (sent) ::kill(::getpid(), SIGTERM);
            }
            const StepDecision d =
                ctx.AtStepBoundary(step, ctx.rank() == 0 && step >= 3 && saved[0] < 0);
            if (d.save && saved[ctx.local_rank()] < 0) saved[ctx.local_rank()] = step;
            if (d.stop) {
              stopped[ctx.local_rank()] = step;
              Tensor y = nn::ones({4});
              ctx.communicator().all_reduce(y, ReduceOp::kSum);  // the save's collectives
              TANDEM_CHECK(y.to_vector<float>()[0] == ctx.world_size(), "after the stop");
              throw StoppedError("stopped", step);
            }
          }
        },
        2, "cpu", Options());
    ASSERT_TRUE(IsStopped(s)) << s;
    ASSERT_TRUE(StoppedAtStep(s).has_value()) << s;
    EXPECT_EQ(stopped[0], *StoppedAtStep(s));
    EXPECT_EQ(stopped[1], *StoppedAtStep(s));
    EXPECT_GT(stopped[0], saved[0]);
    EXPECT_EQ(saved[0], saved[1]);
    EXPECT_GE(saved[0], 3);
    const std::string reason =
        LaunchedIndex() == sender ? "stopped by SIGTERM at step" : "SIGTERM on another process";
    EXPECT_NE(s.message().find(reason), std::string::npos) << s;
    // The same steps in every process: max == min over the processes.
    auto across = spawn(
        [&](Context& ctx) {
          Tensor v = nn::from_vector<double>(
              {static_cast<double>(stopped[0]), -static_cast<double>(stopped[0]),
               static_cast<double>(saved[0]), -static_cast<double>(saved[0])},
              {4}, {.dtype = nn::kFloat64});
          ctx.communicator().all_reduce(v, ReduceOp::kMax);
          return v.to_vector<double>();
        },
        1, "cpu", Options());
    ASSERT_TRUE(across.ok()) << across.status();
    const std::vector<double>& m = (*across)[0];
    EXPECT_EQ(m[0], -m[1]) << "the processes stopped at different steps";
    EXPECT_EQ(m[2], -m[3]) << "the processes saved at different steps";
  }
}

// Timed checkpoints (CheckpointManager every_minutes: global rank 0's clock
// proposes) across processes: every rank of every process saves at one step; a
// rank saving at another step would pair the snapshot's collectives with a
// training step's and fail the run.
TEST_F(MpiTest, TimedCheckpointsSaveAtOneStepInEveryProcess) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/mpi_timed_", getppid(), "_", LaunchedIndex());
  std::filesystem::remove_all(dir);
  SpawnOptions options = Options();
  options.timeout_s = 20;
  const absl::Status s = spawn(
      [&](Context& ctx) -> absl::Status {
        LinearNet net;
        DataParallel dp(net, ctx);
        optim::Adam adam(dp.parameters(), {.lr = 1e-2});
        int64_t step = 0;
        TrainingState state{.model = &net, .optimizer = &adam, .step = &step};
        CheckpointManager m(ctx, {.dir = dir, .every_minutes = 0.02 / 60});  // 20 ms
        std::mt19937 jitter(static_cast<uint32_t>(ctx.rank()));
        for (int i = 0; i < 60; ++i) {
          Tensor loss = nn::mse_loss(dp(nn::randn({4, 10})), nn::randn({4, 1}));
          loss.backward();
          adam.step();
          adam.zero_grad();
          ++step;
          ::usleep(jitter() % 3000);
          RETURN_IF_ERROR(m.AtStepBoundary(state));
        }
        return m.Finish();
      },
      2, "cpu", options);
  ASSERT_TRUE(s.ok()) << s << console_.str();
  if (LaunchedIndex() == 0) EXPECT_GE(CheckpointManager::List(dir).size(), 2u) << console_.str();
  std::filesystem::remove_all(dir);
}

// DataParallel's overlap depends on all_reduce_async returning at once while
// the communication thread runs the MPI part: here process 1 joins 1 s late,
// and process 0's call still returns at once (the default synchronous
// implementation would block for that second); the result is right after wait().
TEST_F(MpiTest, AsyncAllReduceDoesNotBlockTheRankWhileAPeerIsLate) {
  auto result = spawn(
      [](Context& ctx) {
        if (ctx.process_index() == 1) ::usleep(1000 * 1000);
        Tensor x = nn::full({1000}, static_cast<double>(ctx.rank() + 1), {.dtype = nn::kFloat32});
        const auto start = std::chrono::steady_clock::now();
        auto work = ctx.communicator().all_reduce_async(x);
        const double call_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        work->wait();
        return std::make_pair(call_s, static_cast<double>(x.to_vector<float>()[999]));
      },
      1, "cpu", Options());
  ASSERT_TRUE(result.ok()) << result.status();
  const int world = LaunchedProcesses();
  EXPECT_EQ((*result)[0].second, world * (world + 1) / 2);
  if (LaunchedIndex() == 0) EXPECT_LT((*result)[0].first, 0.5) << "all_reduce_async blocked";
}

// GPU ranks across processes: one NCCL communicator over every process's GPU
// (process p on cuda:p). Skips without a GPU per process.
TEST_F(MpiTest, NcclAllReduceAcrossProcesses) {
  const int processes = LaunchedProcesses();
  TANDEM_REQUIRE_GPUS(processes);  // one per process
  auto result = spawn(
      [](Context& ctx) {
        Tensor x = RankData(ctx.rank(), 1001, nn::kFloat32).to(ctx.device());
        ctx.communicator().all_reduce(x, ReduceOp::kSum);
        return std::make_pair(ctx.communicator().kind(), x.to(nn::Device()).to_vector<float>());
      },
      1, std::to_string(LaunchedIndex()), Options());
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ((*result)[0].first, "nccl");
  for (int64_t i = 0; i < 1001; ++i) {
    double expected = 0;
    for (int r = 0; r < processes; ++r) expected += RankData(r, 1001, nn::kFloat32).to_vector<float>()[i];
    EXPECT_NEAR((*result)[0].second[i], expected, 1e-5 * std::max(1.0, std::fabs(expected)));
  }
}

}  // namespace
}  // namespace tandem::dist
