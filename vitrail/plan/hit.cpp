// The hit path of vitrail.plan below Python: one C++ call per op call that has a plan.
//
// A Table holds one op family's plans, keyed by the arguments of its public function as they
// were passed: each tensor's shape, strides, dtype, device, dispatch keys, address modulo 16
// and which earlier tensor argument starts at the same address (mm(a, a) is not mm(a, b));
// each scalar's type and value (a tuple or list of up to 8 ints too: a stride, a padding);
// and the current device and stream (a plan may pass state kept
// per stream). table.call(*args) builds that key, finds the plan and runs it: allocates the
// outputs (and scratch buffers) through ATen, then calls the recorded entry points (through
// their prototype's packed caller) and launches the recorded kernels (cuLaunchKernel) with this
// call's pointers on the current stream, or calls at::matmul where torch's matmul is the route
// (at::addmm and the epilogue's in-place ops where torch's ops run a fused GEMM epilogue).
// No Python object is built but the result.
//
// A table given a gradient rule (set_grad) also answers calls that record gradients: the key
// then holds which tensors require a gradient, the plan runs with grad mode off, and a C++
// autograd node (GradNode) takes the outputs' history; its backward calls the rule's Python
// function (a front function itself, so the backward's plan runs from C++ too), or, where the
// rule gives steps and no graph of the gradients is asked for, calls each step's front table
// from C++ (its Python function only where the table misses). The rule's arguments (saved
// outputs or inputs, output gradients, constants) are learned with the plan.
//
// What the key cannot vouch for returns MISS: a tensor that records a gradient where the table
// has no rule (or one with a forward-mode gradient), a tensor subclass, an argument of another
// type, settings scoped by `with vitrail.tune.settings(...)`, a call being recorded by
// vitrail.plan in any thread, a kernel launch in a thread that has no CUDA context and cannot
// be given the device's primary one. A MISS of a key with no plan is "pending": the family's
// Python path runs, and if it ran exactly one plan whose outputs are the call's result, Python
// adds that plan's description under the pending key (vitrail/plan/native.py).
#include <Python.h>
#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/hardswish.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/tanh.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <type_traits>

#ifdef VITRAIL_C10_CUDA  // a CUDA build of torch: its current device and stream read in C++
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void*, void**, void**);
using CtxFn = int (*)(void**);
using SetCtxFn = int (*)(void*);
using DeviceGetFn = int (*)(int*, int);
using PrimaryFn = int (*)(void**, int);
using Packed = long long (*)(void*, const unsigned long long*);
using EncodeFn = int (*)(void*, int, unsigned, void*, const unsigned long long*,
                         const unsigned long long*, const unsigned*, const unsigned*, int, int,
                         int, int);  // cuTensorMapEncodeTiled, enums as ints

LaunchFn cu_launch = nullptr;         // cuLaunchKernel, where libcuda is loaded
CtxFn cu_ctx_current = nullptr;       // cuCtxGetCurrent
SetCtxFn cu_set_current = nullptr;    // cuCtxSetCurrent
DeviceGetFn cu_device_get = nullptr;  // cuDeviceGet
PrimaryFn cu_primary = nullptr;       // cuDevicePrimaryCtxRetain
EncodeFn cu_encode = nullptr;         // cuTensorMapEncodeTiled
PyObject* get_device = nullptr;       // () -> int: torch's current device (-1: none)
PyObject* get_stream = nullptr;       // (device) -> int: torch's current stream there
PyObject* scoped = nullptr;           // the ContextVar of `with vitrail.tune.settings(...)`
PyObject* MISS = nullptr;             // what call() returns when the caller must run Python
long recording = 0;                   // calls being recorded by vitrail.plan, in any thread

enum SlotKind : int { CONST = 0, POINTER = 1, STREAM = 2, MAP = 3 };
struct Slot {
  int kind;
  int tensor;                // POINTER, MAP: the tensor (arguments, then outputs, then scratch)
  unsigned long long value;  // CONST: the value's bytes; POINTER: the offset in bytes; MAP: the
                             // plan's map, encoded at each call for the tensor (a kernel's
                             // 128-byte CUtensorMap parameter)
};

struct TensorMap {  // cuTensorMapEncodeTiled's arguments but the address
  int data_type;
  unsigned rank;
  unsigned long long dims[5], strides[5];
  unsigned box[5];
  int swizzle;
  unsigned long long offset;  // of the view from the tensor's start, in bytes
};

struct Launch {
  bool entry;              // an entry point, else a kernel
  void* target;            // the entry point's address, or the CUfunction
  Packed packed;           // entry: its prototype's caller from an array of 8-byte slots
  bool check;              // entry: a result that is not 0 is an error
  unsigned dims[6];        // kernel: grid and block
  unsigned shared_mem;     // kernel: dynamic shared memory
  std::vector<Slot> slots;
};

struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  c10::Device device;
};

