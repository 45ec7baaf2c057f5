#include "simulator/op_traits.h"

#include <mutex>
#include <unordered_map>

namespace memsim {
namespace {

struct Registry {
  std::mutex mutex;
  // Node-based: pointers to values survive later insertions.
  std::unordered_map<std::string, OpTraits> traits;
};

Registry& TheRegistry() {
  static auto* registry = new Registry();  // never destroyed: used until process exit
  return *registry;
}

}  // namespace

void RegisterOpTraits(const std::string& name, const OpTraits& traits) {
  Registry& registry = TheRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.traits[name] = traits;
}

const OpTraits* FindOpTraits(const std::string& name) {
  Registry& registry = TheRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto it = registry.traits.find(name);
  return it == registry.traits.end() ? nullptr : &it->second;
}

}  // namespace memsim
