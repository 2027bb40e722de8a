// The in-process communicator's fast paths against plain references: every
// reduction bit-identical to a scalar loop over the ranks in order (rank 0 op
// rank 1 op ...), for every op and dtype, at sizes that cross the loops' blocks
// and do not divide by the world size; the split broadcast and all_gather on
// large buffers; and the group's barrier waking promptly from every phase of its
// wait (spin, sleep) on Cancel.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>
#endif

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "spawn/comm/inprocess/inprocess_communicator.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

template <typename Body>
void RunRanks(int world, Body body, InProcessGroupOptions options = {}) {
  auto group = std::make_shared<InProcessGroup>(world, options);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        InProcessCommunicator comm(r, nn::Device::CPU(), group);
        body(comm);
        // A failed ASSERT returned early: release the ranks waiting for this one.
        if (::testing::Test::HasFailure()) group->Cancel("a check failed on another rank");
      } catch (const std::exception& e) {
        errors[r] = e.what();
        group->Cancel(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Rank r's input at element i: magnitudes from 1e-3 to 1e7 and both signs, so a
// different order of additions gives different bits. Max inputs also hold
// signed zeros and (float types) NaNs, whose handling depends on operand order.
float RawValue(int rank, int64_t i, bool for_max) {
  if (for_max && i % 11 == 3) return (rank % 2 == 0) ? 0.0f : -0.0f;
  if (for_max && i % 13 == 5 && rank == 1) return std::numeric_limits<float>::quiet_NaN();
  const float sign = ((i + rank) % 3 == 0) ? -1.0f : 1.0f;
  return sign * (1.0f / static_cast<float>(1 + i + 7 * rank) + 1e7f * static_cast<float>(i % 2) +
                 0.37f * static_cast<float>(rank));
}

// Bytes of rank r's input tensor of n elements.
std::vector<char> Input(nn::DType dtype, int rank, int64_t n, bool for_max) {
  std::vector<char> bytes(static_cast<size_t>(n * nn::ElementSize(dtype)));
  for (int64_t i = 0; i < n; ++i) {
    const float f = RawValue(rank, i, for_max);
    switch (dtype) {
      case nn::kFloat32: std::memcpy(&bytes[i * 4], &f, 4); break;
      case nn::kFloat64: {
        const double d = static_cast<double>(f) * (1.0 + 1e-9 * static_cast<double>(i % 5));
        std::memcpy(&bytes[i * 8], &d, 8);
        break;
      }
      case nn::kBFloat16: {
        const uint16_t b = nn::BFloat16(f).bits;
        std::memcpy(&bytes[i * 2], &b, 2);
        break;
      }
      case nn::kFloat16: {  // 1e7 is out of range: +-inf, so inf - inf (NaN) is covered
        const uint16_t h = nn::Float16(f).bits;
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
      default: {
        const int64_t v = (i * 7919 + rank * 104729) % 2001 - 1000;
        std::memcpy(&bytes[i * 8], &v, 8);
      }
    }
  }
  return bytes;
}

template <typename T>
T At(const std::vector<char>& bytes, int64_t i) {
  T v;
  std::memcpy(&v, &bytes[i * sizeof(T)], sizeof(T));
  return v;
}

// The scalar loop of the reference: acc = x0; acc = acc op xk for k = 1..n-1;
// avg divides by n at the end.
template <typename A>
A Fold(const A* xs, size_t n, ReduceOp op) {
  A acc = xs[0];
  for (size_t k = 1; k < n; ++k) {
    const A v = xs[k];
    acc = op == ReduceOp::kMax ? (v > acc ? v : acc) : static_cast<A>(acc + v);
  }
  if (op == ReduceOp::kAvg) acc = static_cast<A>(acc / static_cast<A>(n));
  return acc;
}

// The expected bytes of elements [first, first + n) of the reduction of
// inputs[0..world) (at most 8 ranks).
std::vector<char> Expected(nn::DType dtype, const std::vector<std::vector<char>>& inputs,
                           int64_t first, int64_t n, ReduceOp op) {
  const int64_t size = nn::ElementSize(dtype);
  const size_t world = inputs.size();
  std::vector<char> out(static_cast<size_t>(n * size));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = first + i;
    switch (dtype) {
      case nn::kFloat32: {
        float xs[8];
        for (size_t k = 0; k < world; ++k) xs[k] = At<float>(inputs[k], j);
        const float r = Fold(xs, world, op);
        std::memcpy(&out[i * size], &r, size);
        break;
      }
      case nn::kFloat64: {
        double xs[8];
        for (size_t k = 0; k < world; ++k) xs[k] = At<double>(inputs[k], j);
        const double r = Fold(xs, world, op);
        std::memcpy(&out[i * size], &r, size);
        break;
      }
      case nn::kBFloat16: {
        float xs[8];  // bfloat16 sums in float32, rounded once
        for (size_t k = 0; k < world; ++k) {
          nn::BFloat16 b;
          b.bits = At<uint16_t>(inputs[k], j);
          xs[k] = static_cast<float>(b);
        }
        const uint16_t r = nn::BFloat16(Fold(xs, world, op)).bits;
        std::memcpy(&out[i * size], &r, size);
        break;
      }
      case nn::kFloat16: {
        float xs[8];  // float16 likewise
        for (size_t k = 0; k < world; ++k) xs[k] = nn::Float16::ToFloat(At<uint16_t>(inputs[k], j));
        const uint16_t r = nn::Float16(Fold(xs, world, op)).bits;
        std::memcpy(&out[i * size], &r, size);
        break;
      }
      default: {
        int64_t xs[8];
        for (size_t k = 0; k < world; ++k) xs[k] = At<int64_t>(inputs[k], j);
        const int64_t r = Fold(xs, world, op);
        std::memcpy(&out[i * size], &r, size);
      }
    }
  }
  return out;
}

Tensor FromBytes(const std::vector<char>& bytes, nn::Shape shape, nn::DType dtype) {
  Tensor t = nn::empty(shape, {.dtype = dtype});
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::vector<char> Bytes(const Tensor& t) {
  std::vector<char> out(static_cast<size_t>(t.nbytes()));
  std::memcpy(out.data(), t.data_ptr(), out.size());
  return out;
}

// Names the first differing element.
std::string FirstDifference(const std::vector<char>& got, const std::vector<char>& want,
                            int64_t element_size) {
  for (size_t b = 0; b < got.size(); ++b) {
    if (got[b] != want[b]) return "element " + std::to_string(b / element_size);
  }
  return "none";
}

// Parameters: the world size, and the group's staged_bytes: -1 automatic, 0
// (every collective meets twice, reading the ranks' buffers directly) or 1 MB
// (every CPU collective of these tests meets once, through staging buffers).
class BitExactTest : public ::testing::TestWithParam<std::tuple<int, int64_t>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  InProcessGroupOptions options() const { return {.staged_bytes = std::get<1>(GetParam())}; }
};

constexpr nn::DType kDTypes[] = {nn::kFloat32, nn::kFloat64, nn::kBFloat16, nn::kFloat16,
                                 nn::kInt64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};
// 1 element; fewer than the ranks' cache lines; across the loops' 8 KB blocks;
// odd and not divisible by 2, 3 or 4.
constexpr int64_t kSizes[] = {1, 7, 37, 1031, 2048 * 3 + 5};

TEST_P(BitExactTest, AllReduceEqualsTheScalarLoopInRankOrder) {
  const int world = this->world();
  for (nn::DType dtype : kDTypes) {
    for (ReduceOp op : kOps) {
      for (int64_t n : kSizes) {
        std::vector<std::vector<char>> inputs;
        for (int r = 0; r < world; ++r) inputs.push_back(Input(dtype, r, n, op == ReduceOp::kMax));
        const std::vector<char> want = Expected(dtype, inputs, 0, n, op);
        RunRanks(world, [&](Communicator& comm) {
          Tensor x = FromBytes(inputs[comm.rank()], {n}, dtype);
          comm.all_reduce(x, op);
          const std::vector<char> got = Bytes(x);
          ASSERT_TRUE(got == want)
              << nn::DTypeName(dtype) << " " << ReduceOpName(op) << " n=" << n << " rank "
              << comm.rank() << ": first difference at "
              << FirstDifference(got, want, nn::ElementSize(dtype));
        }, options());
      }
    }
  }
}

TEST_P(BitExactTest, ReduceScatterEqualsTheScalarLoopInRankOrder) {
  const int world = this->world();
  for (nn::DType dtype : kDTypes) {
    for (ReduceOp op : kOps) {
      for (int64_t rows : {int64_t{1}, int64_t{5}, int64_t{1031}}) {
        const int64_t n = rows * 3 * world;  // input (world * rows, 3)
        std::vector<std::vector<char>> inputs;
        for (int r = 0; r < world; ++r) inputs.push_back(Input(dtype, r, n, op == ReduceOp::kMax));
        RunRanks(world, [&](Communicator& comm) {
          Tensor x = FromBytes(inputs[comm.rank()], {world * rows, 3}, dtype);
          Tensor part = comm.reduce_scatter(x, op);
          ASSERT_EQ(part.shape(), (nn::Shape{rows, 3}));
          const std::vector<char> want = Expected(dtype, inputs, comm.rank() * rows * 3,
                                                  rows * 3, op);
          ASSERT_TRUE(Bytes(part) == want)
              << nn::DTypeName(dtype) << " " << ReduceOpName(op) << " rows=" << rows;
          ASSERT_TRUE(Bytes(x) == inputs[comm.rank()]) << "reduce_scatter changed its input";
        }, options());
      }
    }
  }
}

TEST_P(BitExactTest, LargeBroadcastAndAllGatherCopyEveryByte) {
  const int world = this->world();
  // Above the split-broadcast threshold (64 KB), odd, with a tail shorter than a line.
  const int64_t n = 20011;
  RunRanks(world, [&](Communicator& comm) {
    for (int root = 0; root < world; ++root) {
      Tensor x = FromBytes(Input(nn::kFloat32, comm.rank(), n, false), {n}, nn::kFloat32);
      comm.broadcast(x, root);
      ASSERT_TRUE(Bytes(x) == Input(nn::kFloat32, root, n, false)) << "root " << root;
    }
    const int64_t m = 5001;
    Tensor mine = FromBytes(Input(nn::kFloat64, comm.rank(), m, false), {m}, nn::kFloat64);
    Tensor all = comm.all_gather(mine);
    ASSERT_EQ(all.shape(), (nn::Shape{world, m}));
    const std::vector<char> got = Bytes(all);
    for (int k = 0; k < world; ++k) {
      const std::vector<char> want = Input(nn::kFloat64, k, m, false);
      ASSERT_EQ(std::memcmp(got.data() + k * m * 8, want.data(), want.size()), 0) << "row " << k;
    }
  }, options());
}

TEST_P(BitExactTest, ManySmallCollectivesInARow) {
  // Back-to-back collectives with no work between them: a rank that runs ahead
  // into the next collective must not disturb one still finishing the last.
  const int world = this->world();
  RunRanks(world, [&](Communicator& comm) {
    for (int round = 0; round < 200; ++round) {
      Tensor x = nn::full({3}, static_cast<double>(comm.rank() + round));
      comm.all_reduce(x, ReduceOp::kSum);
      const double want = world * round + world * (world - 1) / 2.0;
      for (double v : x.to_vector<double>()) ASSERT_EQ(v, want) << "round " << round;
      Tensor y = nn::full({2}, static_cast<double>(comm.rank() == round % world ? round : -1));
      comm.broadcast(y, round % world);
      for (double v : y.to_vector<double>()) ASSERT_EQ(v, round);
    }
  }, options());
}

TEST_P(BitExactTest, LargeCollectivesShareChunksAndStayExact) {
  // Above 64 KB x 2 x world: the ranks claim 64 KB chunks from the group's
  // counter. Several in a row, of different sizes and kinds, so that a rank whose
  // idea of the counter's start drifted would reduce the wrong chunks.
  const int world = this->world();
  struct Case {
    nn::DType dtype;
    ReduceOp op;
    int64_t n;
  };
  const Case cases[] = {{nn::kFloat32, ReduceOp::kSum, 200003},
                        {nn::kFloat64, ReduceOp::kAvg, 70001},
                        {nn::kBFloat16, ReduceOp::kMax, 400009},
                        {nn::kFloat32, ReduceOp::kAvg, 131072 + 17}};
  std::vector<std::vector<std::vector<char>>> inputs;
  std::vector<std::vector<char>> wants;
  for (const Case& c : cases) {
    inputs.emplace_back();
    for (int r = 0; r < world; ++r) {
      inputs.back().push_back(Input(c.dtype, r, c.n, c.op == ReduceOp::kMax));
    }
    wants.push_back(Expected(c.dtype, inputs.back(), 0, c.n, c.op));
  }
  const int64_t b = 300001;  // broadcast bytes (uint8), between the all_reduces
  RunRanks(world, [&](Communicator& comm) {
    for (int round = 0; round < 2; ++round) {
      for (size_t i = 0; i < std::size(cases); ++i) {
        Tensor x = FromBytes(inputs[i][comm.rank()], {cases[i].n}, cases[i].dtype);
        comm.all_reduce(x, cases[i].op);
        const std::vector<char> got = Bytes(x);
        ASSERT_TRUE(got == wants[i])
            << "case " << i << " round " << round << " rank " << comm.rank() << ": first "
            << "difference at " << FirstDifference(got, wants[i], nn::ElementSize(cases[i].dtype));
        const int root = static_cast<int>(i) % world;
        Tensor y = nn::full({b}, comm.rank() + 1.0, {.dtype = nn::kUInt8});
        comm.broadcast(y, root);
        const std::vector<char> sent = Bytes(y);
        ASSERT_EQ(std::count(sent.begin(), sent.end(), static_cast<char>(root + 1)), b)
            << "broadcast from " << root;
      }
    }
  }, options());
}

TEST_P(BitExactTest, StagedAndDirectCollectivesInterleave) {
  // Staged collectives (one meeting) between direct ones (two) and barriers: the
  // halves of the slots and staging buffers follow the barrier count, whatever
  // mix of collectives ran before. Every collective checks its result.
  const int world = this->world();
  RunRanks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    for (int round = 0; round < 60; ++round) {
      const int64_t n = (round % 3 == 0) ? 5 : (round % 3 == 1) ? 300 : 3000;  // 20 B .. 12 KB
      Tensor x = nn::full({n}, static_cast<double>(r + round), {.dtype = nn::kFloat32});
      comm.all_reduce(x, ReduceOp::kSum);
      const float want = static_cast<float>(world * round + world * (world - 1) / 2);
      for (float v : x.to_vector<float>()) ASSERT_EQ(v, want) << "round " << round << " n " << n;
      if (round % 4 == 0) comm.barrier();
      Tensor rows = nn::full({world, n}, static_cast<double>(r + 1), {.dtype = nn::kFloat32});
      Tensor part = comm.reduce_scatter(rows, ReduceOp::kMax);
      for (float v : part.to_vector<float>()) ASSERT_EQ(v, static_cast<float>(world));
      Tensor mine = nn::full({n}, static_cast<double>(r * 1000 + round), {.dtype = nn::kFloat32});
      const std::vector<float> all = comm.all_gather(mine).to_vector<float>();
      for (int k = 0; k < world; ++k) {
        ASSERT_EQ(all[k * n], static_cast<float>(k * 1000 + round)) << "row " << k;
        ASSERT_EQ(all[k * n + n - 1], static_cast<float>(k * 1000 + round)) << "row " << k;
      }
      const int root = round % world;
      Tensor y = nn::full({n}, static_cast<double>(r == root ? round : -1), {.dtype = nn::kFloat32});
      comm.broadcast(y, root);
      for (float v : y.to_vector<float>()) ASSERT_EQ(v, static_cast<float>(round));
    }
  }, {.staged_bytes = std::get<1>(GetParam()) == -1 ? 4096 : std::get<1>(GetParam())});
}

