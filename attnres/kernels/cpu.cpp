// Block AttnRes's two phases (docs/design.md §6) as fused CPU loops, forward and backward: what `attnres.two_phase_torch`
// computes with a dozen or more tensor operations per phase and pass, in one pass over each token's rows.
//
// On a CPU, depth attention's cost is not arithmetic but per-operation overhead and memory passes: decoding one
// token, every PyTorch operation costs microseconds of dispatch whatever its size (and phase 2 runs 2L times per
// token); in training, phase 1's backward pass as tensor operations sweeps every block several times. Here each
// phase and pass is one call, and each token's rows are read while they sit in cache, on ATen's thread pool. The
// layouts are `two_phase_torch`'s, except that phase 1's output `obar` comes as one tensor per query (the form the
// model's depth state holds), so `attnres.kernels.cpu` plugs these in behind its API.
//
// Numerics are the Triton kernels' (`phase1.py`, `phase2.py`): everything in fp32 whatever the input dtype, each
// output rounded once to its dtype (with bf16 / fp16 inputs the unfused model also rounds the merged `h` and the
// normalised `h`, as Llama's RMSNorm does). Sums run in a different order than torch's, so results agree with the
// reference (`attnres.two_phase`) to fp32 rounding, not bit for bit.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// Eight fp32 lanes as one value (a GCC / Clang vector extension): one AVX register, or two SSE / NEON ones. The
// reductions below are written with it because, written as loops over an array of lanes, the compiler kept the
// lanes on the stack and summed them one by one: a serial chain as long as the vectorised loop itself. Built without
// AVX, GCC warns that passing such a value changes the calling convention, which does not matter to functions
// internal to this file; the helpers take it by reference, where GCC adds a note that the pragma does not silence.
#pragma GCC diagnostic ignored "-Wpsabi"
using Lanes = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = sizeof(Lanes) / sizeof(float);

Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void store_lanes(float* p, const Lanes& v) {
  std::memcpy(p, &v, sizeof v);
}

float sum_lanes(const Lanes& v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Tokens per task on ATen's thread pool: one token of decode or a short prompt stays on the calling thread.
constexpr int64_t kGrainTokens = 16;

// Calls `body.template operator()<G>(first)` for consecutive groups [first, first + G) of `count` items, G <= 4: G
// is a compile-time constant so that the compiler unrolls the group and keeps its accumulators in registers (chosen
// at run time, it does neither).
constexpr int64_t kMaxGroup = 4;

template <typename Body>
void in_groups(int64_t count, const Body& body) {
  for (int64_t first = 0; first < count; first += kMaxGroup) {
    switch (std::min(kMaxGroup, count - first)) {
      case 1: body.template operator()<1>(first); break;
      case 2: body.template operator()<2>(first); break;
      case 3: body.template operator()<3>(first); break;
      default: body.template operator()<4>(first);
    }
  }
}

// `out[g] = row . v[g]` for G vectors in one pass over `row`, each with two independent chains of partial sums (one
// chain is bound by the latency of its additions).
template <int64_t G>
void dots(const float* row, const float* const* v, int64_t n, float* out) {
  Lanes even[G] = {}, odd[G] = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    const Lanes low = load_lanes(row + i), high = load_lanes(row + i + kLanes);
    for (int64_t g = 0; g < G; ++g) {
      even[g] += low * load_lanes(v[g] + i);
      odd[g] += high * load_lanes(v[g] + i + kLanes);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float total = sum_lanes(even[g] + odd[g]);
    for (int64_t j = i; j < n; ++j) total += row[j] * v[g][j];
    out[g] = total;
  }
}

float dot(const float* a, const float* b, int64_t n) {
  float total;
  dots<1>(a, &b, n, &total);
  return total;
}

// One row of `n` values as fp32: the row itself when it is fp32, else converted into `scratch`.
template <typename scalar_t>
const float* fp32_row(const scalar_t* row, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(row[i]);
    return scratch;
  }
}

// A norm's gain `w + offset` as fp32, rounded to w's dtype as torch's `w + offset` is: the family's norm (Gemma's
// `1 + w`) computed from its own weight, where adding the offset before the call would be one more operation per
// sublayer and token (`modeling_attnres.FusableNorm`).
template <typename scalar_t>
const float* gain_row(const scalar_t* weight, int64_t n, double offset, float* scratch) {
  if (offset == 0.0) return fp32_row(weight, n, scratch);
  const float offset_f = static_cast<float>(offset);
  for (int64_t i = 0; i < n; ++i) {
    scratch[i] = static_cast<float>(static_cast<scalar_t>(static_cast<float>(weight[i]) + offset_f));
  }
  return scratch;
}

// Phase 2's merge `h = obar + gate (P - obar)` of one token, with torch.lerp's formula (exact at both ends).
void merge(const float* obar, const float* partial, float gate, int64_t n, float* h) {
  for (int64_t i = 0; i < n; ++i) {
    const float delta = partial[i] - obar[i];
    h[i] = gate < 0.5f ? obar[i] + gate * delta : partial[i] - delta * (1.f - gate);
  }
}

// `rsqrt(mean(v^2) + eps)` of one fp32 row: the scale RMSNorm applies to it.
float inverse_rms(const float* v, int64_t n, float eps) {
  return 1.f / std::sqrt(dot(v, v, n) * (1.f / static_cast<float>(n)) + eps);
}

