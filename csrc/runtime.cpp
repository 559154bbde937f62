// The per-call path of the fused op's CUDA kernels (forward, and the generated backward of pointwise,
// norm and reduction programs): checks, GEMM through ATen (cuBLAS(Lt), bias
// epilogue, TF32 as eager), output allocation from the caching allocator, and the launch of a
// program module's kernels on the current stream. No host synchronisation, so CUDA graphs capture
// it. Built once per toolchain; program modules (csrc/row_epilogue.cuh) are reached through the
// FxProgramInfo address Python hands in, GEMM modules (csrc/gemm_epilogue.cuh: the epilogue inside
// a CUTLASS GEMM) through their FxGemmInfo address, with the configuration measured fastest for
// the call's bucket of M (or none: the row path).
//
// The CUDA build registers the op's CUDA kernel with the dispatcher (TORCH_LIBRARY_IMPL below), so
// a compiled graph's call reaches the kernels with no Python in between; Python only fills the
// table of prepared programs and handles what the table does not cover.
//
// run() returns None when the kernels do not cover the call (an unsupported shape, a batch of one
// for a training BatchNorm, mismatched parameters, ...): the caller then runs the reference, which
// raises eager's error where eager raises one. With FX_EMULATE the same code drives the host
// emulation of the kernels on CPU tensors (tests on machines without a GPU).
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#if !defined(FX_EMULATE)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "fx_abi.h"

namespace {

using at::Tensor;

std::optional<at::ScalarType> scalar_type_of(int32_t code) {
  switch (code) {
    case FX_F32: return at::kFloat;
    case FX_BF16: return at::kBFloat16;
    case FX_F16: return at::kHalf;
    default: return std::nullopt;
  }
}

std::optional<int32_t> code_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return FX_F32;
    case at::kBFloat16: return FX_BF16;
    case at::kHalf: return FX_F16;
    default: return std::nullopt;
  }
}

struct DeviceFacts {
  int32_t sm_count = 1;
  int32_t smem_optin = 48 * 1024;
};

// Multiprocessor count and opt-in shared memory of a device, queried once.
DeviceFacts device_facts(int device) {
#if defined(FX_EMULATE)
  (void)device;
  return DeviceFacts{4, 227 * 1024};
#else
  constexpr int kMaxDevices = 64;
  static std::array<DeviceFacts, kMaxDevices> facts;
  static std::array<std::once_flag, kMaxDevices> once;
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "fxfuse: device index ", device);
  std::call_once(once[device], [device] {
    DeviceFacts f;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.sm_count, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    facts[device] = f;
  });
  return facts[device];
#endif
}

// The stream the kernels of a call on t's device go to (none when emulated on the host).
void* current_stream(const Tensor& t) {
#if defined(FX_EMULATE)
  (void)t;
  return nullptr;
#else
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
#endif
}

bool on_kernel_device(const Tensor& t) {
#if defined(FX_EMULATE)
  return t.is_cpu();
#else
  return t.is_cuda();
#endif
}

// Whether a full operand broadcast along the leading dims of the output `full` is, past its leading
// 1s, the output's trailing shape ((T, N) or (1, T, N) of (B, T, N)): then output row r reads its
// row r mod P (P = its rows), and the row kernels read it where it is.
bool rows_repeat(at::IntArrayRef operand, const std::vector<int64_t>& full) {
  size_t first = 0;
  while (first < operand.size() && operand[first] == 1) ++first;
  const size_t dims = operand.size() - first;
  return dims >= 1 && dims <= full.size() &&
         std::equal(operand.begin() + first, operand.end(), full.end() - static_cast<std::ptrdiff_t>(dims));
}

// A parameter as the kernels read it: 1 (scalar), N (column), M (row: one value a row, its last dim
// 1; one a sample expands), M x N (full: the output's shape, N its last dim; one broadcast along
// the rows expands, unless `repeat_rows` and its rows repeat (rows_repeat): then P x N) or P x D
// (head: a rotary table of P rows dividing M, D dividing N) contiguous values of a float type, on
// x's device, and P (0 where the kernels read it otherwise: FxParam::rows). nullopt where the
// reference would raise (wrong size or device).
struct KernelParam {
  Tensor values;
  int64_t rows;
};