INSTANTIATE_TEST_SUITE_P(Ranks, BitExactTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(int64_t{-1}, int64_t{0},
                                                              int64_t{1} << 20)));

// The wake tests: a waiter asleep in the kernel must return soon after the
// arrival or the Cancel that wakes it. The group's own re-check of sleepers
// (sleep_recheck_ns, 50 ms by default) would let a wake that never comes pass
// after 50 ms, so these groups re-check only after kRecheckNs, five times the
// limit kWakeLimitS: a missing wake fails the test. A woken thread runs within
// microseconds on an idle machine; the limit leaves seconds for a loaded 2-core
// machine under ThreadSanitizer (scheduling delays there are tens of ms).
constexpr double kWakeLimitS = 4.0;
constexpr int64_t kRecheckNs = 20'000'000'000;

InProcessGroupOptions WithoutSelfWake(InProcessGroupOptions options = {}) {
  options.sleep_recheck_ns = kRecheckNs;
  return options;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST(InProcessGroupWaitTest, RankBarrierOrdersWritesAcrossManyRounds) {
  const int world = 4;  // more ranks than this machine's cores: the sleep path runs
  InProcessGroup group(world);
  std::vector<int> marks(world, 0);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      for (int round = 1; round <= 500; ++round) {
        marks[r] = round;
        group.ArriveAndWait(r);
        for (int k = 0; k < world; ++k) {
          if (marks[k] != round) ++failures;
        }
        group.ArriveAndWait(r);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

#ifdef __linux__
// A CPU this thread may run on: the one it runs on now if known (test processes
// running side by side then tend to pick different CPUs), else the first allowed.
int SomeAllowedCpu() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return -1;
  const int now = sched_getcpu();
  if (now >= 0 && now < CPU_SETSIZE && CPU_ISSET(now, &allowed)) return now;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) return cpu;
  }
  return -1;
}

