#include "framework/memory_estimate.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "framework/model_registry.h"
#include "sharding/pipeline_schedule.h"

namespace dtrain::framework {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double bytes_of(c10::ScalarType t) { return t == c10::kFloat ? 4 : t == c10::kDouble ? 8 : 2; }

// Tensor parallelism's share of one rank's activations: Megatron's formula (Korthikanti et
// al. 2022, sbh(34 + 5as/h) without TP): with TP, sbh(10 + 24/t + 5as/(ht)), the norms' and
// residual's 10 whole; with sequence parallelism, everything / t; with it but without the
// regather in backward, the gathered inputs of attention and the MLP (4 of the 10) stay whole.
// The attention term is taken as cut with the rest.
double tp_activation_share(const ParallelConfig& p) {
  const double t = static_cast<double>(p.tp);
  if (t == 1) return 1;
  return !p.sequence_parallel           ? (10 + 24 / t) / 34
         : p.sequence_parallel_regather ? 1 / t
                                        : (4 + 30 / t) / 34;
}

double optimizer_bytes_per_parameter(const TrainConfig& t) {
  return t.optimizer == OptimizerType::kAdamW ? 8 : (t.momentum > 0 ? 4 : 0);
}

// The layers of each stage: the config's split, or as even as it goes (a depth the estimate's
// search tries need not split evenly).
std::vector<std::pair<int64_t, int64_t>> stage_ranges(int64_t layers, int stages,
                                                      const std::vector<int64_t>& split) {
  try {
    return sharding::pp::split_layers(layers, stages, split);
  } catch (const ConfigError&) {
  }
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t begin = 0;
  for (int s = 0; s < stages; ++s) {
    const int64_t n = layers / stages + (s < layers % stages ? 1 : 0);
    out.emplace_back(begin, begin + n);
    begin += n;
  }
  return out;
}

}  // namespace

std::vector<StageEstimate> estimate_pipeline_ranks(const RunConfig& c, int world) {
  const ModelSpec& spec = model_spec(c);
  DTRAIN_CHECK(c.parallel.pp > 1 && spec.pipeline_layers != nullptr, "model.type ", spec.name,
               ": no pipeline to estimate");
  const ModelMemory mm = spec.memory(c);
  const auto& mp = c.precision.mixed;
  const int64_t layers = spec.pipeline_layers(*c.model.settings);
  const int pp = static_cast<int>(c.parallel.pp),
            v = static_cast<int>(c.parallel.pp_stages_per_rank);
  const sharding::pp::Schedule schedule = sharding::pp::make_schedule(
      c.parallel.pp_schedule, pp, static_cast<int>(c.train.micro_batches), v);
  const auto ranges = stage_ranges(layers, schedule.stages, c.parallel.pp_split);
  // Under tensor parallelism each rank holds 1/tp of every layer (tp_activation_share of its
  // activations), and a full checkpoint's writer the whole model still.
  const double t = static_cast<double>(c.parallel.tp), share = tp_activation_share(c.parallel);
  const double total = static_cast<double>(mm.parameters);
  const double layer_params = mm.largest_unit / t, tail = (mm.root - mm.embedding) / t;
  const double embedding = mm.embedding / t, head_activations = mm.head_activations * share;
  const double layer_activations = (mm.activations - mm.head_activations) * share /
                                   static_cast<double>(std::max<int64_t>(1, layers));
  const double opt = optimizer_bytes_per_parameter(c.train);
  const int dp = std::max(1, world / (pp * static_cast<int>(c.parallel.tp)));
  const double d = c.parallel.strategy == ParallelStrategy::kFsdp ? dp : 1;
  std::vector<StageEstimate> out;
  for (int r = 0; r < pp; ++r) {
    double n = 0, held = 0;  // layers; activations of one micro-batch on each of its stages
    bool first = false, last = false;
    std::string holds;
    for (int stage : schedule.stages_of(r)) {
      const auto& [begin, end] = ranges[static_cast<size_t>(stage)];
      n += static_cast<double>(end - begin);
      first = first || stage == 0;
      last = last || stage == schedule.stages - 1;
      holds += (holds.empty() ? "stage " : ", stage ") + std::to_string(stage) + " (" +
               (stage == 0 ? "the embedding, " : "") + "layers " + std::to_string(begin) + "-" +
               std::to_string(end - 1) + (stage == schedule.stages - 1 ? ", the head" : "") + ")";
      held += static_cast<double>(end - begin) * layer_activations +
              (stage == schedule.stages - 1 ? head_activations : 0);
    }
    const double p = n * layer_params + (first ? embedding : 0) + (last ? tail : 0);
    StageEstimate st;
    st.holds = holds;
    st.in_flight = schedule.promised_in_flight[static_cast<size_t>(r)];
    MemoryEstimate& e = st.memory;
    e.parameter_count = mm.parameters;
    // Sharded (strategy fsdp): the fp32 masters and the optimizer state are 1/dp; in a step
    // the stage is gathered whole and its gradients accumulate whole until the reduce-scatter.
    e.parameters = 4 * p / d;
    e.gradients = 4 * p;
    // The data-parallel average of a stage's gradients: one flat copy in the reduce dtype.
    if (dp > 1) e.gradients += bytes_of(mp.effective_reduce_dtype()) * p;
    e.optimizer = opt * p / d;
    e.compute = (d > 1 ? 4 * p : 0) + (mp.is_low_precision() ? bytes_of(mp.param_dtype) * p : 0);
    // The mean micro-batch over its stages, times the most the schedule holds at once.
    e.activations = static_cast<double>(st.in_flight) * held / static_cast<double>(v);
    // A model built deferred makes only the rank's stages, another is built whole before the
    // rank keeps its stages; rank 0 holds the whole model and optimizer state while a full
    // checkpoint is staged.
    e.construction = mm.deferred_under_fsdp ? 4 * p : 4 * total / t;
    // Sharded, a checkpoint gathers each stage and its optimizer state whole first.
    if (d > 1 && !c.checkpoint.dir.empty()) {
      e.construction = std::max(e.construction, e.steady() + (4 + opt) * p);
    }
    if (r == 0 && !c.checkpoint.dir.empty()) {
      e.construction = std::max(e.construction, (4 + opt) * total + e.gradients);
      if (c.checkpoint.async) e.checkpoint_staging = (4 + opt) * total;
    }
    out.push_back(std::move(st));
  }
  return out;
}

