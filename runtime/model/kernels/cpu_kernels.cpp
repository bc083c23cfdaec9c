// CPU kernels for the native runtime (x86-64 with AVX-512): the serving path's decode step without
// chains of small ATen calls and without streaming fp32 weights.
//
// packed_linear y = x W^T with W kept as the release stores it: FP8 e4m3 in 128x128 scaled blocks (a
//              quarter of the fp32 bytes; each block's partial sum is scaled once, as DeepGEMM does), or
//              BF16 for the few weights the release does not quantize.
// moe          a whole MoE layer (routing, routed and shared experts) for a ragged set of tokens.
// mla_prepare  absorbed-MLA queries of new tokens; their latents normalized, roped, written to the cache.
// mla_attention absorbed MLA over the paged latent cache, read in place through the block tables.
// rms_norm     RMSNorm of rows.
// decoder_layer all of the above for one decoder layer, in one call; decoder_layers for all of a model's;
//              mtp_layer the same for an MTP module; mtp_greedy_drafts its greedy chain of k drafts;
//              greedy_step a whole greedy step (drafts, verification, acceptance; k per sequence, 0: plain decoding).
// uniforms, race the counter-based draws of runtime.core.sampling and a seeded sampled row's token.
//
// Every output row is computed with the same arithmetic in the same order whatever the other rows
// of the batch are, so a request's result does not depend on what it is batched with.
// Threads (torch.get_num_threads() of them; see Pool) split the work by output columns, rows, tokens, whole routed
// experts and the shared expert's fixed halves, never inside a sum, so the bits do not depend on the number of
// threads either.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <pthread.h>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kBlock = 128;  // FP8 scale block (both dims)
constexpr int64_t kLanes = 16;   // floats per AVX-512 register; weights are packed in panels of 16 rows

// The kernels' threads: torch.get_num_threads() of them as the calling thread sees it (set_num_threads before
// the executor thread starts), the caller included, in a pool whose workers spin
// for a while after each job (a decode step's jobs come microseconds apart), then sleep. Not OpenMP: libgomp
// cuts its spinning to almost nothing once a second thread of the process runs parallel regions (the
// executor's thread besides the main one), and a futex wake per region costs as much as a small kernel.
// One job at a time; a nested call, or one made while another thread's job runs, runs on its caller alone.
class Pool {
 public:
  // Leaked on purpose: no destructor runs at exit to meet joinable workers (std::terminate); its workers, idle at
  // exit (runtime.executor stops its step loops first), just end with the process. A forked child starts a new
  // one (the parent's workers do not exist there, and a lock one of them held would stay held).
  static Pool& get() {
    static std::once_flag once;
    std::call_once(once, [] { pthread_atfork(nullptr, nullptr, [] { instance().store(nullptr); }); });
    Pool* pool = instance().load();
    if (pool == nullptr) {
      Pool* fresh = new Pool();
      if (instance().compare_exchange_strong(pool, fresh)) return *fresh;
      delete fresh;  // another thread made one first (no worker was started yet)
    }
    return *pool;
  }

  // fn(begin, end) over [0, n), `chunk` items at a time, every chunk once. Rethrows the first error.
  void run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
    if (threads <= 1 || inside_ || !busy_.try_lock()) {
      if (n > 0) fn(0, n);
      return;
    }
    std::lock_guard<std::mutex> job_lock(busy_, std::adopt_lock);
    while (static_cast<int64_t>(workers_.size()) < threads - 1)
      workers_.emplace_back([this, i = static_cast<int64_t>(workers_.size())] { work(i); });
    {
      std::lock_guard<std::mutex> lk(m_);
      fn_ = &fn;
      n_ = n;
      chunk_ = chunk;
      helpers_ = threads - 1;
      next_ = 0;
      done_ = 0;
      error_ = nullptr;
      open_ = true;
      ++generation_;
      if (sleepers_) wake_.notify_all();
    }
    inside_ = true;
    drain();
    inside_ = false;
    while (done_.load(std::memory_order_acquire) < n) _mm_pause();
    {
      std::lock_guard<std::mutex> lk(m_);
      open_ = false;  // late workers skip this job
    }
    while (users_.load(std::memory_order_acquire) > 0) _mm_pause();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(500);

  static std::atomic<Pool*>& instance() {
    static std::atomic<Pool*> pool{nullptr};
    return pool;
  }

  void drain() {
    for (;;) {
      const int64_t b = next_.fetch_add(chunk_);
      if (b >= n_) return;
      const int64_t e = std::min(n_, b + chunk_);
      try {
        (*fn_)(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lk(m_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(e - b, std::memory_order_release);
    }
  }

  void work(int64_t index) {
    inside_ = true;
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
        std::this_thread::yield();  // a runnable thread on this core (the server, a client) goes first
      std::unique_lock<std::mutex> lk(m_);
      if (generation_ == seen) {
        ++sleepers_;
        wake_.wait(lk, [&] { return generation_ != seen; });
        --sleepers_;
      }
      seen = generation_;
      if (!open_ || index >= helpers_) continue;
      users_.fetch_add(1, std::memory_order_acq_rel);
      lk.unlock();
      drain();
      users_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex busy_, m_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0}, done_{0}, users_{0};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1, helpers_ = 0, sleepers_ = 0;
  bool open_ = false;
  std::exception_ptr error_;
  static thread_local bool inside_;
};
thread_local bool Pool::inside_ = false;

void parallel(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t chunk = 1) { Pool::get().run(n, chunk, fn); }

// Weight formats: 16 consecutive stored values -> 16 floats.
// Fp8: e4m3 bytes -> the e4m3 values times 2^-8. Sign-extending each byte to 16 bits and shifting it
// left by 7 gives the fp16 pattern s|s|eeee|mmm|0000000; clearing bit 14 leaves s|0|eeee|mmm, an fp16
// 2^8 times smaller than the e4m3 value, subnormals included. The 2^8 is folded into the block scales.
struct Fp8 {
  using T = uint8_t;
  static __m512 load16(const T* p) {
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF))));
  }
};
// Bf16: the weights a release keeps in BF16 (heads, eh_proj), exactly; block scales are all 1.
struct Bf16 {
  using T = uint16_t;
  static __m512 load16(const T* p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
};

// y[MT rows, NT*16 cols] = x[MT, K] . panels (ldp rows apart); `scale` holds one entry per k-block of this n-block.
// Only the k-block's sums live in registers (MT * NT, the rows' broadcasts and one weight vector beside them); the
// running sums wait in L1 between k-blocks, so that wide tiles fit: each converted weight vector serves MT rows.
template <class W, int MT, int NT>
void gemm_tile(const float* x, int64_t K, const typename W::T* panels, int64_t ldp, const float* scale, float* y,
               int64_t N, int64_t last_cols) {
  alignas(64) float acc[MT][NT * kLanes];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) _mm512_store_ps(acc[m] + j * kLanes, _mm512_setzero_ps());
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    __m512 part[MT][NT];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NT; ++j) part[m][j] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      __m512 xb[MT];
      for (int m = 0; m < MT; ++m) xb[m] = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < NT; ++j) {
        const __m512 w = W::load16(panels + (j * ldp + k) * kLanes);
        for (int m = 0; m < MT; ++m) part[m][j] = _mm512_fmadd_ps(xb[m], w, part[m][j]);
      }
    }
    const __m512 s = _mm512_set1_ps(scale[k0 / kBlock]);
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NT; ++j)
        _mm512_store_ps(acc[m] + j * kLanes, _mm512_fmadd_ps(part[m][j], s, _mm512_load_ps(acc[m] + j * kLanes)));
  }
  const __mmask16 tail = last_cols >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << last_cols) - 1);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j)
      _mm512_mask_storeu_ps(y + m * N + j * kLanes, j == NT - 1 ? tail : 0xFFFF, _mm512_load_ps(acc[m] + j * kLanes));
}

// MT rows against panels [p0, p1) (all inside one 128-row n-block), NT panels at a time, the rest NT/2 at a time
// and so on (one panel per tile would leave a single FMA chain, waiting on its own latency).
template <class W, int MT, int NT>
void gemm_rows(const float* x, int64_t K, const typename W::T* packed, int64_t ldp, const float* scale, int64_t lds,
               float* y, int64_t N, int64_t p0, int64_t p1) {
  const float* s = scale + (p0 * kLanes / kBlock) * lds;
  int64_t p = p0;
  for (; p + NT <= p1; p += NT)
    gemm_tile<W, MT, NT>(x, K, packed + p * ldp * kLanes, ldp, s, y + p * kLanes, N,
                         std::min(kLanes, N - (p + NT - 1) * kLanes));
  if constexpr (NT > 1)
    if (p < p1) gemm_rows<W, MT, NT / 2>(x, K, packed, ldp, scale, lds, y, N, p, p1);
}

// y[MT, NT*16] (+)= (sum over one k-block of x . w) * s, with the block's weights already
// converted to floats in `w` [k, NT*16]: the same arithmetic as gemm_tile, for many rows.
template <int MT, int NT>
void block_tile(const float* x, int64_t ldx, const float* w, int64_t klen, float s, float* y, int64_t ldy,
                int64_t last_cols, bool first) {
  __m512 part[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) part[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < klen; ++k) {
    __m512 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = _mm512_loadu_ps(w + (k * NT + j) * kLanes);
    for (int m = 0; m < MT; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int j = 0; j < NT; ++j) part[m][j] = _mm512_fmadd_ps(xb, wv[j], part[m][j]);
    }
  }
  const __m512 sv = _mm512_set1_ps(s);
  const __mmask16 tail = last_cols >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << last_cols) - 1);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) {
      const __mmask16 mask = j == NT - 1 ? tail : 0xFFFF;
      float* dst = y + m * ldy + j * kLanes;
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, dst);
      _mm512_mask_storeu_ps(dst, mask, _mm512_fmadd_ps(part[m][j], sv, prev));
    }
}

template <int NT>
void block_rows(const float* x, int64_t M, int64_t K, int64_t k0, const float* w, int64_t klen, float s, float* y,
                int64_t N, int64_t last_cols) {
  const bool first = k0 == 0;
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) block_tile<6, NT>(x + m * K + k0, K, w, klen, s, y + m * N, N, last_cols, first);
  const float* xr = x + m * K + k0;
  float* yr = y + m * N;
  switch (M - m) {
    case 5: block_tile<5, NT>(xr, K, w, klen, s, yr, N, last_cols, first); break;
    case 4: block_tile<4, NT>(xr, K, w, klen, s, yr, N, last_cols, first); break;
    case 3: block_tile<3, NT>(xr, K, w, klen, s, yr, N, last_cols, first); break;
    case 2: block_tile<2, NT>(xr, K, w, klen, s, yr, N, last_cols, first); break;
    case 1: block_tile<1, NT>(xr, K, w, klen, s, yr, N, last_cols, first); break;
    default: break;
  }
}

