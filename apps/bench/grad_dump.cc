// mnv2_grad_dump: a diagnostic (MobileNetV2 losses vs PyTorch). Loads
// tandem_bench's exchange directory (apps/bench/exchange.h) for mobilenet_v2,
// optionally converts the model to float64, runs one forward/backward on batch 0
// and writes every parameter's gradient to OUT/<name>.grad.bin (raw, the model's
// dtype), then runs STEPS plain-SGD steps (lr 0.01, batches cycled as
// tandem_bench does) and prints the losses. scripts/bench/mnv2_grads.py does the
// same with torchvision and compares.
// With ACT=silu every ReLU6 is replaced by SiLU (x * sigmoid(x), smooth), as
// scripts/bench/mnv2_grads.py --silu does on the torch side.
//   mnv2_grad_dump IMPORT_DIR OUT_DIR {float32|float64} [BATCH] [STEPS] [relu6|silu]
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "apps/bench/exchange.h"
#include "apps/models.h"
#include "nn/nn.h"
#include "optim/sgd.h"

namespace {

using namespace tandem;

void Die(const std::string& what) {
  std::cerr << "mnv2_grad_dump: " << what << "\n";
  std::exit(1);
}

// Points t's TensorImpl at a float64 copy of its data (as Module::to does for devices).
void ToFloat64InPlace(const nn::Tensor& t) {
  nn::NoGradGuard no_grad;
  nn::Tensor converted = t.detach().to(nn::kFloat64);
  t.impl()->storage = converted.storage();
  t.impl()->offset = converted.storage_offset();
  t.impl()->dtype = nn::kFloat64;
}

// x * sigmoid(x): a smooth stand-in for ReLU6 (no kinks).
class SiLUImpl : public nn::Module {
 public:
  nn::Tensor forward(const nn::Tensor& x) override { return nn::mul(x, nn::sigmoid(x)); }
};

// Replaces every ReLU6 inside a Sequential of `m`'s subtree by SiLU. A diagnostic's
// shortcut: Sequential has no setter, so the slot is overwritten through its
// accessor (the vector element itself is not const); ReLU6 has no parameters, so
// the registered children (traversal only) may keep the old module.
void ReplaceRelu6(nn::Module& m) {
  if (auto* seq = dynamic_cast<nn::SequentialImpl*>(&m)) {
    for (int64_t i = 0; i < seq->size(); ++i) {
      if (dynamic_cast<nn::ReLU6Impl*>((*seq)[i].get()) != nullptr) {
        const_cast<std::shared_ptr<nn::Module>&>((*seq)[i]) = std::make_shared<SiLUImpl>();
      }
    }
  }
  for (const auto& [name, child] : m.named_children()) ReplaceRelu6(*child);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) Die("usage: mnv2_grad_dump IMPORT_DIR OUT_DIR {float32|float64} [BATCH] [STEPS]");
  const std::string import_dir = argv[1], out_dir = argv[2], dtype_name = argv[3];
  const int64_t batch = argc > 4 ? std::atoll(argv[4]) : 32;
  const int64_t steps = argc > 5 ? std::atoll(argv[5]) : 10;
  const bool f64 = dtype_name == "float64";
  const std::string act = argc > 6 ? argv[6] : "relu6";
  if (act != "relu6" && act != "silu") Die("ACT must be relu6 or silu");
  if (!f64 && dtype_name != "float32") Die("dtype must be float32 or float64");
  nn::set_cpu_blas_threads(1);

  std::shared_ptr<nn::Module> model = apps::MakeMobileNetV2(/*dropout=*/0.0);
  if (auto s = apps::bench::ReadModelState(import_dir, "mobilenet_v2", *model); !s.ok()) {
    Die(s.ToString());
  }
  auto images = apps::bench::ReadRawRows(import_dir + "/mobilenet_v2/images.bin", {3, 32, 32},
                                         nn::kFloat32);
  if (!images.ok()) Die(images.status().ToString());
  auto labels = apps::bench::ReadRawTensor(import_dir + "/mobilenet_v2/labels.bin",
                                           {images->size(0)}, nn::kInt64);
  if (!labels.ok()) Die(labels.status().ToString());
  nn::Tensor all_images = f64 ? images->to(nn::kFloat64) : *images;
  if (f64) {
    for (const nn::Tensor& p : model->parameters()) ToFloat64InPlace(p);
    for (const nn::Tensor& b : model->buffers()) ToFloat64InPlace(b);
  }
  if (act == "silu") ReplaceRelu6(*model);
  model->train();
  std::filesystem::create_directories(out_dir);

  optim::SGD sgd(model->parameters(), optim::SGDOptions{.lr = 0.01});
  const int64_t batches = images->size(0) / batch;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t b = step % batches;
    sgd.zero_grad();
    nn::Tensor loss = nn::cross_entropy(model->forward(all_images.slice(b * batch, (b + 1) * batch)),
                                        labels->slice(b * batch, (b + 1) * batch));
    loss.backward();
    std::printf("step %lld loss %.17g\n", static_cast<long long>(step),
                loss.item());
    if (step == 0) {
      for (const auto& [name, p] : model->named_parameters()) {
        auto s = apps::bench::WriteRawTensor(absl::StrCat(out_dir, "/", name, ".grad.bin"), p.grad());
        if (!s.ok()) Die(s.ToString());
      }
    }
    sgd.step();
  }
  return 0;
}
