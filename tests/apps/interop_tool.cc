// interop_tool: tandem's half of tests/apps/interop_test.py, which checks
// tandem's models and safetensors files against PyTorch's.
//
//   interop_tool eval MODEL WEIGHTS INPUT OUTPUT
//       builds MODEL, loads WEIGHTS strictly (nn::LoadSafetensors), runs it in
//       eval mode on INPUT's tensor "input" (float32 (N, C, H, W)) and writes the
//       logits as tensor "output" of the safetensors file OUTPUT.
//   interop_tool save MODEL SEED OUTPUT
//       writes MODEL as built after nn::manual_seed(SEED) (nn::SaveSafetensors).
//
// MODEL: lenet, mobilenet_v2 (10 classes), resnet18, resnet50 (ImageNet stem),
// resnet18_cifar, resnet50_cifar (CIFAR stem), the ResNets with ":CLASSES"
// (default 1000). Exit status 0, or 1 with one line on stderr.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "apps/models.h"
#include "nn/random.h"
#include "nn/safetensors.h"

namespace {

namespace nn = ::tandem::nn;
namespace apps = ::tandem::apps;

[[noreturn]] void Die(const std::string& message) {
  std::cerr << "interop_tool: " << message << "\n";
  std::exit(1);
}

std::shared_ptr<nn::Module> MakeModel(const std::string& spec) {
  const size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  apps::ResNetOptions options{.cifar_stem = name.ends_with("_cifar")};
  if (colon != std::string::npos && !absl::SimpleAtoi(spec.substr(colon + 1), &options.num_classes)) {
    Die(absl::StrCat("model \"", spec, "\": bad class count"));
  }
  if (name == "lenet") return apps::MakeLeNet();
  if (name == "mobilenet_v2") return apps::MakeMobileNetV2();
  if (name == "resnet18" || name == "resnet18_cifar") return apps::MakeResNet18(options);
  if (name == "resnet50" || name == "resnet50_cifar") return apps::MakeResNet50(options);
  Die(absl::StrCat("unknown model \"", spec, "\""));
}

void Eval(const std::string& spec, const std::string& weights, const std::string& input,
          const std::string& output) {
  std::shared_ptr<nn::Module> model = MakeModel(spec);
  absl::StatusOr<nn::SafetensorsLoadReport> loaded = nn::LoadSafetensors(weights, *model);
  if (!loaded.ok()) Die(loaded.status().ToString());
  absl::StatusOr<nn::SafetensorsFile> in = nn::ReadSafetensors(input);
  if (!in.ok()) Die(in.status().ToString());
  if (in->tensors.size() != 1 || in->tensors[0].first != "input") {
    Die(absl::StrCat(input, ": expected one tensor \"input\""));
  }
  const nn::Tensor x = in->tensors[0].second;
  model->eval();
  nn::NoGradGuard no_grad;
  constexpr int64_t kChunk = 500;
  nn::Tensor logits;
  for (int64_t i = 0; i < x.size(0); i += kChunk) {
    const nn::Tensor y = model->forward(x.slice(i, std::min(x.size(0), i + kChunk)));
    if (!logits.defined()) logits = nn::empty({x.size(0), y.size(1)});
    logits.slice(i, i + y.size(0)).copy_(y);
  }
  const absl::Status saved = nn::SaveSafetensors(output, nn::StateDict{{"output", logits}});
  if (!saved.ok()) Die(saved.ToString());
  std::cout << "loaded " << loaded->loaded.size() << " tensors into " << spec << "; "
            << x.size(0) << " outputs written to " << output << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "eval" && argc == 6) {
    Eval(argv[2], argv[3], argv[4], argv[5]);
  } else if (command == "save" && argc == 5) {
    uint64_t seed = 0;
    if (!absl::SimpleAtoi(argv[3], &seed)) Die(absl::StrCat("bad seed \"", argv[3], "\""));
    nn::manual_seed(seed);
    const absl::Status saved = nn::SaveSafetensors(argv[4], *MakeModel(argv[2]));
    if (!saved.ok()) Die(saved.ToString());
  } else {
    Die("usage: interop_tool eval MODEL WEIGHTS INPUT OUTPUT | save MODEL SEED OUTPUT");
  }
  return 0;
}
