// How an asynchronous NCCL collective's handle waits (spawn/comm/nccl/internal/work_wait.h),
// every case of the table and the host wait's loop, on the CPU: the NCCL code
// that follows them cannot run without a GPU (its GPU tests:
// tests/spawn/gpu_test.cc, GpuSpawnTest.NcclWork*).
#include "spawn/comm/nccl/internal/work_wait.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace tandem::dist::internal {
namespace {

std::string Plan(WorkWaitSite site, bool destructor) {
  return WorkWaitPathName(PlanWorkWait(site, destructor));
}

// Made and waited for outside any capture: the compute stream waits, no host wait.
TEST(NcclWorkWaitTest, EagerHandleOutsideACaptureWaitsOnTheStream) {
  EXPECT_EQ(Plan({}, false), "stream");
  EXPECT_EQ(Plan({}, true), "stream");
}

// Made outside any capture, waited for or dropped inside one on the thread's
// stream (a warm-up step's handle dropped by the captured step): a wait of the
// capturing stream on an event recorded outside the capture would invalidate
// it. The host waits instead, in wait() and in the destructor.
TEST(NcclWorkWaitTest, EagerHandleInsideACaptureOfItsStreamWaitsOnTheHost) {
  const WorkWaitSite site{.made_in = 0, .capture_now = 3, .stream_captures = true};
  EXPECT_EQ(Plan(site, false), "host");
  EXPECT_EQ(Plan(site, true), "host");
}

// The thread captures on another GPU: this device's stream is eager.
TEST(NcclWorkWaitTest, EagerHandleWhileTheThreadCapturesAnotherDeviceWaitsOnTheStream) {
  const WorkWaitSite site{.made_in = 0, .capture_now = 3, .stream_captures = false};
  EXPECT_EQ(Plan(site, false), "stream");
  EXPECT_EQ(Plan(site, true), "stream");
}

// Destroyed by a thread_local after the thread's streams were given back (one
// made before the thread's first stream): ThreadStream cannot be had, and the
// wait used to be skipped. The host waits.
TEST(NcclWorkWaitTest, EagerHandleAfterTheThreadsStreamsWentWaitsOnTheHost) {
  const WorkWaitSite site{.made_in = 0, .capture_now = 0, .streams_gone = true};
  EXPECT_EQ(Plan(site, true), "host");
  EXPECT_EQ(Plan(site, false), "host");
}

// Made inside a capture: waited for on the stream inside that capture only.
TEST(NcclWorkWaitTest, CapturedHandleWaitsOnTheStreamInsideItsOwnCaptureOnly) {
  const WorkWaitSite inside{.made_in = 5, .capture_now = 5, .stream_captures = true};
  EXPECT_EQ(Plan(inside, false), "stream");
  EXPECT_EQ(Plan(inside, true), "stream");
  const WorkWaitSite after{.made_in = 5, .capture_now = 0};
  EXPECT_EQ(Plan(after, false), "refused");
  EXPECT_EQ(Plan(after, true), "none");
  const WorkWaitSite later{.made_in = 5, .capture_now = 6, .stream_captures = true};
  EXPECT_EQ(Plan(later, false), "refused");
  EXPECT_EQ(Plan(later, true), "none");
  const WorkWaitSite exiting{.made_in = 5, .capture_now = 0, .streams_gone = true};
  EXPECT_EQ(Plan(exiting, true), "none");
}

// The host wait's loop (WaitForEventOnHost) with a scripted event: the codes
// stand for cudaSuccess, cudaErrorNotReady and a failure. Returns the wait's
// result and how many queries it made.
constexpr int kDone = 0, kNotReady = 600, kFault = 700;
std::pair<int, size_t> WaitFor(const std::vector<int>& answers) {
  size_t queries = 0;
  const int result = WaitForEventOnHost(
      [&] { return answers.at(queries++); },
      [](const auto& ready) {
        while (!ready()) {
        }
      },
      kDone, kNotReady);
  return {result, queries};
}

// A collective still running at the first queries (an eager handle waited for
// inside a capture right after it was queued): the wait ends when the event
// completes, and succeeds. It used to return the earlier "not ready", which
// wait() raised as a CUDA error.
TEST(NcclWorkWaitTest, HostWaitForACollectiveStillRunningSucceedsOnceItEnds) {
  EXPECT_EQ(WaitFor({kNotReady, kNotReady, kDone}), std::make_pair(kDone, size_t{3}));
  EXPECT_EQ(WaitFor({kDone}), std::make_pair(kDone, size_t{1}));
}

// A failing query (a broken context) ends the wait with its error.
TEST(NcclWorkWaitTest, HostWaitEndsWithTheFailureOfAQuery) {
  EXPECT_EQ(WaitFor({kNotReady, kFault}), std::make_pair(kFault, size_t{2}));
  EXPECT_EQ(WaitFor({kFault}), std::make_pair(kFault, size_t{1}));
}

}  // namespace
}  // namespace tandem::dist::internal
