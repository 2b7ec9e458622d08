// AdamW over every leaf of a unit in one call, in place: the gradient scaled and clipped, both
// moments, the weight and its compute-dtype (bf16) copy, each read and written once. Built and
// loaded by engine/fused_adamw.py, whose JAX fallback does the same operations in the same order,
// with the same roundings: keep the two in step. It is built without contracting a multiply and
// an add into an FMA (-ffp-contract=off), and the fallback keeps XLA from contracting them, so
// the two give the same bits (tests/test_host_optim.py). Neither is bit-identical to optax;
// tests/test_host_optim.py bounds both against float64.
//
// The moments are float32 (exact AdamW) or bfloat16 (optimizer.state_dtype): read as bf16,
// computed in f32, written back stochastically rounded, each rounding's random bits a hash of
// (the step's Adam count, the unit's index, the leaf's index in its unit, the element's index in
// the whole leaf): a resumed run rounds as the uninterrupted one did, two units' roundings are
// independent however alike their values, and a process holding some rows of a leaf (the sharded
// host layout) rounds them as a process holding all of it.
//
// One call per unit, not per leaf: XLA:CPU runs independent custom calls concurrently on its own
// threads, so one call per leaf ran several leaves at once, each over its own threads, more
// threads than cores. Here the unit's leaves, laid end to end, are cut into one contiguous range
// per thread (cuts on cache-line boundaries of every array), so each core streams its share once,
// on a persistent pool of one thread per core. The same loop is called two ways: as an XLA FFI
// handler (FusedAdamw, FusedAdamwBus) inside a jit, and directly (megatrain_adamw, through
// ctypes: engine/direct.py) on buffers the caller owns.
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The per-call scalars (engine/fused_adamw.py SCALARS), in this order; then, in the FFI call, per
// leaf its decay flag, then per leaf the index of its first element in the whole leaf (`first`,
// mod 2^32) in two exact 16-bit halves: all the low halves, then all the high ones.
enum {
  kScale, kClip, kNorm, kMaxNorm, kStep, kBc1, kBc2, kWd, kB1, kC1, kB2, kC2, kEps,
  kCountLo, kCountHi,  // the Adam count after this step, in two exact 16-bit halves
  kUnit,  // the unit's index (exact in f32)
  kNumScalars
};

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t rounded = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40u) : rounded;
}

// A 32-bit integer hash (a bijection with good avalanche: "lowbias32", C. Wellons). The JAX
// fallback (engine/fused_adamw.py `_mix`) computes the same.
inline uint32_t Mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The key of one leaf's roundings at one step; element i's random bits are Mix(key + i), i its
// index in the whole leaf.
inline uint32_t LeafKey(const float* s, uint32_t leaf) {
  const uint32_t count = uint32_t(s[kCountLo]) | (uint32_t(s[kCountHi]) << 16);
  const uint32_t unit = uint32_t(s[kUnit]);
  return Mix(Mix(Mix(count * 0x9e3779b9u ^ 0x5bd1e995u) + unit * 0xc2b2ae35u) +
             leaf * 0x85ebca6bu);
}

// f32 to bf16 rounded stochastically: up with probability (the dropped 16 bits) / 2^16, so the
// rounding is unbiased; `r` holds the 16 random bits. NaN stays NaN, inf stays inf.
inline uint16_t f32_to_bf16_stochastic(float f, uint32_t r) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t rounded = uint16_t((u + (r & 0xffffu)) >> 16);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40u) : rounded;
}

