// tandem::testing: testing training functions in-process (target
// tandem::testing; docs/testing.md). One header for all of it:
//   testing/run.h               Run: N in-process ranks, StepLog, RunReport
//   testing/equivalence.h       CheckEquivalence: N ranks against one
//   testing/faults.h            faults at a rank and step or collective
//   testing/fake_communicator.h collectives that complete late or never
//   testing/seed.h              deterministic seeds
// GoogleTest assertions: testing/gtest/assertions.h (target tandem::testing_gtest).
#ifndef TANDEM_TESTING_TESTING_H_
#define TANDEM_TESTING_TESTING_H_

#include "testing/equivalence.h"
#include "testing/fake_communicator.h"
#include "testing/faults.h"
#include "testing/run.h"
#include "testing/seed.h"

#endif  // TANDEM_TESTING_TESTING_H_
