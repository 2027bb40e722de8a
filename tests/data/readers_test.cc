#include "data/readers.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace tandem::data {
namespace {

namespace fs = std::filesystem;

constexpr char kFashionDir[] = "/usr/share/datasets/fashion-mnist";

std::string Idx(uint8_t type, const std::vector<uint32_t>& dims, const std::string& payload) {
  std::string out = {0, 0, static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((d >> shift) & 0xff));
  }
  return out + payload;
}

std::string Gzip(const std::string& raw) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&z, raw.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  z.avail_in = raw.size();
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = out.size();
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// n images of 28x28 where image i is filled with byte i, labels i % 10.
std::pair<std::string, std::string> GoodMnist(uint32_t n) {
  std::string pixels, labels;
  for (uint32_t i = 0; i < n; ++i) {
    pixels.append(28 * 28, static_cast<char>(i));
    labels.push_back(static_cast<char>(i % 10));
  }
  return {Idx(0x08, {n, 28, 28}, pixels), Idx(0x08, {n}, labels)};
}

void ExpectIdxError(const std::string& bytes, const std::string& needle) {
  for (bool gz : {false, true}) {
    absl::StatusOr<nn::Tensor> t = ParseIdx(gz ? Gzip(bytes) : bytes, "images.idx");
    ASSERT_FALSE(t.ok()) << "expected '" << needle << "' (gzip " << gz << ")";
    const std::string m(t.status().message());
    EXPECT_NE(m.find("images.idx"), std::string::npos) << m;
    EXPECT_NE(m.find(needle), std::string::npos) << m << " (gzip " << gz << ")";
  }
}

TEST(MnistReaderTest, ParsesGoodRawAndGzipBuffers) {
  auto [images, labels] = GoodMnist(12);
  for (bool gz : {false, true}) {
    absl::StatusOr<TensorDataset> ds = ParseMnist(gz ? Gzip(images) : images, gz ? Gzip(labels) : labels,
                                                  "img", "lbl");
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_EQ(ds->data().shape(), (nn::Shape{12, 1, 28, 28}));
    EXPECT_EQ(ds->data().dtype(), nn::kUInt8);
    EXPECT_EQ(ds->targets().dtype(), nn::kInt64);
    EXPECT_EQ(ds->targets().to_vector<int64_t>()[11], 1);
    EXPECT_EQ(ds->get(5).data.to_vector<uint8_t>()[100], 5);
  }
  absl::StatusOr<TensorDataset> f = ParseMnist(images, labels, "img", "lbl", /*as_float=*/true);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->data().dtype(), nn::kFloat32);
  EXPECT_FLOAT_EQ(f->get(3).data.to_vector<float>()[0], 3.0f / 255.0f);
}

TEST(MnistReaderTest, BadFilesGiveErrorsNamingFileAndProblem) {
  ExpectIdxError("", "empty");
  ExpectIdxError(std::string("\0\0", 2), "truncated header");
  ExpectIdxError(Idx(0x08, {2, 2}, "abcd").replace(0, 1, "\x07"), "wrong magic");
  ExpectIdxError(Idx(0x0D, {4}, "abcdabcdabcdabcd"), "type code 0xd is not unsigned byte");
  ExpectIdxError(Idx(0x08, {}, ""), "dimension count 0 outside 1..3");
  ExpectIdxError(Idx(0x08, {1, 1, 1, 1}, "a"), "dimension count 4 outside 1..3");
  ExpectIdxError(Idx(0x08, {2, 28, 28}, "").substr(0, 10), "truncated header");
  ExpectIdxError(Idx(0x08, {2, 3}, "abcde"), "payload has 5 bytes but dims (2, 3) need 6 (truncated)");
  // Too long: raw files report the size; gzip ones stop at the promise (below).
  absl::StatusOr<nn::Tensor> long_raw = ParseIdx(Idx(0x08, {2, 3}, "abcdefg"), "images.idx");
  ASSERT_FALSE(long_raw.ok());
  EXPECT_NE(long_raw.status().message().find("payload has 7 bytes"), std::string::npos) << long_raw.status();
  ExpectIdxError(Idx(0x08, {0xffffffffu, 0xffffffffu, 0xffffffffu}, "x"), "overflow");
  // A tiny gzip file whose header promises 4 GB: fails on the real size, without
  // allocating what the header says.
  ExpectIdxError(Idx(0x08, {0xffffffffu}, "xyz"), "payload has 3 bytes");

  // gzip: more data than the header promises is cut off at the promise.
  absl::StatusOr<nn::Tensor> over = ParseIdx(Gzip(Idx(0x08, {2}, std::string(100000, 'a'))), "big.gz");
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("exceeds the 10 bytes its header promises"), std::string::npos)
      << over.status();
  // Corrupt and truncated gzip streams.
  std::string gz = Gzip(Idx(0x08, {64, 28, 28}, std::string(64 * 784, 'q')));
  absl::StatusOr<nn::Tensor> cut = ParseIdx(gz.substr(0, gz.size() / 2), "cut.gz");
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.status().message().find("cut.gz"), std::string::npos);
  std::string corrupt = gz;
  for (size_t i = 20; i < 40; ++i) corrupt[i] ^= 0x5a;
  EXPECT_FALSE(ParseIdx(corrupt, "corrupt.gz").ok());

  // Pairing checks.
  auto [images, labels] = GoodMnist(4);
  auto [images5, labels5] = GoodMnist(5);
  auto count = ParseMnist(images, labels5, "img", "lbl");
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("5 labels but img holds 4 images"), std::string::npos) << count.status();
  std::string bad_label = labels;
  bad_label.back() = 10;
  auto range = ParseMnist(images, bad_label, "img", "lbl");
  ASSERT_FALSE(range.ok());
  EXPECT_NE(range.status().message().find("lbl: label 10 of record 3 outside 0..9"), std::string::npos)
      << range.status();
  auto dims = ParseMnist(labels, labels, "img", "lbl");
  ASSERT_FALSE(dims.ok());
  EXPECT_NE(dims.status().message().find("images need 3 dims"), std::string::npos) << dims.status();
}