// Elements [lo, hi) of a leaf: params and moments updated in place, the new weights' bf16 copy
// written to out[i - lo] (kBus). M: the moments' type (float, or uint16_t for bf16); `key` and
// `first` (the index in the whole leaf of element 0 of these pointers) give a bf16 moment's
// random bits. One
// variant per (gradient type, moments' type, clip, decay, bus): no branch inside, so the compiler
// vectorizes it.
template <typename G, typename M, bool kClip, bool kDecay, bool kBus>
inline void Span(const float* s, float* __restrict__ p, M* __restrict__ m, M* __restrict__ v,
                 const G* __restrict__ g, uint16_t* __restrict__ out, size_t lo, size_t hi,
                 uint32_t key, uint64_t first) {
  const float scale = s[kScale], norm = s[kNorm], max_norm = s[kMaxNorm], step = s[kStep];
  const float bc1 = s[kBc1], bc2 = s[kBc2], wd = s[kWd], b1 = s[kB1], c1 = s[kC1], b2 = s[kB2];
  const float c2 = s[kC2], eps = s[kEps], r1 = 1.0f / bc1, r2 = 1.0f / bc2;
  constexpr bool kHalf = sizeof(M) == 2;
  for (size_t i = lo; i < hi; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) {
      gi = bf16_to_f32(g[i]);
    } else {
      gi = g[i];
    }
    float m_old, v_old;
    if constexpr (kHalf) {
      m_old = bf16_to_f32(m[i]);
      v_old = bf16_to_f32(v[i]);
    } else {
      m_old = m[i];
      v_old = v[i];
    }
    gi = gi * scale;
    if constexpr (kClip) gi = (gi / norm) * max_norm;
    const float mi = c1 * gi + b1 * m_old;
    const float vi = c2 * (gi * gi) + b2 * v_old;
    float u = (mi * r1) / (std::sqrt(vi * r2) + eps);
    if constexpr (kDecay) u = u + wd * p[i];
    const float pi = p[i] + step * u;
    if constexpr (kHalf) {
      const uint32_t r = Mix(key + uint32_t(first + i));  // low half m's bits, high half v's
      m[i] = f32_to_bf16_stochastic(mi, r);
      v[i] = f32_to_bf16_stochastic(vi, r >> 16);
    } else {
      m[i] = mi;
      v[i] = vi;
    }
    p[i] = pi;
    if constexpr (kBus) out[i - lo] = f32_to_bf16(pi);
  }
}

constexpr size_t kLine = 32;  // bf16 elements in a 64-byte cache line

// One 64-byte line to `to` (64-byte aligned) with a non-temporal store: the line is only written,
// so it skips the read for ownership a plain store makes (2 B/param less memory traffic).
inline void StreamLine(uint16_t* to, const uint16_t* line) {
#if defined(__AVX512F__)
  _mm512_stream_si512(reinterpret_cast<__m512i*>(to), _mm512_load_si512(line));
#elif defined(__AVX__)
  for (int k = 0; k < 2; ++k) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(to) + k,
                        _mm256_load_si256(reinterpret_cast<const __m256i*>(line) + k));
  }
#elif defined(__SSE2__)
  for (int k = 0; k < 4; ++k) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(to) + k,
                     _mm_load_si128(reinterpret_cast<const __m128i*>(line) + k));
  }
#else
  std::memcpy(to, line, 64);
#endif
}

// Elements [lo, hi) of one leaf; the bf16 copy streamed out a line at a time, then fenced (the
// thread that joins this one reads it next).
template <typename G, typename M, bool kClip, bool kDecay, bool kBus>
void Run(const float* s, float* p, M* m, M* v, const G* g, uint16_t* bus, size_t lo, size_t hi,
         uint32_t key, uint64_t first) {
  if constexpr (!kBus) {
    Span<G, M, kClip, kDecay, false>(s, p, m, v, g, nullptr, lo, hi, key, first);
  } else {
    const size_t to_line = ((64 - reinterpret_cast<uintptr_t>(bus + lo) % 64) % 64) / 2;
    size_t i = std::min(hi, lo + to_line);
    Span<G, M, kClip, kDecay, true>(s, p, m, v, g, bus + lo, lo, i, key, first);
    for (; i + kLine <= hi; i += kLine) {
      alignas(64) uint16_t line[kLine];
      Span<G, M, kClip, kDecay, true>(s, p, m, v, g, line, i, i + kLine, key, first);
      StreamLine(bus + i, line);
    }
    Span<G, M, kClip, kDecay, true>(s, p, m, v, g, bus + i, i, hi, key, first);
#if defined(__SSE2__)
    _mm_sfence();
#endif
  }
}

