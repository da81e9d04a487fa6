// What the trainer trains (Task), and what a registered model's build is given and fills
// (BuildContext, BuiltModel; framework/model_registry.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "amp/numerics.h"
#include "comm/communicator.h"
#include "framework/config.h"
#include "framework/data.h"
#include "framework/strategy.h"
#include "sharding/mesh.h"

namespace dtrain::framework {

// The loss of one micro-batch from the module's output: a scalar tensor, the mean over the
// batch (the trainer divides by micro_batches itself).
using LossFn = std::function<at::Tensor(const at::Tensor& output, const Batch& batch)>;

// Cross-entropy in fp32 over the last dimension (classes or vocabulary): the config models'
// loss, and a ready LossFn for users.
at::Tensor cross_entropy(const at::Tensor& output, const Batch& batch);

// What a trainer trains: the model behind its strategy, and its loss.
struct Task {
  // Builds the model's strategy once the trainer's numerics monitor exists.
  std::function<std::unique_ptr<Strategy>(amp::NumericsMonitor* monitor)> make_strategy;
  LossFn loss;
  // Validation per token (cross-entropy summed over every target of the set; the config
  // models) rather than per item (the loss times the batch's items; a user's loss).
  bool per_token_validation = false;
  // Names the model in the log and the metrics file.
  std::string description;
  // Called on every rank after the last step (before the end-of-run report), with the trained
  // model: e.g. to export it. Collective under FSDP if it gathers. Optional.
  std::function<void(Strategy& model)> on_finish;
};

// What a model's build gets: the run and this rank's place in it.
struct BuildContext {
  const RunConfig& config;
  std::shared_ptr<comm::Communicator> comm;  // null: one process
  int rank = 0, world = 1;
  c10::DeviceType device = c10::kCPU;
  int64_t micro_batch = 0;  // samples per micro-batch
  uint64_t data_seed = 0;   // data.seed
  // parallel.tp > 1: the mesh (sharding/mesh.h); the model's strategy runs over mesh->dp()
  // and its plan over mesh->tp(). Null otherwise.
  std::shared_ptr<sharding::DeviceMesh> mesh;
};

// What a model's build fills: the task (strategy maker, loss, description), and for a model
// with data of its own (ModelData::kOwn) its batches; a token model leaves data null and the
// trainer makes the source the config names for its TokenShape.
struct BuiltModel {
  Task task;
  std::unique_ptr<BatchSource> data;
};

}  // namespace dtrain::framework
