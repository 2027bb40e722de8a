// Distinct addresses standing in for cudaStream_t and cudaEvent_t values, for
// the tests of nn's CUDA bookkeeping that run without a GPU (stream uses, the
// capture registry, the spare streams). Never dereferenced.
#ifndef TANDEM_TESTS_NN_FAKE_CUDA_HANDLES_H_
#define TANDEM_TESTS_NN_FAKE_CUDA_HANDLES_H_

struct CUstream_st;  // cudaStream_t is CUstream_st*
struct CUevent_st;   // cudaEvent_t is CUevent_st*

namespace tandem::testing {

inline constexpr int kFakeHandles = 64;

// i in [0, kFakeHandles): the same i gives the same handle.
inline CUstream_st* FakeStream(int i) {
  static char slots[kFakeHandles];
  return reinterpret_cast<CUstream_st*>(&slots[i]);
}
inline CUevent_st* FakeEvent(int i) {
  static char slots[kFakeHandles];
  return reinterpret_cast<CUevent_st*>(&slots[i]);
}

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_NN_FAKE_CUDA_HANDLES_H_
