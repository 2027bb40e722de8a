#include "nn/autocast.h"

#include "nn/error.h"

namespace tandem::nn {
namespace {
thread_local DType t_autocast_dtype = kFloat32;
}  // namespace

AutocastGuard::AutocastGuard(DType dtype) : previous_(t_autocast_dtype) {
  TANDEM_CHECK(dtype == kBFloat16 || dtype == kFloat32, "AutocastGuard: dtype ",
               DTypeName(dtype), " is not supported (bfloat16 turns autocast on, float32 off)");
  t_autocast_dtype = dtype;
}

AutocastGuard::~AutocastGuard() { t_autocast_dtype = previous_; }

bool autocast_enabled() { return t_autocast_dtype == kBFloat16; }

}  // namespace tandem::nn
