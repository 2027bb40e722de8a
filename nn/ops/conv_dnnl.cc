// float32 CPU convolution on oneDNN (Debian's libdnnl, OpenMP runtime): forward,
// backward data and backward weights, one primitive per shape cached per thread
// (least recently used dropped past nn::cpu_primitive_cache_capacity());
// and the float32 GEMM of the matmul family (dnnl_sgemm), so that every float32
// CPU kernel with threads runs on one runtime (OpenMP), never beside a spinning
// OpenBLAS pool.
// Grouped convolutions pass oneDNN 5-D grouped weights (our (O, C / G, KH, KW)
// tensor is its goihw layout as it is); groups == channels runs on oneDNN's
// depthwise kernels (jit dw in the blocked layouts).
// By default the primitives run in the layouts oneDNN prefers (blocked, e.g.
// nChw16c) or, where channel counts are off the 16-channel block, channels-last
// (AutoLayout), with our NCHW / OIHW tensors reordered to them and back inside
// each call; CpuConvPath::kDnnl keeps the plain layouts instead (for comparison).
// Built only with TANDEM_WITH_DNNL; conv_cpu.cc calls it for float32, and for
// bfloat16 where oneDNN's ISA has bfloat16 instructions (CpuBf16Native: the same
// primitives with bfloat16 src, weights, bias and dst, float32 accumulation, and
// float32 weight gradients rounded once by Backward); float64 keeps im2col +
// OpenBLAS (oneDNN 2.6 has no float64 convolution), and so does bfloat16 elsewhere
// (on widened float32 copies).
//
// Host cost per call: a tiny convolution's arithmetic takes about a microsecond,
// so a call creates no oneDNN objects. Each cached primitive keeps the memory
// objects of its arguments (pointed at the call's buffers with set_data_handle)
// and, made on first use, its reorders; arguments go to oneDNN as the C API's
// array (DnnlExecute), and scratchpads and reordered copies that do not outlive
// the call come from the thread's scratch buffers (DnnlScratch).
//
// Threads: oneDNN's OpenMP runtime keeps one thread count per calling thread; each
// call sets the calling thread's count to nn::cpu_blas_threads() (the count the
// programs choose for OpenBLAS), so a rank thread and OpenBLAS's pool use the
// same number of cores and the ranks' OpenMP teams do not grow past it.
// Determinism: the primitives are chosen from the shape, the ISA and the thread
// count (all in the cache key) and oneDNN 2.6's CPU convolutions split work
// statically over the threads, so the same inputs and thread count give the
// same bits (tests/nn/conv_test.cc checks it run to run).
#include <array>
#include <dnnl.hpp>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nn/error.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/dnnl_runtime.h"
#include "nn/ops/internal/elementwise_kernels.h"
#include "nn/ops/internal/lru_cache.h"
#include "nn/ops/internal/matmul_kernels.h"
#include "nn/ops/internal/pool_kernels.h"
#include "nn/ops/matmul.h"

namespace tandem::nn::ops::internal {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
using DataType = memory::data_type;

enum class Kind { kForward, kBackwardData, kBackwardWeights };

// The activation layout the primitives run in: plain NCHW (our tensors' own),
// oneDNN's choice (blocked, e.g. nChw16c) or channels-last NHWC; weights are in
// oneDNN's choice for the latter two.
enum class Layout { kPlain, kBlocked, kNhwc };

struct Key {
  Kind kind;
  DataType dt;  // src, weights and dst: f32, or bf16 (CpuBf16Native)
  int64_t n, c, h, w, o, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw, groups;
  bool bias;
  bool relu;  // forward: max(y, 0) as a post-op
  Layout layout;
  int threads;
  auto Tie() const {
    return std::tie(kind, dt, n, c, h, w, o, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw, groups, bias,
                    relu, layout, threads);
  }
  bool operator<(const Key& other) const { return Tie() < other.Tie(); }
};

Key KeyOf(Kind kind, DataType dt, const Conv2dGeometry& g, bool bias, bool relu, Layout layout,
          int threads) {
  const auto& p = g.params;
  return {kind,         dt,           g.n,           g.c,           g.h,         g.w,         g.o,
          g.kh,         g.kw,          g.oh,          g.ow,        p.stride[0], p.stride[1],
          p.padding[0], p.padding[1],  p.dilation[0], p.dilation[1], p.groups,  bias,
          relu,         layout,        threads};
}

// One argument of a primitive (DNNL_ARG_*): the layout the primitive wants, the
// plain one of our tensor for it (NCHW, OIHW / GOIHW, x), and the memory object
// in the wanted layout that each call points at its buffer (set_data_handle;
// oneDNN 2.6 neither reads nor writes the buffer there, as when creating the
// object: reorders and primitives write a blocked layout's padding).
struct Arg {
  int id = 0;
  bool output = false;
  memory::desc want, plain;
  memory bound;
  // Decided once (oneDNN's description queries cost as much as a small
  // primitive's arithmetic): want's size, whether it is the plain layout, and
  // the index in Entry::reorders of the reorder from or to the plain layout.
  size_t want_bytes = 0;
  bool plain_is_want = false;
  int plain_reorder = -1;
};

// A reorder of one argument between a layout of our tensor (`from`: its plain
// one, or a caller's, as the fused path's dy) and the primitive's, made by the
// first call that needs it; `user` is a memory object over our tensor.
struct Reorder {
  int id = 0;
  memory::desc from;
  memory user;
  dnnl::reorder primitive;
};

// A primitive with the layouts it wants for its arguments; where those differ
// from the plain NCHW / OIHW ones of our tensors, the arguments are reordered
// inside the call. The memory objects and reorders are made once and kept with
// the primitive, so a call creates no oneDNN objects and builds no maps.
struct Entry {
  dnnl::primitive primitive;
  memory::desc scratchpad;
  size_t scratchpad_bytes = 0;
  memory scratchpad_memory;
  std::vector<Arg> args;
  // One per argument and layout of ours that needed one (at most two per
  // argument: plain, or the fused path's).
  std::vector<Reorder> reorders;
  // Forward with relu asked: whether the primitive applies it (a post-op of a
  // JIT kernel); else Conv2dForwardDnnl runs relu's kernel after it.
  bool relu_inside = false;
  // bfloat16: oneDNN offers only its gemm or reference kernel for this one (e.g.
  // 2.6's backward weights of a one-channel input), which runs several times
  // slower than float32's JIT kernel: Backward runs the float32 primitive on
  // widened copies instead (the emulated path's arithmetic).
  bool widen_instead = false;