std::optional<KernelParam> kernel_param(const Tensor& p, int32_t kind, int64_t m, int64_t n, const Tensor& x,
                                        bool repeat_rows) {
  if (kind == FX_PARAM_GEMM) kind = FX_PARAM_FULL;  // by now its GEMM's output (second_gemm_outputs)
  if (kind == FX_PARAM_SEED) {  // two int64 values on x's device, read as they are
    if (p.numel() != 2 || p.scalar_type() != at::kLong || p.device() != x.device()) return std::nullopt;
    return KernelParam{p.reshape({2}).contiguous(), 0};
  }
  Tensor q = p;
  int64_t full_rows = m;
  if (kind == FX_PARAM_FULL && p.numel() != m * n) {  // broadcast along the rows ((T, N) of (B, T, N))
    std::vector<int64_t> full(x.sizes().begin(), x.sizes().end() - 1);
    full.push_back(n);
    if (!at::is_expandable_to(p.sizes(), full)) return std::nullopt;
    if (repeat_rows && rows_repeat(p.sizes(), full)) {
      full_rows = p.numel() / n;  // P rows, read at row r mod P
    } else {
      q = p.expand(full);  // made contiguous below: the kernels read M x N values
    }
  }
  if (kind == FX_PARAM_ROW && p.numel() != m) {  // one value a sample: expand it to one a row
    std::vector<int64_t> rows(x.sizes().begin(), x.sizes().end() - 1);
    rows.push_back(1);
    if (p.dim() != static_cast<int64_t>(rows.size()) || !at::is_expandable_to(p.sizes(), rows)) return std::nullopt;
    q = p.expand(rows);
  }
  if (kind == FX_PARAM_HEAD) {
    const int64_t d = q.dim() >= 1 ? q.size(-1) : 0;
    if (d == 0 || q.numel() == 0 || n % d != 0 || m % (q.numel() / d) != 0 || q.device() != x.device()) {
      return std::nullopt;
    }
  }
  const int64_t numel = kind == FX_PARAM_HEAD ? q.numel() : kind == FX_PARAM_FULL ? full_rows * n
                        : kind == FX_PARAM_COL ? n : kind == FX_PARAM_ROW ? m : 1;
  if (q.numel() != numel || (kind == FX_PARAM_FULL && (q.dim() < 1 || q.size(-1) != n)) ||
      (kind == FX_PARAM_ROW && (q.dim() < 1 || q.size(-1) != 1))) {
    return std::nullopt;
  }
  if (q.device() != x.device()) {
    if (!(q.is_cpu() && q.numel() == 1)) return std::nullopt;  // a CPU scalar, as eager allows
    q = q.to(x.device());
  }
  if (!code_of(q.scalar_type())) q = q.to(at::kFloat);
  q = q.reshape({q.numel()}).contiguous();
  if (reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 != 0) q = q.clone();  // the kernels load 16 bytes
  const int64_t rows = kind == FX_PARAM_HEAD ? numel / p.size(-1) : full_rows != m ? full_rows : 0;
  return KernelParam{q, rows};
}

// The program's parameters as its kernels read them (kept alive in `kept`); false where one does
// not fit (the caller then leaves the call to the reference or the row path). `dtypes`, where
// given, are the FxDtype codes a module compiled its parameter loads for (a GEMM module's).
// `repeat_rows`: the kernels read a full operand broadcast along the leading dims at row r mod P
// (the row kernels; the in-GEMM epilogue loads M x N values by TMA, so for it such an operand
// expands). `unread`: a parameter the kernels do not read (a gated module's second weight), passed
// as null.
bool kernel_params(at::TensorList params, const int32_t* kinds, const int32_t* dtypes, int64_t m, int64_t n,
                   const Tensor& like, bool repeat_rows, std::vector<Tensor>& kept, std::vector<FxParam>& fx_params,
                   int64_t unread = -1) {
  kept.reserve(params.size());
  fx_params.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (static_cast<int64_t>(i) == unread) {
      fx_params.push_back(FxParam{nullptr, dtypes != nullptr ? dtypes[i] : FX_F32, 0});
      continue;
    }
    std::optional<KernelParam> q = kernel_param(params[i], kinds[i], m, n, like, repeat_rows);
    if (!q) return false;
    const int32_t code = kinds[i] == FX_PARAM_SEED ? FX_F32 : *code_of(q->values.scalar_type());  // unused for a seed
    if (dtypes != nullptr && code != dtypes[i]) return false;
    if (q->rows > INT32_MAX) return false;
    kept.push_back(q->values);
    fx_params.push_back(FxParam{q->values.data_ptr(), code, static_cast<int32_t>(q->rows)});
  }
  return true;
}

// The GEMM in x's dtype, as the reference: no autocast re-dispatch inside the op.
Tensor gemm_of(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return at::linear(x, weight, bias);
}

// The GEMM into `out` (contiguous, of the output's shape), as at::linear computes it for a
// contiguous x: one addmm (the bias in cuBLAS's epilogue) over x's rows; no autocast either.
void gemm_into(Tensor& out, const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const int64_t k = x.size(-1), n = weight.size(0);
  Tensor rows = out.view({-1, n});
  const Tensor x_rows = x.reshape({-1, k});
  if (bias) {
    at::addmm_out(rows, *bias, x_rows, weight.t());
  } else {
    at::mm_out(rows, x_rows, weight.t());
  }
}

// The parameters with each second GEMM's weight (FX_PARAM_GEMM: (N, K), x's dtype and device)
// replaced by x @ weight.T; with `stacked` (the op's saved GEMM output: (1 + G, *rows, N)) the
// outputs are written into stacked[1], stacked[2], ... nullopt where a weight does not fit x (the
// reference then raises eager's error).
std::optional<std::vector<Tensor>> second_gemm_outputs(at::TensorList params, const int32_t* kinds, const Tensor& x,
                                                       int64_t n, const Tensor* stacked) {
  std::vector<Tensor> values(params.begin(), params.end());
  int64_t j = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (kinds[i] != FX_PARAM_GEMM) continue;
    const Tensor& w = values[i];
    if (w.dim() != 2 || w.size(0) != n || w.size(1) != x.size(-1) || w.scalar_type() != x.scalar_type() ||
        w.device() != x.device()) {
      return std::nullopt;
    }
    if (stacked != nullptr) {
      Tensor into = stacked->select(0, ++j);
      gemm_into(into, x, w, std::nullopt);
      values[i] = into;
    } else {
      values[i] = gemm_of(x, w, std::nullopt);
    }
  }
  return values;
}

