// The cross-process layer without MPI, under ThreadSanitizer (label tsan_ok):
// P "processes" in one process, each with its HierarchicalExchange, its
// communication thread (Serve with a ControlPlane and a cross-process
// StepAgreement) and L rank threads, joined by an in-memory ProcessTransport
// whose operations complete when every process has started them (in order, per
// channel), as MPI's non-blocking collectives do. The MPI tests (label mpi) run
// the same code between real processes, but not under TSan.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nn/error.h"
#include "nn/tensor.h"
#include "spawn/comm/mpi/hierarchical_communicator.h"
#include "spawn/internal/process_world.h"
#include "spawn/signals.h"

namespace tandem::dist::internal {
namespace {

// The processes' meeting point: operation k of a channel completes when all P
// processes have started it; each then fills its own output from the inputs.
class Hub {
 public:
  explicit Hub(int processes) : processes_(processes) {}
  int processes() const { return processes_; }

  struct Op {
    std::vector<std::string> inputs;  // per process
    int started = 0;
  };
  // Process p starts its next operation of `channel` with `input`; returns its index.
  int64_t Start(int channel, int p, std::string input) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t k = next_[{channel, p}]++;
    Op& op = ops_[{channel, k}];
    if (op.inputs.empty()) op.inputs.resize(processes_);
    op.inputs[p] = std::move(input);
    ++op.started;
    return k;
  }
  // Every process's input once all started, else null.
  std::optional<std::vector<std::string>> Inputs(int channel, int64_t k) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Op& op = ops_.at({channel, k});
    if (op.started < processes_) return std::nullopt;
    return op.inputs;
  }

 private:
  const int processes_;
  std::mutex mutex_;
  std::map<std::pair<int, int>, int64_t> next_;
  std::map<std::pair<int, int64_t>, Op> ops_;
};

class HubOp final : public PendingOp {
 public:
  using Finish = std::function<void(const std::vector<std::string>&)>;
  HubOp(Hub* hub, int channel, int64_t k, Finish finish)
      : hub_(hub), channel_(channel), k_(k), finish_(std::move(finish)) {}
  bool Test() override {
    if (done_) return true;
    std::optional<std::vector<std::string>> inputs = hub_->Inputs(channel_, k_);
    if (!inputs) return false;
    finish_(*inputs);
    done_ = true;
    return true;
  }

 private:
  Hub* hub_;
  int channel_;
  int64_t k_;
  Finish finish_;
  bool done_ = false;
};

std::string Bytes(const void* p, int64_t n) { return std::string(static_cast<const char*>(p), n); }

class HubTransport final : public ProcessTransport {
 public:
  static constexpr int kData = 0, kControl = 1;
  HubTransport(Hub* hub, int index) : hub_(hub), index_(index) {}
  int process_index() const override { return index_; }
  int process_count() const override { return hub_->processes(); }