  void Add(int id, const memory::desc& want, bool output = false) {
    args.push_back({.id = id, .output = output, .want = want});
  }
  Arg& At(int id) {
    for (Arg& arg : args) {
      if (arg.id == id) return arg;
    }
    Fail("conv2d: the oneDNN primitive has no argument ", id);
  }
  const memory::desc& Want(int id) { return At(id).want; }
};

struct Descs {
  memory::desc src, weights, bias, dst;
  memory::dims strides, dilates, padding;
};

// The plain layout of our weight tensor (O, C / G, KH, KW): OIHW, or for a
// grouped convolution the same bytes as oneDNN's 5-D (G, O / G, C / G, KH, KW) GOIHW.
Tag PlainWeightTag(const Conv2dGeometry& g) {
  return g.params.groups == 1 ? Tag::oihw : Tag::goihw;
}

// The oneDNN data type of a tensor dtype (float32 or bfloat16).
DataType DataTypeOf(DType dtype) { return dtype == kBFloat16 ? DataType::bf16 : DataType::f32; }

// weight_tag: Tag::any or PlainWeightTag(g). dt: src and dst; wdt: weights and
// bias (dt, but f32 for the bfloat16 weight gradient, rounded once afterwards).
Descs DescsOf(const Conv2dGeometry& g, bool bias, Tag activation_tag, Tag weight_tag,
              DataType dt = DataType::f32, DataType wdt = DataType::undef) {
  if (wdt == DataType::undef) wdt = dt;
  const auto& p = g.params;
  Descs d;
  d.src = memory::desc({g.n, g.c, g.h, g.w}, dt, activation_tag);
  if (p.groups == 1) {
    d.weights = memory::desc({g.o, g.c, g.kh, g.kw}, wdt, weight_tag);
  } else {
    d.weights = memory::desc({p.groups, g.o / p.groups, g.c / p.groups, g.kh, g.kw}, wdt,
                             weight_tag);
  }
  if (bias) d.bias = memory::desc({g.o}, wdt, Tag::x);
  d.dst = memory::desc({g.n, g.o, g.oh, g.ow}, dt, activation_tag);
  d.strides = {p.stride[0], p.stride[1]};
  d.dilates = {p.dilation[0] - 1, p.dilation[1] - 1};  // oneDNN counts the gaps
  d.padding = {p.padding[0], p.padding[1]};
  return d;
}

// relu: max(y, 0) applied by the primitive as it writes y (eltwise_relu with
// alpha 0: negative -> +0, the bits of relu()'s kernel; conv_test checks it).
dnnl::primitive_attr Attr(bool relu = false) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (relu) {
    dnnl::post_ops ops;
    ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
    attr.set_post_ops(ops);
  }
  return attr;
}

dnnl::convolution_forward::primitive_desc ForwardDesc(const Conv2dGeometry& g, bool bias,
                                                      Tag activation_tag, Tag weight_tag,
                                                      DataType dt, bool relu = false) {
  const Descs d = DescsOf(g, bias, activation_tag, weight_tag, dt);
  const dnnl::convolution_forward::desc desc =
      bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                             dnnl::algorithm::convolution_direct, d.src,
                                             d.weights, d.bias, d.dst, d.strides, d.dilates,
                                             d.padding, d.padding)
           : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                             dnnl::algorithm::convolution_direct, d.src,
                                             d.weights, d.dst, d.strides, d.dilates, d.padding,
                                             d.padding);
  return dnnl::convolution_forward::primitive_desc(desc, Attr(relu), DnnlEngine());
}