// Many rows: each (two panels x one k-block) of weights is converted once into an L1-sized buffer and
// used by every row, instead of once per six rows.
template <class W>
void gemm_many_rows(const float* x, int64_t M, int64_t K, const typename W::T* packed, int64_t ldp, const float* scale,
                    int64_t lds, float* y, int64_t N, int64_t p0, int64_t p1) {
  alignas(64) float w[kBlock * 2 * kLanes];
  const float* s = scale + (p0 * kLanes / kBlock) * lds;
  for (int64_t p = p0; p < p1; p += 2) {
    const int64_t nt = std::min<int64_t>(2, p1 - p), last = std::min(kLanes, N - (p + nt - 1) * kLanes);
    for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
      const int64_t klen = std::min(kBlock, K - k0);
      for (int64_t k = 0; k < klen; ++k)
        for (int64_t j = 0; j < nt; ++j)
          _mm512_store_ps(w + (k * nt + j) * kLanes, W::load16(packed + ((p + j) * ldp + k0 + k) * kLanes));
      if (nt == 2) block_rows<2>(x, M, K, k0, w, klen, s[k0 / kBlock], y + p * kLanes, N, last);
      else block_rows<1>(x, M, K, k0, w, klen, s[k0 / kBlock], y + p * kLanes, N, last);
    }
  }
}

// y[M, N] = x[M, K] W^T for W packed as [ceil(N/16), K, 16] values with scale [ceil(N/128), ceil(K/128)].
// Up to six rows convert weights in registers; more go through gemm_many_rows (same sums, same order).
// A part of a wider weight: its panels ldp rows apart and its scale rows lds apart; the part must start at a
// 128-block boundary in both dimensions, or lie inside one block in that dimension.
template <class W>
void packed_gemm(const float* x, int64_t M, int64_t K, const typename W::T* packed, const float* scale, int64_t N,
                 float* y, int64_t ldp = 0, int64_t lds = 0) {
  const int64_t panels = (N + kLanes - 1) / kLanes, per_block = kBlock / kLanes;
  if (ldp == 0) ldp = K;
  if (lds == 0) lds = (K + kBlock - 1) / kBlock;
  const int64_t n_blocks = (panels + per_block - 1) / per_block;
  // Fewer column blocks than threads (a narrow weight, q_a or kv_a): the rows are split too, eight or more
  // each side; a row's sums are the same in any group of rows.
  const int64_t threads = at::get_num_threads();
  const int64_t row_parts = n_blocks < threads ? std::max<int64_t>(1, std::min(threads / n_blocks, M / 8)) : 1;
  parallel(n_blocks * row_parts, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i % n_blocks, m0 = i / n_blocks * M / row_parts, m1 = (i / n_blocks + 1) * M / row_parts;
      const int64_t p0 = b * per_block, p1 = std::min(panels, p0 + per_block);
      const float* xr = x + m0 * K;
      float* yr = y + m0 * N;
      switch (m1 - m0) {
        case 6: gemm_rows<W, 6, 4>(xr, K, packed, ldp, scale, lds, yr, N, p0, p1); break;
        case 5: gemm_rows<W, 5, 4>(xr, K, packed, ldp, scale, lds, yr, N, p0, p1); break;
        case 4: gemm_rows<W, 4, 4>(xr, K, packed, ldp, scale, lds, yr, N, p0, p1); break;
        case 3: gemm_rows<W, 3, 8>(xr, K, packed, ldp, scale, lds, yr, N, p0, p1); break;
        case 2: gemm_rows<W, 2, 8>(xr, K, packed, ldp, scale, lds, yr, N, p0, p1); break;
        case 1: gemm_rows<W, 1, 8>(xr, K, packed, ldp, scale, lds, yr, N, p0, p1); break;
        case 0: break;
        default: gemm_many_rows<W>(xr, m1 - m0, K, packed, ldp, scale, lds, yr, N, p0, p1);
      }
    }
  });
}

// r[i] = sum of the 16 lanes of v[i]: halves, quarters, pairs and lanes added in a tree (45 operations
// instead of 16 separate horizontal sums).
inline __m512 sum16(const __m512* v) {
  __m512 h[8], q[4], p[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: [v2i lo+hi | v2i+1 lo+hi]
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: one per vector, in order 4i..4i+3
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88), _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs of lanes within each quarter
    p[i] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0x44), _mm512_shuffle_ps(q[2 * i], q[2 * i + 1], 0xEE));
  __m512 r = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x88), _mm512_shuffle_ps(p[0], p[1], 0xDD));
  // lane order is now (vector index) 0,4,8,12 | 1,5,9,13 | ... per quarter: put it back to 0..15
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

inline __m512 exp16(__m512 x) {  // exp, ~1 ulp (x clamped at -87): 2^n * p(r), r = x - n ln2, |r| <= ln2/2
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // operand order: a NaN in x comes through
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// out[0:m] = scale * (a[0:n] @ W[n, m]), m a multiple of 16: broadcast-FMA over rows of W, 4 chains.
inline void matvec(const float* a, int64_t n, const float* W, int64_t m, float scale, float* out) {
  int64_t j = 0;
  for (; j + 4 * kLanes <= m; j += 4 * kLanes) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n; ++i) {
      const __m512 b = _mm512_set1_ps(a[i]);
      const float* w = W + i * m + j;
      a0 = _mm512_fmadd_ps(b, _mm512_loadu_ps(w), a0);
      a1 = _mm512_fmadd_ps(b, _mm512_loadu_ps(w + kLanes), a1);
      a2 = _mm512_fmadd_ps(b, _mm512_loadu_ps(w + 2 * kLanes), a2);
      a3 = _mm512_fmadd_ps(b, _mm512_loadu_ps(w + 3 * kLanes), a3);
    }
    const __m512 sv = _mm512_set1_ps(scale);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(a0, sv));
    _mm512_storeu_ps(out + j + kLanes, _mm512_mul_ps(a1, sv));
    _mm512_storeu_ps(out + j + 2 * kLanes, _mm512_mul_ps(a2, sv));
    _mm512_storeu_ps(out + j + 3 * kLanes, _mm512_mul_ps(a3, sv));
  }
  for (; j < m; j += kLanes) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) acc = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), _mm512_loadu_ps(W + i * m + j), acc);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
  }
}

// y[0:n] = x * rsqrt(mean(x^2) + eps) * w
inline void rms_norm_row(const float* x, int64_t n, const float* w, float eps, float* y) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mk = i + kLanes <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(mk, x + i);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mk = i + kLanes <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, mk, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, x + i), r), _mm512_maskz_loadu_ps(mk, w + i)));
  }
}

// Interleaved pairs (x0, x1), (x2, x3)... rotated by rot = (re, im) per pair, times `scale`.
inline void rope_row(const float* x, const float* rot, int64_t pairs, float scale, float* y) {
  for (int64_t i = 0; i < pairs; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1], re = rot[2 * i], im = rot[2 * i + 1];
    y[2 * i] = (a * re - b * im) * scale;
    y[2 * i + 1] = (a * im + b * re) * scale;
  }
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "cpu_kernels: ", what); }

}  // namespace

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale, int64_t N) {
  check(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check(packed.dim() == 3 && packed.size(0) == (N + kLanes - 1) / kLanes && packed.size(1) == K &&
            packed.size(2) == kLanes && packed.is_contiguous(), "packed weight shape");
  check(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.size(0) == (N + kBlock - 1) / kBlock &&
            scale.size(1) == (K + kBlock - 1) / kBlock, "scale shape");
  auto y = torch::empty({M, N}, x.options());
  if (packed.scalar_type() == torch::kUInt8)
    packed_gemm<Fp8>(x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), N, y.data_ptr<float>());
  else if (packed.scalar_type() == torch::kBFloat16)
    packed_gemm<Bf16>(x.data_ptr<float>(), M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                      scale.data_ptr<float>(), N, y.data_ptr<float>());
  else
    check(false, "packed weights must be uint8 (e4m3) or bfloat16");
  return y;
}

namespace {

// One FP8 MLP's packed weights, down(silu(gate(x)) * up(x)); for stacked experts, expert 0's, and
// `expert(e)` moves to expert e.
struct Mlp {
  const uint8_t *gate, *up, *down;
  const float *gate_scale, *up_scale, *down_scale;
  int64_t inter, panel_stride, down_stride, scale_stride, down_scale_stride;

