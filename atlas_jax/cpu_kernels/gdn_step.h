// The gated linear recurrence's token update, shared by atlas_gdn_recurrent and atlas_gdn_layer.
#pragma once

#include <cstdint>

namespace atlas {

// One token of one value head: S = S decay; delta = beta (v - S^T k) [beta v without the delta rule];
// S += k delta^T; o = S^T q. s [Dk, Dv] (in L1), kv [Dv] scratch.
inline void token_update(float* __restrict s, float* __restrict kv, const float* qt, const float* kt, const float* vt,
                         float decay, float beta, float* __restrict ot, int64_t Dk, int64_t Dv, bool delta_rule) {
  for (int64_t j = 0; j < Dv; ++j) kv[j] = 0.0f;
  for (int64_t i = 0; i < Dk; ++i) {               // pass 1: decay, and S^T k
    float* __restrict row = s + i * Dv;
    const float ki = kt[i];
    for (int64_t j = 0; j < Dv; ++j) {
      row[j] *= decay;
      kv[j] += row[j] * ki;
    }
  }
  for (int64_t j = 0; j < Dv; ++j) kv[j] = beta * (vt[j] - (delta_rule ? kv[j] : 0.0f));   // delta
  for (int64_t j = 0; j < Dv; ++j) ot[j] = 0.0f;
  for (int64_t i = 0; i < Dk; ++i) {               // pass 2: S += k delta^T, and o = S^T q
    float* __restrict row = s + i * Dv;
    const float ki = kt[i], qi = qt[i];
    for (int64_t j = 0; j < Dv; ++j) {
      row[j] += ki * kv[j];
      ot[j] += row[j] * qi;
    }
  }
}

}  // namespace atlas