// The three kinds of primitive for `key`, with the tags of its activations (act)
// and weights (wei) and their descriptions d; each fills e's primitive, scratchpad
// and the layouts it wants.
void MakeForward(const Key& key, const Conv2dGeometry& g, Tag act, Tag wei, Entry& e) {
  auto pd = ForwardDesc(g, key.bias, act, wei, key.dt, key.relu);
  // The JIT kernels clamp with max(y, 0): negative -> +0, the bits of relu()'s
  // kernel. oneDNN's gemm and reference kernels compute y > 0 ? y : 0 * y (-0 for
  // negatives; they differ on the plain layouts here): those run without the
  // post-op.
  const std::string impl = pd.impl_info_str();
  e.relu_inside = key.relu && impl.find("gemm") == std::string::npos &&
                  impl.find("ref") == std::string::npos;  // e.g. "x64:gemm:jit", "ref:any"
  if (key.relu && !e.relu_inside) pd = ForwardDesc(g, key.bias, act, wei, key.dt, false);
  e.primitive = dnnl::convolution_forward(pd);
  e.scratchpad = pd.scratchpad_desc();
  e.Add(DNNL_ARG_SRC, pd.src_desc());
  e.Add(DNNL_ARG_WEIGHTS, pd.weights_desc());
  if (key.bias) e.Add(DNNL_ARG_BIAS, pd.bias_desc());
  e.Add(DNNL_ARG_DST, pd.dst_desc(), /*output=*/true);
}

void MakeBackwardData(const Key& key, const Conv2dGeometry& g, Tag act, Tag wei,
                      const Descs& d, Entry& e) {
  const auto hint = ForwardDesc(g, false, act, wei, key.dt);
  const dnnl::convolution_backward_data::desc desc(dnnl::algorithm::convolution_direct, d.src,
                                                   d.weights, d.dst, d.strides, d.dilates,
                                                   d.padding, d.padding);
  const dnnl::convolution_backward_data::primitive_desc pd(desc, Attr(), DnnlEngine(), hint);
  e.primitive = dnnl::convolution_backward_data(pd);
  e.scratchpad = pd.scratchpad_desc();
  e.Add(DNNL_ARG_DIFF_DST, pd.diff_dst_desc());
  e.Add(DNNL_ARG_WEIGHTS, pd.weights_desc());
  e.Add(DNNL_ARG_DIFF_SRC, pd.diff_src_desc(), /*output=*/true);
}

// key.bias: the bias gradient in the same pass over dy.
// bfloat16: dweight and dbias in float32 (d's wdt), accumulated in float32 over
// the batch and rounded to bfloat16 once by the caller.
void MakeBackwardWeights(const Key& key, const Conv2dGeometry& g, Tag act, Tag wei,
                         const Descs& d, Entry& e) {
  const auto hint = ForwardDesc(g, key.bias, act, wei, key.dt);
  const dnnl::convolution_backward_weights::desc desc =
      key.bias ? dnnl::convolution_backward_weights::desc(
                     dnnl::algorithm::convolution_direct, d.src, d.weights, d.bias, d.dst,
                     d.strides, d.dilates, d.padding, d.padding)
               : dnnl::convolution_backward_weights::desc(
                     dnnl::algorithm::convolution_direct, d.src, d.weights, d.dst, d.strides,
                     d.dilates, d.padding, d.padding);
  const dnnl::convolution_backward_weights::primitive_desc pd(desc, Attr(), DnnlEngine(), hint);
  const std::string impl = pd.impl_info_str();
  e.widen_instead = key.dt == DataType::bf16 && (impl.find("gemm") != std::string::npos ||
                                                 impl.find("ref") != std::string::npos);
  e.primitive = dnnl::convolution_backward_weights(pd);
  e.scratchpad = pd.scratchpad_desc();
  e.Add(DNNL_ARG_DIFF_DST, pd.diff_dst_desc());
  e.Add(DNNL_ARG_SRC, pd.src_desc());
  e.Add(DNNL_ARG_DIFF_WEIGHTS, pd.diff_weights_desc(), /*output=*/true);
  if (key.bias) e.Add(DNNL_ARG_DIFF_BIAS, pd.diff_bias_desc(), /*output=*/true);
}

