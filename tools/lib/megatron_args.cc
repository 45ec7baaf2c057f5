#include "tools/lib/megatron_args.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>

#include "ops/library_workspaces.h"
#include "simulator/checked_math.h"

namespace memsim {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

enum class Arity { kFlag, kValue, kValues };  // store_true, one value, nargs='*'/'+'

// Arguments memsim reads. Some are memory-neutral with some values (e.g.
// --cpu-offloading-num-layers 0): they land in `ignored` then, an error otherwise.
const std::map<std::string, Arity>& ReadArgs() {
  static const auto* args = new std::map<std::string, Arity>{
      // Model shape.
      {"--num-layers", Arity::kValue},
      {"--hidden-size", Arity::kValue},
      {"--ffn-hidden-size", Arity::kValue},
      {"--num-attention-heads", Arity::kValue},
      {"--group-query-attention", Arity::kFlag},
      {"--num-query-groups", Arity::kValue},
      {"--kv-channels", Arity::kValue},
      {"--max-position-embeddings", Arity::kValue},
      {"--vocab-size", Arity::kValue},
      {"--padded-vocab-size", Arity::kValue},
      {"--make-vocab-size-divisible-by", Arity::kValue},
      {"--swiglu", Arity::kFlag},
      {"--normalization", Arity::kValue},
      {"--position-embedding-type", Arity::kValue},
      {"--use-rotary-position-embeddings", Arity::kFlag},
      {"--untie-embeddings-and-output-weights", Arity::kFlag},
      {"--disable-bias-linear", Arity::kFlag},
      {"--add-qkv-bias", Arity::kFlag},
      {"--qk-layernorm", Arity::kFlag},
      {"--multi-latent-attention", Arity::kFlag},
      {"--q-lora-rank", Arity::kValue},
      {"--kv-lora-rank", Arity::kValue},
      {"--qk-head-dim", Arity::kValue},
      {"--qk-pos-emb-head-dim", Arity::kValue},
      {"--v-head-dim", Arity::kValue},
      {"--hidden-dropout", Arity::kValue},
      {"--attention-dropout", Arity::kValue},
      // Mixture of experts.
      {"--num-experts", Arity::kValue},
      {"--moe-router-topk", Arity::kValue},
      {"--moe-ffn-hidden-size", Arity::kValue},
      {"--moe-shared-expert-intermediate-size", Arity::kValue},
      {"--moe-expert-capacity-factor", Arity::kValue},
      {"--moe-layer-freq", Arity::kValue},
      {"--moe-token-dispatcher-type", Arity::kValue},
      {"--moe-grouped-gemm", Arity::kFlag},
      {"--moe-permute-fusion", Arity::kFlag},
      {"--moe-router-dtype", Arity::kValue},
      {"--moe-aux-loss-coeff", Arity::kValue},
      {"--moe-z-loss-coeff", Arity::kValue},
      {"--cross-entropy-loss-fusion", Arity::kFlag},
      {"--defer-embedding-wgrad-compute", Arity::kFlag},
      {"--wgrad-deferral-limit", Arity::kValue},
      {"--cross-entropy-fusion-impl", Arity::kValue},
      // Batch and sequence.
      {"--seq-length", Arity::kValue},
      {"--micro-batch-size", Arity::kValue},
      {"--global-batch-size", Arity::kValue},
      // Parallelism.
      {"--tensor-model-parallel-size", Arity::kValue},
      {"--pipeline-model-parallel-size", Arity::kValue},
      {"--num-layers-per-virtual-pipeline-stage", Arity::kValue},
      {"--num-virtual-stages-per-pipeline-rank", Arity::kValue},
      {"--microbatch-group-size-per-virtual-pipeline-stage", Arity::kValue},
      {"--decoder-first-pipeline-num-layers", Arity::kValue},
      {"--decoder-last-pipeline-num-layers", Arity::kValue},
      {"--account-for-embedding-in-pipeline-split", Arity::kFlag},
      {"--account-for-loss-in-pipeline-split", Arity::kFlag},
      {"--context-parallel-size", Arity::kValue},
      {"--cp-comm-type", Arity::kValues},
      {"--expert-model-parallel-size", Arity::kValue},
      {"--expert-tensor-parallel-size", Arity::kValue},
      {"--sequence-parallel", Arity::kFlag},
      {"--use-distributed-optimizer", Arity::kFlag},
      {"--num-distributed-optimizer-instances", Arity::kValue},
      {"--data-parallel-sharding-strategy", Arity::kValue},
      // Precision, kernels, optimizer.
      {"--bf16", Arity::kFlag},
      {"--fp16", Arity::kFlag},
      {"--accumulate-allreduce-grads-in-fp32", Arity::kFlag},
      {"--main-grads-dtype", Arity::kValue},
      {"--main-params-dtype", Arity::kValue},
      {"--exp-avg-dtype", Arity::kValue},
      {"--exp-avg-sq-dtype", Arity::kValue},
      {"--transformer-impl", Arity::kValue},
      {"--attention-backend", Arity::kValue},
      {"--use-flash-attn", Arity::kFlag},
      {"--optimizer", Arity::kValue},
      {"--no-gradient-accumulation-fusion", Arity::kFlag},
      // Recomputation and memory management.
      {"--recompute-activations", Arity::kFlag},
      {"--recompute-granularity", Arity::kValue},
      {"--recompute-method", Arity::kValue},
      {"--recompute-num-layers", Arity::kValue},
      {"--recompute-modules", Arity::kValues},
      {"--cpu-offloading-num-layers", Arity::kValue},
      {"--empty-unused-memory-level", Arity::kValue},
      {"--cuda-graph-impl", Arity::kValue},
      // What the graphs capture and when: only with --cuda-graph-impl, which is refused.
      {"--cuda-graph-modules", Arity::kValues},
      {"--cuda-graph-scope", Arity::kValues},
      {"--cuda-graph-warmup-steps", Arity::kValue},
  };
  return *args;
}

// Memory-neutral arguments: schedules and hyperparameters of the optimizer, data and
// tokenizer files, checkpointing, logging and profiling, initialisation, kernel fusions
// and communication overlap that reuse the same buffers (--overlap-grad-reduce,
// --overlap-param-gather: Megatron's DDP reduces and gathers in place in its contiguous
// buffers), RoPE variants (a rotation, not a tensor size), sliding windows (the
// attention saves the same tensors with any mask), and the settings of features that
// are off without their switch (FP8 recipe without --fp8-format, MLA ranks without
// --multi-latent-attention).
const std::map<std::string, Arity>& NeutralArgs() {
  static const auto* args = [] {
    auto* m = new std::map<std::string, Arity>;
    for (const char* name : {
             "--adam-beta1",
             "--adam-beta2",
             "--adam-eps",
             "--adlr-autoresume-interval",
             "--app-tag-run-name",
             "--app-tag-run-version",
             "--async-strategy",
             "--check-weight-hash-across-dp-replicas-interval",
             "--ckpt-convert-format",
             "--ckpt-convert-save",
             "--ckpt-format",
             "--ckpt-step",
             "--clip-grad",
             "--config-logger-dir",
             "--data-args-path",
             "--data-cache-path",
             "--dataloader-type",
             "--ddp-bucket-size",
             "--ddp-num-buckets",
             "--decoupled-lr",
             "--decoupled-min-lr",
             "--dist-ckpt-format",
             "--dist-ckpt-strictness",
             "--distributed-backend",
             "--distributed-timeout-minutes",
             "--distributed-timeout-seconds-after-init",
             "--embedding-init-method-std",
             "--end-weight-decay",
             "--error-injection-rate",
             "--error-injection-type",
             "--eval-interval",
             "--eval-iters",
             "--fim-rate",  // FIM: a CPU-side permutation of the data (fim_dataset.py)
             "--fim-spm-rate",
             "--fim-split-sample",
             "--fim-fragment-rate",
             "--fim-no-prefix",
             "--fim-prefix-token",
             "--fim-middle-token",
             "--fim-suffix-token",
             "--fim-pad-token",
             "--fim-eod-token",
             "--exit-duration-in-mins",
             "--exit-interval",
             "--fp8-amax-compute-algo",
             "--fp8-amax-history-len",
             "--fp8-interval",
             "--fp8-margin",
             "--fp8-recipe",
             "--hysteresis",
             "--init-method-std",
             "--initial-loss-scale",
             "--load",
             "--local-rank",
             "--log-interval",
             "--logging-level",
             "--loss-scale",
             "--loss-scale-window",
             "--lr",
             "--lr-decay-iters",
             "--lr-decay-samples",
             "--lr-decay-style",
             "--lr-warmup-fraction",
             "--lr-warmup-init",
             "--lr-warmup-iters",
             "--lr-warmup-samples",
             "--lr-wsd-decay-iters",
             "--lr-wsd-decay-samples",
             "--lr-wsd-decay-style",
             "--manual-gc-interval",
             "--memory-snapshot-path",
             "--merge-file",
             "--mid-level-dataset-surplus",
             "--min-loss-scale",
             "--min-lr",
             "--moe-input-jitter-eps",
             "--moe-router-bias-update-rate",
             "--moe-router-group-topk",
             "--moe-router-num-groups",
             "--moe-router-score-function",
             "--moe-router-topk-scaling-factor",
             "--moe-token-drop-policy",
             "--mtp-loss-scaling-factor",
             "--nccl-communicator-config-path",
             "--non-persistent-ckpt-type",
             "--non-persistent-global-ckpt-dir",
             "--non-persistent-local-ckpt-dir",
             "--non-persistent-save-interval",
             "--norm-epsilon",
             "--num-dataset-builder-threads",
             "--num-workers",
             "--object-storage-cache-path",
             "--one-logger-project",
             "--one-logger-run-name",
             "--per-split-data-args-path",
             "--pretrained-checkpoint",
             "--profile-step-end",
             "--profile-step-start",
             "--rerun-mode",
             "--result-rejected-tracker-filename",
             "--rope-scaling-factor",
             "--rope-type",
             "--rotary-base",
             "--rotary-scaling-factor",  // RoPE/YaRN scalars: the same tensors
             "--mscale",
             "--mscale-all-dim",
             "--rotary-percent",
             "--rotary-seq-len-interpolation-factor",
             "--save",
             "--save-interval",
             "--save-retain-interval",
             "--seed",
             "--sgd-momentum",
             "--split",
             "--start-weight-decay",
             "--straggler-ctrlr-port",
             "--straggler-minmax-count",
             "--tensorboard-dir",
             "--tensorboard-log-interval",
             "--tensorboard-queue-size",
             "--tiktoken-num-special-tokens",
             "--tiktoken-pattern",
             "--timing-log-level",
             "--timing-log-option",
             "--tokenizer-metadata",
             "--tokenizer-model",
             "--tokenizer-type",
             "--train-iters",
             "--train-samples",
             "--train-sync-interval",
             "--vocab-file",
             "--wandb-entity",
             "--wandb-exp-name",
             "--wandb-project",
             "--wandb-save-dir",
             "--weight-decay",
             "--weight-decay-incr-style",
             "--window-size",
         }) {
      (*m)[name] = Arity::kValue;
    }
    for (const char* name : {
             "--data-path",
             "--high-priority-stream-groups",
             "--iterations-to-skip",
             "--moe-router-load-balancing-type",
             "--profile-ranks",
             "--test-data-path",
             "--tiktoken-special-tokens",
             "--train-data-path",
             "--valid-data-path",
         }) {
      (*m)[name] = Arity::kValues;
    }
    for (const char* name : {
             "--adlr-autoresume",
             "--apply-layernorm-1p",
             "--apply-query-key-layer-scaling",
             "--async-save",
             "--async-ckpt-use-cpu-shm",
             "--attention-softmax-in-fp32",
             "--auto-detect-ckpt-format",
             "--calculate-per-token-loss",
             "--check-for-large-grads",
             "--check-for-spiky-loss",
             "--ckpt-assume-constant-structure",
             "--ckpt-fully-parallel-load",
             "--ckpt-fully-parallel-save",
             "--data-parallel-random-init",
             "--ddp-average-in-collective",
             "--ddp-pad-buckets-for-high-nccl-busbw",
             "--deterministic-mode",
             "--cache-mla-latents",  // inference only
             "--test-mode",  // attention's consistency check: all-gathers of 4 D-wide vectors
             "--disable-gloo-process-groups",
             "--disable-msc",
             "--disable-straggler-on-startup",
             "--dist-ckpt-optim-fully-reshardable",
             "--enable-experimental",
             "--eod-mask-loss",
             "--fim-data",
             "--exit-on-missing-checkpoint",
             "--exit-signal-handler",
             "--finetune",
             "--full-validation",
             "--init-method-xavier-uniform",
             "--init-model-with-meta-device",
             "--legacy-tokenizer",
             "--log-energy",
             "--log-memory-to-tensorboard",
             "--log-num-zeros-in-grad",
             "--log-params-norm",
             "--log-progress",
             "--log-straggler",
             "--log-throughput",
             "--log-timers-to-tensorboard",
             "--log-validation-ppl-to-tensorboard",
             "--log-world-size-to-tensorboard",
             "--manual-gc",
             "--mock-data",
             "--moe-per-layer-logging",
             "--moe-router-enable-expert-bias",
             "--moe-router-force-load-balancing",
             "--moe-router-fusion",
             "--moe-router-pre-softmax",
             "--moe-shared-expert-overlap",
             "--moe-use-legacy-grouped-gemm",
             "--no-align-grad-reduce",
             "--no-align-param-gather",
             "--no-async-tensor-model-parallel-allreduce",
             "--no-barrier-with-level-1-timing",
             "--no-bias-dropout-fusion",
             "--no-bias-gelu-fusion",
             "--no-bias-swiglu-fusion",
             "--no-check-for-nan-in-loss-and-grad",
             "--no-ckpt-fully-parallel-save",
             "--no-create-attention-mask-in-dataloader",
             "--no-fp8-wgrad",
             "--no-gradient-reduce-div-fusion",
             "--no-initialization",
             "--no-load-optim",
             "--no-load-rng",
             "--no-log-loss-scale-to-tensorboard",
             "--no-manual-gc-eval",
             "--no-masked-softmax-fusion",
             "--no-mmap-bin-files",
             "--no-one-logger",
             "--no-overlap-p2p-communication",
             "--no-persist-layer-norm",
             "--no-rope-fusion",
             "--no-save-optim",
             "--no-save-rng",
             "--no-scatter-gather-tensors-in-pipeline",
             "--one-logger-async",
             "--openai-gelu",
             "--overlap-grad-reduce",
             "--overlap-p2p-communication-warmup-flush",
             "--overlap-param-gather",
             "--overlap-param-gather-with-optimizer-step",
             "--override-opt-param-scheduler",
             "--override-opt_param-scheduler",
             "--profile",
             "--record-memory-history",
             "--reset-attention-mask",
             "--reset-position-ids",
             "--rotary-interleaved",
             "--sft",
             "--skip-train",
             "--te-rng-tracker",
             "--trust-remote-code",
             "--use-checkpoint-args",
             "--use-checkpoint-opt-param-scheduler",
             "--use-checkpoint-opt_param-scheduler",
             "--use-cpu-initialization",
             "--use-dist-ckpt",
             "--use-mcore-models",
             "--use-mp-args-from-checkpoint-args",
             "--use-persistent-ckpt-worker",
             "--use-pytorch-profiler",
             "--use-ring-exchange-p2p",
             "--use-rope-scaling",
             "--use-sharp",
             "--use-tp-pp-dp-mapping",
             "--verify-integrity",
         }) {
      (*m)[name] = Arity::kFlag;
    }
    return m;
  }();
  return *args;
}

// Arguments that change memory in ways memsim does not simulate, with what they are.
const std::map<std::string, std::string>& UnmodelledArgs() {
  static const auto* args = new std::map<std::string, std::string>{
      {"--cpu-offloading", "activation offloading to CPU"},
      {"--decoder-num-layers", "encoder-decoder models"},
      {"--decoder-seq-length", "encoder-decoder models"},
      {"--decrease-batch-size-if-needed", "batch sizes that change during training"},
      {"--delay-wgrad-compute", "delayed weight gradients"},
      {"--distribute-saved-activations", "saved activations split over tensor parallelism"},
      {"--enable-cuda-graph", "CUDA graphs"},
      {"--encoder-num-layers", "encoder-decoder models"},
      {"--encoder-seq-length", "encoder-decoder models"},
      {"--external-cuda-graph", "CUDA graphs"},
      {"--first-last-layers-bf16", "FP8 training"},
      {"--fp16-lm-cross-entropy", "an fp16 cross entropy"},
      {"--fp32-residual-connection", "an fp32 residual stream"},
      {"--fp4-format", "FP4 training"},
      {"--fp4-param-gather", "FP4 parameters"},
      {"--fp8-format", "FP8 training"},
      {"--fp8-param-gather", "FP8 parameters"},
      {"--grad-reduce-in-bf16", "bf16 gradient buffers"},
      {"--heterogeneous-layers-config-encoded-json", "heterogeneous layers"},
      {"--heterogeneous-layers-config-path", "heterogeneous layers"},
      {"--hierarchical-context-parallel-sizes", "hierarchical context parallelism"},
      {"--hybrid-attention-ratio", "hybrid Mamba models"},
      {"--hybrid-mlp-ratio", "hybrid Mamba models"},
      {"--hybrid-override-pattern", "hybrid Mamba models"},
      {"--is-hybrid-model", "hybrid Mamba models"},
      {"--moe-enable-deepep", "the DeepEP token dispatcher"},
      {"--moe-extended-tp", "extended expert tensor parallelism"},
      {"--moe-layer-recompute", "MoE-layer recomputation"},
      {"--moe-pad-expert-input-to-capacity", "expert inputs padded to capacity"},
      {"--moe-use-upcycling", "MoE upcycling"},
      {"--mla-down-proj-fusion", "fused MLA down projections and input layernorm"},
      {"--mtp-num-layers", "multi-token prediction layers"},
      {"--optimizer-cpu-offload", "optimizer offloading to CPU"},
      {"--overlap-moe-expert-parallel-comm", "overlapped expert-parallel communication"},
      {"--pipeline-model-parallel-layout", "custom pipeline layouts"},
      {"--qk-l2-norm", "q/k normalization"},
      {"--quick-geglu", "the quick-GeGLU activation"},
      {"--rampup-batch-size", "batch sizes that change during training"},
      {"--spec", "custom layer specs"},
      {"--squared-relu", "the squared-ReLU activation"},
      {"--tp-comm-overlap", "tensor-parallel communication overlap buffers"},
      {"--use-custom-fsdp", "FSDP"},
      {"--use-legacy-models", "the legacy (non-core) models"},
      {"--use-megatron-fsdp", "FSDP"},
      {"--use-precision-aware-optimizer", "low-precision optimizer states"},
      {"--use-torch-fsdp2", "FSDP"},
      {"--yaml-cfg", "arguments read from a YAML file"},
  };
  return *args;
}

Status NotModelled(const std::string& arg, const std::string& what) {
  return Status::Error(arg + " changes memory in a way memsim does not model (" + what +
                       "); drop it to simulate the run without it");
}

// The arguments as given: the last occurrence of each wins, as with argparse.
class Args {
 public:
  Status Parse(const std::vector<std::string>& args) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& token = args[i];
      if (token.rfind("--", 0) != 0 || token.size() == 2) {
        return Status::Error("unexpected argument '" + token +
                             "': Megatron-LM arguments start with --");
      }
      const size_t eq = token.find('=');
      const std::string name = token.substr(0, eq);
      Arity arity;
      if (auto it = ReadArgs().find(name); it != ReadArgs().end()) {
        arity = it->second;
      } else if (auto it = NeutralArgs().find(name); it != NeutralArgs().end()) {
        arity = it->second;
        ignored_.insert(name);
      } else if (auto it = UnmodelledArgs().find(name); it != UnmodelledArgs().end()) {
        return NotModelled(name, it->second);
      } else {
        return Status::Error("unknown Megatron-LM argument '" + name +
                             "'; if it does not change memory, drop it from the arguments "
                             "given to memsim");
      }
      std::vector<std::string> values;
      if (eq != std::string::npos) {
        if (arity == Arity::kFlag) {
          return Status::Error(name + " takes no value, got '" + token + "'");
        }
        values.push_back(token.substr(eq + 1));
      } else if (arity != Arity::kFlag) {
        while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
          values.push_back(args[++i]);
          if (arity == Arity::kValue) break;
        }
        if (arity == Arity::kValue && values.empty()) return Status::Error(name + " needs a value");
      }
      if (!values_.count(name)) order_.push_back(name);
      values_[name] = std::move(values);
    }
    return Status::OK();
  }

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  // The value of a one-value argument; `fallback` when absent.
  std::string Text(const std::string& name, const std::string& fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second.front();
  }
  const std::vector<std::string>& Values(const std::string& name) const { return values_.at(name); }
  // Leaves `*out` unchanged when the argument is absent.
  Status Int(const std::string& name, int64_t* out) const {
    if (!Has(name)) return Status::OK();
    const std::string text = Text(name, "");
    const char* begin = text.data() + (text.rfind('+', 0) == 0 ? 1 : 0);
    const char* end = text.data() + text.size();
    int64_t v;
    auto [ptr, ec] = std::from_chars(begin, end, v);
    if (ec != std::errc() || ptr != end || begin == end) {
      return Status::Error(name + " expects an integer, got '" + text + "'");
    }
    *out = v;
    return Status::OK();
  }
  Status Float(const std::string& name, double* out) const {
    if (!Has(name)) return Status::OK();
    const std::string text = Text(name, "");
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size()) {
      return Status::Error(name + " expects a number, got '" + text + "'");
    }
    *out = v;
    return Status::OK();
  }
  // Records a present argument as not changing memory.
  void Ignore(const std::string& name) {
    if (Has(name)) ignored_.insert(name);
  }
  std::vector<std::string> Ignored() const {
    std::vector<std::string> out;
    for (const std::string& name : order_) {
      if (ignored_.count(name)) out.push_back(name);
    }
    return out;
  }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> order_;  // first occurrence
  std::set<std::string> ignored_;
};

