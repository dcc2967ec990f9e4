/* polyjit CPU stream runtime: each stream is an in-order task queue drained by
 * its own worker pthread.
 *
 * Why C: handing a task to a worker and waiting for it must cost about a
 * microsecond; a Python thread hand-off costs 10-50 us. Python drives this
 * through ctypes, which releases the GIL during every call, so kernels run
 * while the interpreter goes on.
 *
 * Tickets: the k-th task enqueued on a stream has ticket k (from 1); `done`
 * counts completed tasks. An event is (stream, ticket), done iff
 * done >= ticket.
 *
 * Lifetime: a stream's memory is reference counted. Destroying a stream stops and joins its
 * worker; a WAIT task that another stream holds on it keeps the memory (its final `done`
 * counter) readable until that task has run.
 *
 * Wake-ups: an idle worker spins for a short while (new work usually
 * arrives within microseconds), then parks (a futex on Linux); producers
 * wake it only when it parks. Host waits do the same on `done`, and the
 * worker wakes them only when someone parks. The flag/counter handshakes
 * use seq_cst atomics on both sides (a Dekker pattern), so a wake-up is
 * never lost: either the sleeper sees the new value, or the waker sees the
 * sleeper. Spinners yield the CPU after a few microseconds, in case the
 * thread they wait for shares their CPU.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PJ_EXPORT __attribute__((visibility("default")))

typedef void (*pj_kernel)(void* const* bufs, const int64_t* statics);
typedef struct {
    pj_kernel fn;
    void* const* bufs;
} pj_launch_desc;

#define PJ_MAX_STATICS 16
#define PJ_RING 4096 /* power of two */
#define PJ_RING_MASK (PJ_RING - 1)
#define PJ_CACHELINE 64
/* Worker stacks are large so kernel-local arrays fit; pages are committed lazily. */
#define PJ_WORKER_STACK (64u << 20)
/* Copies and fills above this size are split across the stream's OpenMP team. */
#define PJ_PARALLEL_COPY (4u << 20)

enum { PJ_LAUNCH = 1, PJ_MEMCPY, PJ_MEMSET, PJ_WAIT, PJ_STAMP, PJ_STOP };

struct pj_stream;

typedef struct {
    int kind;
    int value; /* MEMSET byte */
    union {
        struct {
            pj_kernel fn;
            void* const* bufs;
        } launch;
        struct {
            void* dst;
            const void* src;
            size_t n;
        } copy;
        struct {
            struct pj_stream* other;
            uint64_t ticket;
        } wait;
        int64_t* stamp; /* STAMP: where the worker writes the time it got there (ns) */
    } u;
    /* Copied at enqueue time: later changes by the host do not reach the kernel. */
    int64_t statics[PJ_MAX_STATICS];
} pj_task;

typedef struct pj_stream {
    /* Producer side (host threads). */
    _Alignas(PJ_CACHELINE) _Atomic uint64_t tail; /* last ticket published */
    pthread_mutex_t prod_mu;                      /* serializes producers */
    /* Consumer side (the worker). */
    _Alignas(PJ_CACHELINE) _Atomic uint64_t done; /* tasks completed */
    _Atomic uint32_t done_seq; /* bumped when done changes while someone parks on it */
    _Alignas(PJ_CACHELINE) _Atomic uint32_t sleeping; /* 1: the worker parks (or is about to) */
    _Atomic int waiters;                              /* threads parked on done_seq */
    _Atomic int refs; /* 1 for the owner until pj_stream_destroy, +1 per pending WAIT on it */
    pthread_t thread;
    int num_threads;
    _Alignas(PJ_CACHELINE) pj_task ring[PJ_RING];
} pj_stream;

/* Spin budgets (ns) before sleeping; tunable for benchmarks via pj_set_spin. */
static _Atomic int64_t g_worker_spin_ns = 100000;
static _Atomic int64_t g_wait_spin_ns = 100000;
/* Pure spinning (no sched_yield) for this long, then spinning with yields. */
static _Atomic int64_t g_worker_noyield_ns = 10000;
static _Atomic int64_t g_wait_noyield_ns = 2000;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Called every ~2 us of spinning; true once the budget is spent. Past the first
 * few microseconds it also yields the CPU: the thread we wait for may have been
 * woken onto our CPU (wake-affine scheduling), and a plain spin would keep it
 * off the CPU for the whole budget. A yield with nothing else runnable costs
 * well under a microsecond. */
static inline int spin_tick(int64_t start, int64_t budget, int64_t noyield) {
    int64_t elapsed = now_ns() - start;
    if (elapsed > budget) return 1;
    if (elapsed > noyield) sched_yield();
    return 0;
}