// The backward of a plan whose call records gradients: backward(*args) -> the gradient of each
// differentiable input (a tensor, a tuple of them, None for none), where args are built from
// the spec. Freed with the GIL, wherever the last node that uses it dies.
struct GradRule {
  enum Kind : int { OUTPUT = 0, INPUT = 1, GRAD = 2, VALUE = 3, ARG = 4 };
  struct Arg {
    int kind;
    int index;                  // OUTPUT, GRAD: the output; INPUT: the argument position;
                                // ARG (a step's): the rule's argument
    PyObject* value = nullptr;  // VALUE
  };
  // A step of the backward without Python: fn's front table called on args (ARG or VALUE),
  // its result the gradient of inputs[gradient]; fn itself where the table misses.
  struct Step {
    PyObject* fn = nullptr;
    PyObject* table = nullptr;
    std::vector<Arg> args;
    int gradient = 0;
  };
  PyObject* backward = nullptr;
  std::vector<Arg> args;
  std::vector<int> inputs;      // the argument positions of the differentiable tensors
  std::vector<Step> steps;      // none: the backward runs in Python
  std::string name;
  ~GradRule() {
    if (!Py_IsInitialized()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF(backward);
    for (Arg& a : args) Py_XDECREF(a.value);
    for (Step& st : steps) {
      Py_XDECREF(st.fn);
      Py_XDECREF(st.table);
      for (Arg& a : st.args) Py_XDECREF(a.value);
    }
    PyGILState_Release(gil);
  }
};

struct Plan {
  enum Kind { LAUNCHES, MATMUL, ADDMM, GENERAL } kind = GENERAL;
  std::vector<int> args;           // the argument position of each tensor the plan reads
  // ADDMM (vitrail.gemm.ops.launch.torch_fused on 2-D operands): args a, b, c, bias (-1: none);
  // clamp(act(alpha * a @ b + beta * c + bias)), act numbered as vitrail.gemm.epilogue.ACT_IDS
  double alpha = 1.0, beta = 0.0, slope = 0.0;
  int activation = 0;
  std::optional<double> lo, hi;
  std::vector<Alloc> outputs, scratch;
  std::vector<Launch> launches;
  std::vector<TensorMap> maps;
  int result = 0;                  // >= 0: that tensor; -1: None; -2: the outputs as a tuple
  bool launches_kernels = false;
  PyObject* keep = nullptr;        // objects alive as long as the plan (tables it passes)
  PyObject* failed = nullptr;      // (launch index, result) -> raises the launch's error
  std::shared_ptr<GradRule> grad;  // a plan of a call that records gradients: its backward
  ~Plan() {
    Py_XDECREF(keep);
    Py_XDECREF(failed);
  }
};

struct Table {
  PyObject_HEAD
  std::unordered_map<std::string, std::shared_ptr<Plan>>* plans;
  Py_ssize_t capacity;
  bool grad;  // calls that record gradients may have plans (set_grad)
};

thread_local std::string key_buffer;
thread_local unsigned long long key_stream = 0;  // the current stream of the last make_key
thread_local long key_device = -1;               // and the current device
thread_local std::string pending;          // the key of this thread's last learnable miss
thread_local Table* pending_table = nullptr;
thread_local bool pending_grad = false;    // whether that miss recorded gradients

template <typename T>
inline void put(std::string& key, const T& v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// torch's current device and its current stream there, as torch.cuda would say them; false
// where they cannot be read (CUDA unusable in this process: the Python path says why).
bool current_place(long& device, unsigned long long& stream) {
#ifdef VITRAIL_C10_CUDA
  try {  // what torch._C._cuda_getDevice and _cuda_getCurrentRawStream return, without Python
    const c10::DeviceIndex index = c10::cuda::current_device();
    device = index;
    cudaStream_t current = c10::cuda::getCurrentCUDAStream(index).stream();
    stream = reinterpret_cast<unsigned long long>(current);
    return true;
  } catch (const std::exception&) {
    return false;
  }
#else
  PyObject* index = PyObject_CallNoArgs(get_device);
  PyObject* current = index ? PyObject_CallOneArg(get_stream, index) : nullptr;
  if (current == nullptr) {
    Py_XDECREF(index);
    PyErr_Clear();
    return false;
  }
  device = PyLong_AsLong(index);
  stream = PyLong_AsUnsignedLongLong(current);
  Py_DECREF(index);
  Py_DECREF(current);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
#endif
}

// The key of a call into key; false where the call is not for this path (see the file's top).
// records: whether the call records gradients (only where grad_ok: the table has a rule).
bool make_key(PyObject* const* args, Py_ssize_t n, std::string& key, bool grad_ok,
              bool& records) {
  key.clear();
  records = false;
  const bool grad = c10::GradMode::is_enabled();
  const void* starts[16];  // the tensor arguments' addresses so far
  int8_t tensors = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = args[i];
    if (o == Py_None) {
      key.push_back('N');
    } else if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
      const at::Tensor& t = THPVariable_Unpack(o);
      const bool needs = grad && t.requires_grad();
      if (needs && !grad_ok) return false;
      records |= needs;
      try {  // sizes and strides throw for tensors without them (sparse, nested)
        if (t._fw_grad(/*level=*/0).defined()) return false;  // forward-mode AD: Python's
        const int64_t dim = t.dim();
        key.push_back(needs ? 'G' : 'T');
        put(key, dim);
        key.append(reinterpret_cast<const char*>(t.sizes().data()), dim * sizeof(int64_t));
        key.append(reinterpret_cast<const char*>(t.strides().data()), dim * sizeof(int64_t));
        put(key, static_cast<int8_t>(t.scalar_type()));
        put(key, static_cast<int8_t>(t.device().type()));
        put(key, static_cast<int8_t>(t.device().index()));
        put(key, t.key_set().raw_repr());  // conjugate and negative views, functorch wrappers
        const void* start = t.data_ptr();
        put(key, static_cast<uint8_t>(reinterpret_cast<uintptr_t>(start) & 15));
        int8_t same = -1;  // the first earlier tensor argument at this address
        for (int8_t k = 0; k < tensors && same < 0; ++k) same = starts[k] == start ? k : -1;
        put(key, same);
        if (tensors == 16) return false;
        starts[tensors++] = start;
      } catch (const std::exception&) {
        return false;
      }
    } else if (PyBool_Check(o)) {
      key.push_back(o == Py_True ? 'y' : 'n');
    } else if (PyLong_CheckExact(o)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      key.push_back('I');
      put(key, v);
    } else if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {  // a few ints: (1, 1), [3, 3]
      const Py_ssize_t size = PySequence_Fast_GET_SIZE(o);
      if (size > 8) return false;
      PyObject* const* items = PySequence_Fast_ITEMS(o);
      key.push_back(PyTuple_CheckExact(o) ? 'U' : 'L');
      put(key, static_cast<int8_t>(size));
      for (Py_ssize_t j = 0; j < size; ++j) {
        if (!PyLong_CheckExact(items[j])) return false;  // bools, floats, nested: Python's
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(items[j], &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) {
          PyErr_Clear();
          return false;
        }
        put(key, v);
      }
    } else if (PyFloat_CheckExact(o)) {
      key.push_back('F');
      put(key, PyFloat_AS_DOUBLE(o));
    } else if (PyUnicode_CheckExact(o)) {
      Py_ssize_t len = 0;
      const char* s = PyUnicode_AsUTF8AndSize(o, &len);
      if (s == nullptr) {
        PyErr_Clear();
        return false;
      }
      key.push_back('S');
      put(key, len);
      key.append(s, len);
    } else if (THPDtype_Check(o)) {
      key.push_back('D');
      put(key, static_cast<int8_t>(reinterpret_cast<THPDtype*>(o)->scalar_type));
    } else {
      return false;
    }
  }
  // the current device and its current stream: a plan may pass state kept per stream (a
  // workspace whose counters two grids must not share), so it holds on its own stream only
  if (!current_place(key_device, key_stream)) return false;
  put(key, key_device);
  put(key, key_stream);
  return true;
}