// A string argument (`fallback` when absent) that must be one of `choices`.
Status Choice(const Args& a, const std::string& name, const std::vector<std::string>& choices,
              const std::string& fallback, std::string* out) {
  *out = a.Text(name, fallback);
  if (std::find(choices.begin(), choices.end(), *out) != choices.end()) return Status::OK();
  std::string list;
  for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
  return Status::Error(name + " '" + *out + "' is not modelled (memsim supports " + list + ")");
}

// Megatron's --moe-layer-freq as memsim can model it: 1 (every layer has experts), or
// dense layers followed by MoE layers, "([0]*K+[1]*N)" or "[0,...,0,1,...,1]". Sets the
// number of leading dense layers.
Status ParseMoeLayerFreq(const std::string& text, int64_t num_layers, int64_t* dense) {
  std::string s;
  for (char c : text) {
    if (c != ' ') s += c;
  }
  if (s.size() >= 2 && s.front() == '(' && s.back() == ')') s = s.substr(1, s.size() - 2);
  const Status unsupported =
      Status::Error("--moe-layer-freq '" + text +
                    "' is not modelled (memsim models dense layers followed by MoE layers, e.g. "
                    "'([0]*3+[1]*" +
                    Str(std::max<int64_t>(num_layers - 3, 1)) + ")', or 1)");
  int64_t zeros = 0, ones = 0;
  // "[0]*K" or "[0]" (K = 1), "[1]*N": the count after "*", up to 9 digits.
  auto repeat = [](const std::string& part, char digit, int64_t* count) {
    const std::string head = std::string("[") + digit + "]";
    if (part.rfind(head, 0) != 0) return false;
    if (part == head) {
      *count = 1;
      return true;
    }
    const std::string tail = part.substr(head.size());
    if (tail.size() < 2 || tail.size() > 10 || tail[0] != '*' ||
        !std::all_of(tail.begin() + 1, tail.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return false;
    }
    *count = std::stoll(tail.substr(1));
    return true;
  };
  // "[0,...,0,1,...,1]" or "[1,...,1]", scanned without recursion (a list may be long).
  auto list = [&](const std::string& text_list) {
    if (text_list.size() < 3 || text_list.front() != '[' || text_list.back() != ']') return false;
    bool seen_one = false;
    for (size_t i = 1; i + 1 < text_list.size(); i += 2) {
      const char c = text_list[i];
      const char next = text_list[i + 1];
      if ((c != '0' && c != '1') || (next != ',' && i + 2 != text_list.size())) return false;
      if (c == '0' && seen_one) return false;  // dense layers come first
      seen_one = seen_one || c == '1';
      (c == '0' ? zeros : ones) += 1;
    }
    return true;
  };
  if (s == "1") return Status::OK();
  const size_t plus = s.find('+');
  const bool parsed = plus != std::string::npos ? repeat(s.substr(0, plus), '0', &zeros) &&
                                                      repeat(s.substr(plus + 1), '1', &ones)
                                                : repeat(s, '1', &ones) || list(s);
  if (!parsed) return unsupported;
  if (zeros + ones != num_layers) {
    return Status::Error("--moe-layer-freq '" + text + "' describes " + Str(zeros + ones) +
                         " layers, not --num-layers " + Str(num_layers));
  }
  *dense = zeros;
  return Status::OK();
}

Status Build(Args& a, int64_t world_size, MegatronArgsResult* out) {
  RunSpec& spec = out->spec;
  ModelConfig& m = spec.model;
  TrainingConfig& t = spec.training;
  ParallelLayout& l = spec.layout;
  m.name = "megatron";
  spec.model_source = "Megatron-LM arguments";

  for (const char* required : {"--num-layers", "--hidden-size", "--num-attention-heads",
                               "--seq-length", "--micro-batch-size"}) {
    if (!a.Has(required)) {
      return Status::Error(std::string("missing ") + required + " (Megatron-LM requires it)");
    }
  }
  // The vocabulary: --vocab-size, else what the tokenizer has. Of the tokenizers that
  // read files, memsim knows GPT2BPETokenizer's (GPT-2's vocab.json: 50,257 tokens),
  // pretrain_gpt.py's default.
  const std::string tokenizer = a.Text("--tokenizer-type", "GPT2BPETokenizer");
  const bool gpt2_vocabulary = tokenizer == "GPT2BPETokenizer";
  if (!a.Has("--vocab-size") && !a.Has("--padded-vocab-size") && !gpt2_vocabulary) {
    return Status::Error(
        "missing --vocab-size: memsim does not read tokenizer files (--tokenizer-type " +
        tokenizer + ")" + ", so give the vocabulary size (e.g. --vocab-size 128256 for Llama 3)");
  }

  // Model shape, with Megatron-LM's defaults.
  MEMSIM_RETURN_IF_ERROR(a.Int("--num-layers", &m.num_layers));
  MEMSIM_RETURN_IF_ERROR(a.Int("--hidden-size", &m.hidden_size));
  MEMSIM_RETURN_IF_ERROR(a.Int("--num-attention-heads", &m.num_attention_heads));
  m.activation = a.Has("--swiglu") ? ActivationKind::kSwiglu : ActivationKind::kGelu;
  // Megatron-LM's default FFN size: 4H, or for SwiGLU int(4H * 2/3 / 64) * 64 (rounded
  // down to a multiple of 64).
  m.ffn_hidden_size = m.activation == ActivationKind::kSwiglu
                          ? CheckedMul(m.hidden_size, 8) / 192 * 64
                          : CheckedMul(m.hidden_size, 4);
  MEMSIM_RETURN_IF_ERROR(a.Int("--ffn-hidden-size", &m.ffn_hidden_size));
  MEMSIM_RETURN_IF_ERROR(a.Int("--kv-channels", &m.kv_channels));
  if (a.Has("--group-query-attention")) {
    m.num_query_groups = 1;  // Megatron-LM's default
    MEMSIM_RETURN_IF_ERROR(a.Int("--num-query-groups", &m.num_query_groups));
  } else {
    a.Ignore("--num-query-groups");  // Megatron-LM reads it only with the flag
  }
  if (a.Has("--padded-vocab-size")) {
    // Megatron-LM takes it as is; a divisor of 1 keeps it (rounded up to a multiple of TP).
    MEMSIM_RETURN_IF_ERROR(a.Int("--padded-vocab-size", &m.vocab_size));
    m.make_vocab_size_divisible_by = 1;
    a.Ignore("--vocab-size");
    a.Ignore("--make-vocab-size-divisible-by");
  } else {
    if (gpt2_vocabulary && !a.Has("--vocab-size")) m.vocab_size = 50257;
    MEMSIM_RETURN_IF_ERROR(a.Int("--vocab-size", &m.vocab_size));
    m.make_vocab_size_divisible_by = 128;
    MEMSIM_RETURN_IF_ERROR(
        a.Int("--make-vocab-size-divisible-by", &m.make_vocab_size_divisible_by));
  }
  std::string text;
  MEMSIM_RETURN_IF_ERROR(
      Choice(a, "--normalization", {"LayerNorm", "RMSNorm"}, "LayerNorm", &text));
  m.norm = text == "RMSNorm" ? NormKind::kRmsNorm : NormKind::kLayerNorm;
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--position-embedding-type", {"learned_absolute", "rope"},
                                "learned_absolute", &text));
  m.position = text == "rope" || a.Has("--use-rotary-position-embeddings") ? PositionKind::kRope
                                                                           : PositionKind::kLearned;
  int64_t max_positions = 0;
  MEMSIM_RETURN_IF_ERROR(a.Int("--max-position-embeddings", &max_positions));
  if (m.position == PositionKind::kLearned) {
    m.max_position_embeddings = max_positions;
  } else {
    a.Ignore("--max-position-embeddings");  // RoPE allocates no position table
  }
  m.tie_embeddings = !a.Has("--untie-embeddings-and-output-weights");
  m.add_bias_linear = !a.Has("--disable-bias-linear");
  m.add_qkv_bias = m.add_bias_linear || a.Has("--add-qkv-bias");  // as Megatron-LM syncs them
  m.qk_layernorm = a.Has("--qk-layernorm");
  if (a.Has("--multi-latent-attention")) {
    // Megatron-LM's argument defaults (arguments.py): no q down projection (--q-lora-rank
    // None), kv_lora_rank 32, q/k heads 128 + 64 wide, v heads 128.
    m.kv_lora_rank = 32;
    m.qk_head_dim = 128;
    m.qk_pos_emb_head_dim = 64;
    m.v_head_dim = 128;
    MEMSIM_RETURN_IF_ERROR(a.Int("--q-lora-rank", &m.q_lora_rank));
    MEMSIM_RETURN_IF_ERROR(a.Int("--kv-lora-rank", &m.kv_lora_rank));
    MEMSIM_RETURN_IF_ERROR(a.Int("--qk-head-dim", &m.qk_head_dim));
    MEMSIM_RETURN_IF_ERROR(a.Int("--qk-pos-emb-head-dim", &m.qk_pos_emb_head_dim));
    MEMSIM_RETURN_IF_ERROR(a.Int("--v-head-dim", &m.v_head_dim));
    if (m.kv_lora_rank <= 0) return Status::Error("--kv-lora-rank must be positive");
  } else {
    for (const char* name : {"--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                             "--qk-pos-emb-head-dim", "--v-head-dim"}) {
      a.Ignore(name);
    }
  }
  m.hidden_dropout = m.attention_dropout = 0.1;
  MEMSIM_RETURN_IF_ERROR(a.Float("--hidden-dropout", &m.hidden_dropout));
  MEMSIM_RETURN_IF_ERROR(a.Float("--attention-dropout", &m.attention_dropout));

  // Mixture of experts (--num-experts 0 is dense, as in Megatron-LM).
  m.num_experts = 0;
  MEMSIM_RETURN_IF_ERROR(a.Int("--num-experts", &m.num_experts));
  const std::vector<std::string> moe_args = {"--moe-router-topk",
                                             "--moe-ffn-hidden-size",
                                             "--moe-layer-freq",
                                             "--moe-shared-expert-intermediate-size",
                                             "--moe-expert-capacity-factor",
                                             "--moe-token-dispatcher-type",
                                             "--moe-router-dtype",
                                             "--moe-aux-loss-coeff",
                                             "--moe-z-loss-coeff",
                                             "--moe-permute-fusion",
                                             "--expert-tensor-parallel-size"};
  t.moe_grouped_gemm = m.num_experts > 0 && a.Has("--moe-grouped-gemm");
  if (m.num_experts == 0) {
    for (const std::string& name : moe_args) a.Ignore(name);
    a.Ignore("--moe-grouped-gemm");
  } else {
    m.moe_router_topk = 2;
    MEMSIM_RETURN_IF_ERROR(a.Int("--moe-router-topk", &m.moe_router_topk));
    MEMSIM_RETURN_IF_ERROR(a.Int("--moe-ffn-hidden-size", &m.moe_ffn_hidden_size));
    MEMSIM_RETURN_IF_ERROR(
        a.Int("--moe-shared-expert-intermediate-size", &m.moe_shared_expert_size));
    MEMSIM_RETURN_IF_ERROR(a.Float("--moe-expert-capacity-factor", &m.moe_capacity_factor));
    if (a.Has("--moe-layer-freq")) {
      MEMSIM_RETURN_IF_ERROR(ParseMoeLayerFreq(a.Text("--moe-layer-freq", ""), m.num_layers,
                                               &m.moe_first_k_dense_layers));
    }
    MEMSIM_RETURN_IF_ERROR(
        Choice(a, "--moe-token-dispatcher-type", {"allgather", "alltoall"}, "allgather", &text));
    t.moe_dispatcher = text == "alltoall" ? MoeDispatcher::kAllToAll : MoeDispatcher::kAllGather;
    t.moe_permute_fusion = a.Has("--moe-permute-fusion");
    // The router's dtype: fp32 logits and probabilities, or (unset) the training dtype.
    MEMSIM_RETURN_IF_ERROR(Choice(a, "--moe-router-dtype", {"fp32", "none"}, "none", &text));
    m.moe_router_fp32 = text == "fp32";
    MEMSIM_RETURN_IF_ERROR(a.Float("--moe-aux-loss-coeff", &m.moe_aux_loss_coeff));
    MEMSIM_RETURN_IF_ERROR(a.Float("--moe-z-loss-coeff", &m.moe_z_loss_coeff));
    if (a.Has("--moe-router-load-balancing-type") &&
        a.Values("--moe-router-load-balancing-type") == std::vector<std::string>{"none"}) {
      m.moe_aux_loss_coeff = 0;  // no load-balancing loss is computed
    }
    MEMSIM_RETURN_IF_ERROR(a.Int("--expert-tensor-parallel-size", &l.etp));
  }

  // Batch, sequence and parallelism.
  MEMSIM_RETURN_IF_ERROR(a.Int("--seq-length", &t.seq_length));
  MEMSIM_RETURN_IF_ERROR(a.Int("--micro-batch-size", &t.micro_batch_size));
  l.world_size = world_size;
  MEMSIM_RETURN_IF_ERROR(a.Int("--tensor-model-parallel-size", &l.tp));
  MEMSIM_RETURN_IF_ERROR(a.Int("--pipeline-model-parallel-size", &l.pp));
  MEMSIM_RETURN_IF_ERROR(a.Int("--context-parallel-size", &l.cp));
  MEMSIM_RETURN_IF_ERROR(a.Int("--expert-model-parallel-size", &l.ep));
  for (auto [value, name] : {std::pair{world_size, "world size"},
                             {t.seq_length, "--seq-length"},
                             {t.micro_batch_size, "--micro-batch-size"},
                             {l.tp, "--tensor-model-parallel-size"},
                             {l.pp, "--pipeline-model-parallel-size"},
                             {l.cp, "--context-parallel-size"},
                             {l.ep, "--expert-model-parallel-size"}}) {
    if (value <= 0) {
      return Status::Error(std::string(name) + " must be positive, got " + Str(value));
    }
  }
  if (max_positions > 0 && max_positions < t.seq_length) {
    return Status::Error("--max-position-embeddings " + Str(max_positions) +
                         " is smaller than --seq-length " + Str(t.seq_length) +
                         " (Megatron-LM rejects it)");
  }
  if (l.cp > 1 && t.seq_length % (2 * l.cp) != 0) {
    return Status::Error("--seq-length " + Str(t.seq_length) + " must be a multiple of 2 x " +
                         "--context-parallel-size = " + Str(2 * l.cp) +
                         " (Megatron-LM requires it)");
  }
  if (a.Has("--cp-comm-type")) {
    for (const std::string& type : a.Values("--cp-comm-type")) {
      if (type != "p2p") {
        return NotModelled("--cp-comm-type " + type,
                           "context-parallel communication other than p2p");
      }
    }
    a.Ignore("--cp-comm-type");
  }
  l.sequence_parallel = a.Has("--sequence-parallel");

  // Pipeline stages: uneven first/last stages, or interleaved (virtual) stages.
  MEMSIM_RETURN_IF_ERROR(a.Int("--decoder-first-pipeline-num-layers", &l.first_stage_layers));
  MEMSIM_RETURN_IF_ERROR(a.Int("--decoder-last-pipeline-num-layers", &l.last_stage_layers));
  const bool uneven =
      a.Has("--decoder-first-pipeline-num-layers") || a.Has("--decoder-last-pipeline-num-layers");
  l.embedding_in_split = a.Has("--account-for-embedding-in-pipeline-split");
  l.loss_in_split = a.Has("--account-for-loss-in-pipeline-split");
  if (uneven && !(a.Has("--decoder-first-pipeline-num-layers") &&
                  a.Has("--decoder-last-pipeline-num-layers"))) {
    // Megatron-LM splits the rest evenly over the other stages, the unnamed end included.
    const int64_t given = l.first_stage_layers + l.last_stage_layers;
    if (l.pp < 2 || given < 0 || (m.num_layers - given) % (l.pp - 1) != 0) {
      return Status::Error("the " + Str(m.num_layers - given) +
                           " layers left by --decoder-first/last-pipeline-num-layers do not " +
                           "split evenly over the other " + Str(l.pp - 1) + " pipeline stages");
    }
    (a.Has("--decoder-first-pipeline-num-layers") ? l.last_stage_layers : l.first_stage_layers) =
        (m.num_layers - given) / (l.pp - 1);
  }
  if (a.Has("--num-layers-per-virtual-pipeline-stage") &&
      a.Has("--num-virtual-stages-per-pipeline-rank")) {
    return Status::Error(
        "give one of --num-layers-per-virtual-pipeline-stage and "
        "--num-virtual-stages-per-pipeline-rank (Megatron-LM rejects both)");
  }
  if (a.Has("--num-layers-per-virtual-pipeline-stage")) {
    int64_t per_chunk = 0;
    MEMSIM_RETURN_IF_ERROR(a.Int("--num-layers-per-virtual-pipeline-stage", &per_chunk));
    if (uneven) {
      return Status::Error(
          "--num-layers-per-virtual-pipeline-stage cannot be combined with uneven first/last "
          "pipeline stages (Megatron-LM asks for --num-virtual-stages-per-pipeline-rank)");
    }
    // The embedding and the loss count as layers when the split accounts for them.
    const int64_t split_layers =
        m.num_layers + (l.embedding_in_split ? 1 : 0) + (l.loss_in_split ? 1 : 0);
    if (per_chunk <= 0 || split_layers % l.pp != 0 || (split_layers / l.pp) % per_chunk != 0) {
      return Status::Error("--num-layers-per-virtual-pipeline-stage " + Str(per_chunk) +
                           " does not split the " + Str(split_layers) + " layers over " +
                           Str(l.pp) + " pipeline stages evenly; memsim does not model " +
                           "uneven virtual stages");
    }
    l.vpp = split_layers / l.pp / per_chunk;
  }
  MEMSIM_RETURN_IF_ERROR(a.Int("--num-virtual-stages-per-pipeline-rank", &l.vpp));
  MEMSIM_RETURN_IF_ERROR(
      a.Int("--microbatch-group-size-per-virtual-pipeline-stage", &l.microbatch_group_size));
  if (l.vpp == 1) a.Ignore("--microbatch-group-size-per-virtual-pipeline-stage");

  // Data parallelism and the microbatches of one iteration.
  if (a.Has("--use-distributed-optimizer")) {
    l.data_parallel = DataParallelKind::kDistributedOptimizer;
  }
  MEMSIM_RETURN_IF_ERROR(
      a.Int("--num-distributed-optimizer-instances", &l.distributed_optimizer_instances));
  if (a.Text("--data-parallel-sharding-strategy", "no_shard") != "no_shard") {
    return NotModelled("--data-parallel-sharding-strategy", "FSDP");
  }
  a.Ignore("--data-parallel-sharding-strategy");
  const int64_t model_parallel = CheckedMul(CheckedMul(l.tp, l.pp), l.cp);
  if (world_size % model_parallel != 0) {
    return Status::Error("world size " + Str(world_size) +
                         " is not a multiple of TP*PP*CP = " + Str(l.tp) + "*" + Str(l.pp) + "*" +
                         Str(l.cp) + " = " + Str(model_parallel));
  }
  const int64_t dp = world_size / model_parallel;
  const int64_t samples_per_microbatch = CheckedMul(t.micro_batch_size, dp);
  spec.global_batch_size = samples_per_microbatch;  // Megatron-LM's default
  MEMSIM_RETURN_IF_ERROR(a.Int("--global-batch-size", &spec.global_batch_size));
  if (spec.global_batch_size <= 0 || spec.global_batch_size % samples_per_microbatch != 0) {
    return Status::Error("--global-batch-size " + Str(spec.global_batch_size) +
                         " is not a positive multiple of --micro-batch-size " +
                         Str(t.micro_batch_size) + " x data-parallel size " + Str(dp) + " = " +
                         Str(samples_per_microbatch));
  }
  t.num_microbatches = spec.global_batch_size / samples_per_microbatch;

  // Precision and the optimizer's state.
  if (a.Has("--bf16") && a.Has("--fp16")) {
    return Status::Error("--bf16 and --fp16 exclude each other");
  }
  t.precision = a.Has("--bf16")   ? Precision::kBf16
                : a.Has("--fp16") ? Precision::kFp16
                                  : Precision::kFp32;
  if (a.Has("--accumulate-allreduce-grads-in-fp32")) {
    // bf16 and fp32 gradients are fp32 already; fp16 ones would change dtype.
    if (t.precision == Precision::kFp16) {
      return NotModelled("--accumulate-allreduce-grads-in-fp32", "fp32 gradients in fp16 training");
    }
    a.Ignore("--accumulate-allreduce-grads-in-fp32");
  }
  for (const char* name :
       {"--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"}) {
    if (a.Text(name, "fp32") != "fp32") return NotModelled(name, "low-precision optimizer states");
    a.Ignore(name);
  }
  t.gradient_accumulation_fusion = !a.Has("--no-gradient-accumulation-fusion");
  t.defer_embedding_wgrad = a.Has("--defer-embedding-wgrad-compute");
  MEMSIM_RETURN_IF_ERROR(a.Int("--wgrad-deferral-limit", &t.wgrad_deferral_limit));
  if (!t.defer_embedding_wgrad) a.Ignore("--wgrad-deferral-limit");
  // The native fused cross-entropy (megatron/core/fusions/fused_cross_entropy.py) is
  // modelled (VocabCrossEntropy); TE's (a kernel over the 16-bit logits) is not.
  if (a.Has("--cross-entropy-loss-fusion")) {
    MEMSIM_RETURN_IF_ERROR(
        Choice(a, "--cross-entropy-fusion-impl", {"native", "te"}, "native", &text));
    if (text == "te") {
      return NotModelled("--cross-entropy-fusion-impl te",
                         "Transformer Engine's cross-entropy kernel");
    }
    t.cross_entropy_fusion = true;
  }
  a.Ignore("--cross-entropy-fusion-impl");
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--optimizer", {"adam", "sgd"}, "adam", &text));
  t.optimizer = text == "sgd" ? OptimizerKind::kSgd : OptimizerKind::kAdam;

  // Kernels: Transformer Engine (Megatron-LM's default) picks its attention backend per
  // GPU from the backends allowed (--attention-backend sets NVTE_FLASH_ATTN,
  // NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN; "auto" leaves the environment's); "local"
  // swaps in Megatron's own unfused DotProductAttention. The local implementation is
  // unfused unless --use-flash-attn.
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--transformer-impl", {"local", "transformer_engine"},
                                "transformer_engine", &text));
  const bool local = text == "local";
  t.profile = local ? ProfileKind::kMegatronLocal : ProfileKind::kTransformerEngine;
  std::string backend;
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--attention-backend",
                                {"auto", "flash", "fused", "unfused", "local"}, "auto", &backend));
  if (local) {
    t.attention = a.Has("--use-flash-attn") ? AttentionKind::kFlash : AttentionKind::kEager;
    a.Ignore("--attention-backend");
  } else if (backend == "local") {
    t.attention = AttentionKind::kEager;
    a.Ignore("--use-flash-attn");
  } else {
    TeAttentionChoice choice;
    if (backend != "auto") {
      choice.flash = backend == "flash";
      choice.fused = backend == "fused";
      choice.unfused = backend == "unfused";
    }
    t.te_attention = choice;
    a.Ignore("--use-flash-attn");
  }
  // --deterministic-mode sets NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 and, unless the
  // environment has one, CUBLAS_WORKSPACE_CONFIG=:4096:8 (megatron/training/determinism.py).
  if (a.Has("--deterministic-mode")) {
    if (t.te_attention) t.te_attention->deterministic = true;
    t.cublas_workspace_bytes = 4096 * 1024 * 8;
  }

  // Recomputation, with Megatron-LM's rules.
  std::string granularity = "none";
  if (a.Has("--recompute-activations")) {
    granularity = "selective";  // Megatron-LM lets it override --recompute-granularity
    a.Ignore("--recompute-granularity");
  } else if (a.Has("--recompute-granularity")) {
    MEMSIM_RETURN_IF_ERROR(
        Choice(a, "--recompute-granularity", {"full", "selective"}, "", &granularity));
  }
  t.recompute = granularity == "full"        ? RecomputeKind::kFull
                : granularity == "selective" ? RecomputeKind::kSelective
                                             : RecomputeKind::kNone;
  if (t.recompute == RecomputeKind::kFull) {
    if (!a.Has("--recompute-method") || !a.Has("--recompute-num-layers")) {
      return Status::Error(
          "--recompute-granularity full needs --recompute-method (uniform or block) and "
          "--recompute-num-layers (Megatron-LM requires both)");
    }
    MEMSIM_RETURN_IF_ERROR(Choice(a, "--recompute-method", {"uniform", "block"}, "", &text));
    t.recompute_method = text == "block" ? RecomputeMethod::kBlock : RecomputeMethod::kUniform;
    MEMSIM_RETURN_IF_ERROR(a.Int("--recompute-num-layers", &t.recompute_num_layers));
  } else if (a.Has("--recompute-method") || a.Has("--recompute-num-layers")) {
    return Status::Error(
        "--recompute-method and --recompute-num-layers need --recompute-granularity full "
        "(Megatron-LM rejects them otherwise)");
  }
  if (a.Has("--recompute-modules")) {
    const std::vector<std::string>& modules = a.Values("--recompute-modules");
    if (modules != std::vector<std::string>{"core_attn"}) {
      return NotModelled("--recompute-modules",
                         "selective recomputation of modules other than core_attn");
    }
    a.Ignore("--recompute-modules");  // memsim's selective recomputation is core_attn's
  }

  // Memory management that memsim models only when off.
  for (auto [name, what] :
       {std::pair{"--cpu-offloading-num-layers", "activation offloading to CPU"},
        {"--empty-unused-memory-level", "emptying the CUDA cache"}}) {
    if (a.Text(name, "0") != "0") return NotModelled(name, what);
    a.Ignore(name);
  }
  if (a.Text("--cuda-graph-impl", "none") != "none") {
    return NotModelled("--cuda-graph-impl", "CUDA graphs");
  }
  for (const char* name : {"--cuda-graph-impl", "--cuda-graph-modules", "--cuda-graph-scope",
                           "--cuda-graph-warmup-steps"}) {
    a.Ignore(name);
  }
  return Status::OK();
}

