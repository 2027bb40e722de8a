// How an asynchronous NCCL collective's handle waits (spawn/comm/nccl/internal/work_wait.h),
// every case of the table, on the CPU: the NCCL code that follows it cannot run
// without a GPU (its GPU tests: tests/spawn/gpu_test.cc, GpuSpawnTest.NcclWork*).
#include "spawn/comm/nccl/internal/work_wait.h"

#include <gtest/gtest.h>

#include <string>

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

}  // namespace
}  // namespace tandem::dist::internal