using Loop = void (*)(const float*, float*, void*, void*, const void*, uint16_t*, size_t,
                      size_t, uint32_t, uint64_t);

template <typename G, typename M, bool kClip, bool kDecay, bool kBus>
void RunAny(const float* s, float* p, void* m, void* v, const void* g, uint16_t* bus, size_t lo,
            size_t hi, uint32_t key, uint64_t first) {
  Run<G, M, kClip, kDecay, kBus>(s, p, static_cast<M*>(m), static_cast<M*>(v),
                                 static_cast<const G*>(g), bus, lo, hi, key, first);
}

template <typename G, typename M>
Loop PickFor(bool clip, bool decay, bool bus) {
  static const Loop loops[8] = {
      RunAny<G, M, false, false, false>, RunAny<G, M, false, false, true>,
      RunAny<G, M, false, true, false>,  RunAny<G, M, false, true, true>,
      RunAny<G, M, true, false, false>,  RunAny<G, M, true, false, true>,
      RunAny<G, M, true, true, false>,   RunAny<G, M, true, true, true>};
  return loops[4 * clip + 2 * decay + bus];
}

// The loop for a gradient (bf16 or f32) and moments (bf16 or f32).
Loop Pick(bool grad_bf16, bool moments_bf16, bool clip, bool decay, bool bus) {
  if (moments_bf16) {
    return grad_bf16 ? PickFor<uint16_t, uint16_t>(clip, decay, bus)
                     : PickFor<float, uint16_t>(clip, decay, bus);
  }
  return grad_bf16 ? PickFor<uint16_t, float>(clip, decay, bus)
                   : PickFor<float, float>(clip, decay, bus);
}

// One leaf: its buffers (outputs; the inputs when XLA could not alias them, to copy from first).
// m and v hold `moment_bytes` (4 or 2) a element; key and first: their roundings' (Span).
struct Leaf {
  float* p;
  void *m, *v;
  const float* p_in;
  const void *m_in, *v_in;
  const void* g;
  uint16_t* bus;
  size_t n;
  Loop loop;
  size_t moment_bytes;
  uint32_t key;
  uint64_t first;
};

// Elements [lo, hi) of a leaf: copied from the inputs where not aliased, then updated.
void RunLeaf(const float* s, const Leaf& x, size_t lo, size_t hi) {
  if (lo >= hi) return;
  const size_t mb = x.moment_bytes;
  if (x.p != x.p_in) std::memcpy(x.p + lo, x.p_in + lo, 4 * (hi - lo));
  if (x.m != x.m_in) {
    std::memcpy(static_cast<char*>(x.m) + mb * lo, static_cast<const char*>(x.m_in) + mb * lo,
                mb * (hi - lo));
  }
  if (x.v != x.v_in) {
    std::memcpy(static_cast<char*>(x.v) + mb * lo, static_cast<const char*>(x.v_in) + mb * lo,
                mb * (hi - lo));
  }
  x.loop(s, x.p, x.m, x.v, x.g, x.bus, lo, hi, x.key, x.first);
}

// The CPUs of the process's affinity, in order (one pool thread each).
std::vector<int> Cpus() {
  cpu_set_t set;
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) cpus.push_back(-1);  // unknown: one thread, never pinned
  return cpus;
}

// A position in the leaves laid end to end: leaf `leaf`, element `i` of it.
struct Cut {
  size_t leaf, i;
};

// The leaves cut into k ranges of about equal length; a cut inside a leaf falls on a multiple of
// 32 elements (a 64-byte line of the bf16 copy, whole lines of the fp32 arrays).
std::vector<Cut> Cuts(const std::vector<Leaf>& leaves, size_t total, int k) {
  std::vector<Cut> cuts = {{0, 0}};
  size_t leaf = 0, start = 0;  // start: the global index of leaf's first element
  for (int t = 1; t < k; ++t) {
    const size_t at = total / k * t;
    while (start + leaves[leaf].n <= at) start += leaves[leaf++].n;
    cuts.push_back({leaf, std::max(cuts.back().leaf == leaf ? cuts.back().i : size_t(0),
                                   (at - start) & ~size_t(31))});
  }
  cuts.push_back({leaves.size(), 0});
  return cuts;
}