// torch's ops for a fused GEMM epilogue, as vitrail.gemm.ops.launch.torch_fused calls them
at::Tensor addmm_epilogue(const Plan& plan, PyObject* const* args) {
  const at::Tensor& a = THPVariable_Unpack(args[plan.args[0]]);
  const at::Tensor& b = THPVariable_Unpack(args[plan.args[1]]);
  at::Tensor d;
  if (plan.args[2] >= 0) {
    d = at::addmm(THPVariable_Unpack(args[plan.args[2]]).to(a.scalar_type()), a, b, plan.beta,
                  plan.alpha);
    if (plan.args[3] >= 0) d.add_(THPVariable_Unpack(args[plan.args[3]]));
  } else if (plan.args[3] >= 0) {
    d = at::addmm(THPVariable_Unpack(args[plan.args[3]]).to(a.scalar_type()), a, b, 1.0,
                  plan.alpha);
  } else if (plan.alpha == 1.0) {
    d = at::mm(a, b);
  } else {  // alpha applied inside the product, as torch_fused's addmm(beta=0) does
    d = at::empty({a.size(0), b.size(1)}, a.options());
    at::addmm_out(d, d, a, b, 0.0, plan.alpha);
  }
  switch (plan.activation) {
    case 0: break;
    case 1: at::relu_(d); break;
    case 2: at::leaky_relu_(d, plan.slope); break;
    case 3: at::gelu_(d, "none"); break;
    case 4: at::gelu_(d, "tanh"); break;
    case 5: at::silu_(d); break;
    case 6: at::sigmoid_(d); break;
    case 7: at::tanh_(d); break;
    case 8: at::hardswish_(d); break;
  }
  if (plan.lo || plan.hi) {
    at::clamp_(d, plan.lo ? std::optional<at::Scalar>(*plan.lo) : std::nullopt,
               plan.hi ? std::optional<at::Scalar>(*plan.hi) : std::nullopt);
  }
  return d;
}