std::string format_bytes(double bytes) {
  char buf[32];
  if (bytes >= kGiB) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", bytes / kGiB);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", bytes / (1024.0 * 1024.0));
  }
  return buf;
}

double MemoryEstimate::peak() const {
  return std::max(steady() + compute + activations + checkpoint_staging, construction);
}

std::string MemoryEstimate::describe() const {
  std::ostringstream os;
  os << format_bytes(peak()) << " (parameters " << format_bytes(parameters) << ", gradients "
     << format_bytes(gradients) << ", optimizer state " << format_bytes(optimizer)
     << ", gathered/low-precision copies " << format_bytes(compute) << ", activations "
     << format_bytes(activations) << "; " << parameter_count / 1e6 << "M parameters)";
  return os.str();
}

MemoryEstimate estimate_memory(const RunConfig& c, int world) {
  if (c.parallel.pp > 1 && model_spec(c).pipeline_layers != nullptr) {
    MemoryEstimate largest;
    for (const auto& st : estimate_pipeline_ranks(c, world)) {
      if (st.memory.peak() > largest.peak()) largest = st.memory;
    }
    return largest;
  }
  MemoryEstimate e;
  const auto& mp = c.precision.mixed;
  const double cb = bytes_of(mp.param_dtype);  // compute dtype
  const ModelMemory mm = model_spec(c).memory(c);
  e.parameter_count = mm.parameters;
  e.activations = mm.activations;
  // Tensor parallelism: each rank holds 1/tp of every cut layer (the norms, a sliver, are
  // counted cut too) and the data-parallel strategy runs over world / tp ranks; activations
  // by tp_activation_share.
  const double t = static_cast<double>(c.parallel.tp);
  if (t > 1) {
    world = std::max(1, world / static_cast<int>(c.parallel.tp));
    e.activations *= tp_activation_share(c.parallel);
  }
  const double largest_unit = mm.largest_unit / t, root = mm.root / t;
  const double p = static_cast<double>(e.parameter_count) / t;
  const double opt_per_param = optimizer_bytes_per_parameter(c.train);
  e.construction = 4 * p;
  if (c.parallel.strategy == ParallelStrategy::kFsdp) {
    using sharding::ShardingStrategy;
    const ShardingStrategy s = c.parallel.sharding_strategy;
    double n = world;
    if (s == ShardingStrategy::kNoShard) n = 1;
    if (s == ShardingStrategy::kHybridShard && c.parallel.hybrid_group_size > 0) {
      n = static_cast<double>(c.parallel.hybrid_group_size);
    }
    e.parameters = 4 * p / n;
    const double grad_bytes =
        mp.keep_low_precision_grads ? bytes_of(mp.effective_reduce_dtype()) : 4;
    // Stepped in backward, a rank holds the shards of the unit being stepped and of the one
    // whose reduction is in flight, not the whole gradient.
    e.gradients = c.train.optimizer_in_backward ? 2 * std::max(largest_unit, root) * grad_bytes / n
                                                : grad_bytes * p / n;
    e.optimizer = opt_per_param * p / n;
    const double gathered =
        s == ShardingStrategy::kShardGradOp || s == ShardingStrategy::kNoShard
            ? (n > 1 || cb != 4 ? p * cb : 0)
            : (static_cast<double>(c.parallel.limit_all_gathers) * largest_unit + root) * cb;
    e.compute = gathered + largest_unit * bytes_of(mp.effective_reduce_dtype());
    // Building the model: a model built deferred (placeholders) has each unit initialized
    // whole in its fp32 buffer, then sharded; the others are built whole first.
    e.construction =
        (mm.deferred_under_fsdp ? 4 * p / n : 4 * p) + 4 * std::max(largest_unit, root);
  } else {
    e.parameters = 4 * p;
    e.gradients = 4 * p;
    if (c.parallel.strategy == ParallelStrategy::kDdp &&
        mp.effective_reduce_dtype() != c10::kFloat) {
      e.gradients += bytes_of(mp.effective_reduce_dtype()) * p;
    }
    e.optimizer = opt_per_param * p;
    e.compute = mp.is_low_precision() ? cb * p : 0;  // autocast's weight cache
  }
  if (c.checkpoint.async && !c.checkpoint.dir.empty()) {
    // What this rank writes: its shards (sharded), or the whole model and optimizer state
    // (a full checkpoint: rank 0, the largest; under TP gathered from every tp rank's slices,
    // so the whole model's, not this rank's 1/tp; a TP run's is full unless sharded is asked).
    const bool sharded = c.parallel.strategy == ParallelStrategy::kFsdp &&
                         c.checkpoint.format != CheckpointFormat::kFull &&
                         (t == 1 || c.checkpoint.format == CheckpointFormat::kSharded);
    e.checkpoint_staging = sharded ? e.parameters + e.optimizer
                                   : (4 + opt_per_param) * static_cast<double>(e.parameter_count);
  }
  return e;
}

