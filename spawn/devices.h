// Choosing the devices of a run from spawn's `gpus` string and `nprocs`.
//
// gpus:
//   ""        all visible GPUs (CUDA_VISIBLE_DEVICES applies); CPU ranks when none
//             is visible.
//   "cpu"     CPU ranks (case-insensitive).
//   "0,1,3"   those CUDA ordinals in that order: rank i runs on the i-th listed one.
//   "cuda:0,cuda:1", "cpu:0,cpu:1"
//             PyTorch's device names (case-insensitive): "cuda:K" is ordinal K
//             ("cuda" without K is an error); a list of "cpu" / "cpu:K" tokens
//             is one CPU rank per token (any number K, repeats too: CPU ranks
//             share the host), so "cpu:3" alone is ONE rank. CPU and GPU tokens
//             in one list are an error naming one of each.
// nprocs:
//   -1        one rank per listed device (1 for "cpu").
//   1..N      the first nprocs listed devices (nprocs CPU ranks for "cpu").
//   more than listed, 0 or below -1: an error.
// More than kMaxRanksPerProcess ranks (a typo such as nprocs 100000) is an error
// before any list of that length is built.
// Tokens are checked before any CUDA or NCCL call: empty tokens, signs, non-numbers,
// overflow, ordinals that are not visible and duplicates are errors that name the
// bad token and what is visible. Duplicates ("0,0") are allowed only with
// share_devices: those ranks then share the GPU through the in-process
// communicator. The selected ranks (after nprocs) must then all be on ONE GPU:
// a mix such as "0,0,1,1" (two GPUs, each shared) is an error naming the list,
// since the in-process communicator reduces on one device and NCCL refuses two
// ranks on one GPU.
#ifndef TANDEM_SPAWN_DEVICES_H_
#define TANDEM_SPAWN_DEVICES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nn/device.h"

namespace tandem::dist {

// The most rank threads one process runs (more: use several processes).
inline constexpr int kMaxRanksPerProcess = 1024;

// visible_gpus: how many CUDA devices this process sees (nn::cuda_device_count()).
// Returns one device per rank, rank order. Thread-safe (pure function).
absl::StatusOr<std::vector<nn::Device>> SelectDevices(absl::string_view gpus, int nprocs,
                                                      int visible_gpus, bool share_devices);

// The same with the GPUs this process sees.
absl::StatusOr<std::vector<nn::Device>> SelectDevices(absl::string_view gpus, int nprocs,
                                                      bool share_devices);

// The GPU ordinals a gpus list names, in order ("0,cuda:1,1": 0, 1, 1; none for
// "", "cpu" or a list of CPU names), with the syntax checks of SelectDevices
// (visible_gpus only words its messages; visibility is not checked).
absl::StatusOr<std::vector<int>> ParseGpuOrdinals(absl::string_view gpus, int visible_gpus);

// "no GPU is visible" or "2 GPUs are visible (ordinals 0..1)", plus the
// CUDA_VISIBLE_DEVICES setting when one is set.
std::string DescribeVisibleGpus(int visible_gpus);

// True when two ranks of `devices` use the same GPU.
bool HasSharedGpu(const std::vector<nn::Device>& devices);

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_DEVICES_H_
