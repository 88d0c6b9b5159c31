// Batch-invariant attention on the CPU: every query row is computed alone, over its own keys in position order,
// by the same sequence of float operations whatever the number of rows, the tree's layout or the thread count.
// See exitspec/attention.py for the equations and why.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for x <= 0 (a score minus the row's top) as plain arithmetic, so that a vector lane and the scalar tail
// compute it alike (a libm call differs between its vector and scalar versions): x = k ln 2 + r, |r| <= ln 2 / 2,
// exp(r) by its degree-6 Taylor polynomial (relative error < 3e-7), times 2^k built from the exponent bits.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // below this exp is under float's normal range: clamp rather than build a subnormal
  const int32_t k = static_cast<int32_t>(x * 1.44269504f - 0.5f);  // round(x / ln 2) for x <= 0
  const float kf = static_cast<float>(k);
  const float r = (x - kf * 0.693145752f) - kf * 1.42860677e-06f;
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f + r * 1.3888889e-3f)))));
  return p * __builtin_bit_cast(float, (k + 127) << 23);
}

// src [count] to float: bf16 by its bits (a loop the compiler vectorises), other types by their conversion
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < count; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(bits[i]) << 16);
  } else {
    for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

constexpr int64_t kRows = 8;   // at most this many query rows computed together (register blocking: a block of
                               // up to 4 rows runs 4 wide, a bigger one 8; each row's arithmetic is its own)
constexpr int64_t kLanes = 16; // keys scored together, one per vector lane

// Every number a row's output depends on is computed by one fixed sequence of float operations: its score for a
// key is q[0]·k[0] + q[1]·k[1] + ... in order of d (vectorised across keys, never across d), its softmax and
// value sums run over its keys in position order (vectorised across d, never across keys). Rows are blocked only
// to share loads. The build turns off FMA contraction, so a vector lane and the scalar tail of a loop round alike
// (-fno-trapping-math only lets the exponential's loop vectorise; it changes no result).
template <int64_t HD>
struct Block {
  const float* keys_t;    // [hd, ≥T] of this head, row d at keys_t + d * kstride
  const float* values_f;  // [≥T, hd] of this head
  int64_t kstride, hd, total, start, n;

  int64_t dim() const { return HD ? HD : hd; }

  // scores [rows, T] of up to R queries [rows, hd] against every key
  template <int64_t R>
  void score(const float* query, int64_t rows, float* scores) const {
    const int64_t D = dim();
    int64_t j = 0;
    for (; j + kLanes <= total; j += kLanes) {
      float acc[R][kLanes] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float* k = keys_t + d * kstride + j;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += query[r * D + d] * k[l];
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t l = 0; l < kLanes; ++l) scores[r * total + j + l] = acc[r][l];
    }
    for (; j < total; ++j)
      for (int64_t r = 0; r < rows; ++r) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += query[r * D + d] * keys_t[d * kstride + j];
        scores[r * total + j] = acc;
      }
  }

  // out [rows, hd] = Σ_i w[r][i] v[key i] / Σ_i w[r][i] over the cache's keys, then each row's own `extra` keys
  template <int64_t R>
  void weigh(const float* weights, const int64_t* extra, const int64_t* extra_count, int64_t rows, float* out) const {
    const int64_t D = dim();
    float acc[R][HD ? HD : 1];
    float* a = HD ? &acc[0][0] : out;  // runtime hd accumulates in `out` itself
    for (int64_t i = 0; i < R * D; ++i) a[i] = 0.f;
    for (int64_t j = 0; j < start; ++j) {
      const float* v = values_f + j * D;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) a[r * D + d] += weights[r * total + j] * v[d];
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* w = weights + r * total;
      float lanes[kLanes] = {};  // the row's i-th key adds to lane i mod kLanes: a fixed order, and vectorised
      int64_t j = 0;
      for (; j + kLanes <= start; j += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] += w[j + l];
      for (; j < start; ++j) lanes[j % kLanes] += w[j];
      for (int64_t i = 0; i < extra_count[r]; ++i) {
        const int64_t key = extra[r * n + i];
        const float* v = values_f + key * D;
        lanes[(start + i) % kLanes] += w[key];
        for (int64_t d = 0; d < D; ++d) a[r * D + d] += w[key] * v[d];
      }
      float sum = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
      for (int64_t d = 0; d < D; ++d) out[r * D + d] = a[r * D + d] / sum;
    }
  }
};