int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (f >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return -1;
}

namespace {

bool fits(const RunConfig& c, int world, int ranks_here, int64_t available) {
  return estimate_memory(c, world).peak() * ranks_here <= 0.9 * static_cast<double>(available);
}

void set_depth(RunConfig& c, int64_t depth) { model_spec(c).set_depth(*c.model.settings, depth); }

}  // namespace

int64_t deepest_that_fits(const RunConfig& c, int world, int ranks_here, int64_t available) {
  if (!model_spec(c).set_depth) return 0;
  RunConfig probe = c;
  auto fits_at = [&](int64_t depth) {
    set_depth(probe, depth);
    return fits(probe, world, ranks_here, available);
  };
  if (!fits_at(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (hi < (int64_t{1} << 30) && fits_at(hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {  // fits_at(lo), !fits_at(hi)
    const int64_t mid = lo + (hi - lo) / 2;
    (fits_at(mid) ? lo : hi) = mid;
  }
  return lo;
}

std::string estimate_report(const RunConfig& c, int world, int ranks_here, int64_t available) {
  const MemoryEstimate e = estimate_memory(c, world);
  const ModelSpec& spec = model_spec(c);
  const ModelMemory mm = spec.memory(c);
  std::ostringstream os;
  auto row = [&](const std::string& what, double bytes, const std::string& note = "") {
    char name[48];
    std::snprintf(name, sizeof(name), "  %-38s", what.c_str());
    os << name << format_bytes(bytes) << (note.empty() ? "" : "  (" + note + ")") << "\n";
  };
  os << "memory estimate for " << c.source << ": model.type " << spec.name << ", "
     << static_cast<double>(e.parameter_count) / 1e6 << "M parameters, strategy "
     << name_of(c.parallel.strategy);
  if (c.parallel.strategy == ParallelStrategy::kFsdp) {
    os << " " << name_of(c.parallel.sharding_strategy);
  }
  if (c.parallel.tp > 1) {
    os << ", tp " << c.parallel.tp
       << (c.parallel.sequence_parallel ? " with sequence parallel" : "") << " (each rank 1/"
       << c.parallel.tp << " of every layer; activations by Megatron's formula)";
  }
  os << ", precision " << name_of(c.precision.policy) << ", " << world << " rank(s), " << ranks_here
     << " on this node\nper rank:\n";
  row("parameters (fp32 masters)", e.parameters);
  row("gradients", e.gradients);
  row("optimizer state", e.optimizer,
      c.train.optimizer == OptimizerType::kAdamW ? "AdamW: 2 fp32 values per parameter" : "");
  row("gathered units, low-precision copies", e.compute,
      c.parallel.strategy == ParallelStrategy::kFsdp
          ? "limit_all_gathers " + std::to_string(c.parallel.limit_all_gathers) +
                " units and the root in param_dtype, taken from and returned to the pool"
          : "");
  std::string note;
  if (mm.activations_other_recompute) {
    const double alt = *mm.activations_other_recompute;
    note = alt < e.activations ? "with model.recompute: full " + format_bytes(alt)
                               : "without recompute " + format_bytes(alt);
  }
  if (!mm.activations_note.empty()) note += (note.empty() ? "" : "; ") + mm.activations_note;
  row("activations", e.activations, note);
  row("buffers", 0, "the built-in models have none");
  if (e.checkpoint_staging > 0) {
    row("checkpoint staging", e.checkpoint_staging,
        "checkpoint.async: the host copy of what this rank writes, reused by every save");
  }
  row("construction peak", e.construction,
      c.parallel.strategy != ParallelStrategy::kFsdp ? "the full fp32 model"
      : mm.deferred_under_fsdp
          ? "this rank's shards and one unit in fp32 (built deferred, initialized unit by unit)"
          : "the full fp32 model, before FSDP shards it, and one unit's copy");
  row("peak", e.peak());
  if (c.parallel.pp > 1 && spec.pipeline_layers != nullptr) {
    os << "per pipeline rank (parallel.pp " << c.parallel.pp << ", "
       << sharding::pp::schedule_name(c.parallel.pp_schedule) << "; above: the largest):\n";
    int r = 0;
    for (const auto& st : estimate_pipeline_ranks(c, world)) {
      os << "  pp rank " << r++ << ": " << st.holds << "\n    " << format_bytes(st.memory.peak())
         << ": parameters " << format_bytes(st.memory.parameters) << ", gradients "
         << format_bytes(st.memory.gradients) << ", optimizer state "
         << format_bytes(st.memory.optimizer) << ", activations "
         << format_bytes(st.memory.activations) << " (" << st.in_flight
         << " micro-batch(es) held at once)\n";
    }
  }
  if (available < 0) {
    os << "this node's available memory is unknown";
  } else {
    const double need = e.peak() * ranks_here;
    os << "this node: " << ranks_here << " rank(s) x " << format_bytes(e.peak()) << " = "
       << format_bytes(need) << " of " << format_bytes(static_cast<double>(available))
       << " available: " << (fits(c, world, ranks_here, available) ? "fits" : "does NOT fit")
       << " (the limit is 90%)\n";
    const int64_t deepest = deepest_that_fits(c, world, ranks_here, available);
    const std::string key = "model." + spec.depth_key;
    if (!spec.set_depth) {
      os << "model.type " << spec.name << " has no depth to vary";
    } else if (deepest == 0) {
      os << "no depth of this width fits: not even " << key << " 1";
    } else {
      RunConfig d = c;
      set_depth(d, deepest);
      os << "deepest of this width that fits: " << key << " " << deepest << " ("
         << static_cast<double>(estimate_memory(d, world).parameter_count) / 1e6 << "M parameters)";
    }
  }
  if (c.device == ComputeDevice::kCuda) {
    os << "\n(host memory; a CUDA run's device memory is not estimated here)";
  }
  return os.str();
}

void check_memory_fits(const RunConfig& c, int world, int ranks_here, int64_t available) {
  if (available < 0) return;
  const MemoryEstimate e = estimate_memory(c, world);
  const double need = e.peak() * ranks_here;
  if (need <= 0.9 * static_cast<double>(available)) return;
  std::ostringstream hint;
  if (c.parallel.strategy != ParallelStrategy::kFsdp && world > 1) {
    RunConfig f = c;
    f.parallel.strategy = ParallelStrategy::kFsdp;
    f.parallel.sharding_strategy = sharding::ShardingStrategy::kFullShard;
    hint << "parallel.strategy: fsdp (full_shard shards parameters, gradients and optimizer "
            "state over the "
         << world << " ranks: about " << format_bytes(estimate_memory(f, world).peak())
         << " per rank)";
  } else if (c.parallel.strategy != ParallelStrategy::kFsdp) {
    hint << "more ranks with parallel.strategy: fsdp (it shards parameters, gradients and "
            "optimizer state over them)";
  } else {
    hint << "more ranks on more nodes (FSDP shards further)";
  }
  hint << ", a smaller train.batch_size, or precision.policy: bf16";
  DTRAIN_FAIL(ConfigError, c.source, ": this run needs about ", e.describe(), " per rank, x ",
              ranks_here, " rank(s) on this node = ", format_bytes(need), ", but only ",
              format_bytes(static_cast<double>(available)),
              " of memory are available. It would end in the kernel's out-of-memory "
              "killer, so it does not start. To fit: ",
              hint.str(), ".");
}

}  // namespace dtrain::framework
