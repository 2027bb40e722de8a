// float32 CPU max and average pooling on oneDNN (Debian's libdnnl 2.6, OpenMP
// runtime), forward and backward, one primitive per shape cached per thread
// (least recently used dropped past nn::cpu_primitive_cache_capacity()), as
// conv_dnnl.cc does for convolutions (same engine, streams, thread count and
// scratch buffers; the memory objects and reorders made once with the primitive).
// Max pooling runs forward_training and keeps oneDNN's workspace (the argmax's
// offset inside each window, in the primitive's dst layout) for backward in
// place of our int64 indices. CpuPoolPath picks the layout: plain NCHW (our
// tensors as they are), or blocked (nChw16c / nChw8c) or channels-last (NHWC)
// with our tensors reordered to it and back inside each call (for comparison:
// a lone pooling between NCHW tensors pays two reorders for nothing).
// Built only with TANDEM_WITH_DNNL; pool.cc calls it for float32 where
// ResolveCpuPoolPath (pool_cpu.cc) says so.
//
// Semantics against pool_cpu.cc (tests/nn/pool_dnnl_test.cc): max pooling
// compares with a strict '>' in row-major window order, so ties go to the first
// maximum as ours do, and values and gradients are the same bits; padding is
// -inf. NaN differs: oneDNN ignores NaN (a window of only NaN gives -FLT_MAX),
// ours keeps a NaN that is a window's first element. Average pooling counts the
// padding in the divisor (pooling_avg_include_padding), as ours does; its sums
// may run in another order (float rounding).
// Determinism: the implementation is chosen from the shape, the ISA and the
// thread count (all in the cache key); oneDNN's pooling splits the outputs (and
// for backward the dx planes) statically over the threads, so the same inputs
// and thread count give the same bits (tested run to run).
#include <algorithm>
#include <dnnl.hpp>
#include <span>
#include <tuple>

#include "nn/error.h"
#include "nn/ops/internal/dnnl_runtime.h"
#include "nn/ops/internal/lru_cache.h"
#include "nn/ops/internal/pool_kernels.h"
#include "nn/ops/cpu_settings.h"  // cpu_primitive_cache_capacity