int64_t count_second_gemms(const int32_t* kinds, int64_t num_params) {
  return std::count(kinds, kinds + num_params, static_cast<int32_t>(FX_PARAM_GEMM));
}

using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor>;  // (out, batch_stats, gemm, kept), as the op's schema
using Result = std::optional<Outputs>;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A gated module's weight: the GEMM's weight and its second GEMM's, interleaved in blocks of
// `block` rows (gate block 0, up block 0, gate block 1, ...; the last blocks padded with zero
// rows), so that one GEMM computes both and each epilogue subtile holds matching columns. Built
// once per pair of weights and kept while both live and neither changes: a weight is known by its
// storage (aliases and views of it, as a compiled graph may pass, share it), its offset there and
// its version counter (shared by those aliases; an optimizer step bumps it). The cost is a copy of
// the two weights in device memory. nullopt for inference tensors (no version counter).
std::optional<Tensor> gated_weight(const Tensor& gate, const Tensor& up, int64_t block) {
  if (gate.is_inference() || up.is_inference()) return std::nullopt;
  struct Weight {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const void* data;
    int64_t version;
    bool is(const Tensor& t) const {
      return !storage.expired() && storage.lock().get() == t.storage().unsafeGetStorageImpl() &&
             data == t.data_ptr() && version == t._version();
    }
    bool alive() const { return !storage.expired(); }
  };
  struct Entry {
    Weight gate, up;
    int64_t block;
    Tensor value;
  };
  static std::mutex mutex;
  static std::vector<Entry> entries;
  const std::lock_guard<std::mutex> lock(mutex);
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [&](const Entry& e) {
                                 return !e.gate.alive() || !e.up.alive() ||
                                        (e.gate.data == gate.data_ptr() && e.up.data == up.data_ptr() &&
                                         !(e.gate.is(gate) && e.up.is(up)));  // an older version of this pair
                               }),
                entries.end());
  for (const Entry& e : entries) {
    if (e.block == block && e.gate.is(gate) && e.up.is(up)) return e.value;
  }
  const int64_t n = gate.size(0), k = gate.size(1), whole = n / block, rest = n % block;
  const int64_t blocks = whole + (rest > 0);
  Tensor value = at::zeros({blocks, 2, block, k}, gate.options());
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (int64_t half = 0; half < 2; ++half) {  // views of `value` throughout: copies land in it
    const Tensor& rows = half == 0 ? gate : up;
    Tensor into = value.select(1, half);  // (blocks, block, k)
    if (whole > 0) into.narrow(0, 0, whole).copy_(rows.narrow(0, 0, whole * block).view({whole, block, k}));
    if (rest > 0) into.select(0, whole).narrow(0, 0, rest).copy_(rows.narrow(0, whole * block, rest));
  }
  value = value.view({2 * blocks * block, k});
  const auto weight_of = [](const Tensor& t) {
    return Weight{c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl()), t.data_ptr(),
                  t._version()};
  };
  entries.push_back(Entry{weight_of(gate), weight_of(up), block, value});
  return value;
}

// The output's shape for x's leading dims: (..., width) rows (FX_OUT_ROWS), (...) one value a row
// (FX_OUT_REDUCED) or (..., 1) (FX_OUT_REDUCED_KEEP)
std::vector<int64_t> output_shape(const Tensor& x, int32_t out_kind, int64_t width) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  if (out_kind == FX_OUT_ROWS) shape.push_back(width);
  if (out_kind == FX_OUT_REDUCED_KEEP) shape.push_back(1);
  return shape;
}

// The in-GEMM path: the program's GEMM module runs configuration `config` on the call (no GEMM
// output is kept: a call that must save it for the backward takes the row path). nullopt where
// the module does not cover the call (layout, alignment, dtypes, sizes); the caller then takes
// the row path.
// Whether the GEMM module computes this call in some configuration at all: its operands' devices,
// dtypes, layouts and alignment (each configuration's sizes aside: gemm->supports)
bool gemm_takes(const FxGemmInfo* gemm, const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                at::TensorList params) {
  TORCH_CHECK(gemm->abi_version == FX_ABI_VERSION, "fxfuse: GEMM module ABI ", gemm->abi_version,
              " != runtime ABI ", FX_ABI_VERSION);
  if (x.dim() < 1 || weight.dim() != 2 || !on_kernel_device(x) || weight.device() != x.device()) return false;
  if (gemm->channels_dim1 && x.dim() != 2) return false;  // the row path and the reference decide
  if (scalar_type_of(gemm->dtype) != x.scalar_type() || weight.scalar_type() != x.scalar_type()) return false;
  // a float32 module computes in TF32: only while torch allows TF32 for cuBLAS's matmuls
  if (gemm->dtype == FX_F32 && !at::globalContext().allowTF32CuBLAS()) return false;
  if (!x.is_contiguous() || !weight.is_contiguous() || x.size(-1) != weight.size(1)) return false;
  if (static_cast<int64_t>(params.size()) != gemm->num_params) return false;
  if (bias && (bias->scalar_type() != x.scalar_type() || bias->device() != x.device() || !bias->is_contiguous() ||
               bias->numel() != weight.size(0) || !aligned16(bias->data_ptr()))) {
    return false;
  }
  return aligned16(x.data_ptr()) && aligned16(weight.data_ptr());
}