/* Parking: block while *word == expected, until unpark(word). Linux: a futex
 * (one syscall each side, no mutex for the woken thread to contend on).
 * Elsewhere: one process-wide mutex + condvar (spurious wake-ups only). */
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
static inline void park(_Atomic uint32_t* word, uint32_t expected) {
    syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}
static inline void unpark_all(_Atomic uint32_t* word) {
    syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}
#else
static pthread_mutex_t g_park_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_park_cv = PTHREAD_COND_INITIALIZER;
static void park(_Atomic uint32_t* word, uint32_t expected) {
    pthread_mutex_lock(&g_park_mu);
    if (atomic_load(word) == expected) pthread_cond_wait(&g_park_cv, &g_park_mu);
    pthread_mutex_unlock(&g_park_mu);
}
static void unpark_all(_Atomic uint32_t* word) {
    (void)word; /* the waker changed *word before: taking the lock orders it with park's check */
    pthread_mutex_lock(&g_park_mu);
    pthread_mutex_unlock(&g_park_mu);
    pthread_cond_broadcast(&g_park_cv);
}
#endif

/* Block until s->done >= ticket: spin, then park on done_seq. */
static void wait_done(pj_stream* s, uint64_t ticket) {
    if (atomic_load_explicit(&s->done, memory_order_acquire) >= ticket) return;
    int64_t budget = atomic_load_explicit(&g_wait_spin_ns, memory_order_relaxed);
    int64_t noyield = atomic_load_explicit(&g_wait_noyield_ns, memory_order_relaxed);
    if (budget > 0) {
        int64_t start = now_ns();
        for (unsigned i = 1;; i++) {
            cpu_relax();
            if (atomic_load_explicit(&s->done, memory_order_acquire) >= ticket) return;
            if ((i & 63) == 0 && spin_tick(start, budget, noyield)) break;
        }
    }
    /* Announce first, then read the sequence, then re-check: the worker stores done
     * before reading waiters, so it either sees us or we see its done. */
    atomic_fetch_add_explicit(&s->waiters, 1, memory_order_seq_cst);
    for (;;) {
        uint32_t seq = atomic_load_explicit(&s->done_seq, memory_order_seq_cst);
        if (atomic_load_explicit(&s->done, memory_order_seq_cst) >= ticket) break;
        park(&s->done_seq, seq);
    }
    atomic_fetch_sub_explicit(&s->waiters, 1, memory_order_seq_cst);
}

/* Worker: block until tail != head (new work published). */
static void wait_work(pj_stream* s, uint64_t head) {
    int64_t budget = atomic_load_explicit(&g_worker_spin_ns, memory_order_relaxed);
    int64_t noyield = atomic_load_explicit(&g_worker_noyield_ns, memory_order_relaxed);
    if (budget > 0) {
        int64_t start = now_ns();
        for (unsigned i = 1;; i++) {
            cpu_relax();
            if (atomic_load_explicit(&s->tail, memory_order_acquire) != head) return;
            if ((i & 63) == 0 && spin_tick(start, budget, noyield)) break;
        }
    }
    for (;;) {
        atomic_store_explicit(&s->sleeping, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&s->tail, memory_order_seq_cst) != head) break;
        park(&s->sleeping, 1); /* returns at once if a producer already cleared the flag */
        if (atomic_load_explicit(&s->tail, memory_order_acquire) != head) break;
    }
    atomic_store_explicit(&s->sleeping, 0, memory_order_relaxed);
}

static void stream_unref(pj_stream* s) {
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_destroy(&s->prod_mu);
        free(s);
    }
}

/* Copy n bytes from src to dst, or set them to value when src is NULL: in 1 MiB chunks
   shared by the OpenMP team when the range is large. */
static void parallel_bytes(void* dst, const void* src, int value, size_t n) {
    if (n < PJ_PARALLEL_COPY || omp_get_max_threads() < 2) {
        if (src) memcpy(dst, src, n); else memset(dst, value, n);
        return;
    }
    const size_t chunk = 1u << 20;
    const long nchunks = (long)((n + chunk - 1) / chunk);
#pragma omp parallel for schedule(static)
    for (long c = 0; c < nchunks; c++) {
        size_t off = (size_t)c * chunk;
        size_t len = n - off < chunk ? n - off : chunk;
        if (src) memcpy((char*)dst + off, (const char*)src + off, len);
        else memset((char*)dst + off, value, len);
    }
}

