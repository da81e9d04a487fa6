// safetensors_tool: dtrain's safetensors reader and writer from the command line, for
// tests/safetensors_test.py, which checks them against the safetensors package.
//   safetensors_tool list PATH       one line per tensor: name dtype shape... (PATH: a file, or a
//                                    directory with model.safetensors[.index.json])
//   safetensors_tool copy PATH OUT   reads PATH as dtrain does and writes OUT (one file) with
//                                    its metadata
// A CheckpointError prints its message and exits 2.
#include <sys/stat.h>
#include <iostream>
#include <string>

#include "core/error.h"
#include "framework/checkpoint/safetensors.h"

int main(int argc, char** argv) {
  using namespace dtrain::framework::ckpt;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "list" && argc == 3) || (mode == "copy" && argc == 4))) {
    std::cerr << "usage: safetensors_tool list PATH | copy PATH OUT\n";
    return 2;
  }
  try {
    struct stat st {};
    const std::string in = argv[2];
    const bool dir = ::stat(in.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    SafeTensors s = dir ? read_safetensors_dir(in) : read_safetensors(in);
    if (mode == "list") {
      for (const auto& [name, t] : s.tensors) {
        std::cout << name << " " << safetensors_dtype(t.scalar_type());
        for (int64_t d : t.sizes()) std::cout << " " << d;
        std::cout << "\n";
      }
    } else {
      write_safetensors(argv[3], s.tensors, s.metadata);
    }
  } catch (const dtrain::CheckpointError& e) {
    std::cerr << "safetensors_tool: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