  Mlp expert(int64_t e) const {
    return {gate + e * panel_stride, up + e * panel_stride, down + e * down_stride, gate_scale + e * scale_stride,
            up_scale + e * scale_stride, down_scale + e * down_scale_stride, inter, 0, 0, 0, 0};
  }
};

// Panels [(E,) I/16, H, 16] / [(E,) H/16, I, 16] with their block scales, checked once per call.
Mlp checked_mlp(const torch::Tensor& gate, const torch::Tensor& gs, const torch::Tensor& up, const torch::Tensor& us,
                const torch::Tensor& down, const torch::Tensor& ds) {
  check(gate.scalar_type() == torch::kUInt8 && up.scalar_type() == torch::kUInt8 && down.scalar_type() == torch::kUInt8 &&
            gate.is_contiguous() && up.sizes() == gate.sizes() && up.is_contiguous() && down.is_contiguous() &&
            gate.size(-1) == kLanes && down.size(-1) == kLanes && down.size(-2) == gate.size(-3) * kLanes &&
            down.size(-3) * kLanes == gate.size(-2), "FP8 MLP panels [I/16, H, 16] and [H/16, I, 16]");
  const int64_t inter = gate.size(-3) * kLanes, hidden = gate.size(-2);
  check(gs.scalar_type() == torch::kFloat && us.scalar_type() == torch::kFloat && ds.scalar_type() == torch::kFloat &&
            gs.is_contiguous() && us.sizes() == gs.sizes() && us.is_contiguous() && ds.is_contiguous() &&
            gs.size(-2) == (inter + kBlock - 1) / kBlock && gs.size(-1) == (hidden + kBlock - 1) / kBlock &&
            ds.size(-2) == (hidden + kBlock - 1) / kBlock && ds.size(-1) == (inter + kBlock - 1) / kBlock &&
            gs.dim() == gate.dim() - 1 && ds.dim() == down.dim() - 1, "FP8 MLP block scales");
  const int64_t n = gate.dim() == 4 ? gate.size(0) : 1;
  return {gate.data_ptr<uint8_t>(), up.data_ptr<uint8_t>(), down.data_ptr<uint8_t>(), gs.data_ptr<float>(),
          us.data_ptr<float>(), ds.data_ptr<float>(), inter, gate.numel() / n, down.numel() / n, gs.numel() / n,
          ds.numel() / n};
}

// y[R, H] = down[:, lo:hi](silu(gate[lo:hi](x)) * up[lo:hi](x)) for rows x[R, H]: the MLP over its intermediate
// features [lo, hi), all of them or a part (see `split_point`) whose output the caller adds up; g, u: scratch.
void mlp_rows(const float* x, int64_t R, int64_t H, const Mlp& w, int64_t lo, int64_t hi, std::vector<float>& g,
              std::vector<float>& u, float* y) {
  const int64_t I = hi - lo, h_blocks = (H + kBlock - 1) / kBlock;
  g.resize(R * I);
  u.resize(R * I);
  packed_gemm<Fp8>(x, R, H, w.gate + lo * H, w.gate_scale + lo / kBlock * h_blocks, I, g.data());
  packed_gemm<Fp8>(x, R, H, w.up + lo * H, w.up_scale + lo / kBlock * h_blocks, I, u.data());
  for (int64_t i = 0; i < R * I; i += kLanes) {
    const __m512 gv = _mm512_loadu_ps(g.data() + i);
    const __m512 sig = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
    _mm512_storeu_ps(g.data() + i, _mm512_mul_ps(_mm512_div_ps(gv, sig), _mm512_loadu_ps(u.data() + i)));
  }
  packed_gemm<Fp8>(g.data(), R, I, w.down + lo * kLanes, w.down_scale + lo / kBlock, H, y, w.inter,
                   (w.inter + kBlock - 1) / kBlock);
}

// Where the shared expert is cut in two halves of its intermediate features, so that two threads share it (a
// batch-1 step has it and two routed experts: three equal items for two threads). At a scale block boundary when
// there are several blocks, else at a multiple of 16 inside the one block; 0: not cut. Fixed by the weights alone,
// so a row's sums never depend on the batch or the threads.
int64_t split_point(int64_t inter) {
  return inter > kBlock ? std::max(inter / 2 / kBlock, int64_t{1}) * kBlock : inter / 2 / kLanes * kLanes;
}

// noaux_tc routing of one token: sigmoid scores, the correction bias steering selection only, the best
// topk_group groups (a group scored by its two best biased experts), then top_k experts among them;
// weights = scores of the chosen, normalized if asked, times the scaling factor. Ties go to the lower index.
void route(const float* score, const float* bias, int64_t E, int64_t n_group, int64_t topk_group, int64_t top_k,
           bool normalize, float scaling, int64_t* idx, float* weights) {
  float biased[256], group_score[64];
  const int64_t per_group = E / n_group;
  for (int64_t e = 0; e < E; ++e) biased[e] = score[e] + bias[e];
  for (int64_t g = 0; g < n_group; ++g) {
    float a = -INFINITY, b = -INFINITY;
    for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
      const float v = biased[e];
      if (v > a) { b = a; a = v; } else if (v > b) { b = v; }
    }
    group_score[g] = per_group > 1 ? a + b : a;
  }
  bool keep[64] = {};
  for (int64_t n = 0; n < topk_group; ++n) {
    int64_t best = -1;
    for (int64_t g = 0; g < n_group; ++g)
      if (!keep[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
    keep[best] = true;
  }
  bool taken[256] = {};
  float sum = 0.0f;
  for (int64_t n = 0; n < top_k; ++n) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (keep[e / per_group] && !taken[e] && (best < 0 || biased[e] > biased[best])) best = e;
    taken[best] = true;
    idx[n] = best;
    weights[n] = score[best];
    sum += score[best];
  }
  for (int64_t n = 0; n < top_k; ++n) weights[n] = (normalize ? weights[n] / (sum + 1e-20f) : weights[n]) * scaling;
}

}  // namespace

// A whole MoE layer for tokens x [T, H]: routing (gate [E, H] float32, bias [E]), the routed experts held here
// (stacked FP8 panels: El of them from first_expert; all E without expert parallelism) and the shared expert
// (FP8 panels). A token's output is its experts' outputs added in expert order, then the shared expert's: the
// same whatever else is in the batch.
torch::Tensor moe(const torch::Tensor& x, const torch::Tensor& gate_w, const torch::Tensor& bias, int64_t n_group,
                  int64_t topk_group, int64_t top_k, bool normalize, double scaling,
                  const torch::Tensor& eg, const torch::Tensor& egs, const torch::Tensor& eu, const torch::Tensor& eus,
                  const torch::Tensor& ed, const torch::Tensor& eds,
                  const torch::Tensor& sg, const torch::Tensor& sgs, const torch::Tensor& su, const torch::Tensor& sus,
                  const torch::Tensor& sd, const torch::Tensor& sds, int64_t first_expert) {
  check(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, H]");
  const int64_t T = x.size(0), H = x.size(1), E = gate_w.size(0), El = eg.size(0);
  check(gate_w.scalar_type() == torch::kFloat && gate_w.is_contiguous() && gate_w.size(1) == H && bias.numel() == E &&
            bias.scalar_type() == torch::kFloat && bias.is_contiguous(), "router weight [E, H] and bias [E], float32");
  check(n_group >= 1 && topk_group >= 1 && top_k >= 1, "routing sizes must be >= 1");
  check(E <= 256 && n_group <= 64 && E % n_group == 0 && topk_group <= n_group && top_k <= E / n_group * topk_group,
        "routing sizes");
  check(eg.dim() == 4 && first_expert >= 0 && first_expert <= E && eg.size(2) == H && ed.dim() == 4 &&
            ed.size(0) == El && egs.dim() == 3 && egs.size(0) == El && eds.dim() == 3 && eds.size(0) == El,
        "this rank's experts first_expert.. of E: panels [El, I/16, H, 16] and [El, H/16, I, 16], scales [El, ...]");
  check(sg.dim() == 3 && sg.size(1) == H && sd.dim() == 3, "shared expert panels");
  for (const auto* t : {&x, &gate_w, &bias, &eg, &egs, &eu, &eus, &ed, &eds, &sg, &sgs, &su, &sus, &sd, &sds})
    check(t->device().is_cpu(), "tensors must be on the CPU");
  const Mlp routed_mlp = checked_mlp(eg, egs, eu, eus, ed, eds), shared_mlp = checked_mlp(sg, sgs, su, sus, sd, sds);
  const float* xp = x.data_ptr<float>();
  const float *gw = gate_w.data_ptr<float>(), *bp = bias.data_ptr<float>();
  std::vector<int64_t> idx(T * top_k);
  std::vector<float> weights(T * top_k), score(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      __m512 acc = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(xp + t * H + i), _mm512_loadu_ps(gw + e * H + i), acc);
      float dot = _mm512_reduce_add_ps(acc);
      for (; i < H; ++i) dot += xp[t * H + i] * gw[e * H + i];
      score[e] = 1.0f / (1.0f + std::exp(-dot));
    }
    route(score.data(), bp, E, n_group, topk_group, top_k, normalize, static_cast<float>(scaling),
          idx.data() + t * top_k, weights.data() + t * top_k);
  }
  // Work items: each routed expert held here over its rows, the shared expert's two halves (items El, El + 1; see
  // split_point) over all rows. Items are dealt to the threads longest first; each writes only its own output,
  // and the outputs are added in a fixed order afterwards (the shared halves, then the routed experts in
  // expert order), so the sums do not depend on the threads.
  std::vector<std::vector<int64_t>> rows(El);
  std::vector<std::vector<float>> row_w(El), ys(El);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = idx[t * top_k + j] - first_expert;  // expert parallel: other ranks' experts are skipped
      if (e < 0 || e >= El) continue;
      rows[e].push_back(t);
      row_w[e].push_back(weights[t * top_k + j]);
    }
  auto out = torch::empty({T, H}, x.options());
  float* op = out.data_ptr<float>();
  const int64_t shared_inter = shared_mlp.inter, cut = split_point(shared_inter);
  const int64_t bounds[3] = {0, cut > 0 ? cut : shared_inter, shared_inter};
  std::vector<float> shared_tail(cut > 0 ? T * H : 0);
  std::vector<int64_t> items;
  for (int64_t e = 0; e < El; ++e)
    if (!rows[e].empty()) items.push_back(e);
  items.push_back(El);
  if (cut > 0) items.push_back(El + 1);
  auto size = [&](int64_t e) { return e >= El ? T : static_cast<int64_t>(rows[e].size()); };
  auto cost = [&](int64_t e) {  // a weight read per expert plus a row's work: rows cost little next to weights
    const double part = e >= El ? static_cast<double>(bounds[e - El + 1] - bounds[e - El]) / routed_mlp.inter : 1.0;
    return part * static_cast<double>(8 + size(e));
  };
  std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  const int64_t n_bins = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  std::vector<std::vector<int64_t>> bins(n_bins);
  std::vector<double> load(n_bins, 0.0);
  for (int64_t e : items) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(e);
    load[b] += cost(e);
  }
  parallel(n_bins, [&](int64_t b0, int64_t b1) {
    std::vector<float> xs, g, u;
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t e : bins[b]) {
        if (e >= El) {
          mlp_rows(xp, T, H, shared_mlp, bounds[e - El], bounds[e - El + 1], g, u, e == El ? op : shared_tail.data());
          continue;
        }
        const int64_t R = size(e);
        xs.resize(R * H);
        ys[e].resize(R * H);
        for (int64_t r = 0; r < R; ++r) std::copy_n(xp + rows[e][r] * H, H, xs.data() + r * H);
        mlp_rows(xs.data(), R, H, routed_mlp.expert(e), 0, routed_mlp.inter, g, u, ys[e].data());
      }
  });
  std::vector<float> routed(T * H, 0.0f);
  for (int64_t e = 0; e < El; ++e)
    for (int64_t r = 0; r < size(e); ++r) {
      float* dst = routed.data() + rows[e][r] * H;
      const float* src = ys[e].data() + r * H;
      for (int64_t c = 0; c < H; ++c) dst[c] += row_w[e][r] * src[c];
    }
  if (cut > 0)
    for (int64_t i = 0; i < T * H; ++i) op[i] = routed[i] + (op[i] + shared_tail[i]);
  else
    for (int64_t i = 0; i < T * H; ++i) op[i] = routed[i] + op[i];
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "x must be float32 [rows, n], rows contiguous");
  check(w.scalar_type() == torch::kFloat && w.is_contiguous() && w.numel() == x.size(1), "weight [n]");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto y = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(xp + r * ld, n, w.data_ptr<float>(), static_cast<float>(eps), yp + r * n);
  return y;
}

