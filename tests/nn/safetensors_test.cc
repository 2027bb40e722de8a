// nn/safetensors.h: round trips (every dtype, bit for bit), the byte layout of
// the format, loading into modules (strict and not, every mismatch in one
// message), malformed files (one clear error each), and the float16 dtype.
#include "nn/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/random.h"
#include "nn/ops/elementwise.h"

namespace tandem::nn {
namespace {

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "safetensors_test_" + name;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A file from a header text and data bytes, as the format lays it out.
std::string FileOf(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

std::vector<uint8_t> Bytes(const Tensor& t) {
  const Tensor host = t.to(Device::CPU());
  const auto* p = static_cast<const uint8_t*>(host.host_ptr());
  return {p, p + host.nbytes()};
}

struct Net : Module {
  Net() : fc(register_module("fc", Linear(4, 3))), bn(register_module("bn", BatchNorm2d(3))) {}
  Linear fc;
  BatchNorm2d bn;
};

TEST(SafetensorsTest, RoundTripIsBitIdenticalForEveryDType) {
  manual_seed(3);
  const Tensor f32 = randn({3, 5});
  StateDict state = {
      {"f32", f32},
      {"f64", randn({4}, {.dtype = kFloat64})},
      {"bf16", f32.to(kBFloat16)},
      {"f16", f32.to(kFloat16)},
      {"i64", from_vector(std::vector<int64_t>{-3, 0, 1ll << 40}, {3})},
      {"u8", from_vector(std::vector<uint8_t>{0, 7, 255}, {3})},
      {"scalar", zeros({}, {.dtype = kInt64})},
      {"empty", zeros({0, 2})},
  };
  const std::string path = TempPath("roundtrip.safetensors");
  ASSERT_TRUE(SaveSafetensors(path, state, {{"format", "pt"}}).ok());
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata, (SafetensorsMetadata{{"format", "pt"}}));
  ASSERT_EQ(file->tensors.size(), state.size());
  for (size_t i = 0; i < state.size(); ++i) {
    // Written in the given order, so read back in it (offsets ascend).
    EXPECT_EQ(file->tensors[i].first, state[i].first);
    EXPECT_EQ(file->tensors[i].second.dtype(), state[i].second.dtype()) << state[i].first;
    EXPECT_EQ(file->tensors[i].second.shape(), state[i].second.shape()) << state[i].first;
    EXPECT_EQ(Bytes(file->tensors[i].second), Bytes(state[i].second)) << state[i].first;
  }
  // Saved again from what was read: the same file, byte for byte.
  const std::string again = TempPath("roundtrip2.safetensors");
  ASSERT_TRUE(SaveSafetensors(again, file->tensors, file->metadata).ok());
  EXPECT_EQ(ReadBytes(again), ReadBytes(path));
}

TEST(SafetensorsTest, LayoutIsTheFormatsHeaderAndData) {
  StateDict state = {{"b", from_vector(std::vector<float>{1.5f, -2.0f}, {2})},
                     {"a", from_vector(std::vector<int64_t>{7}, {1, 1})}};
  const std::string path = TempPath("layout.safetensors");
  ASSERT_TRUE(SaveSafetensors(path, state).ok());
  const std::string bytes = ReadBytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);  // padded so the data starts aligned
  std::string header = bytes.substr(8, n);
  while (!header.empty() && header.back() == ' ') header.pop_back();
  EXPECT_EQ(header,
            R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("a":{"dtype":"I64","shape":[1,1],"data_offsets":[8,16]}})");
  ASSERT_EQ(bytes.size(), 8 + n + 16);
  float f[2];
  std::memcpy(f, bytes.data() + 8 + n, 8);
  EXPECT_EQ(f[0], 1.5f);
  EXPECT_EQ(f[1], -2.0f);
}

TEST(SafetensorsTest, ModuleRoundTripUsesStateDictNamesAndLoadsInPlace) {
  manual_seed(5);
  Net a;
  a.bn->train();
  a.bn(randn({2, 3, 2, 2}));  // running statistics and the batch count move
  const std::string path = TempPath("module.safetensors");
  ASSERT_TRUE(SaveSafetensors(path, a).ok());
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<std::string> names;
  for (const auto& [name, unused] : file->tensors) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"fc.weight", "fc.bias", "bn.weight", "bn.bias",
                                             "bn.running_mean", "bn.running_var",
                                             "bn.num_batches_tracked"}));
  manual_seed(6);
  Net b;
  const Tensor held = b.fc->weight;  // an optimizer's handle sees the load
  absl::StatusOr<SafetensorsLoadReport> report = LoadSafetensors(path, b);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->loaded.size(), 7u);
  EXPECT_TRUE(report->missing.empty() && report->unexpected.empty() && report->mismatched.empty());
  const StateDict sa = a.state_dict(), sb = b.state_dict();
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(Bytes(sa[i].second), Bytes(sb[i].second));
  EXPECT_EQ(b.bn->num_batches_tracked.item(), 1.0);
  EXPECT_EQ(Bytes(held), Bytes(a.fc->weight));
}

