// The MPI process transport: the only file of tandem that includes mpi.h.
//
// MPI is initialised once per process with MPI_THREAD_FUNNELED by the first spawn
// that joins a world, on that thread; every later MPI call comes from the same
// thread (spawn's caller, the communication thread while ranks run). MPI_Finalize
// runs at exit. Each run works on its own duplicate of MPI_COMM_WORLD, with
// MPI_ERRORS_RETURN so that an MPI error becomes a message, not an abort. While
// the run lasts MPI_COMM_WORLD returns errors too: Open MPI 4.1 reports an error
// that MPI_Test finds in a non-blocking collective (MPI_ERR_TRUNCATE when the
// processes' collectives differ) through MPI_COMM_WORLD's handler, not the
// request's communicator's, and that handler aborts by default (measured: the
// job ended in Open MPI's MPI_ERRORS_ARE_FATAL banner before tandem could say
// which collectives differed). The previous handler is put back after the run.
// The C API only: OpenMPI would otherwise pull in its deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "nn/error.h"
#include "nn/status_macros.h"
#include "spawn/comm/mpi/mpi_transport.h"

namespace tandem::dist::internal {
namespace {

std::once_flag g_init_once;
std::thread::id g_mpi_thread;
std::string g_init_error;

std::string MpiError(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void InitOnce() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    PrepareMpiInit();
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) {
      g_init_error = absl::StrCat("MPI_Init_thread failed: ", MpiError(rc));
      return;
    }
    if (provided < MPI_THREAD_FUNNELED) {
      g_init_error = absl::StrCat("MPI provides thread level ", provided,
                                  ", spawn needs MPI_THREAD_FUNNELED");
      return;
    }
    std::atexit(FinalizeAtExit);
  }
  g_mpi_thread = std::this_thread::get_id();
}

int Int(int64_t bytes) {
  TANDEM_CHECK(bytes >= 0 && bytes <= INT32_MAX, "cross-process message of ", bytes,
               " bytes: over MPI's int count limit (2 GiB); use smaller buckets");
  return static_cast<int>(bytes);
}

void Check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) Fail(what, " failed: ", MpiError(rc));
}

class MpiOp final : public PendingOp {
 public:
  MpiOp(MPI_Request request, const char* what, std::vector<int> keep_a = {},
        std::vector<int> keep_b = {}, std::vector<int> keep_c = {}, std::vector<int> keep_d = {})
      : request_(request), what_(what), a_(std::move(keep_a)), b_(std::move(keep_b)),
        c_(std::move(keep_c)), d_(std::move(keep_d)) {}
  ~MpiOp() override {
    // Only a cancelled run leaves an operation unfinished; the job is aborted
    // next. Every operation here is a non-blocking collective, whose request
    // may not be freed (MPI_Request_free on it is erroneous: OpenMPI reports
    // MPI_ERR_REQUEST, fatal on MPI_COMM_WORLD, and that report could come
    // before the run's error line). The request and the counts it reads are
    // left to the abort, as the step agreement's round in flight is.
    if (request_ != MPI_REQUEST_NULL) {
      new std::vector<int>[4]{std::move(a_), std::move(b_), std::move(c_), std::move(d_)};
    }
  }
  bool Test() override {
    int flag = 0;
    Check(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE), what_);
    return flag != 0;
  }

 private:
  MPI_Request request_;
  const char* what_;
  std::vector<int> a_, b_, c_, d_;  // counts/displacements the request reads until done
};

