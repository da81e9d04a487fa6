// Example (d): a user's own dataset and model, registered with dtrain's model registry and
// trained by dtrain's trainer: one registration (register_model) makes `model.type:
// spiral_classifier` a model the YAML config names, with its own keys (model.hidden,
// model.label_smoothing) read and checked like dtrain's, a memory estimate, and its data. The
// loop, the strategy (ddp or fsdp), the precision (fp32, bf16, fp16 with its scaler), gradient
// accumulation, clipping, the LR schedule, logging, the metrics file and checkpoints all come
// from the config, as for dtrain-train.
//
// Run at 2 ranks:  dtrain-launch --nproc-per-node 2 -- ./own_data_trainer config.yaml
// [key=value...] e.g. ... own_data_trainer config.yaml parallel.strategy=fsdp model.hidden=64
// The data: two interleaved spirals (2-D points, 2 classes), generated once in memory and
// split over the ranks by DistributedSampler. Exits 1 if the loss did not fall.
#include <ATen/ATen.h>
#include <dtrain/comm/communicator.h>
#include <dtrain/core/error.h>
#include <dtrain/framework/config.h>
#include <dtrain/framework/config_section.h>
#include <dtrain/framework/data.h>
#include <dtrain/framework/model_registry.h>
#include <dtrain/framework/strategy.h>
#include <dtrain/framework/task.h>
#include <dtrain/framework/trainer.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace {

namespace fw = dtrain::framework;
using fw::Batch;

// n points per class on two spirals, with noise; labels 0 and 1.
std::pair<at::Tensor, at::Tensor> spirals(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor t = at::rand({n}, at::kFloat) * 3 * M_PI;
  at::Tensor r = t / (3 * M_PI);
  std::vector<at::Tensor> xs, ys;
  for (int64_t c = 0; c < 2; ++c) {
    at::Tensor a = t + c * M_PI;
    xs.push_back(at::stack({r * at::cos(a), r * at::sin(a)}, 1) + at::randn({n, 2}) * 0.02);
    ys.push_back(at::full({n}, c, at::kLong));
  }
  return {at::cat(xs), at::cat(ys)};
}

// The user's dataset: a dtrain BatchSource. Every batch is a function of (step, micro), which
// is what lets a resumed run continue exactly where its checkpoint left off.
class SpiralData : public dtrain::framework::BatchSource {
 public:
  static constexpr int64_t kPerClass = 1024;

  SpiralData(int64_t batch_size, int64_t micro_batches, int world, int rank)
      : batch_size_(batch_size),
        micro_batches_(micro_batches),
        sampler_(2 * kPerClass, world, rank, /*seed=*/3) {
    std::tie(x_, y_) = spirals(kPerClass, 1);
    std::tie(val_x_, val_y_) = spirals(64, 2);
    sampler_.set_epoch(0);
  }
  // Micro-batch `micro` of step `step`: the next batch_size samples of this rank's share,
  // epoch after epoch (the sampler reshuffles per epoch).
  Batch next(int64_t step, int64_t micro) override {
    const int64_t per_epoch = static_cast<int64_t>(sampler_.indices().size());
    std::vector<int64_t> idx;
    for (int64_t k = 0; k < batch_size_; ++k) {
      const int64_t pos = (step * micro_batches_ + micro) * batch_size_ + k;
      if (sampler_.epoch() != pos / per_epoch) sampler_.set_epoch(pos / per_epoch);
      idx.push_back(sampler_.indices()[pos % per_epoch]);
    }
    at::Tensor i = at::tensor(idx, at::kLong);
    return {x_.index_select(0, i), y_.index_select(0, i)};
  }
  // Rank r's share of a fixed validation set: samples r, r + world, ...
  Batch validation(int rank, int world) override {
    at::Tensor i = at::arange(rank, val_x_.size(0), world, at::kLong);
    return {val_x_.index_select(0, i), val_y_.index_select(0, i)};
  }
  int64_t items_per_sample() const override { return 1; }

 private:
  int64_t batch_size_, micro_batches_;
  dtrain::framework::DistributedSampler sampler_;
  at::Tensor x_, y_, val_x_, val_y_;
};

