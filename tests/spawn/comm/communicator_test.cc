// The in-process communicator against closed forms, for 1..4 CPU ranks, driven
// directly by threads (no spawn), plus the cancellable barrier.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "spawn/comm/inprocess/inprocess_communicator.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

// Runs body(comm) on `world` threads, one InProcessCommunicator each.
template <typename Body>
void RunRanks(int world, Body body) {
  auto group = std::make_shared<InProcessGroup>(world);
  std::vector<std::unique_ptr<InProcessCommunicator>> comms;
  for (int r = 0; r < world; ++r) {
    comms.push_back(std::make_unique<InProcessCommunicator>(r, nn::Device::CPU(), group));
  }
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(*comms[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        group->Cancel(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Rank r's value at element i: distinct per rank and element, exact in float.
double Value(int rank, int64_t i) { return (rank + 1) * 0.5 + i * 0.25 - (i % 3) * rank; }

class CommunicatorTest : public ::testing::TestWithParam<int> {};

TEST_P(CommunicatorTest, AllReduceSumAvgMax) {
  const int world = GetParam();
  const int64_t n = 37;  // not divisible by the world size: uneven slices
  RunRanks(world, [&](Communicator& comm) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (nn::DType dtype : {nn::kFloat32, nn::kFloat64}) {
        std::vector<double> mine(n);
        for (int64_t i = 0; i < n; ++i) mine[i] = Value(comm.rank(), i);
        Tensor x = nn::from_vector(mine, {n}, {.dtype = dtype});
        comm.all_reduce(x, op);
        std::vector<double> got = x.to_vector<double>();
        for (int64_t i = 0; i < n; ++i) {
          double sum = 0, max = Value(0, i);
          for (int k = 0; k < world; ++k) {
            sum += Value(k, i);
            max = std::max(max, Value(k, i));
          }
          const double expected =
              op == ReduceOp::kSum ? sum : op == ReduceOp::kAvg ? sum / world : max;
          ASSERT_NEAR(got[i], expected, 1e-6) << ReduceOpName(op) << " element " << i;
        }
      }
    }
  });
}

TEST_P(CommunicatorTest, AllReduceInt64AndAsync) {
  const int world = GetParam();
  RunRanks(world, [&](Communicator& comm) {
    Tensor x = nn::from_vector(std::vector<int64_t>{comm.rank(), 10}, {2}, {.dtype = nn::kInt64});
    comm.all_reduce_async(x, ReduceOp::kSum)->wait();
    std::vector<int64_t> got = x.to_vector<int64_t>();
    EXPECT_EQ(got[0], int64_t{world} * (world - 1) / 2);
    EXPECT_EQ(got[1], 10 * world);
  });
}

TEST_P(CommunicatorTest, BroadcastFromEveryRoot) {
  const int world = GetParam();
  RunRanks(world, [&](Communicator& comm) {
    for (int root = 0; root < world; ++root) {
      Tensor x = nn::full({2, 3}, comm.rank() * 10.0 + 1);
      comm.broadcast(x, root);
      for (double v : x.to_vector<double>()) ASSERT_EQ(v, root * 10.0 + 1);
    }
  });
}

TEST_P(CommunicatorTest, AllGather) {
  const int world = GetParam();
  RunRanks(world, [&](Communicator& comm) {
    Tensor x = nn::from_vector(std::vector<float>{1.0f * comm.rank(), 100.0f + comm.rank()}, {2});
    Tensor all = comm.all_gather(x);
    ASSERT_EQ(all.shape(), (nn::Shape{world, 2}));
    std::vector<float> got = all.to_vector<float>();
    for (int k = 0; k < world; ++k) {
      EXPECT_EQ(got[2 * k], k);
      EXPECT_EQ(got[2 * k + 1], 100.0f + k);
    }
  });
}

TEST_P(CommunicatorTest, ReduceScatter) {
  const int world = GetParam();
  const int64_t k = 3;
  RunRanks(world, [&](Communicator& comm) {
    std::vector<double> mine(world * k);
    for (int64_t i = 0; i < world * k; ++i) mine[i] = Value(comm.rank(), i);
    Tensor x = nn::from_vector(mine, {world * k}, {.dtype = nn::kFloat64});
    Tensor part = comm.reduce_scatter(x, ReduceOp::kSum);
    ASSERT_EQ(part.shape(), (nn::Shape{k}));
    std::vector<double> got = part.to_vector<double>();
    for (int64_t i = 0; i < k; ++i) {
      double sum = 0;
      for (int r = 0; r < world; ++r) sum += Value(r, comm.rank() * k + i);
      EXPECT_DOUBLE_EQ(got[i], sum);
    }
  });
}

TEST_P(CommunicatorTest, BarrierOrdersWrites) {
  const int world = GetParam();
  std::vector<int> marks(world, 0);
  RunRanks(world, [&](Communicator& comm) {
    for (int round = 1; round <= 20; ++round) {
      marks[comm.rank()] = round;
      comm.barrier();
      for (int k = 0; k < world; ++k) ASSERT_EQ(marks[k], round);
      comm.barrier();
    }
  });
}

TEST_P(CommunicatorTest, SameBitsEveryRun) {
  const int world = GetParam();
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    std::vector<float> result;
    std::mutex mutex;
    RunRanks(world, [&](Communicator& comm) {
      std::vector<float> mine(1000);
      for (int i = 0; i < 1000; ++i) mine[i] = 1.0f / (1 + i + 7 * comm.rank()) + 1e7f * (i % 2);
      Tensor x = nn::from_vector(mine, {1000});
      comm.all_reduce(x);
      if (comm.rank() == world - 1) {
        std::lock_guard<std::mutex> lock(mutex);
        result = x.to_vector<float>();
      }
    });
    if (run == 0) {
      first = result;
    } else {
      ASSERT_EQ(std::memcmp(first.data(), result.data(), first.size() * sizeof(float)), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommunicatorTest, ::testing::Values(1, 2, 3, 4));

TEST(CommunicatorMismatchTest, DifferentSizesThrowOnEveryRank) {
  auto group = std::make_shared<InProcessGroup>(2);
  std::atomic<int> throws{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      InProcessCommunicator comm(r, nn::Device::CPU(), group);
      Tensor x = nn::zeros({r == 0 ? 4 : 5});
      try {
        comm.all_reduce(x);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("collective mismatch"), std::string::npos)
            << e.what();
        ++throws;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(throws.load(), 2);
}

// A collective made under Communicator::Label names its caller in the
// mismatch every rank throws; the label ends with its scope (an outer one
// comes back), and a rank that made no labelled call adds nothing.
TEST(CommunicatorMismatchTest, ALabelledCollectiveNamesItsCaller) {
  auto group = std::make_shared<InProcessGroup>(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      InProcessCommunicator comm(r, nn::Device::CPU(), group);
      Tensor x = nn::zeros({4});
      try {
        if (r == 0) {
          Communicator::Label outer(comm, "an outer call");
          {
            Communicator::Label inner(comm, "an inner call");
            EXPECT_STREQ(comm.label(), "an inner call");
          }
          EXPECT_STREQ(comm.label(), "an outer call");
          comm.all_reduce(x);
        } else {
          comm.barrier();
        }
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
      if (r == 0) EXPECT_EQ(comm.label(), nullptr);
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("rank 0 called all_reduce #1 (4 float32, arg 0) from an outer call while "
                     "rank 1 called barrier #1 (0 float32, arg 0)"),
              std::string::npos)
        << e;
  }
}

TEST(InProcessGroupTest, CancelWakesWaitersAndLaterCalls) {
  InProcessGroup group(3);
  std::atomic<int> cancelled{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 2; ++i) {
    waiters.emplace_back([&] {
      try {
        group.ArriveAndWait();
      } catch (const CancelledError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 2 failed"), std::string::npos);
        ++cancelled;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  group.Cancel("rank 2 failed");
  group.Cancel("a later reason is ignored");
  for (auto& t : waiters) t.join();
  EXPECT_EQ(cancelled.load(), 2);
  EXPECT_THROW(group.ArriveAndWait(), CancelledError);
}

TEST(CommunicatorTraceTest, StopTokenCancelsBeforeEntering) {
  auto group = std::make_shared<InProcessGroup>(1);
  InProcessCommunicator comm(0, nn::Device::CPU(), group);
  std::stop_source stop;
  internal::CollectiveTrace trace;
  comm.Attach(stop.get_token(), &trace);
  comm.barrier();
  Tensor x = nn::ones({3});
  comm.all_reduce(x);
  EXPECT_EQ(trace.entered.load(), 2u);
  EXPECT_EQ(trace.completed.load(), 2u);
  EXPECT_STREQ(trace.op.load(), "all_reduce");
  stop.request_stop();
  EXPECT_THROW(comm.barrier(), CancelledError);
  EXPECT_EQ(trace.entered.load(), 2u);
}

// A tensor on another device than the rank's is refused before the collective
// is entered: a caller that catches the error leaves no collective in flight
// for the watchdog to time out. Before, the trace showed each of them entered
// and never completed. The rank "is" on cuda:0 here; the check runs before
// any device work, so no GPU is needed.
TEST(CommunicatorTraceTest, TensorOnAnotherDeviceIsRefusedBeforeEntering) {
  auto group = std::make_shared<InProcessGroup>(1);
  InProcessCommunicator comm(0, nn::Device::CUDA(0), group);
  std::stop_source stop;
  internal::CollectiveTrace trace;
  comm.Attach(stop.get_token(), &trace);
  Tensor x = nn::ones({4});  // on the host
  Tensor out = nn::empty({4});
  auto expect_refused = [&](auto collective, const char* op) {
    try {
      collective();
      ADD_FAILURE() << op << " did not throw";
    } catch (const CancelledError& e) {
      ADD_FAILURE() << op << ": " << e.what();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not on rank 0's device cuda:0"), std::string::npos)
          << e.what();
      EXPECT_EQ(std::string(e.what()).rfind(op, 0), 0u) << e.what();
    }
    EXPECT_EQ(comm.collectives_entered(), 0u) << op;
    EXPECT_EQ(trace.entered.load(), 0u) << op;
  };
  expect_refused([&] { comm.all_reduce(x); }, "all_reduce");
  expect_refused([&] { comm.all_reduce_async(x); }, "all_reduce_async");
  expect_refused([&] { comm.broadcast(x); }, "broadcast");
  expect_refused([&] { comm.all_gather(x); }, "all_gather");
  expect_refused([&] { comm.all_gather_into(x, out); }, "all_gather_into");
  expect_refused([&] { comm.reduce_scatter(x); }, "reduce_scatter");
  expect_refused([&] { comm.reduce_scatter_async(x, out); }, "reduce_scatter_async");
  EXPECT_EQ(trace.completed.load(), 0u);
}

}  // namespace
}  // namespace tandem::dist