// Pins the calling thread to `cpu`; false if it cannot.
bool PinTo(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0;
}

// Pins the calling thread to one CPU while it lives, then restores its affinity.
// A group created meanwhile sees one usable CPU: more ranks than CPUs, so its
// waiters yield (InProcessGroup), on a machine of any size.
class PinnedScope {
 public:
  explicit PinnedScope(int cpu) {
    saved_ok_ = pthread_getaffinity_np(pthread_self(), sizeof saved_, &saved_) == 0;
    pinned_ = saved_ok_ && PinTo(cpu);
  }
  ~PinnedScope() {
    if (saved_ok_) pthread_setaffinity_np(pthread_self(), sizeof saved_, &saved_);
  }
  bool pinned() const { return pinned_; }

 private:
  cpu_set_t saved_{};
  bool saved_ok_ = false;
  bool pinned_ = false;
};

// Voluntary context switches and CPU time (us) of the calling thread so far.
std::pair<long, long> ThreadSwitchesAndCpuUs() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  const long cpu_us = (usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) * 1'000'000L +
                      usage.ru_utime.tv_usec + usage.ru_stime.tv_usec;
  return {usage.ru_nvcsw, cpu_us};
}

// Tests of ranks that share one CPU, cpu_ (one this process may run on); skipped
// where sched_getcpu() does not work (no rank would know its CPU).
class OneCpuWaitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cpu_ = SomeAllowedCpu();
    ASSERT_GE(cpu_, 0);
    if (sched_getcpu() < 0) GTEST_SKIP() << "sched_getcpu() is not available: no CPU to share";
  }
  int cpu_ = -1;
};