// The user's model: any module whose forward takes the batch's inputs.
class ClassifierImpl : public torch::nn::Module {
 public:
  explicit ClassifierImpl(int64_t hidden) {
    fc1 = register_module("fc1", torch::nn::Linear(2, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc3->forward(at::tanh(fc2->forward(at::tanh(fc1->forward(x)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Classifier);

// The model's keys under `model:` (besides type).
struct SpiralSettings : fw::ModelSettingsOf<SpiralSettings> {
  int64_t hidden = 128;
  double label_smoothing = 0.05;
};

// The registration: how its config is read, what it needs in memory, and how it is built.
fw::ModelSpec spiral_classifier() {
  fw::ModelSpec spec;
  spec.name = "spiral_classifier";
  spec.summary = "a 3-layer tanh MLP on two interleaved spirals";
  spec.data = fw::ModelData::kOwn;  // its batches are its own (data.source stays synthetic)
  spec.read = [](fw::ConfigSection& s) {
    auto m = std::make_unique<SpiralSettings>();
    s.read("hidden", m->hidden);
    s.read("label_smoothing", m->label_smoothing);
    s.check(m->hidden >= 1, "hidden", "must be >= 1, got " + std::to_string(m->hidden));
    s.check(m->label_smoothing >= 0 && m->label_smoothing < 1, "label_smoothing",
            "must be in [0, 1)");
    return m;
  };
  // No wrap points: under FSDP the whole model is one unit.
  spec.memory = [](const fw::RunConfig& c) {
    const double h = static_cast<double>(c.model.as<SpiralSettings>().hidden);
    fw::ModelMemory m;
    m.parameters = static_cast<int64_t>(3 * h + h * h + h + 2 * h + 2);
    m.root = static_cast<double>(m.parameters);
    // Saved for backward per sample: two layers' pre- and post-tanh values, in fp32.
    m.activations = fw::micro_batch_samples(c) * 4 * h * 4;
    return m;
  };
  spec.build = [](const fw::BuildContext& ctx, fw::BuiltModel& out) {
    const auto& m = ctx.config.model.as<SpiralSettings>();
    Classifier model(m.hidden);
    model->to(ctx.device);
    out.task.description = "spiral classifier, hidden " + std::to_string(m.hidden);
    out.task.make_strategy = [model, comm = ctx.comm,
                              c = &ctx.config](dtrain::amp::NumericsMonitor* monitor) {
      return fw::make_strategy(model, comm, *c, monitor);
    };
    // Cross-entropy with label smoothing, in fp32 whatever autocast gave.
    out.task.loss = [smoothing = m.label_smoothing](const at::Tensor& output, const Batch& batch) {
      return at::cross_entropy_loss(output.to(at::kFloat), batch.targets, {}, at::Reduction::Mean,
                                    -100, smoothing);
    };
    out.data = std::make_unique<SpiralData>(ctx.micro_batch, ctx.config.train.micro_batches,
                                            ctx.world, ctx.rank);
  };
  return spec;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string path = argc > 1 ? argv[1] : "config.yaml";
    std::vector<std::string> overrides(argv + std::min(argc, 2), argv + argc);
    fw::register_model(spiral_classifier());  // before load_config reads model.type
    auto config = fw::load_config(path, overrides);
    auto comm = fw::connect(config);  // null for one process, strategy none
    const int world = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
    auto result = fw::train(config, comm);
    if (comm) comm->barrier().wait();
    if (rank == 0) {
      std::printf("own_data_trainer: %d ranks, %lld steps, loss %.4f -> %.4f\n", world,
                  static_cast<long long>(result.steps), result.first_loss, result.last_loss);
    }
    return result.last_loss < result.first_loss * 0.8 ? 0 : 1;
  } catch (const dtrain::ConfigError& e) {
    std::fprintf(stderr, "own_data_trainer: %s\n", dtrain::message_of(e).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "own_data_trainer: %s\n", dtrain::message_of(e).c_str());
    return 1;
  }
}