Result run_gemm(const FxGemmInfo* gemm, int32_t config, const Tensor& x, const Tensor& weight,
                const std::optional<Tensor>& bias, at::TensorList params) {
  if (config < 0 || config >= gemm->num_configs || !gemm_takes(gemm, x, weight, bias, params)) return std::nullopt;
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t m = k > 0 ? x.numel() / k : 0;
  if (!gemm->supports(m, n, k, config)) return std::nullopt;

  at::AutoDispatchBelowADInplaceOrView below_autograd;
#if !defined(FX_EMULATE)
  const c10::cuda::OptionalCUDAGuard device_guard(x.device());
#endif
  // A gated module runs its second GEMM itself, over the interleaved weight; otherwise the second
  // GEMMs' outputs are computed here and read as operands of the output's shape.
  Tensor gemm_weight = weight;
  std::vector<Tensor> kept;
  std::vector<FxParam> fx_params;
  if (gemm->gated_block > 0 && config >= gemm->first_gated_config) {
    const int64_t second = std::find(gemm->param_kinds, gemm->param_kinds + gemm->num_params,
                                     static_cast<int32_t>(FX_PARAM_GEMM)) - gemm->param_kinds;
    if (second >= gemm->num_params) return std::nullopt;
    const Tensor& up = params[second];
    if (up.sizes() != weight.sizes() || up.scalar_type() != weight.scalar_type() || up.device() != weight.device() ||
        !up.is_contiguous()) {
      return std::nullopt;
    }
    const std::optional<Tensor> interleaved = gated_weight(weight, up, gemm->gated_block);
    if (!interleaved) return std::nullopt;
    gemm_weight = *interleaved;
    if (!kernel_params(params, gemm->param_kinds, gemm->param_dtypes, m, n, x, false, kept, fx_params, second)) {
      return std::nullopt;
    }
  } else {
    const std::optional<std::vector<Tensor>> values = second_gemm_outputs(params, gemm->param_kinds, x, n, nullptr);
    if (!values) return std::nullopt;
    if (!kernel_params(*values, gemm->param_kinds, gemm->param_dtypes, m, n, x, false, kept, fx_params)) return std::nullopt;
  }
  const int device = x.device().is_cpu() ? 0 : x.get_device();
  const DeviceFacts facts = device_facts(device);
  Tensor out = at::empty(output_shape(x, gemm->out_kind, n), x.options().dtype(*scalar_type_of(gemm->out_dtype)));
  const auto floats = x.options().dtype(at::kFloat);
  Tensor stats = gemm->batch_train ? at::empty({2, n}, floats) : at::empty({0}, floats);
  const int64_t ws_bytes = gemm->workspace(m, n, k, facts.sm_count, config);
  Tensor workspace;
  if (ws_bytes > 0) workspace = at::empty({ws_bytes}, x.options().dtype(at::kByte));

  FxGemmLaunch launch{};
  launch.x = x.data_ptr();
  launch.weight = gemm_weight.data_ptr();
  launch.bias = bias ? bias->data_ptr() : nullptr;
  launch.out = out.data_ptr();
  launch.params = fx_params.data();
  launch.workspace = ws_bytes > 0 ? workspace.data_ptr() : nullptr;
  launch.stats = gemm->batch_train ? stats.data_ptr<float>() : nullptr;
  launch.m = m;
  launch.n = n;
  launch.k = k;
  launch.num_params = static_cast<int32_t>(fx_params.size());
  launch.sm_count = facts.sm_count;
  launch.device = device;
  launch.config = config;
  const char* error = gemm->launch(&launch, current_stream(x));
  TORCH_CHECK(error == nullptr, "fxfuse: GEMM kernel launch failed: ", error);
  return std::make_tuple(out, stats, at::empty({0}, x.options()), at::empty({0}, x.options()));
}

// Buckets of M (ceil(log2 m)) the selection measures and the table routes by, with N and K
constexpr int kBuckets = 64;
int bucket_of(int64_t m) {
  int b = 0;
  while (b + 1 < kBuckets && (int64_t(1) << b) < m) ++b;
  return b;
}

// save_gemm: the GEMM output is returned too (for the backward), so the epilogue may not overwrite it.
// gemm_address / config: the program's GEMM module and the configuration to run (-1: the row path).
Result run(int64_t info_address, const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
           at::TensorList params, int64_t flags, bool save_gemm, int64_t gemm_address = 0, int64_t config = -1) {
  if (gemm_address != 0 && config >= 0 && !save_gemm) {
    Result result = run_gemm(reinterpret_cast<const FxGemmInfo*>(gemm_address), static_cast<int32_t>(config), x,
                             weight, bias, params);
    if (result) return result;
  }
  if (info_address == 0) return std::nullopt;
  const auto* info = reinterpret_cast<const FxProgramInfo*>(info_address);
  TORCH_CHECK(info->abi_version == FX_ABI_VERSION, "fxfuse: program module ABI ", info->abi_version,
              " != runtime ABI ", FX_ABI_VERSION);
  if (x.dim() < 1 || weight.dim() != 2 || !on_kernel_device(x)) return std::nullopt;
  if (scalar_type_of(info->dtype) != x.scalar_type()) return std::nullopt;
  if (static_cast<int64_t>(params.size()) != info->num_params) return std::nullopt;
  if (info->channels_dim1 && x.dim() != 2) return std::nullopt;  // the reference decides (dim 1 = channels)
  const int64_t n = weight.size(0);
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);

  at::AutoDispatchBelowADInplaceOrView below_autograd;