// Llama's RMSNorm of one fp32 row `h` with gain `w`, `y = w * (h * r)`, written in the output dtype; returns r.
template <typename scalar_t>
float normalize(const float* h, const float* w, int64_t n, float eps, scalar_t* y) {
  const float inv_rms = inverse_rms(h, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<scalar_t>(w[i] * (h[i] * inv_rms));
  return inv_rms;
}

// The backward pass of `normalize` for one row, from its inverse RMS `r`: adds `go * h * r` to `grad_w` and writes
// `gh = dL/dh = r (go w) - r^3 (h . go w) h / n`. `go w` goes through `gh` so that `h . go w` is a `dot` (a sum
// accumulated in the loop that computes it would be one serial chain: four times slower at D = 256).
void normalize_backward(
    const float* h, const float* go, const float* w, float inv_rms, int64_t n, float* grad_w, float* gh) {
  for (int64_t i = 0; i < n; ++i) {
    grad_w[i] += go[i] * (h[i] * inv_rms);
    gh[i] = go[i] * w[i];
  }
  const float coef = inv_rms * inv_rms * inv_rms * dot(h, gh, n) * (1.f / static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) gh[i] = gh[i] * inv_rms - coef * h[i];
}

// `out[g] = sum_r w[g][r] rows[r]` for G queries: each 16-value slice of the G outputs is accumulated in registers
// over all the rows and stored once, where a pass per row would load and store the outputs once per row.
template <int64_t G>
void mix_rows(const float* const* rows, int64_t num_rows, const float* const* w, int64_t n, float* const* out) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    Lanes even[G] = {}, odd[G] = {};
    for (int64_t r = 0; r < num_rows; ++r) {
      const Lanes low = load_lanes(rows[r] + i), high = load_lanes(rows[r] + i + kLanes);
      for (int64_t g = 0; g < G; ++g) {
        even[g] += w[g][r] * low;
        odd[g] += w[g][r] * high;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      store_lanes(out[g] + i, even[g]);
      store_lanes(out[g] + i + kLanes, odd[g]);
    }
  }
  for (; i < n; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      float total = 0.f;
      for (int64_t r = 0; r < num_rows; ++r) total += w[g][r] * rows[r][i];
      out[g][i] = total;
    }
  }
}

// One pass of phase 1's backward pass for one block row `v` and K queries (a group of `in_groups`):
// `grad_row (=|+=) sum_k p_k go_k + c_k q_k` and `grad_q_k += c_k v`. The first group writes `grad_row`, the others
// add to it.
template <int64_t K, bool Accumulate>
void block_row_backward_pass(
    const float* const* go,
    const float* const* q,
    const float* p,
    const float* c,
    const float* v,
    int64_t n,
    float* const* grad_q,
    float* grad_row) {
  // The rows `go`, `q`, `grad_q`, `v` and `grad_row` are distinct, which the compiler cannot prove through the
  // pointer arrays.
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float total = Accumulate ? grad_row[i] : 0.f;
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; ++k) {
      total += p[k] * go[k][i] + c[k] * q[k][i];
      grad_q[k][i] += c[k] * v[i];
    }
    grad_row[i] = total;
  }
}

void check_fp32(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
}

// `blocks_inv_rms` `[N, *tokens]` with the inverse RMS of the newly completed `block` `[*tokens, D]` appended:
// `torch.cat([blocks_inv_rms, two_phase.inverse_rms(block, eps).unsqueeze(0)])`.
at::Tensor append_inverse_rms(const at::Tensor& blocks_inv_rms, const at::Tensor& block, double eps) {
  check_fp32(blocks_inv_rms, "blocks_inv_rms");
  const int64_t hidden = block.size(-1);
  const int64_t tokens = block.numel() / hidden;
  TORCH_CHECK(blocks_inv_rms.numel() % std::max<int64_t>(tokens, 1) == 0, "blocks_inv_rms must be [N, *tokens]");
  auto sizes = blocks_inv_rms.sizes().vec();
  sizes[0] += 1;
  auto result = at::empty(sizes, blocks_inv_rms.options());
  const int64_t existing = blocks_inv_rms.numel();
  const auto old_c = blocks_inv_rms.contiguous(), block_c = block.contiguous();
  std::copy_n(old_c.data_ptr<float>(), existing, result.data_ptr<float>());
  float* new_row = result.data_ptr<float>() + existing;
  const float eps_f = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, block.scalar_type(), "append_inverse_rms", [&] {
    const scalar_t* block_p = block_c.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(hidden);
      for (int64_t t = begin; t < end; ++t) {
        const float* v = fp32_row(block_p + t * hidden, hidden, scratch.data());
        new_row[t] = inverse_rms(v, hidden, eps_f);
      }
    });
  });
  return result;
}

