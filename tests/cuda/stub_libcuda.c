// stub_libcuda.c: a strict stand-in for the CUDA driver library (libcuda.so.1), for
// tests on machines without a GPU. Built by tests/cuda/stub.py; a test process that
// runs with LD_LIBRARY_PATH pointing at the build gets it from cuda.bindings (and so
// cuda.core), which resolve every entry point through cuGetProcAddress_v2.
//
// What it models, and how strictly (see tests/cuda/README.md for the full list):
// - devices (PJSTUB_DEVICES, PJSTUB_CC, PJSTUB_MEMORY, PJSTUB_SMS, PJSTUB_PEER), each
//   with a primary context; a current context per thread;
// - handles: every handle is an opaque id looked up in a registry, so a destroyed or
//   made-up handle is an error, never a crash;
// - device memory: a reserved address range per device, carved into allocations with
//   gaps between them; every copy, memset and pointer argument is checked against the
//   live allocations;
// - images: cubins (ELF, EM_CUDA) checked against the device's arch, their kernels
//   and parameter layouts read from the symbol table and .nv.info sections; PTX read
//   from its .entry directives; the host code of an image is <sha256>.so in
//   PJSTUB_KERNELS (built by the tests from the same CUDA source);
// - streams are deferred queues: work runs only when something waits for it, and by
//   default (PJSTUB_SCHEDULE=others_first) every other stream runs first;
// - faults are sticky: the context returns CUDA_ERROR_ILLEGAL_ADDRESS until
//   cuDevicePrimaryCtxReset.
//
// One mutex serialises every entry point: work runs in the thread that waits for it.
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------------------------
 * CUDA types and constants (the subset used here; values from cuda.h 13.0)
 * ---------------------------------------------------------------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef void* CUhandle;  // CUcontext, CUstream, CUevent, CUmodule, ... are all opaque

enum {
  CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3, CUDA_ERROR_NO_DEVICE = 100, CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200, CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NO_BINARY_FOR_GPU = 209, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
  CUDA_ERROR_INVALID_PTX = 218, CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
  CUDA_ERROR_INVALID_HANDLE = 400, CUDA_ERROR_ILLEGAL_STATE = 401, CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600, CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
  CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705, CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_LAUNCH_FAILED = 719, CUDA_ERROR_NOT_PERMITTED = 800, CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
  CUDA_ERROR_STREAM_CAPTURE_MERGE = 902, CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
  CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904, CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905,
  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906, CUDA_ERROR_CAPTURED_EVENT = 907,
  CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908, CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910,
  CUDA_ERROR_UNKNOWN = 999,
};

enum { CU_STREAM_NON_BLOCKING = 0x1 };
enum { CU_EVENT_BLOCKING_SYNC = 0x1, CU_EVENT_DISABLE_TIMING = 0x2, CU_EVENT_INTERPROCESS = 0x4 };
enum { CU_EVENT_WAIT_EXTERNAL = 0x1 };
enum { CU_MEMHOSTALLOC_ALL = 0x7 };
enum { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2 };
enum { CU_MEM_LOCATION_TYPE_DEVICE = 1, CU_MEM_LOCATION_TYPE_HOST = 2,
       CU_MEM_LOCATION_TYPE_HOST_NUMA = 3, CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 4 };
enum { CU_STREAM_CAPTURE_STATUS_NONE = 0, CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
       CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2 };
enum { CU_STREAM_CAPTURE_MODE_GLOBAL = 0, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
       CU_STREAM_CAPTURE_MODE_RELAXED = 2 };
enum { CU_GRAPH_NODE_TYPE_KERNEL = 0, CU_GRAPH_NODE_TYPE_MEMCPY = 1, CU_GRAPH_NODE_TYPE_MEMSET = 2,
       CU_GRAPH_NODE_TYPE_HOST = 3, CU_GRAPH_NODE_TYPE_EMPTY = 5, CU_GRAPH_NODE_TYPE_WAIT_EVENT = 6,
       CU_GRAPH_NODE_TYPE_EVENT_RECORD = 7 };
enum { CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
       CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
       CU_FUNC_ATTRIBUTE_NUM_REGS = 4, CU_FUNC_ATTRIBUTE_PTX_VERSION = 5,
       CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6, CU_FUNC_ATTRIBUTE_CACHE_MODE_CA = 7,
       CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
       CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9, CU_FUNC_ATTRIBUTE_MAX = 16 };
enum { CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
       CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
       CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
       CU_MEMPOOL_ATTR_USED_MEM_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_HIGH };
enum { CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
       CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
       CU_DEVICE_ATTRIBUTE_MAX = 148 };

typedef struct { int type; int id; } CUmemLocation;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct {
  int allocType, handleTypes;
  CUmemLocation location;
  void* win32SecurityAttributes;
  size_t maxSize;
  unsigned short usage;
  unsigned char reserved[54];
} CUmemPoolProps;

typedef struct {
  CUhandle func;
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  void** kernelParams;
  void** extra;
  CUhandle kern;  // v2 only
  CUhandle ctx;   // v2 only
} CUDA_KERNEL_NODE_PARAMS;

typedef struct {
  CUdeviceptr dst;
  size_t pitch;
  unsigned value, elementSize;
  size_t width, height;
} CUDA_MEMSET_NODE_PARAMS;

typedef struct { void (*fn)(void*); void* userData; } CUDA_HOST_NODE_PARAMS;

typedef struct {
  uint64_t flags;
  CUhandle hUploadStream;
  CUhandle hErrNode_out;
  int result_out;
} CUDA_GRAPH_INSTANTIATE_PARAMS;

typedef struct { int result; CUhandle errorNode; CUhandle errorFromNode; } CUgraphExecUpdateResultInfo;

typedef struct { unsigned char from_port, to_port, type, reserved[5]; } CUgraphEdgeData;

typedef struct {
  int id;
  char pad[4];
  union { char bytes[64]; int i; struct { unsigned x, y, z; } dim; } value;
} CUlaunchAttribute;

typedef struct {
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUhandle hStream;
  CUlaunchAttribute* attrs;
  unsigned numAttrs;
} CUlaunchConfig;

typedef struct { char bytes[16]; } CUuuid;

/* ------------------------------------------------------------------------------------
 * Configuration (read once, at cuInit)
 * ---------------------------------------------------------------------------------- */

#define MAX_DEVICES 8
#define DRIVER_VERSION 13000
#define GAP 256            // bytes between two allocations: an overrun lands in no allocation
#define ALIGN 256          // cuMemAlloc alignment
#define SHMEM_DEFAULT 49152
#define SHMEM_OPTIN 232448  // 227 KiB
#define RESERVED_SHMEM 1024

enum { SCHED_OTHERS_FIRST = 0, SCHED_TARGET_FIRST = 1 };

static struct {
  int devices, cc_major[MAX_DEVICES], cc_minor[MAX_DEVICES], sms, peer, trace, schedule;
  int query_polls, driver_version;
  size_t memory;
  char kernels[4096];
} cfg;

static long env_long(const char* name, long fallback) {
  const char* v = getenv(name);
  return v && *v ? strtol(v, NULL, 0) : fallback;
}

// "1G", "512M", "65536": bytes.
static size_t env_bytes(const char* name, size_t fallback) {
  const char* v = getenv(name);
  if (!v || !*v) return fallback;
  char* end;
  double x = strtod(v, &end);
  size_t unit = *end == 'G' || *end == 'g' ? 1ul << 30 : *end == 'M' || *end == 'm' ? 1ul << 20
              : *end == 'K' || *end == 'k' ? 1ul << 10 : 1;
  return (size_t)(x * (double)unit);
}

// PJSTUB_CC: "9.0" for every device, or "9.0,8.6" one per device (the last repeats).
static void read_cc(void) {
  const char* v = getenv("PJSTUB_CC");
  int major = 9, minor = 0;
  for (int d = 0; d < MAX_DEVICES; ++d) {
    if (v && *v) {
      major = (int)strtol(v, (char**)&v, 10);
      minor = *v == '.' ? (int)strtol(v + 1, (char**)&v, 10) : 0;
      if (*v == ',') ++v;
    }
    cfg.cc_major[d] = major;
    cfg.cc_minor[d] = minor;
  }
}

static void read_config(void) {
  cfg.devices = (int)env_long("PJSTUB_DEVICES", 1);
  if (cfg.devices < 0) cfg.devices = 0;
  if (cfg.devices > MAX_DEVICES) cfg.devices = MAX_DEVICES;
  read_cc();
  cfg.memory = env_bytes("PJSTUB_MEMORY", 1ul << 30);
  cfg.sms = (int)env_long("PJSTUB_SMS", 132);
  cfg.peer = (int)env_long("PJSTUB_PEER", 1);
  cfg.trace = (int)env_long("PJSTUB_TRACE", 0);
  cfg.query_polls = (int)env_long("PJSTUB_QUERY_POLLS", 2);
  cfg.driver_version = (int)env_long("PJSTUB_DRIVER_VERSION", DRIVER_VERSION);
  const char* s = getenv("PJSTUB_SCHEDULE");
  cfg.schedule = s && !strcmp(s, "target_first") ? SCHED_TARGET_FIRST : SCHED_OTHERS_FIRST;
  const char* k = getenv("PJSTUB_KERNELS");
  snprintf(cfg.kernels, sizeof cfg.kernels, "%s", k ? k : "");
}

/* ------------------------------------------------------------------------------------
 * Errors, tracing, the global lock
 * ---------------------------------------------------------------------------------- */