// The layouts the primitives see (key.layout), reordered to and from ours inside
// each call where they are not plain NCHW / OIHW.
Entry MakeEntry(const Key& key, const Conv2dGeometry& g) {
  const Tag act = key.layout == Layout::kPlain    ? Tag::nchw
                  : key.layout == Layout::kNhwc   ? Tag::nhwc
                                                  : Tag::any;
  const Tag wei = key.layout == Layout::kPlain ? PlainWeightTag(g) : Tag::any;
  const DataType wdt = key.kind == Kind::kBackwardWeights ? DataType::f32 : key.dt;
  const Descs d = DescsOf(g, key.bias, act, wei, key.dt, wdt);
  Entry e;
  switch (key.kind) {
    case Kind::kForward: MakeForward(key, g, act, wei, e); break;
    case Kind::kBackwardData: MakeBackwardData(key, g, act, wei, d, e); break;
    case Kind::kBackwardWeights: MakeBackwardWeights(key, g, act, wei, d, e); break;
  }
  // Our tensors' layouts (bfloat16's weight gradients: float32, as wdt).
  const Descs plain = DescsOf(g, key.bias, Tag::nchw, PlainWeightTag(g), key.dt, wdt);
  for (Arg& arg : e.args) {
    switch (arg.id) {
      case DNNL_ARG_SRC: case DNNL_ARG_DIFF_SRC: arg.plain = plain.src; break;
      case DNNL_ARG_WEIGHTS: case DNNL_ARG_DIFF_WEIGHTS: arg.plain = plain.weights; break;
      case DNNL_ARG_BIAS: case DNNL_ARG_DIFF_BIAS: arg.plain = plain.bias; break;
      default: arg.plain = plain.dst; break;  // DST, DIFF_DST
    }
    arg.bound = memory(arg.want, DnnlEngine(), DNNL_MEMORY_NONE);
    arg.want_bytes = arg.want.get_size();
    arg.plain_is_want = arg.plain == arg.want;
  }
  e.scratchpad_bytes = e.scratchpad.get_size();
  e.scratchpad_memory = memory(e.scratchpad, DnnlEngine(), DNNL_MEMORY_NONE);
  return e;
}

// kAuto's layout for a shape (grouped convs: blocked). The blocked layouts pad
// channels to multiples of 16 with AVX-512: 20 -> 32 channels on both sides makes
// LeNet's second conv do 2.56x the useful work, and channels-last runs it 1.5x
// faster (nn_ops_bench, docs/benchmarks.md). So for a real (C >= 8) input:
// channels-last where a channel count is off the 16-block on either side, blocked
// on 16-multiples, where it measured faster. For a first conv (C < 8, whose input
// is the NCHW tensor): blocked with AVX-512 (faster on the Intel machine); without
// it (oneDNN's AVX2 kernels block by 8) channels-last, where the input needs no
// reorder: LeNet's first conv's forward + backward took 2.0 ms against 5.1 ms
// blocked (BM_Conv1x20k5, batch 64, AMD EPYC AVX2). ONEDNN_MAX_CPU_ISA below
// AVX-512 counts as without. bfloat16 first convs run channels-last too: oneDNN
// 2.6's bfloat16 backward weights of a one-channel input has a JIT kernel there
// only (blocked and plain layouts get its gemm kernel, several times slower).
Layout AutoLayout(const Conv2dGeometry& g, DType dtype) {
  if (g.params.groups != 1) return Layout::kBlocked;
  static const bool avx512 = dnnl::get_effective_cpu_isa() >= dnnl::cpu_isa::avx512_core;
  if (g.c < 8) return avx512 && dtype != kBFloat16 ? Layout::kBlocked : Layout::kNhwc;
  const bool off_block = g.c % 16 != 0 || g.o % 16 != 0;
  return off_block ? Layout::kNhwc : Layout::kBlocked;
}

// The calling thread's primitives by shape (as the cuDNN algorithm cache, but
// per thread: no lock on the hot path, and a rank thread's thread count is its
// own), the least recently used dropped past the capacity.
LruCache<Key, Entry>& ThreadCache() {
  thread_local LruCache<Key, Entry> cache;
  return cache;
}

// The entry for a shape, valid until the thread's next Lookup, which may drop
// it: a call that runs two entries (Backward) keeps the first one's pointer.
const std::shared_ptr<Entry>& Lookup(Kind kind, DType dtype, const Conv2dGeometry& g, bool bias,
                                     bool relu = false) {
  // kAuto: AutoLayout; plain NCHW (oneDNN's gemm:jit) and im2col + OpenBLAS
  // measured slower on every conv of the apps' models (docs/benchmarks.md).
  const CpuConvPath path = GetCpuConvPath();
  const Layout layout = path == CpuConvPath::kDnnl          ? Layout::kPlain
                        : path == CpuConvPath::kDnnlNhwc    ? Layout::kNhwc
                        : path == CpuConvPath::kDnnlBlocked ? Layout::kBlocked
                                                            : AutoLayout(g, dtype);
  const Key key = KeyOf(kind, DataTypeOf(dtype), g, bias, relu, layout, DnnlUseThreads());
  return ThreadCache().Get(key, cpu_primitive_cache_capacity, [&] { return MakeEntry(key, g); });
}

