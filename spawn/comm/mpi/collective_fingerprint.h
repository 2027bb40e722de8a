// What one cross-process collective is, as two 63-bit words (internal to
// spawn/), so that the processes can compare their collectives inside the step
// agreement's rounds (spawn/internal/process_world.h, ControlPlane) without a
// message of their own per collective.
//
// `shape` packs, low to high: root (32 bits: a broadcast's global root; 0 for the
// other ops), dtype (4), reduction (2: 0 for ops that do not reduce), op (3).
// `numel` is each rank's element count, whole (0 for a barrier): two collectives
// that differ in any count a tensor can have differ in it. Neither word is ever
// negative, so -word and INT64_MIN ("none") fit the rounds' MAX; on the wire a
// fingerprint is its kWords words, shape first.
//
// A collective's label (Communicator::Label) is no part of its fingerprint
// (labels are never compared); where the processes' collectives differ, each
// process sends its own side's label as text (PackLabel, kLabelWords words) so
// that every process's message names every labelled side.
// Pure functions: no thread, no MPI.
#ifndef TANDEM_SPAWN_COMM_MPI_COLLECTIVE_FINGERPRINT_H_
#define TANDEM_SPAWN_COMM_MPI_COLLECTIVE_FINGERPRINT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nn/dtype.h"
#include "spawn/comm/communicator.h"

namespace tandem::dist::internal {

struct CollectiveShape {
  const char* op = "";  // "all_reduce", "reduce_scatter", "broadcast", "all_gather", "barrier"
  ReduceOp reduce = ReduceOp::kSum;  // all_reduce, reduce_scatter
  int root = 0;                      // broadcast: global rank
  nn::DType dtype = nn::DType::kFloat32;
  int64_t numel = 0;                 // each rank's input; 0 for barrier
};

struct Fingerprint {
  static constexpr int kWords = 2;
  static constexpr int64_t kNone = INT64_MIN;  // both words: not known
  int64_t shape = kNone;
  int64_t numel = kNone;
  bool known() const { return shape != kNone; }
  friend bool operator==(const Fingerprint&, const Fingerprint&) = default;
};

// Throws tandem::Error for an op the hierarchical exchange does not run, a
// negative element count or a negative broadcast root.
Fingerprint PackFingerprint(const CollectiveShape& shape);
// "all_reduce #4 (1530 float32, sum)", "broadcast #2 (64 float32, root 1)",
// "barrier #7"; an unknown op or dtype reads "op?" / "dtype?".
std::string DescribeFingerprint(const Fingerprint& fingerprint, uint64_t sequence);

// A label as kLabelWords words for a MAX all-reduce: 7 bytes a word in its low
// 56 bits (never negative, so a process's words win over the INT64_MIN that the
// others put in its slots), zero bytes after the text. At most kLabelBytes bytes
// travel: a longer label is cut (between UTF-8 characters) and ends in "...".
// Null or "": every word INT64_MIN (no label).
inline constexpr int kLabelWords = 32;
inline constexpr int kLabelBytes = 7 * kLabelWords;
void PackLabel(const char* label, int64_t* words);
// The text PackLabel packed into `words`; "" for no label (words INT64_MIN).
std::string UnpackLabel(const int64_t* words);

// fingerprints: every process's fingerprint of collective `sequence`, in process
// order (not known(): left out). "" when the known ones agree, else
// "collective mismatch across processes: <name(0)> called all_reduce #4 (...)
// while <name(1)> called all_gather #4 (...)[, <name(p)> called ...] (op, size,
// ...)": the first process against the first that differs, then every further
// process that differs from the first. labels: each process's label of that
// collective ("": none; empty vector: none known), named after its side
// ("... called all_reduce #4 (1 float64, sum) from hapi::Model::save (...)").
std::string CollectiveMismatch(const std::vector<Fingerprint>& fingerprints, uint64_t sequence,
                               const std::function<std::string(int process)>& name,
                               const std::vector<std::string>& labels = {});

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_MPI_COLLECTIVE_FINGERPRINT_H_
