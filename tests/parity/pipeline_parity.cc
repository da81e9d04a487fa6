// dtrain's side of the pipeline-against-PyTorch comparison (tests/parity/pipeline_parity_test.sh
// runs it beside bench/reference/pipeline_reference.py, torch.distributed.pipelining, on the
// same Hugging Face checkpoint, split and micro-batches).
//
//   dtrain-launch --nproc-per-node 2 -- pipeline_parity --hf DIR
//       --cases gpipe:4:1,1f1b:8:1,interleaved_1f1b:4:2 --out FILE   (one command line)
//
// Each case is schedule:micro_batches:stages_per_rank: the Llama's layers split evenly over
// world x stages_per_rank stages (stage s on rank s % world), tokens and targets from the
// reference's formula, cross-entropy per micro-batch. The last stage's rank writes each case's
// per-micro-batch losses (JSON) to FILE.
#include <ATen/ATen.h>

#include <fstream>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include "comm/factory.h"
#include "core/cli.h"
#include "framework/models/llama.h"
#include "sharding/pipeline.h"

namespace pp = dtrain::sharding::pp;

int main(int argc, char** argv) {
  CLI::App app{"pipeline_parity: dtrain's pipeline losses on a Hugging Face Llama"};
  dtrain::cli::setup(app, "pipeline_parity");
  std::string hf, cases, out;
  app.add_option("--hf", hf, "Hugging Face checkpoint folder")->required();
  app.add_option("--cases", cases, "schedule:micro_batches:stages_per_rank,...")->required();
  app.add_option("--out", out, "JSON of each case's losses (the last stage's rank)")->required();
  dtrain::cli::parse(app, argc, argv);
  at::set_num_threads(1);

  auto world = dtrain::comm::create_world();
  const int rank = world->rank(), size = world->size();
  constexpr int64_t kMicro = 2, kSeq = 8;
  std::ostringstream json;
  json << std::setprecision(17) << "{";
  bool wrote = false;
  std::stringstream list(cases);
  for (std::string c; std::getline(list, c, ',');) {
    const auto a = c.find(':'), b = c.rfind(':');
    const auto kind = pp::parse_schedule(c.substr(0, a));
    const int M = std::stoi(c.substr(a + 1, b - a - 1)), v = std::stoi(c.substr(b + 1));
    auto model = dtrain::framework::load_hf_llama(hf);
    const int64_t vocab = model->options().vocab_size();
    const int64_t layers = model->options().num_hidden_layers();
    pp::Pipeline pipe(pp::make_schedule(kind, size, M, v), world);
    const int S = pipe.schedule().stages;
    const auto ranges = pp::split_layers(layers, S);
    at::Tensor rows = at::arange(M * kMicro, at::kLong).view({-1, 1});
    at::Tensor cols = at::arange(kSeq, at::kLong).view({1, -1});
    at::Tensor tokens = at::remainder(rows * 31 + cols * 7 + 3, vocab);
    at::Tensor targets = at::remainder(rows * 17 + cols * 5 + 1, vocab);
    pp::Pipeline::Step step;
    step.inputs = tokens.chunk(M, 0);
    const auto target = targets.chunk(M, 0);
    std::vector<double> ce(static_cast<size_t>(M));
    step.forward = [&](int stage, int, const at::Tensor& x) {
      return model->forward_stage(x, ranges[stage].first, ranges[stage].second);
    };
    step.loss = [&](int micro, const at::Tensor& logits) {
      at::Tensor l = at::cross_entropy_loss(logits.reshape({-1, vocab}),
                                            target[static_cast<size_t>(micro)].reshape({-1}));
      ce[static_cast<size_t>(micro)] = l.item<double>();
      return l / M;
    };
    step.activation_shape = {kMicro, kSeq, model->options().hidden_size()};
    pipe.run(step);
    if (pipe.schedule().rank_of(S - 1) == rank) {
      json << (wrote ? ", " : "") << "\"" << c << "\": [";
      for (int m = 0; m < M; ++m) json << (m ? ", " : "") << ce[static_cast<size_t>(m)];
      json << "]";
      wrote = true;
    }
  }
  json << "}";
  if (wrote) std::ofstream(out) << json.str() << "\n";
  world->barrier().wait();
  return 0;
}
