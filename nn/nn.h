// Everything of tandem::nn in one include: tensors, autograd, ops, modules,
// layers and losses.
#ifndef TANDEM_NN_NN_H_
#define TANDEM_NN_NN_H_

#include "nn/autocast.h"
#include "nn/autograd.h"
#include "nn/device.h"
#include "nn/dtype.h"
#include "nn/error.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/ops/batch_norm.h"
#include "nn/ops/conv.h"
#include "nn/ops/dropout.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/index.h"
#include "nn/ops/join.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/ops/pool.h"
#include "nn/ops/reduce.h"
#include "nn/ops/softmax.h"
#include "nn/random.h"
#include "nn/tensor.h"

#endif  // TANDEM_NN_NN_H_