// Phase 2 (docs/design.md §6) and the per-token scalars its backward pass reuses: `(out, stats)`, with `stats`
// `[4, *tokens]` fp32 holding (gate, raw, inv_rms, norm_inv_rms). With `norm_weight`, `two_phase.phase2_rms_norm`:
// `h` normalised by the sublayer's RMSNorm (gain `norm_weight + gain_offset`, eps `norm_eps`). Without,
// `two_phase.phase2`: the input `k * h` itself (k = `scale`, the step's output scale), for a sublayer whose pre-norm
// is the family's own and not fused (Gemma's `1 + w` on a bf16 stream, a LayerNorm); `norm_inv_rms` is then not
// written.
std::vector<at::Tensor> phase2(
    const at::Tensor& obar,
    const at::Tensor& lse,
    const at::Tensor& partial,
    const at::Tensor& query,
    double eps,
    const std::optional<at::Tensor>& norm_weight,
    double norm_eps,
    double gain_offset,
    double scale) {
  check_fp32(obar, "obar");
  check_fp32(lse, "lse");
  check_fp32(query, "query");
  const bool normalizes = norm_weight.has_value();
  TORCH_CHECK(!normalizes || norm_weight->scalar_type() == partial.scalar_type(),
              "norm_weight must have the partial's dtype");
  const int64_t hidden = partial.size(-1);
  const int64_t tokens = partial.numel() / hidden;
  TORCH_CHECK(obar.numel() == tokens * hidden && lse.numel() == tokens, "obar / lse do not match the partial");
  TORCH_CHECK(query.numel() == hidden && (!normalizes || norm_weight->numel() == hidden),
              "query / norm_weight must be [hidden]");

  const auto obar_c = obar.contiguous(), lse_c = lse.contiguous(), partial_c = partial.contiguous();
  const auto query_c = query.contiguous(), weight_c = normalizes ? norm_weight->contiguous() : at::Tensor();
  auto out = at::empty_like(partial_c);
  const auto token_shape = partial.sizes().slice(0, partial.dim() - 1);
  std::vector<int64_t> stats_shape{4};
  stats_shape.insert(stats_shape.end(), token_shape.begin(), token_shape.end());
  auto stats = at::empty(stats_shape, partial.options().dtype(at::kFloat));
  const float eps_f = static_cast<float>(eps), norm_eps_f = static_cast<float>(norm_eps);
  const float scale_f = static_cast<float>(scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial.scalar_type(), "phase2", [&] {
    const scalar_t* partial_p = partial_c.data_ptr<scalar_t>();
    const scalar_t* weight_p = normalizes ? weight_c.data_ptr<scalar_t>() : nullptr;
    scalar_t* out_p = out.data_ptr<scalar_t>();
    const float* obar_p = obar_c.data_ptr<float>();
    const float* lse_p = lse_c.data_ptr<float>();
    const float* query_p = query_c.data_ptr<float>();
    float* gate_p = stats.data_ptr<float>();
    float* raw_p = gate_p + tokens;
    float* inv_rms_p = raw_p + tokens;
    float* norm_inv_rms_p = inv_rms_p + tokens;
    at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(hidden), hidden_row(hidden), weight(hidden);
      const float* w = normalizes ? gain_row(weight_p, hidden, gain_offset, weight.data()) : nullptr;
      float* h = hidden_row.data();
      for (int64_t t = begin; t < end; ++t) {
        const float* v = fp32_row(partial_p + t * hidden, hidden, scratch.data());
        const float raw = dot(v, query_p, hidden);
        const float inv_rms = inverse_rms(v, hidden, eps_f);
        const float gate = 1.f / (1.f + std::exp(lse_p[t] - raw * inv_rms));
        merge(obar_p + t * hidden, v, gate, hidden, h);
        scalar_t* y = out_p + t * hidden;
        if (normalizes) {
          norm_inv_rms_p[t] = normalize(h, w, hidden, norm_eps_f, y);
        } else {
          for (int64_t i = 0; i < hidden; ++i) y[i] = static_cast<scalar_t>(h[i] * scale_f);
        }
        gate_p[t] = gate;
        raw_p[t] = raw;
        inv_rms_p[t] = inv_rms;
      }
    });
  });
  return {out, stats};
}

