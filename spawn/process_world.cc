#include "spawn/internal/process_world.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "spawn/comm/mpi/hierarchical_communicator.h"
#include "nn/status_macros.h"
#include "spawn/options.h"
#include "spawn/signals.h"
#include "spawn/internal/startup.h"
#if TANDEM_WITH_CUDA
#include "spawn/comm/nccl/nccl_communicator.h"
#endif

namespace tandem::dist::internal {
namespace {

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : std::string();
}

// How the processes' collectives are compared: unset or "rounds" (by the step
// agreement's rounds, ControlPlane), "each" (also before each collective, a
// round trip more: HierarchicalExchange::CheckEachCollective).
constexpr char kCheckCollectivesEnv[] = "TANDEM_CHECK_COLLECTIVES";

#if TANDEM_WITH_MPI
absl::Status CheckCollectivesSetting() {
  const std::string value = Env(kCheckCollectivesEnv);
  if (value.empty() || value == "rounds" || value == "each") return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "spawn: ", kCheckCollectivesEnv, "=\"", value,
      "\" is not a setting: unset or \"rounds\" (the processes' collectives compared by the "
      "step agreement's rounds), or \"each\" (also before each collective)"));
}
#endif

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

void Put(std::string* out, absl::string_view field) { absl::StrAppend(out, field.size(), ":", field); }

// Reads one length-prefixed field from *in; false when malformed.
bool Take(absl::string_view* in, std::string* field) {
  const size_t colon = in->find(':');
  size_t length = 0;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(in->substr(0, colon), &length) ||
      in->size() - colon - 1 < length) {
    return false;
  }
  *field = std::string(in->substr(colon + 1, length));
  in->remove_prefix(colon + 1 + length);
  return true;
}

// "process 1 (host h, pid 7, ranks 2..3)": process p, whose first global rank is `first`.
std::string ProcessName(const std::vector<ProcessInfo>& processes, size_t p, int first) {
  const int count = static_cast<int>(processes[p].devices.size());
  return absl::StrCat("process ", p, " (host ", processes[p].host, ", pid ", processes[p].pid,
                      ", rank", count > 1 ? absl::StrCat("s ", first, "..", first + count - 1)
                                          : absl::StrCat(" ", first),
                      ")");
}

std::string Where(const std::vector<ProcessInfo>& processes, size_t p) {
  return absl::StrCat("host ", processes[p].host, " (process ", p, ")");
}

// "name: v0 on host a (process 0), v1 on host b (process 1)", at most 8 entries.
std::string Disagreement(absl::string_view name, const std::vector<ProcessInfo>& processes,
                         const std::vector<std::string>& values) {
  std::string text = absl::StrCat(name, ":");
  for (size_t p = 0; p < values.size() && p < 8; ++p) {
    absl::StrAppend(&text, p ? ", " : " ", values[p], " on ", Where(processes, p));
  }
  if (values.size() > 8) absl::StrAppend(&text, ", ... (", values.size(), " processes)");
  return text;
}

bool AllEqual(const std::vector<std::string>& values) {
  for (const std::string& v : values) {
    if (v != values[0]) return false;
  }
  return true;
}

}  // namespace

}  // namespace tandem::dist::internal

namespace tandem::dist {
LaunchInfo DetectLaunch() {
  const internal::LauncherEnv env = internal::DetectLauncher();
  return {.processes = env.size, .index = env.rank, .evidence = env.evidence};
}
}  // namespace tandem::dist

