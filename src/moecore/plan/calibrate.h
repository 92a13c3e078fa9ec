// `moecore plan --calibrate`: times moecore's own kernels on this device at one rank's shapes of
// a layout and turns them into the step-time model's profile fields:
//   gemm_efficiency          the q projection's forward, dgrad and wgrad GEMMs ([T, H] x [H, Hq/TP d])
//   grouped_gemm_efficiency  the experts' six grouped GEMMs (fc1 / fc2 forward, dgrad, wgrad) at the
//                            balanced rows per expert of the layout (-> grouped_gemm_reference_rows)
//   attention_efficiency     causal attention forward + backward (B, S, Hq / TP, the qk / v dims; no CP)
//   small_kernel_efficiency  one layer's attention block (its own class: MHA or MLA), two norms and
//                            its MoE layer (router, permutation, experts, combine, losses; balanced
//                            routing) forward + backward, less the GEMMs and attention the model
//                            prices with the efficiencies above: the rest against the bytes
//                            step_time.h counts for the small kernels
// Efficiencies are fractions of the base profile's bf16 peak (the model's 3 x forward FLOPs per
// forward + backward, as step_time.cpp counts them). The other fields are the base profile's.
#pragma once

#include <nlohmann/json.hpp>

#include "moecore/plan/hardware.h"
#include "moecore/plan/memory_model.h"
#include "moecore/train/arguments.h"

namespace moecore::plan {

struct Calibration {
  HardwareProfile profile;  // the base profile with the measured fields
  nlohmann::json measured;  // the shapes and milliseconds behind them
};

// a: finalized train arguments (their device is where it measures).
Calibration calibrate(const TrainArgs& a, const PlanOptions& o, const HardwareProfile& base);

}  // namespace moecore::plan