  std::unique_ptr<PendingOp> AllGatherInPlace(void* recv, const std::vector<int64_t>& counts) override {
    std::vector<int64_t> offsets = Offsets(counts);
    const int64_t k = hub_->Start(kData, index_, Bytes(static_cast<char*>(recv) + offsets[index_], counts[index_]));
    return Make(kData, k, [=, this](const std::vector<std::string>& in) {
      for (int q = 0; q < process_count(); ++q) {
        std::memcpy(static_cast<char*>(recv) + offsets[q], in[q].data(), in[q].size());
      }
    });
  }
  std::unique_ptr<PendingOp> AllToAll(const void* send, const std::vector<int64_t>& send_counts,
                                      void* recv, const std::vector<int64_t>& recv_counts) override {
    const int64_t k = hub_->Start(kData, index_, Bytes(send, Total(send_counts)));
    const std::vector<int64_t> recv_offsets = Offsets(recv_counts);
    return Make(kData, k, [=, this, me = index_](const std::vector<std::string>& in) {
      // Process q's send buffer holds, at its offset for `me`, the block for me;
      // every process uses the same slicing, so q's offsets equal mine.
      for (int q = 0; q < process_count(); ++q) {
        const std::vector<int64_t> theirs = Offsets(send_counts);  // same element slicing
        std::memcpy(static_cast<char*>(recv) + recv_offsets[q], in[q].data() + theirs[me],
                    static_cast<size_t>(recv_counts[q]));
      }
    });
  }
  std::unique_ptr<PendingOp> Broadcast(void* data, int64_t bytes, int root) override {
    const int64_t k = hub_->Start(kData, index_, Bytes(data, bytes));
    return Make(kData, k, [=](const std::vector<std::string>& in) {
      std::memcpy(data, in[root].data(), static_cast<size_t>(bytes));
    });
  }
  std::unique_ptr<PendingOp> Barrier() override {
    const int64_t k = hub_->Start(kData, index_, "");
    return Make(kData, k, [](const std::vector<std::string>&) {});
  }
  std::unique_ptr<PendingOp> AllReduceInPlace(void* data, int64_t count, nn::DType dtype,
                                              ReduceOp op) override {
    if (dtype == nn::kInt64) {  // the exchange's check before each collective: a MAX
      EXPECT_EQ(op, ReduceOp::kMax);
      const int64_t k = hub_->Start(kData, index_, Bytes(data, count * 8));
      return Make(kData, k, [=](const std::vector<std::string>& in) {
        MaxInt64(in, static_cast<int64_t*>(data), static_cast<int>(count));
      });
    }
    EXPECT_EQ(dtype, nn::kFloat32);
    const int64_t k = hub_->Start(kData, index_, Bytes(data, count * 4));
    return Make(kData, k, [=](const std::vector<std::string>& in) {
      float* out = static_cast<float*>(data);
      for (int64_t i = 0; i < count; ++i) {
        float acc = reinterpret_cast<const float*>(in[0].data())[i];
        for (size_t q = 1; q < in.size(); ++q) {
          const float v = reinterpret_cast<const float*>(in[q].data())[i];
          acc = op == ReduceOp::kMax ? std::max(acc, v) : acc + v;
        }
        out[i] = acc;
      }
    });
  }
  std::unique_ptr<PendingOp> ControlAllReduceMax(int64_t* data, int n) override {
    const int64_t k = hub_->Start(kControl, index_, Bytes(data, n * 8));
    return Make(kControl, k, [=](const std::vector<std::string>& in) { MaxInt64(in, data, n); });
  }

 private:
  // Every process must send as many words as this one expects (as MPI's
  // all-reduce requires: otherwise MPI_ERR_TRUNCATE or a hang): a round or a
  // check whose size differs between the processes fails the test.
  static void MaxInt64(const std::vector<std::string>& in, int64_t* out, int n) {
    for (size_t q = 0; q < in.size(); ++q) {
      if (in[q].size() != static_cast<size_t>(n) * 8) {
        ADD_FAILURE() << "a MAX all-reduce of " << n << " int64 met process " << q << "'s "
                      << in[q].size() / 8;
        throw Error(absl::StrCat("test transport: a MAX all-reduce of ", n,
                                 " int64 met process ", q, "'s ", in[q].size() / 8));
      }
    }
    for (int i = 0; i < n; ++i) {
      int64_t m = INT64_MIN;
      for (const std::string& s : in) m = std::max(m, reinterpret_cast<const int64_t*>(s.data())[i]);
      out[i] = m;
    }
  }
  static std::vector<int64_t> Offsets(const std::vector<int64_t>& counts) {
    std::vector<int64_t> offsets;
    int64_t at = 0;
    for (int64_t c : counts) {
      offsets.push_back(at);
      at += c;
    }
    return offsets;
  }
  static int64_t Total(const std::vector<int64_t>& counts) {
    int64_t t = 0;
    for (int64_t c : counts) t += c;
    return t;
  }
  std::unique_ptr<PendingOp> Make(int channel, int64_t k, HubOp::Finish finish) {
    if (channel == kData && data_ops_++ == fail_data_op_) {
      // Started at the hub (the other processes' op completes), failed here.
      class FailingOp final : public PendingOp {
       public:
        bool Test() override { throw Error("test transport error"); }
      };
      return std::make_unique<FailingOp>();
    }
    if (channel == kData && data_ops_ - 1 == slow_data_op_) {
      // Completes no sooner than slow_for_ after it started (the rounds go on meanwhile).
      class SlowOp final : public PendingOp {
       public:
        SlowOp(std::unique_ptr<PendingOp> op, std::chrono::steady_clock::duration delay)
            : op_(std::move(op)), ready_(std::chrono::steady_clock::now() + delay) {}
        bool Test() override { return std::chrono::steady_clock::now() >= ready_ && op_->Test(); }

       private:
        std::unique_ptr<PendingOp> op_;
        std::chrono::steady_clock::time_point ready_;
      };
      return std::make_unique<SlowOp>(std::make_unique<HubOp>(hub_, channel, k, std::move(finish)),
                                      slow_for_);
    }
    return std::make_unique<HubOp>(hub_, channel, k, std::move(finish));
  }
  Hub* hub_;
  int index_;
  int64_t data_ops_ = 0;

