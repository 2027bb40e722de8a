// The flight recorder (spawn/comm/flight_recorder.h) on its own: states, the
// ring's wrap-around, a disabled ring, the divergence line; then as the
// in-process communicator fills it (driven by threads, no spawn), and
// Work::sequence() / Work::is_completed() of that communicator.
#include "spawn/comm/flight_recorder.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "spawn/comm/inprocess/inprocess_communicator.h"

namespace tandem::dist {
namespace {

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string Join(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  return text;
}

TEST(FlightRecorderTest, RecordsStatesInOrder) {
  FlightRecorder ring(8);
  ring.Entered(1, "all_reduce", nn::kFloat32, 256, 1000);
  ring.Entered(2, "barrier", std::nullopt, 0, 2000);
  ring.Entered(3, "broadcast", nn::kInt64, 3, 3000);
  ring.Completed(0, 2, 4000);  // completes #1 and #2
  ring.Failed(3, 5000);
  ring.Completed(2, 3, 6000);  // a failed one stays failed
  const std::vector<FlightRecord> records = ring.Snapshot();
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0].sequence, 1u);
  EXPECT_STREQ(records[0].op, "all_reduce");
  EXPECT_EQ(records[0].dtype, nn::kFloat32);
  EXPECT_EQ(records[0].numel, 256);
  EXPECT_EQ(records[0].state, CollectiveState::kCompleted);
  EXPECT_EQ(records[0].ended_ns, 4000);
  EXPECT_FALSE(records[1].dtype.has_value());
  EXPECT_EQ(records[1].state, CollectiveState::kCompleted);
  EXPECT_EQ(records[2].state, CollectiveState::kFailed);
  EXPECT_EQ(records[2].ended_ns, 5000);
  ring.set_kind("in-process");
  const std::string text = Join(ring.Dump("rank 0 (cpu)", 11000));
  EXPECT_TRUE(Contains(text, "flight recorder: rank 0 (cpu) [in-process]: 3 collectives entered, "
                             "the last 3 (oldest first):"))
      << text;
  EXPECT_TRUE(Contains(text, "flight recorder: rank 0 (cpu) #1 all_reduce float32[256] completed: "
                             "entered 0.000010 s ago, took 0.000003 s"))
      << text;
  EXPECT_TRUE(Contains(text, "flight recorder: rank 0 (cpu) #2 barrier completed")) << text;
  EXPECT_TRUE(Contains(text, "#3 broadcast int64[3] failed: entered 0.000008 s ago, ended after "
                             "0.000002 s"))
      << text;
}

TEST(FlightRecorderTest, KeepsTheLastEntriesWhenItWrapsAround) {
  FlightRecorder ring(4);
  for (uint64_t s = 1; s <= 10; ++s) ring.Entered(s, "all_reduce", nn::kFloat32, 4, 100 * s);
  ring.Completed(0, 9, 2000);
  EXPECT_EQ(ring.entered(), 10u);
  const std::vector<FlightRecord> records = ring.Snapshot();
  ASSERT_EQ(records.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(records[i].sequence, 7u + i);
  EXPECT_EQ(records[2].state, CollectiveState::kCompleted);
  EXPECT_EQ(records[3].state, CollectiveState::kEntered);
  const std::string text = Join(ring.Dump("rank 1 (cpu)", 3000));
  EXPECT_TRUE(Contains(text, "10 collectives entered, the last 4 (oldest first):")) << text;
  EXPECT_FALSE(Contains(text, "#6 ")) << text;
  EXPECT_TRUE(Contains(text, "#10 all_reduce float32[4] entered: entered 0.000002 s ago, "
                             "not completed"))
      << text;
}

TEST(FlightRecorderTest, ZeroEntriesRecordNothing) {
  FlightRecorder ring(0);
  EXPECT_FALSE(ring.enabled());
  ring.Entered(1, "all_reduce", nn::kFloat32, 4, 1);
  ring.Completed(0, 1, 3);
  ring.Failed(1, 4);
  EXPECT_TRUE(ring.Snapshot().empty());
  EXPECT_EQ(ring.entered(), 0u);
  const std::vector<std::string> lines = ring.Dump("rank 0 (cpu)", 5);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "flight recorder: rank 0 (cpu): disabled "
                      "(SpawnOptions::flight_recorder_entries = 0)");
}

std::vector<FlightRecord> Ops(const std::vector<const char*>& ops, int64_t numel = 8) {
  std::vector<FlightRecord> records;
  for (const char* op : ops) {
    records.push_back({.sequence = records.size() + 1, .op = op, .dtype = nn::kFloat32,
                       .numel = numel});
  }
  return records;
}