static const struct { int code; const char *name, *text; } error_table[] = {
#define E(c, n, t) {c, #n, t}
  E(0, CUDA_SUCCESS, "no error"),
  E(1, CUDA_ERROR_INVALID_VALUE, "invalid argument"),
  E(2, CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
  E(3, CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
  E(4, CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
  E(100, CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
  E(101, CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
  E(200, CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
  E(201, CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
  E(209, CUDA_ERROR_NO_BINARY_FOR_GPU, "no kernel image is available for execution on the device"),
  E(217, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices"),
  E(218, CUDA_ERROR_INVALID_PTX, "a PTX JIT compilation failed"),
  E(222, CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "the provided PTX was compiled with an unsupported toolchain."),
  E(400, CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
  E(401, CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state"),
  E(500, CUDA_ERROR_NOT_FOUND, "named symbol not found"),
  E(600, CUDA_ERROR_NOT_READY, "device not ready"),
  E(700, CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
  E(701, CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch"),
  E(704, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"),
  E(705, CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled"),
  E(709, CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"),
  E(719, CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"),
  E(800, CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
  E(801, CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
  E(900, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing"),
  E(901, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture"),
  E(902, CUDA_ERROR_STREAM_CAPTURE_MERGE, "operation would result in a merge of separate capture sequences"),
  E(903, CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "capture was not ended in the same stream as it began"),
  E(904, CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "capturing stream has unjoined work"),
  E(905, CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "dependency created on uncaptured work in another stream"),
  E(906, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "operation would make the legacy stream depend on a capturing blocking stream"),
  E(907, CUDA_ERROR_CAPTURED_EVENT, "operation not permitted on an event last recorded in a capturing stream"),
  E(908, CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "attempt to terminate a thread-local capture sequence from another thread"),
  E(910, CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"),
  E(999, CUDA_ERROR_UNKNOWN, "unknown error"),
#undef E
};

static const char* error_name(CUresult r) {
  for (size_t i = 0; i < sizeof error_table / sizeof *error_table; ++i)
    if (error_table[i].code == r) return error_table[i].name;
  return "CUDA_ERROR_UNKNOWN";
}

static pthread_mutex_t g_lock;
static pthread_once_t g_lock_once = PTHREAD_ONCE_INIT;
static __thread int tls_in_callback;  // inside a host function run by a stream

static void read_config(void);

// The lock and the configuration, once per process.
static void init_once(void) {
  read_config();
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&g_lock, &a);
}

static __thread int tls_lock_depth;

static void lock(void) {
  pthread_once(&g_lock_once, init_once);
  pthread_mutex_lock(&g_lock);
  ++tls_lock_depth;
}

// User-object destructors whose last reference went: they run after the lock is
// released (they may take other locks, e.g. Python's), like the driver's own thread.
typedef struct { void (*fn)(void*); void* data; } destructor;
static destructor* doomed;
static size_t n_doomed, cap_doomed;

static void run_destructors(void) {
  while (n_doomed) {
    pthread_mutex_lock(&g_lock);
    destructor d = doomed[--n_doomed];
    pthread_mutex_unlock(&g_lock);
    tls_in_callback = 1;
    d.fn(d.data);
    tls_in_callback = 0;
  }
}

static CUresult unlock_ret(const char* fn, CUresult r) {
  if (cfg.trace) fprintf(stderr, "pjstub: %s -> %s\n", fn, error_name(r));
  int outermost = --tls_lock_depth == 0;
  pthread_mutex_unlock(&g_lock);
  if (outermost && n_doomed) run_destructors();
  return r;
}

// Every entry point: ENTER; ...; LEAVE(result). No CUDA call from a stream callback.
#define ENTER                                                      \
  lock();                                                          \
  if (tls_in_callback) return unlock_ret(__func__, CUDA_ERROR_NOT_PERMITTED)
#define LEAVE(r) return unlock_ret(__func__, (r))
#define CHECK(expr)                    \
  do {                                 \
    CUresult check_r_ = (expr);        \
    if (check_r_) LEAVE(check_r_);     \
  } while (0)
#define TRY(expr)                      \
  do {                                 \
    CUresult try_r_ = (expr);          \
    if (try_r_) return try_r_;         \
  } while (0)

static void complain(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("pjstub: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static void* xcalloc(size_t n, size_t size) {
  void* p = calloc(n ? n : 1, size ? size : 1);
  if (!p) {
    complain("out of host memory");
    abort();
  }
  return p;
}

static void* xrealloc(void* p, size_t size) {
  p = realloc(p, size ? size : 1);
  if (!p) {
    complain("out of host memory");
    abort();
  }
  return p;
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* ------------------------------------------------------------------------------------
 * The handle registry: every handle given out is an id, never a pointer, and is looked
 * up here, so a destroyed or made-up handle is found missing instead of dereferenced.
 * Ids are never reused.
 * ---------------------------------------------------------------------------------- */

enum kind { K_FREE, K_CTX, K_STREAM, K_EVENT, K_MODULE, K_FUNC, K_LIBRARY, K_KERNEL,
            K_GRAPH, K_NODE, K_EXEC, K_POOL, K_USEROBJ };

typedef struct obj { int kind; uint64_t id; } obj;

static struct { uint64_t* keys; obj** vals; size_t cap, used; } reg;  // open addressing
static uint64_t next_serial = 1;
#define TOMBSTONE ((obj*)1)

static size_t reg_slot(uint64_t id) { return (size_t)((id >> 4) * 0x9E3779B97F4A7C15ull) & (reg.cap - 1); }

static void reg_grow(void) {
  size_t old_cap = reg.cap;
  uint64_t* old_keys = reg.keys;
  obj** old_vals = reg.vals;
  reg.cap = old_cap ? old_cap * 2 : 1024;
  reg.keys = xcalloc(reg.cap, sizeof *reg.keys);
  reg.vals = xcalloc(reg.cap, sizeof *reg.vals);
  reg.used = 0;
  for (size_t i = 0; i < old_cap; ++i) {
    if (!old_vals[i] || old_vals[i] == TOMBSTONE) continue;
    size_t j = reg_slot(old_keys[i]);
    while (reg.vals[j]) j = (j + 1) & (reg.cap - 1);
    reg.keys[j] = old_keys[i];
    reg.vals[j] = old_vals[i];
    ++reg.used;
  }
  free(old_keys);
  free(old_vals);
}

// Registers o under a fresh id (which looks like an aligned pointer, never 0, 1 or 2).
static void reg_add(obj* o, int kind) {
  if ((reg.used + 1) * 2 > reg.cap) reg_grow();
  o->kind = kind;
  o->id = 0x7a0000000000ull + (next_serial++ << 4);
  size_t j = reg_slot(o->id);
  while (reg.vals[j] && reg.vals[j] != TOMBSTONE) j = (j + 1) & (reg.cap - 1);
  reg.keys[j] = o->id;
  reg.vals[j] = o;
  ++reg.used;
}

static obj* reg_find(uint64_t id) {
  if (!reg.cap) return NULL;
  for (size_t j = reg_slot(id), n = 0; reg.vals[j] && n < reg.cap; j = (j + 1) & (reg.cap - 1), ++n)
    if (reg.vals[j] != TOMBSTONE && reg.keys[j] == id) return reg.vals[j];
  return NULL;
}

static void* reg_get(CUhandle h, int kind) {
  obj* o = reg_find((uint64_t)(uintptr_t)h);
  return o && o->kind == kind ? o : NULL;
}

static void reg_remove(obj* o) {
  for (size_t j = reg_slot(o->id); reg.vals[j]; j = (j + 1) & (reg.cap - 1))
    if (reg.vals[j] == o) {
      reg.vals[j] = TOMBSTONE;
      break;
    }
  o->kind = K_FREE;
}

#define HANDLE(o) ((CUhandle)(uintptr_t)((obj*)(o))->id)

// Calls fn on every registered object of a kind (fn may remove it).
static void reg_each(int kind, void (*fn)(obj*, void*), void* arg) {
  for (size_t j = 0; j < reg.cap; ++j) {
    obj* o = reg.vals[j];
    if (o && o != TOMBSTONE && o->kind == kind) fn(o, arg);
  }
}

/* ------------------------------------------------------------------------------------
 * SHA-256 (the key of an image's host library)
 * ---------------------------------------------------------------------------------- */

static const uint32_t sha_k[64] = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha_block(uint32_t h[8], const unsigned char* p) {
  uint32_t w[64], v[8];
  for (int i = 0; i < 16; ++i)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  memcpy(v, h, sizeof v);
  for (int i = 0; i < 64; ++i) {
    uint32_t t1 = v[7] + (ROR(v[4], 6) ^ ROR(v[4], 11) ^ ROR(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) + sha_k[i] + w[i];
    uint32_t t2 = (ROR(v[0], 2) ^ ROR(v[0], 13) ^ ROR(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
    memmove(v + 1, v, 7 * sizeof *v);
    v[4] += t1;
    v[0] = t1 + t2;
  }
  for (int i = 0; i < 8; ++i) h[i] += v[i];
}

static void sha256_hex(const void* data, size_t n, char out[65]) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const unsigned char* p = data;
  size_t full = n / 64 * 64;
  for (size_t i = 0; i < full; i += 64) sha_block(h, p + i);
  unsigned char tail[128] = {0};
  size_t rest = n - full, len = rest < 56 ? 64 : 128;
  memcpy(tail, p + full, rest);
  tail[rest] = 0x80;
  for (size_t i = 0; i < 8; ++i) tail[len - 1 - i] = (unsigned char)((uint64_t)n * 8 >> (8 * i));
  for (size_t i = 0; i < len; i += 64) sha_block(h, tail + i);
  for (int i = 0; i < 8; ++i) snprintf(out + 8 * i, 9, "%08x", h[i]);
}

/* ------------------------------------------------------------------------------------
 * Images: cubins and PTX. An image is parsed once (cached by its SHA-256) into its
 * kernels: name, parameter layout, limits. Kernels run through the host library
 * PJSTUB_KERNELS/<sha256>.so, whose pjhost_<name>(params, launch) is the kernel.
 * ---------------------------------------------------------------------------------- */

#define EM_CUDA 190
#define PTX_ISA_MAX 90  // PTX ISA 9.0: what a 13.0 driver JIT-compiles

typedef void (*host_fn)(void** params, const unsigned* launch);
typedef struct { uint32_t offset, size; } param;

typedef struct kinfo {
  char* name;
  param* params;
  int nparams;
  uint32_t param_bytes;
  int max_threads;          // __launch_bounds__ / .maxntid; 1024 without
  unsigned reqntid[3];      // .reqntid: the only block shape allowed (0: any)
  int regs, static_smem, const_bytes, local_bytes;
  host_fn host;
} kinfo;

typedef struct image {
  char sha[65];
  int is_ptx, sm, ptx_version;
  kinfo* kernels;
  int nkernels;
  int lib_state;  // 0: not looked for yet, 1: loaded, 2: missing
  void* lib;
  struct image* next;
} image;

static image* images;  // every image ever parsed (never freed: ops point at kernels)

static uint16_t rd16(const unsigned char* p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t rd32(const unsigned char* p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd64(const unsigned char* p) { uint64_t v; memcpy(&v, p, 8); return v; }

typedef struct {
  const unsigned char* base;
  uint64_t shoff;
  unsigned shnum, shentsize, shstrndx;
} elf;

typedef struct { uint32_t name, type; uint64_t offset, size; uint32_t link; } section;

static section elf_section(const elf* e, unsigned i) {
  const unsigned char* s = e->base + e->shoff + (uint64_t)i * e->shentsize;
  section out = {rd32(s), rd32(s + 4), rd64(s + 24), rd64(s + 32), rd32(s + 40)};
  return out;
}

static const char* elf_section_name(const elf* e, unsigned i) {
  section names = elf_section(e, e->shstrndx);
  return (const char*)e->base + names.offset + elf_section(e, i).name;
}

static int elf_find(const elf* e, const char* prefix, const char* name) {
  for (unsigned i = 1; i < e->shnum; ++i) {
    const char* n = elf_section_name(e, i);
    size_t lp = strlen(prefix);
    if (!strncmp(n, prefix, lp) && !strcmp(n + lp, name)) return (int)i;
  }
  return -1;
}

// The extent of the ELF file: the end of its last header table or section.
static size_t elf_extent(const elf* e) {
  const unsigned char* h = e->base;
  uint64_t end = e->shoff + (uint64_t)e->shnum * e->shentsize;
  uint64_t phend = rd64(h + 32) + (uint64_t)rd16(h + 56) * rd16(h + 54);
  if (phend > end) end = phend;
  for (unsigned i = 1; i < e->shnum; ++i) {
    section s = elf_section(e, i);
    if (s.type != 8 /* SHT_NOBITS */ && s.offset + s.size > end) end = s.offset + s.size;
  }
  return (size_t)end;
}

// The header checks of a CUDA cubin (64-bit little-endian ELF, e_machine EM_CUDA).
static int elf_open(const void* data, elf* e) {
  const unsigned char* h = data;
  if (memcmp(h, "\x7f" "ELF", 4) || h[4] != 2 || h[5] != 1 || rd16(h + 18) != EM_CUDA) return 0;
  e->base = h;
  e->shoff = rd64(h + 40);
  e->shentsize = rd16(h + 58);
  e->shnum = rd16(h + 60);
  e->shstrndx = rd16(h + 62);
  if (e->shentsize != 64 || !e->shnum || e->shstrndx >= e->shnum || e->shoff > (1ull << 31)) return 0;
  return elf_extent(e) < (1ull << 31);
}

// The SM version of a cubin: CUDA 13's ELF (EI_OSABI 0x41) keeps it in bits 8..15 of
// e_flags (sm_80: 0x5004, sm_90: 0x5a04, sm_120: 0x7802); older ones in bits 0..7.
static int elf_sm(const elf* e) {
  uint32_t flags = rd32(e->base + 48);
  return e->base[7] == 0x41 ? (int)(flags >> 8 & 0xff) : (int)(flags & 0xff);
}

static void kinfo_defaults(kinfo* k, const char* name) {
  memset(k, 0, sizeof *k);
  k->name = strdup(name);
  k->max_threads = 1024;
}

// One EIATTR record of an .nv.info.<kernel> section.
static void nvinfo_record(kinfo* k, int attr, const unsigned char* v, unsigned len) {
  if (attr == 0x17 && len >= 12) {  // EIATTR_KPARAM_INFO: index, ordinal, offset, flags
    unsigned ordinal = rd16(v + 4), offset = rd16(v + 6), size = rd32(v + 8) >> 18 & 0x3fff;
    if ((int)ordinal >= k->nparams) {
      k->params = xrealloc(k->params, (ordinal + 1) * sizeof *k->params);
      for (unsigned i = (unsigned)k->nparams; i <= ordinal; ++i) k->params[i] = (param){0, 0};
      k->nparams = (int)ordinal + 1;
    }
    k->params[ordinal] = (param){offset, size};
  } else if (attr == 0x0a && len >= 8) {  // EIATTR_PARAM_CBANK: symbol, offset, size
    k->param_bytes = rd16(v + 6);
  } else if (attr == 0x05 && len >= 12) {  // EIATTR_MAX_THREADS
    k->max_threads = (int)(rd32(v) * rd32(v + 4) * rd32(v + 8));
  } else if (attr == 0x10 && len >= 12) {  // EIATTR_REQNTID
    k->reqntid[0] = rd32(v), k->reqntid[1] = rd32(v + 4), k->reqntid[2] = rd32(v + 8);
  }
}

// Walks the records of an .nv.info section: 4-byte headers (format, attribute), an
// EIFMT_SVAL record followed by a 16-bit length and its bytes.
static void nvinfo_walk(const unsigned char* d, uint64_t size,
                        void (*fn)(void*, int, const unsigned char*, unsigned), void* arg) {
  uint64_t p = 0;
  while (p + 4 <= size) {
    int fmt = d[p], attr = d[p + 1];
    unsigned len = fmt == 4 ? rd16(d + p + 2) : 2;
    const unsigned char* v = fmt == 4 ? d + p + 4 : d + p + 2;
    if (fmt == 4 && p + 4 + len > size) break;
    fn(arg, attr, v, len);
    p += fmt == 4 ? 4 + len : 4;
  }
}

static void kernel_record(void* k, int attr, const unsigned char* v, unsigned len) {
  nvinfo_record(k, attr, v, len);
}

typedef struct { kinfo* kernels; int n; const uint32_t* symidx; } reg_walk;

static void global_record(void* arg, int attr, const unsigned char* v, unsigned len) {
  reg_walk* w = arg;
  if ((attr != 0x2f && attr != 0x11) || len < 8) return;  // EIATTR_REGCOUNT, EIATTR_FRAME_SIZE
  for (int i = 0; i < w->n; ++i)
    if (w->symidx[i] == rd32(v)) {
      if (attr == 0x2f) w->kernels[i].regs = (int)rd32(v + 4);
      else w->kernels[i].local_bytes = (int)rd32(v + 4);
    }
}

static void elf_kernel_sections(const elf* e, kinfo* k, int reserved_smem) {
  int info = elf_find(e, ".nv.info.", k->name);
  if (info >= 0) {
    section s = elf_section(e, (unsigned)info);
    nvinfo_walk(e->base + s.offset, s.size, kernel_record, k);
  }
  int shared = elf_find(e, ".nv.shared.", k->name);
  if (shared >= 0) {
    int64_t bytes = (int64_t)elf_section(e, (unsigned)shared).size - reserved_smem;
    k->static_smem = bytes > 0 ? (int)bytes : 0;
  }
  int constant = elf_find(e, ".nv.constant0.", k->name);
  if (constant >= 0) k->const_bytes = (int)elf_section(e, (unsigned)constant).size;
  if (!k->param_bytes && k->nparams) {
    const param* last = &k->params[k->nparams - 1];
    k->param_bytes = last->offset + last->size;
  }
}

// The kernels of a cubin: its global STT_FUNC symbols, with their .nv.info data.
static void elf_kernels(const elf* e, image* img) {
  int symtab = -1;
  for (unsigned i = 1; i < e->shnum; ++i)
    if (elf_section(e, i).type == 2 /* SHT_SYMTAB */) symtab = (int)i;
  if (symtab < 0) return;
  section st = elf_section(e, (unsigned)symtab), strs = elf_section(e, st.link);
  size_t nsym = st.size / 24;
  uint32_t* symidx = xcalloc(nsym, sizeof *symidx);
  img->kernels = xcalloc(nsym, sizeof *img->kernels);
  int reserved = 0;
  for (size_t i = 0; i < nsym; ++i) {
    const unsigned char* s = e->base + st.offset + 24 * i;
    const char* name = (const char*)e->base + strs.offset + rd32(s);
    if (!strcmp(name, ".nv.reservedSmem.offset0")) reserved = RESERVED_SHMEM;
    if ((s[4] & 0xf) != 2 /* STT_FUNC */ || (s[4] >> 4) != 1 /* STB_GLOBAL */) continue;
    symidx[img->nkernels] = (uint32_t)i;
    kinfo_defaults(&img->kernels[img->nkernels++], name);
  }
  for (int i = 0; i < img->nkernels; ++i) elf_kernel_sections(e, &img->kernels[i], reserved);
  int info = elf_find(e, ".nv.info", "");
  if (info >= 0) {
    section s = elf_section(e, (unsigned)info);
    reg_walk w = {img->kernels, img->nkernels, symidx};
    nvinfo_walk(e->base + s.offset, s.size, global_record, &w);
  }
  free(symidx);
}

/* -- PTX ------------------------------------------------------------------------- */

static const char* skip_space(const char* p) {
  while (*p && isspace((unsigned char)*p)) ++p;
  return p;
}

// The size and alignment of one ".param [.align N] .type[ .ptr ...] name[[count]]".
static param ptx_param(const char* p, const char* end, uint32_t* align) {
  unsigned bits = 0, al = 0, count = 1;
  const char* a = strstr(p, ".align");
  const char* t = p + 6;  // past ".param"
  t = skip_space(t);
  if (a && a < end && a == t) {
    al = (unsigned)strtoul(a + 6, (char**)&t, 10);
    t = skip_space(t);
  }
  if (*t == '.' && strchr("usbf", t[1])) bits = (unsigned)strtoul(t + 2, NULL, 10);
  const char* br = memchr(p, '[', (size_t)(end - p));
  if (br) count = (unsigned)strtoul(br + 1, NULL, 10);
  param out = {0, bits / 8 * count};
  *align = al ? al : bits / 8;
  return out;
}

static void ptx_entry(image* img, const char* p) {
  char name[512];
  p = skip_space(p + 6);  // past ".entry"
  size_t n = 0;
  while ((isalnum((unsigned char)*p) || *p == '_' || *p == '$') && n + 1 < sizeof name) name[n++] = *p++;
  name[n] = 0;
  kinfo* k = &img->kernels[img->nkernels++];
  kinfo_defaults(k, name);
  const char* open = strchr(p, '(');
  const char* close = open ? strchr(open, ')') : NULL;
  for (const char* q = open; q && close && (q = strstr(q, ".param")) && q < close;) {
    const char* stop = strchr(q, ',');
    if (!stop || stop > close) stop = close;
    uint32_t align;
    param pr = ptx_param(q, stop, &align);
    uint32_t at = align ? (k->param_bytes + align - 1) / align * align : k->param_bytes;
    pr.offset = at;
    k->params = xrealloc(k->params, (size_t)(k->nparams + 1) * sizeof *k->params);
    k->params[k->nparams++] = pr;
    k->param_bytes = at + pr.size;
    q = stop;
  }
  const char* body = close ? strchr(close, '{') : NULL;
  const char* maxntid = close ? strstr(close, ".maxntid") : NULL;
  if (maxntid && body && maxntid < body) {
    unsigned x = 1, y = 1, z = 1;
    sscanf(maxntid + 8, " %u , %u , %u", &x, &y, &z);
    k->max_threads = (int)(x * y * z);
  }
}

// A PTX image: the .version, the .target and every .entry.
static CUresult ptx_parse(const char* text, image* img) {
  const char* v = strstr(text, ".version");
  const char* t = strstr(text, ".target");
  if (!v || !t) return CUDA_ERROR_INVALID_PTX;
  unsigned major = 0, minor = 0;
  sscanf(v + 8, " %u.%u", &major, &minor);
  img->ptx_version = (int)(major * 10 + minor);
  const char* sm = strstr(t, "sm_");
  if (!sm) return CUDA_ERROR_INVALID_PTX;
  img->sm = (int)strtol(sm + 3, NULL, 10);
  int entries = 0;
  for (const char* p = text; (p = strstr(p, ".entry")); p += 6) ++entries;
  img->kernels = xcalloc((size_t)entries, sizeof *img->kernels);
  for (const char* p = text; (p = strstr(p, ".entry")); p += 6) ptx_entry(img, p);
  return CUDA_SUCCESS;
}

/* -- loading ----------------------------------------------------------------------- */

static int is_ptx_text(const char* p) {
  p = skip_space(p);
  return !strncmp(p, "//", 2) || !strncmp(p, ".version", 8);
}

static image* image_cached(const char* sha) {
  for (image* i = images; i; i = i->next)
    if (!strcmp(i->sha, sha)) return i;
  return NULL;
}

// Parses (or finds) an image; INVALID_IMAGE for anything but a cubin or PTX text.
static CUresult image_parse(const void* data, image** out) {
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  elf e;
  int ptx = 0;
  size_t size;
  if (elf_open(data, &e)) size = elf_extent(&e);
  else if (is_ptx_text(data)) ptx = 1, size = strlen(data);
  else return CUDA_ERROR_INVALID_IMAGE;
  char sha[65];
  sha256_hex(data, size, sha);
  if ((*out = image_cached(sha))) return CUDA_SUCCESS;
  image* img = xcalloc(1, sizeof *img);
  memcpy(img->sha, sha, sizeof sha);
  img->is_ptx = ptx;
  if (ptx) {
    CUresult r = ptx_parse(data, img);
    if (r) {
      free(img);
      return r;
    }
  } else {
    img->sm = elf_sm(&e);
    elf_kernels(&e, img);
  }
  img->next = images;
  images = img;
  *out = img;
  return CUDA_SUCCESS;
}

// Whether a device of compute capability major.minor runs the image: a cubin of the
// same major and a minor no newer; PTX of an ISA this driver knows, for an arch no newer.
static CUresult image_fits(const image* img, int major, int minor) {
  int dev = major * 10 + minor;
  if (img->is_ptx) {
    if (img->ptx_version > PTX_ISA_MAX) return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    return img->sm > dev ? CUDA_ERROR_INVALID_PTX : CUDA_SUCCESS;
  }
  if (img->sm / 10 != major || img->sm % 10 > minor) return CUDA_ERROR_NO_BINARY_FOR_GPU;
  return CUDA_SUCCESS;
}

// The host library of an image, looked up when a kernel of it first runs.
static void image_host_library(image* img) {
  if (img->lib_state == 1) return;
  char path[4200];
  snprintf(path, sizeof path, "%s/%s.so", cfg.kernels, img->sha);
  struct stat st;
  if (!cfg.kernels[0] || stat(path, &st)) {
    img->lib_state = 2;
    return;
  }
  img->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!img->lib) {
    complain("cannot load the host code %s: %s", path, dlerror());
    img->lib_state = 2;
    return;
  }
  img->lib_state = 1;
  for (int i = 0; i < img->nkernels; ++i) {
    char sym[600];
    snprintf(sym, sizeof sym, "pjhost_%s", img->kernels[i].name);
    *(void**)&img->kernels[i].host = dlsym(img->lib, sym);
  }
}

static kinfo* image_kernel(image* img, const char* name) {
  for (int i = 0; i < img->nkernels; ++i)
    if (!strcmp(img->kernels[i].name, name)) return &img->kernels[i];
  return NULL;
}

/* ------------------------------------------------------------------------------------
 * Devices, contexts and memory
 * ---------------------------------------------------------------------------------- */

enum { A_PENDING, A_LIVE };  // a pool allocation is PENDING until its stream reaches it

typedef struct pool pool;
typedef struct ctx ctx;

typedef struct alloc {
  uint64_t base, serial;
  size_t size, span;  // span: what the allocation holds of the device's range
  int dev;            // -1: pinned host memory
  int state;
  ctx* owner;
  pool* pool;
  unsigned flags;
} alloc;

typedef struct { alloc** a; size_t n, cap; } alloc_table;  // sorted by base

typedef struct device {
  int major, minor;
  size_t total, used;
  char* base;  // the device's address range [base, base + span)
  size_t span;
  alloc_table allocs;
  ctx* primary;
  pool *default_pool, *current_pool;
  int faults_to_inject;
} device;

struct ctx {
  obj h;
  int dev, refs, active;
  unsigned flags;
  CUresult sticky;  // set by a fault; every later call on the context returns it
  uint32_t peers;   // devices whose memory (cuMemAlloc'd) this context's kernels may touch
  struct stream *null_stream, *ptds_stream;
};

struct pool {
  obj h;
  int dev, host;
  uint32_t access;  // devices whose kernels may touch this pool's memory
  uint64_t threshold, used, used_high, reserved_high;
  int reuse[3];
};

static int initialized;
static device devices[MAX_DEVICES];
static pool *host_default_pool, *host_current_pool;  // pinned host memory pools
static alloc_table host_allocs;  // pinned host memory
static uint64_t next_alloc_serial = 1;

#define CTX_STACK 32
static __thread ctx* tls_ctx[CTX_STACK];
static __thread int tls_depth;

static ctx* current_ctx(void) { return tls_depth ? tls_ctx[tls_depth - 1] : NULL; }

static CUresult need_init(void) { return initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }

static CUresult need_device(CUdevice d) {
  TRY(need_init());
  return d >= 0 && d < cfg.devices ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

// A context a call may use: active, and not poisoned by a fault.
static CUresult ctx_usable(ctx* c) {
  if (!c->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  return c->sticky;
}

// The calling thread's context, for calls that need one.
static CUresult need_ctx(ctx** out) {
  TRY(need_init());
  ctx* c = current_ctx();
  if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  *out = c;
  return ctx_usable(c);
}

static CUresult get_ctx(CUhandle h, ctx** out) {
  TRY(need_init());
  *out = reg_get(h, K_CTX);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* -- allocation tables -------------------------------------------------------------- */

// The index of the last allocation whose base is <= p (or -1).
static long table_floor(const alloc_table* t, uint64_t p) {
  long lo = 0, hi = (long)t->n - 1, best = -1;
  while (lo <= hi) {
    long mid = (lo + hi) / 2;
    if (t->a[mid]->base <= p) best = mid, lo = mid + 1;
    else hi = mid - 1;
  }
  return best;
}

static void table_insert(alloc_table* t, alloc* a) {
  if (t->n == t->cap) {
    t->cap = t->cap ? 2 * t->cap : 64;
    t->a = xrealloc(t->a, t->cap * sizeof *t->a);
  }
  size_t at = (size_t)(table_floor(t, a->base) + 1);
  memmove(t->a + at + 1, t->a + at, (t->n - at) * sizeof *t->a);
  t->a[at] = a;
  ++t->n;
}

static void table_remove(alloc_table* t, alloc* a) {
  long i = table_floor(t, a->base);
  if (i < 0 || t->a[i] != a) return;
  memmove(t->a + i, t->a + i + 1, (t->n - (size_t)i - 1) * sizeof *t->a);
  --t->n;
}

// The allocation holding address p (p == its end counts when `end_ok`).
static alloc* table_at(const alloc_table* t, uint64_t p, int end_ok) {
  long i = table_floor(t, p);
  if (i < 0) return NULL;
  alloc* a = t->a[i];
  return p < a->base + a->size || (end_ok && p == a->base + a->size) ? a : NULL;
}

// The device whose address range holds p (or -1).
static int region_of(uint64_t p) {
  for (int d = 0; d < cfg.devices; ++d)
    if (p >= (uint64_t)(uintptr_t)devices[d].base && p < (uint64_t)(uintptr_t)devices[d].base + devices[d].span)
      return d;
  return -1;
}

static alloc* device_alloc_at(uint64_t p, int end_ok) {
  int d = region_of(p);
  return d < 0 ? NULL : table_at(&devices[d].allocs, p, end_ok);
}

// The allocation (device, or pinned host) holding all of [p, p + n), else NULL.
static alloc* range_alloc(uint64_t p, size_t n) {
  alloc* a = device_alloc_at(p, 0);
  if (!a) a = table_at(&host_allocs, p, 0);
  if (!a || n > a->size || p - a->base > a->size - n) return NULL;
  return a;
}

static alloc* alloc_by_serial(const alloc_table* t, uint64_t base, uint64_t serial) {
  alloc* a = table_at(t, base, 0);
  return a && a->serial == serial ? a : NULL;
}

/* -- the device address ranges ------------------------------------------------------- */

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// First fit in the device's range, GAP bytes after every allocation.
static uint64_t region_fit(device* dv, size_t span) {
  uint64_t start = (uint64_t)(uintptr_t)dv->base;
  for (size_t i = 0; i < dv->allocs.n; ++i) {
    alloc* a = dv->allocs.a[i];
    if (start + span + GAP <= a->base) return start;
    start = round_up(a->base + a->span + GAP, ALIGN);
  }
  return start + span <= (uint64_t)(uintptr_t)dv->base + dv->span ? start : 0;
}

// New device memory, filled with garbage (device memory is not zeroed).
static CUresult device_alloc(int dev, size_t size, ctx* owner, pool* pl, alloc** out) {
  device* dv = &devices[dev];
  if (!size) return CUDA_ERROR_INVALID_VALUE;
  size_t span = round_up(size, ALIGN);
  if (span < size || span > dv->total - dv->used) return CUDA_ERROR_OUT_OF_MEMORY;
  uint64_t base = region_fit(dv, span);
  if (!base) return CUDA_ERROR_OUT_OF_MEMORY;
  alloc* a = xcalloc(1, sizeof *a);
  *a = (alloc){base, next_alloc_serial++, size, span, dev, A_LIVE, owner, pl, 0};
  table_insert(&dv->allocs, a);
  dv->used += span;
  memset((void*)(uintptr_t)base, 0xab, span);
  *out = a;
  return CUDA_SUCCESS;
}

static void device_free(alloc* a) {
  device* dv = &devices[a->dev];
  table_remove(&dv->allocs, a);
  dv->used -= a->span;
  if (a->pool) a->pool->used -= a->span;
  memset((void*)(uintptr_t)a->base, 0xcd, a->span);  // a read after free gives garbage
  free(a);
}

static CUresult host_alloc(size_t size, unsigned flags, ctx* owner, pool* pl, alloc** out) {
  if (!size) return CUDA_ERROR_INVALID_VALUE;
  void* p = NULL;
  if (posix_memalign(&p, 4096, round_up(size, 4096))) return CUDA_ERROR_OUT_OF_MEMORY;
  alloc* a = xcalloc(1, sizeof *a);
  *a = (alloc){(uint64_t)(uintptr_t)p, next_alloc_serial++, size, round_up(size, 4096), -1, A_LIVE,
               owner, pl, flags};
  table_insert(&host_allocs, a);
  *out = a;
  return CUDA_SUCCESS;
}

static void host_free(alloc* a) {
  table_remove(&host_allocs, a);
  if (a->pool) a->pool->used -= a->span;
  free((void*)(uintptr_t)a->base);
  free(a);
}

static void alloc_release(alloc* a) {
  if (a->dev < 0) host_free(a);
  else device_free(a);
}

/* -- initialisation ------------------------------------------------------------------ */

static pool* pool_new(int dev, int host) {
  pool* p = xcalloc(1, sizeof *p);
  p->dev = dev;
  p->host = host;
  p->access = host ? 0 : 1u << dev;
  p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
  reg_add(&p->h, K_POOL);
  return p;
}

static struct stream* stream_new(ctx* c, unsigned flags, int priority, int special);

static CUresult device_init(int d) {
  device* dv = &devices[d];
  dv->major = cfg.cc_major[d];
  dv->minor = cfg.cc_minor[d];
  dv->total = cfg.memory;
  dv->span = round_up(2 * cfg.memory + (64ul << 20), 2ul << 20);
  void* base = mmap(NULL, dv->span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  dv->base = base;
  ctx* c = xcalloc(1, sizeof *c);
  c->dev = d;
  reg_add(&c->h, K_CTX);
  c->null_stream = stream_new(c, 0, 0, 1);
  c->ptds_stream = stream_new(c, 0, 0, 2);
  dv->primary = c;
  dv->default_pool = dv->current_pool = pool_new(d, 0);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuInit(unsigned flags) {
  ENTER;
  if (flags) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (!initialized) {
    if (!cfg.devices) LEAVE(CUDA_ERROR_NO_DEVICE);
    for (int d = 0; d < cfg.devices; ++d)
      if (device_init(d)) LEAVE(CUDA_ERROR_OUT_OF_MEMORY);
    host_default_pool = host_current_pool = pool_new(-1, 1);
    initialized = 1;
  }
  LEAVE(CUDA_SUCCESS);
}

/* ------------------------------------------------------------------------------------
 * Work: ops, streams (deferred queues), graphs and captures
 * ---------------------------------------------------------------------------------- */

enum { OP_KERNEL, OP_COPY, OP_MEMSET, OP_WAIT, OP_RECORD, OP_HOST, OP_GRAPH, OP_ALLOC, OP_FREE, OP_NOP };

typedef struct stream stream;
typedef struct snapshot snapshot;

typedef struct op {
  int kind;
  ctx* c;  // whose sticky error a fault of this op sets
  union {
    struct { kinfo* k; unsigned launch[7]; unsigned char* params; } k;
    struct { uint64_t dst, src; size_t n; unsigned char* staged; } cp;  // staged: pageable source
    struct { uint64_t dst; unsigned value, elem; size_t count; } ms;
    struct { stream* s; uint64_t seq; } w;
    struct { uint64_t event, gen; } rec;
    struct { void (*fn)(void*); void* data; } host;
    struct { snapshot* snap; } g;
    struct { uint64_t base, serial; int host; } mem;  // OP_ALLOC, OP_FREE
  } u;
} op;

typedef struct { uint64_t id; unsigned count; } uref;  // references held on a user object
typedef struct { uref* r; size_t n; } urefs;

struct snapshot { size_t n; op* ops; urefs users; };  // a graph launch: the exec's nodes as they were

typedef struct capture {
  uint64_t id;
  struct graph* g;
  int mode, status;
  stream* origin;
  pthread_t thread;
} capture;

struct stream {
  obj h;
  ctx* c;
  unsigned flags;
  int priority, special;  // special: 1 the legacy NULL stream, 2 the per-thread stream
  op* q;                  // ops [base, len) are q[0 .. len - base)
  uint64_t base, len, done;
  size_t cap;
  int polls, destroyed;
  capture* cap_seq;       // the capture this stream takes part in
  uint64_t* deps;         // capture: the nodes the next captured op depends on
  size_t ndeps;
  uint64_t* deps_out;     // what cuStreamGetCaptureInfo handed out
};

typedef struct gnode {
  obj h;
  struct graph* g;
  int type, index, mark;
  op o;
  uint64_t* deps;
  size_t ndeps;
} gnode;

typedef struct graph { obj h; gnode** nodes; size_t n, cap; urefs users; } graph;

typedef struct gexec {
  obj h;
  size_t n;
  op* ops;              // in a topological order
  uint64_t* node_ids;   // the graph node each op came from
  stream* last_stream;  // launches of one exec run one after another
  uint64_t last_seq;
  urefs users;          // the graph's user objects, held while the exec lives
} gexec;

typedef struct event {
  obj h;
  ctx* c;
  unsigned flags;
  stream* s;
  uint64_t seq, gen, time_gen;
  int recorded, polls;
  double time;
  capture* cap_seq;  // recorded in a capturing stream: the nodes it stands for
  uint64_t* cap_deps;
  size_t ncap_deps;
} event;

static stream** all_streams;
static size_t n_streams, cap_streams;
static struct { unsigned long long kernel_launches, graph_launches, kernels_run; } counters;  // for tests

/* -- user objects: reference-counted host data that graphs keep alive ------------- */

typedef struct uobj { obj h; void* ptr; void (*destroy)(void*); unsigned refs; } uobj;

static void uobj_release(uobj* u, unsigned count) {
  u->refs -= count < u->refs ? count : u->refs;
  if (u->refs) return;
  if (n_doomed == cap_doomed) {
    cap_doomed = cap_doomed ? 2 * cap_doomed : 16;
    doomed = xrealloc(doomed, cap_doomed * sizeof *doomed);
  }
  doomed[n_doomed++] = (destructor){u->destroy, u->ptr};
  reg_remove(&u->h);
  free(u);
}

static void urefs_add(urefs* list, uint64_t id, unsigned count) {
  for (size_t i = 0; i < list->n; ++i)
    if (list->r[i].id == id) {
      list->r[i].count += count;
      return;
    }
  list->r = xrealloc(list->r, (list->n + 1) * sizeof *list->r);
  list->r[list->n++] = (uref){id, count};
}

// Another holder of the same references (each user object retained again).
static urefs urefs_copy(const urefs* from) {
  urefs out = {NULL, 0};
  for (size_t i = 0; i < from->n; ++i) {
    uobj* u = reg_get((CUhandle)(uintptr_t)from->r[i].id, K_USEROBJ);
    if (!u) continue;
    u->refs += from->r[i].count;
    urefs_add(&out, from->r[i].id, from->r[i].count);
  }
  return out;
}

static void urefs_release(urefs* list) {
  for (size_t i = 0; i < list->n; ++i) {
    uobj* u = reg_get((CUhandle)(uintptr_t)list->r[i].id, K_USEROBJ);
    if (u) uobj_release(u, list->r[i].count);
  }
  free(list->r);
  list->r = NULL;
  list->n = 0;
}

static void op_free(op* o) {
  if (o->kind == OP_KERNEL) free(o->u.k.params);
  if (o->kind == OP_COPY) free(o->u.cp.staged);
  if (o->kind == OP_GRAPH && o->u.g.snap) {
    for (size_t i = 0; i < o->u.g.snap->n; ++i) op_free(&o->u.g.snap->ops[i]);
    free(o->u.g.snap->ops);
    urefs_release(&o->u.g.snap->users);  // the launch has run: its user objects may go
    free(o->u.g.snap);
  }
  o->kind = OP_NOP;
}

// A deep copy (kernel parameters and staged bytes are owned by each op).
static op op_clone(const op* o) {
  op c = *o;
  if (o->kind == OP_KERNEL) {
    size_t n = o->u.k.k->param_bytes;
    c.u.k.params = xcalloc(1, n);
    memcpy(c.u.k.params, o->u.k.params, n);
  }
  if (o->kind == OP_COPY && o->u.cp.staged) {
    c.u.cp.staged = xcalloc(1, o->u.cp.n);
    memcpy(c.u.cp.staged, o->u.cp.staged, o->u.cp.n);
  }
  return c;
}

static stream* stream_new(ctx* c, unsigned flags, int priority, int special) {
  stream* s = xcalloc(1, sizeof *s);
  s->c = c;
  s->flags = flags;
  s->priority = priority;
  s->special = special;
  if (!special) reg_add(&s->h, K_STREAM);
  if (n_streams == cap_streams) {
    cap_streams = cap_streams ? 2 * cap_streams : 64;
    all_streams = xrealloc(all_streams, cap_streams * sizeof *all_streams);
  }
  all_streams[n_streams++] = s;
  return s;
}

static void stream_push(stream* s, const op* o) {
  size_t held = (size_t)(s->len - s->base), ran = (size_t)(s->done - s->base);
  if (ran > 256 && ran * 2 > held) {  // drop what has run
    memmove(s->q, s->q + ran, (held - ran) * sizeof *s->q);
    s->base = s->done;
    held -= ran;
  }
  if (held == s->cap) {
    s->cap = s->cap ? 2 * s->cap : 64;
    s->q = xrealloc(s->q, s->cap * sizeof *s->q);
  }
  s->q[held] = *o;
  ++s->len;
}

/* -- running work ------------------------------------------------------------------- */

static void fault(ctx* c, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("pjstub: fault: ", stderr);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, " (context of device %d is now CUDA_ERROR_ILLEGAL_ADDRESS until cuDevicePrimaryCtxReset)\n", c->dev);
  va_end(ap);
  if (!c->sticky) c->sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
}

// Whether a kernel of context c may touch the allocation a.
static int reachable(const ctx* c, const alloc* a) {
  if (a->dev < 0 || a->dev == c->dev) return 1;
  if (a->pool) return (int)(a->pool->access >> c->dev & 1);
  return (int)(c->peers >> a->dev & 1);
}

// Every 8-byte argument that lies in a device's address range is a pointer: it must be
// in (or at the end of) a live allocation that the kernel's device may touch.
static int check_pointer_args(const op* o) {
  const kinfo* k = o->u.k.k;
  for (int i = 0; i < k->nparams; ++i) {
    if (k->params[i].size != 8) continue;
    uint64_t v = rd64(o->u.k.params + k->params[i].offset);
    int d = region_of(v);
    if (d < 0) continue;
    alloc* a = table_at(&devices[d].allocs, v, 1);
    if (!a || a->state != A_LIVE) {
      fault(o->c, "kernel %s argument %d = 0x%llx is not in a live allocation of device %d", k->name, i,
            (unsigned long long)v, d);
      return 0;
    }
    if (!reachable(o->c, a)) {
      fault(o->c, "kernel %s on device %d: argument %d = 0x%llx is memory of device %d, without peer access",
            k->name, o->c->dev, i, (unsigned long long)v, d);
      return 0;
    }
  }
  return 1;
}

static void run_kernel(const op* o) {
  kinfo* k = o->u.k.k;
  device* dv = &devices[o->c->dev];
  if (dv->faults_to_inject > 0) {
    --dv->faults_to_inject;
    fault(o->c, "injected into kernel %s", k->name);
    return;
  }
  if (!check_pointer_args(o)) return;
  ++counters.kernels_run;
  void** params = xcalloc((size_t)k->nparams + 1, sizeof *params);
  for (int i = 0; i < k->nparams; ++i) params[i] = o->u.k.params + k->params[i].offset;
  k->host(params, o->u.k.launch);
  free(params);
}

// Device memory an op touches must still be live when the op runs.
static int live_range(const op* o, uint64_t p, size_t n, const char* what) {
  if (region_of(p) < 0 && !table_at(&host_allocs, p, 0)) return 1;  // pageable host memory
  alloc* a = range_alloc(p, n);
  if (a && a->state == A_LIVE) return 1;
  fault(o->c, "%s of %zu bytes at 0x%llx: not (all) in a live allocation", what, n, (unsigned long long)p);
  return 0;
}

static void run_memset(const op* o) {
  size_t n = o->u.ms.count * o->u.ms.elem;
  if (!live_range(o, o->u.ms.dst, n, "memset")) return;
  unsigned char* d = (unsigned char*)(uintptr_t)o->u.ms.dst;
  if (o->u.ms.elem == 1) {
    memset(d, (int)(o->u.ms.value & 0xff), n);
    return;
  }
  for (size_t i = 0; i < o->u.ms.count; ++i) memcpy(d + i * o->u.ms.elem, &o->u.ms.value, o->u.ms.elem);
}

static void run_copy(const op* o) {
  if (!live_range(o, o->u.cp.dst, o->u.cp.n, "copy destination")) return;
  if (!o->u.cp.staged && !live_range(o, o->u.cp.src, o->u.cp.n, "copy source")) return;
  const void* src = o->u.cp.staged ? (const void*)o->u.cp.staged : (const void*)(uintptr_t)o->u.cp.src;
  memmove((void*)(uintptr_t)o->u.cp.dst, src, o->u.cp.n);
}

static void run_record(const op* o) {
  event* e = reg_get((CUhandle)(uintptr_t)o->u.rec.event, K_EVENT);
  if (e && e->gen == o->u.rec.gen) {
    e->time = now_ms();
    e->time_gen = e->gen;
  }
}

static void run_mem(const op* o) {
  const alloc_table* t = o->u.mem.host ? &host_allocs : &devices[region_of(o->u.mem.base)].allocs;
  alloc* a = alloc_by_serial(t, o->u.mem.base, o->u.mem.serial);
  if (!a) return;
  if (o->kind == OP_ALLOC) a->state = A_LIVE;
  else alloc_release(a);
}

static void run_op(const op* o) {
  if (o->c && o->c->sticky && o->kind != OP_RECORD) return;  // a faulted context runs nothing
  switch (o->kind) {
    case OP_KERNEL: run_kernel(o); break;
    case OP_COPY: run_copy(o); break;
    case OP_MEMSET: run_memset(o); break;
    case OP_RECORD: run_record(o); break;
    case OP_HOST:
      tls_in_callback = 1;
      o->u.host.fn(o->u.host.data);
      tls_in_callback = 0;
      break;
    case OP_GRAPH:
      for (size_t i = 0; i < o->u.g.snap->n; ++i) run_op(&o->u.g.snap->ops[i]);
      break;
    case OP_ALLOC:
    case OP_FREE: run_mem(o); break;
    default: break;
  }
}

// Runs a stream's ops up to (not including) seq; a wait runs what it waits for first.
static void run_until(stream* s, uint64_t seq) {
  while (s->done < seq && s->done < s->len) {
    op* o = &s->q[s->done - s->base];
    if (o->kind == OP_WAIT) run_until(o->u.w.s, o->u.w.seq);
    else run_op(o);
    op_free(&s->q[s->done - s->base]);
    ++s->done;
  }
}

// A host thread waits for (s, seq): under the others-first schedule, every other
// stream runs as far as it can first, so a missing wait shows up as wrong data.
static void sync_to(stream* s, uint64_t seq) {
  if (cfg.schedule == SCHED_OTHERS_FIRST)
    for (size_t i = 0; i < n_streams; ++i)
      if (all_streams[i] != s) run_until(all_streams[i], all_streams[i]->len);
  run_until(s, seq);
}

static void run_everything(void) {
  for (size_t i = 0; i < n_streams; ++i) run_until(all_streams[i], all_streams[i]->len);
}

// Drops a stream's pending work unrun (its context was reset or released).
static void stream_discard(stream* s) {
  for (uint64_t i = s->done; i < s->len; ++i) op_free(&s->q[i - s->base]);
  s->done = s->len;
}

// A destroyed stream, its work done or dropped, leaves the list of streams; the struct
// stays, since waits recorded on other streams may still point at it (already satisfied).
static void stream_retire(stream* s) {
  s->destroyed = 1;
  free(s->q);
  s->q = NULL;
  s->cap = 0;
  s->base = s->done = s->len;
  for (size_t i = 0; i < n_streams; ++i)
    if (all_streams[i] == s) {
      all_streams[i] = all_streams[--n_streams];
      break;
    }
}

/* -- graphs and stream capture ------------------------------------------------------- */

static uint64_t next_capture_id = 1;
static __thread int tls_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

static graph* graph_new(void) {
  graph* g = xcalloc(1, sizeof *g);
  reg_add(&g->h, K_GRAPH);
  return g;
}

static gnode* graph_add(graph* g, int type, const op* o, const uint64_t* deps, size_t ndeps) {
  gnode* n = xcalloc(1, sizeof *n);
  n->g = g;
  n->type = type;
  n->o = *o;
  n->deps = xcalloc(ndeps, sizeof *n->deps);
  memcpy(n->deps, deps, ndeps * sizeof *deps);
  n->ndeps = ndeps;
  reg_add(&n->h, K_NODE);
  if (g->n == g->cap) {
    g->cap = g->cap ? 2 * g->cap : 16;
    g->nodes = xrealloc(g->nodes, g->cap * sizeof *g->nodes);
  }
  n->index = (int)g->n;
  g->nodes[g->n++] = n;
  return n;
}

// Dependencies given to a graph call must be nodes of that graph.
static CUresult check_deps(const graph* g, const CUhandle* deps, size_t n, uint64_t** out) {
  if (n && !deps) return CUDA_ERROR_INVALID_VALUE;
  *out = xcalloc(n, sizeof **out);
  for (size_t i = 0; i < n; ++i) {
    gnode* d = reg_get(deps[i], K_NODE);
    if (!d || d->g != g) {
      free(*out);
      return CUDA_ERROR_INVALID_VALUE;
    }
    (*out)[i] = d->h.id;
  }
  return CUDA_SUCCESS;
}

static void graph_destroy(graph* g) {
  for (size_t i = 0; i < g->n; ++i) {
    op_free(&g->nodes[i]->o);
    free(g->nodes[i]->deps);
    reg_remove(&g->nodes[i]->h);
    free(g->nodes[i]);
  }
  free(g->nodes);
  urefs_release(&g->users);
  reg_remove(&g->h);
  free(g);
}

static int node_type(const op* o) {
  switch (o->kind) {
    case OP_KERNEL: return CU_GRAPH_NODE_TYPE_KERNEL;
    case OP_COPY: return CU_GRAPH_NODE_TYPE_MEMCPY;
    case OP_MEMSET: return CU_GRAPH_NODE_TYPE_MEMSET;
    case OP_HOST: return CU_GRAPH_NODE_TYPE_HOST;
    default: return CU_GRAPH_NODE_TYPE_EMPTY;
  }
}

static void set_deps(stream* s, const uint64_t* deps, size_t n) {
  s->deps = xrealloc(s->deps, (n ? n : 1) * sizeof *s->deps);
  memcpy(s->deps, deps, n * sizeof *deps);
  s->ndeps = n;
}

static void add_deps(stream* s, const uint64_t* deps, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    size_t j = 0;
    while (j < s->ndeps && s->deps[j] != deps[i]) ++j;
    if (j < s->ndeps) continue;
    s->deps = xrealloc(s->deps, (s->ndeps + 1) * sizeof *s->deps);
    s->deps[s->ndeps++] = deps[i];
  }
}

static int reaches(uint64_t id, const uint64_t* deps, size_t n);

static void leave_capture(stream* s) {
  s->cap_seq = NULL;
  free(s->deps);
  s->deps = NULL;
  s->ndeps = 0;
}

// Work submitted to a capturing stream becomes a node, after the stream's dependencies.
static CUresult capture_node(stream* s, op* o) {
  capture* cap = s->cap_seq;
  if (cap->status != CU_STREAM_CAPTURE_STATUS_ACTIVE) {
    op_free(o);
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  gnode* n = graph_add(cap->g, node_type(o), o, s->deps, s->ndeps);
  set_deps(s, &n->h.id, 1);
  return CUDA_SUCCESS;
}

static int thread_is_capturing_strictly(void) {
  pthread_t self = pthread_self();
  for (size_t i = 0; i < n_streams; ++i) {
    capture* cap = all_streams[i]->cap_seq;
    if (cap && pthread_equal(cap->thread, self) && cap->mode != CU_STREAM_CAPTURE_MODE_RELAXED) return 1;
  }
  return 0;
}

static capture* global_capture_elsewhere(void) {
  pthread_t self = pthread_self();
  for (size_t i = 0; i < n_streams; ++i) {
    capture* cap = all_streams[i]->cap_seq;
    if (cap && !pthread_equal(cap->thread, self) && cap->mode == CU_STREAM_CAPTURE_MODE_GLOBAL) return cap;
  }
  return NULL;
}

static void invalidate_thread_captures(void) {
  for (size_t i = 0; i < n_streams; ++i) {
    capture* cap = all_streams[i]->cap_seq;
    if (cap && (pthread_equal(cap->thread, pthread_self()) || cap->mode == CU_STREAM_CAPTURE_MODE_GLOBAL))
      cap->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  }
}

// "Potentially unsafe" calls (allocation, freeing, device-wide sync) are refused while
// a capture that this thread's capture mode respects is under way; the capture is
// invalidated, as the driver does.
static CUresult capture_unsafe_call(void) {
  if (tls_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  int refused = thread_is_capturing_strictly() ||
                (tls_capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL && global_capture_elsewhere());
  if (!refused) return CUDA_SUCCESS;
  invalidate_thread_captures();
  return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

/* -- submitting work ----------------------------------------------------------------- */

static void push_wait(stream* s, stream* on, uint64_t seq) {
  op w = {.kind = OP_WAIT, .c = s->c};
  w.u.w.s = on;
  w.u.w.seq = seq;
  stream_push(s, &w);
}

static int pending(const stream* s) { return s->len > s->done; }

// The legacy NULL stream waits for every blocking stream of its context, and every
// blocking stream for the NULL stream.
static CUresult legacy_order(stream* s) {
  ctx* c = s->c;
  if (s->special == 1) {
    for (size_t i = 0; i < n_streams; ++i) {
      stream* t = all_streams[i];
      if (t == s || t->c != c || t->destroyed || (t->flags & CU_STREAM_NON_BLOCKING)) continue;
      if (t->cap_seq) {
        t->cap_seq->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
        return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
      }
      if (pending(t)) push_wait(s, t, t->len);
    }
  } else if (!(s->flags & CU_STREAM_NON_BLOCKING) && pending(c->null_stream)) {
    push_wait(s, c->null_stream, c->null_stream->len);
  }
  return CUDA_SUCCESS;
}

// Enqueues an op (taking its buffers) on a stream, or adds it to the stream's capture.
static CUresult submit(stream* s, op* o) {
  if (s->cap_seq) return capture_node(s, o);
  CUresult r = legacy_order(s);
  if (r) {
    op_free(o);
    return r;
  }
  stream_push(s, o);
  return CUDA_SUCCESS;
}

// The stream a call names: NULL / CU_STREAM_LEGACY is the context's legacy stream,
// CU_STREAM_PER_THREAD its per-thread stream (one per context here).
static CUresult get_stream(CUhandle h, stream** out) {
  TRY(need_init());
  uintptr_t v = (uintptr_t)h;
  if (v == 0 || v == 1 || v == 2) {
    ctx* c;
    TRY(need_ctx(&c));
    *out = v == 2 ? c->ptds_stream : c->null_stream;
    return CUDA_SUCCESS;
  }
  stream* s = reg_get(h, K_STREAM);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  *out = s;
  return ctx_usable(s->c);
}

static CUresult get_event(CUhandle h, event** out) {
  TRY(need_init());
  *out = reg_get(h, K_EVENT);
  if (!*out) return CUDA_ERROR_INVALID_HANDLE;
  return ctx_usable((*out)->c);
}

// A work call needs a current context too (the stream's context does the work).
static CUresult work_stream(CUhandle h, stream** out) {
  ctx* c;
  TRY(need_ctx(&c));
  return get_stream(h, out);
}

/* ------------------------------------------------------------------------------------
 * API: versions, errors, devices
 * ---------------------------------------------------------------------------------- */

EXPORT CUresult cuDriverGetVersion(int* version) {
  ENTER;
  if (!version) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *version = cfg.driver_version;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuGetErrorName(CUresult error, const char** out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof error_table / sizeof *error_table; ++i)
    if (error_table[i].code == error) {
      *out = error_table[i].name;
      return CUDA_SUCCESS;
    }
  *out = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char** out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof error_table / sizeof *error_table; ++i)
    if (error_table[i].code == error) {
      *out = error_table[i].text;
      return CUDA_SUCCESS;
    }
  *out = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuDeviceGetCount(int* count) {
  ENTER;
  CHECK(need_init());
  if (!count) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *count = cfg.devices;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGet(CUdevice* out, int ordinal) {
  ENTER;
  CUresult r = need_device(ordinal);
  if (!r && !out) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *out = ordinal;
  LEAVE(r);
}

EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  ENTER;
  CUresult r = need_device(d);
  if (!r && (!name || len <= 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) snprintf(name, (size_t)len, "polyjit stub GPU");
  LEAVE(r);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
  ENTER;
  CUresult r = need_device(d);
  if (!r && !bytes) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *bytes = devices[d].total;
  LEAVE(r);
}

EXPORT CUresult cuDeviceComputeCapability(int* major, int* minor, CUdevice d) {
  ENTER;
  CUresult r = need_device(d);
  if (!r && (!major || !minor)) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *major = devices[d].major, *minor = devices[d].minor;
  LEAVE(r);
}

EXPORT CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice d) {
  ENTER;
  CUresult r = need_device(d);
  if (!r && !uuid) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) {
    memcpy(uuid->bytes, "pjstub-device-00", 16);
    uuid->bytes[15] = (char)('0' + d);
  }
  LEAVE(r);
}

EXPORT CUresult cuDeviceGetPCIBusId(char* out, int len, CUdevice d) {
  ENTER;
  CUresult r = need_device(d);
  if (!r && (!out || len <= 0)) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) snprintf(out, (size_t)len, "0000:%02x:00.0", 0x18 + d);
  LEAVE(r);
}

// H100-like values for the attributes that describe a device; 0 for the rest.
static int device_attribute(int attr, int d) {
  static const struct { int attr, value; } table[] = {
    {1, 1024}, {2, 1024}, {3, 1024}, {4, 64}, {5, 2147483647}, {6, 65535}, {7, 65535},
    {8, SHMEM_DEFAULT}, {9, 65536}, {10, 32}, {11, 2147483647}, {12, 65536}, {13, 1980000},
    {14, 512}, {15, 1}, {19, 1}, {30, 512}, {31, 1}, {32, 1}, {36, 2619000}, {37, 5120},
    {38, 52428800}, {39, 2048}, {40, 3}, {41, 1}, {51, 32}, {78, 1}, {79, 1}, {80, 1},
    {81, 233472}, {82, 65536}, {83, 1}, {87, 2}, {89, 1}, {90, 1}, {91, 1}, {95, 1},
    {97, SHMEM_OPTIN}, {99, 1}, {102, 1}, {103, 1}, {106, 32}, {107, 1}, {108, 82837504},
    {109, 134213632}, {110, 1}, {111, RESERVED_SHMEM}, {112, 1}, {113, 1}, {114, 1}, {115, 1},
    {116, 1}, {117, 1}, {118, 100}, {119, 1}, {121, 1}, {122, 1}, {123, 1}, {124, 1}, {125, 1},
    {126, 4}, {127, 1}, {131, -1}, {134, -1}, {144, 1},
  };
  const device* dv = &devices[d];
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return dv->major;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return dv->minor;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return cfg.sms;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: return 0x18 + d;
    case 85: return d;                  // MULTI_GPU_BOARD_GROUP_ID
    case 120: return dv->major >= 9;    // CLUSTER_LAUNCH
    default: break;
  }
  for (size_t i = 0; i < sizeof table / sizeof *table; ++i)
    if (table[i].attr == attr) return table[i].value;
  return 0;
}

EXPORT CUresult cuDeviceGetAttribute(int* value, int attr, CUdevice d) {
  ENTER;
  CUresult r = need_device(d);
  if (!r && (!value || attr < 1 || attr >= CU_DEVICE_ATTRIBUTE_MAX)) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *value = device_attribute(attr, d);
  LEAVE(r);
}

static int peer_possible(int a, int b) { return a != b && cfg.peer; }

EXPORT CUresult cuDeviceCanAccessPeer(int* can, CUdevice d, CUdevice peer) {
  ENTER;
  CUresult r = need_device(d);
  if (!r) r = need_device(peer);
  if (!r && !can) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *can = peer_possible(d, peer);
  LEAVE(r);
}

EXPORT CUresult cuDeviceGetP2PAttribute(int* value, int attr, CUdevice src, CUdevice dst) {
  ENTER;
  CUresult r = need_device(src);
  if (!r) r = need_device(dst);
  if (!r && (!value || attr < 1 || attr > 4)) r = CUDA_ERROR_INVALID_VALUE;
  if (!r && src == dst) r = CUDA_ERROR_INVALID_DEVICE;
  if (!r) *value = attr == 1 ? 0 : peer_possible(src, dst);  // PERFORMANCE_RANK is 0
  LEAVE(r);
}

/* ------------------------------------------------------------------------------------
 * API: primary contexts, the current context, peer access
 * ---------------------------------------------------------------------------------- */

typedef struct module { obj h; ctx* c; image* img; uint64_t* funcs; } module;
typedef struct func {
  obj h;
  ctx* c;
  image* img;
  kinfo* k;
  uint64_t owner;  // the module or kernel it came from
  int own_dyn_smem;
  int* dyn_smem;   // the MAX_DYNAMIC_SHARED_SIZE_BYTES in force (a CUkernel's, per device)
} func;
typedef struct library { obj h; image* img; uint64_t* kernels; uint64_t modules[MAX_DEVICES]; } library;
typedef struct kern {
  obj h;
  library* lib;
  kinfo* k;
  int dyn_smem[MAX_DEVICES];
  uint64_t funcs[MAX_DEVICES];
} kern;

static void drop_if_ctx(obj* o, void* arg) {
  ctx* c = arg;
  ctx* owner = o->kind == K_STREAM ? ((stream*)o)->c
             : o->kind == K_EVENT  ? ((event*)o)->c
             : o->kind == K_MODULE ? ((module*)o)->c
             : ((func*)o)->c;
  if (owner != c) return;
  int kind = o->kind;
  reg_remove(o);
  if (kind == K_STREAM) stream_retire((stream*)o);
  else if (kind == K_MODULE) free(((module*)o)->funcs), free(o);
  else free(o);
}

static void drop_allocations(alloc_table* t, ctx* c) {
  for (size_t i = t->n; i-- > 0;)
    if (t->a[i]->owner == c) alloc_release(t->a[i]);
}

// What the driver does when a primary context is reset or released for the last time:
// its work is dropped and its streams, events, modules and memory destroyed.
static void ctx_teardown(ctx* c) {
  for (size_t i = 0; i < n_streams; ++i)
    if (all_streams[i]->c == c) {
      stream_discard(all_streams[i]);
      if (all_streams[i]->cap_seq) leave_capture(all_streams[i]);
    }
  int kinds[] = {K_STREAM, K_EVENT, K_FUNC, K_MODULE};
  for (size_t k = 0; k < sizeof kinds / sizeof *kinds; ++k) reg_each(kinds[k], drop_if_ctx, c);
  for (int d = 0; d < cfg.devices; ++d) {
    drop_allocations(&devices[d].allocs, c);
    devices[d].primary->peers &= ~(1u << c->dev);  // their mappings of this memory
  }
  drop_allocations(&host_allocs, c);
  c->peers = 0;
  c->sticky = CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUhandle* out, CUdevice d) {
  ENTER;
  CHECK(need_device(d));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  ctx* c = devices[d].primary;
  ++c->refs;
  c->active = 1;
  *out = HANDLE(c);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  ENTER;
  CHECK(need_device(d));
  ctx* c = devices[d].primary;
  if (c->refs <= 0) LEAVE(CUDA_ERROR_INVALID_CONTEXT);
  if (--c->refs == 0) {
    ctx_teardown(c);
    c->active = 0;
  }
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) {
  ENTER;
  CHECK(need_device(d));
  ctx_teardown(devices[d].primary);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned* flags, int* active) {
  ENTER;
  CHECK(need_device(d));
  if (!flags || !active) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *flags = devices[d].primary->flags;
  *active = devices[d].primary->active;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice d, unsigned flags) {
  ENTER;
  CHECK(need_device(d));
  if (flags & ~0x1fu) LEAVE(CUDA_ERROR_INVALID_VALUE);
  devices[d].primary->flags = flags;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxSetCurrent(CUhandle h) {
  ENTER;
  CHECK(need_init());
  if (!h) {
    if (tls_depth) --tls_depth;
    LEAVE(CUDA_SUCCESS);
  }
  ctx* c = reg_get(h, K_CTX);
  if (!c) LEAVE(CUDA_ERROR_INVALID_CONTEXT);
  if (!tls_depth) tls_depth = 1;
  tls_ctx[tls_depth - 1] = c;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxGetCurrent(CUhandle* out) {
  ENTER;
  CHECK(need_init());
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  ctx* c = current_ctx();
  *out = c ? HANDLE(c) : NULL;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxPushCurrent_v2(CUhandle h) {
  ENTER;
  CHECK(need_init());
  ctx* c = reg_get(h, K_CTX);
  if (!c) LEAVE(CUDA_ERROR_INVALID_CONTEXT);
  if (tls_depth == CTX_STACK) LEAVE(CUDA_ERROR_INVALID_VALUE);
  tls_ctx[tls_depth++] = c;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuCtxPopCurrent_v2(CUhandle* out) {
  ENTER;
  CHECK(need_init());
  if (!tls_depth) LEAVE(CUDA_ERROR_INVALID_CONTEXT);
  ctx* c = tls_ctx[--tls_depth];
  if (out) *out = HANDLE(c);
  LEAVE(CUDA_SUCCESS);
}

static CUresult ctx_or_current(CUhandle h, ctx** out) {
  if (h) return get_ctx(h, out);
  TRY(need_init());
  *out = current_ctx();
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

EXPORT CUresult cuCtxGetDevice(CUdevice* d) {
  ENTER;
  ctx* c;
  CUresult r = ctx_or_current(NULL, &c);
  if (!r && !d) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *d = c->dev;
  LEAVE(r);
}

EXPORT CUresult cuCtxGetDevice_v2(CUdevice* d, CUhandle h) {
  ENTER;
  ctx* c;
  CUresult r = ctx_or_current(h, &c);
  if (!r && !d) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *d = c->dev;
  LEAVE(r);
}

EXPORT CUresult cuCtxGetFlags(unsigned* flags) {
  ENTER;
  ctx* c;
  CUresult r = ctx_or_current(NULL, &c);
  if (!r && !flags) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *flags = c->flags;
  LEAVE(r);
}

EXPORT CUresult cuCtxGetId(CUhandle h, unsigned long long* id) {
  ENTER;
  ctx* c;
  CUresult r = ctx_or_current(h, &c);
  if (!r && !id) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *id = (unsigned long long)c->dev + 1;
  LEAVE(r);
}

EXPORT CUresult cuCtxGetApiVersion(CUhandle h, unsigned* version) {
  ENTER;
  ctx* c;
  CUresult r = ctx_or_current(h, &c);
  if (!r && !version) r = CUDA_ERROR_INVALID_VALUE;
  if (!r) *version = 3020;
  LEAVE(r);
}

EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  ENTER;
  ctx* c;
  CUresult r = need_ctx(&c);
  if (!r && least) *least = 0;
  if (!r && greatest) *greatest = -5;
  LEAVE(r);
}

static CUresult ctx_synchronize(ctx* c) {
  TRY(capture_unsafe_call());
  for (size_t i = 0; i < n_streams; ++i)
    if (all_streams[i]->c == c) sync_to(all_streams[i], all_streams[i]->len);
  return c->sticky;
}

EXPORT CUresult cuCtxSynchronize(void) {
  ENTER;
  ctx* c;
  CUresult r = need_ctx(&c);
  LEAVE(r ? r : ctx_synchronize(c));
}

EXPORT CUresult cuCtxSynchronize_v2(CUhandle h) {
  ENTER;
  ctx* c;
  CUresult r = ctx_or_current(h, &c);
  if (!r) r = ctx_usable(c);
  LEAVE(r ? r : ctx_synchronize(c));
}

EXPORT CUresult cuCtxEnablePeerAccess(CUhandle peer, unsigned flags) {
  ENTER;
  ctx *c, *p;
  CUresult r = need_ctx(&c);
  if (!r) r = get_ctx(peer, &p);
  if (!r && !p->active) r = CUDA_ERROR_INVALID_CONTEXT;
  if (!r && flags) r = CUDA_ERROR_INVALID_VALUE;
  if (!r && p->dev == c->dev) r = CUDA_ERROR_INVALID_DEVICE;
  if (!r && !peer_possible(c->dev, p->dev)) r = CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
  if (!r && (c->peers >> p->dev & 1)) r = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
  if (!r) c->peers |= 1u << p->dev;
  LEAVE(r);
}

EXPORT CUresult cuCtxDisablePeerAccess(CUhandle peer) {
  ENTER;
  ctx *c, *p;
  CUresult r = need_ctx(&c);
  if (!r) r = get_ctx(peer, &p);
  if (!r && !(c->peers >> p->dev & 1)) r = CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
  if (!r) c->peers &= ~(1u << p->dev);
  LEAVE(r);
}

/* ------------------------------------------------------------------------------------
 * API: memory
 * ---------------------------------------------------------------------------------- */

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t n) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  CHECK(capture_unsafe_call());
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  alloc* a;
  CHECK(device_alloc(c->dev, n, c, NULL, &a));
  *out = a->base;
  LEAVE(CUDA_SUCCESS);
}

// cuMemFree waits for the device to finish (as the driver does), then frees.
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  CHECK(capture_unsafe_call());
  if (!p) LEAVE(CUDA_SUCCESS);
  alloc* a = device_alloc_at(p, 0);
  if (!a || a->base != p || a->state != A_LIVE) LEAVE(CUDA_ERROR_INVALID_VALUE);
  run_everything();
  alloc_release(a);
  LEAVE(c->sticky);
}

EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  if (!free_bytes || !total) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *total = devices[c->dev].total;
  *free_bytes = devices[c->dev].total - devices[c->dev].used;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  ENTER;
  CHECK(need_init());
  alloc* a = device_alloc_at(p, 0);
  if (!a) LEAVE(CUDA_ERROR_NOT_FOUND);
  if (base) *base = a->base;
  if (size) *size = a->size;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostAlloc(void** out, size_t n, unsigned flags) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  CHECK(capture_unsafe_call());
  if (!out || (flags & ~(unsigned)CU_MEMHOSTALLOC_ALL)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  alloc* a;
  CHECK(host_alloc(n, flags, c, NULL, &a));
  *out = (void*)(uintptr_t)a->base;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemAllocHost_v2(void** out, size_t n) { return cuMemHostAlloc(out, n, 0); }

EXPORT CUresult cuMemFreeHost(void* p) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  CHECK(capture_unsafe_call());
  alloc* a = table_at(&host_allocs, (uint64_t)(uintptr_t)p, 0);
  if (!a || a->base != (uint64_t)(uintptr_t)p || a->pool) LEAVE(CUDA_ERROR_INVALID_VALUE);
  run_everything();  // pending copies into it run first
  host_free(a);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* out, void* p, unsigned flags) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  if (!out || flags || !table_at(&host_allocs, (uint64_t)(uintptr_t)p, 0)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = (uint64_t)(uintptr_t)p;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemHostGetFlags(unsigned* flags, void* p) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  alloc* a = table_at(&host_allocs, (uint64_t)(uintptr_t)p, 0);
  if (!flags || !a) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *flags = a->flags;
  LEAVE(CUDA_SUCCESS);
}

/* -- copies and memsets ------------------------------------------------------------- */

enum { DIR_HTOD, DIR_DTOH, DIR_DTOD, DIR_ANY };

// A device-side operand: all of [p, p + n) in one allocation (device, or pinned host
// memory, which UVA maps for the device).
static CUresult device_operand(uint64_t p, size_t n) {
  alloc* a = range_alloc(p, n);
  return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// A host-side operand: not NULL, and not device memory (which the host cannot touch).
static CUresult host_operand(uint64_t p) {
  return !p || region_of(p) >= 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static int is_pinned(uint64_t p, size_t n) {
  alloc* a = table_at(&host_allocs, p, 0);
  return a && n <= a->size && p - a->base <= a->size - n;
}

// Host memory from a memory pool (cuda.core's PinnedMemoryResource) is page-locked, but a
// copy from the device into it returns only when done, as into pageable memory: so the
// real driver did (580.159, CUDA 13.0, H200: 250 us behind a busy stream, 5 us into
// cuMemHostAlloc memory; docs/benchmarks.md, session 19).
static int in_host_pool(uint64_t p) {
  alloc* a = table_at(&host_allocs, p, 0);
  return a && a->pool;
}

// Checks both operands of a copy; reports whether the source / destination are
// pageable host memory (staged now / written synchronously, as the driver does).
static CUresult copy_operands(int dir, uint64_t dst, uint64_t src, size_t n, int* src_pageable, int* dst_pageable) {
  int dst_dev = dir == DIR_HTOD || dir == DIR_DTOD || (dir == DIR_ANY && region_of(dst) >= 0);
  int src_dev = dir == DIR_DTOH || dir == DIR_DTOD || (dir == DIR_ANY && region_of(src) >= 0);
  TRY(dst_dev ? device_operand(dst, n) : host_operand(dst));
  TRY(src_dev ? device_operand(src, n) : host_operand(src));
  *src_pageable = !src_dev && !is_pinned(src, n);
  *dst_pageable = !dst_dev && !is_pinned(dst, n);
  return CUDA_SUCCESS;
}

static CUresult enqueue_copy(stream* s, int dir, uint64_t dst, uint64_t src, size_t n) {
  int src_pageable, dst_pageable;
  TRY(copy_operands(dir, dst, src, n, &src_pageable, &dst_pageable));
  if (!n) return CUDA_SUCCESS;
  if (s->cap_seq && (src_pageable || dst_pageable)) {
    s->cap_seq->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  op o = {.kind = OP_COPY, .c = s->c};
  o.u.cp.dst = dst;
  o.u.cp.src = src;
  o.u.cp.n = n;
  if (src_pageable) {
    o.u.cp.staged = xcalloc(1, n);
    memcpy(o.u.cp.staged, (const void*)(uintptr_t)src, n);
  }
  TRY(submit(s, &o));
  if (dst_pageable || in_host_pool(dst)) sync_to(s, s->len);  // returns when done
  return s->c->sticky;
}

static CUresult copy_async(CUhandle h, int dir, uint64_t dst, uint64_t src, size_t n) {
  stream* s;
  TRY(work_stream(h, &s));
  return enqueue_copy(s, dir, dst, src, n);
}

// A synchronous copy: on the legacy stream, waited for.
static CUresult copy_sync(int dir, uint64_t dst, uint64_t src, size_t n) {
  stream* s;
  TRY(work_stream(NULL, &s));
  TRY(enqueue_copy(s, dir, dst, src, n));
  sync_to(s, s->len);
  return s->c->sticky;
}

#define U64(p) ((uint64_t)(uintptr_t)(p))

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUhandle s) {
  ENTER;
  LEAVE(copy_async(s, DIR_HTOD, dst, U64(src), n));
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUhandle s) {
  ENTER;
  LEAVE(copy_async(s, DIR_DTOH, U64(dst), src, n));
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUhandle s) {
  ENTER;
  LEAVE(copy_async(s, DIR_DTOD, dst, src, n));
}
EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUhandle s) {
  ENTER;
  LEAVE(copy_async(s, DIR_ANY, dst, src, n));
}
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  ENTER;
  LEAVE(copy_sync(DIR_HTOD, dst, U64(src), n));
}
EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  ENTER;
  LEAVE(copy_sync(DIR_DTOH, U64(dst), src, n));
}
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  ENTER;
  LEAVE(copy_sync(DIR_DTOD, dst, src, n));
}
EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  ENTER;
  LEAVE(copy_sync(DIR_ANY, dst, src, n));
}

// A peer copy needs no peer access; each pointer must be memory of its context's device.
static CUresult peer_operands(CUdeviceptr dst, CUhandle dctx, CUdeviceptr src, CUhandle sctx, size_t n) {
  ctx *dc, *sc;
  TRY(get_ctx(dctx, &dc));
  TRY(get_ctx(sctx, &sc));
  TRY(ctx_usable(dc));
  TRY(ctx_usable(sc));
  alloc *da = range_alloc(dst, n), *sa = range_alloc(src, n);
  if (!da || !sa || da->dev != dc->dev || sa->dev != sc->dev) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUhandle dctx, CUdeviceptr src, CUhandle sctx, size_t n,
                                  CUhandle h) {
  ENTER;
  stream* s;
  CHECK(work_stream(h, &s));
  CHECK(peer_operands(dst, dctx, src, sctx, n));
  LEAVE(enqueue_copy(s, DIR_DTOD, dst, src, n));
}

EXPORT CUresult cuMemcpyPeer(CUdeviceptr dst, CUhandle dctx, CUdeviceptr src, CUhandle sctx, size_t n) {
  ENTER;
  CHECK(peer_operands(dst, dctx, src, sctx, n));
  LEAVE(copy_sync(DIR_DTOD, dst, src, n));
}

static CUresult enqueue_memset(stream* s, CUdeviceptr dst, unsigned value, unsigned elem, size_t count) {
  if (dst % elem) return CUDA_ERROR_INVALID_VALUE;
  TRY(device_operand(dst, count * elem));
  if (!count) return CUDA_SUCCESS;
  op o = {.kind = OP_MEMSET, .c = s->c};
  o.u.ms.dst = dst;
  o.u.ms.value = value;
  o.u.ms.elem = elem;
  o.u.ms.count = count;
  TRY(submit(s, &o));
  return s->c->sticky;
}

static CUresult memset_call(CUhandle h, int sync, CUdeviceptr dst, unsigned value, unsigned elem, size_t count) {
  stream* s;
  TRY(work_stream(h, &s));
  TRY(enqueue_memset(s, dst, value, elem, count));
  if (sync) sync_to(s, s->len);
  return s->c->sticky;
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUhandle s) {
  ENTER;
  LEAVE(memset_call(s, 0, d, v, 1, n));
}
EXPORT CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUhandle s) {
  ENTER;
  LEAVE(memset_call(s, 0, d, v, 2, n));
}
EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUhandle s) {
  ENTER;
  LEAVE(memset_call(s, 0, d, v, 4, n));
}
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
  ENTER;
  LEAVE(memset_call(NULL, 1, d, v, 1, n));
}
EXPORT CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) {
  ENTER;
  LEAVE(memset_call(NULL, 1, d, v, 2, n));
}
EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) {
  ENTER;
  LEAVE(memset_call(NULL, 1, d, v, 4, n));
}

/* ------------------------------------------------------------------------------------
 * API: streams and events
 * ---------------------------------------------------------------------------------- */

EXPORT CUresult cuStreamCreateWithPriority(CUhandle* out, unsigned flags, int priority) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  if (!out || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
  *out = HANDLE(stream_new(c, flags, priority, 0));
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamCreate(CUhandle* out, unsigned flags) { return cuStreamCreateWithPriority(out, flags, 0); }

// A stream that joined a capture may go once the capture has joined its work back;
// destroying the origin, or a stream with unjoined work, ends the capture.
static void stream_leaves_capture(stream* s) {
  capture* cap = s->cap_seq;
  stream* origin = cap->origin;
  int joined = s != origin;
  for (size_t j = 0; joined && j < s->ndeps; ++j) joined = reaches(s->deps[j], origin->deps, origin->ndeps);
  if (!joined) cap->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  if (s != origin) leave_capture(s);
}

// Destroying a stream lets its queued work finish (here: runs it), then the handle dies.
EXPORT CUresult cuStreamDestroy_v2(CUhandle h) {
  ENTER;
  CHECK(need_init());
  stream* s = reg_get(h, K_STREAM);
  if (!s) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (s->cap_seq) stream_leaves_capture(s);
  run_until(s, s->len);
  reg_remove(&s->h);
  stream_retire(s);
  LEAVE(CUDA_SUCCESS);
}

// Waiting on a capturing stream is illegal (and ends the capture).
static CUresult not_capturing(stream* s) {
  if (!s->cap_seq) return CUDA_SUCCESS;
  s->cap_seq->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

EXPORT CUresult cuStreamSynchronize(CUhandle h) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  CHECK(not_capturing(s));
  if (s->special == 1) CHECK(capture_unsafe_call());
  sync_to(s, s->len);
  LEAVE(s->c->sticky);
}

// A query of unfinished work says NOT_READY PJSTUB_QUERY_POLLS - 1 times, then runs it,
// so that callers must handle NOT_READY and polling loops still end.
static int poll_done(int* polls) {
  if (++*polls < cfg.query_polls) return 0;
  *polls = 0;
  return 1;
}

EXPORT CUresult cuStreamQuery(CUhandle h) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  CHECK(not_capturing(s));
  if (pending(s)) {
    if (!poll_done(&s->polls)) LEAVE(CUDA_ERROR_NOT_READY);
    sync_to(s, s->len);
  }
  LEAVE(s->c->sticky);
}

EXPORT CUresult cuStreamGetFlags(CUhandle h, unsigned* flags) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  if (!flags) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *flags = s->flags;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetPriority(CUhandle h, int* priority) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  if (!priority) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *priority = s->priority;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetCtx(CUhandle h, CUhandle* out) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(s->c);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetCtx_v2(CUhandle h, CUhandle* out, CUhandle* green) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(s->c);
  if (green) *green = NULL;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetId(CUhandle h, unsigned long long* id) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  if (!id) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *id = s->special ? (unsigned long long)s->special : s->h.id >> 4;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuStreamGetDevice(CUhandle h, CUdevice* d) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  if (!d) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *d = s->c->dev;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuLaunchHostFunc(CUhandle h, void (*fn)(void*), void* data) {
  ENTER;
  stream* s;
  CHECK(work_stream(h, &s));
  if (!fn) LEAVE(CUDA_ERROR_INVALID_VALUE);
  op o = {.kind = OP_HOST, .c = s->c};
  o.u.host.fn = fn;
  o.u.host.data = data;
  LEAVE(submit(s, &o));
}

/* -- events ------------------------------------------------------------------------- */

EXPORT CUresult cuEventCreate(CUhandle* out, unsigned flags) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  if (!out || (flags & ~7u)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  event* e = xcalloc(1, sizeof *e);
  e->c = c;
  e->flags = flags;
  reg_add(&e->h, K_EVENT);
  *out = HANDLE(e);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuEventDestroy_v2(CUhandle h) {
  ENTER;
  CHECK(need_init());
  event* e = reg_get(h, K_EVENT);
  if (!e) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  reg_remove(&e->h);
  free(e->cap_deps);
  free(e);
  LEAVE(CUDA_SUCCESS);
}

static CUresult record(event* e, stream* s) {
  if (e->c != s->c) return CUDA_ERROR_INVALID_HANDLE;  // event and stream of one context
  if (s->cap_seq) {  // the event stands for the capture's current nodes
    if (s->cap_seq->status != CU_STREAM_CAPTURE_STATUS_ACTIVE) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    e->cap_seq = s->cap_seq;
    e->cap_deps = xrealloc(e->cap_deps, (s->ndeps ? s->ndeps : 1) * sizeof *e->cap_deps);
    memcpy(e->cap_deps, s->deps, s->ndeps * sizeof *s->deps);
    e->ncap_deps = s->ndeps;
    return CUDA_SUCCESS;
  }
  op o = {.kind = OP_RECORD, .c = s->c};
  o.u.rec.event = e->h.id;
  o.u.rec.gen = ++e->gen;
  int idle = !pending(s);
  TRY(submit(s, &o));
  if (idle && s->len == s->done + 1) run_until(s, s->len);  // nothing before it: done at once
  e->cap_seq = NULL;
  e->s = s;
  e->seq = s->len;
  e->recorded = 1;
  e->polls = 0;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUhandle he, CUhandle hs) {
  ENTER;
  event* e;
  stream* s;
  CHECK(get_event(he, &e));
  CHECK(work_stream(hs, &s));
  LEAVE(record(e, s));
}

EXPORT CUresult cuEventRecordWithFlags(CUhandle he, CUhandle hs, unsigned flags) {
  ENTER;
  event* e;
  stream* s;
  CHECK(get_event(he, &e));
  CHECK(work_stream(hs, &s));
  if (flags & ~1u) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (flags) {
    complain("cuEventRecordWithFlags(CU_EVENT_RECORD_EXTERNAL) is not modelled by the stub");
    LEAVE(CUDA_ERROR_NOT_SUPPORTED);
  }
  LEAVE(record(e, s));
}

static int event_done(const event* e) { return !e->recorded || e->s->done >= e->seq; }

EXPORT CUresult cuEventQuery(CUhandle h) {
  ENTER;
  event* e;
  CHECK(get_event(h, &e));
  if (e->cap_seq) LEAVE(CUDA_ERROR_CAPTURED_EVENT);
  if (!event_done(e)) {
    if (!poll_done(&e->polls)) LEAVE(CUDA_ERROR_NOT_READY);
    sync_to(e->s, e->seq);
  }
  LEAVE(e->c->sticky);
}

EXPORT CUresult cuEventSynchronize(CUhandle h) {
  ENTER;
  event* e;
  CHECK(get_event(h, &e));
  if (e->cap_seq) LEAVE(CUDA_ERROR_CAPTURED_EVENT);
  if (e->recorded) sync_to(e->s, e->seq);
  LEAVE(e->c->sticky);
}

EXPORT CUresult cuEventElapsedTime(float* ms, CUhandle hstart, CUhandle hend) {
  ENTER;
  event *a, *b;
  CHECK(get_event(hstart, &a));
  CHECK(get_event(hend, &b));
  if (!ms) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (a->cap_seq || b->cap_seq) LEAVE(CUDA_ERROR_CAPTURED_EVENT);
  if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (a->c != b->c) LEAVE(CUDA_ERROR_INVALID_HANDLE);  // events of two devices
  if (!a->recorded || !b->recorded) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!event_done(a) || !event_done(b)) LEAVE(CUDA_ERROR_NOT_READY);
  if (a->time_gen != a->gen || b->time_gen != b->gen) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  *ms = (float)(b->time - a->time);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuEventElapsedTime_v2(float* ms, CUhandle hstart, CUhandle hend) {
  return cuEventElapsedTime(ms, hstart, hend);
}

// Waiting on an event: in a capture, a dependency on its nodes (joining the capture
// when the stream is not in one yet); outside, a wait for the work recorded before it.
static CUresult wait_captured(stream* s, event* e) {
  if (!s->cap_seq) {
    s->cap_seq = e->cap_seq;
    set_deps(s, e->cap_deps, e->ncap_deps);
    return CUDA_SUCCESS;
  }
  if (s->cap_seq != e->cap_seq) {
    s->cap_seq->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    return CUDA_ERROR_STREAM_CAPTURE_MERGE;
  }
  add_deps(s, e->cap_deps, e->ncap_deps);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamWaitEvent(CUhandle hs, CUhandle he, unsigned flags) {
  ENTER;
  stream* s;
  event* e;
  CHECK(work_stream(hs, &s));
  CHECK(get_event(he, &e));
  if (flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (e->cap_seq) LEAVE(wait_captured(s, e));
  if (s->cap_seq) {  // uncaptured work cannot be a dependency of a capture
    if (flags & CU_EVENT_WAIT_EXTERNAL) {
      complain("cuStreamWaitEvent(CU_EVENT_WAIT_EXTERNAL) in a capture is not modelled by the stub");
      LEAVE(CUDA_ERROR_NOT_SUPPORTED);
    }
    s->cap_seq->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    LEAVE(CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
  }
  if (flags) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (e->recorded && e->s != s && e->seq > e->s->done) push_wait(s, e->s, e->seq);
  LEAVE(CUDA_SUCCESS);
}

/* ------------------------------------------------------------------------------------
 * API: modules, libraries, kernels, functions
 * ---------------------------------------------------------------------------------- */

static const char* image_what(const image* img) { return img->is_ptx ? "PTX" : "cubin"; }

// Parses an image and checks it against a device, saying why it is refused.
static CUresult image_for_device(const void* data, int dev, image** out) {
  CUresult r = image_parse(data, out);
  if (r == CUDA_ERROR_INVALID_IMAGE) complain("refused an image that is neither a cubin (ELF, EM_CUDA) nor PTX");
  if (r) return r;
  r = image_fits(*out, devices[dev].major, devices[dev].minor);
  if (r)
    complain("refused a %s for sm_%d on device %d (compute capability %d.%d): %s", image_what(*out), (*out)->sm,
             dev, devices[dev].major, devices[dev].minor, error_name(r));
  return r;
}

static func* func_new(ctx* c, image* img, kinfo* k, uint64_t owner, int* dyn_smem) {
  func* f = xcalloc(1, sizeof *f);
  f->c = c;
  f->img = img;
  f->k = k;
  f->owner = owner;
  f->own_dyn_smem = SHMEM_DEFAULT - k->static_smem;
  f->dyn_smem = dyn_smem ? dyn_smem : &f->own_dyn_smem;
  reg_add(&f->h, K_FUNC);
  return f;
}

static module* module_new(ctx* c, image* img) {
  module* m = xcalloc(1, sizeof *m);
  m->c = c;
  m->img = img;
  m->funcs = xcalloc((size_t)img->nkernels, sizeof *m->funcs);
  reg_add(&m->h, K_MODULE);
  return m;
}

EXPORT CUresult cuModuleLoadData(CUhandle* out, const void* data) {
  ENTER;
  ctx* c;
  image* img;
  CHECK(need_ctx(&c));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  CHECK(image_for_device(data, c->dev, &img));
  *out = HANDLE(module_new(c, img));
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuModuleLoadDataEx(CUhandle* out, const void* data, unsigned n, void* options, void** values) {
  (void)n, (void)options, (void)values;  // JIT options change nothing here
  return cuModuleLoadData(out, data);
}

static void drop_funcs_of(obj* o, void* owner) {
  if (((func*)o)->owner == *(uint64_t*)owner) {
    reg_remove(o);
    free(o);
  }
}

EXPORT CUresult cuModuleUnload(CUhandle h) {
  ENTER;
  CHECK(need_init());
  module* m = reg_get(h, K_MODULE);
  if (!m) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  reg_each(K_FUNC, drop_funcs_of, &m->h.id);
  reg_remove(&m->h);
  free(m->funcs);
  free(m);
  LEAVE(CUDA_SUCCESS);
}

// A kernel name must be a global function symbol of the image (NOT_FOUND otherwise).
static CUresult module_function(module* m, const char* name, CUhandle* out) {
  if (!name || !out) return CUDA_ERROR_INVALID_VALUE;
  kinfo* k = image_kernel(m->img, name);
  if (!k) return CUDA_ERROR_NOT_FOUND;
  size_t i = (size_t)(k - m->img->kernels);
  func* f = m->funcs[i] ? reg_get((CUhandle)(uintptr_t)m->funcs[i], K_FUNC) : NULL;
  if (!f) {
    f = func_new(m->c, m->img, k, m->h.id, NULL);
    m->funcs[i] = f->h.id;
  }
  *out = HANDLE(f);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(CUhandle* out, CUhandle h, const char* name) {
  ENTER;
  CHECK(need_init());
  module* m = reg_get(h, K_MODULE);
  if (!m) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  CHECK(ctx_usable(m->c));
  LEAVE(module_function(m, name, out));
}

EXPORT CUresult cuModuleGetFunctionCount(unsigned* count, CUhandle h) {
  ENTER;
  CHECK(need_init());
  module* m = reg_get(h, K_MODULE);
  if (!m) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!count) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *count = (unsigned)m->img->nkernels;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuModuleEnumerateFunctions(CUhandle* out, unsigned n, CUhandle h) {
  ENTER;
  CHECK(need_init());
  module* m = reg_get(h, K_MODULE);
  if (!m) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!out || n < (unsigned)m->img->nkernels) LEAVE(CUDA_ERROR_INVALID_VALUE);
  for (int i = 0; i < m->img->nkernels; ++i) CHECK(module_function(m, m->img->kernels[i].name, &out[i]));
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuModuleGetLoadingMode(int* mode) {
  ENTER;
  if (!mode) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *mode = 1;  // CU_MODULE_EAGER_LOADING
  LEAVE(CUDA_SUCCESS);
}

/* -- libraries (context-independent) ------------------------------------------------ */

// A library loads if some device runs it; getting a function checks the device.
EXPORT CUresult cuLibraryLoadData(CUhandle* out, const void* data, void* jit_options, void** jit_values,
                                  unsigned n_jit, void* lib_options, void** lib_values, unsigned n_lib) {
  (void)jit_options, (void)jit_values, (void)n_jit, (void)lib_options, (void)lib_values, (void)n_lib;
  ENTER;
  CHECK(need_init());
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  image* img;
  CUresult r = CUDA_ERROR_NO_BINARY_FOR_GPU;
  for (int d = 0; d < cfg.devices && r; ++d) {
    r = image_for_device(data, d, &img);
    if (r == CUDA_ERROR_INVALID_IMAGE || r == CUDA_ERROR_INVALID_VALUE) break;
  }
  CHECK(r);
  library* l = xcalloc(1, sizeof *l);
  l->img = img;
  l->kernels = xcalloc((size_t)img->nkernels, sizeof *l->kernels);
  reg_add(&l->h, K_LIBRARY);
  *out = HANDLE(l);
  LEAVE(CUDA_SUCCESS);
}

static void drop_kernels_of(obj* o, void* lib) {
  kern* k = (kern*)o;
  if (k->lib != lib) return;
  reg_each(K_FUNC, drop_funcs_of, &k->h.id);
  reg_remove(o);
  free(o);
}

EXPORT CUresult cuLibraryUnload(CUhandle h) {
  ENTER;
  CHECK(need_init());
  library* l = reg_get(h, K_LIBRARY);
  if (!l) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  reg_each(K_KERNEL, drop_kernels_of, l);
  for (int d = 0; d < MAX_DEVICES; ++d) {
    module* m = l->modules[d] ? reg_get((CUhandle)(uintptr_t)l->modules[d], K_MODULE) : NULL;
    if (m) reg_each(K_FUNC, drop_funcs_of, &m->h.id), reg_remove(&m->h), free(m->funcs), free(m);
  }
  reg_remove(&l->h);
  free(l->kernels);
  free(l);
  LEAVE(CUDA_SUCCESS);
}

static CUresult library_kernel(library* l, kinfo* k, CUhandle* out) {
  size_t i = (size_t)(k - l->img->kernels);
  kern* kn = l->kernels[i] ? reg_get((CUhandle)(uintptr_t)l->kernels[i], K_KERNEL) : NULL;
  if (!kn) {
    kn = xcalloc(1, sizeof *kn);
    kn->lib = l;
    kn->k = k;
    for (int d = 0; d < MAX_DEVICES; ++d) kn->dyn_smem[d] = SHMEM_DEFAULT - k->static_smem;
    reg_add(&kn->h, K_KERNEL);
    l->kernels[i] = kn->h.id;
  }
  *out = HANDLE(kn);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuLibraryGetKernel(CUhandle* out, CUhandle h, const char* name) {
  ENTER;
  CHECK(need_init());
  library* l = reg_get(h, K_LIBRARY);
  if (!l) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!out || !name) LEAVE(CUDA_ERROR_INVALID_VALUE);
  kinfo* k = image_kernel(l->img, name);
  if (!k) LEAVE(CUDA_ERROR_NOT_FOUND);
  LEAVE(library_kernel(l, k, out));
}

EXPORT CUresult cuLibraryGetKernelCount(unsigned* count, CUhandle h) {
  ENTER;
  CHECK(need_init());
  library* l = reg_get(h, K_LIBRARY);
  if (!l) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!count) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *count = (unsigned)l->img->nkernels;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuLibraryEnumerateKernels(CUhandle* out, unsigned n, CUhandle h) {
  ENTER;
  CHECK(need_init());
  library* l = reg_get(h, K_LIBRARY);
  if (!l) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!out || n < (unsigned)l->img->nkernels) LEAVE(CUDA_ERROR_INVALID_VALUE);
  for (int i = 0; i < l->img->nkernels; ++i) CHECK(library_kernel(l, &l->img->kernels[i], &out[i]));
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuLibraryGetModule(CUhandle* out, CUhandle h) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  library* l = reg_get(h, K_LIBRARY);
  if (!l) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  CHECK(image_fits(l->img, devices[c->dev].major, devices[c->dev].minor));
  module* m = l->modules[c->dev] ? reg_get((CUhandle)(uintptr_t)l->modules[c->dev], K_MODULE) : NULL;
  if (!m) {
    m = module_new(c, l->img);
    l->modules[c->dev] = m->h.id;
  }
  *out = HANDLE(m);
  LEAVE(CUDA_SUCCESS);
}

// The function of a CUkernel in a context (made once per device).
static CUresult kernel_function(kern* kn, ctx* c, func** out) {
  TRY(image_fits(kn->lib->img, devices[c->dev].major, devices[c->dev].minor));
  func* f = kn->funcs[c->dev] ? reg_get((CUhandle)(uintptr_t)kn->funcs[c->dev], K_FUNC) : NULL;
  if (!f) {
    f = func_new(c, kn->lib->img, kn->k, kn->h.id, &kn->dyn_smem[c->dev]);
    kn->funcs[c->dev] = f->h.id;
  }
  *out = f;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuKernelGetFunction(CUhandle* out, CUhandle h) {
  ENTER;
  ctx* c;
  CHECK(need_ctx(&c));
  kern* kn = reg_get(h, K_KERNEL);
  if (!kn) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  func* f;
  CHECK(kernel_function(kn, c, &f));
  *out = HANDLE(f);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuKernelGetLibrary(CUhandle* out, CUhandle h) {
  ENTER;
  CHECK(need_init());
  kern* kn = reg_get(h, K_KERNEL);
  if (!kn) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(kn->lib);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuKernelGetName(const char** name, CUhandle h) {
  ENTER;
  CHECK(need_init());
  kern* kn = reg_get(h, K_KERNEL);
  if (!kn) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  if (!name) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *name = kn->k->name;
  LEAVE(CUDA_SUCCESS);
}

static CUresult param_info(const kinfo* k, size_t index, size_t* offset, size_t* size) {
  if (index >= (size_t)k->nparams) return CUDA_ERROR_INVALID_VALUE;
  if (offset) *offset = k->params[index].offset;
  if (size) *size = k->params[index].size;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuKernelGetParamInfo(CUhandle h, size_t index, size_t* offset, size_t* size) {
  ENTER;
  CHECK(need_init());
  kern* kn = reg_get(h, K_KERNEL);
  if (!kn) LEAVE(CUDA_ERROR_INVALID_HANDLE);
  LEAVE(param_info(kn->k, index, offset, size));
}

/* -- function attributes ------------------------------------------------------------- */

// Threads per block the kernel can run with: its launch bounds and its registers
// (65536 per block, allocated per warp in units of 256).
static int max_threads(const kinfo* k) {
  int regs = k->regs > 0 ? (k->regs + 7) / 8 * 8 : 8;
  int per_warp = (regs * 32 + 255) / 256 * 256;
  int by_regs = 65536 / per_warp * 32;
  int limit = k->max_threads < by_regs ? k->max_threads : by_regs;
  return limit < 1024 ? limit : 1024;
}

static CUresult func_attribute(const kinfo* k, const image* img, int dyn_smem, int attr, int* value) {
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  switch (attr) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = max_threads(k); break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *value = k->static_smem; break;
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES: *value = k->const_bytes; break;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *value = k->local_bytes; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *value = k->regs; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: *value = img->sm; break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *value = img->sm; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *value = dyn_smem; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *value = -1; break;
    default:
      if (attr < 0 || attr >= CU_FUNC_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
      *value = 0;
  }
  return CUDA_SUCCESS;
}

// Only the dynamic shared memory limit (up to the opt-in maximum) and the carveout
// change anything; other settable attributes are accepted and ignored.
static CUresult func_set_attribute(const kinfo* k, int* dyn_smem, int attr, int value) {
  if (attr == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (value < 0 || value > SHMEM_OPTIN - k->static_smem) return CUDA_ERROR_INVALID_VALUE;
    *dyn_smem = value;
    return CUDA_SUCCESS;
  }
  if (attr == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) return value < -1 || value > 100 ? CUDA_ERROR_INVALID_VALUE : 0;
  if (attr >= 10 && attr < CU_FUNC_ATTRIBUTE_MAX) return CUDA_SUCCESS;  // cluster settings
  return CUDA_ERROR_INVALID_VALUE;  // the rest are read-only
}

static CUresult get_func(CUhandle h, func** out) {
  TRY(need_init());
  *out = reg_get(h, K_FUNC);
  return *out ? ctx_usable((*out)->c) : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuFuncGetAttribute(int* value, int attr, CUhandle h) {
  ENTER;
  func* f;
  CHECK(get_func(h, &f));
  LEAVE(func_attribute(f->k, f->img, *f->dyn_smem, attr, value));
}

EXPORT CUresult cuFuncSetAttribute(CUhandle h, int attr, int value) {
  ENTER;
  func* f;
  CHECK(get_func(h, &f));
  LEAVE(func_set_attribute(f->k, f->dyn_smem, attr, value));
}

EXPORT CUresult cuFuncSetCacheConfig(CUhandle h, int config) {
  ENTER;
  func* f;
  CHECK(get_func(h, &f));
  LEAVE(config < 0 || config > 3 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS);
}

EXPORT CUresult cuFuncGetName(const char** name, CUhandle h) {
  ENTER;
  func* f;
  CHECK(get_func(h, &f));
  if (!name) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *name = f->k->name;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuFuncGetParamInfo(CUhandle h, size_t index, size_t* offset, size_t* size) {
  ENTER;
  func* f;
  CHECK(get_func(h, &f));
  LEAVE(param_info(f->k, index, offset, size));
}

EXPORT CUresult cuFuncGetModule(CUhandle* out, CUhandle h) {
  ENTER;
  func* f;
  CHECK(get_func(h, &f));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  obj* owner = reg_find(f->owner);
  if (!owner || owner->kind != K_MODULE) LEAVE(CUDA_ERROR_NOT_FOUND);
  *out = HANDLE(owner);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuFuncIsLoaded(int* state, CUhandle h) {
  ENTER;
  func* f;
  CHECK(get_func(h, &f));
  if (!state) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *state = 1;  // CU_FUNCTION_LOADING_STATE_LOADED
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuFuncLoad(CUhandle h) {
  ENTER;
  func* f;
  LEAVE(get_func(h, &f));
}

static CUresult get_kern_dev(CUhandle h, CUdevice d, kern** out) {
  TRY(need_device(d));
  *out = reg_get(h, K_KERNEL);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuKernelGetAttribute(int* value, int attr, CUhandle h, CUdevice d) {
  ENTER;
  kern* kn;
  CHECK(get_kern_dev(h, d, &kn));
  LEAVE(func_attribute(kn->k, kn->lib->img, kn->dyn_smem[d], attr, value));
}

EXPORT CUresult cuKernelSetAttribute(int attr, int value, CUhandle h, CUdevice d) {
  ENTER;
  kern* kn;
  CHECK(get_kern_dev(h, d, &kn));
  LEAVE(func_set_attribute(kn->k, &kn->dyn_smem[d], attr, value));
}

EXPORT CUresult cuKernelSetCacheConfig(CUhandle h, int config, CUdevice d) {
  ENTER;
  kern* kn;
  CHECK(get_kern_dev(h, d, &kn));
  LEAVE(config < 0 || config > 3 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS);
}

/* ------------------------------------------------------------------------------------
 * API: launches
 * ---------------------------------------------------------------------------------- */

// The launch limits of the device and of the kernel.
static CUresult check_launch(const func* f, const unsigned d[6], unsigned shmem) {
  const kinfo* k = f->k;
  for (int i = 0; i < 6; ++i)
    if (!d[i]) return CUDA_ERROR_INVALID_VALUE;
  if (d[0] > 2147483647u || d[1] > 65535 || d[2] > 65535) return CUDA_ERROR_INVALID_VALUE;
  if (d[3] > 1024 || d[4] > 1024 || d[5] > 64) return CUDA_ERROR_INVALID_VALUE;
  unsigned long long threads = (unsigned long long)d[3] * d[4] * d[5];
  if (threads > 1024) return CUDA_ERROR_INVALID_VALUE;
  if (k->reqntid[0] && (d[3] != k->reqntid[0] || d[4] != k->reqntid[1] || d[5] != k->reqntid[2]))
    return CUDA_ERROR_INVALID_VALUE;
  if (threads > (unsigned long long)max_threads(k)) return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
  if ((int)shmem > *f->dyn_smem) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

// The argument bytes, copied now (as the driver does) from kernelParams or `extra`.
static CUresult capture_args(const kinfo* k, void** params, void** extra, unsigned char** out) {
  if (params && extra) return CUDA_ERROR_INVALID_VALUE;
  unsigned char* buf = xcalloc(1, k->param_bytes);
  if (extra) {
    void* data = NULL;
    size_t size = 0;
    for (size_t i = 0; extra[i]; i += 2) {
      if ((uintptr_t)extra[i] == 1) data = extra[i + 1];
      else if ((uintptr_t)extra[i] == 2 && extra[i + 1]) size = *(size_t*)extra[i + 1];
      else break;
    }
    if (!data || size < k->param_bytes) goto bad;
    memcpy(buf, data, k->param_bytes);
  } else if (k->nparams) {
    if (!params) goto bad;
    for (int i = 0; i < k->nparams; ++i) {
      if (!params[i]) goto bad;
      memcpy(buf + k->params[i].offset, params[i], k->params[i].size);
    }
  }
  *out = buf;
  return CUDA_SUCCESS;
bad:
  free(buf);
  return CUDA_ERROR_INVALID_VALUE;
}

// A CUfunction, or a CUkernel (its function in the context that launches it).
static CUresult launch_function(CUhandle h, ctx* c, func** out) {
  kern* kn = reg_get(h, K_KERNEL);
  if (kn) return kernel_function(kn, c, out);
  TRY(get_func(h, out));
  return (*out)->c == c ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;  // another context's function
}

// A kernel op, checked; the host code must exist to run it.
static CUresult kernel_op(func* f, ctx* c, const unsigned d[6], unsigned shmem, void** params, void** extra, op* o) {
  TRY(check_launch(f, d, shmem));
  image_host_library(f->img);
  if (!f->k->host) {
    complain("no host code for kernel %s of image %s: expected pjhost_%s in %s/%s.so (register the image's "
             "CUDA source, see tests/cuda/stub.py)", f->k->name, f->img->sha, f->k->name, cfg.kernels, f->img->sha);
    return CUDA_ERROR_LAUNCH_FAILED;
  }
  memset(o, 0, sizeof *o);
  o->kind = OP_KERNEL;
  o->c = c;
  o->u.k.k = f->k;
  memcpy(o->u.k.launch, d, 6 * sizeof *d);
  o->u.k.launch[6] = shmem;
  return capture_args(f->k, params, extra, &o->u.k.params);
}

// Kernel launches to let through before one fails with LAUNCH_OUT_OF_RESOURCES (not sticky,
// as on a GPU); -1: none fails (pjstub_fail_launch).
static long launches_before_failure = -1;

static CUresult launch(CUhandle fh, const unsigned d[6], unsigned shmem, CUhandle sh, void** params, void** extra) {
  stream* s;
  func* f;
  op o;
  TRY(work_stream(sh, &s));
  TRY(launch_function(fh, s->c, &f));
  if (launches_before_failure == 0) {
    launches_before_failure = -1;
    return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
  }
  if (launches_before_failure > 0) --launches_before_failure;
  TRY(kernel_op(f, s->c, d, shmem, params, extra, &o));
  TRY(submit(s, &o));
  ++counters.kernel_launches;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuLaunchKernel(CUhandle f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shmem, CUhandle s, void** params, void** extra) {
  ENTER;
  unsigned d[6] = {gx, gy, gz, bx, by, bz};
  LEAVE(launch(f, d, shmem, s, params, extra));
}

// Launch attributes: the ones that change nothing here are accepted; a cluster
// shape must divide the grid.
static CUresult check_launch_attributes(const CUlaunchConfig* cfgl) {
  if (cfgl->numAttrs && !cfgl->attrs) return CUDA_ERROR_INVALID_VALUE;
  for (unsigned i = 0; i < cfgl->numAttrs; ++i) {
    const CUlaunchAttribute* a = &cfgl->attrs[i];
    if (a->id == 4) {  // CLUSTER_DIMENSION
      unsigned x = a->value.dim.x, y = a->value.dim.y, z = a->value.dim.z;
      if (!x || !y || !z || cfgl->gridDimX % x || cfgl->gridDimY % y || cfgl->gridDimZ % z || x * y * z > 8)
        return CUDA_ERROR_INVALID_VALUE;
    } else if (a->id < 0 || a->id > 16) {
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUhandle f, void** params, void** extra) {
  ENTER;
  if (!config) LEAVE(CUDA_ERROR_INVALID_VALUE);
  CHECK(check_launch_attributes(config));
  unsigned d[6] = {config->gridDimX, config->gridDimY, config->gridDimZ,
                   config->blockDimX, config->blockDimY, config->blockDimZ};
  LEAVE(launch(f, d, config->sharedMemBytes, config->hStream, params, extra));
}

/* ------------------------------------------------------------------------------------
 * API: graphs
 * ---------------------------------------------------------------------------------- */

static CUresult get_graph(CUhandle h, graph** out) {
  TRY(need_init());
  *out = reg_get(h, K_GRAPH);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGraphCreate(CUhandle* out, unsigned flags) {
  ENTER;
  CHECK(need_init());
  if (!out || flags) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(graph_new());
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuGraphDestroy(CUhandle h) {
  ENTER;
  graph* g;
  CHECK(get_graph(h, &g));
  graph_destroy(g);
  LEAVE(CUDA_SUCCESS);
}

// A kernel node's op: the function's context runs it (func, or kern in ctx / current).
static CUresult kernel_node_op(const CUDA_KERNEL_NODE_PARAMS* p, op* o) {
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  func* f;
  if (p->func) {
    TRY(get_func(p->func, &f));
  } else {
    kern* kn = reg_get(p->kern, K_KERNEL);
    ctx* c;
    if (!kn) return CUDA_ERROR_INVALID_VALUE;
    TRY(p->ctx ? get_ctx(p->ctx, &c) : need_ctx(&c));
    TRY(kernel_function(kn, c, &f));
  }
  unsigned d[6] = {p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ};
  return kernel_op(f, f->c, d, p->sharedMemBytes, p->kernelParams, p->extra, o);
}

static CUresult add_node(CUhandle* out, CUhandle hg, const CUhandle* deps, size_t ndeps, int type, op* o) {
  graph* g;
  uint64_t* ids;
  CUresult r = out ? get_graph(hg, &g) : CUDA_ERROR_INVALID_VALUE;
  if (!r) r = check_deps(g, deps, ndeps, &ids);
  if (r) {
    op_free(o);
    return r;
  }
  *out = HANDLE(graph_add(g, type, o, ids, ndeps));
  free(ids);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphAddKernelNode_v2(CUhandle* out, CUhandle g, const CUhandle* deps, size_t n,
                                        const CUDA_KERNEL_NODE_PARAMS* p) {
  ENTER;
  op o;
  CHECK(kernel_node_op(p, &o));
  LEAVE(add_node(out, g, deps, n, CU_GRAPH_NODE_TYPE_KERNEL, &o));
}

EXPORT CUresult cuGraphAddMemsetNode(CUhandle* out, CUhandle g, const CUhandle* deps, size_t n,
                                     const CUDA_MEMSET_NODE_PARAMS* p, CUhandle hctx) {
  ENTER;
  ctx* c;
  CHECK(ctx_or_current(hctx, &c));
  if (!p || (p->elementSize != 1 && p->elementSize != 2 && p->elementSize != 4)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (p->height != 1) {
    complain("2-D memset nodes are not modelled by the stub");
    LEAVE(CUDA_ERROR_NOT_SUPPORTED);
  }
  if (p->dst % p->elementSize) LEAVE(CUDA_ERROR_INVALID_VALUE);
  CHECK(device_operand(p->dst, p->width * p->elementSize));
  op o = {.kind = OP_MEMSET, .c = c};
  o.u.ms.dst = p->dst;
  o.u.ms.value = p->value;
  o.u.ms.elem = p->elementSize;
  o.u.ms.count = p->width;
  LEAVE(add_node(out, g, deps, n, CU_GRAPH_NODE_TYPE_MEMSET, &o));
}

EXPORT CUresult cuGraphAddEmptyNode(CUhandle* out, CUhandle g, const CUhandle* deps, size_t n) {
  ENTER;
  op o = {.kind = OP_NOP};
  LEAVE(add_node(out, g, deps, n, CU_GRAPH_NODE_TYPE_EMPTY, &o));
}

EXPORT CUresult cuGraphAddHostNode(CUhandle* out, CUhandle g, const CUhandle* deps, size_t n,
                                   const CUDA_HOST_NODE_PARAMS* p) {
  ENTER;
  if (!p || !p->fn) LEAVE(CUDA_ERROR_INVALID_VALUE);
  op o = {.kind = OP_HOST};
  o.u.host.fn = p->fn;
  o.u.host.data = p->userData;
  LEAVE(add_node(out, g, deps, n, CU_GRAPH_NODE_TYPE_HOST, &o));
}

static CUresult get_node(CUhandle h, gnode** out) {
  TRY(need_init());
  *out = reg_get(h, K_NODE);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGraphNodeGetType(CUhandle h, int* type) {
  ENTER;
  gnode* n;
  CHECK(get_node(h, &n));
  if (!type) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *type = n->type;
  LEAVE(CUDA_SUCCESS);
}

// The arguments of a kernel node, as pointers into the node's own copy of them.
static void** node_param_pointers(gnode* n) {
  static __thread void* ptrs[1024];
  kinfo* k = n->o.u.k.k;
  for (int i = 0; i < k->nparams && i < 1024; ++i) ptrs[i] = n->o.u.k.params + k->params[i].offset;
  return ptrs;
}

EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUhandle h, CUDA_KERNEL_NODE_PARAMS* p) {
  ENTER;
  gnode* n;
  CHECK(get_node(h, &n));
  if (!p || n->type != CU_GRAPH_NODE_TYPE_KERNEL) LEAVE(CUDA_ERROR_INVALID_VALUE);
  memset(p, 0, sizeof *p);
  const unsigned* d = n->o.u.k.launch;
  p->gridDimX = d[0], p->gridDimY = d[1], p->gridDimZ = d[2];
  p->blockDimX = d[3], p->blockDimY = d[4], p->blockDimZ = d[5], p->sharedMemBytes = d[6];
  p->kernelParams = node_param_pointers(n);
  p->ctx = HANDLE(n->o.c);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuGraphKernelNodeSetParams_v2(CUhandle h, const CUDA_KERNEL_NODE_PARAMS* p) {
  ENTER;
  gnode* n;
  op o;
  CHECK(get_node(h, &n));
  if (n->type != CU_GRAPH_NODE_TYPE_KERNEL) LEAVE(CUDA_ERROR_INVALID_VALUE);
  CHECK(kernel_node_op(p, &o));
  op_free(&n->o);
  n->o = o;
  LEAVE(CUDA_SUCCESS);
}

static CUresult list_nodes(graph* g, int roots, CUhandle* out, size_t* count) {
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  size_t k = 0;
  for (size_t i = 0; i < g->n; ++i) {
    if (roots && g->nodes[i]->ndeps) continue;
    if (out && k < *count) out[k] = HANDLE(g->nodes[i]);
    ++k;
  }
  if (!out || k < *count) *count = k;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGraphGetNodes(CUhandle h, CUhandle* nodes, size_t* count) {
  ENTER;
  graph* g;
  CHECK(get_graph(h, &g));
  LEAVE(list_nodes(g, 0, nodes, count));
}

EXPORT CUresult cuGraphGetRootNodes(CUhandle h, CUhandle* nodes, size_t* count) {
  ENTER;
  graph* g;
  CHECK(get_graph(h, &g));
  LEAVE(list_nodes(g, 1, nodes, count));
}

/* -- instantiation and launch ------------------------------------------------------- */

// The nodes in an order that respects every dependency (Kahn's algorithm).
static size_t* topo_order(const graph* g) {
  size_t* order = xcalloc(g->n, sizeof *order);
  size_t done = 0;
  for (size_t i = 0; i < g->n; ++i) g->nodes[i]->mark = 0;
  while (done < g->n) {
    for (size_t i = 0; i < g->n; ++i) {
      gnode* n = g->nodes[i];
      if (n->mark) continue;
      size_t ready = 0;
      for (size_t j = 0; j < n->ndeps; ++j) {
        gnode* d = reg_get((CUhandle)(uintptr_t)n->deps[j], K_NODE);
        ready += !d || d->mark;
      }
      if (ready == n->ndeps) n->mark = 1, order[done++] = i;
    }
  }
  return order;
}

static gexec* exec_new(const graph* g) {
  gexec* x = xcalloc(1, sizeof *x);
  size_t* order = topo_order(g);
  x->n = g->n;
  x->ops = xcalloc(g->n, sizeof *x->ops);
  x->node_ids = xcalloc(g->n, sizeof *x->node_ids);
  for (size_t i = 0; i < g->n; ++i) {
    x->ops[i] = op_clone(&g->nodes[order[i]]->o);
    x->node_ids[i] = g->nodes[order[i]]->h.id;
  }
  free(order);
  x->users = urefs_copy(&g->users);
  reg_add(&x->h, K_EXEC);
  return x;
}

EXPORT CUresult cuGraphInstantiateWithFlags(CUhandle* out, CUhandle h, unsigned long long flags) {
  ENTER;
  graph* g;
  CHECK(get_graph(h, &g));
  if (!out || (flags & ~0xfull)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(exec_new(g));
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuGraphInstantiateWithParams(CUhandle* out, CUhandle h, CUDA_GRAPH_INSTANTIATE_PARAMS* p) {
  ENTER;
  graph* g;
  CHECK(get_graph(h, &g));
  if (!out || !p || (p->flags & ~0xfull)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(exec_new(g));
  p->result_out = 0;  // CUDA_GRAPH_INSTANTIATE_SUCCESS
  p->hErrNode_out = NULL;
  LEAVE(CUDA_SUCCESS);
}

static CUresult get_exec(CUhandle h, gexec** out) {
  TRY(need_init());
  *out = reg_get(h, K_EXEC);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static void exec_free(gexec* x) {
  for (size_t i = 0; i < x->n; ++i) op_free(&x->ops[i]);
  free(x->ops);
  free(x->node_ids);
  urefs_release(&x->users);
  reg_remove(&x->h);
  free(x);
}

EXPORT CUresult cuGraphExecDestroy(CUhandle h) {
  ENTER;
  gexec* x;
  CHECK(get_exec(h, &x));
  exec_free(x);
  LEAVE(CUDA_SUCCESS);
}

// A launch runs the nodes as they are now; launches of one exec do not overlap.
EXPORT CUresult cuGraphLaunch(CUhandle h, CUhandle hs) {
  ENTER;
  gexec* x;
  stream* s;
  CHECK(get_exec(h, &x));
  CHECK(work_stream(hs, &s));
  if (s->cap_seq) {
    complain("launching a graph into a capture is not modelled by the stub");
    LEAVE(CUDA_ERROR_NOT_SUPPORTED);
  }
  op o = {.kind = OP_GRAPH, .c = s->c};
  o.u.g.snap = xcalloc(1, sizeof *o.u.g.snap);
  o.u.g.snap->n = x->n;
  o.u.g.snap->ops = xcalloc(x->n, sizeof *o.u.g.snap->ops);
  for (size_t i = 0; i < x->n; ++i) o.u.g.snap->ops[i] = op_clone(&x->ops[i]);
  o.u.g.snap->users = urefs_copy(&x->users);
  if (x->last_stream && x->last_stream != s && !x->last_stream->destroyed) push_wait(s, x->last_stream, x->last_seq);
  CHECK(submit(s, &o));
  ++counters.graph_launches;
  x->last_stream = s;
  x->last_seq = s->len;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuGraphUpload(CUhandle h, CUhandle hs) {
  ENTER;
  gexec* x;
  stream* s;
  CHECK(get_exec(h, &x));
  LEAVE(work_stream(hs, &s));
}

static long exec_index(const gexec* x, CUhandle node) {
  for (size_t i = 0; i < x->n; ++i)
    if (x->node_ids[i] == (uint64_t)(uintptr_t)node) return (long)i;
  return -1;
}

// The function may change, within its context (as the driver allows).
EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUhandle h, CUhandle node, const CUDA_KERNEL_NODE_PARAMS* p) {
  ENTER;
  gexec* x;
  op o;
  CHECK(get_exec(h, &x));
  long i = exec_index(x, node);
  if (i < 0 || x->ops[i].kind != OP_KERNEL) LEAVE(CUDA_ERROR_INVALID_VALUE);
  CHECK(kernel_node_op(p, &o));
  if (o.c != x->ops[i].c) {
    op_free(&o);
    LEAVE(CUDA_ERROR_INVALID_VALUE);
  }
  op_free(&x->ops[i]);
  x->ops[i] = o;
  LEAVE(CUDA_SUCCESS);
}

// The generic node update (CUDA 12.2+), which cuda.core's executable-node views call: the
// node type leads, then 3 reserved ints, then the params (a kernel node's are the v2 layout).
typedef struct {
  int type;
  int reserved0[3];
  union {
    long long reserved1[29];
    CUDA_KERNEL_NODE_PARAMS kernel;
  } u;
  long long reserved2;
} CUgraphNodeParams;

EXPORT CUresult cuGraphExecNodeSetParams(CUhandle h, CUhandle node, CUgraphNodeParams* p) {
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  if (p->type != CU_GRAPH_NODE_TYPE_KERNEL) return CUDA_ERROR_NOT_SUPPORTED;  // not modelled
  return cuGraphExecKernelNodeSetParams_v2(h, node, &p->u.kernel);
}

// An update takes a graph of the same shape: same node count, types and dependencies.
EXPORT CUresult cuGraphExecUpdate_v2(CUhandle h, CUhandle hg, CUgraphExecUpdateResultInfo* info) {
  ENTER;
  gexec* x;
  graph* g;
  CHECK(get_exec(h, &x));
  CHECK(get_graph(hg, &g));
  if (!info) LEAVE(CUDA_ERROR_INVALID_VALUE);
  memset(info, 0, sizeof *info);
  size_t* order = topo_order(g);
  int same = g->n == x->n;
  for (size_t i = 0; same && i < g->n; ++i)
    same = g->nodes[order[i]]->o.kind == x->ops[i].kind && g->nodes[order[i]]->o.c == x->ops[i].c;
  if (!same) {
    free(order);
    info->result = 2;  // CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED
    LEAVE(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE);
  }
  for (size_t i = 0; i < g->n; ++i) {
    op_free(&x->ops[i]);
    x->ops[i] = op_clone(&g->nodes[order[i]]->o);
    x->node_ids[i] = g->nodes[order[i]]->h.id;
  }
  free(order);
  LEAVE(CUDA_SUCCESS);
}

/* -- user objects ------------------------------------------------------------------ */

EXPORT CUresult cuUserObjectCreate(CUhandle* out, void* ptr, void (*destroy)(void*), unsigned refs, unsigned flags) {
  ENTER;
  CHECK(need_init());
  if (!out || !destroy || !refs || refs > 2147483647u || flags != 1 /* NO_DESTRUCTOR_SYNC */)
    LEAVE(CUDA_ERROR_INVALID_VALUE);
  uobj* u = xcalloc(1, sizeof *u);
  *u = (uobj){{0, 0}, ptr, destroy, refs};
  reg_add(&u->h, K_USEROBJ);
  *out = HANDLE(u);
  LEAVE(CUDA_SUCCESS);
}

static CUresult get_uobj(CUhandle h, unsigned count, uobj** out) {
  TRY(need_init());
  *out = reg_get(h, K_USEROBJ);
  return *out && count && count <= 2147483647u ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuUserObjectRetain(CUhandle h, unsigned count) {
  ENTER;
  uobj* u;
  CHECK(get_uobj(h, count, &u));
  u->refs += count;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuUserObjectRelease(CUhandle h, unsigned count) {
  ENTER;
  uobj* u;
  CHECK(get_uobj(h, count, &u));
  if (count > u->refs) LEAVE(CUDA_ERROR_INVALID_VALUE);
  uobj_release(u, count);
  LEAVE(CUDA_SUCCESS);
}

// CU_GRAPH_USER_OBJECT_MOVE hands the caller's references to the graph.
EXPORT CUresult cuGraphRetainUserObject(CUhandle hg, CUhandle h, unsigned count, unsigned flags) {
  ENTER;
  graph* g;
  uobj* u;
  CHECK(get_graph(hg, &g));
  CHECK(get_uobj(h, count, &u));
  if (flags > 1) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (!flags) u->refs += count;
  urefs_add(&g->users, u->h.id, count);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuGraphReleaseUserObject(CUhandle hg, CUhandle h, unsigned count) {
  ENTER;
  graph* g;
  uobj* u;
  CHECK(get_graph(hg, &g));
  CHECK(get_uobj(h, count, &u));
  for (size_t i = 0; i < g->users.n; ++i)
    if (g->users.r[i].id == u->h.id) {
      if (count > g->users.r[i].count) LEAVE(CUDA_ERROR_INVALID_VALUE);
      g->users.r[i].count -= count;
      uobj_release(u, count);
      LEAVE(CUDA_SUCCESS);
    }
  LEAVE(CUDA_ERROR_INVALID_VALUE);
}

/* ------------------------------------------------------------------------------------
 * API: stream capture
 * ---------------------------------------------------------------------------------- */

EXPORT CUresult cuStreamBeginCapture_v2(CUhandle h, int mode) {
  ENTER;
  stream* s;
  CHECK(work_stream(h, &s));
  if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (s->special == 1) LEAVE(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);  // the legacy stream
  if (s->cap_seq) LEAVE(CUDA_ERROR_ILLEGAL_STATE);
  capture* cap = xcalloc(1, sizeof *cap);
  cap->id = next_capture_id++;
  cap->g = graph_new();
  cap->mode = mode;
  cap->status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
  cap->origin = s;
  cap->thread = pthread_self();
  s->cap_seq = cap;
  set_deps(s, NULL, 0);
  LEAVE(CUDA_SUCCESS);
}

// Whether `id` is one of `deps` or an ancestor of one of them.
static int reaches(uint64_t id, const uint64_t* deps, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (deps[i] == id) return 1;
    gnode* d = reg_get((CUhandle)(uintptr_t)deps[i], K_NODE);
    if (d && reaches(id, d->deps, d->ndeps)) return 1;
  }
  return 0;
}

// Every stream that joined the capture must have rejoined the origin stream.
static int capture_joined(const capture* cap) {
  const stream* origin = cap->origin;
  for (size_t i = 0; i < n_streams; ++i) {
    const stream* t = all_streams[i];
    if (t == origin || t->cap_seq != cap) continue;
    for (size_t j = 0; j < t->ndeps; ++j)
      if (!reaches(t->deps[j], origin->deps, origin->ndeps)) return 0;
  }
  return 1;
}

// Events recorded in an ended capture stand for nothing any more.
static void forget_capture(obj* o, void* cap) {
  event* e = (event*)o;
  if (e->cap_seq == cap) e->cap_seq = NULL;
}

EXPORT CUresult cuStreamEndCapture(CUhandle h, CUhandle* out) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  capture* cap = s->cap_seq;
  if (!cap) LEAVE(CUDA_ERROR_ILLEGAL_STATE);
  if (cap->mode != CU_STREAM_CAPTURE_MODE_RELAXED && !pthread_equal(cap->thread, pthread_self()))
    LEAVE(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
  if (cap->origin != s) {
    cap->status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    LEAVE(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
  }
  CUresult r = cap->status != CU_STREAM_CAPTURE_STATUS_ACTIVE ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
             : !capture_joined(cap)                           ? CUDA_ERROR_STREAM_CAPTURE_UNJOINED
                                                              : CUDA_SUCCESS;
  graph* g = cap->g;
  for (size_t i = 0; i < n_streams; ++i)
    if (all_streams[i]->cap_seq == cap) leave_capture(all_streams[i]);
  reg_each(K_EVENT, forget_capture, cap);
  free(cap);
  if (!out) LEAVE(r);  // the graph stays with whoever took it from cuStreamGetCaptureInfo
  if (r) {
    graph_destroy(g);
    *out = NULL;
    LEAVE(r);
  }
  *out = HANDLE(g);
  LEAVE(CUDA_SUCCESS);
}

// The legacy stream cannot be asked while a blocking stream of its context captures.
static CUresult capture_status(stream* s, int* status) {
  if (s->special == 1)
    for (size_t i = 0; i < n_streams; ++i) {
      stream* t = all_streams[i];
      if (t->c == s->c && t->cap_seq && !(t->flags & CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
  *status = s->cap_seq ? s->cap_seq->status : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamIsCapturing(CUhandle h, int* status) {
  ENTER;
  stream* s;
  CHECK(get_stream(h, &s));
  if (!status) LEAVE(CUDA_ERROR_INVALID_VALUE);
  LEAVE(capture_status(s, status));
}

static CUresult capture_info(CUhandle h, int* status, uint64_t* id, CUhandle* g, const CUhandle** deps,
                             const CUgraphEdgeData** edges, size_t* ndeps) {
  stream* s;
  TRY(get_stream(h, &s));
  if (!status) return CUDA_ERROR_INVALID_VALUE;
  TRY(capture_status(s, status));
  if (*status != CU_STREAM_CAPTURE_STATUS_ACTIVE) return CUDA_SUCCESS;
  if (id) *id = s->cap_seq->id;
  if (g) *g = HANDLE(s->cap_seq->g);
  s->deps_out = xrealloc(s->deps_out, (s->ndeps ? s->ndeps : 1) * sizeof *s->deps_out);
  memcpy(s->deps_out, s->deps, s->ndeps * sizeof *s->deps);
  if (deps) *deps = (const CUhandle*)s->deps_out;
  if (edges) *edges = NULL;  // all edges are default edges
  if (ndeps) *ndeps = s->ndeps;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamGetCaptureInfo_v2(CUhandle h, int* status, uint64_t* id, CUhandle* g,
                                          const CUhandle** deps, size_t* ndeps) {
  ENTER;
  LEAVE(capture_info(h, status, id, g, deps, NULL, ndeps));
}

EXPORT CUresult cuStreamGetCaptureInfo_v3(CUhandle h, int* status, uint64_t* id, CUhandle* g,
                                          const CUhandle** deps, const CUgraphEdgeData** edges, size_t* ndeps) {
  ENTER;
  LEAVE(capture_info(h, status, id, g, deps, edges, ndeps));
}

static CUresult update_capture_deps(CUhandle h, CUhandle* deps, size_t n, unsigned flags) {
  stream* s;
  uint64_t* ids;
  TRY(get_stream(h, &s));
  if (!s->cap_seq) return CUDA_ERROR_ILLEGAL_STATE;
  if (flags > 1) return CUDA_ERROR_INVALID_VALUE;
  TRY(check_deps(s->cap_seq->g, deps, n, &ids));
  if (flags == 1) set_deps(s, ids, n);  // CU_STREAM_SET_CAPTURE_DEPENDENCIES
  else add_deps(s, ids, n);
  free(ids);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamUpdateCaptureDependencies(CUhandle h, CUhandle* deps, size_t n, unsigned flags) {
  ENTER;
  LEAVE(update_capture_deps(h, deps, n, flags));
}

EXPORT CUresult cuStreamUpdateCaptureDependencies_v2(CUhandle h, CUhandle* deps, const CUgraphEdgeData* edges,
                                                     size_t n, unsigned flags) {
  ENTER;
  (void)edges;
  LEAVE(update_capture_deps(h, deps, n, flags));
}

EXPORT CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  ENTER;
  if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL || *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
    LEAVE(CUDA_ERROR_INVALID_VALUE);
  int old = tls_capture_mode;
  tls_capture_mode = *mode;
  *mode = old;
  LEAVE(CUDA_SUCCESS);
}

/* ------------------------------------------------------------------------------------
 * API: memory pools (stream-ordered allocation)
 * ---------------------------------------------------------------------------------- */

static CUresult get_pool(CUhandle h, pool** out) {
  TRY(need_init());
  *out = reg_get(h, K_POOL);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static int is_host_location(int type) {
  return type == CU_MEM_LOCATION_TYPE_HOST || type == CU_MEM_LOCATION_TYPE_HOST_NUMA ||
         type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT;
}

EXPORT CUresult cuMemPoolCreate(CUhandle* out, const CUmemPoolProps* props) {
  ENTER;
  CHECK(need_init());
  if (!out || !props || props->allocType != 1 /* PINNED */) LEAVE(CUDA_ERROR_INVALID_VALUE);
  int host = is_host_location(props->location.type);
  if (!host && (props->location.type != CU_MEM_LOCATION_TYPE_DEVICE || need_device(props->location.id)))
    LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(pool_new(host ? -1 : props->location.id, host));
  LEAVE(CUDA_SUCCESS);
}

// A pool with allocations outstanding goes away when they are freed (its memory stays).
EXPORT CUresult cuMemPoolDestroy(CUhandle h) {
  ENTER;
  pool* p;
  CHECK(get_pool(h, &p));
  for (int d = 0; d < cfg.devices; ++d)
    if (devices[d].default_pool == p) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (p == host_default_pool) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (p == host_current_pool) host_current_pool = host_default_pool;
  for (int d = 0; d < cfg.devices; ++d)
    if (devices[d].current_pool == p) devices[d].current_pool = devices[d].default_pool;
  reg_remove(&p->h);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolSetAttribute(CUhandle h, int attr, void* value) {
  ENTER;
  pool* p;
  CHECK(get_pool(h, &p));
  if (!value) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (attr >= CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES && attr <= CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES)
    p->reuse[attr - 1] = *(int*)value;
  else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) p->threshold = *(uint64_t*)value;
  else if ((attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH || attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) && !*(uint64_t*)value)
    p->used_high = p->reserved_high = p->used;  // a reset of a high watermark
  else LEAVE(CUDA_ERROR_INVALID_VALUE);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolGetAttribute(CUhandle h, int attr, void* value) {
  ENTER;
  pool* p;
  CHECK(get_pool(h, &p));
  if (!value) LEAVE(CUDA_ERROR_INVALID_VALUE);
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *(int*)value = p->reuse[attr - 1]; break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(uint64_t*)value = p->threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(uint64_t*)value = p->used; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(uint64_t*)value = p->reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(uint64_t*)value = p->used_high; break;
    default: LEAVE(CUDA_ERROR_INVALID_VALUE);
  }
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolTrimTo(CUhandle h, size_t keep) {
  ENTER;
  pool* p;
  (void)keep;
  LEAVE(get_pool(h, &p));  // freed blocks are returned at once here: nothing to trim
}

// Which devices' kernels may touch the pool's memory (the owner always may).
EXPORT CUresult cuMemPoolSetAccess(CUhandle h, const CUmemAccessDesc* map, size_t count) {
  ENTER;
  pool* p;
  CHECK(get_pool(h, &p));
  if (count && !map) LEAVE(CUDA_ERROR_INVALID_VALUE);
  for (size_t i = 0; i < count; ++i) {
    const CUmemAccessDesc* a = &map[i];
    if (a->location.type != CU_MEM_LOCATION_TYPE_DEVICE || need_device(a->location.id)) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (a->flags != 0 && a->flags != 1 && a->flags != 3) LEAVE(CUDA_ERROR_INVALID_VALUE);
    if (a->location.id == p->dev) {
      if (a->flags != 3) LEAVE(CUDA_ERROR_INVALID_DEVICE);
      continue;
    }
    if (!p->host && a->flags && !peer_possible(p->dev, a->location.id)) LEAVE(CUDA_ERROR_INVALID_DEVICE);
    if (a->flags) p->access |= 1u << a->location.id;
    else p->access &= ~(1u << a->location.id);
  }
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemPoolGetAccess(int* flags, CUhandle h, CUmemLocation* location) {
  ENTER;
  pool* p;
  CHECK(get_pool(h, &p));
  if (!flags || !location) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (is_host_location(location->type)) *flags = 3;
  else if (location->type != CU_MEM_LOCATION_TYPE_DEVICE || need_device(location->id)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  else *flags = location->id == p->dev || (p->access >> location->id & 1) ? 3 : 0;
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetDefaultMemPool(CUhandle* out, CUdevice d) {
  ENTER;
  CHECK(need_device(d));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(devices[d].default_pool);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceGetMemPool(CUhandle* out, CUdevice d) {
  ENTER;
  CHECK(need_device(d));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(devices[d].current_pool);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuDeviceSetMemPool(CUdevice d, CUhandle h) {
  ENTER;
  pool* p;
  CHECK(need_device(d));
  CHECK(get_pool(h, &p));
  if (p->host || p->dev != d) LEAVE(CUDA_ERROR_INVALID_VALUE);
  devices[d].current_pool = p;
  LEAVE(CUDA_SUCCESS);
}

// The pool slot of a location (pinned memory only: managed memory is not modelled).
static CUresult location_pool(const CUmemLocation* loc, int type, pool*** current, pool** fallback) {
  if (!loc || (type != 1 && type != 2)) return CUDA_ERROR_INVALID_VALUE;
  if (type == 2) {
    complain("managed memory pools are not modelled by the stub");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (is_host_location(loc->type)) {
    *current = &host_current_pool;
    *fallback = host_default_pool;
    return CUDA_SUCCESS;
  }
  if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
  TRY(need_device(loc->id));
  *current = &devices[loc->id].current_pool;
  *fallback = devices[loc->id].default_pool;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetDefaultMemPool(CUhandle* out, CUmemLocation* loc, int type) {
  ENTER;
  pool **current, *fallback;
  CHECK(need_init());
  CHECK(location_pool(loc, type, &current, &fallback));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(fallback);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemGetMemPool(CUhandle* out, CUmemLocation* loc, int type) {
  ENTER;
  pool **current, *fallback;
  CHECK(need_init());
  CHECK(location_pool(loc, type, &current, &fallback));
  if (!out) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *out = HANDLE(*current);
  LEAVE(CUDA_SUCCESS);
}

EXPORT CUresult cuMemSetMemPool(CUmemLocation* loc, int type, CUhandle h) {
  ENTER;
  pool **current, *fallback, *p;
  CHECK(need_init());
  CHECK(location_pool(loc, type, &current, &fallback));
  CHECK(get_pool(h, &p));
  if (p->host != fallback->host || p->dev != fallback->dev) LEAVE(CUDA_ERROR_INVALID_VALUE);
  *current = p;
  LEAVE(CUDA_SUCCESS);
}

// The memory exists at once, but becomes usable only where the stream reaches the
// allocation: work that touches it earlier (on another stream, unordered) faults.
static CUresult pool_alloc(pool* p, stream* s, size_t n, CUdeviceptr* out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (s->cap_seq) {
    complain("allocations in a stream capture (memory nodes) are not modelled by the stub");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  alloc* a;
  TRY(p->host ? host_alloc(n, 0, s->c, p, &a) : device_alloc(p->dev, n, s->c, p, &a));
  a->state = A_PENDING;
  p->used += a->span;
  if (p->used > p->used_high) p->used_high = p->reserved_high = p->used;
  op o = {.kind = OP_ALLOC, .c = s->c};
  o.u.mem.base = a->base;
  o.u.mem.serial = a->serial;
  o.u.mem.host = p->host;
  TRY(submit(s, &o));
  *out = a->base;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr* out, size_t n, CUhandle hp, CUhandle hs) {
  ENTER;
  pool* p;
  stream* s;
  CHECK(get_pool(hp, &p));
  CHECK(get_stream(hs, &s));  // a current context only for the NULL stream
  LEAVE(pool_alloc(p, s, n, out));
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr* out, size_t n, CUhandle hs) {
  ENTER;
  stream* s;
  CHECK(get_stream(hs, &s));  // a current context only for the NULL stream
  LEAVE(pool_alloc(devices[s->c->dev].current_pool, s, n, out));
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUhandle hs) {
  ENTER;
  stream* s;
  CHECK(get_stream(hs, &s));  // a current context only for the NULL stream
  alloc* a = device_alloc_at(p, 0);
  if (!a) a = table_at(&host_allocs, p, 0);
  if (!a || a->base != p || !a->pool || (a->flags & 0x80000000u)) LEAVE(CUDA_ERROR_INVALID_VALUE);
  if (s->cap_seq) {
    complain("frees in a stream capture (memory nodes) are not modelled by the stub");
    LEAVE(CUDA_ERROR_NOT_SUPPORTED);
  }
  op o = {.kind = OP_FREE, .c = s->c};
  o.u.mem.base = a->base;
  o.u.mem.serial = a->serial;
  o.u.mem.host = a->dev < 0;
  CHECK(submit(s, &o));
  a->flags |= 0x80000000u;  // freed (once its stream gets there); a second free is an error
  LEAVE(CUDA_SUCCESS);
}

/* ------------------------------------------------------------------------------------
 * API: pointer attributes
 * ---------------------------------------------------------------------------------- */

static alloc* pointer_alloc(CUdeviceptr p) {
  alloc* a = device_alloc_at(p, 0);
  return a ? a : table_at(&host_allocs, p, 0);
}

// One attribute of a known allocation (a == NULL: the defaults of an unknown pointer).
static CUresult pointer_attribute(const alloc* a, CUdeviceptr p, int attr, void* data) {
  int dev = a ? (a->dev >= 0 ? a->dev : a->owner ? a->owner->dev : 0) : -2;
  switch (attr) {
    case 1: *(CUhandle*)data = a && a->owner && !a->pool ? HANDLE(a->owner) : NULL; break;
    case 2: *(unsigned*)data = !a ? 0 : a->dev >= 0 ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST; break;
    case 3: *(CUdeviceptr*)data = a ? p : 0; break;
    case 4:
      if (a && a->dev >= 0) return CUDA_ERROR_INVALID_VALUE;
      *(void**)data = a ? (void*)(uintptr_t)p : NULL;
      break;
    case 6: case 13: *(int*)data = a != NULL; break;
    case 7: *(unsigned long long*)data = a ? a->serial : 0; break;
    case 8: case 15: *(int*)data = 0; break;
    case 9: *(int*)data = dev; break;
    case 10: *(int*)data = a && !a->pool && a->dev >= 0; break;
    case 11: *(CUdeviceptr*)data = a ? a->base : 0; break;
    case 12: *(size_t*)data = a ? a->size : 0; break;
    case 14: *(unsigned long long*)data = 0; break;
    case 16: *(unsigned*)data = a ? 3 : 0; break;
    case 17: *(CUhandle*)data = a && a->pool ? HANDLE(a->pool) : NULL; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
  ENTER;
  CHECK(need_init());
  alloc* a = pointer_alloc(p);
  if (!data || !a) LEAVE(CUDA_ERROR_INVALID_VALUE);
  LEAVE(pointer_attribute(a, p, attr, data));
}

// Unlike cuPointerGetAttribute, an unknown pointer is not an error: defaults are returned.
EXPORT CUresult cuPointerGetAttributes(unsigned n, int* attrs, void** data, CUdeviceptr p) {
  ENTER;
  CHECK(need_init());
  if (!attrs || !data) LEAVE(CUDA_ERROR_INVALID_VALUE);
  alloc* a = pointer_alloc(p);
  for (unsigned i = 0; i < n; ++i) CHECK(pointer_attribute(a, p, attrs[i], data[i]));
  LEAVE(CUDA_SUCCESS);
}

// The driver's private tables: NVRTC (which dlopens libcuda.so.1 too) asks for them and
// copes with an error, as it copes with no driver at all.
EXPORT CUresult cuGetExportTable(const void** table, const CUuuid* id) {
  (void)id;
  if (table) *table = NULL;
  return CUDA_ERROR_NOT_SUPPORTED;
}

/* ------------------------------------------------------------------------------------
 * Test hooks (not CUDA): fault injection, the schedule, counters
 * ---------------------------------------------------------------------------------- */

// The next kernel that runs on the device faults (CUDA_ERROR_ILLEGAL_ADDRESS, sticky).
EXPORT int pjstub_inject_fault(int ordinal) {
  lock();
  int ok = initialized && ordinal >= 0 && ordinal < cfg.devices;
  if (ok) ++devices[ordinal].faults_to_inject;
  unlock_ret("pjstub_inject_fault", 0);
  return ok ? 0 : -1;
}

// After `after` more kernel launches succeed, the next one fails (LAUNCH_OUT_OF_RESOURCES).
EXPORT int pjstub_fail_launch(int after) {
  lock();
  launches_before_failure = after;
  unlock_ret("pjstub_fail_launch", 0);
  return 0;
}

// 0: others first (the default), 1: target first. Returns the previous schedule.
EXPORT int pjstub_set_schedule(int schedule) {
  lock();
  int old = cfg.schedule;
  if (schedule == SCHED_OTHERS_FIRST || schedule == SCHED_TARGET_FIRST) cfg.schedule = schedule;
  unlock_ret("pjstub_set_schedule", 0);
  return old;
}

// Ops queued and not run yet, over every stream.
EXPORT unsigned long long pjstub_pending(void) {
  lock();
  unsigned long long n = 0;
  for (size_t i = 0; i < n_streams; ++i) n += all_streams[i]->len - all_streams[i]->done;
  unlock_ret("pjstub_pending", 0);
  return n;
}

// A counter: "kernel_launches", "graph_launches" (calls that succeeded) or "kernels_run".
EXPORT unsigned long long pjstub_count(const char* name) {
  lock();
  unsigned long long n = !strcmp(name, "kernel_launches") ? counters.kernel_launches
                       : !strcmp(name, "graph_launches")  ? counters.graph_launches
                       : !strcmp(name, "kernels_run")     ? counters.kernels_run
                                                          : 0;
  unlock_ret("pjstub_count", 0);
  return n;
}

/* ------------------------------------------------------------------------------------
 * cuGetProcAddress: cuda.bindings asks for every entry point by its base name and the
 * CUDA version whose ABI it expects; the newest entry not newer than that is returned.
 * A name not in the table is CUDA_ERROR_NOT_FOUND, so calling it fails cleanly in Python.
 * ---------------------------------------------------------------------------------- */

typedef struct { const char* name; int version; void* fn; } proc;

#define P(name, version, fn) {name, version, (void*)fn}
static const proc procs[] = {
  P("cuInit", 2000, cuInit), P("cuDriverGetVersion", 2020, cuDriverGetVersion),
  P("cuGetErrorName", 6000, cuGetErrorName), P("cuGetErrorString", 6000, cuGetErrorString),
  P("cuDeviceGetCount", 2000, cuDeviceGetCount), P("cuDeviceGet", 2000, cuDeviceGet),
  P("cuDeviceGetName", 2000, cuDeviceGetName), P("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
  P("cuDeviceComputeCapability", 2000, cuDeviceComputeCapability), P("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
  P("cuDeviceGetUuid", 11040, cuDeviceGetUuid), P("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),
  P("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute), P("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer),
  P("cuDeviceGetP2PAttribute", 8000, cuDeviceGetP2PAttribute),
  P("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
  P("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
  P("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2),
  P("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
  P("cuDevicePrimaryCtxSetFlags", 11000, cuDevicePrimaryCtxSetFlags_v2),
  P("cuCtxSetCurrent", 4000, cuCtxSetCurrent), P("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
  P("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2), P("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
  P("cuCtxGetDevice", 2000, cuCtxGetDevice), P("cuCtxGetDevice", 13000, cuCtxGetDevice_v2),
  P("cuCtxGetFlags", 7000, cuCtxGetFlags), P("cuCtxGetId", 12000, cuCtxGetId),
  P("cuCtxGetApiVersion", 3020, cuCtxGetApiVersion),
  P("cuCtxGetStreamPriorityRange", 5050, cuCtxGetStreamPriorityRange),
  P("cuCtxSynchronize", 2000, cuCtxSynchronize), P("cuCtxSynchronize", 13000, cuCtxSynchronize_v2),
  P("cuCtxEnablePeerAccess", 4000, cuCtxEnablePeerAccess), P("cuCtxDisablePeerAccess", 4000, cuCtxDisablePeerAccess),
  P("cuMemAlloc", 3020, cuMemAlloc_v2), P("cuMemFree", 3020, cuMemFree_v2), P("cuMemGetInfo", 3020, cuMemGetInfo_v2),
  P("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2), P("cuMemHostAlloc", 2020, cuMemHostAlloc),
  P("cuMemAllocHost", 3020, cuMemAllocHost_v2), P("cuMemFreeHost", 2000, cuMemFreeHost),
  P("cuMemHostGetDevicePointer", 3020, cuMemHostGetDevicePointer_v2), P("cuMemHostGetFlags", 2030, cuMemHostGetFlags),
  P("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2), P("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
  P("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2), P("cuMemcpyAsync", 4000, cuMemcpyAsync),
  P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2), P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
  P("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2), P("cuMemcpy", 4000, cuMemcpy),
  P("cuMemcpyPeerAsync", 4000, cuMemcpyPeerAsync), P("cuMemcpyPeer", 4000, cuMemcpyPeer),
  P("cuMemsetD8Async", 3020, cuMemsetD8Async), P("cuMemsetD16Async", 3020, cuMemsetD16Async),
  P("cuMemsetD32Async", 3020, cuMemsetD32Async), P("cuMemsetD8", 3020, cuMemsetD8_v2),
  P("cuMemsetD16", 3020, cuMemsetD16_v2), P("cuMemsetD32", 3020, cuMemsetD32_v2),
  P("cuStreamCreate", 2000, cuStreamCreate), P("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority),
  P("cuStreamDestroy", 4000, cuStreamDestroy_v2), P("cuStreamSynchronize", 2000, cuStreamSynchronize),
  P("cuStreamQuery", 2000, cuStreamQuery), P("cuStreamGetFlags", 5050, cuStreamGetFlags),
  P("cuStreamGetPriority", 5050, cuStreamGetPriority), P("cuStreamGetCtx", 9020, cuStreamGetCtx),
  P("cuStreamGetCtx", 12050, cuStreamGetCtx_v2), P("cuStreamGetId", 12000, cuStreamGetId),
  P("cuStreamGetDevice", 12080, cuStreamGetDevice), P("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
  P("cuLaunchHostFunc", 10000, cuLaunchHostFunc),
  P("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2), P("cuStreamEndCapture", 10000, cuStreamEndCapture),
  P("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
  P("cuStreamGetCaptureInfo", 11030, cuStreamGetCaptureInfo_v2),
  P("cuStreamGetCaptureInfo", 12030, cuStreamGetCaptureInfo_v3),
  P("cuStreamUpdateCaptureDependencies", 11030, cuStreamUpdateCaptureDependencies),
  P("cuStreamUpdateCaptureDependencies", 12030, cuStreamUpdateCaptureDependencies_v2),
  P("cuThreadExchangeStreamCaptureMode", 10010, cuThreadExchangeStreamCaptureMode),
  P("cuEventCreate", 2000, cuEventCreate), P("cuEventDestroy", 4000, cuEventDestroy_v2),
  P("cuEventRecord", 2000, cuEventRecord), P("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags),
  P("cuEventQuery", 2000, cuEventQuery), P("cuEventSynchronize", 2000, cuEventSynchronize),
  P("cuEventElapsedTime", 2000, cuEventElapsedTime), P("cuEventElapsedTime", 12080, cuEventElapsedTime_v2),
  P("cuModuleLoadData", 2000, cuModuleLoadData), P("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx),
  P("cuModuleUnload", 2000, cuModuleUnload), P("cuModuleGetFunction", 2000, cuModuleGetFunction),
  P("cuModuleGetFunctionCount", 12040, cuModuleGetFunctionCount),
  P("cuModuleEnumerateFunctions", 12040, cuModuleEnumerateFunctions),
  P("cuModuleGetLoadingMode", 11070, cuModuleGetLoadingMode),
  P("cuLibraryLoadData", 12000, cuLibraryLoadData), P("cuLibraryUnload", 12000, cuLibraryUnload),
  P("cuLibraryGetKernel", 12000, cuLibraryGetKernel), P("cuLibraryGetKernelCount", 12040, cuLibraryGetKernelCount),
  P("cuLibraryEnumerateKernels", 12040, cuLibraryEnumerateKernels), P("cuLibraryGetModule", 12000, cuLibraryGetModule),
  P("cuKernelGetFunction", 12000, cuKernelGetFunction), P("cuKernelGetLibrary", 12050, cuKernelGetLibrary),
  P("cuKernelGetName", 12030, cuKernelGetName), P("cuKernelGetParamInfo", 12040, cuKernelGetParamInfo),
  P("cuKernelGetAttribute", 12000, cuKernelGetAttribute), P("cuKernelSetAttribute", 12000, cuKernelSetAttribute),
  P("cuKernelSetCacheConfig", 12000, cuKernelSetCacheConfig),
  P("cuFuncGetAttribute", 2020, cuFuncGetAttribute), P("cuFuncSetAttribute", 9000, cuFuncSetAttribute),
  P("cuFuncSetCacheConfig", 3000, cuFuncSetCacheConfig), P("cuFuncGetName", 12030, cuFuncGetName),
  P("cuFuncGetParamInfo", 12040, cuFuncGetParamInfo), P("cuFuncGetModule", 11000, cuFuncGetModule),
  P("cuFuncIsLoaded", 12040, cuFuncIsLoaded), P("cuFuncLoad", 12040, cuFuncLoad),
  P("cuLaunchKernel", 4000, cuLaunchKernel), P("cuLaunchKernelEx", 11060, cuLaunchKernelEx),
  P("cuGraphCreate", 10000, cuGraphCreate), P("cuGraphDestroy", 10000, cuGraphDestroy),
  P("cuGraphAddKernelNode", 12000, cuGraphAddKernelNode_v2),
  P("cuGraphKernelNodeGetParams", 12000, cuGraphKernelNodeGetParams_v2),
  P("cuGraphKernelNodeSetParams", 12000, cuGraphKernelNodeSetParams_v2),
  P("cuGraphAddMemsetNode", 10000, cuGraphAddMemsetNode), P("cuGraphAddEmptyNode", 10000, cuGraphAddEmptyNode),
  P("cuGraphAddHostNode", 10000, cuGraphAddHostNode), P("cuGraphNodeGetType", 10000, cuGraphNodeGetType),
  P("cuGraphGetNodes", 10000, cuGraphGetNodes), P("cuGraphGetRootNodes", 10000, cuGraphGetRootNodes),
  P("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags),
  P("cuGraphInstantiateWithParams", 12000, cuGraphInstantiateWithParams),
  P("cuGraphExecDestroy", 10000, cuGraphExecDestroy), P("cuGraphLaunch", 10000, cuGraphLaunch),
  P("cuGraphUpload", 11010, cuGraphUpload),
  P("cuGraphExecKernelNodeSetParams", 12000, cuGraphExecKernelNodeSetParams_v2),
  P("cuGraphExecNodeSetParams", 12020, cuGraphExecNodeSetParams),
  P("cuGraphExecUpdate", 12000, cuGraphExecUpdate_v2),
  P("cuUserObjectCreate", 11030, cuUserObjectCreate), P("cuUserObjectRetain", 11030, cuUserObjectRetain),
  P("cuUserObjectRelease", 11030, cuUserObjectRelease),
  P("cuGraphRetainUserObject", 11030, cuGraphRetainUserObject),
  P("cuGraphReleaseUserObject", 11030, cuGraphReleaseUserObject),
  P("cuMemPoolCreate", 11020, cuMemPoolCreate), P("cuMemPoolDestroy", 11020, cuMemPoolDestroy),
  P("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute), P("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute),
  P("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo), P("cuMemPoolSetAccess", 11020, cuMemPoolSetAccess),
  P("cuMemPoolGetAccess", 11020, cuMemPoolGetAccess), P("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool),
  P("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool), P("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool),
  P("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync), P("cuMemAllocAsync", 11020, cuMemAllocAsync),
  P("cuMemFreeAsync", 11020, cuMemFreeAsync), P("cuMemGetDefaultMemPool", 13000, cuMemGetDefaultMemPool),
  P("cuMemGetMemPool", 13000, cuMemGetMemPool), P("cuMemSetMemPool", 13000, cuMemSetMemPool), P("cuPointerGetAttribute", 4000, cuPointerGetAttribute),
  P("cuPointerGetAttributes", 7000, cuPointerGetAttributes),
  P("cuGetProcAddress", 12000, NULL),  // filled in below: cuGetProcAddress_v2
};
#undef P

enum { PROC_SUCCESS = 0, PROC_SYMBOL_NOT_FOUND = 1, PROC_VERSION_NOT_SUFFICIENT = 2 };

EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, uint64_t flags, int* status) {
  (void)flags;  // per-thread-default-stream variants: the same functions
  pthread_once(&g_lock_once, init_once);
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  const proc* best = NULL;
  int known = 0;
  for (size_t i = 0; i < sizeof procs / sizeof *procs; ++i) {
    if (strcmp(procs[i].name, symbol)) continue;
    known = 1;
    if (procs[i].version <= version && (!best || procs[i].version > best->version)) best = &procs[i];
  }
  if (cfg.trace > 1 || (cfg.trace && !best)) fprintf(stderr, "pjstub: cuGetProcAddress(%s, %d) -> %s\n", symbol, version, best ? "found" : "NOT FOUND");
  if (!best) {
    *pfn = NULL;
    if (status) *status = known ? PROC_VERSION_NOT_SUFFICIENT : PROC_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
  }
  *pfn = best->fn ? best->fn : (void*)cuGetProcAddress_v2;
  if (status) *status = PROC_SUCCESS;
  return CUDA_SUCCESS;
}
