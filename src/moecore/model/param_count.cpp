#include "moecore/model/param_count.h"

#include <cstdio>

#include "moecore/core/error.h"
#include "moecore/model/gpt.h"
#include "moecore/model/params.h"

namespace moecore {

namespace {
bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// The part a parameter belongs to, from its Megatron-Core name (model/gpt.h).
const char* part_of(const Param& p) {
  const std::string& n = p.name;
  if (n.rfind("mtp.", 0) == 0) return "mtp";  // every weight of the MTP modules (model/mtp.h)
  if (p.expert) return "routed_experts";
  if (contains(n, "embedding.")) return "embedding";
  if (contains(n, "output_layer.")) return "output_layer";
  if (contains(n, ".self_attention.")) return "attention";  // q/k/v/proj and the QK-layernorms
  if (contains(n, "layernorm")) return "norms";              // input, pre-MLP and final norms
  if (contains(n, ".router.")) return "router";
  if (contains(n, ".shared_experts.")) return "shared_experts";
  if (contains(n, ".mlp.")) return "dense_mlp";
  MC_FAIL("count_parameters: parameter '", n, "' belongs to no known part");
}
}  // namespace

int64_t ParamCount::part(const std::string& name) const {
  for (const auto& [k, v] : parts)
    if (k == name) return v;
  MC_FAIL("ParamCount: no part named '", name, "'");
}

ParamCount count_parameters(const ModelConfig& cfg) {
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 0);
  store.set_shapes_only(true);
  const GPTModel model(cfg, store);  // one rank, every layer: registers the whole model
  ParamCount c;
  for (const char* name : {"embedding", "attention", "norms", "router", "routed_experts", "shared_experts", "dense_mlp",
                           "output_layer", "mtp"})
    c.parts.emplace_back(name, 0);
  const int64_t k = cfg.moe.router.topk, e = cfg.moe.num_experts;
  for (const auto& p : store.all()) {
    if (!p->trainable) continue;
    const int64_t n = shape_numel(p->full_shape());
    c.total += n;
    // Routed experts [E, ...]: a token uses k of the E experts' weights.
    const int64_t active = p->expert ? n / p->full_rows * k : n;
    c.active += active;
    const std::string part = part_of(*p);
    if (part == "mtp") c.mtp_active += active;
    for (auto& [name, v] : c.parts)
      if (name == part) v += n;
  }
  MC_CHECK(e == 0 || c.part("routed_experts") % e == 0, "count_parameters: routed expert weights do not split into ", e,
           " experts");
  return c;
}

std::string describe_param_count(const ParamCount& c) {
  // One unit for every number: B(illions), M(illions) or K (thousands), from the total.
  const double unit = c.total >= 1000000000 ? 1e9 : c.total >= 1000000 ? 1e6 : 1e3;
  const char* suffix = unit == 1e9 ? "B" : unit == 1e6 ? "M" : "K";
  auto scaled = [&](int64_t n) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f%s", static_cast<double>(n) / unit, suffix);
    return std::string(buf);
  };
  std::string s = scaled(c.total) + " total, " + scaled(c.active) + " active per token (" + std::to_string(c.total) +
                  " / " + std::to_string(c.active) + ")\n";
  for (const auto& [name, n] : c.parts) {
    std::string left = "  " + name;
    left.resize(18, ' ');
    s += left + scaled(n) + "\n";
  }
  return s;
}

}  // namespace moecore
