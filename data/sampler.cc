#include "data/sampler.h"

#include <algorithm>
#include <numeric>
#include <tuple>
#include <utility>

#include "nn/error.h"
#include "nn/random.h"

namespace tandem::data {

SequentialSampler::SequentialSampler(int64_t size) : size_(size) {
  TANDEM_CHECK(size >= 0, "SequentialSampler: negative size ", size);
}

std::vector<int64_t> SequentialSampler::Order(int64_t) const {
  std::vector<int64_t> order(size_);
  std::iota(order.begin(), order.end(), 0);
  return order;
}

std::vector<int64_t> RandomPermutation(int64_t size, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(size);
  std::iota(order.begin(), order.end(), 0);
  // Fisher-Yates; draw i uses Philox counter i on stream `epoch`. A 64-bit draw
  // modulo (i + 1) has a bias below 2^-30 for any realistic dataset size.
  for (int64_t i = size - 1; i > 0; --i) {
    const nn::Philox4x32 bits = nn::PhiloxAt(seed, static_cast<uint64_t>(epoch), 0, static_cast<uint64_t>(i));
    const uint64_t draw = (static_cast<uint64_t>(bits.out[0]) << 32) | bits.out[1];
    std::swap(order[i], order[draw % static_cast<uint64_t>(i + 1)]);
  }
  return order;
}

RandomSampler::RandomSampler(int64_t size, uint64_t seed) : size_(size), seed_(seed) {
  TANDEM_CHECK(size >= 0, "RandomSampler: negative size ", size);
}

std::vector<int64_t> RandomSampler::Order(int64_t epoch) const {
  return RandomPermutation(size_, seed_, epoch);
}

// --- EpochBatchSampler -----------------------------------------------------------------------
void EpochBatchSampler::Begin() {
  if (!pending_) {
    ++epoch_;
    position_ = 0;
  }
  pending_ = false;
  started_ = true;
  BeginEpoch(epoch_);
}

void EpochBatchSampler::reset() { Begin(); }

std::optional<std::vector<int64_t>> EpochBatchSampler::next() {
  if (!started_) Begin();
  if (position_ >= num_batches()) return std::nullopt;
  return Batch(position_++);
}

void EpochBatchSampler::set_epoch(int64_t epoch) {
  TANDEM_CHECK(epoch >= 0, "set_epoch: negative epoch ", epoch);
  set_state({epoch, 0});
}

void EpochBatchSampler::set_state(const SamplerState& state) {
  TANDEM_CHECK(state.epoch >= 0 && state.position >= 0 && state.position <= num_batches(),
               "set_state: epoch ", state.epoch, " position ", state.position, " outside 0..",
               num_batches());
  epoch_ = state.epoch;
  position_ = state.position;
  pending_ = true;
  started_ = false;
}

// --- SimpleBatchSampler ------------------------------------------------------------------------
SimpleBatchSampler::SimpleBatchSampler(std::shared_ptr<const Sampler> sampler, int64_t batch_size,
                                       bool drop_last)
    : sampler_(std::move(sampler)), batch_size_(batch_size), drop_last_(drop_last) {
  TANDEM_CHECK(sampler_ != nullptr, "BatchSampler: null sampler");
  TANDEM_CHECK(batch_size > 0, "BatchSampler: batch size ", batch_size, " must be positive");
}

int64_t SimpleBatchSampler::num_batches() const {
  const int64_t n = sampler_->size();
  return drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
}

void SimpleBatchSampler::BeginEpoch(int64_t epoch) { order_ = sampler_->Order(epoch); }

std::vector<int64_t> SimpleBatchSampler::Batch(int64_t k) const {
  const int64_t begin = k * batch_size_;
  const int64_t end = std::min<int64_t>(begin + batch_size_, static_cast<int64_t>(order_.size()));
  return std::vector<int64_t>(order_.begin() + begin, order_.begin() + end);
}

// --- DistributedBatchSampler ---------------------------------------------------------------------
const char* DistributedTailName(DistributedTail tail) {
  switch (tail) {
    case DistributedTail::kWrapGlobalBatch: return "wrap_global_batch";
    case DistributedTail::kPaddle: return "paddle";
    case DistributedTail::kUneven: return "uneven";
  }
  return "unknown";
}

namespace {

// `total` samples split contiguously over `replicas` ranks, the first
// total mod replicas ranks one more: where rank `rank`'s part starts, and its size.
std::pair<int64_t, int64_t> EvenSplit(int64_t total, int64_t replicas, int64_t rank) {
  const int64_t each = total / replicas, extra = total % replicas;
  return {rank * each + std::min(rank, extra), each + (rank < extra ? 1 : 0)};
}

}  // namespace

DistributedBatchSampler::DistributedBatchSampler(const DistributedOptions& options)
    : options_(options) {
  const int64_t n = options.dataset_size;
  const int64_t b = options.batch_size;
  const int64_t g = options.global_batch_size;
  const int64_t replicas = options.num_replicas;
  TANDEM_CHECK(n >= 0, "DistributedBatchSampler: negative dataset size ", n);
  TANDEM_CHECK(options.num_replicas > 0, "DistributedBatchSampler: num_replicas ",
               options.num_replicas, ": must be at least 1");
  TANDEM_CHECK(options.rank >= 0 && options.rank < options.num_replicas,
               "DistributedBatchSampler: rank ", options.rank, " outside 0..",
               options.num_replicas - 1);
  TANDEM_CHECK(b >= 0 && g >= 0 && (b > 0 || g > 0), "DistributedBatchSampler: batch size ", b,
               " and global batch size ", g,
               ": one must be positive (the other 0, or consistent with it)");
  TANDEM_CHECK(g == 0 || g >= replicas, "DistributedBatchSampler: global batch size ", g,
               " is smaller than the ", replicas, " replicas (a rank would get no sample)");
  TANDEM_CHECK(g == 0 || b == 0 || b * replicas == g, "DistributedBatchSampler: batch size ", b,
               " per rank contradicts global batch size ", g, " over ", replicas,
               " replicas (", b, " * ", replicas, " = ", b * replicas,
               "); set batch_size 0 to take the global batch's shares");
  TANDEM_CHECK(!(options.tail == DistributedTail::kUneven && options.drop_last),
               "DistributedBatchSampler: tail 'uneven' yields every sample exactly once and "
               "cannot drop_last (dataset size ", n, ", batch size ", b, ", global batch size ",
               g, ", ", replicas, " replicas)");
  global_ = g > 0 ? g : b * replicas;
  TANDEM_CHECK(!(options.tail == DistributedTail::kPaddle && global_ % replicas != 0),
               "DistributedBatchSampler: tail 'paddle' gives every rank one batch size; global "
               "batch size ", global_, " does not divide by ", replicas, " replicas");
  // Rank r's share of a full global batch and where it starts.
  std::tie(offset_, share_) = EvenSplit(global_, replicas, options.rank);
  if (options.tail != DistributedTail::kWrapGlobalBatch) PlanTail();
}

DistributedBatchSampler::DistributedBatchSampler(int64_t dataset_size, int64_t batch_size,
                                                 int num_replicas, int rank, bool shuffle,
                                                 bool drop_last, uint64_t seed)
    : DistributedBatchSampler(DistributedOptions{.dataset_size = dataset_size,
                                                 .batch_size = batch_size,
                                                 .num_replicas = num_replicas,
                                                 .rank = rank,
                                                 .shuffle = shuffle,
                                                 .drop_last = drop_last,
                                                 .seed = seed}) {}

void DistributedBatchSampler::PlanTail() {
  const int64_t n = options_.dataset_size;
  const int64_t replicas = options_.num_replicas;
  const int64_t rank = options_.rank;
  // kPaddle slices the order padded to ceil(n/N)*N; kUneven the order itself.
  const int64_t total = options_.tail == DistributedTail::kPaddle
                            ? (n + replicas - 1) / replicas * replicas
                            : n;
  const int64_t full = total / global_ * global_;  // positions in full global batches
  for (int64_t g = 0; g < full; g += global_) {
    for (int64_t j = 0; j < share_; ++j) positions_.push_back(g + offset_ + j);
  }
  // The remainder, split evenly: kPaddle's is a multiple of N; kUneven gives the
  // first (rest mod N) ranks one sample more. Either way at most share_.
  const auto [first, count] = EvenSplit(total - full, replicas, rank);
  for (int64_t j = 0; j < count; ++j) positions_.push_back(full + first + j);
  // This rank's positions in batches of its share; the last one partial unless drop_last.
  const int64_t mine = static_cast<int64_t>(positions_.size());
  const int64_t kept = options_.drop_last ? mine / share_ * share_ : mine;
  for (int64_t k = 0; k < kept; k += share_) batch_starts_.push_back(k);
  batch_starts_.push_back(kept);
}

int64_t DistributedBatchSampler::num_batches() const {
  if (options_.tail != DistributedTail::kWrapGlobalBatch) {
    return static_cast<int64_t>(batch_starts_.size()) - 1;
  }
  const int64_t n = options_.dataset_size;
  return options_.drop_last ? n / global_ : (n + global_ - 1) / global_;
}

void DistributedBatchSampler::BeginEpoch(int64_t epoch) {
  const int64_t n = options_.dataset_size;
  if (options_.tail == DistributedTail::kPaddle) {
    // Paddle pads the index list 0..n-1 by wrapping (padded[i] = i mod n), then
    // shuffles the padded list.
    const int64_t total = (n + options_.num_replicas - 1) / options_.num_replicas *
                          options_.num_replicas;
    order_ = options_.shuffle ? RandomPermutation(total, options_.seed, epoch)
                              : std::vector<int64_t>(total);
    if (!options_.shuffle) std::iota(order_.begin(), order_.end(), 0);
    for (int64_t& i : order_) i %= n;
    return;
  }
  if (options_.shuffle) {
    order_ = RandomPermutation(n, options_.seed, epoch);
  } else {
    order_.resize(n);
    std::iota(order_.begin(), order_.end(), 0);
  }
}

std::vector<int64_t> DistributedBatchSampler::Batch(int64_t k) const {
  if (options_.tail != DistributedTail::kWrapGlobalBatch) {
    std::vector<int64_t> batch;
    for (int64_t j = batch_starts_[k]; j < batch_starts_[k + 1]; ++j) {
      batch.push_back(order_[positions_[j]]);
    }
    return batch;
  }
  const int64_t first = k * global_ + offset_;
  const int64_t n = static_cast<int64_t>(order_.size());
  std::vector<int64_t> batch(share_);
  for (int64_t j = 0; j < share_; ++j) batch[j] = order_[(first + j) % n];  // wraps in the last batch
  return batch;
}

}  // namespace tandem::data