// The absorbed-MLA inputs of T new tokens: writes each token's latent (normalized c_kv | roped k_pe) to
// its cache slot and returns the queries [T, h, rank + rope] = scale * (q_nope W_UK | rope(q_pe)).
torch::Tensor mla_prepare(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& rot,
                          const torch::Tensor& kv_norm, double eps, const torch::Tensor& w_uk, double scale,
                          torch::Tensor cache, const torch::Tensor& slots) {
  check(w_uk.dim() == 3 && w_uk.is_contiguous() && w_uk.scalar_type() == torch::kFloat, "w_uk [h, nope, rank]");
  const int64_t heads = w_uk.size(0), nope = w_uk.size(1), rank = w_uk.size(2), T = q.size(0);
  check(cache.dim() == 2 && cache.is_contiguous() && cache.scalar_type() == torch::kFloat, "cache [slots, D]");
  const int64_t D = cache.size(1), rope = D - rank;
  check(rank % kLanes == 0 && rope % 2 == 0, "latent sizes");
  check(q.dim() == 2 && q.is_contiguous() && q.size(1) == heads * (nope + rope), "q [T, h * (nope + rope)]");
  check(kv.dim() == 2 && kv.stride(1) == 1 && kv.size(0) == T && kv.size(1) == D, "kv [T, rank + rope]");
  check(rot.is_contiguous() && rot.numel() == T * rope, "rot [T, rope / 2, 2]");
  check(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == T && kv_norm.numel() == rank &&
            kv_norm.is_contiguous(), "slots / norm weight");
  auto out = torch::empty({T, heads, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kvp = kv.data_ptr<float>(), *rp = rot.data_ptr<float>();
  const float *nw = kv_norm.data_ptr<float>(), *wk = w_uk.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) check(sp[t] >= 0 && sp[t] < cache.size(0), "cache slot out of range");  // before any write
  float *cp = cache.data_ptr<float>(), *op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  for (int64_t t = 0; t < T; ++t) {
    const float* kvt = kvp + t * kv.stride(0);
    float* row = cp + sp[t] * D;
    rms_norm_row(kvt, rank, nw, static_cast<float>(eps), row);
    rope_row(kvt + rank, rp + t * rope, rope / 2, 1.0f, row + rank);
  }
  // (token, head) items, in chunks of at least 64K multiply-adds: DeepSeek-V3's heads (128 x 128 x 512 of W_UK)
  // spread over the threads even for one token, while a small model's verify (its few heads, a few tokens) stays
  // on one thread, where waking another would cost more than it saves.
  const int64_t chunk = std::max<int64_t>(1, 65536 / (nope * rank));
  parallel(T * heads, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const float* qh = qp + i * (nope + rope);
      float* o = op + i * D;
      matvec(qh, nope, wk + h * nope * rank, rank, sc, o);
      rope_row(qh + nope, rp + t * rope, rope / 2, sc, o + rank);
    }
  }, chunk);
  return out;
}

// o[t, h] = (softmax_l(q[t, h] . cache[slot(l)]) @ cache[slot(l), :rank]) W_UV[h]^T over positions l = 0..positions[t]
// of the token's sequence; slot(l) = tables[seq[t], l / block_size] * block_size + l % block_size; q is pre-scaled.
torch::Tensor mla_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& positions,
                            const torch::Tensor& seq, const torch::Tensor& tables, int64_t block_size,
                            const torch::Tensor& w_uv) {
  check(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be contiguous float32 [T, h, D]");
  const int64_t T = q.size(0), heads = q.size(1), D = q.size(2);
  check(cache.dim() == 2 && cache.size(1) == D && cache.scalar_type() == torch::kFloat && cache.is_contiguous(), "cache [slots, D]");
  check(D % kLanes == 0, "latent sizes must be multiples of 16");
  check(positions.scalar_type() == torch::kLong && seq.scalar_type() == torch::kLong && tables.scalar_type() == torch::kLong &&
            positions.numel() == T && seq.numel() == T && positions.is_contiguous() && seq.is_contiguous() &&
            tables.dim() == 2 && tables.is_contiguous() && block_size >= 1, "positions/seq/tables");
  check(w_uv.dim() == 3 && w_uv.is_contiguous() && w_uv.size(0) == heads && w_uv.size(1) <= D &&
            w_uv.size(1) % kLanes == 0 && w_uv.size(2) % kLanes == 0 && w_uv.scalar_type() == torch::kFloat,
        "w_uv [h, rank, v], rank and v multiples of 16");
  const int64_t rank = w_uv.size(1), vdim = w_uv.size(2);
  auto out = torch::empty({T, heads * vdim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  const float* wv = w_uv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sq = seq.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1), dv = D / kLanes, rv = rank / kLanes;
  float* outp = out.data_ptr<float>();
  // Items are (token, group of heads): fewer tokens than threads (a batch-1 decode step) split their heads, so
  // every core works; each item reads its token's context once for all of its heads.
  const int64_t threads = at::get_num_threads();
  const int64_t groups = T >= threads ? 1 : std::min(heads, (threads + T - 1) / T);
  parallel(T * groups, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, rowsum(heads), zeros(D, 0.0f), olat(heads * rank);
    std::vector<const float*> ctx;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / groups, h0 = i % groups * heads / groups, h1 = (i % groups + 1) * heads / groups;
      const int64_t L = pos[t] + 1, Lp = (L + kLanes - 1) / kLanes * kLanes;
      check(L >= 1 && L <= max_blocks * block_size, "position negative or past the block table");
      check(sq[t] >= 0 && sq[t] < tables.size(0), "sequence index out of range");
      const int64_t* table = tb + sq[t] * max_blocks;
      for (int64_t b = 0; b * block_size < L; ++b)
        check(table[b] >= 0 && table[b] < cache.size(0) / block_size, "block id past the cache");
      ctx.resize(Lp);  // row of each position; the padding up to 16 reads zeros (its scores are masked)
      for (int64_t l = 0; l < L; ++l) ctx[l] = cp + (table[l / block_size] * block_size + l % block_size) * D;
      for (int64_t l = L; l < Lp; ++l) ctx[l] = zeros.data();
      scores.resize(heads * Lp);
      // Positions outer, heads inner: a chunk of 16 context rows is read from L2 once and used by every head.
      for (int64_t l0 = 0; l0 < L; l0 += kLanes) {
        const float* const* rows = ctx.data() + l0;
        for (int64_t i = kLanes; i < 2 * kLanes && l0 + i < L; ++i)  // the next chunk's rows, from L3
          for (int64_t b = 0; b < D * 4; b += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[i]) + b, _MM_HINT_T0);
        for (int64_t h = h0; h < h1; ++h) {  // 16 partial dot products, then one tree
          const float* qh = qp + (t * heads + h) * D;
          __m512 acc[kLanes];
#pragma GCC unroll 16
          for (int i = 0; i < kLanes; ++i) acc[i] = _mm512_setzero_ps();
          for (int64_t d = 0; d < dv; ++d) {
            const __m512 qd = _mm512_loadu_ps(qh + d * kLanes);
#pragma GCC unroll 16
            for (int i = 0; i < kLanes; ++i) acc[i] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(rows[i] + d * kLanes), acc[i]);
          }
          _mm512_storeu_ps(scores.data() + h * Lp + l0, sum16(acc));
        }
      }
      const __mmask16 tail = L % kLanes ? static_cast<__mmask16>((1u << (L % kLanes)) - 1) : 0xFFFF;
      for (int64_t h = h0; h < h1; ++h) {  // softmax numerators in place; padding set to 0
        float* s = scores.data() + h * Lp;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t l = 0; l < Lp; l += kLanes)
          mx = _mm512_mask_max_ps(mx, l + kLanes < Lp ? 0xFFFF : tail, mx, _mm512_loadu_ps(s + l));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t l = 0; l < Lp; l += kLanes) {
          const __m512 p = _mm512_maskz_mov_ps(l + kLanes < Lp ? 0xFFFF : tail, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), m)));
          _mm512_storeu_ps(s + l, p);
          sum = _mm512_add_ps(sum, p);
        }
        rowsum[h] = _mm512_reduce_add_ps(sum);
      }
      float* o = olat.data();
      std::fill_n(o + h0 * rank, (h1 - h0) * rank, 0.0f);
      for (int64_t l0 = 0; l0 < L; l0 += kLanes) {  // o += p . c, again 16 rows at a time for every head
        const float* const* rows = ctx.data() + l0;
        const int64_t n = std::min(kLanes, L - l0);
        for (int64_t h = h0; h < h1; ++h) {
          const float* s = scores.data() + h * Lp + l0;
          float* oh = o + h * rank;
          int64_t r = 0;
          for (; r + 4 <= rv; r += 4) {  // four independent accumulator chains
            float* dst = oh + r * kLanes;
            __m512 a0 = _mm512_loadu_ps(dst), a1 = _mm512_loadu_ps(dst + kLanes), a2 = _mm512_loadu_ps(dst + 2 * kLanes),
                   a3 = _mm512_loadu_ps(dst + 3 * kLanes);
            for (int64_t i = 0; i < n; ++i) {
              const __m512 p = _mm512_set1_ps(s[i]);
              const float* c = rows[i] + r * kLanes;
              a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(c), a0);
              a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(c + kLanes), a1);
              a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(c + 2 * kLanes), a2);
              a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(c + 3 * kLanes), a3);
            }
            _mm512_storeu_ps(dst, a0);
            _mm512_storeu_ps(dst + kLanes, a1);
            _mm512_storeu_ps(dst + 2 * kLanes, a2);
            _mm512_storeu_ps(dst + 3 * kLanes, a3);
          }
          for (; r < rv; ++r) {
            __m512 a = _mm512_loadu_ps(oh + r * kLanes);
            for (int64_t i = 0; i < n; ++i) a = _mm512_fmadd_ps(_mm512_set1_ps(s[i]), _mm512_loadu_ps(rows[i] + r * kLanes), a);
            _mm512_storeu_ps(oh + r * kLanes, a);
          }
        }
      }
      for (int64_t h = h0; h < h1; ++h)  // (softmax @ c) W_UV^T
        matvec(o + h * rank, rank, wv + h * rank * vdim, vdim, 1.0f / rowsum[h], outp + (t * heads + h) * vdim);
    }
  });
  return out;
}


// ---- a whole decoder layer per call: the kernels above in the order model.DecoderLayer runs them ----------

// A packed linear weight: panels, block scales, output features.
struct Linear {
  torch::Tensor panels, scale;
  int64_t out_features;
  torch::Tensor operator()(const torch::Tensor& x) const { return packed_linear(x, panels, scale, out_features); }
};

// One DeepSeek decoder layer's weights for `decoder_layer`, gathered once: absorbed MLA with a q LoRA,
// then either a MoE layer (router non-empty) or a dense MLP (`mlp` = gate, up, down).
struct Layer {
  int64_t cache_layer;
  torch::Tensor input_norm, q_a_norm, kv_a_norm, post_norm;
  double eps, q_a_eps, kv_a_eps;
  Linear q_a, q_b, kv_a, o;
  torch::Tensor w_uk, w_uv;
  double softmax_scale;
  torch::Tensor router, bias;
  int64_t n_group, topk_group, top_k;
  bool normalize;
  double scaling;
  std::vector<torch::Tensor> experts;  // MoE: routed then shared panels and scales, in `moe`'s order
  std::vector<Linear> mlp;             // dense layer: gate, up, down
};

