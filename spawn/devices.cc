#include "spawn/devices.h"

#include <climits>
#include <cstdlib>
#include <optional>
#include <set>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tandem::dist {
namespace {

absl::Status BadGpus(absl::string_view gpus, absl::string_view token, absl::string_view why,
                     int visible_gpus) {
  return absl::InvalidArgumentError(absl::StrCat("gpus \"", gpus, "\": token \"", token, "\" ",
                                                 why, "; ", DescribeVisibleGpus(visible_gpus)));
}

// Parses one ordinal of a gpus list: `token` (already stripped of surrounding
// spaces) is the number, or PyTorch's "cuda:<number>".
absl::StatusOr<int> ParseOrdinal(absl::string_view gpus, absl::string_view token,
                                 int visible_gpus) {
  if (absl::EqualsIgnoreCase(token, "cuda") || absl::EqualsIgnoreCase(token, "cuda:")) {
    return BadGpus(gpus, token,
                   "names no ordinal (write \"cuda:0\", \"cuda:1\", ...; \"\" is every visible "
                   "GPU)",
                   visible_gpus);
  }
  absl::string_view digits = token;
  if (absl::StartsWithIgnoreCase(digits, "cuda:")) digits.remove_prefix(5);
  if (digits.empty()) {
    return BadGpus(gpus, token, "is empty (write ordinals separated by single commas)",
                   visible_gpus);
  }
  if (digits[0] == '-') {
    return BadGpus(gpus, token, "is negative (ordinals are 0 or more)", visible_gpus);
  }
  int64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') {
      return BadGpus(gpus, token, "is not a whole number (ordinals are 0, 1, 2, ...)",
                     visible_gpus);
    }
    value = value * 10 + (c - '0');
    if (value > INT_MAX) {
      return BadGpus(gpus, token, absl::StrCat("overflows (the largest ordinal is ", INT_MAX, ")"),
                     visible_gpus);
    }
  }
  return static_cast<int>(value);
}

absl::StatusOr<int> RankCount(int nprocs, int listed, absl::string_view what) {
  if (nprocs == 0 || nprocs < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("nprocs ", nprocs, " is invalid: use -1 (one rank per device) or 1 or more"));
  }
  if (nprocs != -1 && listed >= 0 && nprocs > listed) {
    return absl::InvalidArgumentError(absl::StrCat("nprocs ", nprocs, " is more than the ", listed,
                                                   " devices of ", what));
  }
  const int ranks = nprocs == -1 ? listed : nprocs;
  // Checked before the device list is built: "cpu" with nprocs 2147483647
  // would otherwise allocate gigabytes first.
  if (ranks > kMaxRanksPerProcess) {
    return absl::InvalidArgumentError(absl::StrCat(
        ranks, " ranks in one process: at most ", kMaxRanksPerProcess,
        " rank threads per process (check nprocs / --nprocs; use several processes for more)"));
  }
  return ranks;
}

// "cpu" or PyTorch's "cpu:<number>" (case-insensitive): one CPU rank. A
// malformed "cpu:..." is an error naming it.
absl::StatusOr<bool> IsCpuToken(absl::string_view gpus, absl::string_view token,
                                int visible_gpus) {
  if (absl::EqualsIgnoreCase(token, "cpu")) return true;
  if (token.size() < 4 || !absl::EqualsIgnoreCase(token.substr(0, 4), "cpu:")) return false;
  const absl::string_view digits = token.substr(4);
  if (digits.empty() || !absl::c_all_of(digits, absl::ascii_isdigit)) {
    return BadGpus(gpus, token, "is not a whole number after \"cpu:\" (\"cpu\", \"cpu:0\")",
                   visible_gpus);
  }
  return true;
}

// A gpus list's tokens ("0,cuda:1", "cpu:0,cpu:1"), each stripped of spaces,
// and the ordinals of its GPU tokens in order; `cpu` for a list of CPU names
// (one CPU rank each).
struct GpusList {
  std::vector<absl::string_view> tokens;
  std::vector<int> ordinals;
  bool cpu = false;
};

// The syntax of every token first, so "0,,1" is reported as the empty token it
// is, whatever is visible; CPU and GPU tokens do not mix.
absl::StatusOr<GpusList> ParseGpusList(absl::string_view gpus, int visible_gpus) {
  GpusList list;
  std::optional<absl::string_view> cpu_token, gpu_token;  // the first of each kind
  for (absl::string_view raw : absl::StrSplit(gpus, ',')) {
    const absl::string_view token = absl::StripAsciiWhitespace(raw);
    absl::StatusOr<bool> is_cpu = IsCpuToken(gpus, token, visible_gpus);
    if (!is_cpu.ok()) return is_cpu.status();
    list.tokens.push_back(token);
    if (*is_cpu) {
      if (!cpu_token) cpu_token = token;
      continue;
    }
    absl::StatusOr<int> ordinal = ParseOrdinal(gpus, token, visible_gpus);
    if (!ordinal.ok()) return ordinal.status();
    if (!gpu_token) gpu_token = token;
    list.ordinals.push_back(*ordinal);
  }
  if (cpu_token && gpu_token) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpus \"", gpus, "\" mixes CPU and GPU devices (\"", *cpu_token, "\" and \"", *gpu_token,
        "\"): the ranks of a run are all CPU ranks or all GPU ranks; ",
        DescribeVisibleGpus(visible_gpus)));
  }
  list.cpu = cpu_token.has_value();
  return list;
}

