#include "spawn/devices.h"

#include <climits>
#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::dist {
namespace {

using nn::Device;

class DevicesTest : public ::testing::Test {
 protected:
  // Messages mention CUDA_VISIBLE_DEVICES when set; keep them predictable.
  void SetUp() override { unsetenv("CUDA_VISIBLE_DEVICES"); }
};

struct Good {
  const char* gpus;
  int nprocs;
  int visible;
  bool share;
  std::vector<Device> expected;
};

TEST_F(DevicesTest, ValidSelections) {
  const Device c = Device::CPU();
  const std::vector<Good> cases = {
      {"", -1, 4, false, {Device::CUDA(0), Device::CUDA(1), Device::CUDA(2), Device::CUDA(3)}},
      {"", 2, 4, false, {Device::CUDA(0), Device::CUDA(1)}},
      {"", -1, 0, false, {c}},            // no GPU: CPU ranks
      {"", 3, 0, false, {c, c, c}},
      {"cpu", -1, 4, false, {c}},
      {"cpu", 4, 4, false, {c, c, c, c}},
      {"CPU", 2, 0, false, {c, c}},
      {"0,1,3", -1, 4, false, {Device::CUDA(0), Device::CUDA(1), Device::CUDA(3)}},
      {"3,1", -1, 4, false, {Device::CUDA(3), Device::CUDA(1)}},  // listed order = rank order
      {"0,1,3", 2, 4, false, {Device::CUDA(0), Device::CUDA(1)}},  // first nprocs
      {" 2 , 0 ", -1, 4, false, {Device::CUDA(2), Device::CUDA(0)}},
      {"0,0", -1, 1, true, {Device::CUDA(0), Device::CUDA(0)}},  // share_devices
      {"0,0,0", -1, 2, true, {Device::CUDA(0), Device::CUDA(0), Device::CUDA(0)}},
      {"1,1", -1, 2, true, {Device::CUDA(1), Device::CUDA(1)}},
      // share_devices with distinct GPUs: one rank each (NCCL).
      {"0,1", -1, 2, true, {Device::CUDA(0), Device::CUDA(1)}},
      // Only the selected ranks count: the first two of a mixed list share GPU 0.
      {"0,0,1,1", 2, 2, true, {Device::CUDA(0), Device::CUDA(0)}},
      {"0,1,0,1", 2, 2, true, {Device::CUDA(0), Device::CUDA(1)}},
      // PyTorch's device names: one CPU rank per "cpu" / "cpu:K" token, "cuda:K" as K.
      {"cpu:0,cpu:1", -1, 0, false, {c, c}},
      {"cpu:0, cpu:1, CPU:2", -1, 2, false, {c, c, c}},
      {"cpu,cpu", -1, 0, false, {c, c}},
      {"cpu:0,cpu:1,cpu:2", 2, 0, false, {c, c}},
      {"cpu:0", -1, 0, false, {c}},
      // K means nothing for CPU ranks (they share the host): one rank per token,
      // repeats included.
      {"cpu:7", -1, 0, false, {c}},
      {" CPU:0 , cpu:0 ", -1, 2, false, {c, c}},
      {"cuda:1,cuda:0", -1, 2, false, {Device::CUDA(1), Device::CUDA(0)}},
      {"cuda:0,1", -1, 2, false, {Device::CUDA(0), Device::CUDA(1)}},
      {"CUDA:1", -1, 2, false, {Device::CUDA(1)}},
      {"cuda:0,cuda:0", -1, 1, true, {Device::CUDA(0), Device::CUDA(0)}},
  };
  for (const Good& g : cases) {
    absl::StatusOr<std::vector<Device>> got = SelectDevices(g.gpus, g.nprocs, g.visible, g.share);
    ASSERT_TRUE(got.ok()) << "gpus \"" << g.gpus << "\" nprocs " << g.nprocs << ": "
                          << got.status();
    EXPECT_EQ(*got, g.expected) << "gpus \"" << g.gpus << "\" nprocs " << g.nprocs;
  }
}

struct Bad {
  const char* gpus;
  int nprocs;
  int visible;
  bool share;
  std::vector<std::string> message_parts;
};

TEST_F(DevicesTest, InvalidSelectionsNameTheBadTokenAndWhatIsVisible) {
  const std::vector<Bad> cases = {
      {"0,,1", -1, 2, false, {"token \"\"", "empty", "2 GPUs are visible (ordinals 0..1)"}},
      {"5,,1", -1, 0, false, {"token \"\"", "empty", "no GPU is visible"}},
      {",0", -1, 2, false, {"token \"\"", "empty"}},
      {"0,", -1, 2, false, {"token \"\"", "empty"}},
      {"-1", -1, 2, false, {"token \"-1\"", "negative"}},
      {"0,-0", -1, 2, false, {"token \"-0\"", "negative"}},
      {"a", -1, 2, false, {"token \"a\"", "not a whole number"}},
      {"1.5", -1, 2, false, {"token \"1.5\"", "not a whole number"}},
      {"0x1", -1, 2, false, {"token \"0x1\"", "not a whole number"}},
      {"+1", -1, 2, false, {"token \"+1\"", "not a whole number"}},
      {"4294967295", -1, 2, false, {"token \"4294967295\"", "overflows"}},
      {"99999999999999999999999", -1, 2, false, {"overflows"}},
      {"2", -1, 2, false, {"token \"2\"", "not a visible GPU", "ordinals 0..1"}},
      {"0", -1, 0, false, {"token \"0\"", "not a visible GPU", "no GPU is visible"}},
      {"1,0,1", -1, 2, false, {"token \"1\"", "listed twice", "share_devices"}},
      {"0,0", -1, 1, false, {"token \"0\"", "listed twice", "1 GPU is visible"}},
      {"0,1", 3, 2, false, {"nprocs 3", "more than the 2 devices", "\"0,1\""}},
      {"", 5, 4, false, {"nprocs 5", "more than the 4 devices"}},
      {"0,1", 0, 2, false, {"nprocs 0", "invalid"}},
      // Mixed shared lists: two GPUs, one of them (or both) shared.
      {"0,0,1,1", -1, 2, true,
       {"gpus \"0,0,1,1\"", "ranks on GPUs 0,0,1,1", "ONE GPU", "not a mix"}},
      {"0,1,0,1", 3, 2, true, {"nprocs 3", "ranks on GPUs 0,1,0", "not a mix"}},
      {"1,0,0", -1, 2, true, {"ranks on GPUs 1,0,0", "in-process communicator"}},
      {"cpu", -2, 0, false, {"nprocs -2", "invalid"}},
      // PyTorch's device names: CPU and GPU ranks do not mix; a bad ordinal is named.
      {"cpu:0,1", -1, 2, false, {"gpus \"cpu:0,1\"", "\"cpu:0\"", "\"1\"", "CPU and GPU"}},
      {"cuda:0,cpu", -1, 2, false, {"\"cuda:0\"", "\"cpu\"", "CPU and GPU"}},
      {"cpu,,cpu", -1, 0, false, {"token \"\"", "empty"}},
      {"cpu:x", -1, 0, false, {"token \"cpu:x\"", "not a whole number"}},
      {"cuda:", -1, 2, false, {"token \"cuda:\"", "names no ordinal", "\"cuda:0\""}},
      {"cuda", -1, 2, false, {"token \"cuda\"", "names no ordinal", "every visible GPU"}},
      {"0,CUDA", -1, 2, false, {"token \"CUDA\"", "names no ordinal"}},
      {"cuda:0,cuda:1:2", -1, 4, false, {"token \"cuda:1:2\"", "not a whole number"}},
      {"0,cuda:0", -1, 2, false, {"token \"cuda:0\"", "listed twice"}},
      {"cpu:-1", -1, 0, false, {"token \"cpu:-1\"", "not a whole number after \"cpu:\""}},
      {"cpu:", -1, 0, false, {"token \"cpu:\"", "not a whole number after \"cpu:\""}},
      {"cpu:0", 2, 0, false, {"nprocs 2", "more than the 1 devices", "\"cpu:0\""}},
      {"cuda:2", -1, 2, false, {"token \"cuda:2\"", "not a visible GPU"}},
      {"cuda:-1", -1, 2, false, {"token \"cuda:-1\"", "negative"}},
      {"cpu:0,cpu:1", 3, 0, false, {"nprocs 3", "more than the 2 devices", "\"cpu:0,cpu:1\""}},
      // More rank threads than one process runs: refused before the list is built
      // (INT_MAX CPU ranks would allocate gigabytes of devices first).
      {"cpu", 1025, 0, false,
       {"1025 ranks in one process", "at most 1024 rank threads"}},
      {"cpu", INT_MAX, 0, false, {"2147483647 ranks in one process"}},
      {"", INT_MAX, 0, false, {"2147483647 ranks in one process"}},
  };
  for (const Bad& b : cases) {
    absl::StatusOr<std::vector<Device>> got = SelectDevices(b.gpus, b.nprocs, b.visible, b.share);
    ASSERT_FALSE(got.ok()) << "gpus \"" << b.gpus << "\" nprocs " << b.nprocs << " was accepted";
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    for (const std::string& part : b.message_parts) {
      EXPECT_NE(got.status().message().find(part), absl::string_view::npos)
          << "gpus \"" << b.gpus << "\": \"" << got.status().message() << "\" lacks \"" << part
          << "\"";
    }
  }
}

TEST_F(DevicesTest, MessageShowsCudaVisibleDevices) {
  setenv("CUDA_VISIBLE_DEVICES", "2,3", 1);
  absl::StatusOr<std::vector<Device>> got = SelectDevices("5", -1, 2, false);
  unsetenv("CUDA_VISIBLE_DEVICES");
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("CUDA_VISIBLE_DEVICES=\"2,3\""), absl::string_view::npos)
      << got.status();
}

TEST_F(DevicesTest, HasSharedGpu) {
  EXPECT_FALSE(HasSharedGpu({Device::CPU(), Device::CPU()}));
  EXPECT_FALSE(HasSharedGpu({Device::CUDA(0), Device::CUDA(1)}));
  EXPECT_TRUE(HasSharedGpu({Device::CUDA(1), Device::CUDA(0), Device::CUDA(1)}));
}

}  // namespace
}  // namespace tandem::dist
