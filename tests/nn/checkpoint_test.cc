#include "nn/checkpoint.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

#include "tests/test_util.h"

namespace tandem::nn {
namespace {

namespace fs = std::filesystem;

std::string TempDir() { return testing::MakeTempDir("tandem_ckpt"); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

Checkpoint Sample() {
  Checkpoint c;
  c.tensors["w"] = from_vector(std::vector<float>{1.5f, -2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  c.tensors["b"] = from_vector(std::vector<double>{0.25}, {1});
  c.tensors["labels"] = from_vector(std::vector<int64_t>{7, -1, 1LL << 40}, {3});
  c.tensors["bytes"] = from_vector(std::vector<uint8_t>{0, 255}, {2, 1});
  c.tensors["scalar"] = scalar_tensor(2.0);
  c.tensors["empty"] = zeros({0, 4});
  c.metadata["step"] = int64_t{1234};
  c.metadata["lr"] = 0.001;
  c.metadata["optimizer"] = std::string("adam");
  return c;
}

TEST(CheckpointTest, RoundTrip) {
  const std::string path = TempDir() + "/model.ckpt";
  ASSERT_TRUE(SaveCheckpoint(path, Sample()).ok());
  absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Checkpoint& c = *loaded;
  ASSERT_EQ(c.tensors.size(), 6u);
  EXPECT_EQ(c.tensors.at("w").shape(), (Shape{2, 3}));
  EXPECT_EQ(c.tensors.at("w").to_vector<float>(), (std::vector<float>{1.5f, -2.f, 3.f, 4.f, 5.f, 6.f}));
  EXPECT_EQ(c.tensors.at("b").dtype(), kFloat64);
  EXPECT_EQ(c.tensors.at("labels").to_vector<int64_t>(), (std::vector<int64_t>{7, -1, 1LL << 40}));
  EXPECT_EQ(c.tensors.at("bytes").to_vector<uint8_t>(), (std::vector<uint8_t>{0, 255}));
  EXPECT_EQ(c.tensors.at("scalar").dim(), 0);
  EXPECT_EQ(c.tensors.at("scalar").item(), 2.0);
  EXPECT_EQ(c.tensors.at("empty").shape(), (Shape{0, 4}));
  EXPECT_EQ(std::get<int64_t>(c.metadata.at("step")), 1234);
  EXPECT_EQ(std::get<double>(c.metadata.at("lr")), 0.001);
  EXPECT_EQ(std::get<std::string>(c.metadata.at("optimizer")), "adam");
  // No temporary file is left behind.
  int files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(fs::path(path).parent_path())) ++files;
  EXPECT_EQ(files, 1);
}

void ExpectError(const std::string& bytes, const std::string& needle) {
  const std::string path = TempDir() + "/bad.ckpt";
  WriteFile(path, bytes);
  absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path);
  ASSERT_FALSE(loaded.ok()) << "expected an error containing '" << needle << "'";
  const std::string message(loaded.status().message());
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find(needle), std::string::npos) << message;
}

TEST(CheckpointTest, CorruptFilesGiveErrorsNamingFileAndProblem) {
  const std::string good = SerializeCheckpoint(Sample());
  ExpectError("", "empty");
  ExpectError("NOTACKPT" + good.substr(8), "wrong magic");
  ExpectError(good.substr(0, 12), "truncated header");
  std::string version = good;
  version[8] = 9;
  ExpectError(version, "unsupported version 9");
  ExpectError(good.substr(0, good.size() - 5), "truncated");
  ExpectError(good + "xx", "trailing bytes");
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x10;
  ExpectError(flipped, "checksum mismatch");
  // Every truncation is an error, never a crash.
  for (size_t n = 0; n < good.size(); n += 7) {
    EXPECT_FALSE(ParseCheckpoint(good.substr(0, n), "x").ok()) << n;
  }
  EXPECT_EQ(LoadCheckpoint("/nonexistent/dir/x.ckpt").status().code(), absl::StatusCode::kNotFound);
  // A directory under a checkpoint's name says so (an ifstream reads it as empty).
  const std::string dir = ::testing::TempDir() + "/checkpoint_test_dir.ckpt";
  std::filesystem::create_directories(dir);
  const absl::StatusOr<Checkpoint> from_dir = LoadCheckpoint(dir);
  ASSERT_FALSE(from_dir.ok());
  EXPECT_EQ(from_dir.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(from_dir.status().message().find(dir + ": is a directory, not a file"), std::string::npos)
      << from_dir.status();
  std::filesystem::remove(dir);
}

TEST(CheckpointTest, SaveIntoMissingDirectoryFails) {
  absl::Status s = SaveCheckpoint("/nonexistent/dir/x.ckpt", Sample());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("/nonexistent/dir/x.ckpt"), std::string::npos) << s;
}

// A checkpoint whose every value equals `version`, large enough (~2 MB) that a
// kill often lands in the middle of a write.
Checkpoint Versioned(int64_t version) {
  Checkpoint c;
  c.tensors["big"] = full({512, 1024}, static_cast<double>(version));
  c.tensors["small"] = full({3}, static_cast<double>(version), {.dtype = kFloat64});
  c.metadata["version"] = version;
  return c;
}

// Children save versions first, first + 1, ... to one path in a loop; once the
// first save is complete each is killed with SIGKILL at a random moment. After
// every kill the path must load and hold one complete version >= first.
TEST(CheckpointTest, SurvivesSigkillDuringSave) {
  const std::string dir = TempDir();
  const std::string path = dir + "/train.ckpt";
  ASSERT_TRUE(SaveCheckpoint(path, Versioned(0)).ok());
  std::mt19937 rng(12345);
  int64_t last_version = 0;
  int64_t next_version = 1;
  for (int round = 0; round < 20; ++round) {
    const int64_t first = next_version;
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(ready[0]);
      for (int64_t v = first;; ++v) {
        if (!SaveCheckpoint(path, Versioned(v)).ok()) ::_exit(3);
        if (v == first) {  // tell the parent one save is complete, then keep saving
          const char byte = 1;
          if (::write(ready[1], &byte, 1) != 1) ::_exit(4);
          ::close(ready[1]);
        }
      }
    }
    ::close(ready[1]);
    char byte = 0;
    ASSERT_EQ(::read(ready[0], &byte, 1), 1) << "child failed before its first save";
    ::close(ready[0]);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 30000));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int wstatus = 0;
    ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(wstatus)) << "child exited on its own with status " << wstatus;
    absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(path);
    ASSERT_TRUE(loaded.ok()) << "round " << round << ": " << loaded.status();
    const int64_t version = std::get<int64_t>(loaded->metadata.at("version"));
    EXPECT_GE(version, first) << "round " << round << ": the completed save was lost";
    for (float v : loaded->tensors.at("big").to_vector<float>()) {
      ASSERT_EQ(v, static_cast<float>(version)) << "round " << round << ": mixed versions";
    }
    EXPECT_EQ(loaded->tensors.at("small").to_vector<double>(),
              std::vector<double>(3, static_cast<double>(version)));
    last_version = version;
    next_version = std::max(next_version, version + 1) + 1000;  // new versions are distinguishable
  }
  // Temporary files of killed writers remain: evidence that kills landed mid-write.
  int interrupted = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    interrupted += entry.path().filename().string().find(".tmp.") != std::string::npos;
  }
  std::cout << "last version " << last_version << ", " << interrupted << " interrupted writes\n";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tandem::nn
