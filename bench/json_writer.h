// A small streaming JSON writer for tandem_bench's reports and manifests:
// objects, arrays, strings (escaped), integers, doubles (NaN and infinities
// become null, which JSON has no spelling for) and booleans. Commas are placed
// automatically; the caller pairs Begin/End calls. Not thread-safe.
#ifndef TANDEM_BENCH_JSON_WRITER_H_
#define TANDEM_BENCH_JSON_WRITER_H_

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::apps::bench {

class JsonWriter {
 public:
  // `indent`: spaces per nesting level; 0 writes one line.
  explicit JsonWriter(int indent = 1) : indent_(indent) {}

  JsonWriter& BeginObject() { return Open('{'); }
  JsonWriter& EndObject() { return Close('}'); }
  JsonWriter& BeginArray() { return Open('['); }
  JsonWriter& EndArray() { return Close(']'); }

  // The key of the next value inside an object.
  JsonWriter& Key(std::string_view key) {
    Separate();
    AppendString(key);
    out_ += indent_ > 0 ? ": " : ":";
    after_key_ = true;
    return *this;
  }

  JsonWriter& String(std::string_view value) {
    Separate();
    AppendString(value);
    return *this;
  }
  JsonWriter& Int(int64_t value) { return Raw(std::to_string(value)); }
  JsonWriter& Bool(bool value) { return Raw(value ? "true" : "false"); }
  JsonWriter& Null() { return Raw("null"); }
  // `digits` significant digits (17 round-trips a double, 9 a float).
  JsonWriter& Double(double value, int digits = 17) {
    if (!std::isfinite(value)) return Null();
    // The shortest of 15..digits significant digits that reads back as `value`.
    char buffer[40];
    for (int d = std::min(15, digits); d <= digits; ++d) {
      std::snprintf(buffer, sizeof buffer, "%.*g", d, value);
      if (std::strtod(buffer, nullptr) == value) break;
    }
    return Raw(buffer);
  }

  // Shorthands for "key": value.
  JsonWriter& Field(std::string_view key, std::string_view value) { return Key(key).String(value); }
  JsonWriter& Field(std::string_view key, const char* value) { return Key(key).String(value); }
  JsonWriter& Field(std::string_view key, int64_t value) { return Key(key).Int(value); }
  JsonWriter& Field(std::string_view key, int value) { return Key(key).Int(value); }
  JsonWriter& Field(std::string_view key, bool value) { return Key(key).Bool(value); }
  JsonWriter& Field(std::string_view key, double value, int digits = 17) {
    return Key(key).Double(value, digits);
  }
  JsonWriter& Field(std::string_view key, const std::vector<double>& values, int digits = 17) {
    Key(key).BeginArray();
    const int saved = indent_;
    indent_ = 0;  // number lists on one line
    for (double v : values) Double(v, digits);
    Close(']');
    indent_ = saved;
    return *this;
  }
  JsonWriter& Field(std::string_view key, const std::vector<int64_t>& values) {
    Key(key).BeginArray();
    const int saved = indent_;
    indent_ = 0;
    for (int64_t v : values) Int(v);
    Close(']');
    indent_ = saved;
    return *this;
  }

  // The document so far (complete once every Begin has its End).
  const std::string& str() const { return out_; }

 private:
  JsonWriter& Raw(std::string_view text) {
    Separate();
    out_ += text;
    return *this;
  }
  JsonWriter& Open(char bracket) {
    Separate();
    out_ += bracket;
    first_.push_back(true);
    return *this;
  }
  JsonWriter& Close(char bracket) {
    const bool empty = first_.back();
    first_.pop_back();
    if (!empty) NewLine();
    out_ += bracket;
    return *this;
  }
  // Before a value or a key: a comma unless first in its container, then a new line.
  void Separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_ += ',';
    first_.back() = false;
    NewLine();
  }
  void NewLine() {
    if (indent_ <= 0) {
      if (!first_.empty() && out_.back() == ',') out_ += ' ';
      return;
    }
    out_ += '\n';
    out_.append(first_.size() * indent_, ' ');
  }
  void AppendString(std::string_view s) {
    out_ += '"';
    for (unsigned char c : s) {
      switch (c) {
        case '"': out_ += "\\\""; break;
        case '\\': out_ += "\\\\"; break;
        case '\n': out_ += "\\n"; break;
        case '\r': out_ += "\\r"; break;
        case '\t': out_ += "\\t"; break;
        default:
          if (c < 0x20) {
            char buffer[8];
            std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
            out_ += buffer;
          } else {
            out_ += static_cast<char>(c);
          }
      }
    }
    out_ += '"';
  }

  int indent_;
  std::string out_;
  std::vector<bool> first_;  // per open container: nothing written in it yet
  bool after_key_ = false;
};

}  // namespace tandem::apps::bench

#endif  // TANDEM_BENCH_JSON_WRITER_H_
