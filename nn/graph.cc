// CudaGraph in a build without CUDA (nn/cuda/graph.cc is the CUDA build's):
// nothing can be captured, so the constructor fails and no capture ever runs.
#include "nn/graph.h"

#include "nn/error.h"

#if TANDEM_WITH_CUDA
#error "nn/graph.cc is the build without CUDA; the CUDA build compiles nn/cuda/graph.cc"
#endif

namespace tandem::nn {

struct CudaGraph::Impl {};

CudaGraph::CudaGraph(Device device) : device_(device) {
  Fail("CudaGraph: tandem was built without CUDA (device ", device.ToString(),
       "); rebuild with -DTANDEM_CUDA=ON to capture CUDA graphs");
}

CudaGraph::~CudaGraph() = default;
void CudaGraph::Capture(const std::function<void()>&) { Fail("tandem was built without CUDA"); }
void CudaGraph::Replay() { Fail("tandem was built without CUDA"); }
bool CudaGraph::captured() const { return false; }
int64_t CudaGraph::num_nodes() const { return 0; }
Device CudaGraph::device() const { return device_; }
bool CudaGraph::AddPreReplayHook(std::function<void()>) { return false; }
bool CudaGraph::AddPostReplayHook(const void*, std::function<void()>) { return false; }
bool CudaGraph::HasPostReplayHook(const void*) { return false; }
bool CudaGraph::IsCapturing() { return false; }
uint64_t CudaGraph::CaptureId() { return 0; }
std::function<std::string(const std::string&)> CudaGraph::ReleaserOfCurrentCapture() {
  return nullptr;
}

}  // namespace tandem::nn
