#include "spawn/logger.h"

#include <fstream>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace tandem::dist {
namespace {

TEST(FormatTest, FormatsWithFmtSpecs) {
  EXPECT_EQ(Format("step:{} loss:{}", 3, 0.5), "step:3 loss:0.5");
  EXPECT_EQ(Format("{} on {}", std::string("rank"), nn::Device::CUDA(2)), "rank on cuda:2");
  EXPECT_EQ(Format("{}{}", "a", std::string_view("b")), "ab");
  EXPECT_EQ(Format("{}{}", absl::string_view("c"), absl::InvalidArgumentError("x")),
            "cINVALID_ARGUMENT: x");
  EXPECT_EQ(Format("flag {}", true), "flag true");
  EXPECT_EQ(Format("loss {:.6f}", 2.770581234), "loss 2.770581");
  EXPECT_EQ(Format("[{:>6}] [{:<4}] [{:04d}] [{:x}]", "ab", 7, 42, 255),
            "[    ab] [7   ] [0042] [ff]");
  EXPECT_EQ(Format("{1} before {0}", "a", "b"), "b before a");
  EXPECT_EQ(Format("[{:>6}]", nn::Device::CPU()), "[   cpu]");
  EXPECT_EQ(Format("no holes"), "no holes");
}

TEST(FormatTest, BadRuntimeFormatThrowsFromFormat) {
  const std::string bad = "loss {:.q}";
  EXPECT_THROW(Format(fmt::runtime(bad), 1.0), fmt::format_error);
  EXPECT_THROW(Format(fmt::runtime("{} {}"), 1), fmt::format_error);  // too few arguments
}

// A format fmt rejects at run time is reported, on one line, instead of thrown
// into the training code.
TEST(LoggerTest, BadRuntimeFormatBecomesAnErrorLine) {
  std::ostringstream console;
  auto logger = Logger::Create(1, {.console = &console});
  ASSERT_TRUE(logger.ok()) << logger.status();
  const RankLogger log = (*logger)->ForRank(0, nn::Device::CPU());
  const std::string bad = "loss {:.q}\n";
  EXPECT_NO_THROW(log.Info(fmt::runtime(bad), 2.5));
  log.Info(fmt::runtime(std::string("ok {:.2f}")), 2.5);
  const std::vector<std::string> lines = absl::StrSplit(console.str(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << console.str();
  EXPECT_NE(lines[0].find("] ERROR: bad log format \"loss {:.q}\\n\": "), std::string::npos)
      << lines[0];
  EXPECT_TRUE(absl::EndsWith(lines[1], "] ok 2.50")) << lines[1];
}

// 4 threads write long lines at once; each console line must be one whole line
// of one writer, with the prefix, and every line must arrive.
TEST(LoggerTest, LinesNeverInterleave) {
  std::ostringstream console;
  auto logger = Logger::Create(4, {.console = &console, .all_ranks_to_console = true});
  ASSERT_TRUE(logger.ok()) << logger.status();
  constexpr int kLines = 300;
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      RankLogger log = (*logger)->ForRank(r, nn::Device::CPU());
      const std::string payload(200, static_cast<char>('a' + r));
      for (int i = 0; i < kLines; ++i) log.Info("line {} {} end", i, payload);
    });
  }
  for (auto& t : threads) t.join();
  const std::regex line_re(
      R"(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} rank ([0-3]) cpu\] line (\d+) ([a-d]+) end)");
  std::vector<int> next(4, 0);
  int count = 0;
  for (absl::string_view line : absl::StrSplit(console.str(), '\n', absl::SkipEmpty())) {
    std::cmatch m;
    ASSERT_TRUE(std::regex_match(line.begin(), line.end(), m, line_re)) << "torn line: " << line;
    const int rank = std::stoi(m[1].str());
    EXPECT_EQ(m[3].str(), std::string(200, static_cast<char>('a' + rank)));
    EXPECT_EQ(std::stoi(m[2].str()), next[rank]++);  // in order per rank
    ++count;
  }
  EXPECT_EQ(count, 4 * kLines);
}

TEST(LoggerTest, RankZeroToConsoleAndEveryRankToItsFile) {
  const std::string dir = ::testing::TempDir() + "/tandem_logger_test";
  std::ostringstream console;
  {
    auto logger = Logger::Create(2, {.console = &console, .log_dir = dir});
    ASSERT_TRUE(logger.ok()) << logger.status();
    (*logger)->Write(LogLevel::kInfo, -1, nn::Device(), "environment");
    (*logger)->ForRank(0, nn::Device::CPU()).Info("from {}", 0);
    (*logger)->ForRank(1, nn::Device::CPU()).Warning("from {}", 1);
  }
  EXPECT_NE(console.str().find("spawn] environment"), std::string::npos);
  EXPECT_NE(console.str().find("rank 0 cpu] from 0"), std::string::npos);
  EXPECT_EQ(console.str().find("from 1"), std::string::npos) << console.str();
  auto read = [&](int r) {
    std::ifstream in(dir + "/workerlog." + std::to_string(r));
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  EXPECT_NE(read(0).find("from 0"), std::string::npos);
  EXPECT_EQ(read(0).find("from 1"), std::string::npos);
  EXPECT_NE(read(1).find("rank 1 cpu] WARNING: from 1"), std::string::npos) << read(1);
  EXPECT_NE(read(1).find("environment"), std::string::npos);
}

TEST(LoggerTest, UnwritableLogDirIsAnError) {
  auto logger = Logger::Create(1, {.log_dir = "/proc/no/such/dir"});
  ASSERT_FALSE(logger.ok());
  EXPECT_NE(logger.status().message().find("/proc/no/such/dir"), absl::string_view::npos);
}

}  // namespace
}  // namespace tandem::dist
