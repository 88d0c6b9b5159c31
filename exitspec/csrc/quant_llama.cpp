// A whole Llama-family forward in one call, over weights stored as the GGUF file holds them (Q4_1, Q8_0), as
// bf16 or as fp32. See exitspec/quant.py for the equations, the formats and why.
//
// Every number a row's output depends on is computed by one fixed sequence of float operations, whatever the
// number of rows in the call or the thread count: a weight product's output element (row r, column j) is one
// accumulator over the row's blocks in order, then a horizontal sum in a fixed pattern; norms, RoPE, SiLU and
// attention loop over one row at a time. Rows and columns are blocked only to share loads. So a tree's rows
// equal one-token steps bit for bit. The build turns off FMA contraction: only the explicit fused multiply-adds
// below fuse.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define EXITSPEC_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;  // values per quantized block (GGUF's QK8_0 = QK4_1 = 32)

enum Format : int64_t { F32 = 0, BF16 = 1, Q8_0 = 2, Q4_1 = 3 };

// bytes of one row of `cols` values
int64_t row_bytes(int64_t format, int64_t cols) {
  switch (format) {
    case F32: return cols * 4;
    case BF16: return cols * 2;
    case Q8_0: return cols / QK * 34;  // fp16 scale d, int8 q[32]: value = d·q
    case Q4_1: return cols / QK * 20;  // fp16 scale d, fp16 min m, 16 bytes of nibbles: value = d·q + m
  }
  TORCH_CHECK(false, "unknown weight format ", format);
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion is a dozen integer ops
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline uint16_t float_to_half(float x) { return c10::Half(x).x; }

inline float bf16_to_float(uint16_t bits) { return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16); }

// An activation block, quantized for an integer product: d·q[i] ≈ x[i], s = d·Σq (Q4_1's minimum term).
struct ActBlock {
  float d, s;
  int8_t q[QK];
};

// x [cols] → cols/32 blocks: d = max|x|/127, q = round(x/d) (ties to even), as GGUF's Q8_1 rounds activations
void quantize_activation(const float* x, int64_t cols, ActBlock* out) {
  for (int64_t b = 0; b < cols / QK; ++b) {
    const float* v = x + b * QK;
    float amax = 0.f;
    for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < QK; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * id));
      out[b].q[i] = static_cast<int8_t>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

#ifdef EXITSPEC_AVX2
// the eight lanes summed in one fixed pattern: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
using Acc = __m256;
inline Acc zero_acc() { return _mm256_setzero_ps(); }
#else
struct Acc {
  float l[8];
};
inline Acc zero_acc() { return Acc{}; }
inline float hsum(const Acc& a) {
  return ((a.l[0] + a.l[4]) + (a.l[2] + a.l[6])) + ((a.l[1] + a.l[5]) + (a.l[3] + a.l[7]));
}
#endif

// y[r, c] = Σ_k w[c, k] x[r, k] for a tile of C columns and R rows of a float-format weight (F32 or BF16):
// accumulator lane l of (r, c) sums k ≡ l (mod 8) in order, then hsum.
template <int64_t Fmt, int C, int R>
void float_tile(const uint8_t* w, int64_t wstride, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy) {
  Acc acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = zero_acc();
  for (int64_t k = 0; k < K; k += 8) {
#ifdef EXITSPEC_AVX2
    __m256 wv[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* p = w + c * wstride;
      if constexpr (Fmt == F32) {
        wv[c] = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + k);
      } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(p) + k));
        wv[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[c][r] = _mm256_fmadd_ps(wv[c], xv, acc[c][r]);
    }
#else
    for (int c = 0; c < C; ++c) {
      const uint8_t* p = w + c * wstride;
      for (int l = 0; l < 8; ++l) {
        const float wl = Fmt == F32 ? reinterpret_cast<const float*>(p)[k + l]
                                    : bf16_to_float(reinterpret_cast<const uint16_t*>(p)[k + l]);
        for (int r = 0; r < R; ++r) acc[c][r].l[l] = std::fma(wl, x[r * ldx + k + l], acc[c][r].l[l]);
      }
    }
