// Note [Pipeline layout]: Megatron-Core's layout strings, unrolled and placed as its
// PipelineParallelLayerLayout does, worked out by hand.
#include "parallel/layout.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/test_models.h"

namespace memsim {
namespace {

ModelConfig Layers(int64_t layers, int64_t mtp_layers = 0) {
  ModelConfig m = test::Llama(layers, 64, 4, 4, 128, 1000);
  m.mtp_num_layers = mtp_layers;
  EXPECT_TRUE(FinalizeModelConfig(&m).ok());
  return m;
}

// The layers per segment ParsePipelineLayout finds, or its error.
std::vector<int64_t> Parse(const std::string& text, int64_t pp, const ModelConfig& m) {
  std::vector<int64_t> layers;
  const Status s = ParsePipelineLayout(text, pp, m, &layers);
  EXPECT_TRUE(s.ok()) << s.message();
  return layers;
}

std::string ErrorOf(const std::string& text, int64_t pp, const ModelConfig& m) {
  std::vector<int64_t> layers;
  return ParsePipelineLayout(text, pp, m, &layers).message();
}

// The error for a layout whose embedding, loss or MTP layers memsim cannot place.
std::string Misplaced(const std::string& text) {
  return "pipeline layout '" + text +
         "' must hold the embedding in the first stage's first chunk and the loss and MTP "
         "layers in the last stage's last chunk (memsim does not model other placements)";
}

// Megatron-LM's functional test gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_*_fine_grained_offloading:
// "Et*3|(tt|)*6L" on PP 2 unrolls to Ettt|tt|tt|tt|tt|tt|tt|L, 8 segments: VPP 4, segment
// i is chunk i / 2 of stage i % 2, and the last chunk of stage 1 holds only the loss.
TEST(PipelineLayout, MegatronCiLayoutSetsVppAndPlacesEveryLayer) {
  const ModelConfig m = Layers(15);
  ParallelLayout l;
  l.world_size = 2;
  l.pp = 2;
  l.pipeline_layout = "Et*3|(tt|)*6L";
  ASSERT_TRUE(FinalizeLayout(&l, m).ok());
  EXPECT_EQ(l.vpp, 4);
  const int64_t layers[2][4] = {{3, 2, 2, 2}, {2, 2, 2, 0}};
  const int64_t first[2][4] = {{0, 5, 9, 13}, {3, 7, 11, 15}};
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t c = 0; c < 4; ++c) {
      EXPECT_EQ(LayersOnStage(l, m, r, c), layers[r][c]) << r << "," << c;
      EXPECT_EQ(FirstLayerOfStage(l, m, r, c), first[r][c]) << r << "," << c;
    }
  }
  // The same with an MTP layer beside the loss (scoped_cudagraph's "Et|(tt|)*6mL" on 13).
  EXPECT_EQ(Parse("Et|(tt|)*6mL", 2, Layers(13, 1)),
            (std::vector<int64_t>{1, 2, 2, 2, 2, 2, 2, 0}));
}

