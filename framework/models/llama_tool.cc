// llama_tool: dtrain's Llama against transformers' (tests/llama_hf_test.py).
//   llama_tool logits DIR TOKENS OUT [bf16]  loads the Hugging Face checkpoint in DIR, runs the
//                                            "tokens" tensor of the safetensors file TOKENS
//                                            through it (in bf16 when asked) and writes
//                                            "logits" (fp32) to OUT
//   llama_tool resave DIR OUT_DIR             loads DIR and saves it as dtrain does into OUT_DIR
//   llama_tool finetune DIR TOKENS OUT_DIR ddp|fsdp|tp|tp-sp|fsdp-tp|fsdp-tp-sp STEPS
//                                             under dtrain-launch: every rank loads DIR, the
//                                             strategy trains STEPS AdamW steps on its rows of
//                                             "tokens" (next-token loss), and rank 0 saves the
//                                             result into OUT_DIR with its logits of all tokens
//                                             and the loss of every step
//                                             (OUT_DIR/dtrain_logits.safetensors: "logits",
//                                             "losses"). tp and tp-sp: the Llama plan over every
//                                             rank (tp-sp with sequence parallelism), each rank
//                                             with all rows, the loss vocabulary-parallel.
//                                             fsdp-tp, fsdp-tp-sp: FSDP over world / 2
//                                             data-parallel ranks x tp 2 (a 2-D mesh), each
//                                             data-parallel rank with its rows; the losses
//                                             recorded are the mean over them.
// An error prints its message and exits 2.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <iostream>
#include <string>

#include <torch/optim/adamw.h>

#include <map>

#include "comm/factory.h"
#include "core/error.h"
#include "framework/checkpoint/safetensors.h"
#include "framework/models/llama.h"
#include "sharding/ddp.h"
#include "sharding/fsdp.h"
#include "sharding/mesh.h"
#include "sharding/tensor_parallel_plan.h"

