// MixedPrecisionPolicy: which dtype each kind of tensor lives or travels in, with exactly the
// meanings of PyTorch FSDP's MixedPrecision:
//   param_dtype   dtype of parameters during forward/backward compute (fp32 masters are kept
//                 and stepped by the optimizer; under DDP this is the autocast dtype)
//   reduce_dtype  dtype gradients are communicated in; unset follows param_dtype
//   buffer_dtype  dtype buffers are kept in; unset leaves buffers as they are
//   output_dtype  dtype forward outputs are cast to; unset leaves them
//   cast_forward_inputs       cast floating inputs of each unit to param_dtype
//   keep_low_precision_grads  leave gradients in param_dtype instead of upcasting them
// Presets: fp32 (nothing cast), bf16 and fp16 (param, reduce and buffer dtype all bf16/fp16).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace dtrain::amp {

struct MixedPrecisionPolicy {
  c10::ScalarType param_dtype = c10::kFloat;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<c10::ScalarType> buffer_dtype;
  std::optional<c10::ScalarType> output_dtype;
  bool cast_forward_inputs = false;
  bool keep_low_precision_grads = false;

  static MixedPrecisionPolicy fp32();
  static MixedPrecisionPolicy bf16();
  static MixedPrecisionPolicy fp16();
  // "fp32" | "bf16" | "fp16"; throws ConfigError otherwise.
  static MixedPrecisionPolicy preset(const std::string& name);

  c10::ScalarType effective_reduce_dtype() const { return reduce_dtype.value_or(param_dtype); }
  bool is_low_precision() const { return param_dtype != c10::kFloat; }
  // fp16 anywhere in compute or communication: gradients need a loss scaler.
  bool needs_grad_scaler() const;

  // Throws ConfigError for combinations that cannot work (non-float dtypes, fp16 mixed with
  // bf16, keep_low_precision_grads without a low-precision param dtype).
  void validate() const;
  std::string to_string() const;
};

// PyTorch's spellings of a float dtype as dtrain's: "torch.bfloat16" and "bfloat16" -> "bf16",
// "float16"/"half" -> "fp16", "float32"/"float" -> "fp32", "float64"/"double" -> "fp64".
// Other names come back as they are.
std::string canonical_dtype_name(const std::string& name);

// "fp32" | "bf16" | "fp16" | "fp64", or a PyTorch spelling of one -> dtype; throws
// ConfigError naming the choices.
c10::ScalarType parse_float_dtype(const std::string& name);

// Parameters whose gradients a strategy leaves in a low-precision dtype (FSDP's masters under
// keep_low_precision_grads), so that an optimizer built on them can refuse at once what it
// could not step (dtrain's fused AdamW and SGD step fp32 parameters with fp32 gradients, as
// PyTorch's fused kernels do). Process-wide, keyed by the tensor; forgets a tensor once it is
// gone.
void note_low_precision_grads(const at::Tensor& param, c10::ScalarType grad_dtype);
std::optional<c10::ScalarType> low_precision_grad_dtype(const at::Tensor& param);

}  // namespace dtrain::amp