#endif
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[r * ldy + c] = hsum(acc[c][r]);
}

// The same for a quantized weight against quantized activation blocks: per block, the exact integer dot
// Σ q_w q_x, times d_w d_x, accumulated into lane sums (a fused multiply-add), blocks in order; Q4_1 adds
// Σ_b m_w s_x (blocks in order) after the lane sum.
template <int64_t Fmt, int C, int R>
void quant_tile(const uint8_t* w, int64_t wstride, int64_t K, const ActBlock* x, int64_t ldx, float* y, int64_t ldy) {
  const int64_t nb = K / QK;
  constexpr int64_t bytes = Fmt == Q8_0 ? 34 : 20;
  Acc acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = zero_acc();
#ifdef EXITSPEC_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i low = _mm_set1_epi8(0x0f);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    float dw[C];
#ifdef EXITSPEC_AVX2
    __m256i qw[C];
#else
    int32_t qw[C][QK];
#endif
    for (int c = 0; c < C; ++c) {
      const uint8_t* blk = w + c * wstride + b * bytes;
      dw[c] = half_to_float(blk);
      if constexpr (Fmt == Q4_1) {
#ifdef EXITSPEC_AVX2
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        // byte i holds value i (low nibble) and value i + 16 (high nibble)
        qw[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
#else
        for (int i = 0; i < 16; ++i) qw[c][i] = blk[4 + i] & 15, qw[c][i + 16] = blk[4 + i] >> 4;
#endif
      } else {
#ifdef EXITSPEC_AVX2
        qw[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
#else
        for (int i = 0; i < QK; ++i) qw[c][i] = static_cast<int8_t>(blk[2 + i]);
#endif
      }
    }
    for (int r = 0; r < R; ++r) {
      const ActBlock& a = x[r * ldx + b];
#ifdef EXITSPEC_AVX2
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q));
#endif
      for (int c = 0; c < C; ++c) {
#ifdef EXITSPEC_AVX2
        __m256i pairs;  // 16 int16 sums of two products each: exact (|q_w q_x| ≤ 127·127)
        if constexpr (Fmt == Q4_1) {
          pairs = _mm256_maddubs_epi16(qw[c], qx);
        } else {
          pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(qw[c], qw[c]), _mm256_sign_epi8(qx, qw[c]));
        }
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));  // 8 exact int32 → float
        acc[c][r] = _mm256_fmadd_ps(dots, _mm256_set1_ps(dw[c] * a.d), acc[c][r]);
#else
        const float scale = dw[c] * a.d;
        for (int l = 0; l < 8; ++l) {  // lane l: the integer sum over the pairs that AVX2's lane l holds
          const int i = 4 * l;  // AVX2's int32 lane l sums bytes 4l .. 4l + 3
          const int32_t dot = qw[c][i] * a.q[i] + qw[c][i + 1] * a.q[i + 1] + qw[c][i + 2] * a.q[i + 2] +
                              qw[c][i + 3] * a.q[i + 3];
          acc[c][r].l[l] = std::fma(static_cast<float>(dot), scale, acc[c][r].l[l]);
        }
#endif
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float mins = 0.f;  // Q4_1: Σ_b m_w s_x, blocks in order
      if constexpr (Fmt == Q4_1)
        for (int64_t b = 0; b < nb; ++b) mins = std::fma(half_to_float(w + c * wstride + b * bytes + 2), x[r * ldx + b].s, mins);
      y[r * ldy + c] = hsum(acc[c][r]) + mins;
    }
}

// One weight [rows (outputs), cols (inputs)] in its format, with an optional fp32 bias [rows].
struct Weight {
  torch::Tensor data, bias;  // data: uint8 [rows, row_bytes]
  int64_t format, rows, cols, stride;

  Weight(torch::Tensor data_, int64_t format_, int64_t rows_, int64_t cols_, std::optional<torch::Tensor> bias_)
      : data(data_.contiguous()), format(format_), rows(rows_), cols(cols_), stride(row_bytes(format_, cols_)) {
    TORCH_CHECK(cols % QK == 0, "weight products need a multiple of ", QK, " inputs, got ", cols);
    TORCH_CHECK(data.dtype() == torch::kUInt8 && data.numel() == rows * stride,
                "weight data must be uint8 holding ", rows * stride, " bytes, got ", data.numel());
    if (bias_) bias = bias_->to(torch::kFloat32).contiguous();
  }
  const uint8_t* row(int64_t j) const { return data.data_ptr<uint8_t>() + j * stride; }
};

