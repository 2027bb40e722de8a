#include "testing/equivalence.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tandem::testing {
namespace {

bool Close(double n_ranks, double one_rank, const Tolerance& tol) {
  if (std::isnan(n_ranks) || std::isnan(one_rank)) {
    return std::isnan(n_ranks) && std::isnan(one_rank);
  }
  if (n_ranks == one_rank) return true;  // infinities of one sign too
  return std::fabs(n_ranks - one_rank) <= tol.atol + tol.rtol * std::fabs(one_rank);
}

std::string Prefix(int ranks, int64_t step) {
  return absl::StrCat(ranks, " ranks differ from 1 rank at step ", step, ": ");
}

Difference ValueDifference(int ranks, int64_t step, std::string what, int rank, int64_t element,
                           double n_ranks, double one_rank, const Tolerance& tol) {
  Difference d{.step = step,
               .what = std::move(what),
               .rank = rank,
               .element = element,
               .n_ranks = n_ranks,
               .one_rank = one_rank};
  const std::string name =
      element >= 0 ? absl::StrCat("parameter ", d.what, "[", element, "] on rank ", rank)
                   : absl::StrCat("loss (", ranks, " ranks' losses combined)");
  d.message = absl::StrCat(
      Prefix(ranks, step), name, ": ", absl::StrFormat("%.9g", n_ranks), " (", ranks,
      " ranks) vs ", absl::StrFormat("%.9g", one_rank), " (1 rank); |difference| ",
      absl::StrFormat("%.3g", std::fabs(n_ranks - one_rank)), " > ",
      absl::StrFormat("%.3g", tol.atol + tol.rtol * std::fabs(one_rank)), " (atol ", tol.atol,
      " + rtol ", tol.rtol, " * |1-rank value|)");
  return d;
}

Difference ShapeDifference(int ranks, int64_t step, std::string what, int rank,
                           std::string detail) {
  Difference d{.step = step, .what = std::move(what), .rank = rank};
  d.message = absl::StrCat(Prefix(ranks, step), d.what, " on rank ", rank, ": ", detail);
  return d;
}

std::string Names(const std::vector<NamedValues>& params) {
  std::vector<std::string> names;
  for (const NamedValues& p : params) names.push_back(p.name);
  return absl::StrCat("[", absl::StrJoin(names, ", "), "]");
}

std::string ShapeString(const nn::Shape& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// Rank `rank`'s parameters at `step` against the one-rank run's, name, shape
// and value of each; the first difference or nullopt.
std::optional<Difference> CompareParameters(int ranks, int64_t step, int rank,
                                            const std::vector<NamedValues>& mine,
                                            const std::vector<NamedValues>& ref,
                                            const Tolerance& tol, size_t index) {
  const NamedValues& a = mine[index];
  const NamedValues& b = ref[index];
  if (a.shape != b.shape || a.values.size() != b.values.size()) {
    return ShapeDifference(ranks, step, "parameter shapes", rank,
                           absl::StrCat(a.name, " is ", ShapeString(a.shape), " with ", ranks,
                                        " ranks, ", ShapeString(b.shape), " with 1"));
  }
  for (size_t i = 0; i < a.values.size(); ++i) {
    if (!Close(a.values[i], b.values[i], tol)) {
      return ValueDifference(ranks, step, a.name, rank, static_cast<int64_t>(i), a.values[i],
                             b.values[i], tol);
    }
  }
  return std::nullopt;
}

// Everything of one step: the combined loss, then each parameter of each rank.
std::optional<Difference> CompareStep(const RankRecord& ref, const std::vector<RankRecord>& many,
                                      int64_t step, const EquivalenceOptions& options) {
  const int ranks = static_cast<int>(many.size());
  double combined = 0;
  for (const RankRecord& r : many) combined += r.losses[step];
  if (options.combine_losses == LossCombine::kMean) combined /= ranks;
  if (!Close(combined, ref.losses[step], options.losses)) {
    return ValueDifference(ranks, step, "loss", -1, -1, combined, ref.losses[step],
                           options.losses);
  }
  const std::vector<NamedValues>& ref_params = ref.parameters[step];
  for (int r = 0; r < ranks; ++r) {
    const std::vector<NamedValues>& mine = many[r].parameters[step];
    bool same_names = mine.size() == ref_params.size();
    for (size_t i = 0; same_names && i < mine.size(); ++i) {
      same_names = mine[i].name == ref_params[i].name;
    }
    if (!same_names) {
      return ShapeDifference(ranks, step, "parameter names", r,
                             absl::StrCat(Names(mine), " with ", ranks, " ranks, ",
                                          Names(ref_params), " with 1"));
    }
  }
  for (size_t i = 0; i < ref_params.size(); ++i) {
    for (int r = 0; r < ranks; ++r) {
      std::optional<Difference> d = CompareParameters(ranks, step, r, many[r].parameters[step],
                                                      ref_params, options.parameters, i);
      if (d.has_value()) return d;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<Difference> CompareRuns(const RunReport& one_rank, const RunReport& n_ranks,
                                      const EquivalenceOptions& options) {
  const int ranks = static_cast<int>(n_ranks.ranks.size());
  if (one_rank.ranks.size() != 1 || ranks < 1) {
    Difference d{.what = "rank count"};
    d.message = absl::StrCat("cannot compare: the one-rank run recorded ", one_rank.ranks.size(),
                             " ranks, the N-rank run ", ranks);
    return d;
  }
  const RankRecord& ref = one_rank.ranks[0];
  int64_t steps = static_cast<int64_t>(ref.losses.size());
  for (const RankRecord& r : n_ranks.ranks) {
    steps = std::min(steps, static_cast<int64_t>(r.losses.size()));
  }
  for (int64_t step = 0; step < steps; ++step) {
    std::optional<Difference> d = CompareStep(ref, n_ranks.ranks, step, options);
    if (d.has_value()) return d;
  }
  for (int r = 0; r < ranks; ++r) {
    const size_t mine = n_ranks.ranks[r].losses.size();
    if (mine != ref.losses.size()) {
      return ShapeDifference(ranks, steps, "step count", r,
                             absl::StrCat(mine, " steps recorded with ", ranks, " ranks, ",
                                          ref.losses.size(), " with 1"));
    }
  }
  return std::nullopt;
}

absl::Status CheckEquivalence(const TrainingFunction& fn, const EquivalenceOptions& options,
                              EquivalenceReport* report) {
  if (options.ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("EquivalenceOptions::ranks must be at least 1, not ", options.ranks));
  }
  for (const Tolerance& t : {options.parameters, options.losses}) {
    if (!(t.rtol >= 0) || !(t.atol >= 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "EquivalenceOptions: tolerances must be >= 0, not rtol ", t.rtol, " atol ", t.atol));
    }
  }
  EquivalenceReport local;
  EquivalenceReport& out = report != nullptr ? *report : local;
  out = EquivalenceReport();
  auto run = [&](int ranks, RunReport* into) {
    RunOptions run_options{.ranks = ranks, .gpus = options.gpus, .spawn = options.spawn};
    absl::Status s = RunRanks(fn, run_options, into);
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat(ranks == 1 ? "the one-rank run: "
                                                          : absl::StrCat("the ", ranks,
                                                                         "-rank run: "),
                                               s.message()));
  };
  absl::Status one = run(1, &out.one_rank);
  if (!one.ok()) return one;
  absl::Status many = run(options.ranks, &out.n_ranks);
  if (!many.ok()) return many;
  out.first_difference = CompareRuns(out.one_rank, out.n_ranks, options);
  out.steps_compared = static_cast<int64_t>(out.one_rank.ranks[0].losses.size());
  if (out.first_difference.has_value()) {
    return absl::InternalError(out.first_difference->message);
  }
  return absl::OkStatus();
}

}  // namespace tandem::testing