// An argument of one call: our tensor (undefined: left out, as an absent bias)
// and its layout where that is not the entry's plain one (the fused path's y
// and dy). keep: an input whose reordered copy outlives the call (forward's x,
// for backward) goes to a host tensor instead of the call's scratch.
struct Operand {
  int id;  // DNNL_ARG_*
  const Tensor& tensor;
  const memory::desc* layout = nullptr;
  bool keep = false;
};

// What the primitives of one call (a forward, or the backward primitives of one
// backward) share: the inputs reordered so far, for a later primitive that
// wants the same input in the same layout (the two backward primitives both
// read dy: one reorder instead of two), and the scratch buffers of the call's
// temporaries (the primitives' scratchpads, the copies of reordered arguments),
// the thread's, given back when the call ends.
class Call {
 public:
  // A reordered input: our tensor's elements `data` in the layout `*desc` (an
  // entry's, or the forward's saved layout) at `copy`.
  struct Input {
    const void* data = nullptr;
    const memory::desc* desc = nullptr;
    void* copy = nullptr;
    Tensor kept;  // the copy's tensor, where it outlives the call
  };

  void AddInput(Input input) {
    TANDEM_CHECK(inputs_size_ < kMaxInputs, "conv2d: more than ", kMaxInputs,
                 " reordered inputs in one oneDNN call");
    inputs_[inputs_size_++] = std::move(input);
  }

  // The reordered copy of `data` in layout `desc`, or null.
  Input* FindInput(const void* data, const memory::desc& desc) {
    for (int i = 0; i < inputs_size_; ++i) {
      const Input& input = inputs_[i];
      if (input.data == data && (input.desc == &desc || *input.desc == desc)) return &inputs_[i];
    }
    return nullptr;
  }

  // Runs `e` on our tensors, reordering those whose layout the primitive wants
  // otherwise (inputs before, outputs after it; inputs found here are not
  // reordered again), and waits for it.
  void Run(Entry& e, std::initializer_list<Operand> operands);

 private:
  static constexpr int kMaxInputs = 6;
  // Points arg.bound (op's argument) at op's tensor, or at a copy in the
  // primitive's layout: an input's reordered now (or earlier in the call), an
  // output's to be copied back by the reorder Bind sets copy_back to.
  void Bind(Entry& e, const Operand& op, Arg& arg, Reorder*& copy_back);

  DnnlScratch scratch_;
  std::array<Input, kMaxInputs> inputs_;
  int inputs_size_ = 0;
};

// e's reorder of argument `arg` from our layout `from` (an input) or to it (an
// output), made and kept on first use; from_plain: `from` is arg.plain.
Reorder& ReorderOf(Entry& e, Arg& arg, const memory::desc& from, bool from_plain) {
  if (from_plain && arg.plain_reorder >= 0) return e.reorders[arg.plain_reorder];
  if (!from_plain) {
    for (Reorder& r : e.reorders) {
      if (r.id == arg.id && r.from == from) return r;
    }
  }
  const dnnl::engine& engine = DnnlEngine();
  const dnnl::reorder::primitive_desc pd =
      arg.output ? dnnl::reorder::primitive_desc(engine, arg.want, engine, from)
                 : dnnl::reorder::primitive_desc(engine, from, engine, arg.want);
  e.reorders.push_back({.id = arg.id,
                        .from = from,
                        .user = memory(from, engine, DNNL_MEMORY_NONE),
                        .primitive = dnnl::reorder(pd)});
  // Only once the reorder is there: making it may throw (an allocation inside
  // oneDNN), and an index set before would point past e.reorders' end, or at
  // another argument's reorder, on every later call.
  if (from_plain) arg.plain_reorder = static_cast<int>(e.reorders.size()) - 1;
  return e.reorders.back();
}

void Call::Bind(Entry& e, const Operand& op, Arg& arg, Reorder*& copy_back) {
  void* data = op.tensor.host_ptr();
  const bool plain = op.layout == nullptr;
  const memory::desc& layout = plain ? arg.plain : *op.layout;
  if (plain ? arg.plain_is_want : layout == arg.want) return arg.bound.set_data_handle(data);
  if (!arg.output) {
    if (const Input* input = FindInput(data, arg.want)) {
      return arg.bound.set_data_handle(input->copy);
    }
  }
  Input input{.data = data, .desc = &arg.want};
  if (op.keep) {
    input.kept = DnnlBuffer(arg.want);
    input.copy = input.kept.host_ptr();
  } else {
    input.copy = scratch_.Get(arg.want_bytes);
  }
  arg.bound.set_data_handle(input.copy);
  Reorder& reorder = ReorderOf(e, arg, layout, plain);
  reorder.user.set_data_handle(data);
  if (arg.output) {
    copy_back = &reorder;
    return;
  }
  const dnnl_exec_arg_t args[] = {{DNNL_ARG_FROM, reorder.user.get()},
                                  {DNNL_ARG_TO, arg.bound.get()}};
  DnnlExecute(reorder.primitive, args, "conv2d: reorder");
  AddInput(std::move(input));
}