// x [T, H] -> the layer's output, exactly as DecoderLayer.forward computes it with the kernels one by one.
torch::Tensor decoder_layer(const Layer& L, const torch::Tensor& x, const torch::Tensor& rot, const torch::Tensor& kv_cache,
                            const torch::Tensor& slots, const torch::Tensor& positions, const torch::Tensor& seq,
                            const torch::Tensor& tables, int64_t block_size) {
  check(kv_cache.dim() == 3 && L.cache_layer < kv_cache.size(0), "kv_cache [layers, slots, D] holds this layer");
  const torch::Tensor cache = kv_cache.select(0, L.cache_layer);
  const torch::Tensor h = rms_norm(x, L.input_norm, L.eps);
  const torch::Tensor q = mla_prepare(L.q_b(rms_norm(L.q_a(h), L.q_a_norm, L.q_a_eps)), L.kv_a(h), rot, L.kv_a_norm,
                                      L.kv_a_eps, L.w_uk, L.softmax_scale, cache, slots);
  const torch::Tensor y = x + L.o(mla_attention(q, cache, positions, seq, tables, block_size, L.w_uv));
  const torch::Tensor f = rms_norm(y, L.post_norm, L.eps);
  if (L.router.defined()) {
    const auto& e = L.experts;
    return y + moe(f, L.router, L.bias, L.n_group, L.topk_group, L.top_k, L.normalize, L.scaling, e[0], e[1], e[2], e[3],
                   e[4], e[5], e[6], e[7], e[8], e[9], e[10], e[11], 0);
  }
  return y + L.mlp[2](at::silu(L.mlp[0](f)) * L.mlp[1](f));
}

// A model's decoder layers, gathered once, for `decoder_layers`.
struct LayerStack {
  std::vector<Layer> layers;
};

// All the layers in turn in one call: the step's body between the embedding and the final norm.
torch::Tensor decoder_layers(const LayerStack& stack, torch::Tensor x, const torch::Tensor& rot, const torch::Tensor& kv_cache,
                             const torch::Tensor& slots, const torch::Tensor& positions, const torch::Tensor& seq,
                             const torch::Tensor& tables, int64_t block_size) {
  for (const Layer& L : stack.layers) x = decoder_layer(L, x, rot, kv_cache, slots, positions, seq, tables, block_size);
  return x;
}

Layer make_layer(int64_t cache_layer, torch::Tensor input_norm, torch::Tensor q_a_norm, torch::Tensor kv_a_norm,
                 torch::Tensor post_norm, double eps, double q_a_eps, double kv_a_eps, std::vector<torch::Tensor> q_a,
                 std::vector<torch::Tensor> q_b, std::vector<torch::Tensor> kv_a, std::vector<torch::Tensor> o,
                 std::vector<int64_t> out_features, torch::Tensor w_uk, torch::Tensor w_uv, double softmax_scale,
                 std::optional<torch::Tensor> router, std::optional<torch::Tensor> bias, int64_t n_group,
                 int64_t topk_group, int64_t top_k, bool normalize, double scaling, std::vector<torch::Tensor> experts,
                 std::vector<torch::Tensor> mlp) {
  check(cache_layer >= 0, "cache_layer must be >= 0");
  const bool is_moe = router.has_value();
  check(out_features.size() == (is_moe ? 4u : 7u) && q_a.size() == 2 && q_b.size() == 2 && kv_a.size() == 2 && o.size() == 2,
        "linears: (panels, scale) each, and out_features for q_a, q_b, kv_a, o (and the MLP's gate, up, down)");
  check(is_moe == bias.has_value() && (is_moe ? experts.size() == 12 && mlp.empty() : experts.empty() && mlp.size() == 6),
        "a MoE layer takes router, bias and 12 expert tensors; a dense one 6 MLP tensors");
  auto lin = [&](const std::vector<torch::Tensor>& t, size_t i, size_t j) { return Linear{t[i], t[i + 1], out_features[j]}; };
  Layer L{cache_layer, input_norm, q_a_norm, kv_a_norm, post_norm, eps, q_a_eps, kv_a_eps,
          lin(q_a, 0, 0), lin(q_b, 0, 1), lin(kv_a, 0, 2), lin(o, 0, 3), w_uk, w_uv, softmax_scale,
          router.value_or(torch::Tensor()), bias.value_or(torch::Tensor()), n_group, topk_group, top_k, normalize, scaling,
          experts, {}};
  if (!is_moe)
    for (size_t j = 0; j < 3; ++j) L.mlp.push_back(lin(mlp, 2 * j, 4 + j));
  return L;
}

// ---- logit adjustments: penalties and bans of a batch's rows in one call (sampling.Adjustments) ----
namespace {

// x[0:n] penalized in place, with output counts c and prompt flags p: HF's repetition penalty where c > 0 or p (a
// positive logit divided, a negative one multiplied), then x - (frequency * c + presence * (c > 0)), rounded as the
// torch ops round (no fused multiply-add: the sum is a masked add, which the compiler cannot contract).
void penalize_span(float* x, const float* c, const bool* p, int64_t n, float rep, float pres, float freq) {
  const __m512 vr = _mm512_set1_ps(rep), vp = _mm512_set1_ps(pres), vf = _mm512_set1_ps(freq);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t len = std::min<int64_t>(kLanes, n - i);
    const __mmask16 mk = len == kLanes ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
    alignas(16) uint8_t tail[kLanes] = {};
    if (len < kLanes) std::memcpy(tail, p + i, len);
    const void* flags = len < kLanes ? static_cast<const void*>(tail) : static_cast<const void*>(p + i);
    const __m512i pi = _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(flags)));
    const __m512 cv = _mm512_maskz_loadu_ps(mk, c + i);
    const __mmask16 seen = _mm512_cmp_ps_mask(cv, zero, _CMP_GT_OQ);
    const __mmask16 hit = seen | _mm512_test_epi32_mask(pi, pi);
    if (!hit) continue;  // x - (frequency * 0 + presence * 0) is x: most of a vocabulary is neither seen nor prompted
    const __m512 v = _mm512_maskz_loadu_ps(mk, x + i);
    const __m512 rep_v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ), _mm512_mul_ps(v, vr),
                                              _mm512_div_ps(v, vr));
    const __m512 f = _mm512_mul_ps(vf, cv);
    const __m512 sub = _mm512_mask_add_ps(f, seen, f, vp);
    _mm512_mask_storeu_ps(x + i, mk, _mm512_sub_ps(_mm512_mask_blend_ps(hit, v, rep_v), sub));
  }
}

// Row x[0:V] under a grammar's bitmask words w (bit t % 32 of word t / 32 set: token t allowed): the tokens it refuses
// banned (-inf), and the bad and stop tokens too unless they would leave nothing it allows (then they yield to the
// grammar). buf: scratch, one word per 32 tokens.
void ban_refused(float* x, int64_t V, const int32_t* w, const std::vector<int64_t>& bad,
                 const std::vector<int64_t>* stops, std::vector<uint32_t>& buf) {
  const int64_t W = (V + 31) / 32;
  buf.assign(reinterpret_cast<const uint32_t*>(w), reinterpret_cast<const uint32_t*>(w) + W);
  if (V % 32) buf[W - 1] &= (1u << (V % 32)) - 1;  // bits past the vocabulary are no tokens
  for (const int64_t t : bad) {
    check(t >= 0 && t < V, "adjust_logits: bad token out of range");
    buf[t / 32] &= ~(1u << (t % 32));
  }
  if (stops != nullptr) {
    for (const int64_t t : *stops) {
      check(t >= 0 && t < V, "adjust_logits: stop token out of range");
      buf[t / 32] &= ~(1u << (t % 32));
    }
  }
  if (std::all_of(buf.begin(), buf.end(), [](uint32_t v) { return v == 0; })) {
    buf.assign(reinterpret_cast<const uint32_t*>(w), reinterpret_cast<const uint32_t*>(w) + W);
  }
  const __m512 ban = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < V; i += kLanes) {
    const int64_t len = std::min<int64_t>(kLanes, V - i);
    const __mmask16 lanes = len == kLanes ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
    const __mmask16 refused = static_cast<__mmask16>(~(buf[i / 32] >> (i % 32))) & lanes;
    if (refused) _mm512_mask_storeu_ps(x + i, refused, ban);
  }
}

}  // namespace