 public:
  // The data operation with this index (0-based, on this process) fails in Test.
  int64_t fail_data_op_ = -1;
  int64_t slow_data_op_ = -1;  // this data operation completes slow_for_ late
  std::chrono::steady_clock::duration slow_for_{};
};

std::string ProcessLabel(int p) { return absl::StrCat("process ", p); }

// A process's communication thread in the jobs below whose failures are kept:
// its ControlPlane (rounds and the collective comparison) serves the exchange;
// a failure is kept in `failure` and stops the process.
void ServeKeepingFailure(HubTransport& transport, StepAgreement& agreement,
                         HierarchicalExchange& exchange, const std::atomic<int>& running,
                         std::string& failure, std::stop_source& stop) {
  ControlPlane control(&transport,
                       {.agreement = &agreement,
                        .fail = [&](absl::Status s) {
                          failure = std::string(s.message());
                          stop.request_stop();
                        },
                        .collectives_entered = [] { return uint64_t{0}; }},
                       [&] { return running.load(); }, [](const std::vector<int64_t>&) {},
                       {.exchange = &exchange, .name = ProcessLabel});
  exchange.Serve(stop.get_token(), &control);
}

// P processes x L ranks: every step an all_reduce of each rank's global index +
// 1 (checked: the sum over the world), then the step boundary; a stop requested
// by one process's rank at `stop_at` must stop every rank at one later step.
void RunJob(int processes, int local, int64_t stop_at, int stopper) {
  Hub hub(processes);
  std::vector<int> ranks_per_process(processes, local);
  const int world = processes * local;
  std::vector<std::unique_ptr<HubTransport>> transports;
  std::vector<std::shared_ptr<HierarchicalExchange>> exchanges;
  std::vector<std::unique_ptr<StepAgreement>> agreements;
  std::vector<std::unique_ptr<std::atomic<int>>> running;
  for (int p = 0; p < processes; ++p) {
    transports.push_back(std::make_unique<HubTransport>(&hub, p));
    exchanges.push_back(std::make_shared<HierarchicalExchange>(p, ranks_per_process, transports[p].get()));
    agreements.push_back(std::make_unique<StepAgreement>(local, nullptr, 60, true));
    running.push_back(std::make_unique<std::atomic<int>>(local));
  }
  std::vector<int64_t> stopped_at(world, -1);
  std::vector<std::thread> threads;
  std::stop_source never;
  for (int p = 0; p < processes; ++p) {
    threads.emplace_back([&, p] {  // the communication thread
      // The collectives match: the rounds' comparison of them stays silent.
      ControlPlane control(
          transports[p].get(),
          {.agreement = agreements[p].get(),
           .fail = [](absl::Status s) { ADD_FAILURE() << s; },
           .collectives_entered = [] { return uint64_t{0}; }},
          [&, p] { return running[p]->load(); }, [](const std::vector<int64_t>&) {},
          {.exchange = exchanges[p].get(), .name = ProcessLabel});
      exchanges[p]->Serve(never.get_token(), &control);
    });
    for (int l = 0; l < local; ++l) {
      threads.emplace_back([&, p, l] {
        const int global = p * local + l;
        HierarchicalCommunicator comm(l, nn::Device::CPU(), exchanges[p]);
        for (int64_t step = 1; step < 100000; ++step) {
          nn::Tensor x = nn::full({3}, static_cast<double>(global + 1), {.dtype = nn::kFloat32});
          comm.all_reduce(x, ReduceOp::kSum);
          EXPECT_EQ(x.to_vector<float>()[2], world * (world + 1) / 2.0f);
          if (p == stopper && l == 0 && step == stop_at) agreements[p]->RequestStop("test");
          if (agreements[p]->AtBoundary(l, step, false).stop) {
            stopped_at[global] = step;
            nn::Tensor y = nn::ones({2});
            // The save's collectives still work; the handle says when its
            // collective is done without a wait, and carries its number.
            std::shared_ptr<Work> work = comm.all_reduce_async(y, ReduceOp::kSum);
            EXPECT_EQ(work->sequence(), comm.collectives_entered());
            while (!work->is_completed()) std::this_thread::yield();
            work->wait();
            EXPECT_EQ(y.to_vector<float>()[0], static_cast<float>(world));
            const std::vector<FlightRecord> records = comm.FlightRecords();
            EXPECT_FALSE(records.empty());  // no ASSERT: the rank must still exit below
            if (!records.empty()) {
              EXPECT_EQ(records.back().sequence, work->sequence());
              EXPECT_STREQ(records.back().op, "all_reduce_async");
              EXPECT_EQ(records.back().state, CollectiveState::kCompleted);
            }
            break;
          }
        }
        exchanges[p]->RankExited(l);
        running[p]->fetch_sub(1);
      });
    }
  }
  for (std::thread& t : threads) t.join();
  for (int g = 0; g < world; ++g) {
    EXPECT_EQ(stopped_at[g], stopped_at[0]) << "global rank " << g;
  }
  EXPECT_GT(stopped_at[0], stop_at);
}

