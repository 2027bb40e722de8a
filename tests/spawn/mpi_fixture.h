// What the tests run under mpirun share: how many processes the launcher
// started, this process's index, and a fixture that skips without mpirun -np >= 2
// and makes spawn options for the job (Options) and for this process alone (Local).
#ifndef TANDEM_TESTS_SPAWN_MPI_FIXTURE_H_
#define TANDEM_TESTS_SPAWN_MPI_FIXTURE_H_

#include <cstdlib>
#include <sstream>

#include "gtest/gtest.h"
#include "spawn/spawn.h"

namespace tandem::testing {

// OpenMPI's launcher variables; 1 process, index 0 without them.
inline int LaunchedProcesses() {
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  return size != nullptr ? std::atoi(size) : 1;
}
inline int LaunchedIndex() {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  return rank != nullptr ? std::atoi(rank) : 0;
}

class MpiFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    if (LaunchedProcesses() < 2) GTEST_SKIP() << "not started by mpirun with -np >= 2";
  }
  // One job across the launched processes.
  dist::SpawnOptions Options() { return {.timeout_s = 60, .seed = 7, .console = &console_}; }
  // This process on its own (the reference runs).
  dist::SpawnOptions Local() {
    dist::SpawnOptions o = Options();
    o.processes = dist::Processes::kOff;
    return o;
  }
  std::ostringstream console_;
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_SPAWN_MPI_FIXTURE_H_