namespace tandem::nn::ops::internal {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
using DataType = memory::data_type;

enum class Kind { kForward, kBackward };

struct Key {
  Kind kind;
  bool max;
  int64_t n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow;
  CpuPoolPath path;
  int threads;
  auto Tie() const {
    return std::tie(kind, max, n, c, h, w, kh, kw, sh, sw, ph, pw, oh, ow, path, threads);
  }
  bool operator<(const Key& other) const { return Tie() < other.Tie(); }
};

// One side of a primitive, what it reads (forward: x; backward: dy) or writes
// (y; dx): the layout it wants, our tensor's (NCHW), and, made once so that a
// call creates no oneDNN objects, the memory objects of the two (pointed at
// the call's buffers with set_data_handle) and the reorder between them where
// they differ (ours to the primitive's for the input, back for the output).
struct Side {
  memory::desc want, plain;
  bool plain_is_want = false;
  size_t want_bytes = 0;
  memory bound, user;
  dnnl::reorder reorder;
};

// A primitive with the layouts it runs in (src / dst for forward, diff_src /
// diff_dst for backward: x's and y's shapes) and its scratchpad and workspace.
struct Entry {
  dnnl::primitive primitive;
  memory::desc x, y, scratchpad, workspace;
  Side in, out;
  memory scratchpad_memory, workspace_memory;
  size_t scratchpad_bytes = 0;
};

Side MakeSide(const memory::desc& want, const memory::desc& plain, bool input) {
  const dnnl::engine& engine = DnnlEngine();
  Side side{.want = want, .plain = plain, .plain_is_want = want == plain,
            .want_bytes = want.get_size()};
  side.bound = memory(want, engine, DNNL_MEMORY_NONE);
  if (!side.plain_is_want) {
    side.user = memory(plain, engine, DNNL_MEMORY_NONE);
    side.reorder =
        dnnl::reorder(input ? dnnl::reorder::primitive_desc(engine, plain, engine, want)
                            : dnnl::reorder::primitive_desc(engine, want, engine, plain));
  }
  return side;
}

// The activation layout of `path` (kDnnl, kDnnlBlocked or kDnnlNhwc).
Tag LayoutTag(CpuPoolPath path) {
  if (path == CpuPoolPath::kDnnlNhwc) return Tag::nhwc;
  if (path == CpuPoolPath::kDnnl) return Tag::nchw;
  // The channel block of the ISA's vectors: 16 floats with AVX-512, else 8.
  return dnnl::get_effective_cpu_isa() >= dnnl::cpu_isa::avx512_core ? Tag::nChw16c : Tag::nChw8c;
}

memory::desc XDesc(const Pool2dGeometry& g, Tag tag) {
  return memory::desc({g.n, g.c, g.h, g.w}, DataType::f32, tag);
}
memory::desc YDesc(const Pool2dGeometry& g, Tag tag) {
  return memory::desc({g.n, g.c, g.oh, g.ow}, DataType::f32, tag);
}

dnnl::algorithm Algorithm(bool max) {
  return max ? dnnl::algorithm::pooling_max : dnnl::algorithm::pooling_avg_include_padding;
}

// Right padding: what the output size needs past the last window's end (pool.cc
// sizes outputs with floor, so it never exceeds the left padding; oneDNN checks
// (h + pl + pr - kh) / sh + 1 == oh).
memory::dims PaddingRight(const Pool2dGeometry& g) {
  return {std::max<int64_t>(0, (g.oh - 1) * g.sh + g.kh - g.h - g.ph),
          std::max<int64_t>(0, (g.ow - 1) * g.sw + g.kw - g.w - g.pw)};
}

dnnl::primitive_attr Attr() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

dnnl::pooling_forward::primitive_desc ForwardDesc(const Pool2dGeometry& g, bool max, Tag tag) {
  const dnnl::pooling_forward::desc desc(dnnl::prop_kind::forward_training, Algorithm(max),
                                         XDesc(g, tag), YDesc(g, tag), {g.sh, g.sw},
                                         {g.kh, g.kw}, {g.ph, g.pw}, PaddingRight(g));
  return dnnl::pooling_forward::primitive_desc(desc, Attr(), DnnlEngine());
}

// e's sides (forward: x in, y out; backward: dy in, dx out) and the memory
// objects of its scratchpad and workspace.
void Finish(const Pool2dGeometry& g, bool forward, Entry& e) {
  const memory::desc x_plain = XDesc(g, Tag::nchw), y_plain = YDesc(g, Tag::nchw);
  e.in = forward ? MakeSide(e.x, x_plain, /*input=*/true) : MakeSide(e.y, y_plain, true);
  e.out = forward ? MakeSide(e.y, y_plain, /*input=*/false) : MakeSide(e.x, x_plain, false);
  e.scratchpad_bytes = e.scratchpad.get_size();
  e.scratchpad_memory = memory(e.scratchpad, DnnlEngine(), DNNL_MEMORY_NONE);
  e.workspace_memory = memory(e.workspace, DnnlEngine(), DNNL_MEMORY_NONE);
}

Entry MakeEntry(const Key& key, const Pool2dGeometry& g) {
  const Tag tag = LayoutTag(key.path);
  const auto forward = ForwardDesc(g, key.max, tag);
  Entry e;
  if (key.kind == Kind::kForward) {
    e.primitive = dnnl::pooling_forward(forward);
    e.x = forward.src_desc();
    e.y = forward.dst_desc();
    e.scratchpad = forward.scratchpad_desc();
    e.workspace = forward.workspace_desc();
    Finish(g, /*forward=*/true, e);
    return e;
  }
  const dnnl::pooling_backward::desc desc(Algorithm(key.max), XDesc(g, tag), YDesc(g, tag),
                                          {g.sh, g.sw}, {g.kh, g.kw}, {g.ph, g.pw},
                                          PaddingRight(g));
  const dnnl::pooling_backward::primitive_desc pd(desc, Attr(), DnnlEngine(), forward);
  e.primitive = dnnl::pooling_backward(pd);
  e.x = pd.diff_src_desc();
  e.y = pd.diff_dst_desc();
  e.scratchpad = pd.scratchpad_desc();
  e.workspace = pd.workspace_desc();
  Finish(g, /*forward=*/false, e);
  return e;
}

// The calling thread's primitives by shape (no lock; a rank thread's thread
// count is its own), the least recently used dropped past the capacity.
LruCache<Key, Entry>& ThreadCache() {
  thread_local LruCache<Key, Entry> cache;
  return cache;
}

// The entry for a shape; valid until the thread's next Lookup (each call here
// runs one entry, looked up last).
Entry& Lookup(Kind kind, bool max, const Pool2dGeometry& g, CpuPoolPath path) {
  TANDEM_CHECK(path == CpuPoolPath::kDnnl || path == CpuPoolPath::kDnnlBlocked ||
                   path == CpuPoolPath::kDnnlNhwc,
               "pool2d: not a oneDNN path: ", static_cast<int>(path));
  const Key key{kind, max, g.n, g.c,  g.h,  g.w,  g.kh, g.kw,          g.sh,
                g.sw, g.ph, g.pw, g.oh, g.ow, path, DnnlUseThreads()};
  return *ThreadCache().Get(key, cpu_primitive_cache_capacity,
                            [&] { return MakeEntry(key, g); });
}

// A host buffer of `desc`'s size from the host allocator's cache.
Tensor Buffer(const memory::desc& desc) {
  return empty({static_cast<int64_t>(desc.get_size())}, {.dtype = kUInt8, .device = Device::CPU()});
}

// Runs `e` with input `in` (x or dy) and output `out` (y or dx), our NCHW
// tensors, reordered where the primitive wants another layout (the copies and
// the scratchpad in the thread's scratch buffers); `workspace` (may be
// undefined) is passed as it is.
void Run(Entry& e, const Tensor& in, const Tensor& out, const Tensor& workspace, int in_arg,
         int out_arg) {
  DnnlScratch scratch;
  if (e.in.plain_is_want) {
    e.in.bound.set_data_handle(in.host_ptr());
  } else {
    e.in.bound.set_data_handle(scratch.Get(e.in.want_bytes));
    e.in.user.set_data_handle(in.host_ptr());
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_FROM, e.in.user.get()},
                                    {DNNL_ARG_TO, e.in.bound.get()}};
    DnnlExecute(e.in.reorder, args, "pool2d: reorder");
  }
  if (e.out.plain_is_want) {
    e.out.bound.set_data_handle(out.host_ptr());
  } else {
    e.out.bound.set_data_handle(scratch.Get(e.out.want_bytes));
    e.out.user.set_data_handle(out.host_ptr());
  }
  e.scratchpad_memory.set_data_handle(scratch.Get(e.scratchpad_bytes));
  dnnl_exec_arg_t args[] = {{in_arg, e.in.bound.get()},
                            {out_arg, e.out.bound.get()},
                            {DNNL_ARG_SCRATCHPAD, e.scratchpad_memory.get()},
                            {DNNL_ARG_WORKSPACE, e.workspace_memory.get()}};
  if (workspace.defined()) e.workspace_memory.set_data_handle(workspace.host_ptr());
  DnnlExecute(e.primitive, std::span(args, workspace.defined() ? 4 : 3), "pool2d");
  if (!e.out.plain_is_want) {
    const dnnl_exec_arg_t back[] = {{DNNL_ARG_FROM, e.out.bound.get()},
                                    {DNNL_ARG_TO, e.out.user.get()}};
    DnnlExecute(e.out.reorder, back, "pool2d: reorder");
  }
  DnnlStream().wait();
}

