// Two ranks of one NCCL communicator on one GPU: each test forks two
// processes (before any CUDA call in this one), each runs spawn with one rank
// on cuda:0 whose communicator is rank 0 or 1 of a world of two, made through
// SpawnHooks::make_communicators with CreateNcclCommunicatorsAcross from
// process 0's unique id (sent to process 1 through a pipe). spawn's watchdog,
// abort and error reports run as in a real job; the cross-process start-up
// (MPI, the GPU-claim check) is not on this path.
//
// NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
// detected"), but compares the host hash with the bus id, and NCCL_HOSTID sets
// the host hash: the two processes set different ones, so NCCL takes them for
// two hosts and connects them through its network transport (sockets over
// loopback here: NCCL_SOCKET_IFNAME=lo and NCCL_IB_DISABLE=1 unless set). If
// NCCL still refuses, each test prints NCCL's message and skips.
//
// Covered: all_reduce (sum, avg, async), all_gather, reduce_scatter and
// broadcast against references for float32, bfloat16 and float64, and an
// all_reduce whose input another thread's kernels were still writing; CUDA
// graph capture of collectives and 300 replays; a process killed (SIGKILL)
// inside a collective, after which the other ends within its timeout_s; a
// peer's death with a timeout_s too long to matter, which only NCCL's
// asynchronous error can end, reported with NCCL's message; a fault on the
// device while a collective is in flight (a kernel of device_fault.cu),
// reported with the CUDA error instead of a timeout.
//
// Label gpu; each process skips with a reason where no GPU is visible, and so
// does the test. Two processes share one GPU: the limits are generous.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nn/graph.h"
#include "nn/ops/matmul.h"
#include "spawn/comm/nccl/nccl_communicator.h"
#include "nn/internal/cuda_runtime.h"
#include "spawn/spawn.h"
#include "tests/gpu_test_util.h"
#include "tests/spawn/comm/device_fault.h"
#include "tests/spawn/comm/late_writers.h"

