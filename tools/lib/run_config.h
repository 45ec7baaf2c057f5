// How a simulation run (parallel/run_spec.h) is read from YAML: model presets
// (configs/models/NAME.yaml) and run files (configs/runs/*.yaml).
//
// Every key is checked: an unknown key, a value of the wrong type or an impossible value
// is an error naming the file, the line and the key.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "models/model_config.h"
#include "parallel/layout.h"
#include "parallel/run_spec.h"
#include "simulator/cost_model.h"
#include "simulator/status.h"

namespace memsim {

// The folder holding models/ and runs/: $MEMSIM_CONFIG_DIR, else the source tree's.
std::string ConfigDir();
std::vector<std::string> ModelPresetNames();

// Reads configs/models/NAME.yaml.
Status LoadModelPreset(const std::string& name, ModelConfig* model);
// Applies the keys of a model mapping (optionally `base: PRESET` first).
Status ApplyModelYaml(const YAML::Node& node, const std::string& source, ModelConfig* model);
// `global_batch_size` receives training.global_batch_size when the file sets it.
Status ApplyTrainingYaml(const YAML::Node& node, const std::string& source,
                         TrainingConfig* training, int64_t* global_batch_size);
// Reads a run file; `spec` keeps its defaults for keys the file leaves out.
Status LoadRunFile(const std::string& path, RunSpec* spec);
// The built-in default example (configs/runs/default.yaml).
Status LoadDefaultRun(RunSpec* spec);

// Parses enum values as the YAML files and command line spell them (the tables of Note
// [Enum names], beside each enum).
Status ParsePrecision(const std::string& text, Precision* out);
Status ParseActivation(const std::string& text, ActivationKind* out);
Status ParseSoftmax(const std::string& text, SoftmaxKind* out);
Status ParseAttention(const std::string& text, AttentionKind* out);
Status ParseRecompute(const std::string& text, RecomputeKind* out);
Status ParseFp8Recipe(const std::string& text, Fp8Recipe* out);
Status ParseRecomputeMethod(const std::string& text, RecomputeMethod* out);
// Recompute module names ("core_attn", "mlp"; none for none) as RecomputeModuleBit()s.
Status ParseRecomputeModules(const std::vector<std::string>& names, uint32_t* out);
// Megatron's --offload-modules names into OffloadModuleBit()s.
Status ParseOffloadModules(const std::vector<std::string>& names, uint32_t* out);
// Megatron's --cuda-graph-modules names into CudaGraphModuleBit()s.
Status ParseCudaGraphModules(const std::vector<std::string>& names, uint32_t* out);
Status ParseOptimizer(const std::string& text, OptimizerKind* out);
Status ParseProfile(const std::string& text, ProfileKind* out);
Status ParseGpu(const std::string& text, const GpuSpec** out);
Status ParseDataParallel(const std::string& text, DataParallelKind* out);
Status ApplyLayoutYaml(const YAML::Node& node, const std::string& source, ParallelLayout* layout);

}  // namespace memsim
