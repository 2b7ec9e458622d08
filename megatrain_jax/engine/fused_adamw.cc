// AdamW over every leaf of a unit in one call, in place: the gradient scaled and clipped, both
// moments, the weight and its compute-dtype (bf16) copy, each read and written once. Built and
// loaded by engine/fused_adamw.py, whose JAX fallback does the same operations in the same order:
// keep the two in step. (Neither is bit-identical to optax: XLA contracts multiply-adds into FMAs
// as it fuses, and so may the compiler here; tests/test_host_optim.py bounds both against float64.)
//
// One call per unit, not per leaf: XLA:CPU runs independent custom calls concurrently on its own
// threads, so one call per leaf ran several leaves at once, each over its own threads, more
// threads than cores. Here the unit's leaves, laid end to end, are cut into one contiguous range
// per thread (cuts on cache-line boundaries of every array), so each core streams its share once,
// on a persistent pool of one thread per core. The same loop is called two ways: as an XLA FFI
// handler (FusedAdamw, FusedAdamwBus) inside a jit, and directly (megatrain_adamw, through
// ctypes: engine/direct.py) on buffers the caller owns.
#include <sched.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
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

// The per-call scalars (engine/fused_adamw.py SCALARS), in this order; then one decay flag a leaf.
enum { kScale, kClip, kNorm, kMaxNorm, kStep, kBc1, kBc2, kWd, kB1, kC1, kB2, kC2, kEps, kNumScalars };

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

// Elements [lo, hi): params and moments updated in place, the new weights' bf16 copy written to
// out[i - lo] (kBus). One variant per (gradient type, clip, decay, bus): no branch inside, so the
// compiler vectorizes it.
template <typename G, bool kClip, bool kDecay, bool kBus>
inline void Span(const float* s, float* __restrict__ p, float* __restrict__ m,
                 float* __restrict__ v, const G* __restrict__ g, uint16_t* __restrict__ out,
                 size_t lo, size_t hi) {
  const float scale = s[kScale], norm = s[kNorm], max_norm = s[kMaxNorm], step = s[kStep];
  const float bc1 = s[kBc1], bc2 = s[kBc2], wd = s[kWd], b1 = s[kB1], c1 = s[kC1], b2 = s[kB2];
  const float c2 = s[kC2], eps = s[kEps], r1 = 1.0f / bc1, r2 = 1.0f / bc2;
  for (size_t i = lo; i < hi; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) {
      gi = bf16_to_f32(g[i]);
    } else {
      gi = g[i];
    }
    gi = gi * scale;
    if constexpr (kClip) gi = (gi / norm) * max_norm;
    const float mi = c1 * gi + b1 * m[i];
    const float vi = c2 * (gi * gi) + b2 * v[i];
    float u = (mi * r1) / (std::sqrt(vi * r2) + eps);
    if constexpr (kDecay) u = u + wd * p[i];
    const float pi = p[i] + step * u;
    m[i] = mi;
    v[i] = vi;
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
template <typename G, bool kClip, bool kDecay, bool kBus>
void Run(const float* s, float* p, float* m, float* v, const G* g, uint16_t* bus, size_t lo,
         size_t hi) {
  if constexpr (!kBus) {
    Span<G, kClip, kDecay, false>(s, p, m, v, g, nullptr, lo, hi);
  } else {
    const size_t to_line = ((64 - reinterpret_cast<uintptr_t>(bus + lo) % 64) % 64) / 2;
    size_t i = std::min(hi, lo + to_line);
    Span<G, kClip, kDecay, true>(s, p, m, v, g, bus + lo, lo, i);
    for (; i + kLine <= hi; i += kLine) {
      alignas(64) uint16_t line[kLine];
      Span<G, kClip, kDecay, true>(s, p, m, v, g, line, i, i + kLine);
      StreamLine(bus + i, line);
    }
    Span<G, kClip, kDecay, true>(s, p, m, v, g, bus + i, i, hi);
#if defined(__SSE2__)
    _mm_sfence();
#endif
  }
}

using Loop = void (*)(const float*, float*, float*, float*, const void*, uint16_t*, size_t,
                      size_t);

template <typename G, bool kClip, bool kDecay, bool kBus>
void RunAny(const float* s, float* p, float* m, float* v, const void* g, uint16_t* bus, size_t lo,
            size_t hi) {
  Run<G, kClip, kDecay, kBus>(s, p, m, v, static_cast<const G*>(g), bus, lo, hi);
}

template <typename G>
Loop Pick(bool clip, bool decay, bool bus) {
  static const Loop loops[8] = {
      RunAny<G, false, false, false>, RunAny<G, false, false, true>,
      RunAny<G, false, true, false>,  RunAny<G, false, true, true>,
      RunAny<G, true, false, false>,  RunAny<G, true, false, true>,
      RunAny<G, true, true, false>,   RunAny<G, true, true, true>};
  return loops[4 * clip + 2 * decay + bus];
}

// One leaf: its buffers (outputs; the inputs when XLA could not alias them, to copy from first).
struct Leaf {
  float *p, *m, *v;
  const float *p_in, *m_in, *v_in;
  const void* g;
  uint16_t* bus;
  size_t n;
  Loop loop;
};

// Elements [lo, hi) of a leaf: copied from the inputs where not aliased, then updated.
void RunLeaf(const float* s, const Leaf& x, size_t lo, size_t hi) {
  if (lo >= hi) return;
  const size_t bytes = 4 * (hi - lo);
  if (x.p != x.p_in) std::memcpy(x.p + lo, x.p_in + lo, bytes);
  if (x.m != x.m_in) std::memcpy(x.m + lo, x.m_in + lo, bytes);
  if (x.v != x.v_in) std::memcpy(x.v + lo, x.v_in + lo, bytes);
  x.loop(s, x.p, x.m, x.v, x.g, x.bus, lo, hi);
}

int Threads() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
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
class Pool {
 public:
  static Pool& Get() {
    static std::mutex made;
    static Pool* pool = nullptr;
    std::lock_guard<std::mutex> lock(made);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new Pool(Threads());  // never freed
    return *pool;
  }

  int size() const { return n_; }

  // fn(t) for t in [0, k), k <= size(); the calling thread runs t = 0.
  void Run(int k, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> job(job_);
    k = std::max(1, std::min(k, n_));
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
  explicit Pool(int n) : n_(n), pid_(getpid()) {
    for (int t = 1; t < n_; ++t) std::thread([this, t] { Work(t); }).detach();
  }

  void Work(int t) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* task;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (t >= k_) continue;
        task = task_;
      }
      (*task)(t);
      std::lock_guard<std::mutex> lock(m_);
      if (--pending_ == 0) finished_.notify_one();
    }
  }

  const int n_;
  const pid_t pid_;
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

