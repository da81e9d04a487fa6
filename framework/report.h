// The end-of-run report: what a finished run says about itself, after its last step.
//   - parameters_agree: every rank's parameters hashed and compared (the ranks hold bitwise
//     the same model, or the log says which do not);
//   - sample_tokens: greedy decoding from a prompt, for the language models (shown as text for
//     byte data, as token ids for token files);
//   - peak_memory: each rank's peak RSS (and tracked tensor bytes) beside the estimate.
// Each is collective where it says so: every rank calls it, rank 0's log holds the lines.
#pragma once

#include <c10/core/DeviceType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "framework/config.h"
#include "framework/strategy.h"

namespace dtrain::framework {

// Peak resident memory of this process, in MB.
double peak_rss_mb();

// Logs whether every rank holds bitwise the same parameters (full values under FSDP, hashed
// with xxh64). Collective.
void log_parameters_agree(Strategy& model, comm::Communicator* comm);

// `prompt` followed by `count` greedily decoded tokens (each forward sees the last seq_len).
// Collective under FSDP (its forwards gather): every rank calls it.
std::vector<int64_t> sample_tokens(Strategy& model, c10::DeviceType device, int64_t seq_len,
                                   std::vector<int64_t> prompt, int64_t count);
// Bytes as printable text ('?' for the rest, a space for newlines).
std::string printable_bytes(const std::vector<int64_t>& tokens);

// Logs each rank's peak memory, and the estimate for a config model. Collective.
void log_peak_memory(const RunConfig& c, comm::Communicator* comm);

}  // namespace dtrain::framework
