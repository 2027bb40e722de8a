// dist::SummaryWriter: CRC32C against its published check value, one event's
// bytes against a hand-assembled encoding, and whole files decoded by an
// independent reader (tests/spawn/observe/read_tfevents.py: protobuf's Python runtime
// and a bit-by-bit CRC32C of its own), including files written by several
// threads at once.
#include "spawn/observe/summary_writer.h"

#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

// Debian's Python (python3-protobuf is a Debian package), else the one on PATH.
std::string Python() {
  return std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
}

// The reader's output lines and exit status.
struct Decoded {
  int status = 0;
  std::vector<std::string> lines;
};
Decoded Decode(const std::string& path) {
  const std::string command = absl::StrCat(Python(), " ", TANDEM_SOURCE_DIR,
                                           "/tests/spawn/observe/read_tfevents.py '", path, "' 2>&1");
  Decoded d;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return {-1, {}};
  std::string out;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
  d.status = ::pclose(pipe);
  d.lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
  return d;
}

bool ReaderAvailable() {
  return std::system((Python() + " -c 'import google.protobuf' >/dev/null 2>&1").c_str()) == 0;
}

TEST(Crc32c, MatchesThePublishedCheckValue) {
  EXPECT_EQ(internal::Crc32c("123456789"), 0xE3069283u);  // RFC 3720's CRC32C check value
  EXPECT_EQ(internal::Crc32c(""), 0u);
}

TEST(SummaryWriter, ScalarEventBytesAreTheProtobufEncoding) {
  // Event{wall_time: 0.5, step: 300, summary{value{tag: "a", simple_value: 1.0}}}
  const std::string expected = std::string("\x09\x00\x00\x00\x00\x00\x00\xe0\x3f", 9) +  // 1: double
                               std::string("\x10\xac\x02", 3) +                         // 2: varint 300
                               // 5: Summary (10 bytes){1: Value (8 bytes){1: "a", 2: float 1}}
                               std::string("\x2a\x0a\x0a\x08\x0a\x01" "a" "\x15\x00\x00\x80\x3f", 12);
  EXPECT_EQ(internal::ScalarEvent("a", 1.0f, 300, 0.5), expected);
}

TEST(SummaryWriter, FileDecodesWithAnIndependentReader) {
  if (!ReaderAvailable()) GTEST_SKIP() << "python3 with google.protobuf (python3-protobuf) missing";
  const std::string dir = testing::MakeTempDir("tandem_tb_one");
  std::string path;
  {
    absl::StatusOr<std::unique_ptr<SummaryWriter>> tb = SummaryWriter::Open(dir + "/sub", "rank0");
    ASSERT_TRUE(tb.ok()) << tb.status();
    path = (*tb)->path();
    EXPECT_NE(path.find("/sub/events.out.tfevents."), std::string::npos) << path;
    for (int step = 0; step < 100; ++step) {
      (*tb)->AddScalar("train/loss", 2.5 / (step + 1), step, 1000.0 + step);
      (*tb)->AddScalar("train/lr", 1e-3, step, 1000.0 + step);
    }
    (*tb)->AddScalar("negative/step", -7.25, -3, 5.0);
    (*tb)->AddSessionStart(42, 6.0);
    ASSERT_TRUE((*tb)->Close().ok());
  }
  Decoded d = Decode(path);
  ASSERT_EQ(d.status, 0) << absl::StrJoin(d.lines, "\n");
  ASSERT_EQ(d.lines.size(), 1u + 200u + 1u + 1u) << absl::StrJoin(d.lines, "\n");
  EXPECT_EQ(d.lines.back(), "session_log 42 status 1");
  d.lines.pop_back();
  EXPECT_EQ(d.lines[0].rfind("version ", 0), 0u) << d.lines[0];
  EXPECT_NE(d.lines[0].find("brain.Event:2"), std::string::npos);
  EXPECT_EQ(d.lines[1], "scalar 0 train/loss 2.5 1000.000");
  EXPECT_EQ(d.lines[2], "scalar 0 train/lr 0.0010000000474974513 1000.000");  // float32
  EXPECT_EQ(d.lines[199], "scalar 99 train/loss 0.02500000037252903 1099.000");
  EXPECT_EQ(d.lines.back(), "scalar -3 negative/step -7.25 5.000");
}

TEST(SummaryWriter, DamagedFileIsCaughtByTheReader) {
  if (!ReaderAvailable()) GTEST_SKIP() << "python3 with google.protobuf (python3-protobuf) missing";
  const std::string dir = testing::MakeTempDir("tandem_tb_bad");
  std::string path;
  {
    auto tb = SummaryWriter::Open(dir);
    ASSERT_TRUE(tb.ok()) << tb.status();
    path = (*tb)->path();
    (*tb)->AddScalar("x", 1, 1);
  }
  // Flip one byte of the last record's data: its CRC no longer matches.
  std::FILE* f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, -6, SEEK_END);
  const int c = std::fgetc(f);
  std::fseek(f, -6, SEEK_END);
  std::fputc(c ^ 0x40, f);
  std::fclose(f);
  const Decoded d = Decode(path);
  EXPECT_NE(d.status, 0);
  EXPECT_NE(absl::StrJoin(d.lines, "\n").find("data CRC"), std::string::npos)
      << absl::StrJoin(d.lines, "\n");
}

TEST(SummaryWriter, ConcurrentWritersProduceWholeRecords) {
  if (!ReaderAvailable()) GTEST_SKIP() << "python3 with google.protobuf (python3-protobuf) missing";
  const std::string dir = testing::MakeTempDir("tandem_tb_threads");
  std::string path;
  {
    auto tb = SummaryWriter::Open(dir);
    ASSERT_TRUE(tb.ok()) << tb.status();
    path = (*tb)->path();
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int step = 0; step < 250; ++step) {
          (*tb)->AddScalar(absl::StrCat("rank_", t), t + step, step);
        }
      });
    }
    for (std::thread& th : threads) th.join();
  }
  const Decoded d = Decode(path);
  ASSERT_EQ(d.status, 0) << absl::StrJoin(d.lines, "\n");
  EXPECT_EQ(d.lines.size(), 1u + 1000u);
}

TEST(SummaryWriter, UnwritableDirectoryIsAnErrorNamingIt) {
  auto tb = SummaryWriter::Open("/proc/tandem_no_such_dir/tb");
  ASSERT_FALSE(tb.ok());
  EXPECT_NE(tb.status().message().find("/proc/tandem_no_such_dir/tb"), std::string::npos)
      << tb.status();
}

}  // namespace
}  // namespace tandem::dist