// C columns by R rows per tile; R runs 4 wide for 4+ rows (then the tail), one row at a time for a step,
// where C = 4 columns give the four independent accumulator chains a lone row needs.
template <int64_t Fmt, int C, int R>
void run_tile(const Weight& w, int64_t j, const void* x, int64_t ldx, float* y, int64_t ldy) {
  if constexpr (Fmt == F32 || Fmt == BF16) {
    float_tile<Fmt, C, R>(w.row(j), w.stride, w.cols, static_cast<const float*>(x), ldx, y + j, ldy);
  } else {
    quant_tile<Fmt, C, R>(w.row(j), w.stride, w.cols, static_cast<const ActBlock*>(x), ldx, y + j, ldy);
  }
}

template <int64_t Fmt, int C>
void run_columns(const Weight& w, int64_t j, const void* x, int64_t ldx, int64_t n, float* y, int64_t ldy) {
  const int64_t unit = Fmt == F32 || Fmt == BF16 ? sizeof(float) : sizeof(ActBlock);
  auto at = [&](int64_t r) { return static_cast<const char*>(x) + r * ldx * unit; };
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) run_tile<Fmt, C, 4>(w, j, at(r), ldx, y + r * ldy, ldy);
  switch (n - r) {
    case 3: run_tile<Fmt, C, 3>(w, j, at(r), ldx, y + r * ldy, ldy); break;
    case 2: run_tile<Fmt, C, 2>(w, j, at(r), ldx, y + r * ldy, ldy); break;
    case 1: run_tile<Fmt, C, 1>(w, j, at(r), ldx, y + r * ldy, ldy); break;
  }
}

// asks for weight rows [from, to) to be brought into the cache while the current tile computes: a core streams
// a bf16 weight at half the speed it multiplies it without this
inline void prefetch_rows(const Weight& w, int64_t from, int64_t to) {
#ifdef EXITSPEC_AVX2
  const char* p = reinterpret_cast<const char*>(w.row(from));
  for (int64_t b = 0, bytes = (to - from) * w.stride; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
#endif
}

template <int64_t Fmt>
void product(const Weight& w, const void* x, int64_t ldx, int64_t n, float* y) {
  constexpr int64_t kChunk = 32;  // output columns a task takes
  const int64_t rows = w.rows;
  at::parallel_for(0, (rows + kChunk - 1) / kChunk, 1, [&](int64_t lo, int64_t hi) {
    const int64_t last = std::min(hi * kChunk, rows);
    for (int64_t j = lo * kChunk, end = last; j < end;) {
      prefetch_rows(w, std::min(j + 4, last), std::min(j + 8, last));
      if (n == 1 && j + 4 <= end) {
        run_columns<Fmt, 4>(w, j, x, ldx, n, y, rows), j += 4;
      } else if (n > 1 && j + 2 <= end) {
        run_columns<Fmt, 2>(w, j, x, ldx, n, y, rows), j += 2;
      } else {
        run_columns<Fmt, 1>(w, j, x, ldx, n, y, rows), j += 1;
      }
    }
  });
}

// y [n, rows] = x [n, cols] · wᵀ (+ bias)
void linear(const Weight& w, const float* x, int64_t n, float* y, std::vector<ActBlock>& scratch) {
  if (w.format == F32) {
    product<F32>(w, x, w.cols, n, y);
  } else if (w.format == BF16) {
    product<BF16>(w, x, w.cols, n, y);
  } else {
    const int64_t nb = w.cols / QK;
    scratch.resize(n * nb);
    for (int64_t r = 0; r < n; ++r) quantize_activation(x + r * w.cols, w.cols, scratch.data() + r * nb);
    if (w.format == Q8_0) {
      product<Q8_0>(w, scratch.data(), nb, n, y);
    } else {
      product<Q4_1>(w, scratch.data(), nb, n, y);
    }
  }
  if (w.bias.defined()) {
    const float* b = w.bias.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < w.rows; ++j) y[r * w.rows + j] += b[j];
  }
}

