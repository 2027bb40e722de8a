// train_cifar10: the ConvNet of the data-parallel quick start (--model=convnet),
// torchvision's ResNet-18 with the CIFAR stem (--model=resnet18) or torchvision's
// MobileNetV2 (--model=mobilenet_v2, OneFlow's DDP example:
// width 1.0, 10 classes; use --optimizer=sgd --lr=1e-3 --batch_size=64 as OneFlow
// does) on CIFAR-10 binary files (data_batch_1..5.bin, test_batch.bin in --data_dir; files
// that are there but damaged or incomplete are a bad --data_dir). Without any of
// them it says so and trains on a generated CIFAR-shaped dataset
// (3x32x32 images, 10 classes, each class a fixed random pattern plus noise),
// labelled "synthetic" in the environment table, every log line, the metrics
// file and the summary.
//
//   train_cifar10 --data_dir=/data/cifar-10-batches-bin
//   train_cifar10 --epochs=1 --max_steps_per_epoch=20      # synthetic, a smoke run
//   train_cifar10 --model=mobilenet_v2 --gpus=cpu --nprocs=2 --optimizer=sgd --batch_size=64
//   train_cifar10 --model=resnet18 --gpus=cpu --nprocs=2 --optimizer=momentum --lr=0.05
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "apps/common.h"
#include "apps/models.h"
#include "data/readers.h"
#include "data/transforms.h"
#include "nn/nn.h"
#include "spawn/train/sync_batch_norm.h"

ABSL_FLAG(std::string, model, "convnet",
          "convnet (the quick start's ConvNet), mobilenet_v2 (torchvision's MobileNetV2, "
          "width 1.0, 10 classes, classifier Dropout(0.2) + Linear(1280, 10)) or resnet18 "
          "(torchvision's ResNet-18, 10 classes, with the CIFAR stem: conv1 3x3 stride 1, no "
          "max-pool).");
ABSL_FLAG(bool, sync_bn, false,
          "Synchronised BatchNorm (dist::ConvertSyncBatchNorm): training statistics over the "
          "global batch, every rank's slice together, instead of each rank's own; one "
          "all_gather forward and one all_reduce backward per BatchNorm layer. Needs a model "
          "with BatchNorm (mobilenet_v2, resnet18).");
ABSL_FLAG(int, epochs, 10, "Passes over the training set.");
ABSL_FLAG(int, batch_size, 32,
          "Examples per step on each rank (the global batch is batch_size x ranks). Unset in "
          "the default run without GPUs (one CPU rank per core, see --gpus): 32 in all, "
          "split over the ranks.");
ABSL_FLAG(double, lr, 1e-3, "Learning rate (the peak one with --lr_schedule=cosine).");
ABSL_FLAG(std::string, lr_schedule, "constant",
          "constant | cosine (lr * (1 + cos(pi * step / total steps)) / 2, per step).");
ABSL_FLAG(std::string, optimizer, "adam",
          "sgd | momentum (SGD with momentum 0.9) | adagrad | adam | adamw (weight decay 0.01).");
ABSL_FLAG(std::string, data_dir, "",
          "Directory of the CIFAR-10 binary version (data_batch_1.bin .. data_batch_5.bin, "
          "test_batch.bin). Empty, or a directory without any of those files: a generated "
          "CIFAR-shaped dataset, reported as synthetic; files that are there but damaged or "
          "incomplete: an error naming the file.");
ABSL_FLAG(int64_t, synthetic_train_size, 10000,
          "Training examples of the generated dataset (used only without real files).");
ABSL_FLAG(int64_t, synthetic_test_size, 2000,
          "Test examples of the generated dataset (used only without real files).");