// P processes x L ranks, each rank `collectives` collectives of every kind the
// exchange runs, the same on every rank (async all-reduces two at a time in
// flight, as DataParallel's buckets, broadcasts from every root, several dtypes
// and sizes), then it returns. With `differ_last` process 1's ranks broadcast
// the last one from another root (the transport completes it, as MPI does).
// The rounds compare them, also after the ranks returned. Per process:
// hooks.fail's message, or "".
std::vector<std::string> RunMixedJob(int processes, int local, int collectives,
                                     bool differ_last) {
  Hub hub(processes);
  const std::vector<int> ranks_per_process(processes, local);
  const int world = processes * local;
  std::vector<std::unique_ptr<HubTransport>> transports;
  std::vector<std::shared_ptr<HierarchicalExchange>> exchanges;
  std::vector<std::unique_ptr<StepAgreement>> agreements;
  std::vector<std::unique_ptr<std::atomic<int>>> running;
  std::vector<std::stop_source> stops(processes);
  std::vector<std::string> failures(processes);
  for (int p = 0; p < processes; ++p) {
    transports.push_back(std::make_unique<HubTransport>(&hub, p));
    exchanges.push_back(std::make_shared<HierarchicalExchange>(p, ranks_per_process, transports[p].get()));
    agreements.push_back(std::make_unique<StepAgreement>(local, nullptr, 60, true));
    running.push_back(std::make_unique<std::atomic<int>>(local));
  }
  std::vector<std::thread> threads;
  for (int p = 0; p < processes; ++p) {
    threads.emplace_back([&, p] {
      ServeKeepingFailure(*transports[p], *agreements[p], *exchanges[p], *running[p], failures[p],
                          stops[p]);
    });
    for (int l = 0; l < local; ++l) {
      threads.emplace_back([&, p, l] {
        HierarchicalCommunicator comm(l, nn::Device::CPU(), exchanges[p]);
        try {
          for (int step = 0, i = 0; i < collectives; ++step) {  // i: collectives so far
            const int kind = i == collectives - 1 ? 1 : step % 5;
            if (kind == 0 && i + 2 < collectives) {  // two buckets in flight
              nn::Tensor a = nn::ones({i % 7 + 1}), b = nn::ones({i % 11 + 1});
              std::shared_ptr<Work> wa = comm.all_reduce_async(a, ReduceOp::kAvg);
              std::shared_ptr<Work> wb = comm.all_reduce_async(b, ReduceOp::kSum);
              wa->wait();
              wb->wait();
              i += 2;
            } else if (kind <= 1) {
              nn::Tensor x = nn::ones({i % 13 + 1}, {.dtype = nn::kFloat64});
              const bool other = differ_last && p == 1 && i == collectives - 1;
              comm.broadcast(x, other ? (i + 1) % world : i % world);
              ++i;
            } else if (kind == 2) {
              comm.all_gather(nn::ones({2}, {.dtype = nn::kBFloat16}));
              ++i;
            } else if (kind == 3) {
              comm.reduce_scatter(nn::ones({2 * world}), ReduceOp::kMax);
              ++i;
            } else {
              comm.barrier();
              ++i;
            }
          }
        } catch (const std::exception& e) {
          ADD_FAILURE() << "process " << p << " rank " << l << ": " << e.what();
        }
        exchanges[p]->RankExited(l);
        running[p]->fetch_sub(1);
      });
    }
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < processes; ++p) {
    EXPECT_EQ(exchanges[p]->started(), static_cast<uint64_t>(collectives)) << "process " << p;
  }
  return failures;
}