// row j of w as floats
void dequantize_row(const Weight& w, int64_t j, float* out) {
  const uint8_t* p = w.row(j);
  for (int64_t b = 0; b < w.cols / QK; ++b) {
    for (int64_t i = 0; i < QK; ++i) {
      const int64_t k = b * QK + i;
      switch (w.format) {
        case F32: std::memcpy(out + k, p + 4 * k, 4); break;
        case BF16: {
          uint16_t bits;
          std::memcpy(&bits, p + 2 * k, 2);
          out[k] = bf16_to_float(bits);
          break;
        }
        case Q8_0: out[k] = half_to_float(p + b * 34) * static_cast<float>(static_cast<int8_t>(p[b * 34 + 2 + i])); break;
        case Q4_1: {
          const uint8_t byte = p[b * 20 + 4 + (i % 16)];
          const int q = i < 16 ? byte & 15 : byte >> 4;
          out[k] = half_to_float(p + b * 20) * static_cast<float>(q) + half_to_float(p + b * 20 + 2);
          break;
        }
      }
    }
  }
}

// x · rsqrt(mean(x²) + eps) · weight over each of n rows of width D (transformers' RMSNorm in fp32)
void rms_norm(const float* x, const float* weight, int64_t n, int64_t D, float eps, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const float* v = x + r * D;
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) ss += v[i] * v[i];
    const float scale = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) out[r * D + i] = weight[i] * (v[i] * scale);
  }
}

// x [hd] rotated in place by cos, sin [hd] (rotate-half: x·cos + (−x2, x1)·sin)
void rope(float* x, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] + (-b) * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

torch::Tensor dequantize(const Weight& w) {
  auto out = torch::empty({w.rows, w.cols}, torch::TensorOptions().dtype(torch::kFloat32));
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, w.rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) dequantize_row(w, j, dst + j * w.cols);
  });
  return out;
}

