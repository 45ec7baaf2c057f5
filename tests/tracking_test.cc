#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "simulator/session.h"

namespace memsim {
namespace {

std::vector<std::pair<bool, int64_t>> EventSizes(const Recorder& r) {
  std::vector<std::pair<bool, int64_t>> out;
  for (const MemoryEvent& e : r.events()) {
    out.emplace_back(e.is_alloc, r.storages()[e.storage_id].size_bytes);
  }
  return out;
}

TEST(Tracking, EmptyAddAndFree) {
  Session session;
  {
    ActiveSession active(session);
    at::Tensor a = at::empty({4, 8}, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
    at::Tensor b = a.view({32});  // a view allocates nothing
    at::Tensor c = a + 1;         // 4*8*4 = 128 bytes
  }
  // a: 128 alloc, c: 128 alloc; destruction in reverse order: c, then a (b shares a).
  std::vector<std::pair<bool, int64_t>> expected = {
      {true, 128}, {true, 128}, {false, 128}, {false, 128}};
  EXPECT_EQ(EventSizes(session.recorder()), expected);
  EXPECT_EQ(session.recorder().names().Name(session.recorder().storages()[1].op), "aten::add.Tensor");
}

}  // namespace
}  // namespace memsim