// `two_phase.phase1` over the completed blocks given separately, with the softmax weights and raw scores its
// backward pass reuses: `(blocks_inv_rms, lse [S, *tokens], weights [*tokens, N, S], raw [*tokens, N, S], obar_0,
// ..., obar_{S-1})`. `obar` comes as S separate `[*tokens, D]` rows, one per query: each row is read by one sublayer's
// step, so each step's gradient arrives in the backward pass as a row of its own, not scattered into a zero-filled
// `[S, *tokens, D]` that autograd would then sum over the S steps. `weights` and `raw` are token-major, so that a
// token's N x S scores are written and read together, not N x S values a row of tokens apart. The S queries `[D]` come
// separately too, as the steps hold them: stacking them would be one more operation per closed block and token.
//
// With `append_eps`, `blocks_inv_rms` holds the inverse RMS of all blocks but the newest (`[N - 1, *tokens]`): phase 1
// computes the newest one's (`append_inverse_rms` with that eps) from the rows it reads anyway and returns
// `blocks_inv_rms` with it appended, so the block that has just closed is read once, not once more by a pass of its
// own. Without, `blocks_inv_rms` holds all N rows and is returned as given.
//
// Without `for_backward` (no gradient will be asked for), `weights` and `raw` are neither written nor allocated and
// come back undefined (`None`): they are N x S scattered writes per token that only the backward pass reads.
std::vector<at::Tensor> phase1(
    const std::vector<at::Tensor>& blocks,
    const at::Tensor& blocks_inv_rms,
    const std::vector<at::Tensor>& queries,
    std::optional<double> append_eps,
    bool for_backward) {
  TORCH_CHECK(!blocks.empty(), "phase 1 needs at least one block");
  check_fp32(blocks_inv_rms, "blocks_inv_rms");
  const auto& first = blocks.front();
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  const int64_t num_queries = static_cast<int64_t>(queries.size());
  const int64_t hidden = first.size(-1);
  const int64_t tokens = first.numel() / hidden;
  std::vector<at::Tensor> queries_c;
  for (const auto& query : queries) {
    check_fp32(query, "queries");
    TORCH_CHECK(query.numel() == hidden, "each query must be [hidden]");
    queries_c.push_back(query.contiguous());
  }
  const bool appends = append_eps.has_value();
  TORCH_CHECK(
      blocks_inv_rms.numel() == (appends ? num_blocks - 1 : num_blocks) * tokens,
      appends ? "blocks_inv_rms must be [N - 1, *tokens] (the newest block's is appended)"
              : "blocks_inv_rms must be [N, *tokens]");
  std::vector<at::Tensor> blocks_c;
  for (const auto& block : blocks) {
    TORCH_CHECK(block.sizes() == first.sizes() && block.scalar_type() == first.scalar_type(), "blocks must match");
    blocks_c.push_back(block.contiguous());
  }
  const auto token_shape = first.sizes().slice(0, first.dim() - 1);
  std::vector<int64_t> inv_rms_shape{num_blocks}, lse_shape{num_queries};
  for (auto* shape : {&inv_rms_shape, &lse_shape}) {
    shape->insert(shape->end(), token_shape.begin(), token_shape.end());
  }
  std::vector<int64_t> score_shape(token_shape.begin(), token_shape.end());
  score_shape.insert(score_shape.end(), {num_blocks, num_queries});
  const auto fp32 = first.options().dtype(at::kFloat);
  at::Tensor inv_rms_c = blocks_inv_rms.contiguous();
  if (appends) {  // copied here, not by tensor operations: each would be a dispatch per closed block and token
    const auto given = inv_rms_c;
    inv_rms_c = at::empty(inv_rms_shape, fp32);
    std::copy_n(given.data_ptr<float>(), given.numel(), inv_rms_c.data_ptr<float>());
  }
  const auto scores = [&] { return for_backward ? at::empty(score_shape, fp32) : at::Tensor(); };
  std::vector<at::Tensor> result{inv_rms_c, at::empty(lse_shape, fp32), scores(), scores()};
  std::vector<float*> obar_p;
  for (int64_t s = 0; s < num_queries; ++s) {
    result.push_back(at::empty(first.sizes(), fp32));
    obar_p.push_back(result.back().data_ptr<float>());
  }

  const float eps_f = static_cast<float>(append_eps.value_or(0.0));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, first.scalar_type(), "phase1", [&] {
    std::vector<const scalar_t*> block_p;
    for (const auto& block : blocks_c) block_p.push_back(block.data_ptr<scalar_t>());
    float* inv_rms_p = inv_rms_c.data_ptr<float>();
    float* lse_p = result[1].data_ptr<float>();
    float* weights_p = for_backward ? result[2].data_ptr<float>() : nullptr;
    float* raw_p = for_backward ? result[3].data_ptr<float>() : nullptr;
    at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
      // `logits` holds query s's N logits at [s * N, (s + 1) * N), then its softmax weights (`mix[s]` points there).
      std::vector<float> scratch(num_blocks * hidden), logits(num_queries * num_blocks), scores(kMaxGroup);
      std::vector<const float*> rows(num_blocks), query_rows(num_queries), mix(num_queries);
      std::vector<float*> out(num_queries);
      for (int64_t s = 0; s < num_queries; ++s) {
        query_rows[s] = queries_c[s].data_ptr<float>();
        mix[s] = logits.data() + s * num_blocks;
      }
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t n = 0; n < num_blocks; ++n) {
          rows[n] = fp32_row(block_p[n] + t * hidden, hidden, scratch.data() + n * hidden);
          if (appends && n == num_blocks - 1) inv_rms_p[n * tokens + t] = inverse_rms(rows[n], hidden, eps_f);
          in_groups(num_queries, [&]<int64_t G>(int64_t first) {
            dots<G>(rows[n], query_rows.data() + first, hidden, scores.data());
            for (int64_t g = 0; g < G; ++g) {
              const int64_t s = first + g;
              if (for_backward) raw_p[(t * num_blocks + n) * num_queries + s] = scores[g];
              logits[s * num_blocks + n] = scores[g] * inv_rms_p[n * tokens + t];
            }
          });
        }
        for (int64_t s = 0; s < num_queries; ++s) {
          float* logit = logits.data() + s * num_blocks;
          const float peak = *std::max_element(logit, logit + num_blocks);
          float total = 0.f;
          for (int64_t n = 0; n < num_blocks; ++n) {
            logit[n] = std::exp(logit[n] - peak);
            total += logit[n];
          }
          lse_p[s * tokens + t] = peak + std::log(total);
          for (int64_t n = 0; n < num_blocks; ++n) {
            logit[n] /= total;
            if (for_backward) weights_p[(t * num_blocks + n) * num_queries + s] = logit[n];
          }
          out[s] = obar_p[s] + t * hidden;
        }
        in_groups(num_queries, [&]<int64_t G>(int64_t first) {
          mix_rows<G>(rows.data(), num_blocks, mix.data() + first, hidden, out.data() + first);
        });
      }
    });
  });
  return result;
}

// Splits `tokens` into a fixed number of chunks (at most one per thread) so that sums over tokens are accumulated
// per chunk and added in chunk order: the result does not depend on how the threads were scheduled.
int64_t num_chunks(int64_t tokens) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (tokens + kGrainTokens - 1) / kGrainTokens));
}