// Leaves [from.leaf, to.leaf], from element from.i of the first to element to.i of the last.
void RunRange(const float* s, const std::vector<Leaf>& leaves, Cut from, Cut to) {
  for (size_t l = from.leaf; l < leaves.size() && l <= to.leaf; ++l) {
    RunLeaf(s, leaves[l], l == from.leaf ? from.i : 0, l == to.leaf ? to.i : leaves[l].n);
  }
}

// A persistent pool of worker threads (one per core of the process's affinity, the caller being
// one of them): a thread spawned per call costs page faults and tens of microseconds a unit.
// One job at a time (the host-update thread and XLA's FFI calls may both submit). A child process
// made by fork() has no workers: it builds a pool of its own on first use.
//
// Limit(k) runs every later job on k threads (optimizer.host_threads), worker t then pinned to
// the t-th CPU of the affinity, so the CPUs past k stay free for the thread that dispatches the
// device's work (the caller, t = 0, is pinned by its owner: engine/host.py).
class Pool {
 public:
  static Pool& Get() {
    static std::mutex made;
    static Pool* pool = nullptr;
    std::lock_guard<std::mutex> lock(made);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new Pool(Cpus());  // never freed
    return *pool;
  }

  int size() const { return limit_.load(); }
  int cores() const { return n_; }

  // Returns the limit taken: k clamped to [1, cores()].
  int Limit(int k) {
    std::lock_guard<std::mutex> job(job_);  // between jobs
    limit_ = std::max(1, std::min(k, n_));
    ++placement_;
    return limit_;
  }

  // fn(t) for t in [0, k), k <= size(); the calling thread runs t = 0.
  void Run(int k, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> job(job_);
    k = std::max(1, std::min(k, limit_.load()));
    if (k > 1) {
      std::lock_guard<std::mutex> lock(m_);
      task_ = &fn;
      k_ = k;
      pending_ = k - 1;
      ++generation_;
    }
    cv_.notify_all();
    fn(0);
    if (k > 1) {
      std::unique_lock<std::mutex> lock(m_);
      finished_.wait(lock, [&] { return pending_ == 0; });
    }
  }

 private:
  explicit Pool(std::vector<int> cpus)
      : n_(int(cpus.size())), pid_(getpid()), cpus_(std::move(cpus)), limit_(n_) {
    for (int t = 1; t < n_; ++t) std::thread([this, t] { Work(t); }).detach();
  }

  // Worker t on its own CPU while the pool is limited, else on any of the affinity's.
  void Place(int t) {
    if (cpus_[0] < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (limit_.load() < n_) {
      CPU_SET(cpus_[t], &set);
    } else {
      for (int c : cpus_) CPU_SET(c, &set);
    }
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }

  void Work(int t) {
    uint64_t seen = 0, placed = 0;
    for (;;) {
      const std::function<void(int)>* task;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (t >= k_) continue;
        task = task_;
      }
      if (placed != placement_.load()) {
        placed = placement_.load();
        Place(t);
      }
      (*task)(t);
      std::lock_guard<std::mutex> lock(m_);
      if (--pending_ == 0) finished_.notify_one();
    }
  }

  const int n_;
  const pid_t pid_;
  const std::vector<int> cpus_;
  std::atomic<int> limit_;
  std::atomic<uint64_t> placement_{0};
  std::mutex job_, m_;
  std::condition_variable cv_, finished_;
  const std::function<void(int)>* task_ = nullptr;
  int k_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
};

void Parallel(const float* s, const std::vector<Leaf>& leaves) {
  Pool& pool = Pool::Get();
  size_t total = 0;
  for (const Leaf& x : leaves) total += x.n;
  const size_t min_chunk = size_t(1) << 18;  // below this, a thread costs more than it saves
  const int k = int(std::min<size_t>(pool.size(), std::max<size_t>(1, total / min_chunk)));
  const std::vector<Cut> cuts = Cuts(leaves, total, k);
  pool.Run(k, [&](int t) { RunRange(s, leaves, cuts[t], cuts[t + 1]); });
}

