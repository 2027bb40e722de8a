// quickstart_linear: the first program a new user runs: the quick start's LinearNet (README)
// (two Linear layers) trained for 20 steps on random batches with MSELoss and
// plain SGD written in place, on one device, printing "step:N loss:X" per step
// as the Paddle seed does.
//
//   quickstart_linear            # on the CPU
//   quickstart_linear cuda:0     # on GPU 0 (a CUDA build)
//
// Exits 1 with the reason on a bad device argument.
#include <iostream>
#include <string>

#include "absl/status/statusor.h"
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
  if (argc > 2) {
    std::cerr << "usage: " << argv[0] << " [cpu|cuda:N]\n";
    return 1;
  }
  absl::StatusOr<nn::Device> device =
      nn::ParseDevice(argc == 2 ? argv[1] : "cpu");
  if (!device.ok()) {
    std::cerr << device.status() << "\n";
    return 1;
  }
  if (device->is_cuda() && device->index >= nn::cuda_device_count()) {
    std::cerr << "device " << device->ToString() << " is not available: this process sees "
              << nn::cuda_device_count() << " CUDA device(s)\n";
    return 1;
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
