// internal::WriteFileAtomically, the writer behind checkpoints and safetensors
// files: a new file or a replaced one holds exactly the written bytes; a writer
// that fails or throws leaves the old file and no temporary file behind; a
// temporary name in use is passed over, not shared; errors name the kind of
// file, the path and the step that failed.
#include "nn/internal/atomic_file.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace tandem::nn::internal {
namespace {

namespace fs = std::filesystem;

std::string TempDir() { return testing::MakeTempDir("tandem_atomic"); }

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

int FilesIn(const std::string& dir) {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir)) ++n;
  return n;
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  return WriteFileAtomically(path, "test file", [&text](AtomicFileSink& sink) {
    return sink.Write(text.data(), text.size());
  });
}

TEST(AtomicFileTest, CreatesAndReplacesWithExactlyTheWrittenBytes) {
  const std::string dir = TempDir(), path = dir + "/f.bin";
  ASSERT_TRUE(WriteText(path, "first").ok());
  EXPECT_EQ(Read(path), "first");
  const std::string big(3 << 20, 'x');
  ASSERT_TRUE(WriteText(path, big).ok());
  EXPECT_EQ(Read(path), big);
  EXPECT_EQ(FilesIn(dir), 1);  // no temporary file left
  fs::remove_all(dir);
}

TEST(AtomicFileTest, AFailingOrThrowingWriterLeavesTheOldFileAndNoTemporary) {
  const std::string dir = TempDir(), path = dir + "/f.bin";
  ASSERT_TRUE(WriteText(path, "old").ok());
  const absl::Status failed = WriteFileAtomically(path, "test file", [](AtomicFileSink& sink) {
    EXPECT_TRUE(sink.Write("partial", 7).ok());
    return absl::DataLossError("the writer gave up");
  });
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_EQ(Read(path), "old");
  EXPECT_EQ(FilesIn(dir), 1);
  EXPECT_THROW(WriteFileAtomically(path, "test file",
                                   [](AtomicFileSink& sink) -> absl::Status {
                                     EXPECT_TRUE(sink.Write("partial", 7).ok());
                                     throw std::runtime_error("device copy failed");
                                   }),
               std::runtime_error);
  EXPECT_EQ(Read(path), "old");
  EXPECT_EQ(FilesIn(dir), 1);
  fs::remove_all(dir);
}

// The temporary files beside `path` while a write of `text` to it runs.
std::vector<std::string> TemporariesWhileWriting(const std::string& dir, const std::string& path,
                                                 const std::string& text) {
  std::vector<std::string> temps;
  const absl::Status st = WriteFileAtomically(path, "test file", [&](AtomicFileSink& sink) {
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.path().string().rfind(path + ".tmp.", 0) == 0) temps.push_back(entry.path());
    }
    return sink.Write(text.data(), text.size());
  });
  EXPECT_TRUE(st.ok()) << st;
  std::sort(temps.begin(), temps.end());
  return temps;
}

// A temporary name that exists already (another host's writer with this
// pid on a shared filesystem) is passed over: that file is neither truncated
// nor renamed over the target, and the write goes to a name of its own.
TEST(AtomicFileTest, ATemporaryNameInUseIsPassedOverNotShared) {
  const std::string dir = TempDir(), path = dir + "/f.bin";
  const std::vector<std::string> first = TemporariesWhileWriting(dir, path, "first");
  ASSERT_EQ(first.size(), 1u);
  // <path>.tmp.<pid>.<n>: the next write of this process (one thread) tries n + 1.
  const size_t dot = first[0].rfind('.');
  const std::string next =
      first[0].substr(0, dot + 1) + std::to_string(std::stoull(first[0].substr(dot + 1)) + 1);
  std::ofstream(next) << "another writer's bytes";
  const std::vector<std::string> second = TemporariesWhileWriting(dir, path, "second");
  EXPECT_EQ(second.size(), 2u);  // the other writer's and this write's own
  EXPECT_EQ(Read(path), "second");
  EXPECT_EQ(Read(next), "another writer's bytes");
  EXPECT_EQ(FilesIn(dir), 2);  // the target and the other writer's file
  fs::remove_all(dir);
}

TEST(AtomicFileTest, AMissingDirectoryIsAnErrorNamingTheFileAndTheStep) {
  const std::string path = "/nonexistent_tandem_dir/f.bin";
  const absl::Status status = WriteText(path, "x");
  ASSERT_FALSE(status.ok());
  const std::string message(status.message());
  EXPECT_NE(message.find("test file " + path + ": creating " + path + ".tmp."), std::string::npos)
      << message;
  EXPECT_NE(message.find("No such file or directory"), std::string::npos) << message;
}

}  // namespace
}  // namespace tandem::nn::internal