class Engine {
 public:
  Engine(std::vector<Weight> layer_weights, std::vector<torch::Tensor> norms, std::vector<torch::Tensor> qk_norms,
         Weight embed, Weight head, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads,
         int64_t head_dim, double eps, bool dense_prefill)
      : weights_(std::move(layer_weights)), norms_(std::move(norms)), qk_norms_(std::move(qk_norms)),
        embed_(std::move(embed)), head_(std::move(head)), cos_(cos.contiguous()), sin_(sin.contiguous()),
        heads_(heads), kv_heads_(kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)) {
    layers_ = static_cast<int64_t>(weights_.size()) / 4;
    D_ = embed_.cols;
    TORCH_CHECK(static_cast<int64_t>(norms_.size()) == 2 * layers_ + 1, "need 2 norms per layer and a final one");
    TORCH_CHECK(qk_norms_.empty() || static_cast<int64_t>(qk_norms_.size()) == 2 * layers_, "q/k norms per layer");
    if (dense_prefill) {
      for (const Weight& w : weights_) dense_.push_back(dequantize(w));
    }
  }

  // ids, positions [n]; visible [n, n] bool (row i sees new row j) or none (causal); keys, values [layers, Hkv,
  // capacity, hd] fp32, the cache, whose slots start..start+n-1 receive the new rows. Returns the logits [r, V]
  // of the last r = logits_rows rows (0: all) and the residual stream [n, D] after each layer in `taps` (the
  // last layer's after the final norm).
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward(torch::Tensor ids, torch::Tensor positions,
                                                                std::optional<torch::Tensor> visible,
                                                                torch::Tensor keys, torch::Tensor values, int64_t start,
                                                                int64_t logits_rows, std::vector<int64_t> taps) {
    const int64_t n = ids.numel(), D = D_, H = heads_, Hkv = kv_heads_, hd = hd_;
    const int64_t cap = keys.size(2);
    TORCH_CHECK(start + n <= cap, "the cache holds ", cap, " slots; ", start + n, " needed");
    TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dtype() == torch::kFloat32, "cache layout");
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    std::vector<uint8_t> sees;  // [n, n]
    if (visible) {
      auto v = visible->to(torch::kBool).contiguous();
      sees.assign(v.data_ptr<bool>(), v.data_ptr<bool>() + n * n);
    } else {
      sees.assign(n * n, 0);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) sees[i * n + j] = 1;
    }
    // a causal run of many rows (a prompt's prefill, which speculative and autoregressive decoding share) takes
    // the dense products: same weights, fp32 inputs, a BLAS's speed; trees and steps take the row-invariant kernel
    const bool causal_rows = !visible && n >= kDenseRows && !dense_.empty();
    const int64_t max_pos = cos_.size(0);
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position ", pos[i], " out of range");

    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor x_t = torch::empty({n, D}, f32);
    float* x = x_t.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < embed_.rows, "token id ", id[i], " out of range");
      dequantize_row(embed_, id[i], x + i * D);
    }
    const int64_t qkv_width = (H + 2 * Hkv) * hd;
    const int64_t inter = weights_[2].rows / 2;
    std::vector<float> h(n * D), qkv(n * qkv_width), att(n * H * hd), gate_up(n * 2 * inter), act(n * inter);
    std::vector<float> out(n * D);
    std::vector<torch::Tensor> tapped(taps.size());
    auto tap = [&](int64_t layer, const torch::Tensor& t) {
      for (size_t k = 0; k < taps.size(); ++k)
        if (taps[k] == layer) tapped[k] = t.clone();
    };
    float* kc = keys.data_ptr<float>();
    float* vc = values.data_ptr<float>();
    const float* cos = cos_.data_ptr<float>();
    const float* sin = sin_.data_ptr<float>();
    const int64_t groups = H / Hkv;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));

    for (int64_t l = 0; l < layers_; ++l) {
      rms_norm(x, norms_[2 * l].data_ptr<float>(), n, D, eps_, h.data());
      product(4 * l, h.data(), n, qkv.data(), causal_rows);
      for (int64_t i = 0; i < n; ++i) {
        float* row = qkv.data() + i * qkv_width;
        for (int64_t head = 0; head < H + Hkv; ++head) {  // the query heads, then the key heads
          float* v = row + head * hd;
          if (!qk_norms_.empty()) {
            const float* g = qk_norms_[2 * l + (head < H ? 0 : 1)].data_ptr<float>();
            rms_norm(v, g, 1, hd, eps_, v);
          }
          rope(v, cos + pos[i] * hd, sin + pos[i] * hd, hd);
        }
        for (int64_t g = 0; g < Hkv; ++g) {
          const int64_t slot = ((l * Hkv + g) * cap + start + i) * hd;
          std::memcpy(kc + slot, row + (H + g) * hd, hd * sizeof(float));
          std::memcpy(vc + slot, row + (H + Hkv + g) * hd, hd * sizeof(float));
        }
      }
      attend(qkv.data(), qkv_width, kc + l * Hkv * cap * hd, vc + l * Hkv * cap * hd, cap, start, n, sees, groups,
             scale, att.data());
      product(4 * l + 1, att.data(), n, out.data(), causal_rows);
      for (int64_t k = 0; k < n * D; ++k) x[k] = x[k] + out[k];
      rms_norm(x, norms_[2 * l + 1].data_ptr<float>(), n, D, eps_, h.data());
      product(4 * l + 2, h.data(), n, gate_up.data(), causal_rows);
      for (int64_t i = 0; i < n; ++i) {
        const float* gu = gate_up.data() + i * 2 * inter;
        for (int64_t k = 0; k < inter; ++k) {
          const float g = gu[k];
          act[i * inter + k] = (g / (1.f + std::exp(-g))) * gu[inter + k];
        }
      }
      product(4 * l + 3, act.data(), n, out.data(), causal_rows);
      for (int64_t k = 0; k < n * D; ++k) x[k] = x[k] + out[k];
      if (l < layers_ - 1) tap(l, x_t);
    }
    torch::Tensor final_t = torch::empty({n, D}, f32);
    rms_norm(x, norms_[2 * layers_].data_ptr<float>(), n, D, eps_, final_t.data_ptr<float>());
    tap(layers_ - 1, final_t);
    const int64_t r = logits_rows > 0 ? std::min(logits_rows, n) : n;
    torch::Tensor logits = torch::empty({r, head_.rows}, f32);
    linear(head_, final_t.data_ptr<float>() + (n - r) * D, r, logits.data_ptr<float>(), scratch_);
    return {logits, tapped};
  }

 private:
  static constexpr int64_t kDenseRows = 8;  // causal rows from which a forward takes the dense products

  // y [n, rows] = x [n, cols] · W_iᵀ (+ bias) for layer weight i: the kernel's product, or with `dense` the BLAS's
  // over the weight's values in fp32 (dense_, decoded once at load)
  void product(int64_t i, const float* x, int64_t n, float* y, bool dense) {
    const Weight& w = weights_[i];
    if (!dense) return linear(w, x, n, y, scratch_);
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    auto xt = torch::from_blob(const_cast<float*>(x), {n, w.cols}, f32);
    auto yt = torch::from_blob(y, {n, w.rows}, f32);
    if (w.bias.defined()) {
      at::addmm_out(yt, w.bias, xt, dense_[i].t());
    } else {
      at::mm_out(yt, xt, dense_[i].t());
    }
  }

  // att [n, H·hd]: row i's query head h against KV head h / groups over the cache (slots < start) and the new
  // rows it sees, keys in slot order: s_j = scale·q·k_j, w_j = exp(s_j − max s), out = Σ w_j v_j / Σ w_j.
  void attend(const float* qkv, int64_t qkv_width, const float* keys, const float* values, int64_t cap,
              int64_t start, int64_t n, const std::vector<uint8_t>& sees, int64_t groups, float scale,
              float* att) const {
    const int64_t H = heads_, hd = hd_;
    at::parallel_for(0, n * H, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> score(start + n);
      std::vector<int64_t> slots(start + n);
      std::vector<float> acc(hd);
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t i = task / H, head = task % H, g = head / groups;
        const float* q = qkv + i * qkv_width + head * hd;
        const float* K = keys + g * cap * hd;
        const float* V = values + g * cap * hd;
        int64_t count = 0;
        for (int64_t j = 0; j < start; ++j) slots[count++] = j;
        for (int64_t j = 0; j < n; ++j)
          if (sees[i * n + j]) slots[count++] = start + j;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < count; ++t) {
          score[t] = scale * dot(q, K + slots[t] * hd, hd);
          top = std::max(top, score[t]);
        }
        float total = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < count; ++t) {
          const float wt = std::exp(score[t] - top);
          total += wt;
          const float* v = V + slots[t] * hd;
          for (int64_t d = 0; d < hd; ++d) acc[d] = acc[d] + wt * v[d];
        }
        float* o = att + i * H * hd + head * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = acc[d] / total;
      }
    });
  }

  static float dot(const float* a, const float* b, int64_t count) {
#ifdef EXITSPEC_AVX2
    if (count % 8 == 0) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < count; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
      return hsum(acc);
    }
