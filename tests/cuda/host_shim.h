// host_shim.h: compile CUDA C kernels as host C++ (tests only).
//
// A host library built from a CUDA source is `#include "host_shim.h"`, the source
// inside a namespace, and one thunk per kernel (see host_code.py):
//
//   extern "C" void pjhost_<kernel>(void** params, const unsigned* launch);
//
// `params` is the kernel's argument array exactly as cuLaunchKernel takes it (one
// pointer to each argument's bytes) and `launch` is {gx, gy, gz, bx, by, bz, shmem}.
// The stub driver (stub_libcuda.c) calls it when a launch of that kernel runs.
//
// Execution: blocks run one after another. A kernel that never calls __syncthreads
// runs its threads as plain calls; one that does runs each thread of a block as a
// ucontext coroutine, and __syncthreads switches to the next thread, so every thread
// reaches the barrier before any passes it. Shared memory is a static local, shared
// by the threads of the block (the kernels initialise what they read).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <ucontext.h>

#define PJ_HAVE_STDINT 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct pj_dim3 { unsigned int x, y, z; };
static pj_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct alignas(16) float4 { float x, y, z, w; };

static inline float __int_as_float(long long i) { int v = (int)i; float f; std::memcpy(&f, &v, 4); return f; }
static inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
static inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
// The half types' conversions take their portable form here (__CUDA_ARCH__ is undefined):
// the kernels never reach the PTX of the device path.

// -- the scheduler of one launch ------------------------------------------------------

static ucontext_t pj_sched;
static ucontext_t* pj_ctxs;
static int pj_cur, pj_finished;
static bool pj_coroutines;  // false: threads run as plain calls (no barrier allowed)
static void (*pj_body)();
static void* pj_stacks;
static size_t pj_stack_threads;
static const size_t PJ_STACK = 1 << 16;

static void __syncthreads() {
  if (!pj_coroutines) {
    std::fprintf(stderr, "host_shim: __syncthreads in a kernel built without barriers\n");
    std::abort();
  }
  swapcontext(&pj_ctxs[pj_cur], &pj_sched);
}

static void pj_entry() { pj_body(); pj_finished = 1; }

static void pj_set_thread(unsigned t) {
  threadIdx = {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
}

// One block, threads as plain calls.
static void pj_block_plain(unsigned nt) {
  for (unsigned t = 0; t < nt; ++t) {
    pj_set_thread(t);
    pj_body();
  }
}

// Coroutine stacks are kept between launches (a block has at most 1024 threads).
static char* pj_stack_area(unsigned nt) {
  if (pj_stack_threads < nt) {
    std::free(pj_stacks);
    std::free(pj_ctxs);
    pj_stacks = std::malloc(PJ_STACK * nt);
    pj_ctxs = (ucontext_t*)std::malloc(sizeof(ucontext_t) * nt);
    pj_stack_threads = nt;
  }
  return (char*)pj_stacks;
}

// One block, threads as coroutines switched at each barrier.
static void pj_block_coroutines(unsigned nt) {
  char* stacks = pj_stack_area(nt);
  char alive[1024];
  for (unsigned t = 0; t < nt; ++t) {
    getcontext(&pj_ctxs[t]);
    pj_ctxs[t].uc_stack.ss_sp = stacks + t * PJ_STACK;
    pj_ctxs[t].uc_stack.ss_size = PJ_STACK;
    pj_ctxs[t].uc_link = &pj_sched;
    makecontext(&pj_ctxs[t], pj_entry, 0);
    alive[t] = 1;
  }
  unsigned left = nt;
  while (left) {
    for (unsigned t = 0; t < nt; ++t) {
      if (!alive[t]) continue;
      pj_cur = (int)t;
      pj_set_thread(t);
      pj_finished = 0;
      swapcontext(&pj_sched, &pj_ctxs[t]);
      if (pj_finished) { alive[t] = 0; --left; }
    }
  }
}

static void pj_run(void (*body)(), bool barriers, const unsigned* launch) {
  pj_body = body;
  pj_coroutines = barriers;
  gridDim = {launch[0], launch[1], launch[2]};
  blockDim = {launch[3], launch[4], launch[5]};
  const unsigned nt = launch[3] * launch[4] * launch[5];
  if (nt > 1024) {
    std::fprintf(stderr, "host_shim: a block of %u threads\n", nt);
    std::abort();
  }
  for (unsigned z = 0; z < gridDim.z; ++z)
    for (unsigned y = 0; y < gridDim.y; ++y)
      for (unsigned x = 0; x < gridDim.x; ++x) {
        blockIdx = {x, y, z};
        if (barriers) pj_block_coroutines(nt);
        else pj_block_plain(nt);
      }
}

// -- calling a kernel with a kernelParams array ---------------------------------------

template <typename... A, std::size_t... I>
static void pj_call(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_reference_t<A>*>(params[I])...);
}

// The kernel called with its arguments read from `params` (argument k from params[k]).
template <typename... A>
static void pj_invoke(void (*kernel)(A...), void** params) {
  pj_call(kernel, params, std::index_sequence_for<A...>{});
}

// Defines the thunk of one kernel: NS::NAME with or without barriers.
#define PJ_THUNK(NS, NAME, BARRIERS)                                       \
  static void** pj_params_##NAME;                                          \
  static void pj_body_##NAME() { pj_invoke(&NS::NAME, pj_params_##NAME); } \
  extern "C" void pjhost_##NAME(void** params, const unsigned* launch) {   \
    pj_params_##NAME = params;                                             \
    pj_run(pj_body_##NAME, BARRIERS, launch);                              \
  }