#if !defined(FX_EMULATE)
  const c10::cuda::OptionalCUDAGuard device_guard(x.device());
#endif
  const DeviceFacts facts = device_facts(x.device().is_cpu() ? 0 : x.get_device());
  if (!info->supports(m, n, facts.smem_optin)) return std::nullopt;

  // With second GEMMs and save_gemm, the GEMM outputs are computed into one stacked tensor: the op
  // saves it for the backward as it is (otherwise apart: an output written over y frees the rest).
  Tensor y, stacked;
  const int64_t seconds = count_second_gemms(info->param_kinds, info->num_params);
  const bool stacks = save_gemm && seconds > 0;
  if (stacks) {
    if (weight.size(1) != x.size(-1) || weight.scalar_type() != x.scalar_type()) return std::nullopt;
    std::vector<int64_t> stacked_shape{1 + seconds};
    stacked_shape.insert(stacked_shape.end(), x.sizes().begin(), x.sizes().end() - 1);
    stacked_shape.push_back(n);
    stacked = at::empty(stacked_shape, x.options());
    y = stacked.select(0, 0);
    gemm_into(y, x, weight, bias);
  } else {
    y = gemm_of(x, weight, bias);
  }
  const std::optional<std::vector<Tensor>> values =
      second_gemm_outputs(params, info->param_kinds, x, n, stacks ? &stacked : nullptr);
  if (!values) return std::nullopt;
  std::vector<Tensor> kept;
  std::vector<FxParam> fx_params;
  if (!kernel_params(*values, info->param_kinds, nullptr, m, n, x, true, kept, fx_params)) return std::nullopt;
  if (!y.is_contiguous()) y = y.contiguous();
  if (y.scalar_type() != x.scalar_type()) return std::nullopt;

  const int64_t width = info->out_kind == FX_OUT_ROWS ? info->out_width(n) : 1;
  const bool in_place = info->out_kind == FX_OUT_ROWS && !save_gemm && info->out_dtype == info->dtype && width == n;
  Tensor out = in_place ? y : at::empty(output_shape(x, info->out_kind, width),
                                        y.options().dtype(*scalar_type_of(info->out_dtype)));
  const auto floats = y.options().dtype(at::kFloat);
  Tensor stats = info->batch_train ? at::empty({2, n}, floats) : at::empty({0}, floats);
  Tensor kept_value = info->kept_dtype >= 0 ? at::empty(y.sizes(), y.options().dtype(*scalar_type_of(info->kept_dtype)))
                                            : at::empty({0}, y.options());  // of y's shape, (..., n)
  const int64_t ws_floats = info->workspace_floats(m, n, facts.sm_count);
  Tensor workspace;
  if (ws_floats > 0) workspace = at::empty({ws_floats}, floats);

  FxLaunch launch{};
  launch.y = y.data_ptr();
  launch.out = out.data_ptr();
  launch.kept = info->kept_dtype >= 0 ? kept_value.data_ptr() : nullptr;
  launch.stats = info->batch_train ? stats.data_ptr<float>() : nullptr;
  launch.workspace = ws_floats > 0 ? workspace.data_ptr<float>() : nullptr;
  launch.params = fx_params.data();
  launch.m = m;
  launch.n = n;
  launch.num_params = static_cast<int32_t>(fx_params.size());
  launch.sm_count = facts.sm_count;
  launch.smem_optin = facts.smem_optin;
  launch.flags = static_cast<int32_t>(flags);
  const char* error = info->launch(&launch, current_stream(x));
  TORCH_CHECK(error == nullptr, "fxfuse: epilogue kernel launch failed: ", error);
  return std::make_tuple(out, stats, save_gemm ? (stacks ? stacked : y) : at::empty({0}, y.options()),
                         kept_value);
}

using GradOutputs = std::tuple<Tensor, Tensor>;  // (dgemm, sums), as fxfuse::epilogue_backward

// The output's shape for a GEMM output of y's shape (a reduction's: one value a row, kept or not;
// a pooling's: narrower rows)
std::vector<int64_t> output_shape(const Tensor& y, const FxProgramInfo* info) {
  std::vector<int64_t> shape(y.sizes().begin(), y.sizes().end());
  if (info->out_kind == FX_OUT_ROWS) shape.back() = info->out_width(shape.back());
  if (info->out_kind == FX_OUT_REDUCED) shape.pop_back();
  if (info->out_kind == FX_OUT_REDUCED_KEEP) shape.back() = 1;
  return shape;
}