#endif
    float s = 0.f;
    for (int64_t d = 0; d < count; ++d) s += a[d] * b[d];
    return s;
  }

  std::vector<Weight> weights_;  // per layer: W_qkv, W_o, W_gate_up, W_down
  std::vector<torch::Tensor> dense_;  // the same weights' values, fp32 [rows, cols] (empty: no dense products)
  std::vector<torch::Tensor> norms_, qk_norms_;
  Weight embed_, head_;
  torch::Tensor cos_, sin_;  // [max positions, hd]
  int64_t heads_, kv_heads_, hd_, layers_, D_;
  float eps_;
  std::vector<ActBlock> scratch_;
};

// float weight [rows, cols] → its bytes in `format` (GGUF's reference quantizers: Q8_0 d = max|x|/127,
// q = round(x/d); Q4_1 d = (max − min)/15, m = min, q = min(15, trunc((x − m)/d + 0.5)); scales in fp16)
torch::Tensor quantize(torch::Tensor weight, int64_t format) {
  auto w = weight.to(torch::kFloat32).contiguous();
  const int64_t rows = w.size(0), cols = w.size(1);
  TORCH_CHECK(cols % QK == 0, "quantized formats need a multiple of ", QK, " inputs, got ", cols);
  const int64_t stride = row_bytes(format, cols);
  auto out = torch::empty({rows, stride}, torch::TensorOptions().dtype(torch::kUInt8));
  const float* src = w.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const float* x = src + j * cols;
      uint8_t* row = dst + j * stride;
      if (format == F32) {
        std::memcpy(row, x, cols * 4);
      } else if (format == BF16) {
        for (int64_t k = 0; k < cols; ++k) {
          const uint16_t bits = c10::BFloat16(x[k]).x;  // round to nearest even
          std::memcpy(row + 2 * k, &bits, 2);
        }
      } else if (format == Q8_0) {
        for (int64_t b = 0; b < cols / QK; ++b) {
          const float* v = x + b * QK;
          float amax = 0.f;
          for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
          const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
          const uint16_t dh = float_to_half(d);
          std::memcpy(row + b * 34, &dh, 2);
          for (int64_t i = 0; i < QK; ++i) row[b * 34 + 2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::round(v[i] * id)));
        }
      } else {
        for (int64_t b = 0; b < cols / QK; ++b) {
          const float* v = x + b * QK;
          float lo_v = v[0], hi_v = v[0];
          for (int64_t i = 1; i < QK; ++i) lo_v = std::min(lo_v, v[i]), hi_v = std::max(hi_v, v[i]);
          const float d = (hi_v - lo_v) / 15.f, id = d != 0.f ? 1.f / d : 0.f;
          const uint16_t dh = float_to_half(d), mh = float_to_half(lo_v);
          std::memcpy(row + b * 20, &dh, 2);
          std::memcpy(row + b * 20 + 2, &mh, 2);
          for (int64_t i = 0; i < 16; ++i) {
            const int q0 = std::min(15, static_cast<int>((v[i] - lo_v) * id + 0.5f));
            const int q1 = std::min(15, static_cast<int>((v[i + 16] - lo_v) * id + 0.5f));
            row[b * 20 + 4 + i] = static_cast<uint8_t>(q0 | (q1 << 4));
          }
        }
      }
    }
  });
  return out;
}