// parse_str_to_list's docstring examples, with layers for letters: groups first ("(|ab)*2,cd"
// is "|ab|abcd"), then single characters ("x*n"), commas dropped.
TEST(PipelineLayout, UnrollsAsMegatronDoes) {
  EXPECT_EQ(Parse("Et(|tt)*2,tL", 3, Layers(6)), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(Parse("(Et*2|)*1tL", 2, Layers(3)), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(Parse("E,t*3|t*2,(t|)*2tL", 4, Layers(8)), (std::vector<int64_t>{3, 3, 1, 1}));
  EXPECT_EQ(Parse("Et(t)*0|tL", 2, Layers(2)), (std::vector<int64_t>{1, 1}));
}

TEST(PipelineLayout, ReportsWhatIsWrong) {
  EXPECT_EQ(ErrorOf("Et|tX|L", 3, Layers(2)),
            "pipeline layout 'Et|tX|L': invalid layer character 'X' (known: E embedding, t "
            "decoder layer, m MTP layer, L loss; | separates stages)");
  EXPECT_EQ(ErrorOf("Et|t|tL", 2, Layers(3)),
            "pipeline layout 'Et|t|tL' has 3 stages, not a multiple of PP=2");
  EXPECT_EQ(ErrorOf("Ett|tL", 2, Layers(4)),
            "pipeline layout 'Ett|tL' has 3 decoder layers t, not the model's 4");
  EXPECT_EQ(ErrorOf("tE|tL", 2, Layers(2)),
            "pipeline layout 'tE|tL' needs one embedding E first and one loss L last");
  EXPECT_EQ(ErrorOf("Et|tL", 2, Layers(2, 1)),
            "pipeline layout 'Et|tL' has 0 MTP layers m, not --mtp-num-layers 1");
  // Megatron accepts an empty last segment (the loss is still last in layer order); memsim's
  // model builds the loss in the last stage's last chunk.
  EXPECT_EQ(ErrorOf("Et|tL|", 3, Layers(2)), Misplaced("Et|tL|"));
  EXPECT_EQ(ErrorOf("Et|mt|t|L", 2, Layers(3, 1)),
            "pipeline layout 'Et|mt|t|L' places decoder layers after MTP layers");
  // Megatron's own example: a standalone MTP stage before the loss's.
  EXPECT_EQ(ErrorOf("Ettt|(tt|)*29,m|L", 1, Layers(61, 1)), Misplaced("Ettt|(tt|)*29,m|L"));
  EXPECT_EQ(ErrorOf("E(t|)*99999999999L", 1, Layers(2)),
            "pipeline layout 'E(t|)*99999999999L' expands to more than 4194304 characters");
  // More MTP layers than the loss's chunk holds (Megatron wants them in one chunk too),
  // more chunks than layers need, a line break echoed as one.
  EXPECT_EQ(ErrorOf("Ett|tm|mL", 3, Layers(3, 2)), Misplaced("Ett|tm|mL"));
  EXPECT_EQ(ErrorOf("E(|)*9tL", 2, Layers(1)),
            "pipeline layout 'E(|)*9tL' has 5 chunks per stage, more than the 1 layers + 2 need");
  EXPECT_EQ(ErrorOf("Et|\ntL", 2, Layers(2)),
            "pipeline layout 'Et|\\x0atL': invalid layer character '\\x0a' (known: E embedding, t "
            "decoder layer, m MTP layer, L loss; | separates stages)");
  // A million unclosed '(' is one pass, not a million searches to the end, and the error
  // quotes only the layout's start.
  const std::string unclosed = ErrorOf("E" + std::string(1000000, '(') + "tL", 1, Layers(1));
  EXPECT_EQ(unclosed, "pipeline layout 'E" + std::string(59, '(') +
                          "...': invalid layer character '(' (known: E embedding, t decoder "
                          "layer, m MTP layer, L loss; | separates stages)");

  const ModelConfig m = Layers(15);
  ParallelLayout l;
  l.world_size = 2;
  l.pp = 2;
  l.vpp = 2;
  l.pipeline_layout = "Et*3|(tt|)*6L";
  EXPECT_EQ(FinalizeLayout(&l, m).message(),
            "VPP=2 disagrees with the pipeline layout's 4 chunks per stage; leave VPP out");
  l.vpp = 1;
  l.loss_in_split = true;
  EXPECT_NE(FinalizeLayout(&l, m).message().find("cannot be combined"), std::string::npos);
}

// Uneven first/last stages (FinalizeUnevenStages in layout.cc). Expected layers and offsets
// from Megatron-Core 0.20's get_num_layers_to_build and get_transformer_layer_offset by hand.
ParallelLayout Uneven(int64_t pp, int64_t vpp, int64_t first, int64_t last) {
  ParallelLayout l;
  l.world_size = pp;
  l.pp = pp;
  l.vpp = vpp;
  l.first_stage_layers = first;
  l.last_stage_layers = last;
  return l;
}

TEST(UnevenStages, VirtualStagesSplitEachStageEvenly) {
  // 26 layers, PP 4, VPP 2, first 4, last 6: the middle stages hold 16 / 2 = 8 each, so a
  // chunk holds 2, 4, 4, 3 layers; a round of chunks 2 + 16/2 + 3 = 13 layers, and Megatron's
  // offset is c * 13 on stage 0, c * 13 + 2 + (r - 1) * 4 on stage r > 0.
  const ModelConfig m = Layers(26);
  ParallelLayout l = Uneven(4, 2, 4, 6);
  ASSERT_TRUE(FinalizeLayout(&l, m).ok());
  const int64_t layers[4] = {2, 4, 4, 3};
  const int64_t first[4][2] = {{0, 13}, {2, 15}, {6, 19}, {10, 23}};
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t c = 0; c < 2; ++c) {
      EXPECT_EQ(LayersOnStage(l, m, r, c), layers[r]) << r << "," << c;
      EXPECT_EQ(FirstLayerOfStage(l, m, r, c), first[r][c]) << r << "," << c;
    }
  }
}