static void* worker_main(void* arg) {
    pj_stream* s = (pj_stream*)arg;
    /* OpenMP ICVs are per thread: this sets the team size of this stream's kernels. */
    if (s->num_threads > 0) omp_set_num_threads(s->num_threads);
    uint64_t head = 0;
    for (;;) {
        uint64_t tail = atomic_load_explicit(&s->tail, memory_order_acquire);
        if (tail == head) {
            wait_work(s, head);
            continue;
        }
        while (head < tail) {
            pj_task* t = &s->ring[head & PJ_RING_MASK];
            int kind = t->kind;
            switch (kind) {
                case PJ_LAUNCH:
                    t->u.launch.fn(t->u.launch.bufs, t->statics);
                    break;
                case PJ_MEMCPY:
                    parallel_bytes(t->u.copy.dst, t->u.copy.src, 0, t->u.copy.n);
                    break;
                case PJ_MEMSET:
                    parallel_bytes(t->u.copy.dst, NULL, t->value, t->u.copy.n);
                    break;
                case PJ_WAIT:
                    wait_done(t->u.wait.other, t->u.wait.ticket);
                    stream_unref(t->u.wait.other);
                    break;
                case PJ_STAMP:
                    *t->u.stamp = now_ns();
                    break;
                default:
                    break;
            }
            head++;
            /* Publishing `done` frees the slot; t must not be touched after this. */
            atomic_store_explicit(&s->done, head, memory_order_seq_cst);
            if (atomic_load_explicit(&s->waiters, memory_order_seq_cst) > 0) {
                atomic_fetch_add_explicit(&s->done_seq, 1, memory_order_seq_cst);
                unpark_all(&s->done_seq);
            }
            if (kind == PJ_STOP) return NULL;
        }
    }
}

/* With prod_mu held: the slot for the next ticket, waiting while the ring is full. */
static pj_task* reserve(pj_stream* s, uint64_t* ticket) {
    uint64_t t = atomic_load_explicit(&s->tail, memory_order_relaxed) + 1;
    if (t > PJ_RING) wait_done(s, t - PJ_RING); /* the slot's previous task must be done */
    *ticket = t;
    return &s->ring[(t - 1) & PJ_RING_MASK];
}

/* With prod_mu held: make the reserved task visible and wake the worker if it sleeps. */
static void publish(pj_stream* s, uint64_t ticket) {
    atomic_store_explicit(&s->tail, ticket, memory_order_seq_cst);
    if (atomic_load_explicit(&s->sleeping, memory_order_seq_cst) &&
        atomic_exchange_explicit(&s->sleeping, 0, memory_order_seq_cst))
        unpark_all(&s->sleeping);
}

/* Process-wide spin policy (ns); a negative value leaves that setting unchanged. */
PJ_EXPORT void pj_set_spin(int64_t worker_ns, int64_t wait_ns, int64_t worker_noyield_ns,
                           int64_t wait_noyield_ns) {
    if (worker_ns >= 0) atomic_store(&g_worker_spin_ns, worker_ns);
    if (wait_ns >= 0) atomic_store(&g_wait_spin_ns, wait_ns);
    if (worker_noyield_ns >= 0) atomic_store(&g_worker_noyield_ns, worker_noyield_ns);
    if (wait_noyield_ns >= 0) atomic_store(&g_wait_noyield_ns, wait_noyield_ns);
}

PJ_EXPORT void* pj_stream_create(int num_threads, const int* cpus, int ncpus) {
    pj_stream* s = NULL;
    if (posix_memalign((void**)&s, PJ_CACHELINE, sizeof(pj_stream)) != 0) return NULL;
    memset(s, 0, sizeof(*s));
    atomic_store(&s->refs, 1);
    s->num_threads = num_threads;
    pthread_mutex_init(&s->prod_mu, NULL);

    pthread_attr_t attr;
    int ok = pthread_attr_init(&attr) == 0;
    if (ok) pthread_attr_setstacksize(&attr, PJ_WORKER_STACK);
#ifdef __linux__
    if (ok && cpus != NULL && ncpus > 0) {
        /* Pin before the thread runs; the OpenMP threads it spawns inherit the mask. */
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int i = 0; i < ncpus; i++) {
            if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE) {
                ok = 0;
                break;
            }
            CPU_SET(cpus[i], &set);
        }
        if (ok) ok = pthread_attr_setaffinity_np(&attr, sizeof(set), &set) == 0;
    }
#else
    (void)cpus; /* no portable pinning API: the worker floats */
    (void)ncpus;
#endif
    if (ok) ok = pthread_create(&s->thread, &attr, worker_main, s) == 0;
    pthread_attr_destroy(&attr);
    if (!ok) {
        pthread_mutex_destroy(&s->prod_mu);
        free(s);
        return NULL;
    }
    return s;
}

PJ_EXPORT void pj_stream_destroy(void* sp) {
    pj_stream* s = (pj_stream*)sp;
    if (s == NULL) return;
    uint64_t ticket;
    pthread_mutex_lock(&s->prod_mu);
    pj_task* t = reserve(s, &ticket);
    t->kind = PJ_STOP;
    publish(s, ticket);
    pthread_mutex_unlock(&s->prod_mu);
    pthread_join(s->thread, NULL); /* the worker drains everything before STOP */
    stream_unref(s);
}