// Runs `body(chunk, begin, end)` over the chunks of `tokens` on ATen's thread pool.
template <typename Body>
void for_each_chunk(int64_t tokens, int64_t chunks, const Body& body) {
  const int64_t per_chunk = (tokens + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) body(c, c * per_chunk, std::min(tokens, (c + 1) * per_chunk));
  });
}

// `two_phase.phase1_rms_norm`: the RMSNorm (gain `norm_weight + gain_offset`, output in its dtype) of phase 1's fp32
// rows `obar` `[*tokens, D]`, the input of a block's first sublayer; `(out, norm_inv_rms [*tokens])`.
std::vector<at::Tensor> phase1_rms_norm(
    const at::Tensor& obar, const at::Tensor& norm_weight, double norm_eps, double gain_offset) {
  check_fp32(obar, "obar");
  const int64_t hidden = obar.size(-1);
  const int64_t tokens = obar.numel() / hidden;
  TORCH_CHECK(norm_weight.numel() == hidden, "norm_weight must be [hidden]");
  const auto obar_c = obar.contiguous(), weight_c = norm_weight.contiguous();
  auto out = at::empty(obar.sizes(), obar.options().dtype(norm_weight.scalar_type()));
  auto norm_inv_rms = at::empty(obar.sizes().slice(0, obar.dim() - 1), obar.options());
  const float norm_eps_f = static_cast<float>(norm_eps);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, norm_weight.scalar_type(), "phase1_rms_norm", [&] {
    const scalar_t* weight_p = weight_c.data_ptr<scalar_t>();
    scalar_t* out_p = out.data_ptr<scalar_t>();
    const float* obar_p = obar_c.data_ptr<float>();
    float* norm_inv_rms_p = norm_inv_rms.data_ptr<float>();
    at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
      std::vector<float> weight(hidden);
      const float* w = gain_row(weight_p, hidden, gain_offset, weight.data());
      for (int64_t t = begin; t < end; ++t) {
        norm_inv_rms_p[t] = normalize(obar_p + t * hidden, w, hidden, norm_eps_f, out_p + t * hidden);
      }
    });
  });
  return {out, norm_inv_rms};
}

// The backward pass of `phase1_rms_norm`: `(grad_obar, grad_norm_weight)`.
std::vector<at::Tensor> phase1_rms_norm_backward(
    const at::Tensor& grad_out,
    const at::Tensor& obar,
    const at::Tensor& norm_weight,
    const at::Tensor& norm_inv_rms,
    double gain_offset) {
  const int64_t hidden = obar.size(-1);
  const int64_t tokens = obar.numel() / hidden;
  const auto go_c = grad_out.to(norm_weight.scalar_type()).contiguous(), obar_c = obar.contiguous();
  const auto weight_c = norm_weight.contiguous(), inv_rms_c = norm_inv_rms.contiguous();
  auto grad_obar = at::empty_like(obar_c);
  const int64_t chunks = num_chunks(tokens);
  auto grad_weight_chunks = at::zeros({chunks, hidden}, obar_c.options());

  const auto dtype = norm_weight.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "phase1_rms_norm_backward", [&] {
    const scalar_t* go_p = go_c.data_ptr<scalar_t>();
    const scalar_t* weight_p = weight_c.data_ptr<scalar_t>();
    const float* obar_p = obar_c.data_ptr<float>();
    const float* inv_rms_p = inv_rms_c.data_ptr<float>();
    float* grad_obar_p = grad_obar.data_ptr<float>();
    for_each_chunk(tokens, chunks, [&](int64_t chunk, int64_t begin, int64_t end) {
      std::vector<float> go_row(hidden), weight(hidden);
      const float* w = gain_row(weight_p, hidden, gain_offset, weight.data());
      float* grad_w = grad_weight_chunks.data_ptr<float>() + chunk * hidden;
      for (int64_t t = begin; t < end; ++t) {
        const float* go = fp32_row(go_p + t * hidden, hidden, go_row.data());
        normalize_backward(obar_p + t * hidden, go, w, inv_rms_p[t], hidden, grad_w, grad_obar_p + t * hidden);
      }
    });
  });
  return {grad_obar, grad_weight_chunks.sum(0).to(norm_weight.scalar_type())};
}