template <typename T>
T* Data(ffi::AnyBuffer b) {
  return static_cast<T*>(b.untyped_data());
}

// Arguments: the scalars (SCALARS, then per leaf its decay flag and its first element's index),
// then per leaf in groups:
// params, m, v (f32 or bf16, both alike), gradients (f32 or bf16)[, the old bf16 copy]. Results:
// params, m, v[, bf16 copy], aliased to the matching arguments.
ffi::Error Update(ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs args,
                  ffi::RemainingRets rets, bool with_bus) {
  const size_t groups = with_bus ? 5 : 4, n_leaves = args.size() / groups;
  if (args.size() != groups * n_leaves || rets.size() != (groups - 1) * n_leaves ||
      scalars.element_count() != kNumScalars + 3 * n_leaves) {
    return ffi::Error::InvalidArgument("fused_adamw: wrong number of arguments");
  }
  const float* s = scalars.typed_data();
  std::vector<Leaf> leaves;
  for (size_t l = 0; l < n_leaves; ++l) {
    // (The arguments' count was checked above: every index is in range.)
    auto arg = [&](size_t group) { return *args.get<ffi::AnyBuffer>(group * n_leaves + l); };
    auto ret = [&](size_t group) { return **rets.get<ffi::AnyBuffer>(group * n_leaves + l); };
    const ffi::AnyBuffer in[4] = {arg(0), arg(1), arg(2), arg(3)};
    const ffi::AnyBuffer out[3] = {ret(0), ret(1), ret(2)};
    const size_t n = in[0].element_count();
    const bool half = in[1].element_type() == ffi::DataType::BF16;
    for (int j = 0; j < 3; ++j) {
      const ffi::DataType want = j == 0 || !half ? ffi::DataType::F32 : ffi::DataType::BF16;
      if (in[j].element_type() != want || in[j].element_count() != n ||
          out[j].element_type() != want || out[j].element_count() != n) {
        return ffi::Error::InvalidArgument(
            "fused_adamw: params must be float32, both moments float32 or both bfloat16");
      }
    }
    uint16_t* bus = nullptr;
    if (with_bus) {
      const ffi::AnyBuffer b = ret(3);
      if (b.element_type() != ffi::DataType::BF16 || b.element_count() != n) {
        return ffi::Error::InvalidArgument("fused_adamw: the bus copy must be bfloat16");
      }
      bus = Data<uint16_t>(b);
    }
    const bool clip = s[kClip] != 0.0f, decay = s[kNumScalars + l] != 0.0f;
    const uint64_t first = uint32_t(s[kNumScalars + n_leaves + l]) |
                           (uint32_t(s[kNumScalars + 2 * n_leaves + l]) << 16);
    Loop loop;
    if (in[3].element_count() != n) {
      return ffi::Error::InvalidArgument("fused_adamw: a gradient's size differs from its param's");
    } else if (in[3].element_type() == ffi::DataType::F32) {
      loop = Pick(false, half, clip, decay, with_bus);
    } else if (in[3].element_type() == ffi::DataType::BF16) {
      loop = Pick(true, half, clip, decay, with_bus);
    } else {
      return ffi::Error::InvalidArgument("fused_adamw: the gradient must be float32 or bfloat16");
    }
    leaves.push_back({Data<float>(out[0]), out[1].untyped_data(), out[2].untyped_data(),
                      Data<float>(in[0]), in[1].untyped_data(), in[2].untyped_data(),
                      in[3].untyped_data(), bus, n, loop, size_t(half ? 2 : 4),
                      LeafKey(s, uint32_t(l)), first});
  }
  Parallel(s, leaves);
  return ffi::Error::Success();
}

ffi::Error UpdateWithBus(ffi::Buffer<ffi::F32> s, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Update(s, args, rets, true);
}

ffi::Error UpdateNoBus(ffi::Buffer<ffi::F32> s, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return Update(s, args, rets, false);
}

}  // namespace