class MpiTransport final : public ProcessTransport {
 public:
  // world_handler: MPI_COMM_WORLD's error handler before this run, put back at the end.
  MpiTransport(MPI_Comm comm, MPI_Errhandler world_handler)
      : comm_(comm), world_handler_(world_handler) {
    MPI_Comm_rank(comm_, &index_);
    MPI_Comm_size(comm_, &count_);
    MPI_Comm_dup(comm_, &control_);
    MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN);
  }
  ~MpiTransport() override {
    MPI_Comm_free(&control_);
    MPI_Comm_free(&comm_);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, world_handler_);
    MPI_Errhandler_free(&world_handler_);
  }
  int process_index() const override { return index_; }
  int process_count() const override { return count_; }

  std::unique_ptr<PendingOp> AllGatherInPlace(void* recv,
                                              const std::vector<int64_t>& counts) override {
    std::vector<int> c, d;
    Displacements(counts, &c, &d);
    MPI_Request request;
    Check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, recv, c.data(), d.data(), MPI_BYTE, comm_,
                          &request),
          "MPI_Iallgatherv");
    return std::make_unique<MpiOp>(request, "MPI_Iallgatherv", std::move(c), std::move(d));
  }
  std::unique_ptr<PendingOp> AllToAll(const void* send, const std::vector<int64_t>& send_counts,
                                      void* recv,
                                      const std::vector<int64_t>& recv_counts) override {
    std::vector<int> sc, sd, rc, rd;
    Displacements(send_counts, &sc, &sd);
    Displacements(recv_counts, &rc, &rd);
    MPI_Request request;
    Check(MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(),
                         MPI_BYTE, comm_, &request),
          "MPI_Ialltoallv");
    return std::make_unique<MpiOp>(request, "MPI_Ialltoallv", std::move(sc), std::move(sd),
                                   std::move(rc), std::move(rd));
  }
  std::unique_ptr<PendingOp> Broadcast(void* data, int64_t bytes, int root) override {
    MPI_Request request;
    Check(MPI_Ibcast(data, Int(bytes), MPI_BYTE, root, comm_, &request), "MPI_Ibcast");
    return std::make_unique<MpiOp>(request, "MPI_Ibcast");
  }
  std::unique_ptr<PendingOp> Barrier() override {
    MPI_Request request;
    Check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
    return std::make_unique<MpiOp>(request, "MPI_Ibarrier");
  }

  std::unique_ptr<PendingOp> AllReduceInPlace(void* data, int64_t count, nn::DType dtype,
                                              ReduceOp op) override {
    MPI_Datatype type = MPI_FLOAT;
    switch (dtype) {
      case nn::DType::kFloat32: type = MPI_FLOAT; break;
      case nn::DType::kFloat64: type = MPI_DOUBLE; break;
      case nn::DType::kInt64: type = MPI_INT64_T; break;
      default: Fail("MPI all_reduce: dtype ", nn::DTypeName(dtype), " is not supported");
    }
    TANDEM_CHECK(op == ReduceOp::kSum || op == ReduceOp::kMax, "MPI all_reduce: sum or max only");
    MPI_Request request;
    Check(MPI_Iallreduce(MPI_IN_PLACE, data, Int(count), type,
                         op == ReduceOp::kMax ? MPI_MAX : MPI_SUM, comm_, &request),
          "MPI_Iallreduce");
    return std::make_unique<MpiOp>(request, "MPI_Iallreduce");
  }
  std::unique_ptr<PendingOp> ControlAllReduceMax(int64_t* data, int n) override {
    MPI_Request request;
    Check(MPI_Iallreduce(MPI_IN_PLACE, data, n, MPI_INT64_T, MPI_MAX, control_, &request),
          "MPI_Iallreduce (step agreement)");
    return std::make_unique<MpiOp>(request, "MPI_Iallreduce (step agreement)");
  }

  // Blocking all-gather of one string per process (before any rank runs).
  absl::StatusOr<std::vector<std::string>> GatherStrings(const std::string& mine) {
    int length = Int(static_cast<int64_t>(mine.size()));
    std::vector<int> lengths(count_);
    int rc = MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm_);
    if (rc != MPI_SUCCESS) return absl::InternalError(absl::StrCat("MPI_Allgather: ", MpiError(rc)));
    std::vector<int> offsets(count_);
    int64_t total = 0;
    for (int p = 0; p < count_; ++p) {
      offsets[p] = Int(total);
      total += lengths[p];
    }
    std::string all(static_cast<size_t>(total), '\0');
    rc = MPI_Allgatherv(mine.data(), length, MPI_BYTE, all.data(), lengths.data(), offsets.data(),
                        MPI_BYTE, comm_);
    if (rc != MPI_SUCCESS) {
      return absl::InternalError(absl::StrCat("MPI_Allgatherv: ", MpiError(rc)));
    }
    std::vector<std::string> out;
    for (int p = 0; p < count_; ++p) out.push_back(all.substr(offsets[p], lengths[p]));
    return out;
  }

 private:
  static void Displacements(const std::vector<int64_t>& counts, std::vector<int>* c,
                            std::vector<int>* d) {
    int64_t offset = 0;
    for (int64_t count : counts) {
      c->push_back(Int(count));
      d->push_back(Int(offset));
      offset += count;
    }
  }

  MPI_Comm comm_;
  MPI_Comm control_;  // the step agreement's rounds, apart from the ranks' traffic
  MPI_Errhandler world_handler_;
  int index_ = 0;
  int count_ = 1;
};

}  // namespace

