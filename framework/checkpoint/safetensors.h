// Hugging Face's safetensors format, read with mmap and written directly: what `transformers`
// saves (`save_pretrained`: model.safetensors, or shards named by
// model.safetensors.index.json) and loads.
//
// The format: 8 bytes giving N, the header's length (little-endian u64); N bytes of JSON
// mapping each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// into the data that follows the header), plus an optional "__metadata__" of string pairs;
// then the raw little-endian data. Reading maps the file and hands out tensors that view the
// mapping (copy-on-write: writing to one changes no file); a tensor whose offset is not a
// multiple of its element size is copied out. Writing goes through a temporary file renamed
// into place (atomic_file.h), with the header padded by spaces to a multiple of 8 and the
// tensors laid out by decreasing element size, so every tensor is aligned, as the safetensors
// library does.
//
// Every problem raises CheckpointError naming the file and, where there is one, the tensor:
// a header longer than the file, JSON that does not parse, an unknown dtype, offsets outside
// the data, overlapping or out of order, a byte count that is not shape x element size.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::framework::ckpt {

struct SafeTensors {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // in the order of their data
  std::map<std::string, std::string> metadata;              // "__metadata__"
};

// One .safetensors file.
SafeTensors read_safetensors(const std::string& path);
// A model directory as save_pretrained leaves it: model.safetensors.index.json (its weight_map
// names the shard of every tensor; all are read) or else model.safetensors. The metadata of
// the index's "metadata" section, or of the single file.
SafeTensors read_safetensors_dir(const std::string& dir);
// Writes `tensors` (any device; contiguous copies are made as needed) to `path`. Names must
// be unique and not "__metadata__".
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The format's dtype names ("F32", "BF16", ...), both ways; CheckpointError for others.
std::string safetensors_dtype(at::ScalarType t);
at::ScalarType safetensors_dtype(const std::string& name);

}  // namespace dtrain::framework::ckpt
