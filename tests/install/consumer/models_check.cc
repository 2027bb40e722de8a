// models_check: an outside project's use of tandem's model definitions
// (tandem::models, apps/models.h) from the installed package, as a torchvision
// user calls torchvision.models.resnet18. On the CPU:
//   LeNet: 20,350 parameters (10 classes); a batch (2, 1, 28, 28) -> (2, 10);
//   ResNet-18 with 10 classes: torchvision's 11,181,642 parameters
//   (resnet18(num_classes=10)); one image (1, 3, 32, 32) -> (1, 10) in eval mode.
// Exits 0 when every count and shape matches and the outputs are finite; 1
// otherwise, naming what differs.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "apps/models.h"
#include "nn/nn.h"

namespace {

namespace nn = ::tandem::nn;
namespace apps = ::tandem::apps;

int64_t ParameterCount(nn::Module& model) {
  int64_t count = 0;
  for (const auto& [name, p] : model.named_parameters()) count += p.numel();
  return count;
}

// Returns whether `model` has `want_params` parameters and maps `x` to `want_out`.
bool Check(const char* what, nn::Module& model, int64_t want_params, const nn::Tensor& x,
           const nn::Shape& want_out) {
  bool ok = true;
  const int64_t params = ParameterCount(model);
  if (params != want_params) {
    std::fprintf(stderr, "%s: %lld parameters, want %lld\n", what, static_cast<long long>(params),
                 static_cast<long long>(want_params));
    ok = false;
  }
  nn::NoGradGuard no_grad;
  const nn::Tensor y = model.forward(x);
  if (y.shape() != want_out) {
    std::fprintf(stderr, "%s: output %s for input %s, want %s\n", what,
                 nn::ShapeToString(y.shape()).c_str(), nn::ShapeToString(x.shape()).c_str(),
                 nn::ShapeToString(want_out).c_str());
    return false;
  }
  for (float v : y.to_vector<float>()) {
    if (!std::isfinite(v)) {
      std::fprintf(stderr, "%s: output %f is not finite\n", what, v);
      return false;
    }
  }
  if (ok) std::printf("%s: %lld parameters, output %s\n", what, static_cast<long long>(params),
                      nn::ShapeToString(y.shape()).c_str());
  return ok;
}

}  // namespace

int main() {
  nn::manual_seed(5);
  bool ok = true;
  std::shared_ptr<nn::Module> lenet = apps::MakeLeNet();
  ok &= Check("LeNet", *lenet, 20350, nn::randn({2, 1, 28, 28}), {2, 10});
  std::shared_ptr<nn::Module> resnet = apps::MakeResNet18({.num_classes = 10});
  resnet->eval();
  ok &= Check("ResNet-18", *resnet, 11181642, nn::randn({1, 3, 32, 32}), {1, 10});
  return ok ? 0 : 1;
}
