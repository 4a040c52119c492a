// Attention of query rows over their own cached prefix (contract.h, 3).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "attention_chunk.h"
#include "kernels.h"

namespace mg {
namespace {

constexpr int64_t kGroupRows = 64;  // rows sharing one widening of each K/V chunk (speed only)

// Rows of one KV head that attend over keys [0, len_i) of the same request's cache (kh, vh: where those
// keys lie). q[i]: row i's g query heads; out[i] likewise.
//
// The keys go in chunks of kChunk, merged by online softmax in ascending order. Where the chunks
// start is the rows' `align`: 0 lays them from position 0 (exact rows: a row's bits are its own);
// align = A > 0 lays them so that one ends at position A, as a kernel walking a batch padded to A
// keys (left padding) does. `fast` passes its batch's longest row, so its bits depend on its
// neighbours, as a padded batched decode's do. Rows share a group only where their chunks start
// at the same place; each chunk of K/V is widened to fp32 once for all of them (exact), and each
// row takes exactly the steps it would alone. A score is q . k with hsum's order (chunk_scores).
// One KV head of one layer's paged cache as one row group reads it: key j of the group is position lo + j
// of the group's table, widened to fp32 (bf16 and fp32 exactly; a quantized code times its group's scale, one
// rounding: contract.h, 6c). C: the cache's storage type (uint8_t: int4 codes, two a byte).
template <typename C>
struct CacheHead {
  const C* data;
  const float* scales;  // quantized only
  const BlockTables* bt;
  int64_t r, head, lo, hkv, block, d, width, group;  // width: stored elements per row; group: values per scale
  // keys [j0, j0 + n) into dst ([n, d] fp32), a run of consecutive rows of one block at a time (a KV head's
  // rows of a block lie side by side)
  void widen(int64_t j0, int64_t n, float* dst) const {
    const int64_t* table = bt->tables + bt->table_of[r] * bt->width;
    const int64_t groups = d / group;
    for (int64_t p = lo + j0; n > 0;) {
      const int64_t o = p % block, run = std::min(n, block - o), row = (table[p / block] * hkv + head) * block + o;
      widen_rows(data + row * width, scales ? scales + row * groups : nullptr, run, dst);
      p += run, n -= run, dst += run * d;
    }
  }
  void widen_rows(const C* src, const float* scale, int64_t rows, float* dst) const {
    if constexpr (std::is_same_v<C, int8_t>) {
      for (int64_t k = 0; k < rows; ++k, src += width, dst += d)
        for (int64_t g0 = 0; g0 < d; g0 += group) {
          const __m256 s = _mm256_set1_ps(*scale++);
          for (int64_t i = g0; i < g0 + group; i += 8) {
            const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(c), s));
          }
        }
    } else if constexpr (std::is_same_v<C, uint8_t>) {
      const int64_t half = group / 2;
      const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
      for (int64_t k = 0; k < rows; ++k, src += width, dst += d)
        for (int64_t g0 = 0; g0 < d; g0 += group) {
          const __m256 s = _mm256_set1_ps(*scale++);
          for (int64_t j = 0; j < half; j += 8) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + g0 / 2 + j)));
            const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(b, mask), eight);
            const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight);
            _mm256_storeu_ps(dst + g0 + j, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), s));
            _mm256_storeu_ps(dst + g0 + half + j, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), s));
          }
        }
    } else {
      for (int64_t e = 0; e < rows * d; e += 8) _mm256_storeu_ps(dst + e, load8(src + e));
    }
  }
};

// contract.h 6c: a head's d fp32 values rotated and times 1 / R (exact), in place.
void rotate_scaled(float* x, int64_t d) {
  hadamard(x, d);
  const float inv = 1.0f / static_cast<float>(hadamard_block(d));
  for (int64_t i = 0; i < d; ++i) x[i] *= inv;
}

// A row's g heads written out: acc / den, or, with attention sinks (gpt-oss: one learned logit per query head
// that joins the softmax's denominator and carries no value), the sink merged last, as one more chunk of one
// key whose value is zero: m = max(mx, sink), a = exp(mx - m), den = den * a + exp(sink - m), out = (acc * a) / den;
// then, for a rotated cache, back from the values' basis (contract.h 6c).
template <typename T>
void finish_row(const RowState& st, const float* sinks, bool rotate, int64_t g, int64_t d, T* out) {
  alignas(32) float o[256];
  for (int64_t h = 0; h < g; ++h) {
    float a = 1.0f, den = st.den[h];
    if (sinks) {
      const float m = std::max(st.mx[h], sinks[h]);
      a = exp1(st.mx[h] - m);
      den = den * a + exp1(sinks[h] - m);
    }
    for (int64_t e = 0; e < d; ++e) o[e] = (sinks ? st.acc[h * d + e] * a : st.acc[h * d + e]) / den;
    if (rotate) rotate_scaled(o, d);
    for (int64_t e = 0; e < d; ++e) out[h * d + e] = static_cast<T>(o[e]);
  }
}

