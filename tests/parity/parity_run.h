// What dtrain's side of a comparison with PyTorch shares (tests/parity/ddp_parity.cc and
// fsdp_parity.cc; bench/reference/parity.py is PyTorch's side): the command line, the small
// TransformerLM both sides train, each step's data, and the files the Python side reads.
//
// The data of step s on rank r is torch.randint(0, vocab, (B, T)) twice from a CPU generator
// seeded 1000 + s * world + r: the same draws in C++ and Python.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize.h>
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "framework/models/transformer_lm.h"

namespace dtrain::parity {

struct Args {
  std::string precision = "fp32";
  std::string out_dir;
  int64_t steps = 20;
  // fp16: a scale high enough to overflow early and a short growth interval, so the run
  // backs off and grows the scale several times.
  double init_scale = 16777216.0;
  int64_t growth_interval = 4;
  // The model and batch (bench/reference/parity.py uses the same).
  int64_t vocab = 64, seq = 16, d_model = 32, layers = 2, heads = 4, batch = 4;
};

inline void add_options(CLI::App& app, Args& a, const std::string& out_help) {
  app.add_option("--precision", a.precision, "fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--steps", a.steps, "optimizer steps");
  app.add_option("--out", a.out_dir, out_help)->required();
  app.add_option("--init-scale", a.init_scale, "fp16: the GradScaler's initial scale");
  app.add_option("--growth-interval", a.growth_interval, "fp16: the GradScaler's growth interval");
}

// The TransformerLM of both sides, seeded alike on every rank.
inline framework::TransformerLM make_model(const Args& a) {
  at::manual_seed(42);
  return framework::TransformerLM(framework::TransformerLMOptions()
                                      .vocab_size(a.vocab)
                                      .seq_len(a.seq)
                                      .d_model(a.d_model)
                                      .n_layers(a.layers)
                                      .n_heads(a.heads)
                                      .d_ff(2 * a.d_model)
                                      .tie_weights(true));
}

// Step `step`'s inputs and targets on `rank` of `world`.
inline std::pair<at::Tensor, at::Tensor> batch(const Args& a, int64_t step, int world, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step * world + rank);
  at::Tensor x = at::randint(0, a.vocab, {a.batch, a.seq}, gen);
  at::Tensor y = at::randint(0, a.vocab, {a.batch, a.seq}, gen);
  return {x, y};
}

// A {name: tensor} dict that torch.load reads.
template <typename Named>
void save(const Named& named, const std::string& path) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : named) dict.insert(name, t);
  std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// DIR/dtrain.json: the loss (averaged over ranks) and the scale after every step.
inline void write_trajectory(const Args& a, const std::vector<double>& losses,
                             const std::vector<double>& scales, int64_t skipped) {
  std::FILE* f = std::fopen((a.out_dir + "/dtrain.json").c_str(), "w");
  std::fprintf(f, "{\"impl\": \"dtrain\", \"precision\": \"%s\", \"loss\": [", a.precision.c_str());
  for (size_t i = 0; i < losses.size(); ++i) std::fprintf(f, "%s%.17g", i ? ", " : "", losses[i]);
  std::fprintf(f, "], \"scale\": [");
  for (size_t i = 0; i < scales.size(); ++i) std::fprintf(f, "%s%.17g", i ? ", " : "", scales[i]);
  std::fprintf(f, "], \"skipped\": %lld}\n", static_cast<long long>(skipped));
  std::fclose(f);
}

}  // namespace dtrain::parity