// Environment variables of a launch. Modelled ones change what the CUDA libraries
// allocate or which attention kernel runs; neutral ones tune communication, logging and
// kernel scheduling without changing any tensor's size.
const std::set<std::string>& ModelledEnv() {
  static const auto* names = new std::set<std::string>{
      "CUBLAS_WORKSPACE_CONFIG", "NVTE_FLASH_ATTN",         "NVTE_FUSED_ATTN",
      "NVTE_UNFUSED_ATTN",       "PYTORCH_CUDA_ALLOC_CONF", "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
  };
  return *names;
}

const std::set<std::string>& NeutralEnv() {
  static const auto* names = new std::set<std::string>{
      "CUDA_DEVICE_MAX_CONNECTIONS",  // stream scheduling
      "NCCL_ALGO",
      "NCCL_DEBUG",
      "NCCL_NVLS_ENABLE",
      "NON_DETERMINSTIC_RESULTS",  // the functional tests' own switches, as they spell them
      "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE",
      "NVTE_BWD_LAYERNORM_SM_MARGIN",  // SMs left free for communication
      "NVTE_FWD_LAYERNORM_SM_MARGIN",
      "NVTE_CPU_OFFLOAD_V1",  // selects an offloading implementation; offloading is refused
      "N_REPEAT",
      "N_REPEATS",
      "PYTHONWARNINGS",
      "SKIP_PYTEST",
      "THROUGHPUT_START_STEP",
  };
  return *names;
}

