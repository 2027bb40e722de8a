// mnv2_op_errors: the per-op check. For every convolution and BatchNorm of
// MobileNetV2 at its real shape (batch N, 32x32 input as in tandem_bench), runs
// forward and backward in float32 (the oneDNN path for conv) and in float64
// (im2col + OpenBLAS, the path the float64 gradchecks and the whole-model float64
// comparison with torchvision cover) on the same float32-representable inputs,
// and prints the relative L2 error of every float32 result against float64.
// scripts/bench/mnv2_op_errors.py prints the same table for PyTorch's float32.
//   mnv2_op_errors [N]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "nn/nn.h"

namespace {

using namespace tandem;

// ||a - b|| / ||b||, both read as double.
double RelErr(const nn::Tensor& a, const nn::Tensor& b) {
  nn::Tensor a64 = a.to(nn::kFloat64), b64 = b.to(nn::kFloat64);
  const double* pa = a64.host_data<double>();
  const double* pb = b64.host_data<double>();
  double num = 0, den = 0;
  for (int64_t i = 0; i < a64.numel(); ++i) {
    num += (pa[i] - pb[i]) * (pa[i] - pb[i]);
    den += pb[i] * pb[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// Standard normal values rounded to float32, held as float64.
nn::Tensor Randn(const nn::Shape& shape, double scale = 1.0) {
  return nn::mul_scalar(nn::randn(shape), scale).to(nn::kFloat64);
}

struct Results {
  nn::Tensor y, dx, dw, db;
};

Results Conv(const nn::Tensor& x0, const nn::Tensor& w0, const nn::Tensor& dy0,
             const nn::Conv2dParams& p, nn::DType dtype) {
  nn::Tensor x = x0.to(dtype).detach(), w = w0.to(dtype).detach();
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  nn::Tensor y = nn::conv2d(x, w, nn::Tensor(), p);
  nn::sum(nn::mul(y, dy0.to(dtype))).backward();
  return {y.detach(), x.grad(), w.grad(), {}};
}

Results Bn(const nn::Tensor& x0, const nn::Tensor& g0, const nn::Tensor& b0,
           const nn::Tensor& dy0, nn::DType dtype) {
  nn::Tensor x = x0.to(dtype).detach(), g = g0.to(dtype).detach(), b = b0.to(dtype).detach();
  x.set_requires_grad(true);
  g.set_requires_grad(true);
  b.set_requires_grad(true);
  nn::Tensor y = nn::batch_norm2d(x, g, b, nn::Tensor(), nn::Tensor(), /*training=*/true, 0.1, 1e-5);
  nn::sum(nn::mul(y, dy0.to(dtype))).backward();
  return {y.detach(), x.grad(), g.grad(), b.grad()};
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 32;
  nn::set_cpu_blas_threads(1);
  nn::manual_seed(14);
  // (in, out, kernel, stride, groups, H): every conv of MobileNetV2 at 32x32.
  using Geo = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
  std::vector<Geo> convs;
  convs.emplace_back(3, 32, 3, 2, 1, 32);
  int64_t in = 32, h = 16;
  const int64_t stages[7][4] = {{1, 16, 1, 1}, {6, 24, 2, 2},  {6, 32, 3, 2}, {6, 64, 4, 2},
                                {6, 96, 3, 1}, {6, 160, 3, 2}, {6, 320, 1, 1}};
  for (const auto& st : stages) {
    for (int64_t i = 0; i < st[2]; ++i) {
      const int64_t s = i == 0 ? st[3] : 1, hidden = in * st[0];
      if (st[0] != 1) convs.emplace_back(in, hidden, 1, 1, 1, h);
      convs.emplace_back(hidden, hidden, 3, s, hidden, h);
      h = (h + 2 - 3) / s + 1;
      convs.emplace_back(hidden, st[1], 1, 1, 1, h);
      in = st[1];
    }
  }
  convs.emplace_back(in, 1280, 1, 1, 1, h);
  std::set<Geo> seen;
  std::printf("conv (N=%lld) in out k stride groups H | rel L2 err float32 vs float64: y dx dw\n",
              static_cast<long long>(n));
  std::set<std::tuple<int64_t, int64_t>> bn_shapes;  // (C, H after the conv)
  for (const Geo& geo : convs) {
    if (!seen.insert(geo).second) continue;
    const auto [c, o, k, s, groups, hh] = geo;
    const int64_t pad = (k - 1) / 2, oh = (hh + 2 * pad - k) / s + 1;
    bn_shapes.emplace(o, oh);
    nn::Conv2dParams p{.stride = {s, s}, .padding = {pad, pad}, .groups = groups};
    nn::Tensor x = Randn({n, c, hh, hh});
    nn::Tensor w = Randn({o, c / groups, k, k}, std::sqrt(2.0 / static_cast<double>(o * k * k)));
    nn::Tensor dy = Randn({n, o, oh, oh});
    Results r32 = Conv(x, w, dy, p, nn::kFloat32), r64 = Conv(x, w, dy, p, nn::kFloat64);
    std::printf("conv %4lld %4lld %lld %lld %4lld %2lld | %.2e %.2e %.2e\n",
                static_cast<long long>(c), static_cast<long long>(o), static_cast<long long>(k),
                static_cast<long long>(s), static_cast<long long>(groups),
                static_cast<long long>(hh), RelErr(r32.y, r64.y), RelErr(r32.dx, r64.dx),
                RelErr(r32.dw, r64.dw));
  }
  std::printf("batch_norm2d train (N=%lld) C H | rel L2 err float32 vs float64: y dx dweight dbias\n",
              static_cast<long long>(n));
  for (const auto& [c, hh] : bn_shapes) {
    // Inputs with a non-zero mean and a spread like a conv output's.
    nn::Tensor x = nn::add(Randn({n, c, hh, hh}, 0.5), Randn({1, c, 1, 1}, 0.3));
    nn::Tensor g = nn::add_scalar(Randn({c}, 0.1), 1.0), b = Randn({c}, 0.1);
    nn::Tensor dy = Randn({n, c, hh, hh}, 1e-3);
    x = x.to(nn::kFloat32).to(nn::kFloat64);
    g = g.to(nn::kFloat32).to(nn::kFloat64);
    Results r32 = Bn(x, g, b, dy, nn::kFloat32), r64 = Bn(x, g, b, dy, nn::kFloat64);
    std::printf("bn %4lld %2lld | %.2e %.2e %.2e %.2e\n", static_cast<long long>(c),
                static_cast<long long>(hh), RelErr(r32.y, r64.y), RelErr(r32.dx, r64.dx),
                RelErr(r32.dw, r64.dw), RelErr(r32.db, r64.db));
  }
  return 0;
}
