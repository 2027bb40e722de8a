// quickstart_linear: the first program a new user runs: the quick start's LinearNet (README)
// (two Linear layers) trained for 20 steps on random batches with MSELoss and
// plain SGD written in place, on one device, printing "step:N loss:X" per step
// as the Paddle seed does.
//
//   quickstart_linear            # on the CPU
//   quickstart_linear cuda:0     # on GPU 0 (a CUDA build)
//
// The command line is read as every program reads it (apps/flag_check.h):
// --help exits 0; an unknown flag, a second argument, a bad device or one this
// machine lacks exit 2 with one line; a failure while training exits 1.
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "apps/flag_check.h"
#include "nn/nn.h"

namespace {

namespace nn = ::tandem::nn;

struct LinearNet : nn::Module {
  LinearNet() : l1(register_module("l1", nn::Linear(10, 10))),
                l2(register_module("l2", nn::Linear(10, 1))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(l1(x)); }
  nn::Linear l1, l2;
};

void Train(double lr, int steps) {
  LinearNet net;  // built on the current device
  nn::MSELoss loss_fn;
  for (int step = 0; step < steps; ++step) {
    nn::Tensor loss = loss_fn(net(nn::randn({10, 10})), nn::randn({10, 1}));
    std::cout << "step:" << step << " loss:" << loss.item() << "\n";
    loss.backward();
    {
      nn::NoGradGuard no_grad;  // the update itself is not part of the graph
      for (nn::Tensor& p : net.parameters()) p.add_(p.grad(), -lr);
    }
    net.zero_grad();
  }
}

}  // namespace

int main(int argc, char** argv) {
  tandem::apps::SetUpHelp(
      "quickstart_linear",
      "Trains the README's quick-start LinearNet (Linear(10, 10), then Linear(10, 1); mean "
      "squared error; plain SGD at lr 0.05) on random batches for 20 steps on one device, "
      "without spawn, and prints step:N loss:X after each step.\n\n"
      "Usage: quickstart_linear [cpu|cuda:N]   (default cpu)");
  const std::vector<char*> args =
      tandem::apps::ParseCommandLineOrExit("quickstart_linear", argc, argv);
  if (args.size() > 2) {
    std::cerr << "quickstart_linear: error: unexpected argument \"" << args[2]
              << "\" (usage: quickstart_linear [cpu|cuda:N]; see --help)\n";
    return 2;
  }
  absl::StatusOr<nn::Device> device = nn::ParseDevice(args.size() == 2 ? args[1] : "cpu");
  if (!device.ok()) {
    std::cerr << "quickstart_linear: error: " << device.status().message() << "\n";
    return 2;
  }
  if (device->is_cuda() && device->index >= nn::cuda_device_count()) {
    std::cerr << "quickstart_linear: error: device " << device->ToString()
              << " is not available: this process sees " << nn::cuda_device_count()
              << " CUDA device(s)\n";
    return 2;
  }
  try {
    nn::DeviceGuard guard(*device);
    nn::manual_seed(0);
    Train(/*lr=*/0.05, /*steps=*/20);
  } catch (const tandem::Error& e) {
    std::cerr << "quickstart_linear: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