Status ApplyEnvironment(const std::map<std::string, std::string>& env, const Args& a,
                        MegatronArgsResult* out) {
  TrainingConfig& t = out->spec.training;
  for (const auto& [name, value] : env) {
    if (NeutralEnv().count(name)) {
      out->ignored.push_back(name);
    } else if (!ModelledEnv().count(name)) {
      return Status::Error("unknown environment variable " + name +
                           "; if it does not change memory, leave it out of the environment "
                           "given to memsim");
    }
  }
  auto get = [&env](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  if (env.count("CUBLAS_WORKSPACE_CONFIG")) {
    MEMSIM_RETURN_IF_ERROR(
        ParseCublasWorkspaceConfig(get("CUBLAS_WORKSPACE_CONFIG"), &t.cublas_workspace_bytes));
  }
  if (const std::string conf = get("PYTORCH_CUDA_ALLOC_CONF"); !conf.empty()) {
    // expandable_segments maps segments in pages and changes reserved memory, not the
    // blocks handed out; other settings change how blocks are split and cached.
    if (conf != "expandable_segments:True") {
      return Status::Error("PYTORCH_CUDA_ALLOC_CONF '" + conf +
                           "' is not modelled (memsim models the default allocator and "
                           "expandable_segments:True); drop it to simulate without it");
    }
    out->ignored.push_back("PYTORCH_CUDA_ALLOC_CONF");
  }
  if (t.te_attention) {
    // Explicit backends come from --attention-backend, which overrides these.
    if (a.Text("--attention-backend", "auto") == "auto") {
      t.te_attention->flash = get("NVTE_FLASH_ATTN") != "0";
      t.te_attention->fused = get("NVTE_FUSED_ATTN") != "0";
      t.te_attention->unfused = get("NVTE_UNFUSED_ATTN") != "0";
    }
    if (get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0") t.te_attention->deterministic = true;
  }
  return Status::OK();
}

}  // namespace

const std::map<std::string, std::string>& UnmodelledMegatronArgs() { return UnmodelledArgs(); }

std::vector<std::string> ModelledEnvNames() { return {ModelledEnv().begin(), ModelledEnv().end()}; }

Status ParseMegatronArgs(const std::vector<std::string>& args,
                         const std::map<std::string, std::string>& env, int64_t world_size,
                         MegatronArgsResult* out) {
  Args parsed;
  MEMSIM_RETURN_IF_ERROR(parsed.Parse(args));
  MegatronArgsResult result;
  try {
    MEMSIM_RETURN_IF_ERROR(Build(parsed, world_size, &result));
    MEMSIM_RETURN_IF_ERROR(ApplyEnvironment(env, parsed, &result));
  } catch (const std::overflow_error&) {
    return Status::Error("the Megatron-LM arguments give sizes too large for 64-bit counts");
  }
  std::vector<std::string> ignored = parsed.Ignored();
  ignored.insert(ignored.end(), result.ignored.begin(), result.ignored.end());
  result.ignored = std::move(ignored);
  *out = std::move(result);
  return Status::OK();
}

}  // namespace memsim