PyObject* run(const Plan& plan, PyObject* const* args) {
  if (plan.kind == Plan::ADDMM) {  // as MATMUL: a call that records no gradient goes below
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;
    bool grad = false;
    for (int j : plan.args) grad |= j >= 0 && THPVariable_Unpack(args[j]).requires_grad();
    if (!c10::GradMode::is_enabled() || !grad) below.emplace();
    return THPVariable_Wrap(addmm_epilogue(plan, args));
  }
  if (plan.kind == Plan::MATMUL) {  // what torch.mm, torch.bmm or torch.matmul would call
    const at::Tensor& a = THPVariable_Unpack(args[plan.args[0]]);
    const at::Tensor& b = THPVariable_Unpack(args[plan.args[1]]);
    // a call that records no gradient (every call a MATMUL plan serves) goes straight to the
    // CUDA kernel, below autograd's layer, whose work for it is checks that cannot change it
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;
    if (!c10::GradMode::is_enabled() || !(a.requires_grad() || b.requires_grad())) below.emplace();
    return THPVariable_Wrap(a.dim() == 2 && b.dim() == 2   ? at::mm(a, b)
                            : a.dim() == 3 && b.dim() == 3 ? at::bmm(a, b)
                                                           : at::matmul(a, b));
  }
  std::vector<at::Tensor> tensors;  // the plan's: arguments, outputs, scratch
  tensors.reserve(plan.args.size() + plan.outputs.size() + plan.scratch.size());
  for (int j : plan.args) tensors.push_back(THPVariable_Unpack(args[j]));
  for (const auto* allocs : {&plan.outputs, &plan.scratch}) {
    for (const Alloc& a : *allocs) {
      tensors.push_back(at::empty_strided(a.sizes, a.strides,
                                          at::TensorOptions().dtype(a.dtype).device(a.device)));
    }
  }
  const unsigned long long stream = key_stream;  // the current stream (make_key)
  std::vector<char*> bases;
  bases.reserve(tensors.size());
  for (at::Tensor& t : tensors) bases.push_back(static_cast<char*>(t.data_ptr()));
  // The GIL stays held: releasing and taking it again costs about 0.4 µs a call (torch's own
  // bindings pay it), and a launch waits only where the GPU's queue of work is full.
  int failed_at = -1;
  long long code = 0;
  unsigned long long values[64];
  void* params[64];
  alignas(64) unsigned char maps[8][128];
  static const unsigned ones[5] = {1, 1, 1, 1, 1};
  for (size_t j = 0; j < plan.launches.size() && failed_at < 0; ++j) {
    const Launch& l = plan.launches[j];
    int encoded = 0;
    for (size_t k = 0; k < l.slots.size() && failed_at < 0; ++k) {
      const Slot& s = l.slots[k];
      params[k] = &values[k];
      if (s.kind == MAP) {
        const TensorMap& m = plan.maps[s.value];
        code = cu_encode(maps[encoded], m.data_type, m.rank, bases[s.tensor] + m.offset,
                         m.dims, m.strides, m.box, ones, 0, m.swizzle, 2 /* L2 128B */, 0);
        if (code != 0) failed_at = static_cast<int>(j);
        params[k] = maps[encoded++];
        continue;
      }
      values[k] = s.kind == CONST ? s.value
                  : s.kind == STREAM ? stream
                  : reinterpret_cast<unsigned long long>(bases[s.tensor] + s.value);
    }
    if (failed_at >= 0) break;
    if (l.entry) {
      code = l.packed(l.target, values);
      if (l.check && code != 0) failed_at = static_cast<int>(j);
    } else if (l.dims[0] && l.dims[1] && l.dims[2]) {
      code = cu_launch(l.target, l.dims[0], l.dims[1], l.dims[2], l.dims[3], l.dims[4],
                       l.dims[5], l.shared_mem, reinterpret_cast<void*>(stream), params, nullptr);
      if (code != 0) failed_at = static_cast<int>(j);
    }
  }
  if (failed_at >= 0) {
    PyObject* r = PyObject_CallFunction(plan.failed, "iL", failed_at, code);
    Py_XDECREF(r);  // it raises
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "vitrail plan: launch failed");
    return nullptr;
  }
  if (plan.result >= 0) return THPVariable_Wrap(tensors[plan.result]);
  if (plan.result == -1) Py_RETURN_NONE;
  const size_t first = plan.args.size();
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(plan.outputs.size()));
  for (size_t k = 0; k < plan.outputs.size(); ++k) {
    PyTuple_SET_ITEM(out, k, THPVariable_Wrap(tensors[first + k]));
  }
  return out;
}

// ------------------------------------------------------------------ autograd
[[noreturn]] void throw_python_error() {  // the pending Python error, kept (GIL held)
  python_error e;
  e.persist();
  throw std::move(e);
}

using NodePtr = decltype(torch::autograd::Edge::function);  // shared_ptr or intrusive_ptr

template <class T, class P = NodePtr>
P make_node(std::shared_ptr<GradRule> rule) {
  if constexpr (std::is_same_v<P, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::move(rule));
  } else {
    return c10::make_intrusive<T>(std::move(rule));
  }
}

// This node as the pointer type torch's edges hold (what a saved output is unpacked for).
template <class P = NodePtr, class N = torch::autograd::Node>  // N: dependent, for old torch
P self_pointer(N* node) {
  if constexpr (std::is_same_v<P, std::shared_ptr<torch::autograd::Node>>) {
    return node->shared_from_this();
  } else {
    return P::reclaim_copy(node);
  }
}

PyObject* table_call(Table* self, PyObject* const* args, Py_ssize_t n);

constexpr size_t MAX_STEP_ARGS = 32;

// The rule's steps on the backward's arguments (call): each step's table, or its function
// where the table misses (it runs the Python path, and learns the key's plan), into out.
void run_steps(const GradRule& rule, PyObject* call, torch::autograd::variable_list& out) {
  PyObject* items[MAX_STEP_ARGS];
  for (const GradRule::Step& st : rule.steps) {
    const Py_ssize_t n = static_cast<Py_ssize_t>(st.args.size());
    for (Py_ssize_t k = 0; k < n; ++k) {
      const GradRule::Arg& a = st.args[k];
      items[k] = a.kind == GradRule::ARG ? PyTuple_GET_ITEM(call, a.index) : a.value;
    }
    PyObject* r = table_call(reinterpret_cast<Table*>(st.table), items, n);
    if (r == MISS) {
      Py_DECREF(r);
      r = PyObject_Vectorcall(st.fn, items, n, nullptr);
    }
    if (r == nullptr) throw_python_error();
    if (!THPVariable_Check(r)) {
      Py_DECREF(r);
      throw std::runtime_error(rule.name + ": a backward step returned no tensor");
    }
    out[st.gradient] = THPVariable_Unpack(r);
    Py_DECREF(r);
  }
}

// The backward of one planned call: the rule's function on the saved tensors, the output
// gradients and the values. Tensors are saved as torch saves its own (SavedVariable: an output
// without a reference cycle, a version check, freed after backward, history kept for
// create_graph).
struct GradNode : torch::autograd::Node {
  explicit GradNode(std::shared_ptr<GradRule> r) : rule(std::move(r)) {}
  std::shared_ptr<GradRule> rule;
  std::vector<torch::autograd::SavedVariable> saved;  // the rule's OUTPUT and INPUT args