// The backward kernel of a pointwise, norm or reduction program: from the saved GEMM output y and
// the output's gradient, the GEMM output's gradient and the (1 + num_params, n) float32 column sums
// (of it, and of each parameter's gradient). nullopt where the kernel does not cover the call.
std::optional<GradOutputs> run_grad(int64_t info_address, const Tensor& grad, const Tensor& y, at::TensorList params,
                                    int64_t flags) {
  if (info_address == 0) return std::nullopt;
  const auto* info = reinterpret_cast<const FxProgramInfo*>(info_address);
  TORCH_CHECK(info->abi_version == FX_ABI_VERSION, "fxfuse: program module ABI ", info->abi_version,
              " != runtime ABI ", FX_ABI_VERSION);
  if (!info->has_grad || y.dim() < 1 || !on_kernel_device(y) || !on_kernel_device(grad)) return std::nullopt;
  if (scalar_type_of(info->dtype) != y.scalar_type() || scalar_type_of(info->out_dtype) != grad.scalar_type()) {
    return std::nullopt;
  }
  if (grad.sizes() != at::IntArrayRef(output_shape(y, info)) || grad.device() != y.device()) {
    return std::nullopt;
  }
  if (static_cast<int64_t>(params.size()) != info->num_params) return std::nullopt;
  const int64_t n = y.size(-1);
  const int64_t m = n > 0 ? y.numel() / n : 0;

  at::AutoDispatchBelowADInplaceOrView below_autograd;
#if !defined(FX_EMULATE)
  const c10::cuda::OptionalCUDAGuard device_guard(y.device());
#endif
  const DeviceFacts facts = device_facts(y.device().is_cpu() ? 0 : y.get_device());
  std::vector<Tensor> kept;
  std::vector<FxParam> fx_params;
  if (!kernel_params(params, info->param_kinds, nullptr, m, n, y, true, kept, fx_params)) return std::nullopt;
  const Tensor y_c = y.contiguous();
  const Tensor g_c = grad.contiguous();  // an expanded gradient (of a sum, say) is materialised
  Tensor dy = at::empty(y.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t sums = 1 + info->num_params;
  const int64_t chunks = info->grad_chunks(m, n, facts.sm_count);
  if (chunks < 0) return std::nullopt;
  const auto floats = y.options().dtype(at::kFloat);
  if (m == 0 || n == 0 || chunks == 0) return std::make_tuple(dy, at::zeros({sums, n}, floats));
  Tensor total = at::empty({sums, n}, floats);
  Tensor partial = chunks > 1 ? at::empty({sums, chunks, n}, floats) : Tensor();

  FxGradLaunch launch{};
  launch.y = y_c.data_ptr();
  launch.g = g_c.data_ptr();
  launch.dy = dy.data_ptr();
  launch.partial = chunks > 1 ? partial.data_ptr<float>() : nullptr;
  launch.sums = total.data_ptr<float>();
  launch.params = fx_params.data();
  launch.m = m;
  launch.n = n;
  launch.num_params = static_cast<int32_t>(fx_params.size());
  launch.sm_count = facts.sm_count;
  launch.flags = static_cast<int32_t>(flags);
  const char* error = info->launch_grad(&launch, current_stream(y));
  TORCH_CHECK(error == nullptr, "fxfuse: backward kernel launch failed: ", error);
  return std::make_tuple(dy, total);
}

Result run_py(int64_t info_address, const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
              const std::vector<Tensor>& params, int64_t flags, bool save_gemm, int64_t gemm_address,
              int64_t config) {
  return run(info_address, x, weight, bias, params, flags, save_gemm, gemm_address, config);
}

// The op's kernel for the dispatcher: programs prepared in this process (Python registers each
// module's address here) run without any Python; anything else (a program not built yet, a call
// the kernels do not cover) goes to the Python engine, which builds or runs the reference.
class ProgramTable {
 public:
  // Where a call goes: the program module, the GEMM module (0: none) and its configuration (-1:
  // the row path); not `measured` where a GEMM module's call falls in a bucket of M no selection
  // has timed (a graph with a symbolic batch serves every size), which then takes the row path
  struct Route {
    int64_t info = 0;
    int64_t gemm = 0;
    int config = -1;
    bool measured = true;
  };
  void add(const std::string& program, int32_t dtype, int32_t device, int64_t info) {
    const std::lock_guard<std::mutex> guard(mutex_);
    table_[key(program, dtype, device)].info = info;
  }
  void set_gemm(const std::string& program, int32_t dtype, int32_t device, int64_t gemm) {
    const std::lock_guard<std::mutex> guard(mutex_);
    table_[key(program, dtype, device)].gemm = gemm;
  }
  // Calls of an (m, n, k) problem -- m by its bucket, as the selection measured it -- go to GEMM
  // configuration `config` (-1: the row path)
  void choose(const std::string& program, int32_t dtype, int32_t device, int64_t m, int64_t n, int64_t k,
              int config) {
    TORCH_CHECK(config >= -1 && m >= 0 && n >= 0 && k >= 0, "fxfuse: bad choice");
    const std::lock_guard<std::mutex> guard(mutex_);
    table_[key(program, dtype, device)].choice[Shape{bucket_of(m), n, k}] = config;
  }
  int64_t program_module(c10::string_view program, int32_t dtype, int32_t device) {
    const std::string key_ = key(program, dtype, device);
    const std::lock_guard<std::mutex> guard(mutex_);
    const auto it = table_.find(key_);
    return it == table_.end() ? 0 : it->second.info;
  }
  Route route(c10::string_view program, int32_t dtype, int32_t device, int64_t m, int64_t n, int64_t k) {
    const std::string key_ = key(program, dtype, device);
    const std::lock_guard<std::mutex> guard(mutex_);
    const auto it = table_.find(key_);
    if (it == table_.end()) return Route();
    const Entry& entry = it->second;
    const auto chosen = entry.gemm != 0 ? entry.choice.find(Shape{bucket_of(m), n, k}) : entry.choice.end();
    const bool measured = entry.gemm == 0 || chosen != entry.choice.end();
    return Route{entry.info, entry.gemm, chosen == entry.choice.end() ? -1 : chosen->second, measured};
  }
  void set_fallback(py::object fallback, int64_t flags) {
    const std::lock_guard<std::mutex> guard(mutex_);
    fallback_ = fallback.release().ptr();  // kept for the life of the process
    flags_ = flags;
  }
  PyObject* fallback() const { return fallback_; }
  void set_grad_fallback(py::object fallback) {
    const std::lock_guard<std::mutex> guard(mutex_);
    grad_fallback_ = fallback.release().ptr();  // kept for the life of the process
  }
  PyObject* grad_fallback() const { return grad_fallback_; }
  void set_measure(py::object measure) {
    const std::lock_guard<std::mutex> guard(mutex_);
    measure_ = measure.release().ptr();  // kept for the life of the process
  }
  PyObject* measure() const { return measure_; }
  void set_autograd(py::object autograd) {
    const std::lock_guard<std::mutex> guard(mutex_);
    autograd_ = autograd.release().ptr();  // kept for the life of the process
  }
  PyObject* autograd() const { return autograd_; }
  int64_t flags() const { return flags_; }

 private:
  static std::string key(c10::string_view program, int32_t dtype, int32_t device) {
    std::string k(program.data(), program.size());
    k.push_back('\0');
    k.push_back(static_cast<char>(dtype));
    k.append(std::to_string(device));
    return k;
  }
  struct Shape {
    int bucket;
    int64_t n;
    int64_t k;
    bool operator==(const Shape& o) const { return bucket == o.bucket && n == o.n && k == o.k; }
  };
  struct ShapeHash {
    size_t operator()(const Shape& s) const {
      return std::hash<int64_t>()((s.k * 1000003 + s.n) * kBuckets + s.bucket);
    }
  };
  struct Entry {
    int64_t info = 0;
    int64_t gemm = 0;
    std::unordered_map<Shape, int, ShapeHash> choice;
  };
  std::mutex mutex_;
  std::unordered_map<std::string, Entry> table_;
  PyObject* fallback_ = nullptr;
  PyObject* grad_fallback_ = nullptr;
  PyObject* measure_ = nullptr;
  PyObject* autograd_ = nullptr;
  int64_t flags_ = 0;
};

ProgramTable& programs() {
  static ProgramTable* table = new ProgramTable();  // never destroyed: kernels may run at exit
  return *table;
}

Outputs linear_epilogue_kernel(c10::string_view program, const Tensor& x, const Tensor& weight,
                               const std::optional<Tensor>& bias, at::TensorList params, bool save_gemm) {
  ProgramTable& table = programs();
  const std::optional<int32_t> dtype = code_of(x.scalar_type());
  if (dtype) {
    const int64_t k = x.dim() > 0 ? x.size(-1) : 0;
    const int64_t m = k > 0 ? x.numel() / k : 0;
    const int64_t n = weight.dim() == 2 ? weight.size(0) : 0;
    const int32_t device = x.is_cpu() ? -1 : x.get_device();
    ProgramTable::Route route = table.route(program, *dtype, device, m, n, k);
    // where the GEMM module may serve the call (run's and run_gemm's conditions)
    if (!route.measured && table.measure() != nullptr && !save_gemm && m > 0 &&
        gemm_takes(reinterpret_cast<const FxGemmInfo*>(route.gemm), x, weight, bias, params)) {
      // the first call in this bucket: the engine times the module's configurations against the
      // row path on it and routes the bucket (it raises nothing), then the call takes that route
      {
        py::gil_scoped_acquire gil;
        py::handle(table.measure())(std::string(program.data(), program.size()), x, weight, bias,
                                    std::vector<Tensor>(params.begin(), params.end()));
      }
      route = table.route(program, *dtype, device, m, n, k);
    }
    if (route.info != 0) {
      Result result = run(route.info, x, weight, bias, params, table.flags(), save_gemm, route.gemm, route.config);
      if (result) return *result;
    }
  }
  TORCH_CHECK(table.fallback() != nullptr, "fxfuse: runtime used before the engine registered its fallback");
  py::gil_scoped_acquire gil;
  py::handle fallback(table.fallback());
  py::object out = fallback(std::string(program.data(), program.size()), x, weight, bias,
                            std::vector<Tensor>(params.begin(), params.end()), py::arg("save_gemm") = save_gemm);
  return out.cast<Outputs>();
}

// fxfuse::epilogue_backward's kernel: the program module's backward kernel where it covers the
// call, else the Python engine (which runs the reference).
GradOutputs epilogue_backward_kernel(c10::string_view program, const Tensor& grad, const Tensor& gemm,
                                     at::TensorList params) {
  ProgramTable& table = programs();
  const std::optional<int32_t> dtype = code_of(gemm.scalar_type());
  if (dtype) {
    const int64_t info = table.program_module(program, *dtype, gemm.is_cpu() ? -1 : gemm.get_device());
    if (info != 0) {
      std::optional<GradOutputs> result = run_grad(info, grad, gemm, params, table.flags());
      if (result) return *result;
    }
  }
  TORCH_CHECK(table.grad_fallback() != nullptr, "fxfuse: runtime used before the engine registered its fallback");
  py::gil_scoped_acquire gil;
  py::handle fallback(table.grad_fallback());
  py::object out = fallback(std::string(program.data(), program.size()), grad, gemm,
                            std::vector<Tensor>(params.begin(), params.end()));
  return out.cast<GradOutputs>();
}

#if !defined(FX_EMULATE)
bool any_requires_grad(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                       at::TensorList params) {
  if (x.requires_grad() || weight.requires_grad() || (bias && bias->requires_grad())) return true;
  for (const Tensor& p : params)
    if (p.requires_grad()) return true;
  return false;
}

// The op's autograd kernel for CUDA tensors (registered once Python hands over the op's autograd
// implementation). A call that records nothing for backward -- grad mode off, or no input that
// requires grad: every call of a compiled graph -- goes below autograd here, in C++; only a call
// that must record a backward node runs the Python implementation (torch.library's
// register_autograd, fxfuse/op.py), with the key set the dispatcher computed.
Outputs linear_epilogue_autograd(c10::DispatchKeySet ks, c10::string_view program, const Tensor& x,
                                 const Tensor& weight, const std::optional<Tensor>& bias, at::TensorList params,
                                 bool save_gemm) {
  if (!at::GradMode::is_enabled() || !any_requires_grad(x, weight, bias, params)) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fxfuse::linear_epilogue", "")
                               .typed<Outputs(c10::string_view, const Tensor&, const Tensor&,
                                              const std::optional<Tensor>&, at::TensorList, bool)>();
    const at::AutoDispatchBelowAutograd below_autograd;
    return op.redispatch(ks & c10::after_autograd_keyset, program, x, weight, bias, params, save_gemm);
  }
  py::gil_scoped_acquire gil;
  py::handle autograd(programs().autograd());
  py::object out = autograd(py::cast(ks), std::string(program.data(), program.size()), x, weight, bias,
                            std::vector<Tensor>(params.begin(), params.end()), save_gemm);
  return out.cast<Outputs>();
}