namespace tandem::dist::internal {

std::vector<std::pair<std::string, std::string>> NcclEnvironmentToAgree() {
  struct Setting {
    const char* name;
    const char* unset;  // what spawn runs with when it is unset
  };
  std::vector<std::pair<std::string, std::string>> entries;
  for (const Setting& s : {Setting{"NCCL_LAUNCH_MODE", "(unset)"},
                           Setting{"NCCL_GRAPH_REGISTER", "0"},
                           Setting{"NCCL_RUNTIME_CONNECT", "0"},
                           Setting{"NCCL_COMM_BLOCKING", "(unset)"},
                           Setting{"NCCL_ALGO", "(unset)"}, Setting{"NCCL_PROTO", "(unset)"}}) {
    const char* value = std::getenv(s.name);
    entries.emplace_back(absl::StrCat("environment ", s.name),
                         value != nullptr ? std::string(value) : std::string(s.unset));
  }
  return entries;
}

std::string SerializeProcessInfo(const ProcessInfo& info) {
  std::string out;
  Put(&out, info.host);
  Put(&out, absl::StrCat(info.pid));
  Put(&out, absl::StrJoin(info.devices, ","));
  Put(&out, absl::StrJoin(info.gpu_ids, ","));
  Put(&out, info.build);
  Put(&out, absl::StrCat(info.agreed.size()));
  for (const auto& [name, value] : info.agreed) {
    Put(&out, name);
    Put(&out, value);
  }
  return out;
}

absl::StatusOr<ProcessInfo> ParseProcessInfo(absl::string_view bytes) {
  ProcessInfo info;
  std::string pid, devices, gpu_ids, count;
  size_t agreed = 0;
  const absl::Status bad = absl::DataLossError(absl::StrCat(
      "process record of ", bytes.size(), " bytes is malformed (another build of tandem?)"));
  if (!Take(&bytes, &info.host) || !Take(&bytes, &pid) || !Take(&bytes, &devices) ||
      !Take(&bytes, &gpu_ids) || !Take(&bytes, &info.build) || !Take(&bytes, &count) ||
      !absl::SimpleAtoi(pid, &info.pid) || !absl::SimpleAtoi(count, &agreed)) {
    return bad;
  }
  if (!devices.empty()) info.devices = absl::StrSplit(devices, ',');
  if (!gpu_ids.empty()) info.gpu_ids = absl::StrSplit(gpu_ids, ',');
  for (size_t i = 0; i < agreed; ++i) {
    std::string name, value;
    if (!Take(&bytes, &name) || !Take(&bytes, &value)) return bad;
    info.agreed.emplace_back(std::move(name), std::move(value));
  }
  if (!bytes.empty()) return bad;
  return info;
}

absl::Status CheckAgreement(const std::vector<ProcessInfo>& processes, bool share_devices) {
  auto column = [&](auto get) {
    std::vector<std::string> values;
    for (const ProcessInfo& p : processes) values.push_back(get(p));
    return values;
  };
  std::vector<std::string> errors;
  const std::vector<std::string> builds = column([](const ProcessInfo& p) { return p.build; });
  if (!AllEqual(builds)) errors.push_back(Disagreement("tandem build", processes, builds));
  // Every name any process set, in first-seen order.
  std::vector<std::string> names;
  for (const ProcessInfo& p : processes) {
    for (const auto& [name, value] : p.agreed) {
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
  }
  for (const std::string& name : names) {
    const std::vector<std::string> values = column([&](const ProcessInfo& p) {
      for (const auto& [n, v] : p.agreed) {
        if (n == name) return v;
      }
      return std::string("(not set)");
    });
    if (!AllEqual(values)) errors.push_back(Disagreement(name, processes, values));
  }
  const std::vector<std::string> kinds = column([](const ProcessInfo& p) {
    return std::string(!p.devices.empty() && p.devices[0] == "cpu" ? "CPU ranks" : "GPU ranks");
  });
  if (!AllEqual(kinds)) errors.push_back(Disagreement("device kind", processes, kinds));
  // One GPU in two processes is an error with or without share_devices: NCCL
  // refuses it ("Duplicate GPU"), and share_devices shares a GPU between the
  // ranks of one process only.
  std::map<std::pair<std::string, std::string>, size_t> owner;  // (host, gpu) -> process
  for (size_t p = 0; p < processes.size(); ++p) {
    for (const std::string& gpu : processes[p].gpu_ids) {
      auto [it, fresh] = owner.emplace(std::pair{processes[p].host, gpu}, p);
      if (!fresh && it->second != p) {
        errors.push_back(absl::StrCat(
            "GPU ", gpu, " of host ", processes[p].host, " is claimed by process ", it->second,
            " and process ", p, " (give each process its own --gpus",
            share_devices ? "; share_devices shares a GPU between the ranks of one process only"
                          : ", or put the ranks that share it in one process with share_devices",
            ")"));
      }
    }
  }
  if (errors.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the processes of this job disagree: ", absl::StrJoin(errors, "; ")));
}

// --- ProcessWorld ---------------------------------------------------------------------

ProcessWorld::ProcessWorld(int process_index, std::vector<ProcessInfo> processes,
                           std::unique_ptr<ProcessTransport> transport)
    : process_index_(process_index),
      processes_(std::move(processes)),
      transport_(std::move(transport)) {
  local_ranks_ = static_cast<int>(processes_[process_index_].devices.size());
  for (int p = 0; p < static_cast<int>(processes_.size()); ++p) {
    if (p < process_index_) rank_offset_ += static_cast<int>(processes_[p].devices.size());
    world_size_ += static_cast<int>(processes_[p].devices.size());
  }
}

ProcessWorld::~ProcessWorld() = default;

std::string ProcessWorld::Where() const { return absl::StrCat("host ", host(), ", pid ", pid()); }

std::vector<std::pair<std::string, std::string>> ProcessWorld::Describe() const {
  std::vector<std::pair<std::string, std::string>> lines;
  lines.emplace_back("processes", absl::StrCat(processes_.size(), " (this is process ",
                                               process_index_, ", through MPI)"));
  int first = 0;
  for (size_t p = 0; p < processes_.size(); ++p) {
    const ProcessInfo& info = processes_[p];
    const int count = static_cast<int>(info.devices.size());
    lines.emplace_back(absl::StrCat("process ", p),
                       absl::StrCat("host ", info.host, ", pid ", info.pid, ": rank",
                                    count > 1 ? "s " : " ", first,
                                    count > 1 ? absl::StrCat("..", first + count - 1) : "", " on ",
                                    absl::StrJoin(info.devices, " ")));
    first += count;
  }
  return lines;
}

std::string ProcessWorld::NameOf(int process) const {
  int first = 0;
  for (int q = 0; q < process; ++q) first += static_cast<int>(processes_[q].devices.size());
  return ProcessName(processes_, process, first);
}

std::vector<std::unique_ptr<Communicator>> ProcessWorld::MakeCommunicators(
    const std::vector<nn::Device>& local_devices) {
  std::vector<int> ranks_per_process;
  for (const ProcessInfo& p : processes_) ranks_per_process.push_back(static_cast<int>(p.devices.size()));
  exchange_ = std::make_shared<HierarchicalExchange>(process_index_, std::move(ranks_per_process),
                                                     transport_.get());
  // The processes agreed on the setting (JoinProcesses), so all check alike.
  if (Env(kCheckCollectivesEnv) == "each") {
    exchange_->CheckEachCollective([this](int p) { return NameOf(p); });
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int l = 0; l < static_cast<int>(local_devices.size()); ++l) {
    comms.push_back(std::make_unique<HierarchicalCommunicator>(l, local_devices[l], exchange_));
  }
  return comms;
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> ProcessWorld::MakeNcclCommunicators(
    const std::vector<nn::Device>& local_devices) {
  // The check compares what goes through the hierarchical exchange; NCCL carries
  // GPU ranks' collectives, which it does not see: refused rather than silently
  // unchecked (every process agreed on the setting, so every process refuses).
  if (Env(kCheckCollectivesEnv) == "each") {
    return absl::FailedPreconditionError(absl::StrCat(
        "spawn: ", kCheckCollectivesEnv, "=each compares the collectives of CPU ranks between "
        "processes (ranks sharing a GPU run in one process only); these ranks are GPU "
        "ranks whose collectives NCCL carries, which the check cannot see: unset it "
        "(NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS=COLL makes NCCL log each collective)"));
  }
#if TANDEM_WITH_CUDA
  std::string id(128, '\0');
  if (process_index_ == 0) {
    ASSIGN_OR_RETURN(id, NcclUniqueIdBytes());
  }
  // Every process learns the id's size from the build (the agreement checked it
  // is the same build); process 0's bytes go to all.
  auto broadcast = [&] {
    return transport_->Broadcast(id.data(), static_cast<int64_t>(id.size()), 0);
  };
  if (startup_ != nullptr) {
    startup_->WaitForOthers(broadcast, "in the exchange of NCCL's unique id");
    RETURN_IF_ERROR(startup_->Enter("", "initialising NCCL's communicators (ncclGroupEnd waits "
                                        "for every process)", /*waits_for_others=*/true));
  } else {
    std::unique_ptr<PendingOp> op = broadcast();
    try {
      while (!op->Test()) std::this_thread::yield();
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("spawn: broadcasting NCCL's unique id: ", e.what()));
    }
  }
  return CreateNcclCommunicatorsAcross(local_devices, id, rank_offset_, world_size_);
#else
  (void)local_devices;
  return absl::FailedPreconditionError("spawn: GPU ranks in a build without CUDA");
#endif
}

std::unique_ptr<PendingOp> ProcessWorld::StartBarrier() { return transport_->Barrier(); }

void ProcessWorld::RankExited(int local_rank) {
  exited_.fetch_add(1, std::memory_order_acq_rel);
  if (exchange_) exchange_->RankExited(local_rank);
}

void ProcessWorld::Serve(std::stop_token stop, ServeHooks hooks) {
  if (hooks.agreement != nullptr) {
    control_ = std::make_unique<ControlPlane>(
        transport_.get(), std::move(hooks),
        [this] { return local_ranks_ - exited_.load(std::memory_order_acquire); },
        [this](const std::vector<int64_t>& slots) {
          const size_t n = processes_.size();
          std::lock_guard<std::mutex> lock(progress_mutex_);
          progress_.at = std::chrono::steady_clock::now();
          progress_.entered.assign(slots.begin(), slots.begin() + n);
          progress_.returned_entered.assign(slots.begin() + n, slots.begin() + 2 * n);
          progress_.returned_rank.assign(slots.begin() + 2 * n, slots.end());
        },
        CollectiveCheck{.exchange = exchange_.get(),
                        .name = [this](int p) { return NameOf(p); }});
  }
  if (exchange_) {
    exchange_->Serve(std::move(stop), control_.get());
    return;
  }
  // GPU ranks (NCCL carries their traffic): only the rounds, until every process's
  // ranks exited; on a stop, once the local ranks exited.
  while (true) {
    if (stop.stop_requested() || !control_) {
      if (exited_.load(std::memory_order_acquire) >= local_ranks_) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    if (!control_->Tick(stop)) {
      if (stop.stop_requested()) continue;  // a round failed: wait for the ranks to leave
      return;
    }
    std::this_thread::sleep_for(control_->NextWait());
  }
}

namespace {

// The state letter of /proc/<pid>/stat ('R', 'S', 'T' stopped, ...), or 0 when
// there is no such process (or no /proc).
char ProcessState(int64_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // the command name may hold spaces
  return close != std::string::npos && close + 2 < stat.size() ? stat[close + 2] : 0;
}

// "; process 1 (...) is stopped (SIGSTOP or a debugger)" for each process other
// than `self` on `host` that /proc shows stopped, exited or waiting in the kernel.
std::string LocalProcessStates(const std::vector<ProcessInfo>& processes, int self,
                               const std::string& host) {
  std::string text;
  int first = 0;
  for (size_t p = 0; p < processes.size(); ++p) {
    if (static_cast<int>(p) != self && processes[p].host == host) {
      const char state = ProcessState(processes[p].pid);
      if (state == 'T' || state == 't') {
        absl::StrAppend(&text, "; ", ProcessName(processes, p, first),
                        " is stopped (SIGSTOP or a debugger)");
      } else if (state == 0 || state == 'Z' || state == 'X') {
        absl::StrAppend(&text, "; ", ProcessName(processes, p, first), " has exited");
      } else if (state == 'D') {
        absl::StrAppend(&text, "; ", ProcessName(processes, p, first),
                        " waits in the kernel (I/O)");
      }
    }
    first += static_cast<int>(processes[p].devices.size());
  }
  return text;
}

// "; at that exchange not yet at #N: process 1 (...) at #M, ...": the processes
// that had not entered collective #`waiting_for` at the last round, or "" when
// none or when every process was at the same collective (that says nothing).
std::string LateProcesses(const std::vector<ProcessInfo>& processes,
                          const std::vector<int64_t>& entered, uint64_t waiting_for) {
  std::string late;
  bool all_same = true;
  int first = 0;
  for (size_t p = 0; p < processes.size(); ++p) {
    all_same = all_same && entered[p] == entered[0];
    if (entered[p] < static_cast<int64_t>(waiting_for)) {
      absl::StrAppend(&late, late.empty() ? "" : ", ", ProcessName(processes, p, first), " at #",
                      entered[p]);
    }
    first += static_cast<int>(processes[p].devices.size());
  }
  if (late.empty() || all_same) return "";
  return absl::StrCat("; at that exchange not yet at #", waiting_for, ": ", late);
}

}  // namespace

std::string ProcessWorld::DescribeLocalPeers() const {
  return LocalProcessStates(processes_, process_index_, host());
}

std::string ProcessWorld::DescribeProgress(uint64_t waiting_for) const {
  ProcessProgress progress;
  {
    std::lock_guard<std::mutex> lock(progress_mutex_);
    progress = progress_;
  }
  const bool rounds = progress.entered.size() == processes_.size();
  const double age_s =
      rounds ? std::chrono::duration<double>(std::chrono::steady_clock::now() - progress.at).count()
             : 0;
  std::string text =
      rounds ? absl::StrFormat(" the processes' last exchange (a step-agreement round) completed "
                               "%.2f s ago", age_s)
             : " no exchange between the processes (step-agreement round) has completed yet";
  if (!rounds || age_s > 1.0) {
    // Rounds stalled: a process does not take part. Processes of this host can
    // be looked at directly.
    absl::StrAppend(&text, ": a process stopped responding",
                    LocalProcessStates(processes_, process_index_, host()));
  }
  if (!rounds) return text;
  // Who had not entered the collective at the last round (when that says anything).
  absl::StrAppend(&text, LateProcesses(processes_, progress.entered, waiting_for));
  return text;
}

std::vector<ReturnedElsewhere> ProcessWorld::ReturnedRanksElsewhere() const {
  std::vector<int64_t> entered, rank;
  {
    std::lock_guard<std::mutex> lock(progress_mutex_);
    entered = progress_.returned_entered;
    rank = progress_.returned_rank;
  }
  std::vector<ReturnedElsewhere> out;
  int first = 0;
  for (size_t p = 0; p < processes_.size(); ++p) {
    const int count = static_cast<int>(processes_[p].devices.size());
    if (static_cast<int>(p) != process_index_ && p < entered.size() && entered[p] >= 0 &&
        rank[p] >= first && rank[p] < first + count) {
      // As that process's watchdog names it: "rank R (device, host h, pid p)".
      out.push_back({.name = absl::StrCat("rank ", rank[p], " (",
                                          processes_[p].devices[rank[p] - first], ", host ",
                                          processes_[p].host, ", pid ", processes_[p].pid, ")"),
                     .entered = static_cast<uint64_t>(entered[p])});
    }
    first += count;
  }
  return out;
}

// --- ControlPlane -----------------------------------------------------------------------

ControlPlane::ControlPlane(ProcessTransport* transport, ServeHooks hooks,
                           std::function<int()> running,
                           std::function<void(const std::vector<int64_t>&)> progress,
                           CollectiveCheck check)
    : transport_(transport),
      hooks_(std::move(hooks)),
      running_(std::move(running)),
      progress_(std::move(progress)),
      check_(std::move(check)),
      processes_(transport->process_count()),
      base_slots_(kFixed + (4 + Fingerprint::kWords) * processes_ +
                  2 * Fingerprint::kWords * kCheckWindow),
      buffer_(base_slots_, 0) {}

ControlPlane::~ControlPlane() { AbandonRound(); }

void ControlPlane::AbandonRound() {
  // Freeing an active non-blocking collective's request is erroneous MPI; the
  // job is being aborted, so the request (and its buffer) is left.
  if (op_ == nullptr) return;
  (void)op_.release();
  new std::vector<int64_t>(std::move(buffer_));  // leaked on purpose: MPI may still write
}

bool ControlPlane::Tick(const std::stop_token& stop) {
  if (finished_) return false;
  try {
    return TickOrThrow(stop);
  } catch (const std::exception& e) {
    finished_ = true;
    AbandonRound();  // in an unknown state: left to MPI (the job aborts)
    hooks_.fail(absl::InternalError(absl::StrCat(
        "spawn: the step agreement's round between processes failed: ", e.what())));
    return false;
  }
}

bool ControlPlane::TickOrThrow(const std::stop_token& stop) {
  const auto now = std::chrono::steady_clock::now();
  if (op_ != nullptr) {
    if (!op_->Test()) return true;
    op_.reset();
    hooks_.agreement->ApplyRound({.stop_code = buffer_[0], .save_wanted = buffer_[1],
                                  .arrived = buffer_[2]});
    progress_(std::vector<int64_t>(buffer_.begin() + kFixed,
                                   buffer_.begin() + kFixed + 3 * processes_));
    CheckCollectives();
    if (buffer_[3] == 0) {  // no process has a running rank: the last round, once
      // the last collectives are compared too (every process decides alike)
      if (!CollectivesCompared()) {
        next_round_ = now;
        return true;
      }
      finished_ = true;
      return false;
    }
    next_round_ = now + kRoundPeriod;
  }
  // Ranks first, then the stop: a failing rank requests the stop before it
  // exits, so a process that is failing never reports "no running rank" (which
  // could let the others finish the last round and return before its Abort).
  const bool running = running_() > 0 || (hooks_.exits_polled && !hooks_.exits_polled());
  if (stop.stop_requested()) return true;
  // Processes whose ranks all exited keep the cadence: the last process to
  // finish starts the final round at once, and the others join it within a period.
  urgent_ = hooks_.agreement->Urgent();
  if (!urgent_ && now < next_round_) return true;
  const StepAgreement::Round mine = hooks_.agreement->LocalRound();
  // A probe round (the same round on every process: probe_ comes from the
  // rounds) carries the labels too; the others do not.
  buffer_.resize(base_slots_ + (probe_ != 0 ? static_cast<size_t>(processes_) * kLabelWords : 0));
  std::fill(buffer_.begin(), buffer_.end(), INT64_MIN);
  buffer_[0] = mine.stop_code;
  buffer_[1] = mine.save_wanted;
  buffer_[2] = mine.arrived;
  buffer_[3] = running ? 1 : 0;
  const int processes = transport_->process_count();
  const int me = transport_->process_index();
  buffer_[kFixed + me] =
      hooks_.collectives_entered ? static_cast<int64_t>(hooks_.collectives_entered()) : 0;
  // A returned rank's count is final, so a stale round never misreports it.
  if (hooks_.returned_rank) {
    if (const auto returned = hooks_.returned_rank(); returned.has_value()) {
      buffer_[kFixed + processes + me] = static_cast<int64_t>(returned->first);
      buffer_[kFixed + 2 * processes + me] = returned->second;
    }
  }
  PutCollectives();
  op_ = transport_->ControlAllReduceMax(buffer_.data(), static_cast<int>(buffer_.size()));
  return true;
}

void ControlPlane::PutCollectives() {
  const HierarchicalExchange* exchange = check_.exchange;
  if (exchange == nullptr) return;
  const int me = transport_->process_index();
  started_slots()[me] = static_cast<int64_t>(exchange->started());
  if (probe_ != 0) {
    const Fingerprint fingerprint = exchange->FingerprintOf(probe_).value_or(Fingerprint{});
    probe_slots()[me * Fingerprint::kWords] = fingerprint.shape;
    probe_slots()[me * Fingerprint::kWords + 1] = fingerprint.numel;
    PackLabel(exchange->LabelOf(probe_), label_slots() + static_cast<size_t>(me) * kLabelWords);
    return;
  }
  // Per collective, for each of the fingerprint's words: the largest, then the
  // smallest (negated); INT64_MIN: not kept.
  int64_t* window = window_slots();
  for (uint64_t s = checked_ + 1; s <= std::min(common_, checked_ + kCheckWindow); ++s) {
    if (const std::optional<Fingerprint> fingerprint = exchange->FingerprintOf(s)) {
      int64_t* slot = window + 2 * Fingerprint::kWords * (s - checked_ - 1);
      slot[0] = fingerprint->shape;
      slot[1] = -fingerprint->shape;
      slot[2] = fingerprint->numel;
      slot[3] = -fingerprint->numel;
    }
  }
}

bool ControlPlane::CollectivesCompared() const {
  return check_.exchange == nullptr || mismatch_reported_ || (probe_ == 0 && checked_ >= common_);
}

void ControlPlane::CheckCollectives() {
  if (check_.exchange == nullptr || mismatch_reported_) return;
  if (probe_ != 0) {
    const std::string message = MismatchMessage();
    if (!message.empty()) {
      mismatch_reported_ = true;
      hooks_.fail(absl::FailedPreconditionError(message));
      return;
    }
    // No two processes still kept different ones (their histories moved on):
    // count it as compared, so that the rounds never ask for it again.
    checked_ = probe_;
    probe_ = 0;
  } else {
    const int64_t* window = window_slots();
    const uint64_t end = std::min(common_, checked_ + kCheckWindow);
    for (uint64_t s = checked_ + 1; s <= end; ++s) {
      const int64_t* slot = window + 2 * Fingerprint::kWords * (s - checked_ - 1);
      if (slot[0] != INT64_MIN && (slot[0] != -slot[1] || slot[2] != -slot[3])) {
        probe_ = s;
        break;
      }
    }
    if (probe_ == 0) checked_ = end;
  }
  const int64_t* started = started_slots();
  common_ = static_cast<uint64_t>(*std::min_element(started, started + processes_));
  // Far behind (more collectives a round than the window holds): the oldest
  // fingerprints are gone from the history; go on from where they are kept.
  const uint64_t kept = HierarchicalExchange::kFingerprintHistory / 2;
  if (probe_ == 0 && common_ > checked_ + kept) checked_ = common_ - kept;
}

std::string ControlPlane::MismatchMessage() const {
  const int64_t* probe = buffer_.data() + kFixed + 4 * processes_;
  std::vector<Fingerprint> fingerprints(processes_);
  std::vector<std::string> labels(processes_);
  for (int p = 0; p < processes_; ++p) {
    fingerprints[p] = {.shape = probe[p * Fingerprint::kWords],
                       .numel = probe[p * Fingerprint::kWords + 1]};
    labels[p] = UnpackLabel(label_slots() + static_cast<size_t>(p) * kLabelWords);
  }
  return CollectiveMismatch(fingerprints, probe_, check_.name, labels);
}

absl::StatusOr<std::unique_ptr<ProcessWorld>> JoinProcesses(
    const SpawnOptions& options, const std::vector<nn::Device>& local_devices,
    absl::string_view gpus) {
  const LauncherEnv launcher = DetectLauncher();
  const bool join = options.processes == Processes::kOn ||
                    (options.processes == Processes::kAuto && launcher.size > 1);
  if (!join) return std::unique_ptr<ProcessWorld>();
#if !TANDEM_WITH_MPI
  (void)local_devices;
  (void)gpus;
  if (launcher.size > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "spawn: this process was started by a launcher as process ", launcher.rank, " of ",
        launcher.size, " (", launcher.evidence, "), but tandem was built without MPI "
        "(TANDEM_MPI=OFF or MPI not found): the ", launcher.size, " copies would train ",
        launcher.size, " unrelated models. Install openmpi-bin and libopenmpi-dev and rebuild "
        "(TANDEM_MPI=AUTO or ON), or set SpawnOptions::processes = Processes::kOff to run "
        "independent copies on purpose"));
  }
  return absl::FailedPreconditionError(
      "spawn: SpawnOptions::processes is kOn but tandem was built without MPI (TANDEM_MPI=OFF "
      "or MPI not found)");
#else
  ProcessInfo mine;
  mine.host = HostName();
  mine.pid = ::getpid();
  const std::vector<std::string> visible = [] {
    const std::string env = Env("CUDA_VISIBLE_DEVICES");
    return env.empty() ? std::vector<std::string>() : absl::StrSplit(env, ',');
  }();
  for (const nn::Device& d : local_devices) {
    mine.devices.push_back(d.ToString());
    if (d.is_cuda()) {
      // The GPU's UUID names the same card in every process (ordinals and
      // CUDA_VISIBLE_DEVICES entries can differ between processes); the
      // visible entry or the ordinal only where CUDA cannot say.
      const int index = d.index;
      std::string id = nn::cuda_device_uuid(index);
      if (id.empty()) {
        id = index >= 0 && index < static_cast<int>(visible.size()) ? visible[index]
                                                                     : absl::StrCat(index);
      }
      mine.gpu_ids.push_back(std::move(id));
    }
  }
  mine.build = absl::StrCat("tandem ", TANDEM_VERSION, " (CUDA ",
                            nn::cuda_built() ? "on" : "off", ", MPI on)");
  mine.agreed = {{"SpawnOptions::timeout_s", absl::StrCat(options.timeout_s)},
                 {"SpawnOptions::seed", absl::StrCat(options.seed)},
                 {"SpawnOptions::share_devices", options.share_devices ? "true" : "false"}};
  for (const auto& entry : options.must_agree) mine.agreed.push_back(entry);
  // A process that compares before each collective pairs with no other. Unset
  // and "rounds" are one setting (the default), so they agree with each other.
  const std::string check = Env(kCheckCollectivesEnv);
  mine.agreed.push_back({absl::StrCat("environment ", kCheckCollectivesEnv),
                         check.empty() || check == "rounds" ? "rounds (the default)" : check});
  // GPU ranks: NCCL's settings are compared before any NCCL call (the unique
  // id's exchange), so a setting on one host fails every process, named.
  if (!local_devices.empty() && local_devices[0].is_cuda()) {
    for (auto& entry : NcclEnvironmentToAgree()) mine.agreed.push_back(std::move(entry));
  }
  (void)gpus;
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessWorld> world,
                   JoinMpiWorld(launcher, mine, options.share_devices));
  // After the join: every process has the same value, so every one fails alike.
  if (world != nullptr) RETURN_IF_ERROR(CheckCollectivesSetting());
  return world;
#endif
}

}  // namespace tandem::dist::internal