// A float32 copy of logits [B * num_rows, V] with logit biases, penalties and bans applied: rows b * num_rows + r are
// sequence b's output tokens num_output + first + r, each decided after drafts[b, :first + r]. First every row of
// sequence b adds bias_values[b][i] (float32 [n]) to the logit of bias_tokens[b][i] (int64 [n]). Penalized sequence
// penalized[i] has output counts counts[i] [V] float32 (drafts not included), prompt flags in_prompt[i] [V] bool and
// values[3i:3i+3] = (repetition, presence, frequency); a row counts the drafts before it on top. Then bad[b] is
// banned (-inf) in every row of sequence b, stops[b] in its first stop_rows[b] rows. With grammar bitmask words
// allowed [rows, >= ceil(V / 32)] int32 (empty: none), a row also bans what its words refuse (bit t % 32 of word
// t / 32 clear), and its bad and stop bans yield to the words where they would leave no token they allow.
torch::Tensor adjust_logits(const torch::Tensor& logits, int64_t num_rows, int64_t first, const torch::Tensor& drafts,
                            const std::vector<int64_t>& penalized, const std::vector<torch::Tensor>& counts,
                            const std::vector<torch::Tensor>& in_prompt, const std::vector<double>& values,
                            const std::vector<std::vector<int64_t>>& bad, const std::vector<std::vector<int64_t>>& stops,
                            const std::vector<int64_t>& stop_rows, const std::vector<torch::Tensor>& bias_tokens,
                            const std::vector<torch::Tensor>& bias_values, const torch::Tensor& allowed) {
  check(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.is_contiguous(),
        "adjust_logits: logits must be contiguous float32 [rows, V]");
  const int64_t R = logits.size(0), V = logits.size(1), B = num_rows > 0 ? R / num_rows : 0;
  check(num_rows > 0 && first >= 0 && B * num_rows == R, "adjust_logits: rows must be B * num_rows");
  check(static_cast<int64_t>(bad.size()) == B && static_cast<int64_t>(stops.size()) == B &&
        static_cast<int64_t>(stop_rows.size()) == B, "adjust_logits: bad, stops and stop_rows need one entry per sequence");
  check(static_cast<int64_t>(bias_tokens.size()) == B && static_cast<int64_t>(bias_values.size()) == B,
        "adjust_logits: bias_tokens and bias_values need one entry per sequence");
  const size_t P = penalized.size();
  check(counts.size() == P && in_prompt.size() == P && values.size() == 3 * P,
        "adjust_logits: counts, in_prompt and 3 values per penalized sequence");
  const int64_t D = drafts.dim() == 2 ? drafts.size(1) : 0;
  check(first + num_rows - 1 <= D || P == 0, "adjust_logits: drafts [B, >= first + num_rows - 1] int64 needed");
  check(D == 0 || (drafts.scalar_type() == torch::kLong && drafts.is_contiguous() && drafts.size(0) == B),
        "adjust_logits: drafts must be contiguous int64 [B, D]");
  check(allowed.numel() == 0 || (allowed.dim() == 2 && allowed.scalar_type() == torch::kInt &&
                                 allowed.is_contiguous() && allowed.size(0) == R && allowed.size(1) >= (V + 31) / 32),
        "adjust_logits: allowed must be contiguous int32 [rows, >= ceil(V / 32)] bitmask words");
  const int64_t W = allowed.numel() ? allowed.size(1) : 0;
  torch::Tensor out = logits.clone();
  float* y = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const torch::Tensor &tokens = bias_tokens[b], &biases = bias_values[b];
    check(tokens.device().is_cpu() && biases.device().is_cpu() && tokens.scalar_type() == torch::kLong &&
              tokens.is_contiguous() && tokens.dim() == 1 && biases.scalar_type() == torch::kFloat &&
              biases.is_contiguous() && biases.numel() == tokens.numel(),
          "adjust_logits: bias tokens int64 [n] and one float32 bias each, on the CPU");
    const int64_t* t = tokens.data_ptr<int64_t>();
    const float* v = biases.data_ptr<float>();
    for (int64_t i = 0; i < tokens.numel(); ++i) {
      check(t[i] >= 0 && t[i] < V, "adjust_logits: bias token out of range");
      for (int64_t r = 0; r < num_rows; ++r) y[(b * num_rows + r) * V + t[i]] += v[i];
    }
  }
  const int64_t* d = D ? drafts.data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> tokens;
  std::vector<float> xs, cs;
  for (size_t i = 0; i < P; ++i) {
    const int64_t b = penalized[i];
    check(b >= 0 && b < B, "adjust_logits: penalized sequence out of range");
    check(counts[i].scalar_type() == torch::kFloat && counts[i].is_contiguous() && counts[i].numel() == V &&
          in_prompt[i].scalar_type() == torch::kBool && in_prompt[i].is_contiguous() && in_prompt[i].numel() == V,
          "adjust_logits: counts [V] float32 and in_prompt [V] bool");
    const float* c = counts[i].data_ptr<float>();
    const bool* p = in_prompt[i].data_ptr<bool>();
    const float rep = static_cast<float>(values[3 * i]), pres = static_cast<float>(values[3 * i + 1]),
                freq = static_cast<float>(values[3 * i + 2]);
    for (int64_t r = 0; r < num_rows; ++r) {
      float* x = y + (b * num_rows + r) * V;
      // the drafts before the row: their logits penalized from the originals with the drafts counted, written last
      tokens.clear(), xs.clear(), cs.clear();
      for (int64_t j = 0; j < first + r; ++j) {
        const int64_t t = d[b * D + j];
        check(t >= 0 && t < V, "adjust_logits: draft token out of range");
        const auto at = std::find(tokens.begin(), tokens.end(), t);
        if (at != tokens.end()) {
          cs[at - tokens.begin()] += 1.0f;
        } else {
          tokens.push_back(t), xs.push_back(x[t]), cs.push_back(c[t] + 1.0f);
        }
      }
      const std::vector<uint8_t> ones(tokens.size(), 1);
      penalize_span(xs.data(), cs.data(), reinterpret_cast<const bool*>(ones.data()), static_cast<int64_t>(xs.size()),
                    rep, pres, freq);
      penalize_span(x, c, p, V, rep, pres, freq);
      for (size_t j = 0; j < tokens.size(); ++j) x[tokens[j]] = xs[j];
    }
  }
  const float ban = -std::numeric_limits<float>::infinity();
  std::vector<uint32_t> buf;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r = 0; r < num_rows; ++r) {
      float* x = y + (b * num_rows + r) * V;
      if (W) {
        const int32_t* w = allowed.data_ptr<int32_t>() + (b * num_rows + r) * W;
        ban_refused(x, V, w, bad[b], r < stop_rows[b] ? &stops[b] : nullptr, buf);
        continue;
      }
      for (const int64_t t : bad[b]) {
        check(t >= 0 && t < V, "adjust_logits: bad token out of range");
        x[t] = ban;
      }
      if (r >= stop_rows[b]) continue;
      for (const int64_t t : stops[b]) {
        check(t >= 0 && t < V, "adjust_logits: stop token out of range");
        x[t] = ban;
      }
    }
  }
  return out;
}

// A batch's logit biases, penalties and bans in adjust_logits' layout, for the greedy chain and step to apply to their
// rows (sampling.Adjustments.kernel_args): stop_rows counts the rows from the first draft's on.
struct Adjustments {
  std::vector<int64_t> penalized;
  std::vector<torch::Tensor> counts, in_prompt;
  std::vector<double> values;
  std::vector<std::vector<int64_t>> bad, stops;
  std::vector<int64_t> stop_rows;
  std::vector<torch::Tensor> bias_tokens, bias_values;

  // adjust_logits of rows first .. first + num_rows - 1 of each sequence (its stop bans shifted to them)
  torch::Tensor apply(const torch::Tensor& logits, int64_t num_rows, int64_t first, const torch::Tensor& drafts) const {
    std::vector<int64_t> rows(stop_rows.size());
    for (size_t b = 0; b < rows.size(); ++b) rows[b] = std::max<int64_t>(stop_rows[b] - first, 0);
    return adjust_logits(logits, num_rows, first, drafts, penalized, counts, in_prompt, values, bad, stops, rows,
                         bias_tokens, bias_values, torch::empty({0, 0}, torch::kInt));  // guided steps: the general path
  }

  // those of sequences seqs[0], seqs[1], .. as a batch of their own (the drafting ones of a step)
  Adjustments of(const std::vector<int64_t>& seqs) const {
    Adjustments a;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int64_t b = seqs[i];
      const auto at = std::find(penalized.begin(), penalized.end(), b);
      if (at != penalized.end()) {
        const size_t p = at - penalized.begin();
        a.penalized.push_back(static_cast<int64_t>(i)), a.counts.push_back(counts[p]), a.in_prompt.push_back(in_prompt[p]);
        a.values.insert(a.values.end(), values.begin() + 3 * p, values.begin() + 3 * p + 3);
      }
      a.bad.push_back(bad[b]), a.stops.push_back(stops[b]), a.stop_rows.push_back(stop_rows[b]);
      a.bias_tokens.push_back(bias_tokens[b]), a.bias_values.push_back(bias_values[b]);
    }
    return a;
  }
};

// An MTP module's weights for `mtp_layer`: h' = eh_proj([enorm(embed(t)); hnorm(h)]) -> decoder layer ->
// shared_head.norm, then the head.
struct Mtp {
  torch::Tensor embed, enorm, hnorm, head_norm;
  double eps;
  Linear eh_proj, head;
  Layer block;
};

Mtp make_mtp(torch::Tensor embed, torch::Tensor enorm, torch::Tensor hnorm, torch::Tensor head_norm, double eps,
             torch::Tensor eh_panels, torch::Tensor eh_scale, torch::Tensor head_panels, torch::Tensor head_scale,
             int64_t vocab, Layer block) {
  check(embed.dim() == 2 && embed.scalar_type() == torch::kFloat, "embedding [vocab, H] float32");
  const int64_t H = embed.size(1);
  return {embed, enorm, hnorm, head_norm, eps, {eh_panels, eh_scale, H}, {head_panels, head_scale, vocab}, block};
}

// (logits, hidden after shared_head.norm) of the MTP module, at `rows` only when given, exactly as
// MTPLayer.forward computes them with the kernels one by one.
std::tuple<torch::Tensor, torch::Tensor> mtp_layer(const Mtp& M, const torch::Tensor& ids, const torch::Tensor& hidden,
                                                   const torch::Tensor& rot, const torch::Tensor& kv_cache,
                                                   const torch::Tensor& slots, const torch::Tensor& positions,
                                                   const torch::Tensor& seq, const torch::Tensor& tables, int64_t block_size,
                                                   const std::optional<torch::Tensor>& rows) {
  const torch::Tensor e = rms_norm(at::embedding(M.embed, ids), M.enorm, M.eps);
  const torch::Tensor x = M.eh_proj(at::cat({e, rms_norm(hidden.contiguous(), M.hnorm, M.eps)}, -1));
  torch::Tensor h = rms_norm(decoder_layer(M.block, x, rot, kv_cache, slots, positions, seq, tables, block_size),
                             M.head_norm, M.eps);
  if (rows.has_value()) h = h.index({*rows});
  return {M.head(h), h};
}

// Greedy drafts [B, K]: the MTP module over the catch-up tokens (as mtp_layer, the head at `rows`: one per
// sequence), its argmax as draft 1, then K - 1 more steps, each on the previous draft and the module's own
// hidden state, at positions draft_positions[j] (one per sequence; rotations draft_rot[j]). With `adjust`, each
// argmax is of the logits adjusted as the draft's row is (the drafts before it counted). With `ks` (sequence b drafts
// ks[b] in 1..K; empty: all K), a step runs over the sequences whose chain reaches it, the others keeping their last
// logits and hidden state (what their row holds past ks[b] is no draft). The same calls in the same order as drafting
// step by step, without a trip through Python per draft.
torch::Tensor mtp_greedy_drafts(const Mtp& M, const torch::Tensor& ids, const torch::Tensor& hidden, const torch::Tensor& rot,
                                const torch::Tensor& kv_cache, const torch::Tensor& slots, const torch::Tensor& positions,
                                const torch::Tensor& seq, const torch::Tensor& tables, int64_t block_size,
                                const torch::Tensor& rows, const torch::Tensor& draft_positions,
                                const torch::Tensor& draft_rot, const std::vector<int64_t>& ks,
                                const std::optional<Adjustments>& adjust) {
  const int64_t B = rows.numel(), K = draft_positions.size(0) + 1;
  check(draft_positions.dim() == 2 && draft_positions.size(1) == B && draft_positions.scalar_type() == torch::kLong &&
            draft_rot.dim() == 4 && draft_rot.size(0) == K - 1 && draft_rot.size(1) == B,
        "draft_positions [K - 1, B] int64 and draft_rot [K - 1, B, pairs, 2]");
  check(tables.dim() == 2 && tables.size(0) == B && block_size >= 1, "one block table row per drafting sequence");
  check(ks.empty() || static_cast<int64_t>(ks.size()) == B, "ks: one number of drafts per sequence (or none)");
  torch::Tensor logits, h;
  std::tie(logits, h) = mtp_layer(M, ids, hidden, rot, kv_cache, slots, positions, seq, tables, block_size, rows);
  auto drafts = torch::empty({B, K}, ids.options().dtype(torch::kLong));
  // draft j: the argmax of its logits adjusted with drafts 1..j before it counted
  auto choose = [&](const torch::Tensor& x, int64_t j) {
    return (adjust ? adjust->apply(x, 1, j, drafts) : x).argmax(-1);
  };
  torch::Tensor d = choose(logits, 0);
  drafts.select(1, 0).copy_(d);
  const torch::Tensor each = torch::arange(B, drafts.options());
  for (int64_t j = 1; j < K; ++j) {
    std::vector<int64_t> active;  // the sequences drafting j + 1 or more
    for (int64_t b = 0; b < B; ++b)
      if (ks.empty() || ks[b] > j) active.push_back(b);
    const bool all = static_cast<int64_t>(active.size()) == B;
    const torch::Tensor idx = all ? each : torch::tensor(active, torch::kLong);
    auto part = [&](const torch::Tensor& t) { return all ? t : t.index_select(0, idx); };
    const torch::Tensor pos = part(draft_positions[j - 1]).contiguous();
    const torch::Tensor block = at::floor_divide(pos, block_size);
    check(block.max().item<int64_t>() < tables.size(1), "block tables do not cover the draft positions");
    const torch::Tensor step_slots = part(tables).gather(1, block.unsqueeze(1)).squeeze(1) * block_size +
                                     pos.remainder(block_size);
    torch::Tensor step_logits, step_h;
    std::tie(step_logits, step_h) = mtp_layer(M, part(d), part(h), part(draft_rot[j - 1]).contiguous(), kv_cache,
                                              step_slots, pos, idx, tables, block_size, std::nullopt);
    if (all) {
      logits = step_logits, h = step_h;
    } else {
      logits.index_copy_(0, idx, step_logits), h.index_copy_(0, idx, step_h);
    }
    d = choose(logits, j);
    drafts.select(1, j).copy_(d);
  }
  return drafts;
}