void Call::Run(Entry& e, std::initializer_list<Operand> operands) {
  // At most 4 arguments and the scratchpad.
  constexpr size_t kMaxArgs = 5;
  TANDEM_CHECK(operands.size() < kMaxArgs, "conv2d: ", operands.size(),
               " arguments for one oneDNN primitive");
  std::array<dnnl_exec_arg_t, kMaxArgs> args;
  std::array<std::pair<Reorder*, const Arg*>, kMaxArgs> copy_back;
  size_t size = 0, copies = 0;
  for (const Operand& op : operands) {
    if (!op.tensor.defined()) continue;
    Arg& arg = e.At(op.id);
    Reorder* reorder = nullptr;
    Bind(e, op, arg, reorder);
    if (reorder != nullptr) copy_back[copies++] = {reorder, &arg};
    args[size++] = {op.id, arg.bound.get()};
  }
  e.scratchpad_memory.set_data_handle(scratch_.Get(e.scratchpad_bytes));
  args[size++] = {DNNL_ARG_SCRATCHPAD, e.scratchpad_memory.get()};
  DnnlExecute(e.primitive, std::span(args.data(), size), "conv2d");
  for (size_t i = 0; i < copies; ++i) {
    const auto& [reorder, arg] = copy_back[i];
    const dnnl_exec_arg_t back[] = {{DNNL_ARG_FROM, arg->bound.get()},
                                    {DNNL_ARG_TO, reorder->user.get()}};
    DnnlExecute(reorder->primitive, back, "conv2d: reorder");
  }
  DnnlStream().wait();
}

}  // namespace

void SgemmDnnl(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  DnnlUseThreads();
  const dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k,
                                          alpha, a, lda, b, ldb, beta, c, ldc);
  TANDEM_CHECK(status == dnnl_success, "gemm: dnnl_sgemm failed with status ",
               static_cast<int>(status), " for m ", m, ", n ", n, ", k ", k, ", lda ", lda,
               ", ldb ", ldb, ", ldc ", ldc);
}

bool DnnlHasBf16() {
  // cpu_isa values are bit sets: avx512_core_amx's includes avx512_core_bf16's.
  static const bool has = [] {
    const unsigned want = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & want) == want;
  }();
  return has;
}

std::string DnnlVersion() {
  const dnnl_version_t* v = dnnl_version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
         std::to_string(v->patch);
}