  std::string name() const override { return rule->name; }
  void release_variables() override {
    for (auto& v : saved) v.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::vector<at::Tensor> tensors;  // unpacked: checked for in-place changes and release
    for (auto& v : saved) {
      tensors.push_back(v.unpack(self_pointer<NodePtr, torch::autograd::Node>(this)));
    }
    torch::autograd::variable_list out(rule->inputs.size());
    for (const GradRule::Arg& a : rule->args) {  // a zero gradient (undefined): zero results
      if (a.kind == GradRule::GRAD && !grads[a.index].defined()) return out;
    }
    pybind11::gil_scoped_acquire gil;
    PyObject* call = PyTuple_New(static_cast<Py_ssize_t>(rule->args.size()));
    if (call == nullptr) throw_python_error();
    size_t next_saved = 0;
    for (size_t k = 0; k < rule->args.size(); ++k) {
      const GradRule::Arg& a = rule->args[k];
      PyObject* v = a.kind == GradRule::VALUE ? Py_NewRef(a.value)
                    : a.kind == GradRule::GRAD ? THPVariable_Wrap(grads[a.index])
                                               : THPVariable_Wrap(tensors[next_saved++]);
      if (v == nullptr) {
        Py_DECREF(call);
        throw_python_error();
      }
      PyTuple_SET_ITEM(call, k, v);
    }
    if (!rule->steps.empty() && !c10::GradMode::is_enabled()) {
      try {  // (create_graph: the Python backward builds the graph)
        run_steps(*rule, call, out);
      } catch (...) {
        Py_DECREF(call);
        throw;
      }
      Py_DECREF(call);
      return out;
    }
    PyObject* r = PyObject_Call(rule->backward, call, nullptr);
    Py_DECREF(call);
    if (r == nullptr) throw_python_error();
    const bool many = PyTuple_Check(r);
    const Py_ssize_t got = many ? PyTuple_GET_SIZE(r) : 1;
    if (got != static_cast<Py_ssize_t>(out.size())) {
      Py_DECREF(r);
      throw std::runtime_error(rule->name + ": the backward returned " + std::to_string(got) +
                               " gradients for " + std::to_string(out.size()) + " inputs");
    }
    for (Py_ssize_t k = 0; k < got; ++k) {
      PyObject* g = many ? PyTuple_GET_ITEM(r, k) : r;
      if (g == Py_None) continue;
      if (!THPVariable_Check(g)) {
        Py_DECREF(r);
        throw std::runtime_error(rule->name + ": the backward returned a non-tensor gradient");
      }
      out[k] = THPVariable_Unpack(g);
    }
    Py_DECREF(r);
    return out;
  }
};

// The plan's result, given its history: a GradNode whose inputs are the differentiable
// arguments' gradient edges and whose outputs are the plan's new outputs.
PyObject* run_recording(const Plan& plan, PyObject* const* args) {
  PyObject* result;
  {
    c10::AutoGradMode off(false);
    result = run(plan, args);
  }
  if (result == nullptr) return nullptr;
  std::vector<at::Tensor> outputs;
  if (PyTuple_Check(result)) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(result); ++k) {
      outputs.push_back(THPVariable_Unpack(PyTuple_GET_ITEM(result, k)));
    }
  } else {
    outputs.push_back(THPVariable_Unpack(result));
  }
  const GradRule& rule = *plan.grad;
  auto node = make_node<GradNode>(plan.grad);
  torch::autograd::edge_list edges;
  for (int j : rule.inputs) {
    edges.push_back(torch::autograd::impl::gradient_edge(THPVariable_Unpack(args[j])));
  }
  node->set_next_edges(std::move(edges));
  for (const at::Tensor& t : outputs) torch::autograd::set_history(t, node);
  auto* grad_node = static_cast<GradNode*>(node.get());
  for (const GradRule::Arg& a : rule.args) {  // saved once the outputs have their history
    if (a.kind == GradRule::OUTPUT) {
      grad_node->saved.emplace_back(outputs[a.index], /*is_output=*/true);
    } else if (a.kind == GradRule::INPUT) {
      grad_node->saved.emplace_back(THPVariable_Unpack(args[a.index]), /*is_output=*/false);
    }
  }
  return result;
}

// A thread with no current CUDA context (autograd's device threads, before their first
// runtime call) gets the device's primary context, as the runtime would give it.
bool have_context(long device) {
  void* ctx = nullptr;
  if (cu_ctx_current == nullptr || cu_ctx_current(&ctx) != 0) return false;
  if (ctx != nullptr) return true;
  if (device < 0 || device >= 64 || cu_primary == nullptr || cu_set_current == nullptr) {
    return false;
  }
  static void* primary[64] = {};
  if (primary[device] == nullptr) {
    int dev = 0;
    void* made = nullptr;
    if (cu_device_get(&dev, static_cast<int>(device)) != 0 || cu_primary(&made, dev) != 0) {
      return false;
    }
    primary[device] = made;  // retained once for the process, as torch's runtime does
  }
  return cu_set_current(primary[device]) == 0;
}

// table.call(*args) -> the plan's result, or MISS
PyObject* table_call(Table* self, PyObject* const* args, Py_ssize_t n) {
  pending_table = nullptr;
  if (recording) return Py_NewRef(MISS);
  PyObject* scope = nullptr;
  if (PyContextVar_Get(scoped, Py_None, &scope) < 0) return nullptr;
  Py_DECREF(scope);
  if (scope != Py_None) return Py_NewRef(MISS);
  std::string& key = key_buffer;
  bool records = false;
  if (!make_key(args, n, key, self->grad, records)) return Py_NewRef(MISS);
  auto found = self->plans->find(key);
  if (found == self->plans->end()) {
    pending = key;
    pending_table = self;
    pending_grad = records;
    return Py_NewRef(MISS);
  }
  std::shared_ptr<Plan> plan = found->second;  // alive while it runs, cleared or not
  if (plan->kind == Plan::GENERAL) return Py_NewRef(MISS);
  if (plan->launches_kernels && !have_context(key_device)) return Py_NewRef(MISS);
  try {
    return records ? run_recording(*plan, args) : run(*plan, args);
  } catch (python_error& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// ------------------------------------------------------------------ plans from descriptions
template <typename T>
bool read_ints(PyObject* seq, std::vector<T>& out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    out.push_back(static_cast<T>(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i))));
  }
  Py_DECREF(fast);
  return !PyErr_Occurred();
}