namespace {

namespace nn = ::tandem::nn;
namespace apps = ::tandem::apps;
namespace data = ::tandem::data;

// Per-channel standardisation with the CIFAR-10 training statistics, applied
// per batch by the loader; `scale` 1/255 for the stored bytes, 1 for the
// generated float images.
std::shared_ptr<const data::Transform> Standardise(double scale) {
  return std::make_shared<data::ToFloatNormalize>(scale, std::vector<double>{0.4914, 0.4822, 0.4465},
                                                  std::vector<double>{0.2470, 0.2435, 0.2616});
}

// `n` images of 10 classes: class c is pattern[c] (uniform in [0, 1), drawn
// once from seed) blended with per-image uniform noise; label i % 10.
// Deterministic in (seed, stream). Float images in [0, 1) (not yet standardised).
data::TensorDataset Synthetic(int64_t n, uint64_t seed, uint64_t stream) {
  nn::manual_seed(seed, 1000);
  nn::Tensor patterns = nn::rand({10, 3, 32, 32});
  nn::manual_seed(seed, stream);
  nn::Tensor noise = nn::rand({n, 3, 32, 32});
  std::vector<int64_t> labels(n);
  for (int64_t i = 0; i < n; ++i) labels[i] = i % 10;
  nn::Tensor images = nn::empty({n, 3, 32, 32});
  const float* p = patterns.host_data<float>();
  const float* z = noise.host_data<float>();
  float* out = images.host_data<float>();
  constexpr int64_t kImage = 3 * 32 * 32;
  for (int64_t i = 0; i < n; ++i) {
    const float* pattern = p + (i % 10) * kImage;
    for (int64_t j = 0; j < kImage; ++j) {
      out[i * kImage + j] = 0.5f * pattern[j] + 0.5f * z[i * kImage + j];
    }
  }
  return data::TensorDataset(images, nn::from_vector<int64_t>(labels, {n},
                                                                          {.dtype = nn::DType::kInt64}));
}

// --model: the model factory and its line in the environment table; nullopt
// for an unknown name.
struct ModelChoice {
  std::function<std::shared_ptr<nn::Module>()> make;
  std::string description;
  bool has_batch_norm = false;  // --sync_bn applies
};
std::optional<ModelChoice> ChooseModel(const std::string& name) {
  if (name == "convnet") {
    return ModelChoice{apps::MakeConvNet,
                       "model=ConvNet: conv3x3(32)+ReLU, maxpool2, conv3x3(64)+ReLU, "
                       "maxpool2, conv3x3(64)+ReLU, fc(1024->64)+ReLU, fc(64->10)"};
  }
  if (name == "mobilenet_v2") {
    return ModelChoice{[] { return apps::MakeMobileNetV2(); },
                       "model=MobileNetV2 (torchvision's, width 1.0): 17 inverted residual "
                       "blocks, depthwise convolutions, ReLU6, BatchNorm; Dropout(0.2) + "
                       "fc(1280->10); 2,236,682 parameters",
                       true};
  }
  if (name == "resnet18") {
    return ModelChoice{[] { return apps::MakeResNet18({.num_classes = 10, .cifar_stem = true}); },
                       "model=ResNet-18 (torchvision's, CIFAR stem: conv1 3x3 stride 1, no "
                       "max-pool): 8 BasicBlocks, fc(512->10); 11,173,962 parameters",
                       true};
  }
  return std::nullopt;
}

// --model and --sync_bn: the model factory (converted to SyncBatchNorm when asked)
// and its line in the environment table; a bad choice exits 2.
ModelChoice ChooseModelOrExit(apps::RunFlags& flags) {
  const std::string model = absl::GetFlag(FLAGS_model);
  const std::optional<ModelChoice> choice = ChooseModel(model);
  if (!choice) {
    apps::FlagErrorExit(flags, absl::StrCat("--model \"", model,
                                            "\": not a model (convnet, mobilenet_v2, resnet18)"));
  }
  flags.program_agreed.emplace_back("--model", model);
  const bool sync_bn = absl::GetFlag(FLAGS_sync_bn);
  if (sync_bn && !choice->has_batch_norm) {
    apps::FlagErrorExit(flags, absl::StrCat("--sync_bn: --model \"", model,
                                            "\" has no BatchNorm to synchronise (mobilenet_v2 "
                                            "and resnet18 have)"));
  }
  if (sync_bn && flags.cuda_graph) {
    apps::FlagErrorExit(flags, "--cuda_graph with --sync_bn: not supported (SyncBatchNorm's "
                               "collectives have not been captured in a CUDA graph step); drop "
                               "one of them");
  }
  flags.program_agreed.emplace_back("--sync_bn", sync_bn ? "true" : "false");
  if (!sync_bn) return *choice;
  return ModelChoice{[make = choice->make] {
                       std::shared_ptr<nn::Module> net = make();
                       ::tandem::dist::ConvertSyncBatchNorm(*net);
                       return net;
                     },
                     choice->description + "; SyncBatchNorm over the ranks", true};
}

// True when --data_dir holds any of the CIFAR-10 binary files.
bool HasAnyCifarFile(const std::string& dir) {
  for (const char* name : {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin",
                           "data_batch_4.bin", "data_batch_5.bin", "test_batch.bin"}) {
    std::error_code error;
    if (std::filesystem::exists(std::filesystem::path(dir) / name, error)) return true;
  }
  return false;
}

// CIFAR-10 from --data_dir, else (no --data_dir, or none of the files in it: said
// on stderr) a generated CIFAR-shaped dataset labelled synthetic. Files that are
// there but unusable (missing batches, truncated, corrupt) are a bad --data_dir
// (exit 2 naming the file), not a quiet run on generated data.
apps::ClassifierData LoadDataOrSynthetic(const apps::RunFlags& flags, int64_t synthetic_train,
                                         int64_t synthetic_test) {
  apps::ClassifierData set;
  std::string why_synthetic;
  if (flags.data_dir.empty()) {
    why_synthetic = "no --data_dir given";
  } else if (!HasAnyCifarFile(flags.data_dir)) {
    why_synthetic = absl::StrCat("no CIFAR-10 files (data_batch_1.bin .. data_batch_5.bin, "
                                 "test_batch.bin) in ", flags.data_dir);
  } else {
    // uint8 images as stored, converted per batch.
    absl::StatusOr<data::TensorDataset> train = data::LoadCifar10(flags.data_dir, true);
    absl::StatusOr<data::TensorDataset> test =
        train.ok() ? data::LoadCifar10(flags.data_dir, false) : train.status();
    if (train.ok() && test.ok()) {
      set.train = std::make_shared<data::TensorDataset>(*std::move(train));
      set.test = std::make_shared<data::TensorDataset>(*std::move(test));
      set.batch_transform = Standardise(1.0 / 255);
      set.name = "CIFAR-10";
    } else {
      apps::FlagErrorExit(flags, absl::StrCat("--data_dir: ",
                                              (train.ok() ? test : train).status().message()));
    }
  }
  if (!why_synthetic.empty()) {
    std::cerr << flags.program << ": " << why_synthetic
              << ": training on a generated CIFAR-shaped dataset (synthetic)\n";
    set.train = std::make_shared<data::TensorDataset>(Synthetic(synthetic_train, flags.seed, 1));
    set.test = std::make_shared<data::TensorDataset>(Synthetic(synthetic_test, flags.seed, 2));
    set.batch_transform = Standardise(1.0);
    set.name = "CIFAR-10 (synthetic)";
  }
  return set;
}

}  // namespace