template <typename T, typename C>
void attend_group(const T* const* q, const CacheHead<C>& kh, const CacheHead<C>& vh, const int64_t* len, int64_t rows,
                  int64_t align, int64_t g, int64_t d, float scale, const float* sinks, bool rotate,
                  T* const* out) {
  // every view 64-byte aligned (a vector load that crosses a cache line costs two): a row's q, acc, mx and den,
  // then the chunk's keys and values
  const int64_t heads = round_up(g * d, 16), per_row = 2 * heads + 2 * kMaxGroup;
  static thread_local std::vector<float> buf;
  buf.resize(rows * per_row + 2 * kChunk * d + 16);
  float* const base = reinterpret_cast<float*>(round_up(reinterpret_cast<intptr_t>(buf.data()), 64));
  float* const kf = base + rows * per_row;
  float* const vf = kf + kChunk * d;
  RowState st[kGroupRows];  // rows <= kGroupRows (group_starts): no allocation per task
  int64_t longest = 0;
  for (int64_t i = 0; i < rows; ++i) {
    float* b = base + i * per_row;
    st[i] = {b, b + heads, b + 2 * heads, b + 2 * heads + kMaxGroup};
    for (int64_t e = 0; e < g * d; ++e) st[i].qf[e] = static_cast<float>(q[i][e]), st[i].acc[e] = 0.0f;
    for (int64_t h = 0; h < g && rotate; ++h) rotate_scaled(st[i].qf + h * d, d);  // into the keys' basis
    for (int64_t h = 0; h < kMaxGroup; ++h) st[i].mx[h] = -INFINITY, st[i].den[h] = 0.0f;
    longest = std::max(longest, len[i]);
  }
  const int64_t first = align > 0 && align % kChunk ? align % kChunk : kChunk;
  for (int64_t c0 = 0, size = first; c0 < longest; c0 += size, size = kChunk) {
    const int64_t cn = std::min(size, longest - c0);
    kh.widen(c0, cn, kf);
    vh.widen(c0, cn, vf);
    for (int64_t i = 0; i < rows; ++i)
      if (len[i] > c0) row_chunk(st[i], kf, vf, std::min(cn, len[i] - c0), g, d, scale);
  }
  for (int64_t i = 0; i < rows; ++i) finish_row(st[i], sinks, rotate, g, d, out[i]);
}

// Groups: runs of rows of one request (one block table) whose chunks start at 0 (a prompt's rows, a verifier window), so
// a chunk of K/V is widened once for all of them; any other row is a group of its own. Returns each
// group's first row, then n.
std::vector<int64_t> group_starts(const int64_t* table, const int64_t* align, int64_t n, int64_t window) {
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < n; ++r) {
    const bool joins = r > 0 && r - starts.back() < kGroupRows && table[r] == table[r - 1] && window == 0 &&
                       align[r] == 0 && align[r - 1] == 0;
    if (!joins) starts.push_back(r);
  }
  starts.push_back(n);
  return starts;
}

// Tasks group * hkv + KV head, the costliest (most keys read) first: a prompt's late rows read many
// more keys than its early ones, and threads take the next task when free (`attention`).
std::vector<int64_t> costliest_first(const std::vector<int64_t>& starts, const int64_t* len, int64_t hkv) {
  std::vector<std::pair<int64_t, int64_t>> cost;
  for (int64_t i = 0; i + 1 < int64_t(starts.size()); ++i) {
    int64_t keys = 0;
    for (int64_t r = starts[i]; r < starts[i + 1]; ++r) keys += len[r];
    for (int64_t kvh = 0; kvh < hkv; ++kvh) cost.push_back({-keys, i * hkv + kvh});
  }
  std::stable_sort(cost.begin(), cost.end());
  std::vector<int64_t> tasks;
  for (const auto& c : cost) tasks.push_back(c.second);
  return tasks;
}

// One task: rows [r0, r0 + rows) against KV head kvh of their request's cache. q, out: [N, H, D] of T.
template <typename T, typename C>
void run_task(const T* q, const LayerCache& c, const BlockTables& bt, T* out, const int64_t* len, const int64_t* align,
              int64_t r0, int64_t rows, int64_t kvh, int64_t h, int64_t window, float scale, const float* sinks) {
  const int64_t g = h / c.kv_heads, d = c.d;
  // the group's keys are [lo, len): attend_group sees them as a prefix starting at lo
  const int64_t lo = window > 0 ? std::max<int64_t>(0, len[r0] - window) : 0, al = align[r0] ? align[r0] - lo : 0;
  const CacheHead<C> kh{static_cast<const C*>(c.k), c.k_scale, &bt, r0, kvh, lo, c.kv_heads, c.block, d, c.width(), c.group};
  const CacheHead<C> vh{static_cast<const C*>(c.v), c.v_scale, &bt, r0, kvh, lo, c.kv_heads, c.block, d, c.width(), c.group};
  int64_t keys[kGroupRows];
  const T* qs[kGroupRows];
  T* os[kGroupRows];
  for (int64_t r = 0; r < rows; ++r) {
    keys[r] = len[r0 + r] - lo;
    qs[r] = q + ((r0 + r) * h + kvh * g) * d;
    os[r] = out + ((r0 + r) * h + kvh * g) * d;
  }
  attend_group(qs, kh, vh, keys, rows, al, g, d, scale, sinks ? sinks + kvh * g : nullptr, c.rotate, os);
}