TEST(SafetensorsTest, StrictLoadListsEveryMismatchAndChangesNothing) {
  manual_seed(7);
  Net net;
  const std::vector<uint8_t> before = Bytes(net.fc->weight);
  StateDict state = net.state_dict();
  state.erase(state.begin() + 1);                    // fc.bias missing
  state[0].second = zeros({3, 5});                   // fc.weight: shape
  state[1].second = state[1].second.to(kFloat64);    // bn.weight: dtype
  state.emplace_back("extra", zeros({1}));           // unexpected
  state.emplace_back("bn.extra", zeros({1}));        // unexpected
  const std::string path = TempPath("mismatch.safetensors");
  ASSERT_TRUE(SaveSafetensors(path, state).ok());
  absl::StatusOr<SafetensorsLoadReport> report = LoadSafetensors(path, net);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(report.status().message());
  EXPECT_EQ(message,
            "safetensors " + path + " does not match Net: 1 missing from the file (fc.bias); "
            "2 unexpected in the file (extra, bn.extra); 2 mismatched (fc.weight: "
            "float32(3, 4) in the module, float32(3, 5) in the file, bn.weight: float32(3) in "
            "the module, float64(3) in the file)");
  EXPECT_EQ(Bytes(net.fc->weight), before);

  // Not strict: what matches is loaded, the rest is listed.
  SafetensorsLoadOptions options{.strict = false};
  report = LoadSafetensors(path, net, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->missing, (std::vector<std::string>{"fc.bias"}));
  EXPECT_EQ(report->unexpected, (std::vector<std::string>{"extra", "bn.extra"}));
  EXPECT_EQ(report->mismatched.size(), 2u);
  EXPECT_EQ(report->loaded, (std::vector<std::string>{"bn.bias", "bn.running_mean",
                                                      "bn.running_var", "bn.num_batches_tracked"}));
  // Converting floating dtypes makes the float64 bn.weight load.
  options.convert_floating = true;
  report = LoadSafetensors(path, net, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->mismatched.size(), 1u);
}

TEST(SafetensorsTest, Float16FileLoadsIntoFloat32WithConversion) {
  Linear fc(2, 2);
  const std::vector<float> w = {0.5f, -1.25f, 3.0f, 65504.0f};  // exact in float16
  StateDict state = {{"weight", from_vector(w, {2, 2}).to(kFloat16)},
                     {"bias", from_vector(std::vector<float>{1e-7f, 2.0f}, {2}).to(kFloat16)}};
  const std::string path = TempPath("f16.safetensors");
  ASSERT_TRUE(SaveSafetensors(path, state).ok());
  ASSERT_FALSE(LoadSafetensors(path, *fc).ok());  // dtype mismatch without conversion
  ASSERT_TRUE(LoadSafetensors(path, *fc, {.convert_floating = true}).ok());
  EXPECT_EQ(fc->weight.to_vector<float>(), w);
  // 1e-7 is a float16 subnormal: 2 * 2^-24.
  EXPECT_EQ(fc->bias.to_vector<float>(), (std::vector<float>{0x1p-23f, 2.0f}));
}