int main(int argc, char** argv) {
  apps::RunFlags flags = apps::ParseFlagsOrExit(
      argc, argv,
      "Trains an image classifier on CIFAR-10 (32x32 colour photos of 10 classes: "
      "airplanes, cars, birds, cats, ...): a small convolutional network (--model=convnet: "
      "three 3x3 convolutions, two fully connected layers), MobileNetV2 as torchvision "
      "builds it (--model=mobilenet_v2) or ResNet-18 (--model=resnet18, CIFAR stem). It "
      "reads the CIFAR-10 binary files from "
      "--data_dir; without them it trains on a generated CIFAR-shaped dataset and labels "
      "every report synthetic. Training is data-parallel: every rank holds the same model, "
      "trains on its share of each batch, and the ranks average their gradients; one rank "
      "per visible GPU, else CPU ranks (--gpus, --nprocs), and several hosts when mpirun or "
      "srun starts it as several processes. After each epoch it prints the test accuracy, "
      "at the end a summary.\n\n"
      "Usage: train_cifar10 [--flag=value ...]\n"
      "  train_cifar10 --data_dir=/data/cifar-10-batches-bin --epochs=2");
  flags.epochs = absl::GetFlag(FLAGS_epochs);
  flags.batch_size = absl::GetFlag(FLAGS_batch_size);
  flags.lr = absl::GetFlag(FLAGS_lr);
  flags.lr_schedule = absl::GetFlag(FLAGS_lr_schedule);
  flags.optimizer = absl::GetFlag(FLAGS_optimizer);
  flags.data_dir = absl::GetFlag(FLAGS_data_dir);
  const ModelChoice choice = ChooseModelOrExit(flags);
  apps::ValidateOrExit(flags, {.data_dir = apps::Validation::DataDir::kOptional,
                               .rank_per_core = true});
  const int64_t synthetic_train = absl::GetFlag(FLAGS_synthetic_train_size);
  const int64_t synthetic_test = absl::GetFlag(FLAGS_synthetic_test_size);
  if (synthetic_train < 1 || synthetic_test < 1) {
    apps::FlagErrorExit(flags, "--synthetic_train_size and --synthetic_test_size must be >= 1");
  }

  const apps::ClassifierData set = LoadDataOrSynthetic(flags, synthetic_train, synthetic_test);
  return apps::RunClassifier(
      flags, set, choice.make,
      {absl::StrCat("data dir=", flags.data_dir.empty() ? "(none)" : flags.data_dir),
       choice.description});
}
