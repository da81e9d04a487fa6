// attention_bench: the TransformerLM's causal attention, forward + backward, through both of
// its kernels (framework/models/attention.h): ATen's scaled_dot_product_attention (fused) and
// the explicit matmul -> mask -> fp32 softmax -> matmul, on the same q, k, v, in alternating
// rounds of one run. Prints a table of medians, the ratio, and the kernel the model's rule
// picks for that shape on this machine with how it fares against the other one.
//
//   attention_bench                                  the default shapes, fp32 and bf16
//   attention_bench --shape 8,4,64,48 --dtype bf16   [batch, heads, seq, head dim]
//   attention_bench --check 0.10 ...                 exit 3, naming the row, when the rule's
//                                                    kernel is more than 10% slower than the
//                                                    other one (bench/perf_check's figure)
//   attention_bench --rule                           the rule's pick on a grid, untimed: one
//                                                    "dtype T D kernel" line each, which
//                                                    tests/attention_rule_test.py compares
//                                                    with the PyTorch reference's rule
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "core/cli.h"
#include "framework/models/attention.h"
#include "framework/models/transformer_lm.h"

namespace {

using Clock = std::chrono::steady_clock;
using dtrain::framework::AttentionKernel;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of one forward + backward.
double step(const std::vector<at::Tensor>& qkv, const at::Tensor& grad, AttentionKernel kernel) {
  for (const auto& t : qkv) t.mutable_grad() = at::Tensor();
  const auto t0 = Clock::now();
  at::Tensor y = dtrain::framework::causal_attention(qkv[0], qkv[1], qkv[2], kernel);
  y.backward(grad);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Shape {
  int64_t b, h, t, d;
};

Shape parse_shape(const std::string& text) {
  std::vector<int64_t> v;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) v.push_back(std::stoll(part));
  if (v.size() != 4 || *std::min_element(v.begin(), v.end()) < 1) {
    throw CLI::ValidationError("--shape",
                               "expected B,H,T,D (four positive integers), got '" + text + "'");
  }
  return {v[0], v[1], v[2], v[3]};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "attention_bench: the causal attention's forward + backward through both kernels "
      "(scaled_dot_product_attention and the explicit softmax), and the model's choice"};
  dtrain::cli::setup(app, "attention_bench");
  int threads = 1, rounds = 5, reps = 5;
  double check = -1;
  std::vector<std::string> shape_args, dtype_args;
  app.add_option("--threads", threads, "intra-op threads (1: a rank of a 2-rank job here)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--rounds", rounds, "alternating rounds")->check(CLI::Range(1, 1000));
  app.add_option("--reps", reps, "steps of each kernel per round")->check(CLI::Range(1, 1000));
  app.add_option("--shape", shape_args, "B,H,T,D (repeatable; default: three shapes)");
  app.add_option("--dtype", dtype_args, "fp32, bf16 or fp16 (repeatable; default fp32 and bf16)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--check", check,
                 "fail (exit 3) when the rule's kernel is slower than the other by more than "
                 "this fraction")
      ->check(CLI::Range(0.0, 10.0));
  bool rule = false;
  app.add_flag("--rule", rule, "print the rule's pick on a grid of shapes, time nothing");
  dtrain::cli::parse(app, argc, argv);
  if (rule) {
    for (const char* name : {"fp32", "bf16", "fp16"}) {
      const at::ScalarType dtype = std::string(name) == "fp32"   ? at::kFloat
                                   : std::string(name) == "bf16" ? at::kBFloat16
                                                                 : at::kHalf;
      for (int64_t t : {1, 16, 64, 127, 128, 129, 192, 256, 511, 512, 513, 768, 1024, 4096}) {
        for (int64_t d : {8, 32, 47, 48, 64, 128, 256}) {
          std::printf(
              "%s %lld %lld %s\n", name, static_cast<long long>(t), static_cast<long long>(d),
              dtrain::name_of(dtrain::framework::choose_attention(c10::kCPU, dtype, t, d).kernel));
        }
      }
    }
    return 0;
  }
  at::set_num_threads(threads);
  std::vector<Shape> shapes;
  for (const auto& s : shape_args) shapes.push_back(parse_shape(s));
  if (shapes.empty()) shapes = {{8, 4, 256, 48}, {4, 8, 256, 64}, {2, 12, 1024, 64}};
  if (dtype_args.empty()) dtype_args = {"fp32", "bf16"};

  std::printf("# attention_bench: %d thread(s), median of %d alternating rounds x %d steps\n",
              threads, rounds, reps);
  std::printf(
      "| dtype | [B, H, T, D] | explicit (ms) | fused (ms) | explicit / fused | rule picks | "
      "other / picked |\n|---|---|---|---|---|---|---|\n");
  int failed = 0;
  std::string failures;
  for (const auto& name : dtype_args) {
    const at::ScalarType dtype = name == "fp32"   ? at::kFloat
                                 : name == "bf16" ? at::kBFloat16
                                                  : at::kHalf;
    for (const Shape& s : shapes) {
      at::manual_seed(0);
      std::vector<at::Tensor> qkv;
      for (int i = 0; i < 3; ++i) {
        qkv.push_back(at::randn({s.b, s.h, s.t, s.d}).to(dtype).requires_grad_());
      }
      const at::Tensor grad = at::randn({s.b, s.h, s.t, s.d}).to(dtype);
      step(qkv, grad, AttentionKernel::kFused);  // warm up both
      step(qkv, grad, AttentionKernel::kExplicit);
      std::vector<double> plain, fused;
      for (int r = 0; r < rounds; ++r) {
        for (int k = 0; k < reps; ++k) plain.push_back(step(qkv, grad, AttentionKernel::kExplicit));
        for (int k = 0; k < reps; ++k) fused.push_back(step(qkv, grad, AttentionKernel::kFused));
      }
      const double p = median(plain), f = median(fused);
      const AttentionKernel pick =
          dtrain::framework::choose_attention(c10::kCPU, dtype, s.t, s.d).kernel;
      const double other_over_picked = pick == AttentionKernel::kFused ? p / f : f / p;
      char row[256];
      std::snprintf(row, sizeof(row), "%s [%lld, %lld, %lld, %lld]", name.c_str(),
                    static_cast<long long>(s.b), static_cast<long long>(s.h),
                    static_cast<long long>(s.t), static_cast<long long>(s.d));
      std::printf("| %s | [%lld, %lld, %lld, %lld] | %.2f | %.2f | %.2fx | %s | %.2fx |\n",
                  name.c_str(), static_cast<long long>(s.b), static_cast<long long>(s.h),
                  static_cast<long long>(s.t), static_cast<long long>(s.d), p * 1e3, f * 1e3, p / f,
                  dtrain::name_of(pick), other_over_picked);
      std::fflush(stdout);
      if (check >= 0 && other_over_picked < 1.0 - check) {
        ++failed;
        char why[512];
        std::snprintf(why, sizeof(why),
                      "attention_bench: FAILED %s: the rule's %s kernel took %.2f ms, the other "
                      "%.2f ms: other / picked %.2fx, below the bound 1.00x less the margin "
                      "%.0f%% (%.2fx)\n",
                      row, dtrain::name_of(pick), (pick == AttentionKernel::kFused ? f : p) * 1e3,
                      (pick == AttentionKernel::kFused ? p : f) * 1e3, other_over_picked,
                      check * 100, 1.0 - check);
        failures += why;
      }
    }
  }
  if (failed > 0) {
    std::fputs(failures.c_str(), stderr);
    return 3;
  }
  return 0;
}
