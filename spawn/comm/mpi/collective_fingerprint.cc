#include "spawn/comm/mpi/collective_fingerprint.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "nn/error.h"

namespace tandem::dist::internal {
namespace {

constexpr int kRootBits = 32, kDTypeBits = 4, kReduceBits = 2;
constexpr int kRootShift = 0;
constexpr int kDTypeShift = kRootShift + kRootBits;
constexpr int kReduceShift = kDTypeShift + kDTypeBits;
constexpr int kOpShift = kReduceShift + kReduceBits;

// Index + 1 is the op's code (0: none).
constexpr const char* kOps[] = {"all_reduce", "reduce_scatter", "broadcast", "all_gather",
                                "barrier"};
constexpr int kOpCount = sizeof(kOps) / sizeof(kOps[0]);

int64_t Field(int64_t value, int bits) { return value & ((int64_t{1} << bits) - 1); }

bool Reduces(int op_code) { return op_code == 1 || op_code == 2; }

}  // namespace

Fingerprint PackFingerprint(const CollectiveShape& shape) {
  int op_code = 0;
  for (int i = 0; i < kOpCount; ++i) {
    if (std::strcmp(shape.op, kOps[i]) == 0) op_code = i + 1;
  }
  TANDEM_CHECK(op_code != 0, "collective fingerprint: op \"", shape.op,
               "\" is not a cross-process collective");
  // Fields that would spill into their neighbours: a dtype or reduction added to
  // nn/dtype.h or communicator.h beyond what the bits hold fails here, not quietly.
  TANDEM_CHECK(static_cast<int64_t>(shape.dtype) < (int64_t{1} << kDTypeBits) &&
                   static_cast<int64_t>(shape.reduce) >= 0 &&
                   static_cast<int64_t>(shape.reduce) < (int64_t{1} << kReduceBits),
               "collective fingerprint: dtype ", static_cast<int>(shape.dtype), " or reduction ",
               static_cast<int>(shape.reduce), " does not fit its field");
  const bool barrier = op_code == 5;
  TANDEM_CHECK(barrier || shape.numel >= 0, "collective fingerprint: ", shape.op, " of ",
               shape.numel, " elements (a count is never negative)");
  const int64_t reduce = Reduces(op_code) ? static_cast<int64_t>(shape.reduce) : 0;
  const int64_t root = op_code == 3 ? shape.root : 0;
  TANDEM_CHECK(root >= 0, "collective fingerprint: broadcast root ", root, " is negative");
  return {.shape = (int64_t{op_code} << kOpShift) | (reduce << kReduceShift) |
                   (barrier ? 0 : static_cast<int64_t>(shape.dtype) << kDTypeShift) |
                   (Field(root, kRootBits) << kRootShift),
          .numel = barrier ? 0 : shape.numel};
}

std::string DescribeFingerprint(const Fingerprint& f, uint64_t sequence) {
  const int64_t fingerprint = f.shape;
  const int op_code = static_cast<int>(Field(fingerprint >> kOpShift, 3));
  const std::string op = op_code >= 1 && op_code <= kOpCount ? kOps[op_code - 1] : "op?";
  std::string text = absl::StrCat(op, " #", sequence);
  if (op_code == 5) return text;  // barrier: no data
  const int64_t dtype = Field(fingerprint >> kDTypeShift, kDTypeBits);
  const char* dtype_name = dtype <= static_cast<int64_t>(nn::DType::kFloat16)  // the last dtype
                               ? nn::DTypeName(static_cast<nn::DType>(dtype))
                               : "dtype?";
  absl::StrAppend(&text, " (", f.numel, " ", dtype_name);
  if (Reduces(op_code)) {
    absl::StrAppend(&text, ", ", ReduceOpName(static_cast<ReduceOp>(
                                     Field(fingerprint >> kReduceShift, kReduceBits))));
  }
  if (op_code == 3) absl::StrAppend(&text, ", root ", Field(fingerprint >> kRootShift, kRootBits));
  return text + ")";
}

void PackLabel(const char* label, int64_t* words) {
  std::fill(words, words + kLabelWords, Fingerprint::kNone);
  if (label == nullptr || *label == '\0') return;
  std::string text(label);
  if (text.size() > static_cast<size_t>(kLabelBytes)) {
    // Cut before a UTF-8 character that does not fit whole (back over its
    // continuation bytes, 10xxxxxx, to its lead byte), never inside one.
    size_t cut = kLabelBytes - 3;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xc0) == 0x80) --cut;
    text = text.substr(0, cut) + "...";
  }
  for (int w = 0; w < kLabelWords; ++w) {
    int64_t word = 0;
    for (int b = 0; b < 7; ++b) {
      const size_t at = static_cast<size_t>(7 * w + b);
      const int64_t byte = at < text.size() ? static_cast<unsigned char>(text[at]) : 0;
      word |= byte << (8 * b);
    }
    words[w] = word;
  }
}

std::string UnpackLabel(const int64_t* words) {
  std::string text;
  for (int w = 0; w < kLabelWords; ++w) {
    if (words[w] < 0) return text;  // INT64_MIN: no label
    for (int b = 0; b < 7; ++b) {
      const char byte = static_cast<char>((words[w] >> (8 * b)) & 0xff);
      if (byte == '\0') return text;
      text.push_back(byte);
    }
  }
  return text;
}

std::string CollectiveMismatch(const std::vector<Fingerprint>& fingerprints, uint64_t sequence,
                               const std::function<std::string(int process)>& name,
                               const std::vector<std::string>& labels) {
  const int processes = static_cast<int>(fingerprints.size());
  int first = -1, other = -1;
  for (int p = 0; p < processes; ++p) {
    if (!fingerprints[p].known()) continue;
    if (first < 0) {
      first = p;
    } else if (fingerprints[p] != fingerprints[first] && other < 0) {
      other = p;
    }
  }
  if (other < 0) return "";
  auto side = [&](int p) {
    const bool labelled = p < static_cast<int>(labels.size());
    return absl::StrCat(name(p), " called ", DescribeFingerprint(fingerprints[p], sequence),
                        FromLabel(labelled ? labels[p].c_str() : nullptr));
  };
  std::string message = absl::StrCat("collective mismatch across processes: ", side(first),
                                     " while ", side(other));
  for (int p = other + 1; p < processes; ++p) {
    if (fingerprints[p].known() && fingerprints[p] != fingerprints[first]) {
      absl::StrAppend(&message, ", ", side(p));
    }
  }
  return absl::StrCat(message, " (op, size, dtype, reduction or root differ: every process's "
                               "ranks must call the same collectives in the same order)");
}

}  // namespace tandem::dist::internal
