// PyTorch's cuBLAS workspaces against a GPU: ops/testdata/h200_torch2.11_workspaces.json
// holds the blocks an H200 with PyTorch 2.11 allocated at each GEMM of a probe
// (tools/gpu/measure.py workspaces): one per (thread, stream) pair at its first GEMM, of
// the size CUBLAS_WORKSPACE_CONFIG gives, and a second one when autograd's backward thread
// runs its first GEMM (Note [Library workspaces]).
#include "ops/library_workspaces.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace memsim {
namespace {

nlohmann::json Runs() {
  std::ifstream in("ops/testdata/h200_torch2.11_workspaces.json");
  return nlohmann::json::parse(in)["runs"];
}

// The blocks step `label` of probe `run` left allocated.
std::vector<int64_t> NewBlocks(const nlohmann::json& runs, const std::string& run,
                               const std::string& label) {
  for (const nlohmann::json& step : runs.at(run)) {
    if (step["step"] == label) return step["new_blocks"].get<std::vector<int64_t>>();
  }
  throw std::runtime_error("no step " + label);
}

TEST(LibraryWorkspaces, SizesMatchTheGpu) {
  const nlohmann::json runs = Runs();
  const int64_t output_bytes = 1024 * 1024 * 2;  // the probe's bf16 [1024, 1024] product
  const GpuSpec& h200 = *FindGpu("H200-141GB");
  EXPECT_EQ(NewBlocks(runs, "default", "first bf16 mm, main thread"),
            (std::vector<int64_t>{output_bytes, DefaultCublasWorkspaceBytes(h200)}));
  int64_t configured = 0;
  ASSERT_TRUE(ParseCublasWorkspaceConfig(":4096:2:16:8", &configured).ok());
  EXPECT_EQ(NewBlocks(runs, "CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8", "first bf16 mm, main thread"),
            (std::vector<int64_t>{output_bytes, configured}));
  ASSERT_TRUE(ParseCublasWorkspaceConfig(":4096:8", &configured).ok());
  EXPECT_EQ(NewBlocks(runs, "CUBLAS_WORKSPACE_CONFIG=:4096:8", "first bf16 mm, main thread"),
            (std::vector<int64_t>{output_bytes, configured}));
}

TEST(LibraryWorkspaces, GpuMakesOnePerThreadAndStreamAsTheNoteSays) {
  const nlohmann::json runs = Runs();
  const int64_t workspace = DefaultCublasWorkspaceBytes(*FindGpu("H200-141GB"));
  const int64_t output_bytes = 1024 * 1024 * 2;
  EXPECT_EQ(NewBlocks(runs, "default", "second bf16 mm, main thread"),
            (std::vector<int64_t>{output_bytes}));
  EXPECT_EQ(NewBlocks(runs, "default", "bf16 mm on a second stream, main thread"),
            (std::vector<int64_t>{output_bytes, workspace}));
  EXPECT_EQ(NewBlocks(runs, "default", "bf16 mm in a new thread"),
            (std::vector<int64_t>{output_bytes, workspace}));
  // x [256, 1024] @ w [1024, 1024] in bf16: the forward keeps its output and the main
  // thread's workspace; the backward frees the output (x's gradient of the same size takes
  // its place in the count) and adds w's gradient and its own thread's workspace.
  EXPECT_EQ(NewBlocks(runs, "training step", "forward x @ w, main thread"),
            (std::vector<int64_t>{256 * 1024 * 2, workspace}));
  EXPECT_EQ(NewBlocks(runs, "training step", "backward of it (autograd's device thread)"),
            (std::vector<int64_t>{1024 * 1024 * 2, workspace}));
}

}  // namespace
}  // namespace memsim