// The last round (no process has a running rank: every process ends at it)
// waits for each process's watchdog to have looked at its ranks after they
// all returned (ServeHooks::exits_polled): before that look no process ends,
// whose Serve would return while the look could still fail the job.
TEST(CrossProcessThreads, TheLastRoundWaitsForTheWatchdogsLookAfterTheExits) {
  constexpr int kProcesses = 2;
  Hub hub(kProcesses);
  const std::vector<int> ranks_per_process(kProcesses, 1);
  std::vector<std::unique_ptr<HubTransport>> transports;
  std::vector<std::shared_ptr<HierarchicalExchange>> exchanges;
  std::vector<std::unique_ptr<StepAgreement>> agreements;
  for (int p = 0; p < kProcesses; ++p) {
    transports.push_back(std::make_unique<HubTransport>(&hub, p));
    exchanges.push_back(
        std::make_shared<HierarchicalExchange>(p, ranks_per_process, transports[p].get()));
    agreements.push_back(std::make_unique<StepAgreement>(1, nullptr, 60, true));
    exchanges[p]->RankExited(0);  // the one rank of each process has returned
  }
  std::atomic<bool> polled{false};  // process 0's watchdog; process 1 waits for none
  std::atomic<int> served{0};
  std::vector<std::thread> threads;
  std::stop_source never;
  for (int p = 0; p < kProcesses; ++p) {
    threads.emplace_back([&, p] {
      ControlPlane control(
          transports[p].get(),
          {.agreement = agreements[p].get(),
           .fail = [](absl::Status s) { ADD_FAILURE() << s; },
           .collectives_entered = [] { return uint64_t{0}; },
           .exits_polled = p == 0 ? std::function<bool()>([&] { return polled.load(); })
                                  : std::function<bool()>()},
          [] { return 0; }, [](const std::vector<int64_t>&) {},
          {.exchange = exchanges[p].get(), .name = ProcessLabel});
      exchanges[p]->Serve(never.get_token(), &control);
      served.fetch_add(1);
    });
  }
  // Twenty round periods: without the wait the last round ends both at once.
  std::this_thread::sleep_for(20 * ControlPlane::kRoundPeriod);
  EXPECT_EQ(served.load(), 0);
  polled = true;
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(served.load(), kProcesses);
}

// Matched collectives of every kind, several ranks per process issuing them
// concurrently, 3000 of them (a round compares 64): nothing is reported, and
// every process's rounds end once the ranks returned and all are compared.
TEST(CrossProcessThreads, MatchedCollectivesOfEveryKindAreNeverReported) {
  for (const std::string& failure : RunMixedJob(3, 2, 3000, false)) EXPECT_EQ(failure, "");
}

// The same job with the last broadcast's root differing on process 1: found
// after the ranks returned, by every process, each naming the same sides.
TEST(CrossProcessThreads, AMismatchInTheLastOfManyCollectivesIsFound) {
  for (const std::string& failure : RunMixedJob(3, 2, 3000, true)) {
    EXPECT_NE(failure.find("process 0 called broadcast #3000 (10 float64, root 5) while process 1 "
                           "called broadcast #3000 (10 float64, root 0)"),
              std::string::npos)
        << failure;
  }
}

TEST(CrossProcessThreads, TwoProcessesStopTogether) { RunJob(2, 2, 20, 1); }
TEST(CrossProcessThreads, ThreeProcessesStopTogether) { RunJob(3, 1, 15, 2); }

// P processes x 1 rank, each rank calling body(process, comm, i) for i = 0, 1,
// ... until its collective throws (or 20 s pass); each process's rounds compare
// the collectives. What the run's failure hook and each rank saw.
struct FailingJob {
  using Body = std::function<void(int, HierarchicalCommunicator&, int)>;
  std::vector<std::string> failures;  // per process: hooks.fail's message, or ""
  std::vector<std::string> outcomes;  // per process: "cancelled", "error: <what>"
  std::vector<double> seconds;        // per process: from the start to the rank's throw

