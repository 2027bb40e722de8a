#include "testing/run.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nn/status_macros.h"
#include "testing/internal/fault_plan.h"
#include "testing/seed.h"

namespace tandem::testing {

StepLog::StepLog(dist::Context& ctx, RankRecord* record, internal::FaultPlan* plan,
                 bool record_parameters)
    : ctx_(ctx), record_(record), plan_(plan), record_parameters_(record_parameters) {}

absl::Status StepLog::EndStep(const nn::Tensor& loss, const nn::Module& module) {
  if (!loss.defined() || loss.numel() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("StepLog::EndStep: the loss must be a tensor of one element, not ",
                     loss.defined() ? loss.ToString() : "an undefined tensor"));
  }
  return Record(loss.detach().item(), &module);
}

absl::Status StepLog::EndStep(double loss, const nn::Module& module) {
  return Record(loss, &module);
}

absl::Status StepLog::EndStep(double loss) { return Record(loss, nullptr); }

absl::Status StepLog::Record(double loss, const nn::Module* module) {
  const int64_t step = steps();
  record_->losses.push_back(loss);
  std::vector<NamedValues> params;
  if (module != nullptr && record_parameters_) {
    for (const auto& [name, p] : module->named_parameters()) {
      params.push_back({name, p.shape(),
                        p.detach().to(nn::Device::CPU()).to(nn::kFloat64).to_vector<double>()});
    }
  }
  record_->parameters.push_back(std::move(params));
  if (plan_ == nullptr) return absl::OkStatus();
  return plan_->AtStep(ctx_.rank(), step, ctx_.stop_token());
}

namespace {

absl::Status ValidateRunOptions(const RunOptions& options) {
  if (options.ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunOptions::ranks must be at least 1, not ", options.ranks));
  }
  if (options.fake_group != nullptr && options.fake_group->world_size() != options.ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RunOptions::fake_group has ", options.fake_group->world_size(),
        " ranks; the run has ", options.ranks, " (RunOptions::ranks)"));
  }
  if (!(options.hang_limit_s > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunOptions::hang_limit_s must be positive, not ", options.hang_limit_s));
  }
  return ValidateFaults(options.faults, options.ranks);
}

}  // namespace

absl::Status RunRanks(const TrainingFunction& fn, const RunOptions& options, RunReport* report) {
  RETURN_IF_ERROR(ValidateRunOptions(options));
  internal::FaultPlan plan(options.faults, options.ranks, options.hang_limit_s);
  std::ostringstream captured;
  dist::SpawnOptions spawn = options.spawn;
  if (spawn.console == nullptr) spawn.console = &captured;
  dist::SpawnHooks hooks;
  if (options.fake_group != nullptr) {
    hooks.make_communicators = MakeFakeCommunicators(options.fake_group);
  }
  if (!options.faults.empty()) {
    hooks.wrap_communicators = [&plan](std::vector<std::unique_ptr<dist::Communicator>> comms) {
      return plan.Wrap(std::move(comms));
    };
  }
  std::vector<RankRecord> records;
  std::vector<int> attempts;  // per rank
  std::optional<ScopedDeterminism> determinism;
  if (options.deterministic) determinism.emplace();
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = dist::RunSpawnWithHooks(
      options.gpus, options.ranks, spawn, hooks,
      [&](int local_ranks) {
        records.resize(local_ranks);
        attempts.assign(local_ranks, 1);
      },
      [&](dist::Context& ctx) -> absl::Status {
        RankRecord& record = records[ctx.local_rank()];
        if (ctx.attempt() > 0) {
          // A restart: the steps after the one resumed from are run again.
          const auto kept = static_cast<size_t>(ctx.attempt_info().resume_step.value_or(0));
          if (record.losses.size() > kept) record.losses.resize(kept);
          if (record.parameters.size() > kept) record.parameters.resize(kept);
          attempts[ctx.local_rank()] = ctx.attempt() + 1;
        }
        StepLog log(ctx, &record, &plan, options.record_parameters);
        return fn(ctx, log);
      });
  if (report != nullptr) {
    report->seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report->ranks = std::move(records);
    report->faults = plan.events();
    report->attempts = attempts.empty() ? 0 : *std::max_element(attempts.begin(), attempts.end());
    report->log = captured.str();
  }
  return status;
}

}  // namespace tandem::testing
