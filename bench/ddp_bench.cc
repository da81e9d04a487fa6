// ddp_bench: median training-step time of a TransformerLM under dtrain's DDP, with the share
// of all-reduce time hidden behind backward. Paired with bench/reference/ddp_reference.py
// (PyTorch's DDP on the same model, batch, sequence length and threads); run both through
// bench/run_ddp_bench.sh, which prints the table.
//
// Step = zero_grad -> forward -> cross-entropy -> backward (gradients averaged) -> AdamW step.
// Prints one JSON line on rank 0.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/factory.h"
#include "framework/models/transformer_lm.h"
#include "sharding/ddp.h"

using Clock = std::chrono::steady_clock;
using dtrain::framework::TransformerLM;
using dtrain::framework::TransformerLMOptions;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 8, warmup = 2, d_model = 512, layers = 6, heads = 8, d_ff = 2048, seq = 64,
          batch = 4, vocab = 256;
  double bucket_cap_mb = 25;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    int64_t v = std::atoll(argv[i + 1]);
    if (a == "--steps")
      steps = v;
    else if (a == "--warmup")
      warmup = v;
    else if (a == "--d-model")
      d_model = v;
    else if (a == "--layers")
      layers = v;
    else if (a == "--heads")
      heads = v;
    else if (a == "--d-ff")
      d_ff = v;
    else if (a == "--seq")
      seq = v;
    else if (a == "--batch")
      batch = v;
    else if (a == "--bucket-cap-mb")
      bucket_cap_mb = std::atof(argv[i + 1]);
  }
  at::set_num_threads(std::max(
      1, std::atoi(std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "1")));
  auto comm = dtrain::comm::create_world();
  at::manual_seed(0);
  auto opts = TransformerLMOptions()
                  .vocab_size(vocab)
                  .seq_len(seq)
                  .d_model(d_model)
                  .n_layers(layers)
                  .n_heads(heads)
                  .d_ff(d_ff);
  dtrain::sharding::DistributedDataParallel<TransformerLM> model(
      TransformerLM(opts), comm, dtrain::sharding::DDPOptions().bucket_cap_mb(bucket_cap_mb));
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-4));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + comm->rank());
  std::vector<double> step_s, backward_s, comm_s, exposed_s;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    at::Tensor x = at::randint(0, vocab, {batch, seq}, gen);
    at::Tensor y = at::randint(0, vocab, {batch, seq}, gen);
    comm->barrier().wait();
    auto t0 = Clock::now();
    opt.zero_grad();
    at::Tensor logits = model(x);
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, vocab}), y.reshape(-1));
    auto tb = Clock::now();
    loss.backward();
    auto te = Clock::now();
    opt.step();
    auto t1 = Clock::now();
    if (s < warmup) continue;
    step_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    backward_s.push_back(std::chrono::duration<double>(te - tb).count());
    comm_s.push_back(model.last_stats().comm_seconds);
    exposed_s.push_back(model.last_stats().exposed_seconds);
  }
  if (comm->rank() == 0) {
    double c = median(comm_s), e = median(exposed_s);
    std::printf(
        "{\"impl\":\"dtrain\",\"backend\":\"%s\",\"world\":%d,\"params\":%lld,\"buckets\":%lld,"
        "\"median_step_s\":%.4f,\"median_backward_s\":%.4f,\"comm_s\":%.4f,\"exposed_s\":%.4f,"
        "\"hidden\":%.3f}\n",
        comm->backend().c_str(), comm->size(),
        static_cast<long long>(dtrain::framework::transformer_lm_parameter_count(opts)),
        static_cast<long long>(model.last_stats().buckets), median(step_s), median(backward_s), c,
        e, c > 0 ? std::max(0.0, 1 - e / c) : 1.0);
  }
  comm->barrier().wait();
  return 0;
}