  // fail_data_op: per process, HubTransport::fail_data_op_. check_each: the
  // exchanges compare before each collective too (CheckEachCollective).
  // slow_data_op: on every process, this data operation completes 20 round
  // periods late (HubTransport::slow_data_op_).
  FailingJob(int processes, const Body& body, std::vector<int64_t> fail_data_op = {},
             bool check_each = false, int64_t slow_data_op = -1)
      : failures(processes), outcomes(processes), seconds(processes) {
    Hub hub(processes);
    const std::vector<int> ranks_per_process(processes, 1);
    std::vector<std::unique_ptr<HubTransport>> transports;
    std::vector<std::shared_ptr<HierarchicalExchange>> exchanges;
    std::vector<std::unique_ptr<StepAgreement>> agreements;
    std::vector<std::stop_source> stops(processes);
    std::vector<std::unique_ptr<std::atomic<int>>> running;
    for (int p = 0; p < processes; ++p) {
      transports.push_back(std::make_unique<HubTransport>(&hub, p));
      if (p < static_cast<int>(fail_data_op.size())) transports[p]->fail_data_op_ = fail_data_op[p];
      transports[p]->slow_data_op_ = slow_data_op;
      transports[p]->slow_for_ = 20 * ControlPlane::kRoundPeriod;
      exchanges.push_back(
          std::make_shared<HierarchicalExchange>(p, ranks_per_process, transports[p].get()));
      if (check_each) exchanges[p]->CheckEachCollective(ProcessLabel);
      agreements.push_back(std::make_unique<StepAgreement>(1, nullptr, 60, true));
      running.push_back(std::make_unique<std::atomic<int>>(1));
    }
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int p = 0; p < processes; ++p) {
      threads.emplace_back([&, p] {
        ServeKeepingFailure(*transports[p], *agreements[p], *exchanges[p], *running[p],
                            failures[p], stops[p]);
      });
      threads.emplace_back([&, p] {
        HierarchicalCommunicator comm(0, nn::Device::CPU(), exchanges[p]);
        const auto give_up = start + std::chrono::seconds(20);
        try {
          for (int i = 0; std::chrono::steady_clock::now() < give_up; ++i) body(p, comm, i);
          outcomes[p] = "returned";
        } catch (const CancelledError&) {
          outcomes[p] = "cancelled";
        } catch (const Error& e) {
          outcomes[p] = absl::StrCat("error: ", e.what());
        }
        seconds[p] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        // A rank that failed ends the job, as spawn's abort would: the other
        // processes' ranks would wait for a collective it never enters. (A
        // cancelled rank's process failed through the rounds, as the others do.)
        if (outcomes[p] != "cancelled") {
          for (std::stop_source& stop : stops) stop.request_stop();
        }
        exchanges[p]->RankExited(0);
        running[p]->fetch_sub(1);
      });
    }
    for (std::thread& t : threads) t.join();
  }
};

void AllReduceEight(HierarchicalCommunicator& comm, ReduceOp op = ReduceOp::kSum) {
  nn::Tensor x = nn::full({8}, 1.0, {.dtype = nn::kFloat32});
  comm.all_reduce(x, op);
}

// Collective #3 is a broadcast from process p's own rank on each process p: the
// transport completes it (as MPI does), each process keeping its own data. The
// rounds find it while the ranks go on with all_reduces, and every process's
// run fails with the same message naming every side; the ranks are cancelled.
TEST(CrossProcessThreads, DifferentBroadcastRootsFailEveryProcessNamingEachSide) {
  FailingJob job(3, [](int p, HierarchicalCommunicator& comm, int i) {
    if (i != 2) return AllReduceEight(comm);
    nn::Tensor x = nn::full({8}, 1.0, {.dtype = nn::kFloat32});
    comm.broadcast(x, p);
  });
  const std::string expected =
      "collective mismatch across processes: process 0 called broadcast #3 (8 float32, root 0) "
      "while process 1 called broadcast #3 (8 float32, root 1), process 2 called broadcast #3 "
      "(8 float32, root 2) (op, size, dtype, reduction or root differ";
  for (int p = 0; p < 3; ++p) {
    EXPECT_NE(job.failures[p].find(expected), std::string::npos)
        << "process " << p << ": " << job.failures[p];
    EXPECT_EQ(job.outcomes[p], "cancelled") << "process " << p;
  }
}

