#include "framework/report.h"

#include <ATen/ATen.h>
#include <sys/resource.h>

#include <algorithm>
#include <sstream>
#include <vector>

#include "core/logging.h"
#include "framework/checkpoint/hash.h"
#include "framework/memory.h"
#include "framework/memory_estimate.h"
#include "framework/pipeline_strategy.h"

namespace dtrain::framework {

double peak_rss_mb() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_maxrss / 1024.0;
}

void log_parameters_agree(Strategy& model, comm::Communicator* comm) {
  // One hash per full parameter, then a hash of those in the module's order: under FSDP the
  // parameters are gathered one unit at a time (never the whole model), in unit order.
  auto digest = [](const at::Tensor& t) {
    at::Tensor c = t.detach().cpu().contiguous();
    ckpt::Hasher h;
    h.update(static_cast<const char*>(c.data_ptr()), c.nbytes());
    return h.digest();
  };
  std::vector<uint64_t> per_param;
  // A pipeline's ranks hold their own stages' current values: each from its owner first, so
  // the hashes compare the pipelines' replicas (collective over each pipeline).
  if (auto* pipeline = model.pipeline()) pipeline->share(nullptr);
  if (auto* f = model.fsdp()) {
    per_param.resize(f->all_parameters().size());
    f->visit_full_parameters([&](size_t k, const std::string& name, const at::Tensor& full) {
      per_param[k] = digest(model.full_parameter(name, full));
    });
  } else {
    for (const auto& p : model.module().named_parameters()) {
      per_param.push_back(digest(model.full_parameter(p.key(), p.value())));
    }
  }
  ckpt::Hasher hash;
  hash.update(reinterpret_cast<const char*>(per_param.data()), per_param.size() * sizeof(uint64_t));
  const int64_t sum = static_cast<int64_t>(hash.digest());
  std::vector<int64_t> all{sum};
  if (comm != nullptr && comm->size() > 1) {
    at::Tensor in = at::full({1}, sum, at::kLong).to(comm->device());
    at::Tensor out = at::empty({comm->size()}, at::TensorOptions(at::kLong).device(comm->device()));
    comm->all_gather(in, out).wait();
    out = out.cpu();
    all.assign(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
  }
  if (std::all_of(all.begin(), all.end(), [&](int64_t v) { return v == all.front(); })) {
    logging::info("parameters identical on all ", all.size(), " rank(s) (xxh64 ",
                  ckpt::hex(static_cast<uint64_t>(all.front())), ")");
    return;
  }
  std::ostringstream os;
  for (size_t r = 0; r < all.size(); ++r) {
    os << (r ? ", " : "") << "rank " << r << ": " << ckpt::hex(static_cast<uint64_t>(all[r]));
  }
  logging::error("parameters differ across ranks (xxh64 ", os.str(),
                 "): the ranks fell out of sync");
}

std::vector<int64_t> sample_tokens(Strategy& model, c10::DeviceType device, int64_t seq_len,
                                   std::vector<int64_t> tokens, int64_t count) {
  c10::NoGradGuard no_grad;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - seq_len);
    at::Tensor in =
        at::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end()), at::kLong)
            .unsqueeze(0)
            .to(device);
    // Under sequence parallelism the sequence splits over the TP group: padded on the right,
    // which a causal model's earlier positions never see.
    const int64_t n = in.size(1), multiple = model.sequence_multiple();
    if (n % multiple != 0) in = at::constant_pad_nd(in, {0, multiple - n % multiple}, 0);
    at::Tensor logits = model.full_output(model.forward(in));
    tokens.push_back(logits[0][n - 1].argmax().item<int64_t>());
  }
  return tokens;
}

std::string printable_bytes(const std::vector<int64_t>& tokens) {
  std::string text;
  for (int64_t t : tokens)
    text += (t >= 32 && t < 127) ? static_cast<char>(t) : (t == '\n' ? ' ' : '?');
  return text;
}

void log_peak_memory(const RunConfig& c, comm::Communicator* comm) {
  const int world = comm != nullptr ? comm->size() : 1;
  at::Tensor mine = at::tensor(
      {peak_rss_mb() * 1024 * 1024,
       TrackedCpuMemory::installed() ? static_cast<double>(TrackedCpuMemory::peak_bytes()) : -1.0},
      at::kDouble);
  at::Tensor all = mine;
  if (comm != nullptr && world > 1) {
    all = at::empty({2 * world}, at::TensorOptions(at::kDouble).device(comm->device()));
    comm->all_gather(mine.to(comm->device()), all).wait();
    all = all.cpu();
  }
  std::ostringstream os;
  for (int r = 0; r < world; ++r) {
    os << (r ? "; " : "") << "rank " << r << " RSS " << format_bytes(all[2 * r].item<double>());
    const double tensors = all[2 * r + 1].item<double>();
    if (tensors >= 0) os << " (tensors " << format_bytes(tensors) << ")";
  }
  logging::info("peak memory per rank: ", os.str(),
                c.model.custom() ? std::string()
                                 : "; estimated " + format_bytes(estimate_memory(c, world).peak()));
}

}  // namespace dtrain::framework