namespace {

// y's (or dy's) description (n, o, oh, ow) in layout `tag`.
memory::desc YDesc(const Conv2dGeometry& g, Tag tag, DataType dt = DataType::f32) {
  return memory::desc({g.n, g.o, g.oh, g.ow}, dt, tag);
}

// Hands forward's reordered copy of x (if it made one) to saved_x.
void KeepReorderedInput(Entry& e, const Tensor& x, Call& call, Conv2dSavedInput* saved_x) {
  if (saved_x == nullptr) return;
  *saved_x = {};
  const memory::desc& want = e.Want(DNNL_ARG_SRC);
  if (Call::Input* input = call.FindInput(x.host_ptr(), want); input != nullptr) {
    saved_x->data = std::move(input->kept);
    saved_x->layout = std::make_shared<const memory::desc>(want);
  }
}

// Runs the forward primitive `e` on our NCHW x, OIHW weight and bias, writing y
// in `y_layout` (null: ours, NCHW; or the primitive's own layout: then no reorder).
void Forward(Entry& e, const Tensor& x, const Tensor& weight, const Tensor& bias,
             const memory::desc* y_layout, const Tensor& y, Conv2dSavedInput* saved_x) {
  Call call;
  call.Run(e, {{DNNL_ARG_SRC, x, nullptr, /*keep=*/saved_x != nullptr},
               {DNNL_ARG_WEIGHTS, weight},
               {DNNL_ARG_BIAS, bias},
               {DNNL_ARG_DST, y, y_layout}});
  KeepReorderedInput(e, x, call, saved_x);
}

// dy (n, o, oh, ow) in the layout `desc`, as an NCHW tensor.
Tensor ToNchw(const Tensor& dy, const memory::desc& desc, const Conv2dGeometry& g) {
  Tensor nchw = empty({g.n, g.o, g.oh, g.ow}, {.dtype = dy.dtype(), .device = Device::CPU()});
  memory from(desc, DnnlEngine(), dy.host_ptr()),
      to(YDesc(g, Tag::nchw, DataTypeOf(dy.dtype())), DnnlEngine(), nchw.host_ptr());
  dnnl::reorder(from, to).execute(DnnlStream(), from, to);
  DnnlStream().wait();
  return nchw;
}

// dy as an NCHW tensor: itself where dy_layout is null or NCHW.
Tensor DyNchw(const Tensor& dy, const memory::desc* dy_layout, const Conv2dGeometry& g) {
  if (dy_layout == nullptr || *dy_layout == YDesc(g, Tag::nchw, DataTypeOf(dy.dtype()))) {
    return dy;
  }
  return ToNchw(dy, *dy_layout, g);
}

// Conv2dBackwardDnnl's work with dy in `dy_layout` (null: NCHW; or a primitive's
// own layout: then the primitives read it as it is). dbias without dweight
// needs an NCHW dy (Conv2dBackwardBiasCpu's).
void Backward(const Tensor& dy, const memory::desc* dy_layout, const Tensor& x,
              const Tensor& weight, const Conv2dGeometry& g, const Tensor& dx,
              const Tensor& dweight, const Tensor& dbias, const Conv2dSavedInput& saved_x) {
  const DType dtype = dy.dtype();
  // dbias in the weight gradient's pass over dy (bfloat16: summed in float32 by
  // the primitive and rounded once, as dweight).
  const bool bias_here = dbias.defined() && dweight.defined();
  const bool widen = dtype == kBFloat16;
  const TensorOptions f32{.dtype = kFloat32, .device = Device::CPU()};
  // The entries `call` runs, held here as well as by the cache, for as long as
  // `call` lives: the weights' Lookup (or the widened path's) may drop the data
  // entry, whose layouts `call`'s reordered inputs point at.
  std::shared_ptr<Entry> data_entry, weights_entry;
  // dy, reordered once for both primitives where they agree; x, the forward's copy.
  Call call;
  if (dweight.defined() && saved_x.data.defined()) {
    call.AddInput({.data = x.host_ptr(),
                   .desc = static_cast<const memory::desc*>(saved_x.layout.get()),
                   .copy = saved_x.data.host_ptr()});
  }
  if (dx.defined()) {
    data_entry = Lookup(Kind::kBackwardData, dtype, g, false);
    call.Run(*data_entry, {{DNNL_ARG_DIFF_DST, dy, dy_layout},
                           {DNNL_ARG_WEIGHTS, weight},
                           {DNNL_ARG_DIFF_SRC, dx}});
  }
  if (dweight.defined()) weights_entry = Lookup(Kind::kBackwardWeights, dtype, g, bias_here);
  if (weights_entry != nullptr && weights_entry->widen_instead) {
    // bfloat16 only; dy NCHW, or the fused path's layout (copied to NCHW).
    const Tensor dy_nchw = DyNchw(dy, dy_layout, g);
    const Tensor dw32 = empty(dweight.shape(), f32);
    const Tensor db32 = bias_here ? empty(dbias.shape(), f32) : Tensor();
    Backward(dy_nchw.detach().to(kFloat32), nullptr, x.detach().to(kFloat32), Tensor(), g,
             Tensor(), dw32, db32, {});
    dweight.detach().copy_(dw32);
    if (bias_here) dbias.detach().copy_(db32);
  } else if (weights_entry != nullptr) {
    // bfloat16: the weight gradients in float32 (the primitive accumulates in
    // float32), rounded to bfloat16 once below.
    const Tensor dw = widen ? empty(dweight.shape(), f32) : dweight;
    const Tensor db = widen && bias_here ? empty(dbias.shape(), f32) : dbias;
    call.Run(*weights_entry, {{DNNL_ARG_DIFF_DST, dy, dy_layout},
                              {DNNL_ARG_SRC, x},
                              {DNNL_ARG_DIFF_WEIGHTS, dw},
                              {DNNL_ARG_DIFF_BIAS, db}});
    if (widen) {
      dweight.detach().copy_(dw);
      if (bias_here) dbias.detach().copy_(db);
    }
  }
  if (dbias.defined() && !bias_here) Conv2dBackwardBiasCpu(DyNchw(dy, dy_layout, g), dbias);
}

}  // namespace

size_t Conv2dDnnlCacheSize() { return ThreadCache().size(); }

void Conv2dForwardDnnl(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Conv2dGeometry& g, const Tensor& y, bool relu,
                       Conv2dSavedInput* saved_x) {
  Entry& e = *Lookup(Kind::kForward, x.dtype(), g, bias.defined(), relu);
  Forward(e, x, weight, bias, nullptr, y, saved_x);
  if (relu && !e.relu_inside) UnaryCpu(UnaryOp::kRelu, y, y, 0, 0);
}

void Conv2dBackwardDnnl(const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Conv2dGeometry& g, const Tensor& dx, const Tensor& dweight,
                        const Tensor& dbias, const Conv2dSavedInput& saved_x) {
  Backward(dy, nullptr, x, weight, g, dx, dweight, dbias, saved_x);
}

