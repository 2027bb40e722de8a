// The multi-process layer's pieces that need no second process: launcher
// detection, the process record's wire form, the agreement check, the rank-count
// limit. The multi-process runs themselves are mpi_test.cc and mpi_fault_test.sh.
#include "spawn/internal/process_world.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "spawn/spawn.h"

namespace tandem::dist::internal {
namespace {

// Sets environment variables for one test and restores them.
class EnvGuard {
 public:
  EnvGuard(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name);
      saved_.emplace_back(name, old != nullptr ? std::optional<std::string>(old) : std::nullopt);
      if (value != nullptr) {
        setenv(name, value, 1);
      } else {
        unsetenv(name);
      }
    }
  }
  ~EnvGuard() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        setenv(name.c_str(), value->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

constexpr const char* kLauncherVars[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                         "PMIX_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK",
                                         "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"};

TEST(DetectLauncherTest, ReadsEachLauncherFamilyInOrder) {
  EnvGuard clear({{kLauncherVars[0], nullptr}, {kLauncherVars[1], nullptr},
                  {kLauncherVars[2], nullptr}, {kLauncherVars[3], nullptr},
                  {kLauncherVars[4], nullptr}, {kLauncherVars[5], nullptr},
                  {kLauncherVars[6], nullptr}, {kLauncherVars[7], nullptr}});
  EXPECT_EQ(DetectLauncher().size, 1);
  EXPECT_TRUE(DetectLauncher().evidence.empty());
  {
    EnvGuard slurm({{"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_PROCID", "3"}});
    const LauncherEnv env = DetectLauncher();
    EXPECT_EQ(env.size, 4);
    EXPECT_EQ(env.rank, 3);
    EXPECT_EQ(env.evidence, "SLURM_STEP_NUM_TASKS=4 SLURM_PROCID=3");
    EnvGuard ompi({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}});
    EXPECT_EQ(DetectLauncher().size, 2) << "OpenMPI's variables come first";
    EXPECT_EQ(DetectLauncher().rank, 1);
  }
  {
    EnvGuard pmi({{"PMI_SIZE", "8"}, {"PMI_RANK", "5"}});
    EXPECT_EQ(DetectLauncher().size, 8);
    EXPECT_EQ(DetectLauncher().rank, 5);
  }
  {
    EnvGuard bad({{"PMIX_SIZE", "many"}});
    EXPECT_EQ(DetectLauncher().size, 1) << "an unparsable size is no launcher";
  }
}

ProcessInfo Info(const std::string& host, std::vector<std::string> devices,
                 std::vector<std::string> gpu_ids = {}) {
  ProcessInfo info;
  info.host = host;
  info.pid = 1234;
  info.devices = std::move(devices);
  info.gpu_ids = std::move(gpu_ids);
  info.build = "tandem 0.1.0 (CUDA off, MPI on)";
  info.agreed = {{"--batch_size", "64"}, {"--lr", "0.001"}};
  return info;
}

TEST(ProcessInfoTest, RoundTripsAndRejectsMalformedRecords) {
  ProcessInfo info = Info("node-a", {"cuda:0", "cuda:1"}, {"2", "3"});
  info.agreed.emplace_back("weird:name", std::string("with\0nul,comma:colon", 20));
  const std::string bytes = SerializeProcessInfo(info);
  absl::StatusOr<ProcessInfo> back = ParseProcessInfo(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->host, "node-a");
  EXPECT_EQ(back->pid, 1234);
  EXPECT_EQ(back->devices, info.devices);
  EXPECT_EQ(back->gpu_ids, info.gpu_ids);
  EXPECT_EQ(back->build, info.build);
  EXPECT_EQ(back->agreed, info.agreed);
  for (size_t cut : {size_t{0}, size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_FALSE(ParseProcessInfo(bytes.substr(0, cut)).ok()) << "cut at " << cut;
  }
  EXPECT_FALSE(ParseProcessInfo(bytes + "x").ok());
  EXPECT_FALSE(ParseProcessInfo("99999999999:abc").ok());
}

TEST(CheckAgreementTest, AgreeingProcessesPass) {
  EXPECT_TRUE(CheckAgreement({Info("a", {"cpu"}), Info("b", {"cpu", "cpu"})}, false).ok());
  // The same GPU index on two hosts is two GPUs.
  EXPECT_TRUE(CheckAgreement({Info("a", {"cuda:0"}, {"0"}), Info("b", {"cuda:0"}, {"0"})}, false)
                  .ok());
}

TEST(CheckAgreementTest, AFlagThatDiffersNamesValueHostAndProcess) {
  std::vector<ProcessInfo> processes = {Info("a", {"cpu"}), Info("b", {"cpu"}), Info("c", {"cpu"})};
  processes[1].agreed[0].second = "32";
  const absl::Status s = CheckAgreement(processes, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("--batch_size: 64 on host a (process 0), 32 on host b (process 1), "
                             "64 on host c (process 2)"),
            std::string::npos)
      << s;
  EXPECT_EQ(s.message().find("--lr"), std::string::npos) << s;
}

// GPU ranks: NCCL's settings that must agree are compared before the unique id
// is exchanged; a value set on one host only names the variable, the values and
// the processes (unset reads as what spawn runs with).
TEST(CheckAgreementTest, NcclEnvironmentThatDiffersNamesVariableValueAndProcess) {
  std::vector<ProcessInfo> processes = {Info("a", {"cuda:0"}, {"0"}),
                                        Info("b", {"cuda:0"}, {"0"})};
  {
    EnvGuard env({{"NCCL_LAUNCH_MODE", nullptr}, {"NCCL_GRAPH_REGISTER", nullptr},
                  {"NCCL_RUNTIME_CONNECT", nullptr}, {"NCCL_COMM_BLOCKING", nullptr},
                  {"NCCL_ALGO", nullptr}, {"NCCL_PROTO", nullptr}});
    for (const auto& entry : NcclEnvironmentToAgree()) processes[0].agreed.push_back(entry);
  }
  {
    EnvGuard env({{"NCCL_LAUNCH_MODE", "GROUP"}, {"NCCL_GRAPH_REGISTER", "1"},
                  {"NCCL_RUNTIME_CONNECT", "0"}, {"NCCL_COMM_BLOCKING", nullptr},
                  {"NCCL_ALGO", nullptr}, {"NCCL_PROTO", nullptr}});
    for (const auto& entry : NcclEnvironmentToAgree()) processes[1].agreed.push_back(entry);
  }
  const absl::Status s = CheckAgreement(processes, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("environment NCCL_LAUNCH_MODE: (unset) on host a (process 0), GROUP "
                             "on host b (process 1)"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("environment NCCL_GRAPH_REGISTER: 0 on host a (process 0), 1 on "
                             "host b (process 1)"),
            std::string::npos)
      << s;
  // Unset and "0" are the same run for NCCL_RUNTIME_CONNECT (spawn sets it to 0).
  EXPECT_EQ(s.message().find("NCCL_RUNTIME_CONNECT"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("NCCL_ALGO"), std::string::npos) << s;
}

TEST(CheckAgreementTest, BuildMissingFlagAndDeviceKindDifferences) {
  std::vector<ProcessInfo> processes = {Info("a", {"cpu"}), Info("b", {"cuda:0"}, {"0"})};
  processes[1].build = "tandem 0.2.0 (CUDA on, MPI on)";
  processes[1].agreed.pop_back();
  const absl::Status s = CheckAgreement(processes, false);
  EXPECT_NE(s.message().find("tandem build: tandem 0.1.0 (CUDA off, MPI on) on host a (process "
                             "0), tandem 0.2.0 (CUDA on, MPI on) on host b (process 1)"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("--lr: 0.001 on host a (process 0), (not set) on host b"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("device kind: CPU ranks on host a"), std::string::npos) << s;
}

TEST(CheckAgreementTest, OneGpuClaimedByTwoProcessesOfAHost) {
  const std::vector<ProcessInfo> processes = {Info("a", {"cuda:0", "cuda:1"}, {"0", "1"}),
                                              Info("a", {"cuda:1"}, {"1"})};
  const absl::Status s = CheckAgreement(processes, false);
  EXPECT_NE(s.message().find("GPU 1 of host a is claimed by process 0 and process 1"),
            std::string::npos)
      << s;
  // share_devices shares a GPU between the ranks of one process, never between
  // processes (NCCL would refuse it later with "Duplicate GPU").
  const absl::Status shared = CheckAgreement(processes, /*share_devices=*/true);
  EXPECT_NE(shared.message().find("GPU 1 of host a is claimed by process 0 and process 1"),
            std::string::npos)
      << shared;
  EXPECT_NE(shared.message().find("share_devices shares a GPU between the ranks of one process "
                                  "only"),
            std::string::npos)
      << shared;
}

// The same card under two names (an ordinal in one process, a UUID in the
// other) is caught because every process reports the UUID CUDA gives it.
TEST(CheckAgreementTest, GpusAreComparedByUuidAcrossProcesses) {
  const std::vector<ProcessInfo> processes = {
      Info("a", {"cuda:0"}, {"GPU-11111111-2222-3333-4444-555555555555"}),
      Info("a", {"cuda:0"}, {"GPU-11111111-2222-3333-4444-555555555555"})};
  EXPECT_FALSE(CheckAgreement(processes, false).ok());
  const std::vector<ProcessInfo> distinct = {
      Info("a", {"cuda:0"}, {"GPU-11111111-2222-3333-4444-555555555555"}),
      Info("a", {"cuda:0"}, {"GPU-66666666-2222-3333-4444-555555555555"})};
  EXPECT_TRUE(CheckAgreement(distinct, false).ok());
}

TEST(SpawnLimitsTest, TooManyRanksIsAnErrorBeforeAnyThreadStarts) {
  std::ostringstream console;
  bool ran = false;
  const absl::Status s = spawn([&](Context&) { ran = true; }, 100000, "cpu",
                               {.console = &console});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("100000 ranks in one process"), std::string::npos) << s;
  EXPECT_FALSE(ran);
  EXPECT_EQ(console.str(), "") << "nothing printed (no 100000 device lines)";
}

TEST(SpawnProcessesTest, OffRunsAloneEvenUnderALauncher) {
  EnvGuard launcher({{"PMI_SIZE", "2"}, {"PMI_RANK", "1"}});
  std::ostringstream console;
  SpawnOptions options{.console = &console};
  options.processes = Processes::kOff;
  auto ranks = spawn([](Context& ctx) { return ctx.world_size() * 10 + ctx.rank(); }, 2, "cpu",
                     options);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  EXPECT_EQ(*ranks, (std::vector<int>{20, 21}));
}

// A later process's Logger: workerlog.<global rank>, only errors to the console,
// every line tagged with host and pid.
TEST(ProcessLoggerTest, GlobalRanksTagsAndConsoleRules) {
  const std::string dir = ::testing::TempDir() + "/process_logger_test";
  std::ostringstream console;
  auto logger = Logger::Create(2, {.console = &console,
                                   .log_dir = dir,
                                   .first_rank = 2,
                                   .first_process = false,
                                   .process_tag = "host h, pid 7"});
  ASSERT_TRUE(logger.ok()) << logger.status();
  (*logger)->Write(LogLevel::kInfo, -1, nn::Device(), "header");
  (*logger)->Write(LogLevel::kInfo, 2, nn::Device(), "info of rank 2");
  (*logger)->Write(LogLevel::kError, 3, nn::Device(), "error of rank 3");
  (*logger)->Write(LogLevel::kError, -1, nn::Device(), "first failure");
  const std::string text = console.str();
  EXPECT_EQ(text.find("header"), std::string::npos) << text;
  EXPECT_EQ(text.find("info of rank 2"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 3 cpu host h, pid 7] ERROR: error of rank 3"), std::string::npos)
      << text;
  EXPECT_NE(text.find("spawn host h, pid 7] ERROR: first failure"), std::string::npos) << text;
  logger->reset();
  std::ifstream two(dir + "/workerlog.2"), three(dir + "/workerlog.3");
  std::stringstream a, b;
  a << two.rdbuf();
  b << three.rdbuf();
  EXPECT_NE(a.str().find("info of rank 2"), std::string::npos) << a.str();
  EXPECT_NE(a.str().find("header"), std::string::npos) << a.str();
  EXPECT_NE(b.str().find("error of rank 3"), std::string::npos) << b.str();
  EXPECT_EQ(b.str().find("info of rank 2"), std::string::npos) << b.str();
}

}  // namespace
}  // namespace tandem::dist::internal