absl::StatusOr<MpiWorld> ConnectMpi(const std::string& record) {
  std::call_once(g_init_once, InitOnce);
  if (!g_init_error.empty()) return absl::InternalError(absl::StrCat("spawn: ", g_init_error));
  if (std::this_thread::get_id() != g_mpi_thread) {
    return absl::FailedPreconditionError(
        "spawn: a multi-process run must be started from the thread that started the first one "
        "(MPI_THREAD_FUNNELED: only that thread talks to MPI)");
  }
  MpiWorld world;
  MPI_Comm_size(MPI_COMM_WORLD, &world.size);
  MPI_Comm_rank(MPI_COMM_WORLD, &world.index);
  if (world.size == 1) return world;
  MPI_Errhandler world_handler;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &world_handler);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);  // see the top of this file
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  auto transport = std::make_unique<MpiTransport>(comm, world_handler);
  ASSIGN_OR_RETURN(world.records, transport->GatherStrings(record));
  world.transport = std::move(transport);
  return world;
}

void AbortMpiJob(int exit_code) {
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; keep the promise if it did
}

}  // namespace tandem::dist::internal

namespace tandem::dist {

// OpenMPI's non-blocking all-reduce (coll/libnbc) picks its binomial tree
// (reduce to one process, then broadcast) for every in-place call and for fewer
// than 4 processes: the hierarchical exchange's two-process all_reduce
// (spawn/comm/mpi/hierarchical_communicator.cc) is both. Its reduce-scatter + all-gather
// (Rabenseifner, algorithm 3) measured faster at every size from 1 KB to 16 MB
// on 2 processes and faster than the blocking MPI_Allreduce from 1 MB up
// (`scripts/bench.sh mpi`; docs/multiprocess.md, "Benchmark"). With 2 processes
// each element is one IEEE addition, commutative, so the bits do not change.
// Only for exactly 2 processes (the only case where MPI_Iallreduce carries
// data; with more, the control plane's small rounds keep libnbc's choice), and
// only on Open MPI 4.1.2 or later: where algorithm 3 cannot run (count below the
// process count's power of two) libnbc takes its ring, which gave wrong in-place
// results before 4.1.2 (open-mpi/ompi#9385). The environment outranks
// OpenMPI's parameter files; a value already in the environment (the user's,
// or mpirun -mca's) is kept. setenv: call before other threads start.
void PrepareMpiInit() {
#if defined(OPEN_MPI)
  if (internal::DetectLauncher().size != 2) return;
  if (OMPI_MAJOR_VERSION < 4 || (OMPI_MAJOR_VERSION == 4 && OMPI_MINOR_VERSION < 1)) return;
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(version, &length);  // allowed before MPI_Init
  int major = 0, minor = 0, release = 0;
  if (std::sscanf(version, "Open MPI v%d.%d.%d", &major, &minor, &release) != 3) return;
  if (std::make_tuple(major, minor, release) < std::make_tuple(4, 1, 2)) return;
  setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", /*overwrite=*/0);
#endif
}

}  // namespace tandem::dist
