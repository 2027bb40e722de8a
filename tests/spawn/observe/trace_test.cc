// dist::TraceRecorder on its own: the step window, the JSON of its events, the
// --trace_steps parser, spans from several threads (label tsan_ok), and
// WriteTrace through spawn (every rank's track, the file renamed into place).
#include "spawn/observe/trace.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "spawn/spawn.h"

namespace tandem::dist {
namespace {

using Clock = TraceRecorder::Clock;

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(TraceRecorder, RecordsOnlyInsideTheWindow) {
  TraceRecorder trace({.first_step = 3, .steps = 2});
  for (int64_t step = 0; step < 8; ++step) {
    trace.BeginStep(0, step);
    const auto now = Clock::now();
    trace.Span(0, absl::StrCat("step", step), now, now + std::chrono::microseconds(5));
  }
  const std::string json = trace.EventsJson(4);
  EXPECT_EQ(Count(json, "\"ph\": \"X\""), 2) << json;
  EXPECT_NE(json.find("\"name\": \"step3\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"name\": \"step4\""), std::string::npos) << json;
  EXPECT_EQ(json.find("step5"), std::string::npos) << json;
  EXPECT_EQ(Count(json, "\"pid\": 4"), 2) << json;
  EXPECT_NE(json.find("\"dur\": 5"), std::string::npos) << json;
}

TEST(TraceRecorder, EscapesNamesAndKeepsArgs) {
  TraceRecorder trace;
  trace.BeginStep(2, 0);
  const auto now = Clock::now();
  trace.Span(2, "a \"quoted\" \\ name\n", now, now, "\"bytes\": 42");
  const std::string json = trace.EventsJson(0);
  EXPECT_NE(json.find(R"("name": "a \"quoted\" \\ name\u000a")"), std::string::npos) << json;
  EXPECT_NE(json.find("\"args\": {\"bytes\": 42}"), std::string::npos) << json;
  EXPECT_NE(json.find("\"tid\": 2"), std::string::npos) << json;
}

TEST(TraceRecorder, ParsesTheWindowFlag) {
  TraceRecorder::Window w;
  ASSERT_TRUE(ParseTraceWindow("10:5", &w).ok());
  EXPECT_EQ(w.first_step, 10);
  EXPECT_EQ(w.steps, 5);
  ASSERT_TRUE(ParseTraceWindow("7:", &w).ok());
  EXPECT_EQ(w.first_step, 7);
  EXPECT_EQ(w.steps, INT64_MAX);
  for (const char* bad : {"", "5", "a:b", "-1:3", "3:0", "3:x"}) {
    const absl::Status s = ParseTraceWindow(bad, &w);
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.message().find(absl::StrCat("\"", bad, "\"")), std::string::npos) << s;
  }
}

TEST(TraceRecorder, SpansFromSeveralThreadsWhileAnotherReads) {
  TraceRecorder trace;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 4; ++rank) {
    threads.emplace_back([&, rank] {
      for (int64_t step = 0; step < 200; ++step) {
        trace.BeginStep(rank, step);
        const auto now = Clock::now();
        trace.Span(rank, "work", now, now);
      }
    });
  }
  std::thread reader([&] {
    for (int i = 0; i < 20; ++i) (void)trace.EventsJson(0);
  });
  for (std::thread& t : threads) t.join();
  reader.join();
  EXPECT_EQ(Count(trace.EventsJson(0), "\"name\": \"work\""), 800);
}

// ResolveDeviceSpans takes the rank's spans out under its mutex, waits for them
// without it, and appends their events under it again: threads recording into
// the same rank meanwhile lose nothing (label tsan_ok). On CPU ranks there are
// no device spans, so no device wait is exercised here (that part needs CUDA).
TEST(TraceRecorder, SpansOfARankWhileItsDeviceSpansAreResolved) {
  TraceRecorder trace;
  trace.BeginStep(0, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 300; ++i) {
        const auto now = Clock::now();
        trace.Span(0, "work", now, now);
      }
    });
  }
  std::thread resolver([&] {
    for (int i = 0; i < 50; ++i) trace.ResolveDeviceSpans(0);
  });
  for (std::thread& t : threads) t.join();
  resolver.join();
  trace.ResolveDeviceSpans(0);
  EXPECT_EQ(Count(trace.EventsJson(0), "\"name\": \"work\""), 900);
}

TEST(TraceRecorder, WriteTraceNamesEveryRankTrackAndWritesOnce) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            absl::StrCat("tandem_trace_test_", ::getpid(), ".json"))
                               .string();
  TraceRecorder trace;
  std::ostringstream log;
  const absl::Status s = spawn(
      [&](Context& ctx) -> absl::Status {
        ctx.set_trace(&trace);
        trace.BeginStep(ctx.rank(), 0);
        { TraceSpan span(ctx, "forward"); }
        return WriteTrace(ctx, trace, path);
      },
      3, "cpu", {.console = &log});
  ASSERT_TRUE(s.ok()) << s << log.str();
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  EXPECT_EQ(json.rfind("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [", 0), 0u) << json;
  EXPECT_EQ(Count(json, "\"name\": \"forward\""), 3) << json;
  EXPECT_EQ(Count(json, "\"name\": \"thread_name\""), 3) << json;
  EXPECT_EQ(Count(json, "\"name\": \"process_name\""), 1) << json;
  for (int r = 0; r < 3; ++r) EXPECT_NE(json.find(absl::StrCat("rank ", r, " (cpu)")), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace tandem::dist
