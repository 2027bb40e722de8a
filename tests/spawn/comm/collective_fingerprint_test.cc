// The cross-process collectives' fingerprints (spawn/comm/mpi/collective_fingerprint.h):
// every field that must agree changes the value, what need not agree does not,
// and the description reads back what was packed.
#include "spawn/comm/mpi/collective_fingerprint.h"

#include <cstdint>
#include <set>
#include <string>
#include <utility>

#include "gtest/gtest.h"
#include "nn/error.h"

namespace tandem::dist::internal {
namespace {

CollectiveShape AllReduce() {
  return {.op = "all_reduce", .reduce = ReduceOp::kSum, .dtype = nn::kFloat32, .numel = 1530};
}

// What PackFingerprint throws for `shape`: its message, or "no error".
std::string PackError(const CollectiveShape& shape) {
  try {
    PackFingerprint(shape);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(CollectiveFingerprint, EachFieldThatMustAgreeChangesIt) {
  std::vector<CollectiveShape> shapes = {AllReduce()};
  CollectiveShape s = AllReduce();
  s.op = "reduce_scatter";
  shapes.push_back(s);
  s = AllReduce();
  s.op = "all_gather";
  shapes.push_back(s);
  s = AllReduce();
  s.op = "broadcast";
  shapes.push_back(s);
  s.root = 1;
  shapes.push_back(s);
  s = AllReduce();
  s.reduce = ReduceOp::kAvg;
  shapes.push_back(s);
  s.reduce = ReduceOp::kMax;
  shapes.push_back(s);
  s = AllReduce();
  s.numel = 1531;
  shapes.push_back(s);
  s = AllReduce();
  s.dtype = nn::kFloat64;
  shapes.push_back(s);
  s.dtype = nn::kBFloat16;
  shapes.push_back(s);
  shapes.push_back({.op = "barrier"});
  std::set<std::pair<int64_t, int64_t>> seen;
  for (const CollectiveShape& shape : shapes) {
    const Fingerprint f = PackFingerprint(shape);
    EXPECT_GE(f.shape, 0) << DescribeFingerprint(f, 1);
    EXPECT_GE(f.numel, 0) << DescribeFingerprint(f, 1);
    EXPECT_TRUE(seen.insert({f.shape, f.numel}).second)
        << "two shapes share " << DescribeFingerprint(f, 1);
  }
}

// The element count is compared whole: counts that differ by a multiple of any
// power of two (2^34 once aliased in a 34-bit field) still differ.
TEST(CollectiveFingerprint, CountsPast2To34AreComparedExactly) {
  const int64_t small = 1530;
  for (int bits : {31, 32, 34, 40, 48, 62}) {
    CollectiveShape a = AllReduce(), b = AllReduce();
    b.numel = small + (int64_t{1} << bits);
    EXPECT_NE(PackFingerprint(a), PackFingerprint(b)) << "differ by 2^" << bits;
    EXPECT_GE(PackFingerprint(b).numel, 0);
    const std::string message = CollectiveMismatch(
        {PackFingerprint(a), PackFingerprint(b)}, 3,
        [](int p) { return "process " + std::to_string(p); });
    EXPECT_NE(message.find("process 0 called all_reduce #3 (1530 float32, sum) while process 1 "
                           "called all_reduce #3 (" + std::to_string(b.numel) + " float32, sum)"),
              std::string::npos)
        << message << "\ndiffer by 2^" << bits;
  }
  CollectiveShape largest = AllReduce();
  largest.numel = INT64_MAX;
  EXPECT_EQ(DescribeFingerprint(PackFingerprint(largest), 1),
            "all_reduce #1 (9223372036854775807 float32, sum)");
}

TEST(CollectiveFingerprint, RootsPast2To20AreComparedExactly) {
  CollectiveShape a = {.op = "broadcast", .root = 1, .numel = 4}, b = a;
  b.root = 1 + (1 << 20);
  EXPECT_NE(PackFingerprint(a), PackFingerprint(b));
  b.root = INT32_MAX;
  EXPECT_EQ(DescribeFingerprint(PackFingerprint(b), 2),
            "broadcast #2 (4 float32, root 2147483647)");
}

TEST(CollectiveFingerprint, ANegativeCountOrRootIsNamed) {
  CollectiveShape s = AllReduce();
  s.numel = -3;
  EXPECT_NE(PackError(s).find("all_reduce of -3 elements"), std::string::npos) << PackError(s);
  s = {.op = "broadcast", .root = -2, .numel = 4};
  EXPECT_NE(PackError(s).find("broadcast root -2 is negative"), std::string::npos)
      << PackError(s);
}

TEST(CollectiveFingerprint, FieldsAnOpDoesNotUseAreIgnored) {
  // A root outside broadcast, a reduction outside the reducing ops, a barrier's data.
  CollectiveShape a = AllReduce(), b = AllReduce();
  b.root = 3;
  EXPECT_EQ(PackFingerprint(a), PackFingerprint(b));
  a.op = b.op = "all_gather";
  b.reduce = ReduceOp::kMax;
  EXPECT_EQ(PackFingerprint(a), PackFingerprint(b));
  EXPECT_EQ(PackFingerprint({.op = "barrier", .dtype = nn::kFloat64, .numel = 9}),
            PackFingerprint({.op = "barrier"}));
}

TEST(CollectiveFingerprint, DescriptionReadsBackEachField) {
  EXPECT_EQ(DescribeFingerprint(PackFingerprint(AllReduce()), 4), "all_reduce #4 (1530 float32, sum)");
  EXPECT_EQ(DescribeFingerprint(PackFingerprint({.op = "all_gather", .dtype = nn::kFloat64,
                                                 .numel = 4}), 4),
            "all_gather #4 (4 float64)");
  EXPECT_EQ(DescribeFingerprint(PackFingerprint({.op = "broadcast", .root = 1025,
                                                 .dtype = nn::kInt64, .numel = 1}), 12),
            "broadcast #12 (1 int64, root 1025)");
  EXPECT_EQ(DescribeFingerprint(PackFingerprint({.op = "reduce_scatter", .reduce = ReduceOp::kAvg,
                                                 .dtype = nn::kBFloat16,
                                                 .numel = int64_t{1} << 31}), 7),
            "reduce_scatter #7 (2147483648 bfloat16, avg)");
  EXPECT_EQ(DescribeFingerprint(PackFingerprint({.op = "barrier"}), 9), "barrier #9");
}

TEST(CollectiveFingerprint, MismatchNamesTheFirstProcessAndEachThatDiffers) {
  auto name = [](int p) { return "process " + std::to_string(p); };
  const Fingerprint a = PackFingerprint(AllReduce());
  const Fingerprint b = PackFingerprint({.op = "barrier"});
  const Fingerprint none;
  EXPECT_EQ(CollectiveMismatch({a, a, a}, 4, name), "");
  EXPECT_EQ(CollectiveMismatch({a, none, a}, 4, name), "") << "an unknown one is left out";
  EXPECT_EQ(CollectiveMismatch({none, a, b, a, b}, 4, name),
            "collective mismatch across processes: process 1 called all_reduce #4 (1530 float32, "
            "sum) while process 2 called barrier #4, process 4 called barrier #4 (op, size, "
            "dtype, reduction or root differ: every process's ranks must call the same "
            "collectives in the same order)");
}

// Each side's label, which only that side's process knows, follows its
// collective; an unlabelled side and a side whose label is unknown read as before.
TEST(CollectiveFingerprint, MismatchNamesEachSidesLabel) {
  auto name = [](int p) { return "process " + std::to_string(p); };
  const Fingerprint a = PackFingerprint(AllReduce());
  const Fingerprint b = PackFingerprint({.op = "barrier"});
  EXPECT_EQ(CollectiveMismatch({a, b, b}, 4, name, {"lib::save (every rank calls it)", "", ""}),
            "collective mismatch across processes: process 0 called all_reduce #4 (1530 float32, "
            "sum) from lib::save (every rank calls it) while process 1 called barrier #4, process "
            "2 called barrier #4 (op, size, dtype, reduction or root differ: every process's "
            "ranks must call the same collectives in the same order)");
  EXPECT_NE(CollectiveMismatch({a, b}, 4, name, {"", "lib::barrier"})
                .find("process 0 called all_reduce #4 (1530 float32, sum) while process 1 called "
                      "barrier #4 from lib::barrier (op"),
            std::string::npos);
  EXPECT_NE(CollectiveMismatch({a, b}, 4, name, {"x", "y"})
                .find("sum) from x while process 1 called barrier #4 from y (op"),
            std::string::npos);
  EXPECT_EQ(CollectiveMismatch({a, a}, 4, name, {"x", ""}), "") << "labels are not compared";
}

// A label travels as words that a MAX all-reduce keeps: never negative where
// written, INT64_MIN where not; the text reads back, a long one cut with "...".
TEST(CollectiveFingerprint, ALabelPacksIntoWordsAMaxKeepsAndReadsBack) {
  int64_t words[kLabelWords];
  PackLabel(nullptr, words);
  for (int64_t w : words) EXPECT_EQ(w, Fingerprint::kNone);
  EXPECT_EQ(UnpackLabel(words), "");
  PackLabel("", words);
  EXPECT_EQ(UnpackLabel(words), "");
  const std::string save =
      "hapi::Model::save (inside a rank's function a collective: every rank calls it, the "
      "process's first rank writes)";
  PackLabel(save.c_str(), words);
  for (int64_t w : words) EXPECT_GE(w, 0);
  EXPECT_EQ(UnpackLabel(words), save);
  const std::string bytes = "\xc3\xa9t\xe9\x80\xff!";  // bytes above 0x7f stay as they are
  PackLabel(bytes.c_str(), words);
  EXPECT_EQ(UnpackLabel(words), bytes);
  const std::string exact(kLabelBytes, 'x');
  PackLabel(exact.c_str(), words);
  EXPECT_EQ(UnpackLabel(words), exact);
  const std::string longer = std::string(kLabelBytes, 'y') + "z";
  PackLabel(longer.c_str(), words);
  EXPECT_EQ(UnpackLabel(words), std::string(kLabelBytes - 3, 'y') + "...");
}

// A long label is cut before a UTF-8 character that would not fit whole, never
// inside one: the message stays valid UTF-8.
TEST(CollectiveFingerprint, ALongLabelIsCutBetweenUtf8Characters) {
  int64_t words[kLabelWords];
  for (int ascii = 0; ascii < 4; ++ascii) {
    std::string label(kLabelBytes - 4 + ascii, 'a');  // then two-byte e-acutes
    for (int i = 0; i < 4; ++i) label += "\xc3\xa9";
    PackLabel(label.c_str(), words);
    const std::string text = UnpackLabel(words);
    ASSERT_GE(text.size(), 3u);
    EXPECT_EQ(text.substr(text.size() - 3), "...") << "ascii " << ascii;
    const std::string kept = text.substr(0, text.size() - 3);
    EXPECT_LE(text.size(), static_cast<size_t>(kLabelBytes));
    EXPECT_GE(kept.size(), static_cast<size_t>(kLabelBytes - 4)) << "ascii " << ascii;
    EXPECT_EQ(kept, label.substr(0, kept.size())) << "ascii " << ascii;
    EXPECT_NE(static_cast<unsigned char>(kept.back()), 0xc3)
        << "ascii " << ascii << ": cut inside a character: " << text;
  }
}

TEST(CollectiveFingerprint, AnOpThatIsNoCrossProcessCollectiveIsNamed) {
  const std::string error = PackError({.op = "all_to_all"});
  EXPECT_NE(error.find("op \"all_to_all\" is not a cross-process collective"), std::string::npos)
      << error;
}

// A dtype or reduction beyond its field's bits would change the op or reduction
// bits of the value: refused by name instead.
TEST(CollectiveFingerprint, ADTypeOrReductionBeyondItsFieldIsAnError) {
  CollectiveShape s = AllReduce();
  s.dtype = static_cast<nn::DType>(16);
  EXPECT_THROW(PackFingerprint(s), Error);
  s = AllReduce();
  s.reduce = static_cast<ReduceOp>(4);
  EXPECT_NE(PackError(s).find("reduction 4 does not fit"), std::string::npos) << PackError(s);
  s.reduce = ReduceOp::kMax;  // the largest today fits
  EXPECT_NO_THROW(PackFingerprint(s));
}

}  // namespace
}  // namespace tandem::dist::internal