template <typename scalar_t, int64_t HD>
void attend_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& visible,
                 int64_t start, double scale, at::Tensor& out) {
  const int64_t kv_heads = q.size(0), rows_per_head = q.size(1) * q.size(2), n = q.size(2), hd = q.size(3);
  const int64_t total = start + n, blocks = (rows_per_head + kRows - 1) / kRows;
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const bool* seen = visible.data_ptr<bool>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const float scale_f = static_cast<float>(scale);
  std::vector<int64_t> extra(n * n), extra_count(n, 0);  // row r's ancestors-or-self among the new keys, in order
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < n; ++j)
      if (seen[r * n + j]) extra[r * n + extra_count[r]++] = start + j;
  const float* keys_t = keys.data_ptr<float>();
  const float* values_f = values.data_ptr<float>();
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(kRows * hd, 0.f), scores(kRows * total), result(kRows * hd);
    std::vector<int64_t> row_extra(kRows * n), row_count(kRows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t head = item / blocks, first = (item % blocks) * kRows;
      const int64_t rows = std::min(kRows, rows_per_head - first);
      const Block<HD> block{keys_t + head * keys.stride(0), values_f + head * values.stride(0), keys.stride(1), hd,
                            total, start, n};
      const scalar_t* qh = q_data + (head * rows_per_head + first) * hd;  // q is contiguous [Hkv, g, n, hd]
      to_float(qh, query.data(), rows * hd);
      if (rows <= kRows / 2) block.template score<kRows / 2>(query.data(), rows, scores.data());
      else block.template score<kRows>(query.data(), rows, scores.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = (first + r) % n;  // the query's token among the n new ones
        row_count[r] = extra_count[row];
        std::copy_n(extra.data() + row * n, n, row_extra.data() + r * n);
        float* s = scores.data() + r * total;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < total; ++j) s[j] *= scale_f;
        for (int64_t j = 0; j < start; ++j) top = std::max(top, s[j]);
        for (int64_t i = 0; i < row_count[r]; ++i) top = std::max(top, s[row_extra[r * n + i]]);
        for (int64_t j = 0; j < total; ++j) s[j] = exp_nonpositive(s[j] - top);  // unseen keys' weights go unread
      }
      if (rows <= kRows / 2) block.template weigh<kRows / 2>(scores.data(), row_extra.data(), row_count.data(), rows, result.data());
      else block.template weigh<kRows>(scores.data(), row_extra.data(), row_count.data(), rows, result.data());
      scalar_t* o = out_data + (head * rows_per_head + first) * hd;
      for (int64_t i = 0; i < rows * hd; ++i) o[i] = static_cast<scalar_t>(result[i]);
    }
  });
}

}  // namespace

// q [Hkv, g, n, hd]; keys [Hkv, hd, ≥ start + n] and values [Hkv, ≥ start + n, hd], float, last dim contiguous
// (the lean forward's float cache); visible [n, n] bool.
at::Tensor invariant_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& visible, int64_t start, double scale) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 3 && values.dim() == 3, "q [Hkv, g, n, hd], keys [Hkv, hd, T], values [Hkv, T, hd]");
  TORCH_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat, "float keys and values");
  TORCH_CHECK((keys.size(2) == 1 || keys.stride(2) == 1) && values.stride(2) == 1 &&
              (values.size(1) == 1 || values.stride(1) == values.size(2)), "keys and values need contiguous rows");
  TORCH_CHECK(keys.size(1) == q.size(3) && values.size(2) == q.size(3), "head dims differ");
  TORCH_CHECK(keys.size(2) >= start + q.size(2) && values.size(1) >= start + q.size(2), "too few keys");
  const int64_t n = q.size(2);
  TORCH_CHECK(q.size(3) <= 256, "head dimension over 256");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.size(0) == n && visible.size(1) == n, "visible [n, n] bool");
  at::Tensor query = q.contiguous(), seen = visible.contiguous();
  at::Tensor out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "invariant_attention", [&] {
    if (query.size(3) == 64) attend_rows<scalar_t, 64>(query, keys, values, seen, start, scale, out);
    else if (query.size(3) == 128) attend_rows<scalar_t, 128>(query, keys, values, seen, start, scale, out);
    else attend_rows<scalar_t, 0>(query, keys, values, seen, start, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("invariant_attention", &invariant_attention, "batch-invariant attention over a cache and a tree (CPU)");
}