// Arguments: the scalars (SCALARS, then one decay flag per leaf), then per leaf in groups:
// params, m, v, gradients (f32 or bf16)[, the old bf16 copy]. Results: params, m, v[, bf16 copy],
// aliased to the matching arguments.
ffi::Error Update(ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs args,
                  ffi::RemainingRets rets, bool with_bus) {
  const size_t groups = with_bus ? 5 : 4, n_leaves = args.size() / groups;
  if (args.size() != groups * n_leaves || rets.size() != (groups - 1) * n_leaves ||
      scalars.element_count() != kNumScalars + n_leaves) {
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
    for (int j = 0; j < 3; ++j) {
      if (in[j].element_type() != ffi::DataType::F32 || in[j].element_count() != n ||
          out[j].element_type() != ffi::DataType::F32 || out[j].element_count() != n) {
        return ffi::Error::InvalidArgument("fused_adamw: params and moments must be float32 alike");
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
    Loop loop;
    if (in[3].element_count() != n) {
      return ffi::Error::InvalidArgument("fused_adamw: a gradient's size differs from its param's");
    } else if (in[3].element_type() == ffi::DataType::F32) {
      loop = Pick<float>(clip, decay, with_bus);
    } else if (in[3].element_type() == ffi::DataType::BF16) {
      loop = Pick<uint16_t>(clip, decay, with_bus);
    } else {
      return ffi::Error::InvalidArgument("fused_adamw: the gradient must be float32 or bfloat16");
    }
    leaves.push_back({Data<float>(out[0]), Data<float>(out[1]), Data<float>(out[2]),
                      Data<float>(in[0]), Data<float>(in[1]), Data<float>(in[2]),
                      in[3].untyped_data(), bus, n, loop});
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
extern "C" {

struct MegatrainRange {
  float* p;
  float* m;
  float* v;
  const void* g;
  uint16_t* bus;  // nullptr: no bus copy written
  uint64_t n;
  int32_t grad_bf16;
  int32_t decay;
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
    const Loop loop = r.grad_bf16 ? Pick<uint16_t>(clip, r.decay != 0, bus)
                                  : Pick<float>(clip, r.decay != 0, bus);
    leaves.push_back({r.p, r.m, r.v, r.p, r.m, r.v, r.g, r.bus, size_t(r.n), loop});
  }
  if (!leaves.empty()) Parallel(scalars, leaves);
  return 0;
}

// dst[0, nbytes) = src[0, nbytes), spread over the pool (each thread's pages are first touched by
// it: a fresh buffer's page faults are taken by every core, not one).
void megatrain_copy(void* dst, const void* src, uint64_t nbytes) {
  Pool& pool = Pool::Get();
  const size_t chunk = size_t(1) << 20;
  const int k = int(std::min<size_t>(pool.size(), std::max<size_t>(1, nbytes / chunk)));
  const size_t per = (nbytes / k + 63) & ~size_t(63);
  pool.Run(k, [&](int t) {
    const size_t lo = std::min<size_t>(nbytes, per * t), hi = std::min<size_t>(nbytes, lo + per);
    if (hi > lo) std::memcpy(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo, hi - lo);
  });
}

// dst[i] = bf16(src[i]) for i < n, rounded as the update rounds its bus copy.
void megatrain_to_bf16(uint16_t* dst, const float* src, uint64_t n) {
  Pool& pool = Pool::Get();
  const size_t chunk = size_t(1) << 18;
  const int k = int(std::min<size_t>(pool.size(), std::max<size_t>(1, n / chunk)));
  const size_t per = (n / k + 31) & ~size_t(31);
  pool.Run(k, [&](int t) {
    const size_t lo = std::min<size_t>(n, per * t), hi = std::min<size_t>(n, lo + per);
    for (size_t i = lo; i < hi; ++i) dst[i] = f32_to_bf16(src[i]);
  });
}

int megatrain_threads() { return Pool::Get().size(); }

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
