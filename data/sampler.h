// Samplers: the order in which a DataLoader visits a dataset, batch by batch.
//
// A BatchSampler yields the index lists of one pass ("epoch"). reset() starts a
// pass: the next epoch, unless set_epoch()/set_state() chose one since the last
// pass. get_state()/set_state() save and restore (epoch, position) for
// checkpoints: position counts the batches already yielded in that epoch.
//
// Thread-safety: none; one thread (the DataLoader's caller) drives a sampler.
#ifndef TANDEM_DATA_SAMPLER_H_
#define TANDEM_DATA_SAMPLER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace tandem::data {

// Sample order of one epoch.
class Sampler {
 public:
  virtual ~Sampler() = default;
  virtual int64_t size() const = 0;
  // A permutation of [0, size()) for `epoch` (the same epoch gives the same order).
  virtual std::vector<int64_t> Order(int64_t epoch) const = 0;
};

// 0, 1, ..., size-1 every epoch.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t size);
  int64_t size() const override { return size_; }
  std::vector<int64_t> Order(int64_t epoch) const override;

 private:
  int64_t size_;
};

// A uniformly random permutation drawn from (seed, epoch) with Philox: the same
// seed and epoch give the same permutation in every process and on every rank.
class RandomSampler : public Sampler {
 public:
  RandomSampler(int64_t size, uint64_t seed);
  int64_t size() const override { return size_; }
  std::vector<int64_t> Order(int64_t epoch) const override;

 private:
  int64_t size_;
  uint64_t seed_;
};

// The permutation RandomSampler(size, seed) gives for `epoch` (Fisher-Yates).
std::vector<int64_t> RandomPermutation(int64_t size, uint64_t seed, int64_t epoch);

struct SamplerState {
  int64_t epoch = 0;
  int64_t position = 0;  // batches already yielded in `epoch`
};

class BatchSampler {
 public:
  virtual ~BatchSampler() = default;
  // Starts a pass (see the file comment).
  virtual void reset() = 0;
  // The next batch of the current pass, or nullopt at its end. Starts the first
  // pass if reset() was never called.
  virtual std::optional<std::vector<int64_t>> next() = 0;
  // Batches in one pass.
  virtual int64_t num_batches() const = 0;
  virtual void set_epoch(int64_t epoch) = 0;
  virtual SamplerState get_state() const = 0;
  // Resumes: the next reset() continues `state.epoch` at `state.position`.
  virtual void set_state(const SamplerState& state) = 0;
};

// Common epoch bookkeeping: subclasses provide Batch(epoch, k) and num_batches().
class EpochBatchSampler : public BatchSampler {
 public:
  void reset() override;
  std::optional<std::vector<int64_t>> next() override;
  void set_epoch(int64_t epoch) override;
  SamplerState get_state() const override { return {epoch_, position_}; }
  void set_state(const SamplerState& state) override;

 protected:
  // Called when a pass starts (e.g. to draw the epoch's permutation).
  virtual void BeginEpoch(int64_t epoch) = 0;
  // Batch k of the current epoch, k in [0, num_batches()).
  virtual std::vector<int64_t> Batch(int64_t k) const = 0;

 private:
  void Begin();
  int64_t epoch_ = 0;
  int64_t position_ = 0;
  bool pending_ = true;  // the next reset() keeps epoch_ and position_
  bool started_ = false;
};

// Groups a Sampler's order into batches of `batch_size`; the last one is smaller
// unless drop_last drops it.
class SimpleBatchSampler : public EpochBatchSampler {
 public:
  SimpleBatchSampler(std::shared_ptr<const Sampler> sampler, int64_t batch_size, bool drop_last);
  int64_t num_batches() const override;

 protected:
  void BeginEpoch(int64_t epoch) override;
  std::vector<int64_t> Batch(int64_t k) const override;

 private:
  std::shared_ptr<const Sampler> sampler_;
  int64_t batch_size_;
  bool drop_last_;
  std::vector<int64_t> order_;
};