// Every listed GPU visible, and none listed twice unless share_devices.
absl::Status CheckOrdinals(absl::string_view gpus, const GpusList& list, int visible_gpus,
                           bool share_devices) {
  std::set<int> seen;
  for (size_t i = 0; i < list.tokens.size(); ++i) {
    const absl::string_view token = list.tokens[i];
    if (list.ordinals[i] >= visible_gpus) {
      return BadGpus(gpus, token, "is not a visible GPU", visible_gpus);
    }
    if (!seen.insert(list.ordinals[i]).second && !share_devices) {
      return BadGpus(gpus, token,
                     "is listed twice (NCCL refuses two ranks on one GPU; set "
                     "SpawnOptions::share_devices to let those ranks share it in-process)",
                     visible_gpus);
    }
  }
  return absl::OkStatus();
}

// Ranks that share a GPU talk through the in-process communicator, which
// reduces on one device; NCCL refuses two ranks on one GPU. A mix of both
// would need a hierarchy (in-process per GPU, then NCCL across GPUs).
absl::Status CheckOneSharedGpuOrNone(absl::string_view gpus, int nprocs,
                                     const std::vector<nn::Device>& devices, int visible_gpus) {
  if (!HasSharedGpu(devices)) return absl::OkStatus();
  std::set<int> distinct;
  for (const nn::Device& d : devices) distinct.insert(d.index);
  if (distinct.size() == 1) return absl::OkStatus();
  std::string ranks;
  for (const nn::Device& d : devices) absl::StrAppend(&ranks, ranks.empty() ? "" : ",", d.index);
  return absl::InvalidArgumentError(absl::StrCat(
      "gpus \"", gpus, "\" with nprocs ", nprocs, " puts ranks on GPUs ", ranks,
      ": share_devices supports several ranks on ONE GPU (all ranks on the same ordinal, e.g. "
      "\"0,0\") or one rank per GPU (distinct ordinals, e.g. \"0,1\"), not a mix: ranks "
      "sharing a GPU use the in-process communicator, which works on one device, and NCCL "
      "refuses two ranks on one GPU; ", DescribeVisibleGpus(visible_gpus)));
}

}  // namespace

std::string DescribeVisibleGpus(int visible_gpus) {
  std::string text = visible_gpus == 0 ? std::string("no GPU is visible")
                     : visible_gpus == 1
                         ? std::string("1 GPU is visible (ordinal 0)")
                         : absl::StrCat(visible_gpus, " GPUs are visible (ordinals 0..",
                                        visible_gpus - 1, ")");
  if (const char* env = std::getenv("CUDA_VISIBLE_DEVICES")) {
    absl::StrAppend(&text, " with CUDA_VISIBLE_DEVICES=\"", env, "\"");
  }
  return text;
}

absl::StatusOr<std::vector<nn::Device>> SelectDevices(absl::string_view gpus, int nprocs,
                                                      int visible_gpus, bool share_devices) {
  const absl::string_view spec = absl::StripAsciiWhitespace(gpus);
  const bool cpu = absl::EqualsIgnoreCase(spec, "cpu") || (spec.empty() && visible_gpus == 0);
  if (cpu) {
    absl::StatusOr<int> count = RankCount(nprocs, -1, "gpus \"cpu\"");
    if (!count.ok()) return count.status();
    const int ranks = *count == -1 ? 1 : *count;
    return std::vector<nn::Device>(ranks, nn::Device::CPU());
  }
  std::vector<int> ordinals;
  if (spec.empty()) {
    for (int i = 0; i < visible_gpus; ++i) ordinals.push_back(i);
  } else {
    absl::StatusOr<GpusList> list = ParseGpusList(gpus, visible_gpus);
    if (!list.ok()) return list.status();
    if (list->cpu) {
      absl::StatusOr<int> count = RankCount(nprocs, static_cast<int>(list->tokens.size()),
                                            absl::StrCat("gpus \"", gpus, "\""));
      if (!count.ok()) return count.status();
      return std::vector<nn::Device>(*count, nn::Device::CPU());
    }
    if (absl::Status s = CheckOrdinals(gpus, *list, visible_gpus, share_devices); !s.ok()) return s;
    ordinals = std::move(list->ordinals);
  }
  absl::StatusOr<int> count =
      RankCount(nprocs, static_cast<int>(ordinals.size()), absl::StrCat("gpus \"", gpus, "\""));
  if (!count.ok()) return count.status();
  std::vector<nn::Device> devices;
  for (int i = 0; i < *count; ++i) devices.push_back(nn::Device::CUDA(ordinals[i]));
  if (absl::Status s = CheckOneSharedGpuOrNone(gpus, nprocs, devices, visible_gpus); !s.ok()) {
    return s;
  }
  return devices;
}

absl::StatusOr<std::vector<int>> ParseGpuOrdinals(absl::string_view gpus, int visible_gpus) {
  if (absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(gpus), "cpu") ||
      absl::StripAsciiWhitespace(gpus).empty()) {
    return std::vector<int>();
  }
  absl::StatusOr<GpusList> list = ParseGpusList(gpus, visible_gpus);
  if (!list.ok()) return list.status();
  return std::move(list->ordinals);
}

absl::StatusOr<std::vector<nn::Device>> SelectDevices(absl::string_view gpus, int nprocs,
                                                      bool share_devices) {
  return SelectDevices(gpus, nprocs, nn::cuda_device_count(), share_devices);
}

bool HasSharedGpu(const std::vector<nn::Device>& devices) {
  std::set<int> seen;
  for (const nn::Device& d : devices) {
    if (d.is_cuda() && !seen.insert(d.index).second) return true;
  }
  return false;
}

}  // namespace tandem::dist
