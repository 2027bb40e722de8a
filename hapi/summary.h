// hapi::Summary: a model's layers as a table (PyTorch's torchinfo.summary,
// Paddle's paddle.summary): each layer called by one forward, in call order, with
// its module path, type, output shape and parameter count, then the parameter
// totals and their bytes.
//
//   auto s = hapi::Summary(*net, {1, 1, 28, 28});   // (N, C, H, W), batch first
//   if (s.ok()) std::cout << s->table;              // s->total_params: 20350 for LeNet
//
// The forward runs once, on the model's device (that of its first parameter or
// buffer, else nn::current_device()), on zeros of the first parameter's dtype
// (float32 without one), in evaluation mode and without gradients, and leaves
// the model as it was: every module's training flag is put back, BatchNorm's
// running statistics are not updated (evaluation mode) and the calling thread's
// generator is put back (Dropout is the identity in evaluation mode anyway).
//
// Output shapes come from nn::ForwardRecorder (nn/module.h): a layer is listed
// when it is called through its holder or Module::operator() (every layer of
// nn::Sequential and of models written as the README's are); a child whose
// forward() is called directly is not listed, though its parameters count in the
// totals. The root module is not a row; its output is `output_shape`. A call that
// threw and was caught by its caller (a layer trying one child, then another) is
// not a row either.
//
// Thread-safety: call it on the thread that owns the model (a rank's thread, or
// main for a model on the CPU), as any forward.
#ifndef TANDEM_HAPI_SUMMARY_H_
#define TANDEM_HAPI_SUMMARY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nn/module.h"
#include "nn/tensor.h"

namespace tandem::hapi {

struct SummaryLayer {
  std::string name;  // dotted path from the root ("features.0"; "(unregistered)" when none)
  std::string type;  // C++ class without namespaces and "Impl" ("Conv2d", "BasicBlock")
  int depth = 0;     // 1 for the root's children, 2 for theirs, ...
  nn::Shape output_shape;
  // Parameters of the layer and of its descendants (each tensor once). The
  // table prints "--" for a layer with children: their rows carry the counts.
  int64_t params = 0;
  bool has_children = false;
};

struct ModelSummary {
  std::vector<SummaryLayer> layers;  // in the order their forward began (calls that ended)
  nn::Shape input_shape;
  nn::Shape output_shape;            // the root's output
  // Module::parameters() (a shared tensor once): trainable ones require grad.
  int64_t total_params = 0, trainable_params = 0, non_trainable_params = 0;
  int64_t total_param_bytes = 0, trainable_param_bytes = 0, non_trainable_param_bytes = 0;
  // Module::buffers() (BatchNorm's running statistics): not parameters.
  int64_t buffer_elements = 0, buffer_bytes = 0;
  std::string table;                 // the rows and totals, as printed; ends with '\n'
};

// The summary of `network` for an input of `input_shape` (batch first).
// InvalidArgument, naming the value: an empty shape or a dimension that is not
// positive; a forward that throws (the shape does not fit the model), naming the
// innermost layer then running and with its message. The model is left as it was in every case.
absl::StatusOr<ModelSummary> Summary(nn::Module& network, const nn::Shape& input_shape);

}  // namespace tandem::hapi

#endif  // TANDEM_HAPI_SUMMARY_H_
