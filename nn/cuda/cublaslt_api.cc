// dlopen of cuBLASLt on first use. Built only when TANDEM_WITH_CUDA.
#include "nn/cuda/cublaslt_api.h"

#include <dlfcn.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nn/error.h"

// Set by nn/CMakeLists.txt from the toolkit the build found: the library's
// versioned name and the folder it was found in (tried when the loader's search
// path does not hold it).
#ifndef TANDEM_CUBLASLT_SONAME
#error "TANDEM_CUBLASLT_SONAME must name the cuBLASLt library (e.g. libcublasLt.so.13)"
#endif
#ifndef TANDEM_CUBLASLT_DIR
#define TANDEM_CUBLASLT_DIR ""
#endif

namespace tandem::nn::internal {
namespace {

// Opens the library by name (the executable's run path, LD_LIBRARY_PATH, the
// system's cache), then from the build's toolkit folder.
void* OpenLibrary(std::string& opened) {
  std::vector<std::string> candidates = {TANDEM_CUBLASLT_SONAME};
  if (std::string(TANDEM_CUBLASLT_DIR).size() > 0) {
    candidates.push_back(absl::StrCat(TANDEM_CUBLASLT_DIR, "/", TANDEM_CUBLASLT_SONAME));
  }
  std::vector<std::string> failures;
  for (const std::string& path : candidates) {
    // Local binding: the symbols stay out of the global namespace, so a user's own
    // cuBLASLt (the same library) is not interposed.
    if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      opened = path;
      return handle;
    }
    const char* message = dlerror();
    failures.push_back(absl::StrCat(path, ": ", message != nullptr ? message : "unknown error"));
  }
  Fail("cannot load cuBLASLt, which GPU matmuls need (tried ", absl::StrJoin(failures, "; "),
       "); install the CUDA toolkit's cuBLAS or add its lib folder to LD_LIBRARY_PATH");
}

template <typename Fn>
void Resolve(void* handle, const std::string& library, const char* symbol, Fn& slot) {
  dlerror();  // clear a stale message
  void* address = dlsym(handle, symbol);
  if (address == nullptr) {
    const char* message = dlerror();
    Fail("cuBLASLt at ", library, " has no symbol ", symbol, " (",
         message != nullptr ? message : "null address", "): it is older than the ",
         "headers tandem was built with");
  }
  slot = reinterpret_cast<Fn>(address);
}

CublasLtApi Load() {
  std::string library;
  void* handle = OpenLibrary(library);
  // The handle is never closed: the table's pointers live as long as the process.
  CublasLtApi api{};
#define TANDEM_RESOLVE(field) Resolve(handle, library, "cublasLt" #field, api.field)
  TANDEM_RESOLVE(Create);
  TANDEM_RESOLVE(Destroy);
  TANDEM_RESOLVE(GetStatusString);
  TANDEM_RESOLVE(Matmul);
  TANDEM_RESOLVE(MatmulAlgoGetHeuristic);
  TANDEM_RESOLVE(MatmulDescCreate);
  TANDEM_RESOLVE(MatmulDescDestroy);
  TANDEM_RESOLVE(MatmulDescSetAttribute);
  TANDEM_RESOLVE(MatmulPreferenceCreate);
  TANDEM_RESOLVE(MatmulPreferenceDestroy);
  TANDEM_RESOLVE(MatmulPreferenceSetAttribute);
  TANDEM_RESOLVE(MatrixLayoutCreate);
  TANDEM_RESOLVE(MatrixLayoutDestroy);
#undef TANDEM_RESOLVE
  return api;
}

}  // namespace

const CublasLtApi& CublasLt() {
  // A function-local static: initialised once, by one thread; if Load throws, the
  // next call tries again.
  static const CublasLtApi api = Load();
  return api;
}

}  // namespace tandem::nn::internal
