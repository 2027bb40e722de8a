// Runs every row of the parity table (gpu_parity_cases.cc) on every visible
// CUDA device against the CPU: the row's inputs are made on the CPU from its
// seed, the op runs on CPU leaves and on CUDA copies of them, and the outputs
// (and, for kGradients rows, every input's gradient after the same output
// gradient) are compared within the row's tolerance. One test per row
// (GpuParity/Table.MatchesCpu/<op>_<dtype>_<fwd|grad>_<row>), so
// --gtest_filter picks rows by op or dtype. Label gpu; every row skips with the
// reason when no GPU is visible.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "nn/autocast.h"
#include "nn/device.h"
#include "nn/ops/matmul.h"  // set_allow_tf32
#include "nn/random.h"
#include "nn/tensor.h"
#include "tests/gpu_test_util.h"
#include "tests/nn/gpu_parity.h"

namespace tandem::nn::testing {
namespace {

// One side of a row: its leaves (holding their gradients after backward) and the output.
struct Side {
  std::vector<Tensor> leaves;
  Tensor out;
};

// f on copies of `inputs` on `device` (leaves requiring grad for kGradients rows),
// under the row's autocast.
Side Forward(const ParityCase& c, const std::vector<Tensor>& inputs, Device device) {
  Side side;
  for (const Tensor& t : inputs) {
    Tensor leaf = device.is_cuda() ? t.detach().to(device) : t.detach().clone();
    side.leaves.push_back(c.mode == Mode::kGradients ? leaf.set_requires_grad(true) : leaf);
  }
  std::optional<AutocastGuard> autocast;
  if (c.autocast) autocast.emplace(*c.autocast);
  side.out = c.f(side.leaves);
  return side;
}

// The float64 magnitude reference of the rows whose tolerance has one
// (Tolerance::needs_magnitude): f on float64 |inputs|
// (each rounded to the autocast dtype first, as the op under autocast sees it),
// without autocast, and for kGradients rows the gradients after |out_grad|.
Side MagnitudeReference(const ParityCase& c, const std::vector<Tensor>& inputs,
                        const Tensor& out_grad) {
  auto abs64 = [](const Tensor& t) {
    std::vector<double> v = t.to_vector<double>();
    for (double& e : v) e = std::fabs(e);
    return from_vector(v, t.shape(), {.dtype = kFloat64, .device = Device::CPU()});
  };
  Side side;
  for (const Tensor& t : inputs) {
    Tensor leaf = abs64(c.autocast ? t.to(*c.autocast) : t);
    side.leaves.push_back(c.mode == Mode::kGradients ? leaf.set_requires_grad(true) : leaf);
  }
  side.out = c.f(side.leaves);
  if (c.mode == Mode::kGradients) side.out.backward(abs64(out_grad));
  return side;
}

void RunRow(const ParityCase& c, Device gpu) {
  // CUDA GEMMs and convolutions read it (forward and backward); the CPU ignores it.
  // The fixture turns it off again before every row.
  set_allow_tf32(c.tf32);
  manual_seed(c.seed);
  std::vector<Tensor> inputs;
  for (const Input& in : c.inputs) inputs.push_back(Filled(in.shape, in.fill, c.dtype));
  Side cpu = Forward(c, inputs, Device::CPU());
  Side cuda;
  {
    DeviceGuard guard(gpu);  // as a rank thread of spawn runs it
    cuda = Forward(c, inputs, gpu);
  }
  ASSERT_TRUE(cpu.out.defined() && cuda.out.defined());
  ASSERT_EQ(cuda.out.device(), gpu);
  ASSERT_EQ(cpu.out.shape(), cuda.out.shape());
  Tensor out_grad;
  if (c.mode == Mode::kGradients) {
    out_grad = Filled(cpu.out.shape(), c.out_grad, cpu.out.dtype());
    cpu.out.backward(out_grad);
    DeviceGuard guard(gpu);
    cuda.out.backward(out_grad.to(gpu));
  }
  Side ref;
  if (c.tol.needs_magnitude()) ref = MagnitudeReference(c, inputs, out_grad);
  ExpectClose(cpu.out, cuda.out, c.tol, false, ref.out, "output");
  if (c.mode == Mode::kForward) return;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const std::string what = "gradient of input " + std::to_string(k);
    ASSERT_TRUE(cuda.leaves[k].grad().defined()) << what << ": none on CUDA";
    // A gradient has its leaf's dtype (float32 leaves under autocast too).
    EXPECT_EQ(cuda.leaves[k].grad().dtype(), inputs[k].dtype()) << what;
    ExpectClose(cpu.leaves[k].grad(), cuda.leaves[k].grad(), c.tol, true,
                ref.leaves.empty() ? Tensor() : ref.leaves[k].grad(), what);
  }
}

class GpuParity : public tandem::testing::GpuTest,
                  public ::testing::WithParamInterface<ParityCase> {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    set_allow_tf32(false);
  }
};

TEST_P(GpuParity, MatchesCpu) {
  const ParityCase& c = GetParam();
  for (int d = 0; d < cuda_device_count(); ++d) {
    const Device gpu = Device::CUDA(d);
    SCOPED_TRACE(c.op + " " + DTypeName(c.dtype) + (c.attrs.empty() ? "" : ", " + c.attrs) +
                 " on " + gpu.ToString());
    RunRow(c, gpu);
  }
  set_allow_tf32(false);
}

// <op>_<dtype>[_autocast]_<fwd|grad>_<row>, in the characters gtest accepts.
std::string RowName(const ::testing::TestParamInfo<ParityCase>& info) {
  const ParityCase& c = info.param;
  std::string name = c.op + "_" + DTypeName(c.dtype) + (c.autocast ? "_autocast" : "") +
                     (c.tf32 ? "_tf32" : "") + (c.mode == Mode::kForward ? "_fwd_" : "_grad_") +
                     std::to_string(info.index);
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Table, GpuParity, ::testing::ValuesIn(ParityCases()), RowName);

}  // namespace
}  // namespace tandem::nn::testing
