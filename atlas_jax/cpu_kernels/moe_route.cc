// Softmax top-k routing for the packed experts (atlas_moe_route): router logits [N, E] -> the (token, expert)
// pairs sorted by expert, as atlas_moe_experts takes them. One call in place of XLA's softmax, top-k,
// renormalisation, argsort and bincount (ten small thunks a layer at decode).
//   probs = softmax(logits[n]) (fp32, max-subtracted); the k largest probs, ties to the lower expert id (as
//   jax.lax.top_k); weights = those probs, / their sum when `renormalise`;
//   pairs p = n * k + j sorted by expert, stable (as a stable argsort of the flat ids): token[i] = the source
//   row of the i-th sorted pair, weight[i] its weight, sizes[e] = pairs of expert e.
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using namespace atlas;

ffi::Error MoeRoute(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, int64_t top_k, bool renormalise,
                    ffi::ResultBuffer<ffi::S32> token, ffi::ResultBuffer<ffi::F32> weight,
                    ffi::ResultBuffer<ffi::S32> sizes) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || top_k < 1 || top_k > ld[1] || token->element_count() != ld[0] * top_k ||
      weight->element_count() != ld[0] * top_k || sizes->element_count() != ld[1])
    return ffi::Error::InvalidArgument("atlas_moe_route: logits [N, E], token / weight [N * k], sizes [E]");
  const int64_t N = ld[0], E = ld[1], K = top_k;
  const float* l = logits.typed_data();
  std::vector<int32_t> ids(N * K);
  std::vector<float> w(N * K);
  auto route_rows = [&](int64_t n0, int64_t n1) {
    std::vector<float> probs(E);
    std::vector<char> taken(E);
    for (int64_t n = n0; n < n1; ++n) {
      const float* row = l + n * E;
      float top = row[0];
      for (int64_t e = 1; e < E; ++e) top = std::max(top, row[e]);
      float total = 0.0f;
      for (int64_t e = 0; e < E; ++e) total += probs[e] = std::exp(row[e] - top);
      for (int64_t e = 0; e < E; ++e) probs[e] /= total;
      std::fill(taken.begin(), taken.end(), 0);
      float chosen = 0.0f;
      for (int64_t j = 0; j < K; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)     // strictly greater: the lower id wins a tie; NaN never wins
          if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        taken[best] = 1;
        ids[n * K + j] = static_cast<int32_t>(best);
        chosen += w[n * K + j] = probs[best];
      }
      if (renormalise)
        for (int64_t j = 0; j < K; ++j) w[n * K + j] /= chosen;
    }
  };
  constexpr int64_t ROWS = 64;
  parallel_for(pool, (N + ROWS - 1) / ROWS, [&](int64_t b) { route_rows(b * ROWS, std::min(N, (b + 1) * ROWS)); });
  int32_t* size = sizes->typed_data();
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 0; e < E; ++e) size[e] = 0;
  for (int64_t p = 0; p < N * K; ++p) ++size[ids[p]];
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + size[e - 1];
  int32_t* tok = token->typed_data();
  float* wt = weight->typed_data();
  for (int64_t p = 0; p < N * K; ++p) {          // counting sort: stable within each expert's run
    const int64_t i = next[ids[p]]++;
    tok[i] = static_cast<int32_t>(p / K);
    wt[i] = w[p];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AtlasMoeRoute, MoeRoute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [N, E]
                                  .Attr<int64_t>("top_k")
                                  .Attr<bool>("renormalise")
                                  .Ret<ffi::Buffer<ffi::S32>>()   // token [N * k], sorted by expert
                                  .Ret<ffi::Buffer<ffi::F32>>()   // weight [N * k]
                                  .Ret<ffi::Buffer<ffi::S32>>()); // sizes [E]
