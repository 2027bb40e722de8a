// Small helpers shared by the test files.
#ifndef TANDEM_TESTS_TEST_UTIL_H_
#define TANDEM_TESTS_TEST_UTIL_H_

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/autograd.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/random.h"
#include "nn/tensor.h"

namespace tandem::testing {

// Seconds of the steady clock since `start`.
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The message of the exception `f` throws, or "" when it throws none.
inline std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Bitwise equality of two float vectors (NaN-safe, -0 != +0); `what` names them.
inline void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                           const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    ASSERT_EQ(x, y) << what << " element " << i << ": " << a[i] << " vs " << b[i];
  }
}

// Removes `dir` and what it holds when the process that called this exits (not
// in a forked child that exits), unless TANDEM_KEEP_TEST_DIRS is set (to look at
// a failed test's files).
inline void RemoveAtExit(const std::string& dir) {
  static std::mutex mu;
  static auto* dirs = new std::vector<std::string>;
  static const pid_t owner = ::getpid();
  static const bool registered = [] {
    std::atexit([] {
      if (::getpid() != owner || ::getenv("TANDEM_KEEP_TEST_DIRS") != nullptr) return;
      std::lock_guard<std::mutex> lock(mu);
      for (const std::string& d : *dirs) {
        std::error_code ignored;
        std::filesystem::remove_all(d, ignored);
      }
    });
    return true;
  }();
  (void)registered;
  std::lock_guard<std::mutex> lock(mu);
  dirs->push_back(dir);
}

// A new empty directory under the system's temporary directory, named
// <prefix>_XXXXXX (mkdtemp), removed when the test process exits (RemoveAtExit).
inline std::string MakeTempDir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
  EXPECT_NE(::mkdtemp(tmpl.data()), nullptr) << tmpl;
  RemoveAtExit(tmpl);
  return tmpl;
}

// How many autograd nodes named `op` produced `t` (each node counted once): which
// ops (fused or not) a forward recorded.
inline int CountOps(const nn::Tensor& t, const std::string& op) {
  int count = 0;
  std::vector<std::shared_ptr<nn::autograd::Node>> stack{t.grad_fn()};
  std::vector<const nn::autograd::Node*> seen;
  while (!stack.empty()) {
    std::shared_ptr<nn::autograd::Node> node = std::move(stack.back());
    stack.pop_back();
    if (!node || std::find(seen.begin(), seen.end(), node.get()) != seen.end()) continue;
    seen.push_back(node.get());
    count += node->name() == op;
    for (const auto& next : node->next_edges()) stack.push_back(next);
  }
  return count;
}

// `net` run on x as a whole (its forward, with Sequential's fused ops) and child
// by child (no fusion), each followed by backward from one random output
// gradient: the outputs and every parameter's gradient, for tests that compare
// the two runs bit for bit and check which ops each recorded.
struct WholeAndOneByOne {
  nn::Tensor whole, one_by_one;  // the outputs (their graphs name the ops)
  std::vector<std::vector<float>> whole_grads, one_by_one_grads;  // per parameter
};
inline WholeAndOneByOne RunWholeAndOneByOne(nn::Sequential& net, const nn::Tensor& x) {
  WholeAndOneByOne r;
  auto grads = [&net] {
    std::vector<std::vector<float>> g;
    for (const nn::Tensor& p : net->parameters()) g.push_back(p.grad().to_vector<float>());
    net->zero_grad();
    return g;
  };
  r.whole = net->forward(x);
  const nn::Tensor dy = nn::randn(r.whole.shape());
  r.whole.backward(dy);
  r.whole_grads = grads();
  r.one_by_one = x;
  for (int64_t i = 0; i < net->size(); ++i) r.one_by_one = (*net)[i]->forward(r.one_by_one);
  r.one_by_one.backward(dy);
  r.one_by_one_grads = grads();
  return r;
}

// Every parameter of `m`, in parameters() order, flattened into one float vector.
inline std::vector<float> FlatParams(const nn::Module& m) {
  std::vector<float> out;
  for (const nn::Tensor& p : m.parameters()) {
    for (float v : p.to_vector<float>()) out.push_back(v);
  }
  return out;
}

// max |a - b| / max |b| over the elements (max |a - b| where b is all zeros), in
// float64: a distance relative to the reference's scale.
inline double ScaledError(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double err = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    err = std::max(err, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return scale > 0 ? err / scale : err;
}

inline double ScaledError(const std::vector<float>& a, const std::vector<float>& b) {
  return ScaledError(std::vector<double>(a.begin(), a.end()),
                     std::vector<double>(b.begin(), b.end()));
}

// The same for tensors of any device and dtype, compared on the host.
inline double ScaledError(const nn::Tensor& a, const nn::Tensor& b) {
  return ScaledError(a.detach().to(nn::Device::CPU()).to(nn::kFloat64).to_vector<double>(),
                     b.detach().to(nn::Device::CPU()).to(nn::kFloat64).to_vector<double>());
}

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TEST_UTIL_H_