namespace {

using namespace dtrain::framework;

at::Tensor read_tokens(const std::string& path) {
  for (const auto& [name, t] : ckpt::read_safetensors(path).tensors) {
    if (name == "tokens") return t.to(at::kLong);
  }
  DTRAIN_FAIL(dtrain::UsageError, path, ": no tensor 'tokens'");
}

int finetune(const std::string& dir, const std::string& tokens_path, const std::string& out,
             const std::string& strategy, int steps) {
  auto comm = dtrain::comm::create_world();
  const int rank = comm->rank(), world = comm->size();
  const at::Tensor tokens = read_tokens(tokens_path);
  const bool two_d = strategy == "fsdp-tp" || strategy == "fsdp-tp-sp";
  const bool tensor_parallel = strategy == "tp" || strategy == "tp-sp" || two_d;
  const bool sp = strategy == "tp-sp" || strategy == "fsdp-tp-sp";
  const int tp_size = two_d ? 2 : world;
  // This data-parallel rank's rows: d, d + dp, ... (all of them under tensor parallelism
  // alone).
  const int dp = tensor_parallel ? world / tp_size : world, dp_rank = rank / (world / dp);
  const at::Tensor mine = tokens.index_select(
      0, at::arange(dp_rank, tokens.size(0), dp, at::TensorOptions().dtype(at::kLong)));
  std::vector<double> losses;
  auto loss_of = [&](const at::Tensor& logits) {
    const int64_t V = logits.size(-1), T = mine.size(1);
    return at::cross_entropy_loss(logits.narrow(1, 0, T - 1).reshape({-1, V}),
                                  mine.narrow(1, 1, T - 1).reshape(-1));
  };
  std::vector<std::pair<std::string, at::Tensor>> final_params;
  if (tensor_parallel) {
    LlamaForCausalLM model = load_hf_llama(dir);
    dtrain::sharding::DeviceMesh mesh(comm, {1, world / tp_size, tp_size, 1});
    auto tp = std::make_shared<dtrain::sharding::TensorParallelism>(mesh.tp(), sp);
    model->parallelize(tp);
    std::unique_ptr<dtrain::sharding::FullyShardedDataParallel<LlamaForCausalLM>> fsdp;
    if (two_d) {
      fsdp = std::make_unique<dtrain::sharding::FullyShardedDataParallel<LlamaForCausalLM>>(
          model, mesh.dp(),
          dtrain::sharding::FSDPOptions().sync_module_states(false).auto_wrap(
              dtrain::sharding::AutoWrapPolicy().module_types({"LlamaDecoderLayer"})));
    }
    torch::optim::AdamW opt(fsdp ? fsdp->parameters() : model->parameters(),
                            torch::optim::AdamWOptions(1e-3));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      const at::Tensor logits = fsdp ? (*fsdp)(mine) : model(mine);
      const int64_t V = logits.size(-1), T = mine.size(1);
      at::Tensor loss = tp->loss(logits.narrow(1, 0, T - 1).reshape({-1, V}),
                                 mine.narrow(1, 1, T - 1).reshape(-1), model->head_weight());
      loss.backward();
      std::vector<at::Tensor> replicated;  // the norms' gradients (FSDP: their shards)
      if (fsdp) {
        for (const auto& [name, master] : fsdp->state().all_parameters()) {
          if (!tp->sliced(name) && master.grad().defined()) replicated.push_back(master.grad());
        }
      } else {
        for (const auto& p : model->named_parameters()) {
          if (!tp->sliced(p.key()) && p.value().grad().defined())
            replicated.push_back(p.value().grad());
        }
      }
      tp->sync_replicated_grads(replicated);
      opt.step();
      at::Tensor mean = loss.detach().to(at::kDouble).reshape({1}).clone();
      if (fsdp) mesh.dp()->all_reduce(mean).wait();
      losses.push_back(mean.item<double>() / (fsdp ? dp : 1));
    }
    if (fsdp) {
      for (const auto& [name, local] : fsdp->state().full_parameters()) {  // collective
        final_params.emplace_back(name, tp->full(name, local));
      }
    } else {
      for (const auto& p : model->named_parameters()) {
        final_params.emplace_back(p.key(), tp->full(p.key(), p.value().detach()));
      }
    }
  } else if (strategy == "ddp") {
    LlamaForCausalLM model = load_hf_llama(dir);
    dtrain::sharding::DistributedDataParallel<LlamaForCausalLM> ddp(model, comm);
    torch::optim::AdamW opt(ddp.parameters(), torch::optim::AdamWOptions(1e-3));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      at::Tensor loss = loss_of(ddp(mine));
      loss.backward();
      opt.step();
      losses.push_back(loss.item<double>());
    }
    for (const auto& p : model->named_parameters()) final_params.emplace_back(p.key(), p.value());
  } else {
    DTRAIN_CHECK_AS(dtrain::UsageError, strategy == "fsdp",
                    "strategy must be ddp, fsdp, tp, tp-sp, fsdp-tp or fsdp-tp-sp");
    // Built without parameter memory; FSDP loads the checkpoint into it one layer at a time.
    LlamaOptions o = read_hf_llama_config(dir + "/config.json");
    o.deferred_init(true);
    LlamaForCausalLM lazy(o);
    dtrain::sharding::FullyShardedDataParallel<LlamaForCausalLM> fsdp(
        lazy, comm,
        dtrain::sharding::FSDPOptions()
            .auto_wrap(dtrain::sharding::AutoWrapPolicy().module_types({"LlamaDecoderLayer"}))
            .param_init(hf_llama_param_init(dir)));
    DTRAIN_CHECK(fsdp.state().units().size() > 1, "FSDP chose no decoder layer as a unit");
    torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-3));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      at::Tensor loss = loss_of(fsdp(mine));
      loss.backward();
      opt.step();
      losses.push_back(loss.item<double>());
    }
    final_params = fsdp.state().full_parameters();  // collective
  }
  if (rank == 0) {
    LlamaForCausalLM result = load_hf_llama(dir);
    std::map<std::string, at::Tensor> by_name(final_params.begin(), final_params.end());
    c10::NoGradGuard no_grad;
    for (auto& p : result->named_parameters()) p.value().copy_(by_name.at(p.key()));
    save_hf_llama(*result, out);
    ckpt::write_safetensors(
        out + "/dtrain_logits.safetensors",
        {{"logits", result->forward(tokens)}, {"losses", at::tensor(losses, at::kDouble)}});
  }
  comm->barrier().wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dtrain::framework;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "logits" && (argc == 5 || argc == 6)) || (mode == "resave" && argc == 4) ||
        (mode == "finetune" && argc == 7))) {
    std::cerr << "usage: llama_tool logits DIR TOKENS OUT [bf16] | resave DIR OUT_DIR | finetune "
                 "DIR TOKENS OUT_DIR ddp|fsdp|tp|tp-sp STEPS\n";
    return 2;
  }
  try {
    if (mode == "finetune") return finetune(argv[2], argv[3], argv[4], argv[5], std::atoi(argv[6]));
    LlamaForCausalLM m = load_hf_llama(argv[2]);
    if (mode == "resave") {
      save_hf_llama(*m, argv[3]);
      return 0;
    }
    if (argc == 6 && std::string(argv[5]) == "bf16") m->to(at::kBFloat16);
    const at::Tensor tokens = read_tokens(argv[3]);
    c10::NoGradGuard no_grad;
    at::Tensor logits = m->forward(tokens).to(at::kFloat);
    ckpt::write_safetensors(argv[4], {{"logits", logits}});
  } catch (const dtrain::Error& e) {
    std::cerr << "llama_tool: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