template <typename T>
void run_task_for(const T* q, const LayerCache& c, const BlockTables& bt, T* out, const int64_t* len,
                  const int64_t* align, int64_t r0, int64_t rows, int64_t kvh, int64_t h, int64_t window, float scale,
                  const float* sinks) {
  if (c.dtype == at::kChar) run_task<T, int8_t>(q, c, bt, out, len, align, r0, rows, kvh, h, window, scale, sinks);
  else if (c.dtype == at::kByte) run_task<T, uint8_t>(q, c, bt, out, len, align, r0, rows, kvh, h, window, scale, sinks);
  else if (c.dtype == at::kFloat) run_task<T, float>(q, c, bt, out, len, align, r0, rows, kvh, h, window, scale, sinks);
  else run_task<T, bf16>(q, c, bt, out, len, align, r0, rows, kvh, h, window, scale, sinks);
}

}  // namespace

// Row r attends over keys [0, lengths[r]) of its request's paged cache (kernels.h: BlockTables, LayerCache).
// `aligns`: per row, 0 (exact) or the padded length its chunks align to (see attend_group).
// `window` > 0: a row sees only its last `window` keys (sliding-window layers) and lays its
// chunks from the first of them, so its bits stay a function of its own position.
// `sinks`: empty, or one fp32 logit per query head (gpt-oss's attention sinks, merged last: finish_row).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& k_scale, const at::Tensor& v_scale, bool rotate, const at::Tensor& tables,
                     const at::Tensor& table_of, const at::Tensor& lengths, const at::Tensor& aligns, double scale,
                     int64_t window, const at::Tensor& sinks) {
  check_cpu(q, "q");
  const LayerCache c = layer_cache(k_cache, v_cache, k_scale, v_scale, rotate);
  TORCH_CHECK(q.dim() == 3, "attention: q [N, H, D]");
  const int64_t n = q.size(0), h = q.size(1), d = q.size(2), hkv = c.kv_heads;
  TORCH_CHECK(c.d == d && d % 8 == 0 && d <= 256, "attention: head dim must be a multiple of 8, <= 256");
  TORCH_CHECK(h % hkv == 0 && h / hkv <= kMaxGroup, "attention: query heads must be a multiple of KV heads (<= 16x)");
  at::Tensor ln = lengths.to(at::kLong).contiguous(), al = aligns.to(at::kLong).contiguous();
  TORCH_CHECK(table_of.numel() == n && ln.numel() == n && al.numel() == n, "attention: one table, length, align per row");
  TORCH_CHECK(window >= 0, "attention: window must be >= 0");
  const at::Tensor sk = sinks.numel() ? sinks.to(at::kFloat).contiguous() : sinks;
  TORCH_CHECK(sk.numel() == 0 || sk.numel() == h, "attention: one sink per query head");
  const float* sp = sk.numel() ? sk.data_ptr<float>() : nullptr;
  const BlockTables bt = block_tables(tables, table_of, ln, k_cache.size(0), c.block);
  const int64_t* lp = ln.data_ptr<int64_t>();
  const int64_t* ap = al.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(ap[r] >= 0, "attention: align out of range");
  at::Tensor out = at::empty_like(q);
  const std::vector<int64_t> starts = group_starts(bt.table_of, ap, n, window);
  const std::vector<int64_t> tasks = costliest_first(starts, lp, hkv);
  const bool fp32_q = q.scalar_type() == at::kFloat;
  const float sc = static_cast<float>(scale);
  std::atomic<int64_t> next{0};  // which thread runs a task changes no bit
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), int64_t(tasks.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next++) < int64_t(tasks.size());) {
      const int64_t i = tasks[t] / hkv, kvh = tasks[t] % hkv, r0 = starts[i], rows = starts[i + 1] - r0;
      if (fp32_q)
        run_task_for(q.data_ptr<float>(), c, bt, out.data_ptr<float>(), lp, ap, r0, rows, kvh, h, window, sc, sp);
      else
        run_task_for(q.data_ptr<bf16>(), c, bt, out.data_ptr<bf16>(), lp, ap, r0, rows, kvh, h, window, sc, sp);
    }
  });
  return out;
}

}  // namespace mg
