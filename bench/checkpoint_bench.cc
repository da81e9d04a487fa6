// checkpoint_bench: how long a checkpoint of the ~19M TransformerLM under FSDP takes to write
// and to read back, and how many bytes it holds, full (gathered to rank 0) and sharded (every
// rank its shards), parameters and AdamW state included. Paired with PyTorch's torch.save and
// torch.distributed.checkpoint on the same model (bench/reference/checkpoint_reference.py) by
// bench/run_checkpoint_bench.sh.
//
//   dtrain-launch --nproc-per-node 2 -- checkpoint_bench --dir /tmp/ckpt_bench
//
// Write = Checkpointer::save (every file written, fsynced, renamed, checksummed; metadata and
// COMPLETE); read = Checkpointer::restore (every file read, verified and applied). Each is the
// median of --reps repetitions, timed on every rank from a barrier to a barrier. Prints one
// JSON line per format on rank 0.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "comm/factory.h"
#include "core/cli.h"
#include "framework/checkpoint/checkpointer.h"
#include "framework/config.h"
#include "framework/models/configs.h"
#include "framework/models/transformer_lm.h"
#include "sharding/fsdp.h"

using Clock = std::chrono::steady_clock;
using dtrain::framework::TransformerLM;
using dtrain::framework::TransformerLMOptions;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int64_t bytes_under(const std::string& dir) {
  int64_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"checkpoint_bench: FSDP checkpoint write/read time and bytes"};
  dtrain::cli::setup(app, "checkpoint_bench");
  dtrain::framework::register_builtin_model_configs();  // parse_config's model.type
  std::string dir = "/tmp/dtrain_checkpoint_bench";
  int reps = 3;
  app.add_option("--dir", dir, "a scratch folder (emptied)");
  app.add_option("--reps", reps, "repetitions of each write and read");
  dtrain::cli::parse(app, argc, argv);
  at::set_num_threads(1);
  auto comm = dtrain::comm::create_world();
  at::manual_seed(0);
  auto opts =
      TransformerLMOptions().vocab_size(256).seq_len(64).d_model(512).n_layers(6).n_heads(8).d_ff(
          2048);
  dtrain::sharding::FullyShardedDataParallel<TransformerLM> model(TransformerLM(opts), comm);
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(1e-4));
  // One step, so the optimizer holds its state.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1 + comm->rank());
  at::Tensor x = at::randint(0, 256, {4, 64}, gen), y = at::randint(0, 256, {4, 64}, gen);
  at::cross_entropy_loss(model(x).reshape({-1, 256}), y.reshape(-1)).backward();
  opt.step();
  dtrain::amp::GradScaler scaler(dtrain::amp::GradScalerOptions().enabled(false));
  dtrain::framework::CheckpointParts parts{&*model.module(), &model.state(), &opt,
                                           &scaler,          nullptr,        comm.get()};
  for (std::string format : {"full", "sharded"}) {
    const std::string root = dir + "/" + format;
    if (comm->rank() == 0) std::filesystem::remove_all(root);
    comm->barrier().wait();
    auto config = dtrain::framework::parse_config(
        "model: {type: transformer}\ntrain: {steps: 1, batch_size: 1, lr: 1.0}\n"
        "parallel: {strategy: fsdp}\ncheckpoint: {dir: " +
            root + ", keep: 1, format: " + format + "}\n",
        "checkpoint_bench");
    dtrain::framework::Checkpointer ckpt(config);
    std::vector<double> write_s, read_s;
    std::string path;
    for (int r = 0; r < reps; ++r) {
      comm->barrier().wait();
      auto t0 = Clock::now();
      path = ckpt.save(parts, {r + 1, 0, 1e-4});
      comm->barrier().wait();
      write_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      t0 = Clock::now();
      ckpt.restore(parts, path);
      comm->barrier().wait();
      read_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    if (comm->rank() == 0) {
      std::printf(
          "{\"impl\":\"dtrain\",\"format\":\"%s\",\"world\":%d,\"write_s\":%.4f,"
          "\"read_s\":%.4f,\"bytes\":%lld}\n",
          format.c_str(), comm->size(), median(write_s), median(read_s),
          static_cast<long long>(bytes_under(path)));
    }
  }
  comm->barrier().wait();
  return 0;
}