Tensor Forward(bool max, const Tensor& x, const Pool2dGeometry& g, CpuPoolPath path,
               const Tensor& y) {
  Entry& e = Lookup(Kind::kForward, max, g, path);
  Tensor workspace;
  if (max) workspace = Buffer(e.workspace);
  Run(e, x, y, workspace, DNNL_ARG_SRC, DNNL_ARG_DST);
  return workspace;
}

void Backward(bool max, const Tensor& workspace, const Tensor& dy, const Pool2dGeometry& g,
              CpuPoolPath path, const Tensor& dx) {
  Entry& e = Lookup(Kind::kBackward, max, g, path);
  // The forward's workspace must be the one this primitive reads (oneDNN 2.6 lays
  // it out like y in every implementation, whatever the thread counts).
  if (max) {
    TANDEM_CHECK(workspace.numel() * ElementSize(workspace.dtype()) ==
                     static_cast<int64_t>(e.workspace.get_size()),
                 "max_pool2d backward: oneDNN workspace of ",
                 workspace.numel() * ElementSize(workspace.dtype()), " bytes, the primitive wants ",
                 e.workspace.get_size());
  }
  Run(e, dy, dx, workspace, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_SRC);
}

}  // namespace

size_t Pool2dDnnlCacheSize() { return ThreadCache().size(); }

Tensor MaxPool2dForwardDnnl(const Tensor& x, const Pool2dGeometry& g, CpuPoolPath path,
                            const Tensor& y) {
  return Forward(true, x, g, path, y);
}

void MaxPool2dBackwardDnnl(const Tensor& workspace, const Tensor& dy, const Pool2dGeometry& g,
                           CpuPoolPath path, const Tensor& dx) {
  Backward(true, workspace, dy, g, path, dx);
}

void AvgPool2dForwardDnnl(const Tensor& x, const Pool2dGeometry& g, CpuPoolPath path,
                          const Tensor& y) {
  Forward(false, x, g, path, y);
}

void AvgPool2dBackwardDnnl(const Tensor& dy, const Pool2dGeometry& g, CpuPoolPath path,
                           const Tensor& dx) {
  Backward(false, Tensor(), dy, g, path, dx);
}

}  // namespace tandem::nn::ops::internal