// alloc: (sizes, strides, dtype, device index or -1 for the CPU)
bool read_alloc(PyObject* o, std::vector<Alloc>& out) {
  PyObject *sizes, *strides, *dtype;
  int device;
  if (!PyArg_ParseTuple(o, "OOO!i", &sizes, &strides, &THPDtypeType, &dtype, &device)) {
    return false;
  }
  Alloc a{{}, {}, reinterpret_cast<THPDtype*>(dtype)->scalar_type,
          device < 0 ? c10::Device(c10::kCPU)
                     : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))};
  if (!read_ints(sizes, a.sizes) || !read_ints(strides, a.strides)) return false;
  out.push_back(std::move(a));
  return true;
}

// map: (data type, dims, strides in bytes, box, swizzle, byte offset)
bool read_map(PyObject* o, std::vector<TensorMap>& out) {
  PyObject *dims, *strides, *box;
  TensorMap m{};
  if (!PyArg_ParseTuple(o, "iOOOiK", &m.data_type, &dims, &strides, &box, &m.swizzle,
                        &m.offset)) {
    return false;
  }
  std::vector<unsigned long long> d, s;
  std::vector<unsigned> b;
  if (!read_ints(dims, d) || !read_ints(strides, s) || !read_ints(box, b)) return false;
  if (d.empty() || d.size() > 5 || b.size() != d.size() || s.size() + 1 != d.size()) {
    PyErr_SetString(PyExc_ValueError, "a tensor map has 1 to 5 dims, a box each, strides but one");
    return false;
  }
  if (cu_encode == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "no libcuda: tensor maps cannot be encoded");
    return false;
  }
  m.rank = static_cast<unsigned>(d.size());
  std::copy(d.begin(), d.end(), m.dims);
  std::copy(s.begin(), s.end(), m.strides);
  std::copy(b.begin(), b.end(), m.box);
  out.push_back(m);
  return true;
}

// launch: (is_entry, target, packed caller, check, (grid and block), shared_mem,
//          ((kind, tensor, value), ...))
bool read_launch(PyObject* o, Plan& plan) {
  int entry, check;
  unsigned long long target, packed;
  unsigned shared_mem;
  PyObject *dims, *slots;
  if (!PyArg_ParseTuple(o, "pKKpOIO", &entry, &target, &packed, &check, &dims, &shared_mem,
                        &slots)) {
    return false;
  }
  Launch l{};
  l.entry = entry;
  l.target = reinterpret_cast<void*>(target);
  l.packed = reinterpret_cast<Packed>(packed);
  l.check = check;
  l.shared_mem = shared_mem;
  std::vector<unsigned> d;
  if (!read_ints(dims, d)) return false;
  if (d.size() != 6) {
    PyErr_SetString(PyExc_ValueError, "a launch's dims are 6 ints");
    return false;
  }
  std::copy(d.begin(), d.end(), l.dims);
  PyObject* fast = PySequence_Fast(slots, "slots must be a sequence");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    Slot s{};
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iiK", &s.kind, &s.tensor,
                          &s.value)) {
      Py_DECREF(fast);
      return false;
    }
    if (s.kind == MAP && (l.entry || s.value >= plan.maps.size())) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_ValueError, "a map slot names one of the plan's maps, in a kernel");
      return false;
    }
    l.slots.push_back(s);
  }
  Py_DECREF(fast);
  int n_maps = 0;
  for (const Slot& s : l.slots) n_maps += s.kind == MAP;
  if (l.slots.size() > 64 || n_maps > 8) {
    PyErr_SetString(PyExc_ValueError, "a launch takes at most 64 values, 8 of them maps");
    return false;
  }
  if (!l.entry && cu_launch == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "no libcuda: kernels cannot be launched");
    return false;
  }
  if ((l.entry && l.packed == nullptr) || l.target == nullptr) {
    PyErr_SetString(PyExc_ValueError, "a launch needs its target (and an entry its caller)");
    return false;
  }
  plan.launches_kernels |= !l.entry;
  plan.launches.push_back(std::move(l));
  return true;
}

template <typename F>
bool each(PyObject* seq, F&& f) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence");
  if (fast == nullptr) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i) {
    ok = f(PySequence_Fast_GET_ITEM(fast, i));
  }
  Py_DECREF(fast);
  return ok;
}

extern PyTypeObject TableType;

// One (kind, index or value) of a rule's or a step's arguments, appended to out: a VALUE's
// value, or an index below limit(kind) (0 for a kind not taken there).
template <typename Limit>
bool read_arg(PyObject* o, Limit&& limit, std::vector<GradRule::Arg>& out) {
  int kind;
  PyObject* v;
  if (!PyArg_ParseTuple(o, "iO", &kind, &v)) return false;
  GradRule::Arg arg{kind, 0, nullptr};
  if (kind == GradRule::VALUE) {
    arg.value = Py_NewRef(v);
  } else {
    arg.index = static_cast<int>(PyLong_AsLong(v));
    if (PyErr_Occurred()) return false;
    if (arg.index < 0 || arg.index >= limit(kind)) {
      PyErr_SetString(PyExc_ValueError, "a gradient rule's argument names nothing it has");
      return false;
    }
  }
  out.push_back(arg);
  return true;
}