// The CPUs this thread may run on, starting with `first` (then in order).
std::vector<int> AllowedCpusFrom(int first) {
  std::vector<int> cpus{first};
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (cpu != first && CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
  }
  return cpus;
}

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// CPU time of the calling thread (ns; exact, where rusage's split is in ticks).
int64_t ThreadCpuNs() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
}

// Ranks that share one CPU hand it to each other with sched_yield instead of
// sleeping in the kernel: a sleep makes the CPU switch twice and the arrival that
// completes the barrier wake the sleeper (about 30 us on the 2-vCPU VM, against
// under 1 us for a yield; docs/benchmarks.md). Counted by the voluntary context
// switches of the rank threads: a wait that sleeps is one, a yield is not. With
// sleeps, 2 of the 3 ranks would switch at every barrier (8,000 here).
TEST_F(OneCpuWaitTest, RanksSharingOneCpuYieldInsteadOfSleeping) {
  const int world = 3;
  const int rounds = 2000;
  // Another busy thread on the ranks' CPU rightly makes them sleep: a yield can
  // hand it a whole time slice, and the group then pauses yielding for 1 ms or
  // more (InProcessGroup). Whether that happened is measured here, not asked of
  // the group: the three ranks are pinned to one CPU and one of them is always
  // runnable (yielding, or the last arrival running on while the others sleep),
  // so over the measured rounds the CPU time of the ranks is the wall time less
  // what other threads (or the hypervisor) took from that CPU. An attempt counts
  // when they took under 1 ms: a pause needs a yield kept away for over 500 us,
  // so at most one pause per rank (3 x 1 ms of sleeping, a few hundred
  // switches), far below the limit; sleeping waits give about 8,000 however
  // quiet the CPU. Up to 10 attempts, on each allowed CPU in turn, 200 ms apart
  // (a test process beside this one may leave one CPU or a moment free);
  // skipped when no attempt was quiet. The fewest switches of a quiet attempt
  // count.
  constexpr int64_t kQuietNs = 1'000'000;
  const std::vector<int> cpus = AllowedCpusFrom(cpu_);
  long fewest = -1;
  uint64_t pauses_of_fewest = 0;
  std::string busy;  // what other threads took in the attempts that did not count
  for (int attempt = 0; attempt < 10 && (fewest < 0 || fewest >= rounds / 4); ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const int cpu = cpus[attempt % cpus.size()];
    std::unique_ptr<InProcessGroup> group;
    {
      PinnedScope pin(cpu);
      if (!pin.pinned()) GTEST_SKIP() << "could not pin a thread to CPU " << cpu;
      group = std::make_unique<InProcessGroup>(world);
    }
    std::vector<int> marks(world, 0);
    std::atomic<int> failures{0};
    std::atomic<bool> pinned{true};
    std::atomic<long> voluntary_switches{0};
    // Per rank: wall and CPU time at the start and the end of the measured rounds.
    std::vector<int64_t> wall_start(world), wall_end(world), cpu_start(world), cpu_end(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        if (!PinTo(cpu)) pinned = false;
        for (int round = 1; round <= 50; ++round) group->ArriveAndWait(r);  // warm up
        const long before = ThreadSwitchesAndCpuUs().first;
        wall_start[r] = SteadyNs();
        cpu_start[r] = ThreadCpuNs();
        for (int round = 1; round <= rounds; ++round) {
          marks[r] = round;
          group->ArriveAndWait(r);
          for (int k = 0; k < world; ++k) {
            if (marks[k] != round) ++failures;
          }
          group->ArriveAndWait(r);
        }
        cpu_end[r] = ThreadCpuNs();
        wall_end[r] = SteadyNs();
        voluntary_switches += ThreadSwitchesAndCpuUs().first - before;
      });
    }
    for (auto& t : threads) t.join();
    if (!pinned) GTEST_SKIP() << "could not pin the rank threads to CPU " << cpu;
    EXPECT_EQ(failures.load(), 0);
    int64_t ranks_cpu_ns = 0;
    for (int r = 0; r < world; ++r) ranks_cpu_ns += cpu_end[r] - cpu_start[r];
    const int64_t wall_ns = *std::max_element(wall_end.begin(), wall_end.end()) -
                            *std::min_element(wall_start.begin(), wall_start.end());
    const int64_t others_ns = wall_ns - ranks_cpu_ns;
    if (others_ns >= kQuietNs) {
      absl::StrAppend(&busy, " ", others_ns / 1000, " us of ", wall_ns / 1000, " (CPU ", cpu, ")");
      continue;
    }
    if (fewest < 0 || voluntary_switches.load() < fewest) {
      fewest = voluntary_switches.load();
      pauses_of_fewest = group->yield_pauses();
    }
  }
  if (fewest < 0) {
    GTEST_SKIP() << "other threads shared the ranks' CPU for 1 ms or more in every attempt:"
                 << busy;
  }
  EXPECT_LT(fewest, rounds) << "voluntary switches over " << 2 * rounds
                            << " barriers (on a CPU that other threads used for under 1 ms; "
                            << "the group paused yielding " << pauses_of_fewest << " times)";
}