torch::Tensor token_logprobs(const torch::Tensor& lp, const torch::Tensor& tokens, int64_t n);

// The target model around its layers, for `greedy_step`: embedding, rope, the layers, the final norm, lm_head.
struct Target {
  torch::Tensor embed, norm;
  double eps;
  LayerStack stack;
  Linear head;
  torch::Tensor inv_freq;
  double rope_factor;
};

Target make_target(torch::Tensor embed, torch::Tensor norm, double eps, LayerStack stack, torch::Tensor head_panels,
                   torch::Tensor head_scale, int64_t vocab, torch::Tensor inv_freq, double rope_factor) {
  check(embed.dim() == 2 && embed.scalar_type() == torch::kFloat, "embedding [vocab, H] float32");
  return {embed, norm, eps, std::move(stack), {head_panels, head_scale, vocab}, inv_freq, rope_factor};
}

// Rotations [N, pairs, 2] of positions [N], as DeepseekV3ForCausalLM.rope computes them (the same ATen calls).
torch::Tensor rope(const Target& T, const torch::Tensor& positions) {
  const torch::Tensor freqs = positions.unsqueeze(-1).to(torch::kFloat) * T.inv_freq;
  return at::view_as_real(at::polar(at::full_like(freqs, T.rope_factor), freqs));
}

// One greedy step for B decoding sequences, sequence b with ks[b] >= 0 drafts (K the most), from host integers:
// sequence b has num_cached[b] target positions cached, its MTP cache num_mtp[b], its blocks tables[b]; ids and hidden
// are the MTP catch-up's inputs over positions num_mtp[b] .. num_cached[b] - 1 of the sequences that draft, in order.
// mtp_greedy_drafts over those (catch-up, then the chain of drafts at positions num_cached[b] ..), the target over
// [last_ids[b], d1..d_ks[b]] at positions num_cached[b] .. num_cached[b] + ks[b], the final norm and lm_head, and greedy
// acceptance: each sequence's drafts up to the first that is not the target's argmax, then the argmax there; with
// `adjust`, drafts and verified rows are argmaxes of adjusted logits (Adjustments: row j counts drafts 1..j). A
// sequence with no drafts is plain decoding: no MTP catch-up (its num_mtp is not read), the target over last_ids[b]
// alone; with none drafting the MTP module is not needed (M may be null). Rows past ks[b] repeat its last, so the
// logits are [B * (K + 1), V] as the step in Python has them. Returns the emitted tokens of each sequence, the target's
// hidden states after the final norm (the MTP module's next inputs), ks[b] + 1 rows per sequence in order, and the
// emitted tokens' token_logprobs rows of the sequences with top_n[b] >= 0 (top_n empty: none), in order, over the
// rows' log-softmax: of the adjusted logits where processed[b], else of the raw ones. The same calls in the same
// order as the step in Python.
std::tuple<std::vector<std::vector<int64_t>>, torch::Tensor, torch::Tensor> greedy_step(
    const Target& T, const Mtp* M, const torch::Tensor& ids, const torch::Tensor& hidden, const torch::Tensor& kv_cache,
    const std::vector<std::vector<int64_t>>& tables, int64_t block_size, const std::vector<int64_t>& num_mtp,
    const std::vector<int64_t>& num_cached, const std::vector<int64_t>& last_ids, const std::vector<int64_t>& ks,
    const std::optional<Adjustments>& adjust, const std::vector<int64_t>& top_n, const std::vector<bool>& processed) {
  const int64_t B = static_cast<int64_t>(tables.size());
  check(B >= 1 && block_size >= 1 && static_cast<int64_t>(num_cached.size()) == B &&
            static_cast<int64_t>(last_ids.size()) == B && static_cast<int64_t>(ks.size()) == B &&
            *std::min_element(ks.begin(), ks.end()) >= 0,
        "greedy_step: one block table, num_cached, last id and number of drafts >= 0 per sequence");
  const int64_t K = *std::max_element(ks.begin(), ks.end());
  check(K == 0 || (M != nullptr && static_cast<int64_t>(num_mtp.size()) == B),
        "greedy_step: drafts need the MTP module and num_mtp per sequence");
  check((top_n.empty() && processed.empty()) ||
            (static_cast<int64_t>(top_n.size()) == B && static_cast<int64_t>(processed.size()) == B),
        "greedy_step: top_n and processed need one entry per sequence (or none)");
  int64_t W = 0;
  for (const auto& t : tables) W = std::max<int64_t>(W, t.size());
  auto table = torch::zeros({B, W}, torch::kLong);
  int64_t* tb = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) std::copy(tables[b].begin(), tables[b].end(), tb + b * W);
  std::vector<int64_t> drafting, drafting_ks;  // the sequences that draft, in order, and their numbers of drafts
  for (int64_t b = 0; b < B; ++b)
    if (ks[b] > 0) drafting.push_back(b), drafting_ks.push_back(ks[b]);
  const int64_t D = static_cast<int64_t>(drafting.size());
  const bool all_draft = D == B;
  // Catch-up positions (of the i-th drafting sequence: table row i of the drafting ones), then the verified ones.
  std::vector<int64_t> pos, slots, seq, last, draft_pos(D * std::max<int64_t>(K - 1, 0));  // [K - 1, D]
  auto add = [&](int64_t b, int64_t p, int64_t row) {
    check(p >= 0 && p / block_size < static_cast<int64_t>(tables[b].size()), "block tables do not cover the positions");
    pos.push_back(p);
    slots.push_back(tables[b][p / block_size] * block_size + p % block_size);
    seq.push_back(row);
  };
  for (int64_t i = 0; i < D; ++i) {
    const int64_t b = drafting[i];
    check(num_mtp[b] < num_cached[b], "every drafting sequence has hidden states to catch up on");
    for (int64_t p = num_mtp[b]; p < num_cached[b]; ++p) add(b, p, i);
    last.push_back(static_cast<int64_t>(pos.size()) - 1);
    for (int64_t j = 1; j < K; ++j) draft_pos[(j - 1) * D + i] = num_cached[b] + j - 1;  // draft j + 1 proposed there
  }
  const int64_t Tc = static_cast<int64_t>(pos.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j <= ks[b]; ++j) add(b, num_cached[b] + j, b);
  auto host = [](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kLong); };
  const torch::Tensor positions = host(pos), slot_mapping = host(slots), token_seq = host(seq);
  const torch::Tensor rot = rope(T, positions);
  // every sequence's drafts [B, K], as the verified rows count them (zeros where a sequence does not draft)
  torch::Tensor all_drafts = torch::empty({B, 0}, torch::kLong);
  if (K > 0) {
    std::optional<Adjustments> drafting_adjust;  // the drafting sequences' own where some do not draft
    if (adjust && !all_draft) drafting_adjust = adjust->of(drafting);
    const torch::Tensor draft_positions = host(draft_pos).view({K - 1, D});
    const torch::Tensor drafts = mtp_greedy_drafts(
        *M, ids, hidden, rot.slice(0, 0, Tc), kv_cache, slot_mapping.slice(0, 0, Tc), positions.slice(0, 0, Tc),
        token_seq.slice(0, 0, Tc), all_draft ? table : table.index_select(0, host(drafting)), block_size, host(last),
        draft_positions, rope(T, draft_positions), drafting_ks, all_draft ? adjust : drafting_adjust);
    all_drafts = all_draft ? drafts : torch::zeros({B, K}, torch::kLong).index_copy_(0, host(drafting), drafts);
  }
  const int64_t* dp = all_drafts.data_ptr<int64_t>();
  std::vector<int64_t> tokens, rows;  // the verified tokens; per sequence, the K + 1 rows of its logits
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = static_cast<int64_t>(tokens.size());
    tokens.push_back(last_ids[b]);
    tokens.insert(tokens.end(), dp + b * K, dp + b * K + ks[b]);
    for (int64_t j = 0; j <= K; ++j) rows.push_back(first + std::min(j, ks[b]));
  }
  const torch::Tensor x = decoder_layers(T.stack, at::embedding(T.embed, host(tokens)), rot.slice(0, Tc), kv_cache,
                                         slot_mapping.slice(0, Tc), positions.slice(0, Tc), token_seq.slice(0, Tc),
                                         table, block_size);
  const torch::Tensor h = rms_norm(x, T.norm, T.eps);
  torch::Tensor logits = T.head(h);
  if (static_cast<int64_t>(tokens.size()) < B * (K + 1)) logits = logits.index_select(0, host(rows));
  logits = logits.contiguous();
  const torch::Tensor adjusted = adjust ? adjust->apply(logits, K + 1, 0, all_drafts) : logits;
  const torch::Tensor argmax = adjusted.argmax(-1).view({B, K + 1});
  const int64_t* ap = argmax.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> emitted(B);
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    while (n < ks[b] && dp[b * K + n] == ap[b * (K + 1) + n]) emitted[b].push_back(dp[b * K + n++]);
    emitted[b].push_back(ap[b * (K + 1) + n]);
  }
  // the rows that decided the emitted tokens of the sequences asking for logprobs, raw or adjusted
  const int64_t V = logits.size(1);
  std::vector<const float*> picked_rows;
  std::vector<int64_t> chosen;
  int64_t n = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(top_n.size()); ++b) {
    if (top_n[b] < 0) continue;
    n = std::max(n, top_n[b]);
    const float* src = (processed[b] ? adjusted : logits).data_ptr<float>() + b * (K + 1) * V;
    for (size_t j = 0; j < emitted[b].size(); ++j) picked_rows.push_back(src + j * V), chosen.push_back(emitted[b][j]);
  }
  if (picked_rows.empty()) return {emitted, h, torch::empty({0, 3}, torch::kDouble)};
  auto picked = torch::empty({static_cast<int64_t>(picked_rows.size()), V}, torch::kFloat);
  for (size_t m = 0; m < picked_rows.size(); ++m)
    std::copy(picked_rows[m], picked_rows[m] + V, picked.data_ptr<float>() + m * V);
  return {emitted, h, token_logprobs(at::log_softmax(picked, -1), torch::tensor(chosen, torch::kLong), n)};
}