namespace tandem::dist {
namespace {

using nn::Device;
using nn::Tensor;
using Clock = std::chrono::steady_clock;

// A child's whole life (NCCL's set-up over sockets on a shared GPU takes
// seconds); the parent kills what is still running then. Under the 120 s a
// GPU run gives each test (docs/gpu.md).
constexpr double kChildLimitS = 110;

// --- In the child ----------------------------------------------------------------

// The rank's work; returns "" when every check passed, else what failed.
using Body = std::function<std::string(Context& ctx, Communicator& comm)>;

struct Case {
  Body body;
  double timeout_s = 120;  // SpawnOptions::timeout_s
  int max_restarts = 0;    // SpawnOptions::restart.max_restarts
};

void WriteAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

bool ReadExactly(int fd, char* out, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = read(fd, out + done, bytes - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

void SetEnvUnlessSet(const char* name, const char* value) {
  if (std::getenv(name) == nullptr) setenv(name, value, 1);
}

// Process 0 sends the id as 4 bytes of length and the bytes (length 0: it has
// none, and says why in its report); process 1 reads it.
void SendId(int fd, const std::string& id) {
  const uint32_t size = static_cast<uint32_t>(id.size());
  WriteAll(fd, std::string(reinterpret_cast<const char*>(&size), sizeof(size)) + id);
}
std::optional<std::string> ReceiveId(int fd) {
  uint32_t size = 0;
  if (!ReadExactly(fd, reinterpret_cast<char*>(&size), sizeof(size)) || size == 0) {
    return std::nullopt;
  }
  std::string id(size, '\0');
  if (!ReadExactly(fd, id.data(), size)) return std::nullopt;
  return id;
}

// The report, one line: "SKIP <why>", "NOID <why>" (process 1 got no id), or
// "DONE <spawn's status>" ("OK" when it succeeded).
[[noreturn]] void Report(int fd, const std::string& line) {
  WriteAll(fd, line);
  close(fd);
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(0);  // no static destructors, no gtest teardown in the child
}

[[noreturn]] void RunChild(int rank, int id_fd, int report_fd, const Case& c) {
  // Before any CUDA or NCCL call of this process.
  setenv("NCCL_HOSTID", rank == 0 ? "tandem-two-process-test-host-0"
                                  : "tandem-two-process-test-host-1", 1);
  SetEnvUnlessSet("NCCL_SOCKET_IFNAME", "lo");
  SetEnvUnlessSet("NCCL_IB_DISABLE", "1");
  SetEnvUnlessSet("NCCL_DEBUG", "WARN");
  if (const std::string missing = ::tandem::testing::MissingGpus(1); !missing.empty()) {
    if (rank == 0) SendId(id_fd, "");
    Report(report_fd, "SKIP " + missing);
  }
  std::string id;
  if (rank == 0) {
    absl::StatusOr<std::string> made = internal::NcclUniqueIdBytes();
    if (!made.ok()) {
      SendId(id_fd, "");
      Report(report_fd, "DONE " + made.status().ToString());
    }
    id = *made;
    SendId(id_fd, id);
  } else {
    std::optional<std::string> got = ReceiveId(id_fd);
    if (!got) Report(report_fd, "NOID process 0 sent no NCCL unique id (see its report)");
    id = *got;
  }
  close(id_fd);
  SpawnHooks hooks;
  hooks.make_communicators = [&](const std::vector<Device>& devices) {
    return internal::CreateNcclCommunicatorsAcross(devices, id, rank, 2);
  };
  SpawnOptions options{.timeout_s = c.timeout_s, .seed = 7, .handle_sigint = false,
                       .stop_signals = {}, .processes = Processes::kOff};
  options.restart.max_restarts = c.max_restarts;
  const absl::Status status = RunSpawnWithHooks(
      "0", 1, options, hooks, [](int) {},
      [&](Context& ctx) -> absl::Status {
        const std::string failure = c.body(ctx, ctx.communicator());
        if (failure.empty()) return absl::OkStatus();
        return absl::InternalError(absl::StrCat("rank ", rank, ": ", failure));
      });
  // NCCL would not make the communicator (its "Duplicate GPU detected", or
  // no usable network interface on this machine): not tandem's failure.
  if (!status.ok() && absl::StrContains(status.message(), "NCCL init of")) {
    Report(report_fd, "SKIP NCCL could not make a two-rank communicator of two processes on "
                      "one GPU: " + std::string(status.message()));
  }
  Report(report_fd, "DONE " + (status.ok() ? std::string("OK") : status.ToString()));
}

// --- In the parent ---------------------------------------------------------------

struct ChildOutcome {
  std::string report;        // what it wrote ("" if it wrote nothing)
  int wait_status = 0;       // from waitpid
  bool ended = false;        // false: still running at kChildLimitS (then killed)
  double ended_after_s = 0;  // since the fork
  bool killed_by(int sig) const {
    return ended && WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == sig;
  }
  std::string Describe() const {
    std::string how = !ended ? "still running after " + std::to_string(kChildLimitS) + " s"
                      : WIFSIGNALED(wait_status)
                          ? "killed by signal " + std::to_string(WTERMSIG(wait_status))
                          : "exit status " + std::to_string(WEXITSTATUS(wait_status));
    return how + ", after " + std::to_string(ended_after_s) + " s, report: '" + report + "'";
  }
};

// Forks process 0 and 1 running `c`, collects their reports and waits for
// both (at most kChildLimitS: then kills them).
std::array<ChildOutcome, 2> RunTwoProcesses(const Case& c) {
  std::fflush(stdout);
  std::fflush(stderr);
  int id_pipe[2], report_pipe[2][2];
  EXPECT_EQ(pipe(id_pipe), 0);
  for (auto& p : report_pipe) EXPECT_EQ(pipe(p), 0);
  const Clock::time_point start = Clock::now();
  pid_t pids[2];
  const pid_t parent = getpid();
  for (int rank = 0; rank < 2; ++rank) {
    pids[rank] = fork();
    if (pids[rank] < 0) {
      // A pid of -1 must never reach waitpid or kill below: kill(-1, SIGKILL)
      // signals every process this user may signal.
      const std::string why = std::string("fork failed: ") + std::strerror(errno);
      ADD_FAILURE() << why;
      for (int k = 0; k < rank; ++k) {
        kill(pids[k], SIGKILL);
        waitpid(pids[k], nullptr, 0);
      }
      for (int fd : {id_pipe[0], id_pipe[1], report_pipe[0][0], report_pipe[0][1],
                     report_pipe[1][0], report_pipe[1][1]}) {
        close(fd);
      }
      std::array<ChildOutcome, 2> failed;
      for (ChildOutcome& o : failed) o.report = why;
      return failed;
    }
    if (pids[rank] == 0) {
      // Ends with the test (ctest's timeout kills only the parent), and before
      // anything else if the parent is already gone.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      // (An orphan is adopted by init or by a subreaper: compare with the
      // parent's pid, not with 1.)
      if (getppid() != parent) _exit(1);
      // The child keeps its end of the id pipe and its report pipe's write end.
      close(rank == 0 ? id_pipe[0] : id_pipe[1]);
      for (int k = 0; k < 2; ++k) {
        close(report_pipe[k][0]);
        if (k != rank) close(report_pipe[k][1]);
      }
      // Nothing may unwind out of the child: an exception would carry it back
      // into this test as a second parent (waiting for children it does not
      // have, then running the rest of the suite and forking again).
      try {
        RunChild(rank, rank == 0 ? id_pipe[1] : id_pipe[0], report_pipe[rank][1], c);
      } catch (const std::exception& e) {
        Report(report_pipe[rank][1], std::string("DONE the child threw: ") + e.what());
      } catch (...) {
        Report(report_pipe[rank][1], "DONE the child threw");
      }
    }
  }
  close(id_pipe[0]);
  close(id_pipe[1]);
  std::array<ChildOutcome, 2> out;
  for (int k = 0; k < 2; ++k) {
    close(report_pipe[k][1]);
    fcntl(report_pipe[k][0], F_SETFL, O_NONBLOCK);
  }
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  while (!(out[0].ended && out[1].ended) && elapsed() < kChildLimitS) {
    for (int k = 0; k < 2; ++k) {
      char buffer[4096];
      ssize_t n;
      while ((n = read(report_pipe[k][0], buffer, sizeof(buffer))) > 0) {
        out[k].report.append(buffer, static_cast<size_t>(n));
      }
      if (!out[k].ended && waitpid(pids[k], &out[k].wait_status, WNOHANG) == pids[k]) {
        out[k].ended = true;
        out[k].ended_after_s = elapsed();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int k = 0; k < 2; ++k) {
    if (!out[k].ended) {
      kill(pids[k], SIGKILL);
      waitpid(pids[k], &out[k].wait_status, 0);
      out[k].ended_after_s = elapsed();
    }
    char buffer[4096];
    ssize_t n;
    while ((n = read(report_pipe[k][0], buffer, sizeof(buffer))) > 0) {
      out[k].report.append(buffer, static_cast<size_t>(n));
    }
    close(report_pipe[k][0]);
  }
  return out;
}

// The reason to skip, when either process gave one ("" otherwise). Process 1
// without an id is no reason: process 0's report says why it sent none.
std::string SkipReason(const std::array<ChildOutcome, 2>& out) {
  for (int k = 0; k < 2; ++k) {
    if (out[k].report.rfind("SKIP ", 0) == 0) {
      return "process " + std::to_string(k) + ": " + out[k].report.substr(5);
    }
  }
  return "";
}

#define TANDEM_SKIP_IF_REFUSED(out)                                  \
  if (const std::string tandem_skip = SkipReason(out); tandem_skip.empty()) { \
  } else {                                                           \
    std::printf("%s\n", tandem_skip.c_str());                        \
    GTEST_SKIP() << tandem_skip;                                     \
  }

// Both processes ran their checks and spawn returned OK.
void ExpectBothOk(const std::array<ChildOutcome, 2>& out) {
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(out[k].ended && WIFEXITED(out[k].wait_status) &&
                WEXITSTATUS(out[k].wait_status) == 0 && out[k].report == "DONE OK")
        << "process " << k << ": " << out[k].Describe();
  }
}

// --- The rank bodies ------------------------------------------------------------

// Rank r's element i: a multiple of 1/4 below 4, so sums and means of two are
// exact in bfloat16 (8 significant bits) as in float32 and float64.
double Value(int rank, int64_t i) { return (rank + 1) * 0.5 + static_cast<double>(i % 5) * 0.25; }

std::vector<double> Values(int rank, int64_t n, int64_t offset = 0) {
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = Value(rank, offset + i);
  return v;
}

// "" when got == want element for element, else the first difference.
std::string Compare(const char* what, nn::DType dtype, const Tensor& got,
                    const std::vector<double>& want) {
  const std::vector<double> values = got.to_vector<double>();
  if (values.size() != want.size()) {
    return absl::StrCat(what, " ", nn::DTypeName(dtype), ": ", values.size(),
                        " elements, expected ", want.size(), "; ");
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (values[i] != want[i]) {
      return absl::StrCat(what, " ", nn::DTypeName(dtype), ": element ", i, " is ", values[i],
                          ", expected ", want[i], "; ");
    }
  }
  return "";
}

std::string Collectives(Context& ctx, Communicator& comm) {
  const int r = comm.rank();
  const int64_t n = 37;  // odd: no size that happens to suit a kernel
  std::string failures;
  for (nn::DType dtype : {nn::kFloat32, nn::kBFloat16, nn::kFloat64}) {
    const nn::TensorOptions on_gpu{.dtype = dtype, .device = ctx.device()};
    std::vector<double> sum(n), mean(n);
    for (int64_t i = 0; i < n; ++i) {
      sum[i] = Value(0, i) + Value(1, i);
      mean[i] = sum[i] / 2;
    }
    Tensor x = nn::from_vector(Values(r, n), {n}, on_gpu);
    comm.all_reduce(x, ReduceOp::kSum);
    failures += Compare("all_reduce sum", dtype, x, sum);
    x = nn::from_vector(Values(r, n), {n}, on_gpu);
    comm.all_reduce(x, ReduceOp::kAvg);
    failures += Compare("all_reduce avg", dtype, x, mean);
    x = nn::from_vector(Values(r, n), {n}, on_gpu);
    comm.all_reduce_async(x, ReduceOp::kAvg)->wait();
    failures += Compare("all_reduce_async avg", dtype, x, mean);

    std::vector<double> gathered = Values(0, n);
    for (double v : Values(1, n)) gathered.push_back(v);
    failures += Compare("all_gather", dtype,
                        comm.all_gather(nn::from_vector(Values(r, n), {n}, on_gpu)), gathered);

    // input (2 * n): rank r gets the sum of every rank's elements [r*n, (r+1)*n).
    Tensor input = nn::from_vector(Values(r, 2 * n), {2 * n}, on_gpu);
    std::vector<double> block(n);
    for (int64_t i = 0; i < n; ++i) block[i] = Value(0, r * n + i) + Value(1, r * n + i);
    failures += Compare("reduce_scatter", dtype, comm.reduce_scatter(input, ReduceOp::kSum), block);
    Tensor output = nn::empty({n}, on_gpu);
    comm.reduce_scatter_async(input, output, ReduceOp::kSum)->wait();
    failures += Compare("reduce_scatter_async", dtype, output, block);

    x = nn::from_vector(Values(r, n), {n}, on_gpu);
    comm.broadcast(x, /*root=*/1);
    failures += Compare("broadcast from 1", dtype, x, Values(1, n));
  }
  return failures;
}

using testing_support::LateWriters;

// Before the fix NCCL's stream was not ordered after the other thread's
// stream: rank 0's stale 7s went into rank 1's sum (rank 0's own result was
// then overwritten by the late fill, so both ranks are checked).
std::string InputsWrittenLate(Context& ctx, Communicator& comm) {
  std::string failures;
  LateWriters writers;
  Tensor x = writers.Write(ctx.device(), static_cast<float>(comm.rank() + 1));
  comm.all_reduce(x, ReduceOp::kSum);
  int64_t bad = 0;
  for (float v : x.to_vector<float>()) bad += v != 3.0f;
  if (bad != 0) failures += absl::StrCat("all_reduce: ", bad, " elements are not 3; ");
  x = writers.Write(ctx.device(), static_cast<float>(comm.rank() + 1));
  comm.all_reduce_async(x, ReduceOp::kAvg)->wait();
  bad = 0;
  for (float v : x.to_vector<float>()) bad += v != 1.5f;
  if (bad != 0) failures += absl::StrCat("all_reduce_async: ", bad, " elements are not 1.5; ");
  return failures;
}

std::string CapturedCollectives(Context& ctx, Communicator& comm) {
  const float mine = static_cast<float>(comm.rank() + 1);
  Tensor x = nn::ones({1024}, {.device = ctx.device()});
  Tensor y = nn::ones({256}, {.device = ctx.device()});
  comm.all_reduce(x);  // eager first: NCCL's first call outside the capture
  Tensor gathered;
  {
    nn::CudaGraph graph(ctx.device());
    graph.Capture([&] {
      x.fill_(mine);
      comm.all_reduce(x);
      y.fill_(mine);
      gathered = comm.all_gather(y);
    });
    for (int i = 0; i < 300; ++i) graph.Replay();
    for (float v : x.to_vector<float>()) {
      if (v != 3.0f) return absl::StrCat("after 300 replays the all_reduce gave ", v, ", not 3");
    }
    const std::vector<float> g = gathered.to_vector<float>();
    for (size_t i = 0; i < g.size(); ++i) {
      const float want = i < 256 ? 1.0f : 2.0f;
      if (g[i] != want) {
        return absl::StrCat("after 300 replays all_gather element ", i, " is ", g[i], ", not ",
                            want);
      }
    }
    gathered = Tensor();
  }  // the graph goes before the rank returns (spawn would release and name it)
  return "";
}

// Both ranks run all_reduces, each followed by a host read; process 1 kills
// itself with SIGKILL at iteration kKillAt, after issuing that all_reduce
// (`inside`) or before issuing it.
constexpr int kKillAt = 20;
Body KilledPeer(bool inside) {
  return [inside](Context& ctx, Communicator& comm) -> std::string {
    for (int i = 1;; ++i) {
      Tensor x = nn::ones({1 << 16}, {.device = ctx.device()});
      if (comm.rank() == 1 && i == kKillAt && !inside) kill(getpid(), SIGKILL);
      comm.all_reduce(x);
      if (comm.rank() == 1 && i == kKillAt && inside) kill(getpid(), SIGKILL);
      const double v = x.slice(0, 1).item();  // every element is 1 + 1
      if (v != 2.0) return absl::StrCat("all_reduce #", i, " gave ", v, ", not 2");
      if (i > 100000) return "process 1 was not killed";
    }
  };
}

// Process 0: tens of milliseconds of matmuls, then a kernel that faults, then an
// all_reduce (enqueued before the fault happens), then a stop-aware wait that
// makes no CUDA call, so the rank does not meet the error itself: the
// watchdog's query of the collective's event does. Process 1 only joins the
// communicator, and stays (stop-aware) while process 0 faults: were it to end
// at once, its communicator's teardown would close the connection that process
// 0's proxy is already receiving on (NCCL posts a collective's network
// receives when it is launched, before its kernel runs), and NCCL's
// asynchronous error for the closed connection could end process 0 before the
// fault is seen, naming the wrong cause. Before, that query's error was
// cleared and the collective stayed in flight until timeout_s.
std::string FaultWhileACollectiveIsInFlight(Context& ctx, Communicator& comm) {
  if (comm.rank() == 1) {
    for (int i = 0; i < 2000 && !ctx.stop_requested(); ++i) {  // 20 s
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "";
  }
  Tensor a = nn::full({4096, 4096}, 1e-4, {.device = ctx.device()});
  for (int i = 0; i < 24; ++i) a = nn::matmul(a, a);
  ::tandem::testing::LaunchFaultingKernel(nn::internal::CudaThreadStream(ctx.device()));
  Tensor x = nn::ones({1024}, {.device = ctx.device()});
  std::shared_ptr<Work> work = comm.all_reduce_async(x);
  for (int i = 0; i < 10000 && !ctx.stop_requested(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ctx.check_stop();
  return "the run did not stop within 100 s of the fault";
}

// --- The tests -----------------------------------------------------------------

TEST(NcclTwoProcessGpuTest, CollectivesMatchReferences) {
  const auto out = RunTwoProcesses({.body = Collectives});
  TANDEM_SKIP_IF_REFUSED(out);
  ExpectBothOk(out);
}

TEST(NcclTwoProcessGpuTest, CollectivesReadInputsAnotherThreadWroteLate) {
  const auto out = RunTwoProcesses({.body = InputsWrittenLate});
  TANDEM_SKIP_IF_REFUSED(out);
  ExpectBothOk(out);
}

TEST(NcclTwoProcessGpuTest, CapturedCollectivesReplay300Times) {
  const auto out = RunTwoProcesses({.body = CapturedCollectives});
  TANDEM_SKIP_IF_REFUSED(out);
  ExpectBothOk(out);
}

// Process 0 is left inside all_reduce #kKillAt (or the next) with a peer that
// will never come: its spawn must return an error within timeout_s (the
// watchdog's deadline names the collective; NCCL's asynchronous error may
// come first and is as good), not hang.
TEST(NcclTwoProcessGpuTest, PeerKilledInsideACollectiveEndsTheOtherWithinItsTimeout) {
  constexpr double kTimeoutS = 30;
  const auto out = RunTwoProcesses({.body = KilledPeer(/*inside=*/true), .timeout_s = kTimeoutS});
  TANDEM_SKIP_IF_REFUSED(out);
  ASSERT_TRUE(out[1].killed_by(SIGKILL)) << "process 1: " << out[1].Describe();
  ASSERT_TRUE(out[0].ended) << "process 0: " << out[0].Describe();
  std::printf("process 0 ended %.1f s after process 1: %s\n",
              out[0].ended_after_s - out[1].ended_after_s, out[0].report.c_str());
  // The deadline, one watchdog poll, the abort and the process's exit.
  EXPECT_LT(out[0].ended_after_s - out[1].ended_after_s, kTimeoutS + 30) << out[0].Describe();
  EXPECT_EQ(out[0].report.rfind("DONE ", 0), 0u) << out[0].Describe();
  EXPECT_EQ(out[0].report.find("DONE OK"), std::string::npos) << out[0].Describe();
  const bool names_it = out[0].report.find("all_reduce") != std::string::npos ||
                        out[0].report.find("NCCL reported an asynchronous error") !=
                            std::string::npos;
  EXPECT_TRUE(names_it) << out[0].Describe();
}

// The peer dies before issuing the collective process 0 waits in, and
// timeout_s is longer than the child's whole life: only NCCL's asynchronous
// error (its proxy sees the connection to the dead process close) can end
// process 0 in time, and spawn must report it with NCCL's message rather than
// wait for a timeout.
TEST(NcclTwoProcessGpuTest, PeerDeathIsReportedWithNcclsAsynchronousError) {
  const auto out =
      RunTwoProcesses({.body = KilledPeer(/*inside=*/false), .timeout_s = 10 * kChildLimitS});
  TANDEM_SKIP_IF_REFUSED(out);
  ASSERT_TRUE(out[1].killed_by(SIGKILL)) << "process 1: " << out[1].Describe();
  std::printf("process 0: %s\n", out[0].Describe().c_str());
  ASSERT_TRUE(out[0].ended) << "process 0: " << out[0].Describe();
  EXPECT_NE(out[0].report.find("NCCL reported an asynchronous error on rank 0"),
            std::string::npos)
      << out[0].Describe();
}

// A fault on the device while a collective is in flight ends the run with the
// CUDA error, long before timeout_s (which is longer than the child's life).
TEST(NcclTwoProcessGpuTest, DeviceFaultDuringACollectiveIsReportedNotTimedOut) {
  const auto out =
      RunTwoProcesses({.body = FaultWhileACollectiveIsInFlight, .timeout_s = 10 * kChildLimitS});
  TANDEM_SKIP_IF_REFUSED(out);
  std::printf("process 0: %s\n", out[0].Describe().c_str());
  ASSERT_TRUE(out[0].ended) << "process 0: " << out[0].Describe();
  const bool names_the_fault =
      out[0].report.find("cudaErrorIllegalAddress") != std::string::npos ||
      out[0].report.find("illegal memory access") != std::string::npos;
  EXPECT_TRUE(names_the_fault) << out[0].Describe();
}

// The same fault under a RestartPolicy with restarts left and on_comm_error
// on: the CUDA error of the collective's event is the device's failure, not
// the communicator's (CUDA keeps it in the device's context for the rest of
// the process, so an attempt in this process cannot run there). It used to be
// reported as a communicator error and restarted. The run ends with it,
// naming the device, without a restart.
TEST(NcclTwoProcessGpuTest, DeviceFaultIsNotRestartedAsACommunicatorError) {
  const auto out = RunTwoProcesses({.body = FaultWhileACollectiveIsInFlight,
                                    .timeout_s = 10 * kChildLimitS,
                                    .max_restarts = 2});
  TANDEM_SKIP_IF_REFUSED(out);
  std::printf("process 0: %s\n", out[0].Describe().c_str());
  ASSERT_TRUE(out[0].ended) << "process 0: " << out[0].Describe();
  EXPECT_NE(out[0].report.find("cuda:0"), std::string::npos) << out[0].Describe();
  const bool names_the_fault =
      out[0].report.find("cudaErrorIllegalAddress") != std::string::npos ||
      out[0].report.find("illegal memory access") != std::string::npos;
  EXPECT_TRUE(names_the_fault) << out[0].Describe();
  EXPECT_EQ(out[0].report.find("restart"), std::string::npos)
      << "restarted after a fault on the device: " << out[0].Describe();
}

}  // namespace
}  // namespace tandem::dist