// A step: (fn, its front's table, ((ARG, rule argument) or (VALUE, value), ...), gradient)
bool read_step(PyObject* o, GradRule& rule) {
  PyObject *fn, *table, *args;
  int gradient;
  if (!PyArg_ParseTuple(o, "OOOi", &fn, &table, &args, &gradient)) return false;
  if (!PyCallable_Check(fn) || Py_TYPE(table) != &TableType || gradient < 0 ||
      gradient >= static_cast<int>(rule.inputs.size())) {
    PyErr_SetString(PyExc_ValueError, "a gradient rule's step: (front function, its table, "
                                      "args, the index of an input's gradient)");
    return false;
  }
  GradRule::Step& st = rule.steps.emplace_back();  // (freed with the rule, complete or not)
  st.fn = Py_NewRef(fn);
  st.table = Py_NewRef(table);
  st.gradient = gradient;
  const int n = static_cast<int>(rule.args.size());
  return each(args, [&](PyObject* a) {
    if (st.args.size() == MAX_STEP_ARGS) {
      PyErr_Format(PyExc_ValueError, "a gradient rule's step takes at most %d arguments",
                   static_cast<int>(MAX_STEP_ARGS));
      return false;
    }
    return read_arg(a, [&](int kind) { return kind == GradRule::ARG ? n : 0; }, st.args);
  });
}

// grad: (backward, ((kind, index or value), ...), (differentiable argument positions), name,
// steps=()); each step read_step's
bool read_grad(PyObject* o, Plan& plan) {
  PyObject *backward, *args, *inputs, *steps = nullptr;
  const char* name;
  if (!PyArg_ParseTuple(o, "OOOs|O", &backward, &args, &inputs, &name, &steps)) return false;
  auto rule = std::make_shared<GradRule>();
  rule->backward = Py_NewRef(backward);
  rule->name = name;
  if (!PyCallable_Check(backward) || !read_ints(inputs, rule->inputs)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a gradient rule's backward");
    return false;
  }
  const int outputs = plan.result == -2 ? static_cast<int>(plan.outputs.size()) : 1;
  const bool ok = each(args, [&](PyObject* a) {
    return read_arg(a, [&](int kind) {
      return kind == GradRule::INPUT ? 1 << 30
             : kind == GradRule::OUTPUT || kind == GradRule::GRAD ? outputs : 0;
    }, rule->args);
  });
  if (!ok) return false;
  if (steps != nullptr && !each(steps, [&](PyObject* st) { return read_step(st, *rule); })) {
    return false;
  }
  plan.grad = std::move(rule);
  return true;
}

// table.add(description, grad=None) -> bool: the pending miss's key gets this plan (False: no
// pending miss of this table in this thread). description: ("general",), ("matmul", (a, b)),
// ("addmm", (a, b, c, bias), (alpha, beta, activation, slope, lo, hi)) (-1, None: absent), or
// ("launches", args, outputs, scratch, launches, maps, result, keep, failed); grad (where
// the miss recorded gradients): read_grad's. A call that records gradients gets a plan only
// with its rule, and only one whose results are new outputs; else "general".
PyObject* table_add(Table* self, PyObject* const* argv, Py_ssize_t argc) {
  if (argc < 1 || argc > 2) {
    PyErr_SetString(PyExc_TypeError, "add(description, grad=None)");
    return nullptr;
  }
  PyObject* desc = argv[0];
  PyObject* grad = argc == 2 ? argv[1] : Py_None;
  if (pending_table != self) Py_RETURN_FALSE;
  if (!PyTuple_Check(desc) || PyTuple_GET_SIZE(desc) < 1) {
    PyErr_SetString(PyExc_TypeError, "a plan description is a tuple");
    return nullptr;
  }
  auto plan = std::make_shared<Plan>();
  const char* kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(desc, 0));
  if (kind == nullptr) return nullptr;
  if (std::strcmp(kind, "general") == 0) {
    plan->kind = Plan::GENERAL;
  } else if (std::strcmp(kind, "matmul") == 0) {
    plan->kind = Plan::MATMUL;
    if (PyTuple_GET_SIZE(desc) != 2 || !read_ints(PyTuple_GET_ITEM(desc, 1), plan->args) ||
        plan->args.size() != 2) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "matmul takes (a, b)");
      return nullptr;
    }
  } else if (std::strcmp(kind, "addmm") == 0) {
    plan->kind = Plan::ADDMM;
    PyObject *args, *lo, *hi;
    if (!PyArg_ParseTuple(desc, "sO(ddidOO)", &kind, &args, &plan->alpha, &plan->beta,
                          &plan->activation, &plan->slope, &lo, &hi) ||
        !read_ints(args, plan->args)) {
      return nullptr;
    }
    if (plan->args.size() != 4 || plan->args[0] < 0 || plan->args[1] < 0 ||
        plan->activation < 0 || plan->activation > 8) {
      PyErr_SetString(PyExc_ValueError, "addmm takes (a, b, c, bias) and an activation 0-8");
      return nullptr;
    }
    if (lo != Py_None) plan->lo = PyFloat_AsDouble(lo);
    if (hi != Py_None) plan->hi = PyFloat_AsDouble(hi);
    if (PyErr_Occurred()) return nullptr;
  } else if (std::strcmp(kind, "launches") == 0) {
    plan->kind = Plan::LAUNCHES;
    PyObject *args, *outputs, *scratch, *launches, *maps, *keep, *failed;
    int result;
    if (!PyArg_ParseTuple(desc, "sOOOOOiOO", &kind, &args, &outputs, &scratch, &launches, &maps,
                          &result, &keep, &failed) ||
        !read_ints(args, plan->args) ||
        !each(outputs, [&](PyObject* o) { return read_alloc(o, plan->outputs); }) ||
        !each(scratch, [&](PyObject* o) { return read_alloc(o, plan->scratch); }) ||
        !each(maps, [&](PyObject* o) { return read_map(o, plan->maps); }) ||
        !each(launches, [&](PyObject* o) { return read_launch(o, *plan); })) {
      return nullptr;
    }
    plan->result = result;
    plan->keep = Py_NewRef(keep);
    plan->failed = Py_NewRef(failed);
  } else {
    PyErr_Format(PyExc_ValueError, "unknown plan kind '%s'", kind);
    return nullptr;
  }
  if (pending_grad && plan->kind != Plan::GENERAL) {
    const bool fresh = plan->kind == Plan::LAUNCHES &&
                       (plan->result == -2 || plan->result >= static_cast<int>(plan->args.size()));
    if (!fresh || grad == Py_None) {
      plan = std::make_shared<Plan>();  // general
    } else if (!read_grad(grad, *plan)) {
      return nullptr;
    }
  }
  pending_table = nullptr;  // a description that failed to parse leaves the key pending
  if (static_cast<Py_ssize_t>(self->plans->size()) >= self->capacity) self->plans->clear();
  (*self->plans)[pending] = std::move(plan);
  Py_RETURN_TRUE;
}