// The same with the check before each collective: the broadcast never runs;
// every rank throws the mismatch, naming each side. (The rounds, which go on
// while the check waits for the peers, never see a collective before its
// check passed: the rank's error is never raced by the run's failure.)
TEST(CrossProcessThreads, CheckingEachCollectiveStopsTheMismatchBeforeItsDataMoves) {
  FailingJob job(
      2,
      [](int p, HierarchicalCommunicator& comm, int i) {
        if (i != 2) return AllReduceEight(comm);
        nn::Tensor x = nn::full({8}, static_cast<double>(p), {.dtype = nn::kFloat32});
        comm.broadcast(x, p);
        ADD_FAILURE() << "process " << p << "'s broadcast returned";
      },
      {}, /*check_each=*/true);
  const std::string expected =
      "collective mismatch across processes: process 0 called broadcast #3 (8 float32, root 0) "
      "while process 1 called broadcast #3 (8 float32, root 1)";
  for (int p = 0; p < 2; ++p) {
    EXPECT_NE(job.outcomes[p].find("error: " + expected), std::string::npos)
        << "process " << p << ": " << job.outcomes[p] << "; run's failure: " << job.failures[p];
  }
}

// The same with the check of collective #3 (data operation 4: a check and
// the collective's own for each) 20 round periods slow: the rounds, which
// go on meanwhile, do not compare #3 before its check passed, so each rank
// still throws the mismatch itself (the run's failure does not cancel it).
TEST(CrossProcessThreads, ASlowCheckIsNotRacedByTheRounds) {
  FailingJob job(
      2,
      [](int p, HierarchicalCommunicator& comm, int i) {
        if (i != 2) return AllReduceEight(comm);
        nn::Tensor x = nn::full({8}, static_cast<double>(p), {.dtype = nn::kFloat32});
        comm.broadcast(x, p);
        ADD_FAILURE() << "process " << p << "'s broadcast returned";
      },
      {}, /*check_each=*/true, /*slow_data_op=*/4);
  for (int p = 0; p < 2; ++p) {
    EXPECT_NE(job.outcomes[p].find("error: collective mismatch across processes: process 0 "
                                   "called broadcast #3 (8 float32, root 0) while process 1 "
                                   "called broadcast #3 (8 float32, root 1)"),
              std::string::npos)
        << "process " << p << ": " << job.outcomes[p] << "; run's failure: " << job.failures[p];
    EXPECT_GE(job.seconds[p], 0.9 * std::chrono::duration<double>(20 * ControlPlane::kRoundPeriod).count())
        << "process " << p << ": the check was not slowed";
  }
}

// Matching collectives with the check before each one: the sums are right, and
// nothing is reported (the ranks stop after 200 collectives).
TEST(CrossProcessThreads, CheckingEachCollectiveIsSilentWhenTheyMatch) {
  FailingJob job(
      2,
      [](int p, HierarchicalCommunicator& comm, int i) {
        if (i == 200) throw CancelledError("done");
        nn::Tensor x = nn::full({3}, static_cast<double>(p + 1), {.dtype = nn::kFloat32});
        comm.all_reduce(x, ReduceOp::kSum);
        EXPECT_EQ(x.to_vector<float>()[1], 3.0f);
      },
      {}, /*check_each=*/true);
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(job.failures[p], "") << "process " << p;
    EXPECT_EQ(job.outcomes[p], "cancelled") << "process " << p;
  }
}

// Collective #3 differs between the processes (a sum on process 0, a max on
// processes 1 and 2, which call it under labels: a library call that is a
// collective, as hapi::Model::save is): every process's message names each
// side's label, which only that side's process knew, from the rounds and, with
// the check before each collective, from the ranks' error.
constexpr char kLabelA[] = "test::SaveA (a collective: every rank calls it)";
constexpr char kLabelB[] = "test::SaveB";

void AllReduceEightLabelled(int p, HierarchicalCommunicator& comm, int i) {
  if (i != 2 || p == 0) return AllReduceEight(comm);
  Communicator::Label label(comm, p == 1 ? kLabelA : kLabelB);
  AllReduceEight(comm, ReduceOp::kMax);
}

const std::string kLabelledMismatch =
    "collective mismatch across processes: process 0 called all_reduce #3 (8 float32, sum) "
    "while process 1 called all_reduce #3 (8 float32, max) from test::SaveA (a collective: "
    "every rank calls it), process 2 called all_reduce #3 (8 float32, max) from test::SaveB "
    "(op, size";

TEST(CrossProcessThreads, TheRoundsNameEachSidesLabelOnEveryProcess) {
  FailingJob job(3, AllReduceEightLabelled);
  for (int p = 0; p < 3; ++p) {
    EXPECT_NE(job.failures[p].find(kLabelledMismatch), std::string::npos)
        << "process " << p << ": " << job.failures[p];
  }
}