// The backward pass of `phase1`, as `two_phase_torch._Phase1.backward` derives it, from the gradients of phase 1's
// S `obar` rows and of `lse`. Per token, with p the weights, r the blocks' inverse RMS, `g_ns = go_s . b_n` and
// `delta_s = go_s . obar_s = sum_n p_ns g_ns`: `ds = p (g - delta + gl)`, `d b_n = sum_s p_ns go_s + ds_ns r_n w_s`,
// `d r_n = sum_s ds_ns raw_ns`, `d w_s = sum_{tokens, n} ds_ns r_n b_n`. `delta` comes from the same dot products
// as `g` instead of from `obar`, which is then never read back: a token's N block rows are read twice from cache,
// S rows of `obar` would be read from memory.
//
// When the forward pass appended the newest block's inverse RMS (`appended`), `grad_appended` is the gradient of the
// `[N, *tokens]` it returned (`None` where nothing read it): it adds to `d r`, and the newest block's `d r` goes into
// that block's gradient as `append_inverse_rms`'s backward pass would, `d b_{N-1} -= d r_{N-1} r^3 b_{N-1} / D`, in
// the pass that writes the block's gradient anyway.
// Returns `(grad_inv_rms [N or N - 1, *tokens], grad_queries [S, D], grad_blocks...)`, each block's gradient in its
// dtype.
std::vector<at::Tensor> phase1_backward(
    const std::vector<at::Tensor>& grad_obar,
    const at::Tensor& grad_lse,
    const std::vector<at::Tensor>& blocks,
    const at::Tensor& blocks_inv_rms,
    const at::Tensor& queries,
    const at::Tensor& weights,
    const at::Tensor& raw,
    bool appended,
    const std::optional<at::Tensor>& grad_appended) {
  const auto& first = blocks.front();
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  const int64_t num_queries = queries.size(0);
  const int64_t hidden = first.size(-1);
  const int64_t tokens = first.numel() / hidden;
  TORCH_CHECK(static_cast<int64_t>(grad_obar.size()) == num_queries, "grad_obar must hold a row per query");
  std::vector<at::Tensor> go_c;
  for (const auto& grad : grad_obar) go_c.push_back(grad.to(at::kFloat).contiguous());
  const auto gl_c = grad_lse.to(at::kFloat).contiguous();
  const auto inv_rms_c = blocks_inv_rms.contiguous(), queries_c = queries.contiguous();
  const auto weights_c = weights.contiguous(), raw_c = raw.contiguous();
  std::vector<at::Tensor> blocks_c, grad_blocks;
  for (const auto& block : blocks) {
    blocks_c.push_back(block.contiguous());
    grad_blocks.push_back(at::empty_like(blocks_c.back()));
  }
  const int64_t kept_rows = appended ? num_blocks - 1 : num_blocks;  // the rows of `blocks_inv_rms` given as input
  auto grad_inv_rms = at::empty_like(inv_rms_c.narrow(0, 0, kept_rows));
  const auto grad_appended_c =
      appended && grad_appended.has_value() ? grad_appended->to(at::kFloat).contiguous() : at::Tensor();
  const float inv_hidden = 1.f / static_cast<float>(hidden);
  const int64_t chunks = num_chunks(tokens);
  auto grad_queries_chunks = at::zeros({chunks, num_queries, hidden}, queries_c.options());

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, first.scalar_type(), "phase1_backward", [&] {
    std::vector<const scalar_t*> block_p;
    std::vector<scalar_t*> grad_block_p;
    for (int64_t n = 0; n < num_blocks; ++n) {
      block_p.push_back(blocks_c[n].data_ptr<scalar_t>());
      grad_block_p.push_back(grad_blocks[n].data_ptr<scalar_t>());
    }
    std::vector<const float*> go_p;
    for (const auto& grad : go_c) go_p.push_back(grad.data_ptr<float>());
    const float* gl_p = gl_c.data_ptr<float>();
    const float* inv_rms_p = inv_rms_c.data_ptr<float>();
    const float* queries_p = queries_c.data_ptr<float>();
    const float* weights_p = weights_c.data_ptr<float>();
    const float* raw_p = raw_c.data_ptr<float>();
    float* grad_inv_rms_p = grad_inv_rms.data_ptr<float>();
    const float* grad_appended_p = grad_appended_c.defined() ? grad_appended_c.data_ptr<float>() : nullptr;
    for_each_chunk(tokens, chunks, [&](int64_t chunk, int64_t begin, int64_t end) {
      // `go_dots[n * S + s]` is `go_s . v_n`: each query's output gradient against each of the token's block rows.
      std::vector<float> scratch(num_blocks * hidden), grad_row_scratch(hidden), go_dots(num_blocks * num_queries);
      std::vector<float> delta(num_queries), p(num_queries), coef(num_queries);
      std::vector<const float*> rows(num_blocks), go(num_queries), query_rows(num_queries);
      std::vector<float*> grad_q_rows(num_queries);
      float* grad_q = grad_queries_chunks.data_ptr<float>() + chunk * num_queries * hidden;
      for (int64_t s = 0; s < num_queries; ++s) {
        query_rows[s] = queries_p + s * hidden;
        grad_q_rows[s] = grad_q + s * hidden;
      }
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t s = 0; s < num_queries; ++s) go[s] = go_p[s] + t * hidden;
        std::fill(delta.begin(), delta.end(), 0.f);
        for (int64_t n = 0; n < num_blocks; ++n) {
          rows[n] = fp32_row(block_p[n] + t * hidden, hidden, scratch.data() + n * hidden);
          float* row_dots = go_dots.data() + n * num_queries;
          in_groups(num_queries, [&]<int64_t G>(int64_t first) {
            dots<G>(rows[n], go.data() + first, hidden, row_dots + first);
          });
          for (int64_t s = 0; s < num_queries; ++s) {
            delta[s] += weights_p[(t * num_blocks + n) * num_queries + s] * row_dots[s];
          }
        }
        for (int64_t n = 0; n < num_blocks; ++n) {
          const float r = inv_rms_p[n * tokens + t];
          float grad_r = 0.f;
          for (int64_t s = 0; s < num_queries; ++s) {
            const int64_t score = (t * num_blocks + n) * num_queries + s;
            p[s] = weights_p[score];
            const float ds = p[s] * (go_dots[n * num_queries + s] - delta[s] + gl_p[s * tokens + t]);
            grad_r += ds * raw_p[score];
            coef[s] = ds * r;
          }
          if (grad_appended_p != nullptr) grad_r += grad_appended_p[n * tokens + t];
          if (n < kept_rows) grad_inv_rms_p[n * tokens + t] = grad_r;
          scalar_t* grad_b = grad_block_p[n] + t * hidden;
          // fp32 blocks take their gradient in place; others take it in fp32 first, rounded once below.
          float* grad_row =
              std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(grad_b) : grad_row_scratch.data();
          in_groups(num_queries, [&]<int64_t G>(int64_t s) {
            const auto args = std::make_tuple(go.data() + s, query_rows.data() + s, p.data() + s, coef.data() + s,
                                              rows[n], hidden, grad_q_rows.data() + s, grad_row);
            if (s == 0) {
              std::apply(block_row_backward_pass<G, false>, args);
            } else {
              std::apply(block_row_backward_pass<G, true>, args);
            }
          });
          if (n >= kept_rows) {  // the appended row: `r = (mean(b^2) + eps)^(-1/2)`, so `dr/db = -r^3 b / D`
            const float block_coef = grad_r * r * r * r * inv_hidden;
            for (int64_t i = 0; i < hidden; ++i) grad_row[i] -= block_coef * rows[n][i];
          }
          if constexpr (!std::is_same_v<scalar_t, float>) {
            for (int64_t i = 0; i < hidden; ++i) grad_b[i] = static_cast<scalar_t>(grad_row[i]);
          }
        }
      }
    });
  });
  std::vector<at::Tensor> result{grad_inv_rms, grad_queries_chunks.sum(0)};
  result.insert(result.end(), grad_blocks.begin(), grad_blocks.end());
  return result;
}

