// Checkpoint files in a format Python's torch.load reads.
//
//   pickle       torch.save's zip format (data.pkl + one record per tensor) of plain dicts,
//                lists, tuples, strings, numbers and tensors. Unlike torch::pickle_save it
//                writes no TorchScript type tags, so torch.load(weights_only=True) accepts it.
//                Lists of ints and floats are written as generic lists for the same reason.
//   write_pickle pickle() streamed into a file written atomically (atomic_file.h), with no
//                copy in memory.
//   unpickle     reads such files, and torch.save's files from Python (state_dict() with its
//                OrderedDict included).
#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

#include "framework/checkpoint/atomic_file.h"

namespace dtrain::framework::ckpt {

std::vector<char> pickle(const c10::IValue& value);
FileInfo write_pickle(const std::string& dir, const std::string& name, const c10::IValue& value);
c10::IValue unpickle(const std::vector<char>& bytes, const std::string& what);

}  // namespace dtrain::framework::ckpt
