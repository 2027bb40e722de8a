// cuBLASLt, opened the first time a matmul runs on a GPU. Loading the library
// costs ~150 MB of resident memory (its relocations and initialisers), which a
// CUDA build paid at start even when it never saw a GPU; nn therefore does not
// link cuBLASLt but opens it with dlopen and calls it through this table.
// Internal to nn: only nn's CUDA sources include this.
#ifndef TANDEM_NN_CUDA_CUBLASLT_API_H_
#define TANDEM_NN_CUDA_CUBLASLT_API_H_

#include <cublasLt.h>

namespace tandem::nn::internal {

// The cuBLASLt entry points nn calls, named as in cublasLt.h without the prefix.
struct CublasLtApi {
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtDestroy) Destroy;
  decltype(&::cublasLtGetStatusString) GetStatusString;
  decltype(&::cublasLtMatmul) Matmul;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
};

// The table, loaded on the first call (thread-safe). Throws tandem::Error naming
// every path tried and the loader's message when the library or one of its
// symbols cannot be found; a later call tries again.
const CublasLtApi& CublasLt();

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_CUDA_CUBLASLT_API_H_