// x [n, cols] fp32 → x · wᵀ (+ bias) [n, rows]: one product, as the forward runs it
torch::Tensor product_of(const Weight& w, torch::Tensor x) {
  auto xc = x.to(torch::kFloat32).contiguous();
  TORCH_CHECK(xc.dim() == 2 && xc.size(1) == w.cols, "x must be [n, ", w.cols, "]");
  auto y = torch::empty({xc.size(0), w.rows}, xc.options());
  std::vector<ActBlock> scratch;
  linear(w, xc.data_ptr<float>(), xc.size(0), y.data_ptr<float>(), scratch);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("F32") = static_cast<int64_t>(F32);
  m.attr("BF16") = static_cast<int64_t>(BF16);
  m.attr("Q8_0") = static_cast<int64_t>(Q8_0);
  m.attr("Q4_1") = static_cast<int64_t>(Q4_1);
  m.def("row_bytes", &row_bytes);
  m.def("quantize", &quantize);
  m.def("dequantize", &dequantize);
  m.def("product", &product_of);
  pybind11::class_<Weight>(m, "Weight")
      .def(pybind11::init<torch::Tensor, int64_t, int64_t, int64_t, std::optional<torch::Tensor>>(),
           pybind11::arg("data"), pybind11::arg("format"), pybind11::arg("rows"), pybind11::arg("cols"),
           pybind11::arg("bias") = pybind11::none())
      .def_readonly("rows", &Weight::rows)
      .def_readonly("cols", &Weight::cols)
      .def_readonly("format", &Weight::format);
  pybind11::class_<Engine>(m, "Engine")
      .def(pybind11::init<std::vector<Weight>, std::vector<torch::Tensor>, std::vector<torch::Tensor>, Weight, Weight,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double, bool>())
      .def("forward", &Engine::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