// The backward pass of `phase2`, as `two_phase_torch._Phase2RMSNorm.backward` derives it, from the forward pass's
// per-token scalars (`stats`), with `h` recomputed where the norm reads it. Returns `(grad_obar, grad_lse,
// grad_partial, grad_query, grad_norm_weight)`, the last undefined (`None`) without a norm.
std::vector<at::Tensor> phase2_backward(
    const at::Tensor& grad_out,
    const at::Tensor& obar,
    const at::Tensor& partial,
    const at::Tensor& query,
    const std::optional<at::Tensor>& norm_weight,
    const at::Tensor& stats,
    double gain_offset,
    double scale) {
  const bool normalizes = norm_weight.has_value();
  const int64_t hidden = partial.size(-1);
  const int64_t tokens = partial.numel() / hidden;
  const auto go_c = grad_out.to(partial.scalar_type()).contiguous(), obar_c = obar.contiguous();
  const auto partial_c = partial.contiguous(), query_c = query.contiguous(), stats_c = stats.contiguous();
  const auto weight_c = normalizes ? norm_weight->contiguous() : at::Tensor();
  auto grad_obar = at::empty_like(obar_c);
  auto grad_lse = at::empty(stats.sizes().slice(1), obar_c.options());
  auto grad_partial = at::empty_like(partial_c);
  const int64_t chunks = num_chunks(tokens);
  auto sums = at::zeros({chunks, 2, hidden}, obar_c.options());  // per chunk: grad_query, grad_norm_weight
  const float inv_hidden = 1.f / static_cast<float>(hidden), scale_f = static_cast<float>(scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partial.scalar_type(), "phase2_backward", [&] {
    const scalar_t* go_p = go_c.data_ptr<scalar_t>();
    const scalar_t* partial_p = partial_c.data_ptr<scalar_t>();
    const scalar_t* weight_p = normalizes ? weight_c.data_ptr<scalar_t>() : nullptr;
    scalar_t* grad_partial_p = grad_partial.data_ptr<scalar_t>();
    const float* obar_p = obar_c.data_ptr<float>();
    const float* query_p = query_c.data_ptr<float>();
    const float* gate_p = stats_c.data_ptr<float>();
    const float* raw_p = gate_p + tokens;
    const float* inv_rms_p = raw_p + tokens;
    const float* norm_inv_rms_p = inv_rms_p + tokens;
    float* grad_obar_p = grad_obar.data_ptr<float>();
    float* grad_lse_p = grad_lse.data_ptr<float>();
    for_each_chunk(tokens, chunks, [&](int64_t chunk, int64_t begin, int64_t end) {
      std::vector<float> scratch(hidden), go_row(hidden), weight(hidden), h(hidden), gh(hidden);
      const float* w = normalizes ? gain_row(weight_p, hidden, gain_offset, weight.data()) : nullptr;
      float* grad_q = sums.data_ptr<float>() + chunk * 2 * hidden;
      float* grad_w = grad_q + hidden;
      for (int64_t t = begin; t < end; ++t) {
        const float* v = fp32_row(partial_p + t * hidden, hidden, scratch.data());
        const float* go = fp32_row(go_p + t * hidden, hidden, go_row.data());
        const float* o = obar_p + t * hidden;
        const float gate = gate_p[t], inv_rms = inv_rms_p[t];
        if (normalizes) {
          merge(o, v, gate, hidden, h.data());
          normalize_backward(h.data(), go, w, norm_inv_rms_p[t], hidden, grad_w, gh.data());
        } else {
          for (int64_t i = 0; i < hidden; ++i) gh[i] = go[i] * scale_f;
        }
        // gh . (v - o) as two `dot`s: vectorised, where one loop's running sum would be a serial chain.
        const float grad_logit = (dot(gh.data(), v, hidden) - dot(gh.data(), o, hidden)) * gate * (1.f - gate);
        const float query_coef = grad_logit * inv_rms;
        const float value_coef = grad_logit * raw_p[t] * inv_rms * inv_rms * inv_rms * inv_hidden;
        float* grad_o = grad_obar_p + t * hidden;
        scalar_t* grad_v = grad_partial_p + t * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          grad_o[i] = gh[i] * (1.f - gate);
          grad_v[i] = static_cast<scalar_t>(gh[i] * gate + query_coef * query_p[i] - value_coef * v[i]);
          grad_q[i] += query_coef * v[i];
        }
        grad_lse_p[t] = -grad_logit;
      }
    });
  });
  const auto totals = sums.sum(0);
  const auto grad_weight = normalizes ? totals[1].to(norm_weight->scalar_type()) : at::Tensor();
  return {grad_obar, grad_lse, grad_partial, totals[0], grad_weight};
}