namespace {

// The fused path's view of y's layout `y`: channels-last (NHWC: one group of all
// o channels) or blocked nChw8c / nChw16c with o a multiple of the block; either
// way (n * o / block) images of `block` channels-last channels, which is what the
// pooling kernels read. 0: neither (padded blocks, other layouts).
int64_t ChannelGroup(const memory::desc& y, const Conv2dGeometry& g) {
  const DataType dt = y.data_type();
  if (y == YDesc(g, Tag::nhwc, dt)) return g.o;
  if (g.o % 8 == 0 && y == YDesc(g, Tag::nChw8c, dt)) return 8;
  if (g.o % 16 == 0 && y == YDesc(g, Tag::nChw16c, dt)) return 16;
  return 0;
}

// The pooling of (n, o, oh, ow) as (n * o / group) images of `group` channels.
Pool2dGeometry Grouped(Pool2dGeometry pool, int64_t group) {
  pool.n *= pool.c / group;
  pool.c = group;
  return pool;
}

}  // namespace

Conv2dReluMaxPoolLayout Conv2dReluMaxPoolLayoutDnnl(DType dtype, const Conv2dGeometry& g,
                                                    bool bias) {
  Entry& e = *Lookup(Kind::kForward, dtype, g, bias, /*relu=*/true);
  const memory::desc& y_desc = e.Want(DNNL_ARG_DST);
  const int64_t group = e.relu_inside ? ChannelGroup(y_desc, g) : 0;
  if (group == 0) return {};
  return {.group = group, .y_layout = std::make_shared<const memory::desc>(y_desc)};
}

void Conv2dReluMaxPoolForwardDnnl(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                  const Conv2dGeometry& g, const Pool2dGeometry& pool,
                                  const Conv2dReluMaxPoolLayout& layout, const Tensor& out,
                                  const Tensor& where, Conv2dSavedInput* saved_x) {
  Entry& e = *Lookup(Kind::kForward, x.dtype(), g, bias.defined(), /*relu=*/true);
  const memory::desc& y_desc = e.Want(DNNL_ARG_DST);
  TANDEM_CHECK(e.relu_inside && y_desc == *static_cast<const memory::desc*>(layout.y_layout.get()),
               "conv2d_relu_max_pool2d: the convolution's layout changed since "
               "Conv2dReluMaxPoolLayoutDnnl chose the fused path");
  const Tensor y = DnnlBuffer(y_desc, x.dtype());
  Forward(e, x, weight, bias, &y_desc, y, saved_x);
  if (x.dtype() == kBFloat16) {
    MaxPool2dReluChannelsLastForwardCpu(y.host_data<BFloat16>(), Grouped(pool, layout.group),
                                        out.host_data<BFloat16>(), where.host_data<uint8_t>());
  } else {
    MaxPool2dReluChannelsLastForwardCpu(y.host_data<float>(), Grouped(pool, layout.group),
                                        out.host_data<float>(), where.host_data<uint8_t>());
  }
}

void Conv2dReluMaxPoolBackwardDnnl(const Tensor& dout, const Tensor& where, const Tensor& x,
                                   const Tensor& weight, const Conv2dGeometry& g,
                                   const Pool2dGeometry& pool,
                                   const Conv2dReluMaxPoolLayout& layout, bool on_dnnl,
                                   const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                   const Conv2dSavedInput& saved_x) {
  const memory::desc& dy_desc = *static_cast<const memory::desc*>(layout.y_layout.get());
  const Tensor dy = DnnlBuffer(dy_desc, dout.dtype());
  if (dout.dtype() == kBFloat16) {
    MaxPool2dReluChannelsLastBackwardCpu(dout.host_data<BFloat16>(), where.host_data<uint8_t>(),
                                         Grouped(pool, layout.group), dy.host_data<BFloat16>());
  } else {
    MaxPool2dReluChannelsLastBackwardCpu(dout.host_data<float>(), where.host_data<uint8_t>(),
                                         Grouped(pool, layout.group), dy.host_data<float>());
  }
  if (on_dnnl) return Backward(dy, &dy_desc, x, weight, g, dx, dweight, dbias, saved_x);
  // The convolution's backward runs elsewhere now (the path changed since
  // forward): as conv2d_relu's would, from an NCHW dy.
  const Tensor dy_nchw = ToNchw(dy, dy_desc, g);
  Conv2dBackwardCpu(dy_nchw, x, weight, g, dx, dweight, dbias, saved_x);
}

// The single-gradient entry points (the bfloat16 path's float32 calls): the
// combined call with the other gradients undefined.
void Conv2dBackwardDataDnnl(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                            const Tensor& dx) {
  Conv2dBackwardDnnl(dy, Tensor(), weight, g, dx, Tensor(), Tensor());
}

void Conv2dBackwardFilterDnnl(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                              const Tensor& dweight) {
  Conv2dBackwardDnnl(dy, x, Tensor(), g, Tensor(), dweight, Tensor());
}

}  // namespace tandem::nn::ops::internal