/* Enqueue n launches sharing one statics vector; returns the last ticket, 0 on bad input. */
PJ_EXPORT uint64_t pj_launch_seq(void* sp, const pj_launch_desc* descs, int n,
                                 const int64_t* statics, int nstatics) {
    pj_stream* s = (pj_stream*)sp;
    if (nstatics < 0 || nstatics > PJ_MAX_STATICS || n < 0) return 0;
    if (nstatics > 0 && statics == NULL) return 0;
    pthread_mutex_lock(&s->prod_mu);
    uint64_t ticket = atomic_load_explicit(&s->tail, memory_order_relaxed);
    for (int i = 0; i < n; i++) {
        pj_task* t = reserve(s, &ticket);
        t->kind = PJ_LAUNCH;
        t->u.launch.fn = descs[i].fn;
        t->u.launch.bufs = descs[i].bufs;
        if (nstatics > 0) memcpy(t->statics, statics, (size_t)nstatics * sizeof(int64_t));
        publish(s, ticket);
    }
    pthread_mutex_unlock(&s->prod_mu);
    return ticket;
}

PJ_EXPORT uint64_t pj_memcpy(void* sp, void* dst, const void* src, size_t n) {
    pj_stream* s = (pj_stream*)sp;
    uint64_t ticket;
    pthread_mutex_lock(&s->prod_mu);
    pj_task* t = reserve(s, &ticket);
    t->kind = PJ_MEMCPY;
    t->u.copy.dst = dst;
    t->u.copy.src = src;
    t->u.copy.n = n;
    publish(s, ticket);
    pthread_mutex_unlock(&s->prod_mu);
    return ticket;
}

PJ_EXPORT uint64_t pj_memset(void* sp, void* dst, int value, size_t n) {
    pj_stream* s = (pj_stream*)sp;
    uint64_t ticket;
    pthread_mutex_lock(&s->prod_mu);
    pj_task* t = reserve(s, &ticket);
    t->kind = PJ_MEMSET;
    t->value = value;
    t->u.copy.dst = dst;
    t->u.copy.src = NULL;
    t->u.copy.n = n;
    publish(s, ticket);
    pthread_mutex_unlock(&s->prod_mu);
    return ticket;
}

/* Make s wait for (other, ticket); enqueues nothing when that is already implied or done. */
PJ_EXPORT uint64_t pj_wait(void* sp, void* op, uint64_t ticket) {
    pj_stream* s = (pj_stream*)sp;
    pj_stream* other = (pj_stream*)op;
    if (other == NULL || other == s ||
        atomic_load_explicit(&other->done, memory_order_acquire) >= ticket)
        return atomic_load_explicit(&s->tail, memory_order_acquire);
    uint64_t mine;
    atomic_fetch_add_explicit(&other->refs, 1, memory_order_relaxed); /* dropped by the worker */
    pthread_mutex_lock(&s->prod_mu);
    pj_task* t = reserve(s, &mine);
    t->kind = PJ_WAIT;
    t->u.wait.other = other;
    t->u.wait.ticket = ticket;
    publish(s, mine);
    pthread_mutex_unlock(&s->prod_mu);
    return mine;
}

/* Enqueue a timestamp: the worker writes CLOCK_MONOTONIC ns to *out when it gets there. */
PJ_EXPORT uint64_t pj_stamp(void* sp, int64_t* out) {
    pj_stream* s = (pj_stream*)sp;
    uint64_t ticket;
    pthread_mutex_lock(&s->prod_mu);
    pj_task* t = reserve(s, &ticket);
    t->kind = PJ_STAMP;
    t->u.stamp = out;
    publish(s, ticket);
    pthread_mutex_unlock(&s->prod_mu);
    return ticket;
}

PJ_EXPORT uint64_t pj_last_ticket(void* sp) {
    return atomic_load_explicit(&((pj_stream*)sp)->tail, memory_order_acquire);
}

PJ_EXPORT uint64_t pj_done(void* sp) {
    return atomic_load_explicit(&((pj_stream*)sp)->done, memory_order_acquire);
}

PJ_EXPORT void pj_sync(void* sp, uint64_t ticket) { wait_done((pj_stream*)sp, ticket); }

PJ_EXPORT void* pj_alloc(size_t nbytes, size_t alignment) {
    void* p = NULL;
    if (alignment & (alignment - 1)) return NULL; /* posix_memalign needs a power of two */
    if (alignment < sizeof(void*)) alignment = sizeof(void*);
    if (posix_memalign(&p, alignment, nbytes ? nbytes : 1) != 0) return NULL;
    return p;
}

PJ_EXPORT void pj_free(void* p) { free(p); }

PJ_EXPORT void pj_host_memcpy(void* dst, const void* src, size_t n) { memcpy(dst, src, n); }
