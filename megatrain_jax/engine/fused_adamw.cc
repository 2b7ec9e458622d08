// AdamW over one leaf in one pass, in place: the gradient scaled and clipped, both moments, the
// weight and its compute-dtype (bf16) copy, each read and written once. Built and loaded by
// engine/fused_adamw.py, whose JAX fallback does the same operations in the same order: keep the
// two in step. (Neither is bit-identical to optax: XLA contracts multiply-adds into FMAs as it
// fuses, and so may the compiler here; tests/test_host_optim.py bounds both against float64.)
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The per-call scalars (engine/fused_adamw.py SCALARS), in this order.
enum { kScale, kClip, kNorm, kMaxNorm, kStep, kBc1, kBc2, kDecay, kWd, kB1, kC1, kB2, kC2, kEps,
       kNumScalars };

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

// The loop, one variant per (gradient type, clip, decay, bus): no branch inside, so it vectorizes.
template <typename G, bool kClip, bool kDecay, bool kBus>
void Run(const float* s, float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
         const G* __restrict__ g, uint16_t* __restrict__ bus, size_t lo, size_t hi) {
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
    if constexpr (kBus) bus[i] = f32_to_bf16(pi);
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

int Threads() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
}

void Split(Loop loop, const float* s, float* p, float* m, float* v, const void* g,
           uint16_t* bus, size_t n) {
  static const int threads = Threads();
  const size_t min_chunk = size_t(1) << 18;  // below this, a thread costs more than it saves
  const int k = int(std::min<size_t>(threads, std::max<size_t>(1, n / min_chunk)));
  const size_t chunk = (n / k + 15) & ~size_t(15);
  std::vector<std::thread> pool;
  for (int t = 1; t < k; ++t) {
    const size_t lo = std::min(n, t * chunk), hi = t == k - 1 ? n : std::min(n, lo + chunk);
    pool.emplace_back([=] { loop(s, p, m, v, g, bus, lo, hi); });
  }
  loop(s, p, m, v, g, bus, 0, k == 1 ? n : std::min(n, chunk));
  for (auto& t : pool) t.join();
}

ffi::Error Update(ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> v,
                  ffi::AnyBuffer g, ffi::Buffer<ffi::F32> s, uint16_t* bus,
                  ffi::ResultBuffer<ffi::F32> p_out, ffi::ResultBuffer<ffi::F32> m_out,
                  ffi::ResultBuffer<ffi::F32> v_out) {
  if (s.element_count() != kNumScalars) {
    return ffi::Error::InvalidArgument("fused_adamw: wrong number of scalars");
  }
  const size_t n = p.element_count();
  float *po = p_out->typed_data(), *mo = m_out->typed_data(), *vo = v_out->typed_data();
  // Aliased (donated) outputs are the inputs; otherwise (the disk tier's loaned buffers) copy.
  if (po != p.typed_data()) std::memcpy(po, p.typed_data(), 4 * n);
  if (mo != m.typed_data()) std::memcpy(mo, m.typed_data(), 4 * n);
  if (vo != v.typed_data()) std::memcpy(vo, v.typed_data(), 4 * n);
  const float* sc = s.typed_data();
  const bool clip = sc[kClip] != 0.0f, decay = sc[kDecay] != 0.0f;
  Loop loop;
  if (g.element_type() == ffi::DataType::F32) {
    loop = Pick<float>(clip, decay, bus != nullptr);
  } else if (g.element_type() == ffi::DataType::BF16) {
    loop = Pick<uint16_t>(clip, decay, bus != nullptr);
  } else {
    return ffi::Error::InvalidArgument("fused_adamw: the gradient must be float32 or bfloat16");
  }
  Split(loop, sc, po, mo, vo, g.untyped_data(), bus, n);
  return ffi::Error::Success();
}

ffi::Error UpdateWithBus(ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> m,
                         ffi::Buffer<ffi::F32> v, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> s,
                         ffi::Buffer<ffi::BF16>, ffi::ResultBuffer<ffi::F32> p_out,
                         ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> v_out,
                         ffi::ResultBuffer<ffi::BF16> bus_out) {
  return Update(p, m, v, g, s, reinterpret_cast<uint16_t*>(bus_out->typed_data()), p_out, m_out,
                v_out);
}

ffi::Error UpdateNoBus(ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> v,
                       ffi::AnyBuffer g, ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> p_out,
                       ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> v_out) {
  return Update(p, m, v, g, s, nullptr, p_out, m_out, v_out);
}

// Both take param, m, v, the gradient (f32 or bf16) and the scalars; the bus variant then the old
// bus copy (written over). They return param, m, v (and the bus copy) into the inputs' buffers.
auto Inputs() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedAdamwBus, UpdateWithBus,
                              Inputs()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedAdamw, UpdateNoBus,
                              Inputs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
