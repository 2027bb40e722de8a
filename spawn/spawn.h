// The one header a training program includes: dist::spawn and its options
// (spawn/launch.h), dist::Context, the communicators (spawn/comm/), and
// dist::DataParallel and dist::SyncBatchNorm2d (spawn/train/). A facade: the launcher's
// own sources include spawn/launch.h, never this, so that no layer includes
// the one above it (train -> observe -> launch -> comm -> nn).
#ifndef TANDEM_SPAWN_SPAWN_H_
#define TANDEM_SPAWN_SPAWN_H_

#include "spawn/comm/communicator.h"
#include "spawn/context.h"
#include "spawn/launch.h"
#include "spawn/train/data_parallel.h"
#include "spawn/train/sync_batch_norm.h"

#endif  // TANDEM_SPAWN_SPAWN_H_