TEST(FlightRecorderTest, DivergenceNamesTheRankAheadAndTheOneBehind) {
  EXPECT_EQ(DescribeDivergence({{"rank 0 (cpu)", Ops({"all_reduce", "broadcast"})},
                                {"rank 1 (cpu)", Ops({"all_reduce_async", "broadcast"})}}),
            "");
  EXPECT_EQ(DescribeDivergence({{"rank 0 (cpu)", Ops({"all_reduce", "broadcast", "all_reduce"})},
                                {"rank 1 (cpu)", Ops({"all_reduce", "broadcast"})},
                                {"rank 2 (cpu)", Ops({"all_reduce", "broadcast"})}}),
            "flight recorder: the ranks first differ at #3: rank 0 (cpu) entered #3 all_reduce "
            "float32[8]; rank 1 (cpu), rank 2 (cpu) had entered only 2 collectives");
  EXPECT_EQ(DescribeDivergence({{"rank 0 (cpu)", Ops({"all_reduce", "broadcast"})},
                                {"rank 1 (cpu)", Ops({"all_reduce", "all_gather", "barrier"})}}),
            "flight recorder: the ranks first differ at #2: rank 0 (cpu) entered #2 broadcast "
            "float32[8], rank 1 (cpu) entered #2 all_gather float32[8]");
  EXPECT_EQ(DescribeDivergence({{"rank 0 (cpu)", Ops({"all_reduce"}, 8)},
                                {"rank 1 (cpu)", Ops({"all_reduce"}, 9)}}),
            "flight recorder: the ranks first differ at #1: rank 0 (cpu) entered #1 all_reduce "
            "float32[8], rank 1 (cpu) entered #1 all_reduce float32[9]");
}

// Runs body(comm) on `world` threads, one InProcessCommunicator each; returns them.
template <typename Body>
std::vector<std::unique_ptr<InProcessCommunicator>> RunRanks(int world, Body body) {
  auto group = std::make_shared<InProcessGroup>(world);
  std::vector<std::unique_ptr<InProcessCommunicator>> comms;
  for (int r = 0; r < world; ++r) {
    comms.push_back(std::make_unique<InProcessCommunicator>(r, nn::Device::CPU(), group));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { body(*comms[r]); });
  for (auto& t : threads) t.join();
  return comms;
}

TEST(FlightRecorderTest, InProcessCommunicatorRecordsEveryCollective) {
  auto comms = RunRanks(2, [](Communicator& comm) {
    nn::Tensor x = nn::ones({256});
    comm.all_reduce(x);
    nn::Tensor y = nn::ones({3}, {.dtype = nn::kInt64});
    comm.broadcast(y, 1);
    comm.barrier();
    nn::Tensor rows = nn::ones({4, 2});
    comm.reduce_scatter(rows);
    comm.all_gather(x);
  });
  for (const auto& comm : comms) {
    const std::vector<FlightRecord> records = comm->FlightRecords();
    ASSERT_EQ(records.size(), 5u);
    const char* ops[] = {"all_reduce", "broadcast", "barrier", "reduce_scatter", "all_gather"};
    const int64_t numels[] = {256, 3, 0, 8, 256};
    for (int i = 0; i < 5; ++i) {
      EXPECT_STREQ(records[i].op, ops[i]);
      EXPECT_EQ(records[i].numel, numels[i]) << ops[i];
      EXPECT_EQ(records[i].state, CollectiveState::kCompleted) << ops[i];
      EXPECT_GE(records[i].ended_ns, records[i].entered_ns) << ops[i];
    }
    EXPECT_FALSE(records[2].dtype.has_value());
    EXPECT_EQ(records[1].dtype, nn::kInt64);
    const std::string text = comm->DumpFlightRecorder();
    const std::string who = "flight recorder: rank " + std::to_string(comm->rank()) + " (cpu)";
    EXPECT_TRUE(Contains(text, who + ": 5 collectives entered")) << text;
    EXPECT_TRUE(Contains(text, who + " #1 all_reduce float32[256] completed: entered ")) << text;
    EXPECT_TRUE(Contains(text, who + " #3 barrier completed")) << text;
  }
}

TEST(FlightRecorderTest, ACollectiveThatThrowsIsRecordedAsFailed) {
  auto group = std::make_shared<InProcessGroup>(2);
  InProcessCommunicator comm(0, nn::Device::CPU(), group);
  group->Cancel("test: cancelled");
  nn::Tensor x = nn::ones({4});
  EXPECT_THROW(comm.all_reduce(x), CancelledError);
  EXPECT_THROW(comm.all_reduce_async(x), CancelledError);
  const std::vector<FlightRecord> records = comm.FlightRecords();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].state, CollectiveState::kFailed);
  EXPECT_EQ(records[1].state, CollectiveState::kFailed);
  EXPECT_STREQ(records[1].op, "all_reduce_async");
}

// In-process collectives run inside the call: the handle is complete at once and
// carries the collective's number.
TEST(FlightRecorderTest, InProcessWorkHasItsSequenceAndIsCompleted) {
  RunRanks(2, [](Communicator& comm) {
    nn::Tensor x = nn::ones({4});
    comm.barrier();
    std::shared_ptr<Work> first = comm.all_reduce_async(x);
    nn::Tensor rows = nn::ones({4});
    nn::Tensor out = nn::empty({2});
    std::shared_ptr<Work> second = comm.reduce_scatter_async(rows, out);
    EXPECT_EQ(first->sequence(), 2u);
    EXPECT_EQ(second->sequence(), 3u);
    EXPECT_EQ(comm.collectives_entered(), 3u);
    EXPECT_TRUE(first->is_completed());
    EXPECT_TRUE(second->is_completed());
    first->wait();
    second->wait();
    EXPECT_TRUE(first->is_completed());
  });
}

}  // namespace
}  // namespace tandem::dist