TEST(SafetensorsTest, Float16ConversionsRoundToNearestEven) {
  auto bits = [](float f) { return Float16::FromFloat(f); };
  EXPECT_EQ(bits(0.0f), 0x0000);
  EXPECT_EQ(bits(-0.0f), 0x8000);
  EXPECT_EQ(bits(1.0f), 0x3c00);
  EXPECT_EQ(bits(-2.0f), 0xc000);
  EXPECT_EQ(bits(65504.0f), 0x7bff);      // the largest float16
  EXPECT_EQ(bits(65519.0f), 0x7bff);      // rounds down
  EXPECT_EQ(bits(65520.0f), 0x7c00);      // rounds up to infinity
  EXPECT_EQ(bits(1e6f), 0x7c00);
  EXPECT_EQ(bits(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(bits(std::nanf("")), 0x7e00);
  EXPECT_EQ(bits(0x1p-14f), 0x0400);      // the smallest normal
  EXPECT_EQ(bits(0x1p-24f), 0x0001);      // the smallest subnormal
  EXPECT_EQ(bits(0x1p-25f), 0x0000);      // a tie: to even (zero)
  EXPECT_EQ(bits(0x1.8p-25f), 0x0001);    // above the tie
  EXPECT_EQ(bits(1.0f + 0x1p-11f), 0x3c00);               // a tie: to even
  EXPECT_EQ(bits(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);    // above it
  EXPECT_EQ(bits(1.0f + 3 * 0x1p-11f), 0x3c02);           // a tie: to even (up)
  // Every float16 value converts to float32 and back unchanged.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Float16::ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(Float16::FromFloat(f), h) << std::hex << h;
  }
  EXPECT_EQ(Float16::ToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(Float16::ToFloat(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(Float16::ToFloat(0x7c00)));
}

TEST(SafetensorsTest, Float16IsAStorageDTypeOnly) {
  Tensor h = full({3}, 1.5, {.dtype = kFloat16});
  EXPECT_EQ(h.dtype(), kFloat16);
  EXPECT_EQ(h.nbytes(), 6);
  EXPECT_EQ(h.to_vector<float>(), (std::vector<float>{1.5f, 1.5f, 1.5f}));
  EXPECT_EQ(h.to(kFloat64).to_vector<double>(), (std::vector<double>{1.5, 1.5, 1.5}));
  EXPECT_EQ(h.to(kBFloat16).to(kFloat32).to_vector<float>(), (std::vector<float>{1.5f, 1.5f, 1.5f}));
  try {
    add(h, h);
    FAIL() << "add on float16 did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float16"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsTest, Float16SurvivesTandemCheckpoints) {
  Checkpoint ck;
  ck.tensors["h"] = from_vector(std::vector<float>{0.1f, -7.0f}, {2}).to(kFloat16);
  absl::StatusOr<Checkpoint> back = ParseCheckpoint(SerializeCheckpoint(ck), "mem");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tensors.at("h").dtype(), kFloat16);
  EXPECT_EQ(Bytes(back->tensors.at("h")), Bytes(ck.tensors.at("h")));
}

// One malformed file per problem: a DataLoss error naming the file and the problem.
TEST(SafetensorsTest, MalformedFilesGiveOneClearError) {
  const std::string f32x2(8, '\0');
  const std::string ok = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct Case {
    std::string bytes;
    std::string expected;
  };
  std::string huge_length(8, '\xff');
  const std::vector<Case> cases = {
      {"", "file of 0 bytes is shorter than the 8-byte header length"},
      {std::string("\x05\0\0\0\0\0\0\0{}", 10),
       "header length 5 exceeds the 2 bytes after the length field"},
      {huge_length + "{}", "header length 18446744073709551615 exceeds the 2 bytes"},
      {FileOf("{\"t\":", ""), "header is not valid JSON"},
      {FileOf("[1, 2]", ""), "header is JSON array, not an object"},
      {FileOf(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
              R"("t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
              f32x2 + f32x2),
       "name 't' appears twice in the header"},
      {FileOf(R"({"t":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})", f32x2),
       "tensor 't' has dtype \"I32\", which tandem does not support"},
      {FileOf(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2),
       "a size in the shape of tensor 't' is -2, not a non-negative integer"},
      {FileOf(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", f32x2),
       "tensor 't' has data_offsets [0, 16] outside the data part of 8 bytes"},
      {FileOf(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
       "tensor 't' of dtype F32 and shape [3] needs 12 bytes but data_offsets [0, 8] hold 8"},
      {FileOf(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
              f32x2),
       "tensors 'a' [0, 8) and 'b' [4, 8) overlap"},
      {FileOf(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32x2),
       "data bytes [0, 4) belong to no tensor"},
      {FileOf(ok, f32x2 + "xx"), "2 data bytes after the last tensor's end at 8"},
      {FileOf(R"({"t":{"dtype":"F32","shape":[2]}})", f32x2), "tensor 't' has no \"data_offsets\""},
      {FileOf(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", f32x2),
       "tensor 't' has an unknown field 'x'"},
      {FileOf(R"({"__metadata__":{"k":1}})", ""),
       "\"__metadata__\" entry 'k' is JSON number, not a string"},
      {FileOf(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],)"
              R"("data_offsets":[0,8]}})", f32x2),
       "too many elements"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SafetensorsFile> file = ParseSafetensors(c.bytes, "bad.safetensors");
    ASSERT_FALSE(file.ok()) << c.expected;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss) << file.status();
    const std::string message(file.status().message());
    EXPECT_EQ(message.rfind("safetensors bad.safetensors: ", 0), 0u) << message;
    EXPECT_NE(message.find(c.expected), std::string::npos) << message << "\n  wanted: " << c.expected;
  }
  // The well-formed control of these cases parses.
  EXPECT_TRUE(ParseSafetensors(FileOf(ok, f32x2), "ok").ok());
}

// Names and strings from a damaged header reach the message escaped: one line,
// printable ASCII, whatever the JSON escapes decoded to (a newline, a bell, bytes
// that are not UTF-8).
TEST(SafetensorsTest, NamesFromTheFileAreEscapedInMessages) {
  const std::string f32x2(8, '\0');
  struct Case {
    std::string bytes;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {FileOf(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x\nERROR: y":1}})",
              f32x2),
       "tensor 't' has an unknown field 'x\\nERROR: y'"},
      {FileOf(R"({"t\u0007\r\u00e9":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"z":1}})",
              f32x2),
       "tensor 't\\x07\\r\\xc3\\xa9' has an unknown field 'z'"},
      {FileOf(R"({"__metadata__":{"k\n":1}})", ""), "\"__metadata__\" entry 'k\\n' is JSON"},
      {FileOf(R"({"t":{"dtype":"F\n32\u00e9","shape":[2],"data_offsets":[0,8]}})", f32x2),
       "tensor 't' has dtype \"F\\n32\\u00e9\", which tandem does not support"},
      // Bytes that are not UTF-8: the JSON parser's own message quotes them.
      {FileOf("{\"t\xff\n\":{}}", f32x2), "header is not valid JSON: "},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SafetensorsFile> file = ParseSafetensors(c.bytes, "bad.safetensors");
    ASSERT_FALSE(file.ok()) << c.expected;
    const std::string message(file.status().message());
    EXPECT_NE(message.find(c.expected), std::string::npos) << message << "\n  wanted: " << c.expected;
    for (const char ch : message) {
      EXPECT_TRUE(ch >= 0x20 && ch <= 0x7e) << "byte " << int{static_cast<unsigned char>(ch)}
                                            << " in " << absl::CHexEscape(message);
    }
  }
}

TEST(SafetensorsTest, FileErrorsNameThePath) {
  const std::string missing = TempPath("does_not_exist.safetensors");
  Linear fc(1, 1);
  absl::StatusOr<SafetensorsLoadReport> r = LoadSafetensors(missing, *fc);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find(missing), std::string::npos);
  EXPECT_EQ(ReadSafetensors(::testing::TempDir()).status().code(),
            absl::StatusCode::kInvalidArgument);  // a directory
  const absl::Status s = SaveSafetensors("/nonexistent-dir/x.safetensors", *fc);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent-dir/x.safetensors"), std::string::npos) << s;
  EXPECT_FALSE(SaveSafetensors(TempPath("dup.safetensors"),
                               StateDict{{"a", zeros({1})}, {"a", zeros({1})}})
                   .ok());
  const absl::Status not_utf8 =
      SaveSafetensors(TempPath("utf8.safetensors"), StateDict{{"w\xff", zeros({1})}});
  EXPECT_EQ(not_utf8.code(), absl::StatusCode::kInvalidArgument) << not_utf8;
  EXPECT_FALSE(SaveSafetensors(TempPath("reserved.safetensors"),
                               StateDict{{"__metadata__", zeros({1})}})
                   .ok());
}

TEST(SafetensorsTest, SaveIsAtomicAndLeavesNoTemporaryFile) {
  const std::string dir = ::testing::TempDir() + "safetensors_atomic";
  std::remove((dir + "/m.safetensors").c_str());
  ::mkdir(dir.c_str(), 0755);
  Linear fc(3, 2);
  ASSERT_TRUE(SaveSafetensors(dir + "/m.safetensors", *fc).ok());
  ASSERT_TRUE(SaveSafetensors(dir + "/m.safetensors", *fc).ok());  // replaces it
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++files;
    EXPECT_EQ(entry.path().filename(), "m.safetensors");
  }
  EXPECT_EQ(files, 1);
}

// BatchNorm2d counts its training batches (PyTorch's num_batches_tracked), and
// a tandem checkpoint written before it kept the count still loads.
TEST(SafetensorsTest, BatchNormCountsTrainingBatchesOnly) {
  BatchNorm2d bn(2);
  EXPECT_EQ(bn->num_batches_tracked.dtype(), kInt64);
  EXPECT_EQ(bn->num_batches_tracked.dim(), 0);
  const Tensor x = randn({2, 2, 3, 3});
  bn(x);
  bn(x);
  EXPECT_EQ(bn->num_batches_tracked.item(), 2.0);
  bn->eval();
  bn(x);
  EXPECT_EQ(bn->num_batches_tracked.item(), 2.0);

  StateDict old = bn->state_dict();
  old.pop_back();  // no num_batches_tracked, as such files were written
  BatchNorm2d fresh(2);
  EXPECT_FALSE(fresh->load_state_dict(old).ok());
  AddMissingBatchCounts(*fresh, old);
  ASSERT_EQ(old.back().first, "num_batches_tracked");
  EXPECT_TRUE(fresh->load_state_dict(old).ok());
  EXPECT_EQ(fresh->num_batches_tracked.item(), 0.0);
}

}  // namespace
}  // namespace tandem::nn