TEST(UnevenStages, OneNamedEndLeavesTheOtherTheMiddleShare) {
  // 14 layers, PP 4, VPP 2, only the last stage named (2): the other three stages hold
  // 12 / 3 = 4, so the first stage gets 4; chunks of 2, 2, 2, 1; Megatron's offsets (no first
  // stage named: middle rank = r) c * 7 + r * 2.
  const ModelConfig m = Layers(14);
  ParallelLayout l = Uneven(4, 2, 0, 2);
  ASSERT_TRUE(FinalizeLayout(&l, m).ok());
  EXPECT_EQ(l.first_stage_layers, 4);
  EXPECT_EQ(l.last_stage_layers, 2);
  const int64_t layers[4] = {2, 2, 2, 1};
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t c = 0; c < 2; ++c) {
      EXPECT_EQ(LayersOnStage(l, m, r, c), layers[r]) << r << "," << c;
      EXPECT_EQ(FirstLayerOfStage(l, m, r, c), c * 7 + r * 2) << r << "," << c;
    }
  }
  // Only the first stage named, without VPP: 30 layers, 3 on the first, 27 / 3 on the rest.
  const ModelConfig m30 = Layers(30);
  l = Uneven(4, 1, 3, 0);
  ASSERT_TRUE(FinalizeLayout(&l, m30).ok());
  EXPECT_EQ(l.last_stage_layers, 9);
  EXPECT_EQ(FirstLayerOfStage(l, m30, 3, 0), 21);
}

TEST(UnevenStages, ReportsWhatDoesNotSplit) {
  auto check = [](ParallelLayout l, int64_t layers) {
    return FinalizeLayout(&l, Layers(layers)).message();
  };
  EXPECT_EQ(check(Uneven(4, 2, 3, 0), 27),
            "the first stage's 3 layers do not split over VPP=2 virtual stages (Megatron-Core "
            "requires it)");
  EXPECT_EQ(check(Uneven(4, 2, 4, 4), 26),
            "the middle stage's 9 layers do not split over VPP=2 virtual stages (Megatron-Core "
            "requires it)");
  EXPECT_EQ(check(Uneven(2, 1, 3, 3), 8),
            "the first stage's 3 and the last stage's 3 leave 2 of 8 layers with no other stage "
            "to hold them (PP=2)");
  EXPECT_EQ(check(Uneven(3, 1, 4, 4), 8),
            "the first stage's 4 and the last stage's 4 take all 8 layers, leaving none for the "
            "other 1 stages (Megatron-Core needs both or neither)");
  EXPECT_EQ(check(Uneven(4, 1, 5, 0), 30),
            "the 25 of 30 layers left by the first stage's 5 do not split evenly over the other "
            "3 pipeline stages");
  EXPECT_EQ(check(Uneven(4, 1, 3, 3), 5),
            "the first stage's 3 and the last stage's 3 layers are more than the model's 5");
  EXPECT_EQ(check(Uneven(1, 1, 5, 0), 30), "uneven first/last stage layers need PP >= 2");
}

}  // namespace
}  // namespace memsim