TEST(CrossProcessThreads, CheckingEachCollectiveNamesEachSidesLabelOnEveryProcess) {
  FailingJob job(3, AllReduceEightLabelled, {}, /*check_each=*/true);
  for (int p = 0; p < 3; ++p) {
    EXPECT_NE(job.outcomes[p].find("error: " + kLabelledMismatch), std::string::npos)
        << "process " << p << ": " << job.outcomes[p] << "; run's failure: " << job.failures[p];
  }
}

// Within one process, the exchange's comparison of its local ranks' requests
// names the label of the rank that called a labelled collective alone, on
// every local rank, whichever rank it is.
TEST(CrossProcessThreads, TheLocalRanksCheckNamesALabelledCall) {
  for (int labelled = 0; labelled < 2; ++labelled) {
    Hub hub(1);
    HubTransport transport(&hub, 0);
    auto exchange = std::make_shared<HierarchicalExchange>(0, std::vector<int>{2}, &transport);
    std::stop_source never;
    std::thread serve([&] { exchange->Serve(never.get_token(), nullptr); });
    std::vector<std::string> errors(2);
    std::vector<std::thread> ranks;
    for (int l = 0; l < 2; ++l) {
      ranks.emplace_back([&, l] {
        HierarchicalCommunicator comm(l, nn::Device::CPU(), exchange);
        try {
          if (l == labelled) {
            Communicator::Label label(comm, kLabelA);
            AllReduceEight(comm);
          } else {
            comm.barrier();
          }
        } catch (const Error& e) {
          errors[l] = e.what();
        }
        exchange->RankExited(l);
      });
    }
    for (std::thread& t : ranks) t.join();
    serve.join();
    const std::string labelled_side =
        "all_reduce #1 (8 float32, sum) from test::SaveA (a collective: every rank calls it)";
    const std::string expected =
        labelled == 0 ? "collective mismatch: rank 0 called " + labelled_side +
                            " while rank 1 called barrier #1"
                      : "collective mismatch: rank 0 called barrier #1 while rank 1 called " +
                            labelled_side;
    for (int l = 0; l < 2; ++l) {
      EXPECT_NE(errors[l].find(expected + " (op, size, dtype, reduction or root differ)"),
                std::string::npos)
          << "rank " << l << " (labelled: rank " << labelled << "): " << errors[l];
    }
  }
}

// Collective #3 differs (sum on process 0, max on process 1) and fails in
// process 0's transport, as MPI_ERR_TRUNCATE does: process 0 holds its error
// until the rounds name the mismatch, which becomes the failure of both; its
// rank is cancelled rather than given the transport's error.
TEST(CrossProcessThreads, ATransportErrorWaitsForTheRoundsToNameTheMismatch) {
  FailingJob job(
      2,
      [](int p, HierarchicalCommunicator& comm, int i) {
        AllReduceEight(comm, i == 2 && p == 1 ? ReduceOp::kMax : ReduceOp::kSum);
      },
      {2, -1});
  for (int p = 0; p < 2; ++p) {
    EXPECT_NE(job.failures[p].find("collective mismatch across processes: process 0 called "
                                   "all_reduce #3 (8 float32, sum) while process 1 called "
                                   "all_reduce #3 (8 float32, max)"),
              std::string::npos)
        << "process " << p << ": " << job.failures[p];
  }
  EXPECT_EQ(job.outcomes[0], "cancelled");
  EXPECT_LT(job.seconds[0], 1.0) << "the rounds' verdict took that long";
}

// A transport error where the collectives agree: after the rounds' wait
// (kVerdictWait) the rank gets the transport's own error; no mismatch is reported.
TEST(CrossProcessThreads, ATransportErrorWithoutMismatchIsReportedAfterTheWait) {
  FailingJob job(2, [](int, HierarchicalCommunicator& comm, int) { AllReduceEight(comm); },
                 {2, -1});
  EXPECT_NE(job.outcomes[0].find("test transport error"), std::string::npos) << job.outcomes[0];
  const double wait_s = std::chrono::duration<double>(HierarchicalExchange::kVerdictWait).count();
  EXPECT_GE(job.seconds[0], wait_s);
  EXPECT_LT(job.seconds[0], wait_s + 5);
  EXPECT_EQ(job.failures[0], "");
  EXPECT_EQ(job.failures[1], "");
}

}  // namespace
}  // namespace tandem::dist::internal