// A rank that last ran on the waiter's CPU but is not runnable (here: asleep for
// 100 ms) leaves nothing to yield to: the waiter's yields return at once and
// count as spinning, so it sleeps after its spin budget instead of burning the
// CPU for the whole wait.
TEST_F(OneCpuWaitTest, WaiterDoesNotBurnTheCpuOfASleepingRank) {
  PinnedScope pin(cpu_);  // this thread is rank 1, on the waiter's CPU
  if (!pin.pinned()) GTEST_SKIP() << "could not pin a thread to CPU " << cpu_;
  InProcessGroup group(2);
  std::pair<long, long> waited{0, 0};
  std::atomic<bool> pinned{true};
  std::atomic<bool> rank1_back{false};
  std::atomic<bool> waiter_late{false};
  std::thread waiter([&] {
    if (!PinTo(cpu_)) pinned = false;
    group.ArriveAndWait(0);
    const std::pair<long, long> before = ThreadSwitchesAndCpuUs();
    if (rank1_back.load()) waiter_late = true;  // a loaded machine held it back 100 ms
    group.ArriveAndWait(0);
    const std::pair<long, long> after = ThreadSwitchesAndCpuUs();
    waited = {after.first - before.first, after.second - before.second};
  });
  group.ArriveAndWait(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  rank1_back = true;
  group.ArriveAndWait(1);
  waiter.join();
  if (!pinned) GTEST_SKIP() << "could not pin the waiter to CPU " << cpu_;
  if (waiter_late) GTEST_SKIP() << "the waiter arrived after the 100 ms: nothing to wait for";
  // The spin budget is at most 50 us, and the futex re-checks every 50 ms (a few
  // voluntary switches): about 0.1 ms of CPU here. Yields that never ran out (a
  // bug this test found) cost 1-6 ms; spinning through the wait, 100 ms.
  EXPECT_LT(waited.second, 1'000) << "us of CPU while waiting 100 ms";
  EXPECT_GE(waited.first, 1) << "the waiter never slept";
}

// Ranks that share one CPU with a missing rank of that CPU yield to each other,
// then sleep; Cancel reaches them in either phase. The cancel comes 20 us after
// they start waiting (most likely while they yield: a yielding waiter sees it at
// its next look) or 20 ms after (asleep after their 200 us of hand-overs: Cancel
// must wake them, the group's own re-check comes only after kRecheckNs).
TEST_F(OneCpuWaitTest, CancelReachesYieldingWaiters) {
  PinnedScope pin(cpu_);  // this thread is rank 2, on the waiters' CPU
  if (!pin.pinned()) GTEST_SKIP() << "could not pin a thread to CPU " << cpu_;
  const int world = 3;
  for (const int delay_us : {20, 20'000}) {
    SCOPED_TRACE(absl::StrCat("cancelled after ", delay_us, " us"));
    InProcessGroup group(world, WithoutSelfWake());
    std::atomic<int> cancelled{0};
    std::atomic<int> first_done{0};
    std::vector<std::thread> waiters;
    for (int r = 0; r < world - 1; ++r) {
      waiters.emplace_back([&, r] {
        PinTo(cpu_);
        group.ArriveAndWait(r);
        ++first_done;
        try {
          group.ArriveAndWait(r);  // rank 2 stays away
        } catch (const CancelledError& e) {
          EXPECT_NE(std::string(e.what()).find("rank 2 failed"), std::string::npos) << e.what();
          ++cancelled;
        }
      });
    }
    group.ArriveAndWait(world - 1);
    while (first_done.load() < world - 1) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    const auto start = std::chrono::steady_clock::now();
    group.Cancel("rank 2 failed");
    for (auto& t : waiters) t.join();
    const double waited_s = SecondsSince(start);
    EXPECT_EQ(cancelled.load(), world - 1);
    EXPECT_LT(waited_s, kWakeLimitS);
  }
}
#endif  // __linux__

// Waiters are cancelled after `delay`, which puts them in the spin (0, 10 us) or
// the sleep (300 ms >> the 50 us spin) phase; each must throw soon after: a
// spinning waiter at its next look, a sleeping one woken by Cancel (the group's
// own re-check comes only after kRecheckNs).
void ExpectCancelWakes(std::chrono::microseconds delay, bool per_rank) {
  const int world = 3;
  InProcessGroup group(world, WithoutSelfWake());
  std::atomic<int> cancelled{0};
  std::vector<std::thread> waiters;
  for (int r = 0; r < world - 1; ++r) {
    waiters.emplace_back([&, r] {
      try {
        if (per_rank) {
          group.ArriveAndWait(r);
        } else {
          group.ArriveAndWait();
        }
      } catch (const CancelledError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 2 failed"), std::string::npos) << e.what();
        ++cancelled;
      }
    });
  }
  std::this_thread::sleep_for(delay);
  const auto start = std::chrono::steady_clock::now();
  group.Cancel("rank 2 failed");
  for (auto& t : waiters) t.join();
  const double waited_s = SecondsSince(start);
  EXPECT_EQ(cancelled.load(), world - 1);
  EXPECT_LT(waited_s, kWakeLimitS) << "delay " << delay.count() << " us";
  EXPECT_THROW(group.ArriveAndWait(0), CancelledError);
  EXPECT_THROW(group.ArriveAndWait(), CancelledError);
  EXPECT_TRUE(group.cancelled());
}

TEST(InProcessGroupWaitTest, CancelWakesSpinningAndSleepingWaiters) {
  for (bool per_rank : {true, false}) {
    for (int delay_us : {0, 10, 300'000}) {
      ExpectCancelWakes(std::chrono::microseconds(delay_us), per_rank);
    }
  }
}

// A waiter asleep in the kernel passes the barrier soon after the last arrival,
// which must wake it (the group's own re-check comes only after kRecheckNs).
// Both barriers: the per-rank one and the shared one.
TEST(InProcessGroupWaitTest, SleepingWaiterWakesOnTheLastArrival) {
  for (const bool per_rank : {true, false}) {
    SCOPED_TRACE(per_rank ? "ArriveAndWait(rank)" : "ArriveAndWait()");
    InProcessGroup group(2, WithoutSelfWake());
    std::atomic<bool> passed{false};
    std::chrono::steady_clock::time_point passed_at;
    std::thread waiter([&] {
      if (per_rank) {
        group.ArriveAndWait(0);
      } else {
        group.ArriveAndWait();
      }
      passed_at = std::chrono::steady_clock::now();
      passed = true;
    });
    // Long enough to be asleep in the kernel (the spin ends after 50 us, yields
    // after 200 us of hand-overs).
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_FALSE(passed.load());
    const auto arrived_at = std::chrono::steady_clock::now();
    if (per_rank) {
      group.ArriveAndWait(1);
    } else {
      group.ArriveAndWait();
    }
    waiter.join();
    ASSERT_TRUE(passed.load());
    EXPECT_LT(std::chrono::duration<double>(passed_at - arrived_at).count(), kWakeLimitS);
  }
}

// Ranks 0 .. world-2 run a collective that rank world-1 never completes; the
// group is cancelled while they sleep in `phase` and each must throw
// CancelledError soon after (woken by Cancel: the group's own re-check comes
// only after kRecheckNs). phase: "staged" (the one meeting of a staged
// all_reduce), "publish" or "finish" (the first or the second meeting of a
// direct one; for "finish" the test thread plays rank world-1 through the first
// meeting by publishing a matching slot, then stays away).
void ExpectCancelReleases(const std::string& phase) {
  const int world = 3;
  const int64_t n = phase == "staged" ? 16 : 100'000;
  auto group = std::make_shared<InProcessGroup>(
      world, WithoutSelfWake(InProcessGroupOptions{.staged_bytes = 1024}));
  std::atomic<int> cancelled{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < world - 1; ++r) {
    ranks.emplace_back([&, r] {
      InProcessCommunicator comm(r, nn::Device::CPU(), group);
      Tensor x = nn::full({n}, 1.0, {.dtype = nn::kFloat32});
      try {
        comm.all_reduce(x);
        ADD_FAILURE() << phase << ": rank " << r << " returned";
      } catch (const CancelledError& e) {
        EXPECT_NE(std::string(e.what()).find("stopped"), std::string::npos) << e.what();
        ++cancelled;
      }
    });
  }
  std::vector<float> absent(static_cast<size_t>(n), 1.0f);
  if (phase == "finish") {
    const int last = world - 1;
    InProcessGroup::Slot& s = group->slot(last, group->parity(last));
    s.op = "all_reduce";
    s.sequence = 1;
    s.numel = n;
    s.dtype = nn::kFloat32;
    s.arg = static_cast<int>(ReduceOp::kSum);
    s.device = nn::Device::CPU();
    s.send = absent.data();
    s.recv = absent.data();
    group->ArriveAndWait(last);
  }
  // Long enough that the waiters sleep in the kernel.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(cancelled.load(), 0) << phase;
  const auto start = std::chrono::steady_clock::now();
  group->Cancel("stopped by the test");
  for (auto& t : ranks) t.join();
  const double waited_s = SecondsSince(start);
  EXPECT_EQ(cancelled.load(), world - 1) << phase;
  EXPECT_LT(waited_s, kWakeLimitS) << phase;
}

TEST(InProcessCommunicatorCancelTest, CancelReleasesRanksInEveryMeeting) {
  for (const char* phase : {"staged", "publish", "finish"}) ExpectCancelReleases(phase);
}

TEST(CommunicatorDTypeTest, UnsupportedDTypeIsAnErrorOnEveryRank) {
  std::atomic<int> errors{0};
  auto group = std::make_shared<InProcessGroup>(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      InProcessCommunicator comm(r, nn::Device::CPU(), group);
      // 4 bytes: rank 0's 64-byte-aligned slice is empty, yet it must reject the dtype too.
      Tensor x = nn::zeros({4}, {.dtype = nn::kUInt8});
      try {
        comm.all_reduce(x);
      } catch (const CancelledError& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("uint8"), std::string::npos) << e.what();
        ++errors;
        group->Cancel(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 2);
}

}  // namespace
}  // namespace tandem::dist