// The forward kernels as operators of PyTorch's dispatcher (`torch.ops.attnres_cpu.*`), for graphs that torch.compile
// captures without autograd (`attnres.kernels.cpu.operators`): the graph keeps each call whole and calls it from
// inductor's wrapper without Python in between. Their outputs are fresh tensors, as an operator's must be: phase 1
// without `append_eps` returns `blocks_inv_rms` as given, which is left out, as are `weights` and `raw`, undefined
// without `for_backward`.
std::vector<at::Tensor> phase1_operator(
    at::TensorList blocks, const at::Tensor& blocks_inv_rms, at::TensorList queries) {
  auto result = phase1(blocks.vec(), blocks_inv_rms, queries.vec(), std::nullopt, false);
  result.erase(result.begin() + 2, result.begin() + 4);
  result.erase(result.begin());
  return result;  // lse, then the rows
}

std::vector<at::Tensor> close_block_operator(
    at::TensorList blocks, const at::Tensor& blocks_inv_rms, at::TensorList queries, double eps) {
  auto result = phase1(blocks.vec(), blocks_inv_rms, queries.vec(), eps, false);
  result.erase(result.begin() + 2, result.begin() + 4);
  return result;  // blocks_inv_rms with the newest block's appended, lse, then the rows
}

at::Tensor phase2_operator(
    const at::Tensor& obar,
    const at::Tensor& lse,
    const at::Tensor& partial,
    const at::Tensor& query,
    double eps,
    const std::optional<at::Tensor>& scale) {
  const double k = scale.has_value() ? scale->item<double>() : 1.0;
  return phase2(obar, lse, partial, query, eps, std::nullopt, 0.0, 0.0, k)[0];
}

at::Tensor phase2_rms_norm_operator(
    const at::Tensor& obar,
    const at::Tensor& lse,
    const at::Tensor& partial,
    const at::Tensor& query,
    double eps,
    const at::Tensor& norm_weight,
    double norm_eps,
    double gain_offset) {
  return phase2(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset, 1.0)[0];
}

at::Tensor phase1_rms_norm_operator(
    const at::Tensor& obar, const at::Tensor& norm_weight, double norm_eps, double gain_offset) {
  return phase1_rms_norm(obar, norm_weight, norm_eps, gain_offset)[0];
}

}  // namespace

TORCH_LIBRARY(attnres_cpu, m) {
  m.def("phase1(Tensor[] blocks, Tensor blocks_inv_rms, Tensor[] queries) -> Tensor[]");
  m.def("close_block(Tensor[] blocks, Tensor blocks_inv_rms, Tensor[] queries, float eps) -> Tensor[]");
  m.def("phase2(Tensor obar, Tensor lse, Tensor partial, Tensor query, float eps, Tensor? scale) -> Tensor");
  m.def(
      "phase2_rms_norm(Tensor obar, Tensor lse, Tensor partial, Tensor query, float eps, Tensor norm_weight, "
      "float norm_eps, float gain_offset=0) -> Tensor");
  m.def("phase1_rms_norm(Tensor obar, Tensor norm_weight, float norm_eps, float gain_offset=0) -> Tensor");
  m.def("append_inverse_rms(Tensor blocks_inv_rms, Tensor block, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnres_cpu, CPU, m) {
  m.impl("phase1", &phase1_operator);
  m.impl("close_block", &close_block_operator);
  m.impl("phase2", &phase2_operator);
  m.impl("phase2_rms_norm", &phase2_rms_norm_operator);
  m.impl("phase1_rms_norm", &phase1_rms_norm_operator);
  m.impl("append_inverse_rms", &append_inverse_rms);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("phase1", &phase1, "Phase 1 of Block AttnRes over separately given blocks (forward)");
  m.def("append_inverse_rms", &append_inverse_rms, "The inverse RMS of a newly completed block, appended");
  m.def("phase1_backward", &phase1_backward, "Phase 1's backward pass");
  m.def("phase2", &phase2, "Phase 2, fused with the following RMSNorm if given (forward)");
  m.def("phase2_backward", &phase2_backward, "Phase 2, fused with the following RMSNorm if given (backward)");
  m.def("phase1_rms_norm", &phase1_rms_norm, "The RMSNorm of phase 1's result, a block's first input (forward)");
  m.def("phase1_rms_norm_backward", &phase1_rms_norm_backward, "The RMSNorm of phase 1's result (backward)");
}