// How a DistributedBatchSampler ends an epoch whose samples do not fill the last
// global batch of G samples (N replicas, G = N*B for a per-rank batch B, or
// DistributedOptions::global_batch_size; n samples). Every rule gives the same
// full global batches before the tail; they differ in the tail.
enum class DistributedTail {
  // The last partial global batch is filled by wrapping around the epoch's order
  // (up to G-1 repeated samples), so every rank gets its full share in every batch
  // and N ranks see exactly what one rank with batch G sees. drop_last drops the
  // partial global batch.
  kWrapGlobalBatch,
  // paddle.io.DistributedBatchSampler's indices: the order is padded by wrapping to
  // ceil(n/N)*N (at most N-1 repeats), full global batches are sliced
  // contiguously, and the remainder (a multiple of N) is split evenly: every rank
  // gets the same number of samples and of batches, the last batch smaller than B.
  // drop_last drops each rank's partial batch. Without shuffle the indices are
  // exactly Paddle's; with shuffle the padded order is permuted by tandem's own
  // (seed, epoch) permutation where Paddle uses numpy's (same structure, other
  // draws). Needs one batch size for every rank: a global_batch_size that N does
  // not divide is refused.
  kPaddle,
  // Every sample exactly once: the last partial global batch of L samples is split
  // evenly and contiguously (ranks r < L mod N get one sample more), so ranks may get fewer
  // samples, and a rank whose share is empty one batch fewer. For evaluation, and
  // for training under DataParallel::join(). drop_last is refused (it would drop
  // samples).
  kUneven,
};
const char* DistributedTailName(DistributedTail tail);  // "wrap_global_batch", ...

struct DistributedOptions {
  int64_t dataset_size = 0;
  // Per rank. 0: from global_batch_size (one of the two must be set).
  int64_t batch_size = 0;
  // Samples per step over every rank, G. 0: batch_size * num_replicas. Set, each
  // rank takes G / N samples a step, ranks r < G mod N one more (64 over 3
  // ranks: 22, 21, 21), so a world that does not divide G keeps it. batch_size
  // must then be 0 or G / N with N dividing G. G < N (a rank with no sample) is
  // refused.
  int64_t global_batch_size = 0;
  int num_replicas = 1;
  int rank = 0;
  bool shuffle = true;
  bool drop_last = false;
  uint64_t seed = 0;
  DistributedTail tail = DistributedTail::kWrapGlobalBatch;
};

// This rank's batches of a data-parallel epoch.
//
// Contract: every rank draws the same (seed, epoch) permutation (identity
// without shuffle). Global batch g holds permutation positions [g*G, (g+1)*G)
// (G = B*N for per-rank batch B and N replicas, or global_batch_size); rank r
// takes the contiguous slice of its share s_r = G/N + (r < G mod N ? 1 : 0)
// samples starting at g*G + sum_{q<r} s_q. So N ranks see exactly the samples
// one rank with batch G sees, in the same order, whatever N is: a world that
// shrinks with the same G and seed, restored at the same (epoch, position),
// trains on the same samples per step. Uneven shares (N not dividing G) want
// their gradients weighed by rows (DataParallelOptions::global_batch_size, or
// DataParallel::join()). The last partial global batch follows options.tail
// (above); by default it is padded by wrapping around the permutation (so every
// rank gets its share), or dropped with drop_last, and a dataset smaller than
// G, or than N, still yields one full (wrapped) global batch unless drop_last.
// num_batches() is the same on every rank except under kUneven.
class DistributedBatchSampler : public EpochBatchSampler {
 public:
  // Throws tandem::Error on a bad rank, size, batch size or global batch size
  // (naming the values), on kUneven with drop_last and on kPaddle with a global
  // batch that N does not divide.
  explicit DistributedBatchSampler(const DistributedOptions& options);
  DistributedBatchSampler(int64_t dataset_size, int64_t batch_size, int num_replicas, int rank,
                          bool shuffle = true, bool drop_last = false, uint64_t seed = 0);
  int64_t num_batches() const override;

 protected:
  void BeginEpoch(int64_t epoch) override;
  std::vector<int64_t> Batch(int64_t k) const override;

 private:
  // kPaddle / kUneven: this rank's positions in the epoch's order and where each
  // batch starts in them (the same every epoch).
  void PlanTail();

  DistributedOptions options_;
  int64_t global_ = 0;  // G
  int64_t share_ = 0;   // s_r: this rank's samples in a full global batch
  int64_t offset_ = 0;  // where they start in it
  std::vector<int64_t> order_;
  std::vector<int64_t> positions_;      // kPaddle, kUneven
  std::vector<int64_t> batch_starts_;   // kPaddle, kUneven: + positions_.size() at the end
};

}  // namespace tandem::data

#endif  // TANDEM_DATA_SAMPLER_H_
