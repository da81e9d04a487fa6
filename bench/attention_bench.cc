// attention_bench: the TransformerLM's causal attention, forward + backward, through ATen's
// scaled_dot_product_attention (what the model runs; flash kernels) beside the explicit
// matmul -> mask -> fp32 softmax -> matmul of earlier releases (framework/models/
// transformer_lm.h causal_attention), on the same q, k, v, in alternating rounds of one run.
// Prints a table of medians and the ratio; shapes [batch, heads, seq, head dim].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "core/cli.h"
#include "framework/models/transformer_lm.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of one forward + backward.
double step(const std::vector<at::Tensor>& qkv, const at::Tensor& grad, bool fused) {
  for (const auto& t : qkv) t.mutable_grad() = at::Tensor();
  const auto t0 = Clock::now();
  at::Tensor y = dtrain::framework::causal_attention(qkv[0], qkv[1], qkv[2], fused);
  y.backward(grad);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "attention_bench: the causal attention's forward + backward, fused "
      "(scaled_dot_product_attention) beside the explicit softmax, fp32 and bf16"};
  dtrain::cli::setup(app, "attention_bench");
  int threads = 2, rounds = 5, reps = 5;
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::Range(1, 1024));
  app.add_option("--rounds", rounds, "alternating rounds")->check(CLI::Range(1, 1000));
  dtrain::cli::parse(app, argc, argv);
  at::set_num_threads(threads);
  std::printf("# attention_bench: %d thread(s), median of %d alternating rounds x %d steps\n",
              threads, rounds, reps);
  std::printf("| dtype | [B, H, T, D] | explicit (ms) | fused (ms) | explicit / fused |\n");
  std::printf("|---|---|---|---|---|\n");
  struct Shape {
    int64_t b, h, t, d;
  };
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (Shape s : {Shape{8, 4, 256, 48}, Shape{4, 8, 256, 64}, Shape{2, 12, 1024, 64}}) {
      at::manual_seed(0);
      std::vector<at::Tensor> qkv;
      for (int i = 0; i < 3; ++i) {
        qkv.push_back(at::randn({s.b, s.h, s.t, s.d}).to(dtype).requires_grad_());
      }
      const at::Tensor grad = at::randn({s.b, s.h, s.t, s.d}).to(dtype);
      step(qkv, grad, true);  // warm up both
      step(qkv, grad, false);
      std::vector<double> plain, fused;
      for (int r = 0; r < rounds; ++r) {
        for (int k = 0; k < reps; ++k) plain.push_back(step(qkv, grad, false));
        for (int k = 0; k < reps; ++k) fused.push_back(step(qkv, grad, true));
      }
      const double p = median(plain), f = median(fused);
      std::printf("| %s | [%lld, %lld, %lld, %lld] | %.2f | %.2f | %.2fx |\n",
                  dtype == at::kFloat ? "fp32" : "bf16", static_cast<long long>(s.b),
                  static_cast<long long>(s.h), static_cast<long long>(s.t),
                  static_cast<long long>(s.d), p * 1e3, f * 1e3, p / f);
      std::fflush(stdout);
    }
  }
  return 0;
}
