#include "nn/random.h"

namespace tandem::nn {

Generator& thread_generator() {
  thread_local Generator generator;
  return generator;
}

void manual_seed(uint64_t seed, uint64_t stream) {
  thread_generator() = Generator{seed, stream, 0};
}

}  // namespace tandem::nn
