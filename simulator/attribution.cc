#include "simulator/attribution.h"

namespace memsim {

std::string_view PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kSetup:
      return "setup";
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kOptimizer:
      return "optimizer";
  }
  return "unknown";
}

std::string_view CategoryName(Category category) {
  switch (category) {
    case Category::kUnattributed:
      return "unattributed";
    case Category::kParameter:
      return "parameters";
    case Category::kGradient:
      return "gradients";
    case Category::kOptimizerState:
      return "optimizer_state";
    case Category::kActivation:
      return "activations";
    case Category::kTemporary:
      return "temporaries";
    case Category::kCommunication:
      return "communication";
    case Category::kWorkspace:
      return "workspaces";
  }
  return "unknown";
}

}  // namespace memsim
