// Vocabulary shared by every communicator backend: reduction ops, backend names, dtypes.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

#include "comm/backend.h"

namespace dtrain::comm {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

const char* to_string(ReduceOp op);

// Parses a name of comm/backend.h's list; throws ConfigError naming the choices.
Backend parse_backend(const std::string& name);

// Short dtype names used in messages and configs: fp32 fp64 fp16 bf16 int32 int64 uint8.
std::string dtype_name(c10::ScalarType dtype);

// A NUL-terminated copy of `name` that lives as long as the process (the backends' and
// collectives' names, which CollectiveInfo views); the same name gives the same pointer.
const char* interned_name(const std::string& name);

// The dtypes every backend supports: fp32, fp64, fp16, bf16, int32, int64, uint8.
bool is_supported_dtype(c10::ScalarType dtype);

}  // namespace dtrain::comm