TEST(MnistReaderTest, ReadsFashionMnist) {
  if (!fs::exists(std::string(kFashionDir) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not found at " << kFashionDir;
  }
  absl::StatusOr<TensorDataset> train = LoadMnist(kFashionDir, /*train=*/true);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->data().shape(), (nn::Shape{60000, 1, 28, 28}));
  absl::StatusOr<TensorDataset> test = LoadMnist(kFashionDir, /*train=*/false, /*as_float=*/true);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->size(), 10000);
  std::vector<int64_t> counts(10, 0);
  for (int64_t label : test->targets().to_vector<int64_t>()) ++counts[label];
  for (int64_t c : counts) EXPECT_EQ(c, 1000);  // Fashion-MNIST's test set is balanced
  float max_value = 0;
  for (float v : test->get(0).data.to_vector<float>()) max_value = std::max(max_value, v);
  EXPECT_GT(max_value, 0.5f);
  EXPECT_LE(max_value, 1.0f);
  auto missing = LoadMnist("/nonexistent", true);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/train-images-idx3-ubyte"), std::string::npos);
}

std::string CifarRecords(int n, int bad_label_at = -1) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    out.push_back(static_cast<char>(i == bad_label_at ? 12 : i % 10));
    out.append(3072, static_cast<char>(i + 1));
  }
  return out;
}

TEST(CifarReaderTest, ParsesRecordsAndRejectsBadFiles) {
  absl::StatusOr<TensorDataset> ds = ParseCifar10(CifarRecords(3), "batch.bin");
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->data().shape(), (nn::Shape{3, 3, 32, 32}));
  EXPECT_EQ(ds->targets().to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(ds->get(2).data.to_vector<uint8_t>()[3071], 3);

  auto expect = [](const std::string& bytes, const std::string& needle) {
    absl::StatusOr<TensorDataset> r = ParseCifar10(bytes, "batch.bin");
    ASSERT_FALSE(r.ok()) << needle;
    const std::string m(r.status().message());
    EXPECT_NE(m.find("batch.bin"), std::string::npos) << m;
    EXPECT_NE(m.find(needle), std::string::npos) << m;
  };
  expect("", "empty");
  expect(CifarRecords(2).substr(0, 5000), "not a multiple of the 3073-byte record");
  expect(CifarRecords(2) + "x", "not a multiple");
  expect(CifarRecords(4, 2), "label 12 of record 2 outside 0..9");
}

TEST(CifarReaderTest, LoadsTrainAndTestDirectories) {
  const std::string dir = (fs::temp_directory_path() / ("tandem_cifar_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  for (int i = 1; i <= 5; ++i) {
    std::ofstream(dir + "/data_batch_" + std::to_string(i) + ".bin", std::ios::binary) << CifarRecords(i);
  }
  std::ofstream(dir + "/test_batch.bin", std::ios::binary) << CifarRecords(7);
  absl::StatusOr<TensorDataset> train = LoadCifar10(dir, true, /*as_float=*/true);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->size(), 15);
  EXPECT_EQ(train->data().dtype(), nn::kFloat32);
  EXPECT_EQ(train->targets().to_vector<int64_t>()[1], 0);  // first record of data_batch_2
  absl::StatusOr<TensorDataset> test = LoadCifar10(dir, false);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->size(), 7);
  fs::remove(dir + "/data_batch_3.bin");
  auto missing = LoadCifar10(dir, true);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("data_batch_3.bin"), std::string::npos) << missing.status();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tandem::data