// ---- logprobs of emitted tokens: what sampling.token_logprobs reads back, in one call ----
// Rows of log-probabilities lp [M, V] float32 and the token chosen in each, tokens [M] int64: per row, float64
// [token, its logprob, its rank (1 + how many are larger), the n largest logprobs, their ids], largest first (of
// equal ones the lowest id first).
torch::Tensor token_logprobs(const torch::Tensor& lp, const torch::Tensor& tokens, int64_t n) {
  check(lp.dim() == 2 && lp.scalar_type() == torch::kFloat && lp.is_contiguous(),
        "token_logprobs: lp must be contiguous float32 [M, V]");
  const int64_t M = lp.size(0), V = lp.size(1);
  check(tokens.dim() == 1 && tokens.size(0) == M && tokens.scalar_type() == torch::kLong && tokens.is_contiguous(),
        "token_logprobs: tokens must be contiguous int64 [M]");
  check(n >= 0 && n <= V, "token_logprobs: n must be in [0, V]");
  torch::Tensor out = torch::empty({M, 3 + 2 * n}, torch::kDouble);
  double* o = out.data_ptr<double>();
  const float* x = lp.data_ptr<float>();
  const int64_t* t = tokens.data_ptr<int64_t>();
  std::vector<float> vals(n);
  std::vector<int64_t> ids(n);
  for (int64_t m = 0; m < M; ++m, x += V, o += 3 + 2 * n) {
    check(t[m] >= 0 && t[m] < V, "token_logprobs: token out of range");
    const float chosen = x[t[m]];
    const __m512 vc = _mm512_set1_ps(chosen);
    int64_t larger = 0, kept = 0;
    for (int64_t v0 = 0; v0 < V; v0 += kLanes) {
      const int64_t len = std::min<int64_t>(kLanes, V - v0);
      const __mmask16 mk = len == kLanes ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
      const __m512 xv = _mm512_maskz_loadu_ps(mk, x + v0);
      larger += __builtin_popcount(_mm512_mask_cmp_ps_mask(mk, xv, vc, _CMP_GT_OQ));
      // once n are kept, only lanes above the least of them can enter: most chunks have none
      if (n == 0 || (kept == n && !_mm512_mask_cmp_ps_mask(mk, xv, _mm512_set1_ps(vals[n - 1]), _CMP_GT_OQ))) continue;
      for (int64_t v = v0; v < v0 + len; ++v) {
        if (kept == n && !(x[v] > vals[n - 1])) continue;
        int64_t at = std::min(kept, n - 1);  // the slot it takes: after every kept value at least as large
        while (at > 0 && x[v] > vals[at - 1]) {
          vals[at] = vals[at - 1], ids[at] = ids[at - 1];
          --at;
        }
        vals[at] = x[v], ids[at] = v;
        kept = std::min(kept + 1, n);
      }
    }
    o[0] = static_cast<double>(t[m]), o[1] = chosen, o[2] = static_cast<double>(larger + 1);
    for (int64_t i = 0; i < n; ++i) o[3 + i] = vals[i], o[3 + n + i] = static_cast<double>(ids[i]);
  }
  return out;
}

// runtime.core.sampling's 32-bit hash (_mix32), in uint32 arithmetic (Python's int64 products masked to 32 bits).
inline uint32_t mix32(uint32_t x) {
  for (const uint32_t mult : {0x7FEB352Du, 0x68E31DA5u, 0x5BD1E995u}) x = (x ^ (x >> 16)) * mult;
  return x ^ (x >> 15);
}

// runtime.core.sampling._hashes of one (seed, position, purpose): hi, and lo where asked.
inline uint32_t seed_hash(int64_t seed, int64_t position, int64_t purpose, uint32_t* lo = nullptr) {
  const uint32_t lo32 = static_cast<uint32_t>(seed), hi32 = static_cast<uint32_t>(seed >> 32);
  const uint32_t where = mix32(static_cast<uint32_t>(position * 4 + purpose));
  if (lo) *lo = mix32(mix32(mix32(hi32 ^ 0x27D4EB2Fu) ^ lo32) ^ mix32(where ^ 0x165667B1u));
  return mix32(mix32(mix32(lo32) ^ hi32) ^ where);
}

void check_seeds(const torch::Tensor& seeds, const torch::Tensor& positions, int64_t n, const char* what) {
  check(seeds.dim() == 1 && seeds.size(0) == n && seeds.scalar_type() == torch::kLong && seeds.is_contiguous() &&
            positions.sizes() == seeds.sizes() && positions.scalar_type() == torch::kLong && positions.is_contiguous(),
        what);
}

// runtime.core.sampling.uniforms: U(0, 1) float64 draws of each row's (seed, position, purpose), [N].
torch::Tensor uniforms(const torch::Tensor& seeds, const torch::Tensor& positions, int64_t purpose) {
  check_seeds(seeds, positions, seeds.numel(), "uniforms: seeds and positions must be contiguous int64 [N]");
  const int64_t N = seeds.size(0);
  torch::Tensor out = torch::empty({N}, torch::kDouble);
  const int64_t *s = seeds.data_ptr<int64_t>(), *p = positions.data_ptr<int64_t>();
  double* o = out.data_ptr<double>();
  for (int64_t i = 0; i < N; ++i) {
    uint32_t lo;
    const uint32_t hi = seed_hash(s[i], p[i], purpose, &lo);
    o[i] = (static_cast<double>(hi) * 4294967296.0 + static_cast<double>(lo) + 0.5) / 18446744073709551616.0;
  }
  return out;
}

// One token per row of probs [R, V]: argmax_v p(v) / E_v with E_v = -log1p(-w_v), w_v = (x1 2^32 + x2 + 0.5) / 2^64,
// x1 = mix32(hi ^ mix32(v + 0x9E3779B9)), x2 = mix32(x1 ^ lo), (hi, lo) the row's seed_hash (runtime.core.sampling.race,
// bit for bit). E_v >= w_v >= x1 / 2^32, so a token whose p(v) / (x1 / 2^32) cannot beat the best so far needs neither
// x2 nor a log: most of a vocabulary is passed over on a hash and a division.
torch::Tensor race(const torch::Tensor& probs, const torch::Tensor& seeds, const torch::Tensor& positions,
                   int64_t purpose) {
  check(probs.dim() == 2 && probs.scalar_type() == torch::kFloat && probs.is_contiguous(),
        "race: probs must be contiguous float32 [R, V]");
  const int64_t R = probs.size(0), V = probs.size(1);
  check_seeds(seeds, positions, R, "race: seeds and positions must be contiguous int64 [R]");
  torch::Tensor out = torch::empty({R}, torch::kLong);
  const float* p = probs.data_ptr<float>();
  const int64_t *s = seeds.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  parallel(R, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = p + r * V;
      uint32_t lo;
      const uint32_t hi = seed_hash(s[r], pos[r], purpose, &lo);
      double best = -1.0;
      int64_t pick = 0;
      for (int64_t v = 0; v < V; ++v) {
        if (!(row[v] > 0.0f)) continue;
        const uint32_t x1 = mix32(hi ^ mix32(static_cast<uint32_t>(v) + 0x9E3779B9u));
        const double pv = static_cast<double>(row[v]);
        if (x1 != 0 && pv / (static_cast<double>(x1) / 4294967296.0) * (1.0 + 1e-12) <= best) continue;
        const uint32_t x2 = mix32(x1 ^ lo);
        const double w = (static_cast<double>(x1) * 4294967296.0 + static_cast<double>(x2) + 0.5) / 18446744073709551616.0;
        const double score = pv / -std::log1p(-w);
        if (score > best) best = score, pick = v;
      }
      o[r] = pick;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: other threads (request intake, streaming) run meanwhile, as with ATen ops.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("packed_linear", &packed_linear, "y = x W^T, W block-scaled FP8 or BF16 packed in 16-row panels", nogil);
  m.def("moe", &moe, "one MoE layer: noaux_tc routing, routed and shared FP8 experts", nogil);
  m.def("mla_attention", &mla_attention, "absorbed MLA over the paged latent cache", nogil);
  m.def("mla_prepare", &mla_prepare, "absorbed-MLA queries; latents written to the cache", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of rows", nogil);
  py::class_<Layer>(m, "Layer", "one decoder layer's kernel weights (see make_layer)");
  m.def("make_layer", &make_layer, "gather one decoder layer's weights for decoder_layer");
  m.def("decoder_layer", &decoder_layer, "one decoder layer: attention and MoE or MLP, with the kernels above", nogil);
  py::class_<LayerStack>(m, "LayerStack", "a model's decoder layers for decoder_layers");
  m.def("stack_layers", [](std::vector<Layer> layers) { return LayerStack{std::move(layers)}; }, "layers in order");
  m.def("decoder_layers", &decoder_layers, "decoder layers in turn", nogil);
  py::class_<Mtp>(m, "Mtp", "an MTP module's kernel weights (see make_mtp)");
  m.def("make_mtp", &make_mtp, "gather an MTP module's weights for mtp_layer");
  m.def("mtp_layer", &mtp_layer, "an MTP module: embedding, norms, eh_proj, decoder layer, shared head", nogil);
  m.def("mtp_greedy_drafts", &mtp_greedy_drafts, "greedy drafts: the MTP module over the catch-up, then on its own drafts",
        nogil);
  py::class_<Target>(m, "Target", "the target model's kernel weights around its layers (see make_target)");
  m.def("make_target", &make_target, "gather the embedding, rope, layers, final norm and lm_head for greedy_step");
  py::class_<Adjustments>(m, "Adjustments",
                          "a batch's logit biases, penalties and bans in adjust_logits' layout, for greedy_step")
      .def(py::init([](std::vector<int64_t> penalized, std::vector<torch::Tensor> counts,
                       std::vector<torch::Tensor> in_prompt, std::vector<double> values,
                       std::vector<std::vector<int64_t>> bad, std::vector<std::vector<int64_t>> stops,
                       std::vector<int64_t> stop_rows, std::vector<torch::Tensor> bias_tokens,
                       std::vector<torch::Tensor> bias_values) {
        return Adjustments{std::move(penalized), std::move(counts), std::move(in_prompt), std::move(values),
                           std::move(bad), std::move(stops), std::move(stop_rows), std::move(bias_tokens),
                           std::move(bias_values)};
      }));
  m.def("greedy_step", &greedy_step, "a greedy step: drafts, verification, acceptance (k = 0: plain decoding)",
        nogil);
  m.def("adjust_logits", &adjust_logits, "logit biases, penalties and bans of a batch's rows, drafts before each row "
        "counted", nogil);
  m.def("token_logprobs", &token_logprobs, "emitted tokens' logprobs, ranks and top-n alternatives", nogil);
  m.def("uniforms", &uniforms, "the counter-based U(0, 1) draws of (seed, position, purpose)", nogil);
  m.def("race", &race, "one token per row: the exponential race of runtime.core.sampling", nogil);
}