// False (nothing registered) where this build cannot hand a key set to Python.
bool register_autograd(py::object autograd) {
  try {
    py::cast(c10::DispatchKeySet(c10::DispatchKey::CUDA));
  } catch (const py::cast_error&) {
    return false;
  }
  static std::once_flag once;
  programs().set_autograd(autograd);
  std::call_once(once, [] {
    static torch::Library* library =  // never destroyed, as the registration it holds
        new torch::Library(torch::Library::IMPL, "fxfuse", c10::DispatchKey::AutogradCUDA, __FILE__, __LINE__);
    library->impl("linear_epilogue", TORCH_FN(linear_epilogue_autograd));
  });
  return true;
}
#endif

}  // namespace

#if !defined(FX_EMULATE)
TORCH_LIBRARY_IMPL(fxfuse, CUDA, m) {
  m.impl("linear_epilogue", &linear_epilogue_kernel);
  m.impl("epilogue_backward", &epilogue_backward_kernel);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fxfuse runtime: GEMM + generated epilogue kernels";
  m.attr("ABI_VERSION") = FX_ABI_VERSION;
  m.attr("MAX_N") = FX_MAX_N;
  m.attr("GROUP_NORM_ROUNDS_STATS") = static_cast<int>(FX_GROUP_NORM_ROUNDS_STATS);
  m.def(
      "register_program",
      [](const std::string& program, int32_t dtype, int32_t device, int64_t info) {
        programs().add(program, dtype, device, info);
      },
      "Route the op's CUDA calls of (program, dtype code, device index) to a program module");
  m.def(
      "register_gemm",
      [](const std::string& program, int32_t dtype, int32_t device, int64_t gemm) {
        programs().set_gemm(program, dtype, device, gemm);
      },
      "The GEMM module (FxGemmInfo address) of (program, dtype code, device index)");
  m.def(
      "choose",
      [](const std::string& program, int32_t dtype, int32_t device, int64_t m, int64_t n, int64_t k, int config) {
        programs().choose(program, dtype, device, m, n, k, config);
      },
      "Route calls of (program, dtype code, device index) on an (m, n, k) problem -- any m of m's bucket -- "
      "to GEMM configuration `config` (-1: the row path)");
  m.def("bucket_of", &bucket_of, "The bucket of M the selection and the routing use: ceil(log2(m))");
  m.def(
      "set_fallback", [](py::object fallback, int64_t flags) { programs().set_fallback(fallback, flags); },
      "The Python callable for calls the registered programs do not cover, and the FxFlags to launch with");
  m.def(
      "set_grad_fallback", [](py::object fallback) { programs().set_grad_fallback(fallback); },
      "The Python callable for backward calls the registered programs do not cover");
  m.def(
      "set_measure", [](py::object measure) { programs().set_measure(measure); },
      "The Python callable (program, x, weight, bias, params) that times and routes a call's bucket of M "
      "where the program has a GEMM module and no selection has timed that bucket");
  m.def(
      "run_grad",
      [](int64_t info, const Tensor& grad, const Tensor& gemm, const std::vector<Tensor>& params, int64_t flags) {
        return run_grad(info, grad, gemm, params, flags);
      },
      "The backward kernel of a pointwise or norm program: (dgemm, column sums); None when it does not cover "
      "the call",
      py::arg("info"), py::arg("grad"), py::arg("gemm"), py::arg("params"), py::arg("flags") = 0);
#if !defined(FX_EMULATE)
  m.def("register_autograd", &register_autograd,
        "Serve the op's AutogradCUDA key in C++, calling this Python autograd implementation "
        "(keyset, program, x, weight, bias, params, save_gemm) only when a backward node must be recorded");
#endif
  m.def("run", &run_py, "GEMM + epilogue; None when the kernels do not cover the call", py::arg("info"),
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("params"), py::arg("flags") = 0,
        py::arg("save_gemm") = false, py::arg("gemm") = 0, py::arg("config") = -1);
}