PyObject* table_pending(Table* self, PyObject*) {
  return PyBool_FromLong(pending_table == self);
}

PyObject* table_pending_grad(Table* self, PyObject*) {
  return PyBool_FromLong(pending_table == self && pending_grad);
}

PyObject* table_set_grad(Table* self, PyObject*) {
  self->grad = true;
  Py_RETURN_NONE;
}

PyObject* table_clear(Table* self, PyObject*) {
  self->plans->clear();
  if (pending_table == self) pending_table = nullptr;
  Py_RETURN_NONE;
}

Py_ssize_t table_len(Table* self) { return static_cast<Py_ssize_t>(self->plans->size()); }

PyObject* table_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  Py_ssize_t capacity = 4096;
  static const char* names[] = {"capacity", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|n", const_cast<char**>(names), &capacity)) {
    return nullptr;
  }
  Table* self = reinterpret_cast<Table*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->plans = new std::unordered_map<std::string, std::shared_ptr<Plan>>();
  self->capacity = capacity;
  self->grad = false;
  return reinterpret_cast<PyObject*>(self);
}

void table_dealloc(Table* self) {
  delete self->plans;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMethodDef table_methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(table_call)),
     METH_FASTCALL, "call(*args): the plan's result, or MISS"},
    {"add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(table_add)),
     METH_FASTCALL, "add(description, grad=None): the plan of this thread's pending miss"},
    {"pending_grad", reinterpret_cast<PyCFunction>(table_pending_grad), METH_NOARGS,
     "whether this thread's pending miss recorded gradients (its plan needs a rule)"},
    {"set_grad", reinterpret_cast<PyCFunction>(table_set_grad), METH_NOARGS,
     "calls that record gradients may have plans, each with its gradient rule"},
    {"pending", reinterpret_cast<PyCFunction>(table_pending), METH_NOARGS,
     "whether this thread's last call() of this table missed a key it could learn"},
    {"clear", reinterpret_cast<PyCFunction>(table_clear), METH_NOARGS, "drop every plan"},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods table_sequence = {reinterpret_cast<lenfunc>(table_len)};

PyTypeObject TableType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// init(get_device, get_stream, scoped, miss)
PyObject* init(PyObject*, PyObject* args) {
  if (!PyArg_ParseTuple(args, "OOOO", &get_device, &get_stream, &scoped, &MISS)) return nullptr;
  for (PyObject* o : {get_device, get_stream, scoped, MISS}) Py_INCREF(o);
  Py_RETURN_NONE;
}

PyObject* set_recording(PyObject*, PyObject* n) {
  recording = PyLong_AsLong(n);
  if (recording == -1 && PyErr_Occurred()) return nullptr;
  Py_RETURN_NONE;
}

PyObject* can_launch(PyObject*, PyObject*) { return PyBool_FromLong(cu_launch != nullptr); }

PyMethodDef methods[] = {
    {"init", init, METH_VARARGS, "init(get_device, get_stream, scoped, miss)"},
    {"set_recording", set_recording, METH_O, "the number of calls being recorded"},
    {"can_launch", can_launch, METH_NOARGS, "whether kernels can be launched (libcuda)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "vitrail_hit", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_vitrail_hit(void) {
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (cuda == nullptr) cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (cuda != nullptr) {
    cu_launch = reinterpret_cast<LaunchFn>(dlsym(cuda, "cuLaunchKernel"));
    cu_ctx_current = reinterpret_cast<CtxFn>(dlsym(cuda, "cuCtxGetCurrent"));
    cu_set_current = reinterpret_cast<SetCtxFn>(dlsym(cuda, "cuCtxSetCurrent"));
    cu_device_get = reinterpret_cast<DeviceGetFn>(dlsym(cuda, "cuDeviceGet"));
    cu_primary = reinterpret_cast<PrimaryFn>(dlsym(cuda, "cuDevicePrimaryCtxRetain"));
    cu_encode = reinterpret_cast<EncodeFn>(dlsym(cuda, "cuTensorMapEncodeTiled"));
  }
  TableType.tp_name = "vitrail_hit.Table";
  TableType.tp_basicsize = sizeof(Table);
  TableType.tp_flags = Py_TPFLAGS_DEFAULT;
  TableType.tp_doc = "One op family's plans, keyed by its public function's arguments";
  TableType.tp_new = table_new;
  TableType.tp_dealloc = reinterpret_cast<destructor>(table_dealloc);
  TableType.tp_methods = table_methods;
  TableType.tp_as_sequence = &table_sequence;
  if (PyType_Ready(&TableType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&TableType);
  if (PyModule_AddObject(m, "Table", reinterpret_cast<PyObject*>(&TableType)) < 0) {
    Py_DECREF(&TableType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
