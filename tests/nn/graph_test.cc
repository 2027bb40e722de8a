// CudaGraph outside a GPU: bad devices are errors naming them, and no capture
// runs on a thread that did not start one. Runs everywhere (no label).
#include <gtest/gtest.h>

#include <string>

#include "nn/error.h"
#include "nn/graph.h"
#include "tests/test_util.h"

namespace tandem::nn {
using ::tandem::testing::ErrorOf;

namespace {

TEST(CudaGraphTest, CpuDeviceIsAnErrorNamingIt) {
  const std::string what = ErrorOf([] { CudaGraph graph(Device::CPU()); });
  if (!cuda_built()) {
    EXPECT_NE(what.find("tandem was built without CUDA"), std::string::npos) << what;
  } else {
    EXPECT_NE(what.find("device cpu is not a CUDA device"), std::string::npos) << what;
  }
}

TEST(CudaGraphTest, DefaultDeviceOfAThreadWithoutOneIsCpuAndRejected) {
  // The calling thread's current device is the CPU unless set.
  ASSERT_EQ(current_device(), Device::CPU());
  EXPECT_THROW(CudaGraph graph, Error);
}

TEST(CudaGraphTest, InvisibleCudaDeviceIsAnErrorNamingIt) {
  const int index = cuda_device_count() + 3;
  const std::string what = ErrorOf([&] { CudaGraph graph(Device::CUDA(index)); });
  if (!cuda_built()) {
    EXPECT_NE(what.find("tandem was built without CUDA"), std::string::npos) << what;
  } else {
    EXPECT_NE(what.find("cuda:" + std::to_string(index) + " is not visible"), std::string::npos)
        << what;
  }
}

TEST(CudaGraphTest, NoCaptureOutsideCapture) {
  EXPECT_FALSE(CudaGraph::IsCapturing());
  EXPECT_EQ(CudaGraph::CaptureId(), 0u);
  bool ran = false;
  EXPECT_FALSE(CudaGraph::AddPreReplayHook([&] { ran = true; }));
  EXPECT_FALSE(ran);
}

}  // namespace
}  // namespace tandem::nn
