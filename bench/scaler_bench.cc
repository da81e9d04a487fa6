// scaler_bench: unscale_ + inf check + update of dtrain's GradScaler (LibTorch's fused
// _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_) beside a
// straightforward per-tensor loop (isfinite().all() + mul_ per gradient, scale updated on
// the host), on the same fp32 gradients, in the same run. Gradients are split into tensors
// of 1M elements at most, like a model's parameters. Prints a table; median of 7 runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/sgd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "amp/grad_scaler.h"
#include "core/cli.h"

using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "scaler_bench: dtrain's GradScaler (fused unscale + inf check + update) beside a "
      "per-tensor loop, on 1M, 10M and 100M fp32 gradient elements"};
  dtrain::cli::setup(app, "scaler_bench");
  int threads = 1;
  app.add_option("threads,--threads", threads, "intra-op threads")->check(CLI::Range(1, 1024));
  dtrain::cli::parse(app, argc, argv);
  at::set_num_threads(threads);
  std::printf("# scaler_bench: %d thread(s), median of 7 runs\n", threads);
  std::printf(
      "| gradient elements | tensors | dtrain GradScaler (ms) | per-tensor loop (ms) | loop / "
      "dtrain |\n");
  std::printf("|---|---|---|---|---|\n");
  for (int64_t total : {int64_t{1} << 20, int64_t{10} << 20, int64_t{100} << 20}) {
    const int64_t chunk = std::min<int64_t>(total, 1 << 20);
    std::vector<at::Tensor> params;
    for (int64_t off = 0; off < total; off += chunk) {
      at::Tensor p = at::zeros({chunk}).requires_grad_();
      p.mutable_grad() = at::randn({chunk});
      params.push_back(p);
    }
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.0));
    dtrain::amp::GradScaler scaler(dtrain::amp::GradScalerOptions().init_scale(1.0));
    scaler.scale(at::ones({}));  // place the scale on the CPU
    std::vector<double> fused, loop;
    for (int rep = 0; rep < 7; ++rep) {
      auto t0 = Clock::now();
      scaler.unscale_(opt);
      volatile bool inf = scaler.found_inf();  // the host sync step() makes
      (void)inf;
      scaler.update();
      auto t1 = Clock::now();
      // The straightforward way: one check and one multiply per gradient, host-side update.
      double scale = 1.0, inv = 1.0 / scale;
      bool found = false;
      for (auto& p : params) {
        at::Tensor g = p.grad();
        if (!at::isfinite(g).all().item<bool>()) found = true;
        g.mul_(inv);
      }
      scale = found ? scale * 0.5 : scale;
      auto t2 = Clock::now();
      fused.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      loop.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    double f = median(fused), l = median(loop);
    std::printf("| %lldM | %zu | %.2f | %.2f | %.2f |\n", static_cast<long long>(total >> 20),
                params.size(), f, l, l / f);
  }
  return 0;
}