// ------------------------------------------------------------------------------------------
// The same update called directly (engine/direct.py, through ctypes, which releases the GIL): on
// buffers the caller owns, in place. One range per leaf (or per piece of a leaf), each with its
// own gradient buffer, bf16 or f32, and optionally its bf16 bus copy.
// fn(lo, hi) over [0, n) cut into one range per pool thread (none smaller than min_chunk, each
// starting at a multiple of align elements, so no two threads share a cache line).
template <typename Fn>
void InRanges(size_t n, size_t min_chunk, size_t align, const Fn& fn) {
  Pool& pool = Pool::Get();
  const int k = int(std::min<size_t>(pool.size(), std::max<size_t>(1, n / min_chunk)));
  const size_t per = (n / k + align - 1) / align * align;
  pool.Run(k, [&](int t) {
    const size_t lo = std::min<size_t>(n, per * t), hi = std::min<size_t>(n, lo + per);
    if (hi > lo) fn(lo, hi);
  });
}

extern "C" {

struct MegatrainRange {
  float* p;
  void* m;  // float32, or bfloat16 where moments_bf16
  void* v;
  const void* g;
  uint16_t* bus;  // nullptr: no bus copy written
  uint64_t n;
  int32_t grad_bf16;
  int32_t decay;
  int32_t moments_bf16;
  uint32_t leaf;   // the leaf's index in its unit, and the index in the whole leaf of the
  uint64_t first;  // range's first element: a bf16 moment's rounding (as the FFI call's)
};

// scalars: SCALARS (engine/fused_adamw.py) without the decay flags. Returns 0, or -1 when a range
// has a null buffer.
int megatrain_adamw(const float* scalars, const MegatrainRange* ranges, int64_t count) {
  const bool clip = scalars[kClip] != 0.0f;
  std::vector<Leaf> leaves;
  for (int64_t i = 0; i < count; ++i) {
    const MegatrainRange& r = ranges[i];
    if (r.p == nullptr || r.m == nullptr || r.v == nullptr || (r.g == nullptr && r.n > 0)) return -1;
    const bool bus = r.bus != nullptr;
    const Loop loop = Pick(r.grad_bf16 != 0, r.moments_bf16 != 0, clip, r.decay != 0, bus);
    leaves.push_back({r.p, r.m, r.v, r.p, r.m, r.v, r.g, r.bus, size_t(r.n), loop,
                      size_t(r.moments_bf16 ? 2 : 4), LeafKey(scalars, r.leaf), r.first});
  }
  if (!leaves.empty()) Parallel(scalars, leaves);
  return 0;
}

// dst[0, nbytes) = src[0, nbytes), spread over the pool (each thread's pages are first touched by
// it: a fresh buffer's page faults are taken by every core, not one).
void megatrain_copy(void* dst, const void* src, uint64_t nbytes) {
  InRanges(nbytes, size_t(1) << 20, 64, [&](size_t lo, size_t hi) {
    std::memcpy(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo, hi - lo);
  });
}

// dst[i] = bf16(src[i]) for i < n, rounded as the update rounds its bus copy.
void megatrain_to_bf16(uint16_t* dst, const float* src, uint64_t n) {
  InRanges(n, size_t(1) << 18, 32, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) dst[i] = f32_to_bf16(src[i]);
  });
}

// dst[0, nbytes) = 0, spread over the pool (a persistent buffer cleared where it lies).
void megatrain_zero(void* dst, uint64_t nbytes) {
  InRanges(nbytes, size_t(1) << 20, 64, [&](size_t lo, size_t hi) {
    std::memset(static_cast<char*>(dst) + lo, 0, hi - lo);
  });
}

// The threads a job runs on (optimizer.host_threads; every CPU of the affinity by default).
int megatrain_threads() { return Pool::Get().size(); }

// The CPUs of the process's affinity: the most threads a job can run on.
int megatrain_cores() { return Pool::Get().cores(); }

// Every later job on k threads (clamped to [1, cores]); returns the number taken.
int megatrain_set_threads(int k) { return Pool::Get().Limit(k); }

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedAdamwBus, UpdateWithBus,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedAdamw, UpdateNoBus,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
