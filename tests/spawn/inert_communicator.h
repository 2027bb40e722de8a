// A communicator whose collectives do nothing (on the CPU, `world_size` ranks):
// the base of the spawn tests' fakes, which override only what they test
// (PollAsyncError, ReleaseGraphs, one collective).
#ifndef TANDEM_TESTS_SPAWN_INERT_COMMUNICATOR_H_
#define TANDEM_TESTS_SPAWN_INERT_COMMUNICATOR_H_

#include <string>

#include "nn/device.h"
#include "nn/tensor.h"
#include "spawn/comm/communicator.h"

namespace tandem::testing {

class InertCommunicator : public dist::Communicator {
 public:
  InertCommunicator(int rank, int world_size) : Communicator(rank, world_size, nn::Device::CPU()) {}
  std::string kind() const override { return "inert"; }

 protected:
  void AllReduceImpl(nn::Tensor&, dist::ReduceOp) override {}
  void BroadcastImpl(nn::Tensor&, int) override {}
  void AllGatherImpl(const nn::Tensor&, nn::Tensor&) override {}
  void ReduceScatterImpl(const nn::Tensor&, nn::Tensor&, dist::ReduceOp) override {}
  void BarrierImpl() override {}
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_SPAWN_INERT_COMMUNICATOR_H_
