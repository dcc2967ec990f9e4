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
 * worker wakes them only when someone parks and `done` reaches the smallest
 * ticket a parked waiter asked for (wake_at). The flag/counter handshakes
 * use seq_cst atomics on both sides (a Dekker pattern), so a wake-up is
 * never lost: either the sleeper sees the new value, or the waker sees the
 * sleeper. Spinners yield the CPU after a few microseconds, in case the
 * thread they wait for shares their CPU. A waiting host thread takes part in
 * the kernels of an unpinned stream (join_chunks), whose teams leave it a core;
 * when it has parked, the next such kernel calls it back (run_chunks), once per kernel,
 * and one such thread per kernel (they park on call_seq, woken one at a time).
 *
 * Team sizes: an OpenMP team ends in a barrier, so a kernel with a team is as slow as its
 * slowest thread. When other processes take cores, a team thread is often descheduled and
 * the others wait at the barrier for a whole time slice (milliseconds, for a kernel of tens
 * of microseconds). So the worker picks each kernel's team size by measuring it: it keeps,
 * per kernel, a running mean of its wall time at each candidate size (all threads, one
 * less, half, one), runs the fastest, and now and then re-times the others, less often the
 * more they cost (see tune_pick). Kernels that open no team (PJ_TEAM_NONE) are not timed. Alone on the machine the full team wins and stays; with
 * cores taken the kernels move to the size that still pays. Whether mid-sized kernels are
 * shared at all (PJ_TEAM_OPTIONAL) is timed over the stream as a whole (share_window).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define PJ_EXPORT __attribute__((visibility("default")))

/* A kernel computes iterations [lo, hi) of its parallel loops, flattened (a serial one, whose
 * range is [0, 1), ignores them): the runtime shares a kernel's range among the threads that
 * run it (run_chunks). */
typedef void (*pj_kernel)(void* const* bufs, const int64_t* statics, int64_t lo, int64_t hi);
/* team: PJ_TEAM_ADAPT (the worker picks the team size), PJ_TEAM_NONE (the kernel opens no
 * OpenMP team: nothing to pick, nothing to time), or a fixed team size (> 0). */
typedef struct {
    pj_kernel fn;
    void* const* bufs;
    int64_t team;
    int64_t worker_only; /* 1: runs on the stream's worker only (users' kernels: see consume) */
    int64_t chunks;      /* the kernel's range: [0, chunks); 1 (or less): one call */
} pj_launch_desc;
#define PJ_TEAM_ADAPT 0
#define PJ_TEAM_NONE (-1)
/* A kernel with a range that its threads share only while sharing pays on this stream (see
 * share_window); otherwise one call runs the whole range on the thread that runs the task. */
#define PJ_TEAM_OPTIONAL (-2)

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
    int value; /* MEMSET: the byte; MEMCPY: 1 for a streamed copy (pj_memcpy_in) */
    union {
        struct {
            pj_kernel fn;
            void* const* bufs;
            int64_t team;
            int64_t worker_only;
            int64_t chunks;
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

/* Team-size tuning (see the top of the file). */
#define PJ_MAX_TEAMS 4    /* candidate sizes: all threads, one less, half, one */
#define PJ_TUNE_SLOTS 256 /* kernels remembered per stream (power of two) */
#define PJ_TUNE_PROBE 4   /* slots looked at per lookup before one is reused */
/* Each size is first timed this many times, in turns; the first (cold: page faults, the
 * team's threads starting) is not counted. */
#define PJ_TUNE_WARM 3
/* Weights of a new time in a size's running mean: small for the size in use (one stall is
 * not a trend), large for a re-timing (the machine may have changed since the last one). */
#define PJ_WEIGHT_USE (1.0 / 16)
#define PJ_WEIGHT_RETIME 0.5
/* A slower size is re-timed after 200 * (its mean / the best mean - 1) launches, so that
 * re-timing costs about 0.5% of the kernel's time, within these bounds... */
#define PJ_RETIME_MIN 8
#define PJ_RETIME_MAX 4096
/* ... and at least once a second (ns): a size that lost under load is back soon after the
 * load goes, for a few milliseconds a second per kernel while the load lasts. */
#define PJ_RETIME_NS 1000000000

/* Sharing a mid-sized kernel (PJ_TEAM_OPTIONAL) halves its time on two cores but leaves its
 * output in two cores' caches, and the kernels after it read it back: that costs little
 * while the cores share a cache and more than it saves while they do not (a VM's two vCPUs,
 * from phase to phase: a cache line's round trip between them took 50-90 ns, then 300-350).
 * The cost lands on other kernels, so the stream times itself: its busy time per task over
 * windows of this many tasks, with those kernels shared and with them on one thread, picked
 * and re-timed as team sizes are (tune_pick), except that the slower way is re-timed at least
 * every PJ_SHARE_RETIME_MAX windows rather than every second: a window of an MLP's steps
 * lasts 140 ms, and one a second at 1.6x the time would cost 8%. */
#define PJ_SHARE_WINDOW 2048
#define PJ_SHARE_RETIME_MAX 64
static _Atomic int64_t g_share_window = PJ_SHARE_WINDOW; /* pj_set_share_window */
#define PJ_SHARE_ON 0
#define PJ_SHARE_OFF 1

typedef struct {
    pj_kernel fn;                   /* NULL: free slot */
    double mean[PJ_MAX_TEAMS];      /* running mean wall time (ns) */
    int64_t timed_at[PJ_MAX_TEAMS]; /* when each size was last timed (ns) */
    uint32_t since[PJ_MAX_TEAMS];   /* launches since each size was last timed */
    uint32_t timed[PJ_MAX_TEAMS];   /* times each size was timed (saturates) */
} pj_tune;

typedef struct pj_stream {
    /* Producer side (host threads). */
    _Alignas(PJ_CACHELINE) _Atomic uint64_t tail; /* last ticket published */
    pthread_mutex_t prod_mu;                      /* serializes producers */
    /* Consumer side (the worker). */
    _Alignas(PJ_CACHELINE) _Atomic uint64_t done; /* tasks completed */
    _Atomic uint32_t done_seq; /* bumped when done reaches wake_at while someone parks on it */
    /* What waiters that would help park on (idle_helpers): bumped with done_seq, and when a
     * kernel they could share starts, which wakes one of them (run_chunks). */
    _Atomic uint32_t call_seq;
    /* The smallest ticket a parked waiter waits for (UINT64_MAX: none asked): a task done
     * before it wakes nobody (a host waiting for a step's last task was woken, and the worker
     * paid a futex call, for every task of the step). */
    _Atomic uint64_t wake_at;
    /* 1 while a thread runs the ring's tasks: the worker, or a host thread that waits for
     * them while the machine is contended (see wait_done_host). */
    _Atomic int consuming;
    int helpable; /* 0: pinned to some cores, so only the worker (on them) runs tasks */
    _Alignas(PJ_CACHELINE) _Atomic uint32_t sleeping; /* 1: the worker parks (or is about to) */
    _Atomic int waiters;                              /* threads parked on done_seq or call_seq */
    _Atomic int idle_helpers; /* of them, those that would share the stream's kernels (on call_seq) */
    _Atomic int spinning_helpers; /* threads in wait_done that share them now */
    _Atomic int refs; /* 1 for the owner until pj_stream_destroy, +1 per pending WAIT on it */
    pthread_t thread;
    /* The candidate team sizes (fixed at creation) and the per-kernel timings (touched only
     * by the thread holding `consuming`). */
    int teams[PJ_MAX_TEAMS];
    int nteams;
    int all_threads; /* the stream's threads: large copies and fills, kernels without a range */
    _Atomic int adaptive; /* 0: always the full team (pj_stream_set_adaptive) */
    pj_tune tune[PJ_TUNE_SLOTS];
    /* Optional sharing (share_window), touched only by the thread holding `consuming` (but
     * share_pick, which pj_stream_sharing reads): the timings of PJ_SHARE_ON and
     * PJ_SHARE_OFF, the one in use, and the window being timed. */
    pj_tune share;
    _Atomic int share_pick;
    int share_retime, window_optional;
    int share_contended; /* g_contended when share's timings began */
    int64_t window_busy;
    uint64_t window_tasks;
    /* The range of the kernel running now (run_chunks), shared by the threads that run it:
     * its team, and host threads waiting for this stream (join_chunks). The fields are set
     * before `job_live` is stored (release) and change only once no helper is in. */
    _Alignas(PJ_CACHELINE) _Atomic int job_live;
    _Atomic uint32_t job_gen; /* kernels run_chunks has started: a parked helper is called back once each */
    _Atomic int job_helpers; /* host threads inside join_chunks */
    pj_kernel job_fn;
    void* const* job_bufs;
    const int64_t* job_statics;
    int64_t job_n, job_share, job_least; /* the range, a grain's share of what is left, its least */
    int64_t job_serial; /* the launch's number (g_launch_serial): see t_scratch_tag */
    _Alignas(PJ_CACHELINE) _Atomic int64_t job_next; /* the next unclaimed iteration */
    _Alignas(PJ_CACHELINE) pj_task ring[PJ_RING];
} pj_stream;

/* 1 once the process exits (pj_discard_queued): the workers drop what is still queued
 * instead of running it, so the exit's joins end after the kernels running now. */
static _Atomic int g_discard = 0;

/* Spin budgets (ns) before sleeping; tunable for benchmarks via pj_set_spin. */
static _Atomic int64_t g_worker_spin_ns = 100000;
static _Atomic int64_t g_wait_spin_ns = 100000;
/* Pure spinning (no sched_yield) for this long, then spinning with yields. */
static _Atomic int64_t g_worker_noyield_ns = 10000;
static _Atomic int64_t g_wait_noyield_ns = 2000;

/* Contention: 1 while a stream worker finds itself runnable but not running for a
 * noticeable share of the time (other processes, or our own spinners, hold the cores).
 * Then nobody spins: a spinning waiter would take the core from the very thread it waits
 * for, for a whole time slice. Alone on the machine spinning saves a wake-up per handoff. */
static _Atomic int g_contended = 0;
#define PJ_SENSE_NS 20000000 /* how often a thread reads its run delay */
/* Shares of the window spent runnable, not running, above which the machine counts as
 * contended, and below which it no longer does (pj_set_contention). */
static _Atomic double g_contended_on = 0.25;
static _Atomic double g_contended_off = 0.12;

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
static inline void unpark_one(_Atomic uint32_t* word) {
    syscall(SYS_futex, (uint32_t*)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}
/* park, for at most ns nanoseconds */
static inline void park_for(_Atomic uint32_t* word, uint32_t expected, int64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    syscall(SYS_futex, (uint32_t*)word, FUTEX_WAIT_PRIVATE, expected, &ts, NULL, 0);
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
static void unpark_one(_Atomic uint32_t* word) { unpark_all(word); } /* one condvar for all words */
static void park_for(_Atomic uint32_t* word, uint32_t expected, int64_t ns) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += (time_t)(ns / 1000000000);
    ts.tv_nsec += (long)(ns % 1000000000);
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&g_park_mu);
    if (atomic_load(word) == expected) pthread_cond_timedwait(&g_park_cv, &g_park_mu, &ts);
    pthread_mutex_unlock(&g_park_mu);
}
#endif

/* The budget to spin before parking: none while the machine is contended. */
static inline int64_t spin_budget(_Atomic int64_t* budget) {
    if (atomic_load_explicit(&g_contended, memory_order_relaxed)) return 0;
    return atomic_load_explicit(budget, memory_order_relaxed);
}

/* How an idle worker parks (pj_stream.sleeping): until woken, or, while the machine is
 * contended, for at most PJ_LAZY_NS. A worker parked the second way is not woken for new
 * work: a thread that waits for the work runs it itself, on its core, without a hand-off
 * (wait_done_host), and whoever waits without helping wakes the worker (wait_done); the
 * timeout starts work that nobody waits for. */
#define PJ_PARKED 1
#define PJ_PARKED_LAZY 2
#define PJ_LAZY_NS 2000000

static inline void wake_worker(pj_stream* s) {
    if (atomic_load_explicit(&s->sleeping, memory_order_seq_cst) &&
        atomic_exchange_explicit(&s->sleeping, 0, memory_order_seq_cst))
        unpark_all(&s->sleeping);
}

/* New work for a worker that may sleep: wake it, unless it is parked lazily while the
 * machine is contended and a waiting host thread may run the work (a helpable stream). */
static inline void offer_work(pj_stream* s) {
    if (s->helpable && atomic_load_explicit(&g_contended, memory_order_relaxed) &&
        atomic_load_explicit(&s->sleeping, memory_order_seq_cst) == PJ_PARKED_LAZY &&
        atomic_load_explicit(&s->waiters, memory_order_seq_cst) == 0) /* nobody parked on done */
        return;
    wake_worker(s);
}

/* This thread's time on a core and time runnable but waiting for one (ns; the first two
 * fields of its schedstat). 0 on success. */
static int thread_times(int64_t* on_cpu, int64_t* delay) {
#ifdef __linux__
    char path[64], buf[96];
    snprintf(path, sizeof(path), "/proc/self/task/%ld/schedstat", (long)syscall(SYS_gettid));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    unsigned long long c = 0, d = 0;
    if (sscanf(buf, "%llu %llu", &c, &d) != 2) return -1;
    *on_cpu = (int64_t)c;
    *delay = (int64_t)d;
    return 0;
#else
    (void)on_cpu;
    (void)delay;
    return -1;
#endif
}

/* Each thread that runs or waits for tasks (workers, host threads in pj_sync) senses, every
 * PJ_SENSE_NS, the share of its runnable time it spent waiting for a core, and sets
 * g_contended from it (with hysteresis). Time asleep does not count: a parked worker says
 * nothing about the machine. A window with under PJ_SENSE_MIN_NS of runnable time is
 * extended until it has enough. Reading the file costs a few microseconds per window. */
#define PJ_SENSE_MIN_NS 1000000
static __thread int64_t t_sensed_at, t_on_cpu, t_delay;
static __thread double t_share; /* a running mean of the windows' shares */
static __thread int t_sensing = 0; /* 1: the baseline above is set */

/* 1 on the thread that forked, in the child: its libgomp pool (if it ever opened a team,
 * helping) is the parent's, whose threads do not exist here, so a team opened on it would
 * wait for them forever. That thread never helps again. */
static __thread int t_no_help = 0;
static void at_fork_child(void) {
    t_no_help = 1;
    t_sensing = 0; /* the baseline is the parent thread's counters */
    t_share = 0.0;
}
__attribute__((constructor)) static void pj_runtime_init(void) { pthread_atfork(NULL, NULL, at_fork_child); }

static void sense_contention(void) {
    int64_t now = now_ns();
    if (now - t_sensed_at < PJ_SENSE_NS) return;
    int64_t on_cpu, delay;
    if (thread_times(&on_cpu, &delay) != 0) { /* no schedstat here, or out of fds: later */
        t_sensing = 0;
        t_sensed_at = now;
        return;
    }
    if (!t_sensing) {
        t_sensing = 1;
    } else {
        int64_t ran = on_cpu - t_on_cpu, waited = delay - t_delay;
        if (ran + waited < PJ_SENSE_MIN_NS) return;
        /* One window is noisy (a time slice lost to our own threads reads as 60%): average. */
        double share = t_share = 0.5 * t_share + 0.5 * (double)waited / (double)(ran + waited);
        if (share > atomic_load_explicit(&g_contended_on, memory_order_relaxed))
            atomic_store_explicit(&g_contended, 1, memory_order_relaxed);
        else if (share < atomic_load_explicit(&g_contended_off, memory_order_relaxed))
            atomic_store_explicit(&g_contended, 0, memory_order_relaxed);
    }
    t_sensed_at = now;
    t_on_cpu = on_cpu;
    t_delay = delay;
}

/* What this thread's scratch memory holds (pj_scratch_tag), so that a matmul's grains reuse
 * the panel an earlier grain of the same launch packed there instead of packing it again for
 * every grain (the MLP's x @ w1 on two cores: 12 packings of a 200 KiB panel where 4 do):
 * [0] the launch whose grains this thread runs now (0 outside work_chunks: no reuse),
 * [1] the launch that packed what the scratch holds (0: nothing known), [2] which panel of it
 * (the kernel's own key), [3] its size (a second packing site of another shape in one kernel
 * would not match). Launch numbers come from one counter and never repeat. */
static __thread int64_t t_scratch_tag[4];
static _Atomic int64_t g_launch_serial = 0;

/* Claim iterations of the running kernel's range, a grain at a time, and run them; returns
 * whether this thread ran any. A grain is a share of what is left (job_share: a quarter of
 * it on two threads, a helper counted), at least job_least: grains shrink as the range runs
 * out, so the thread that ends last waits on a short grain, not on a fixed one of an eighth
 * of the range (the MLP's step on the 2-vCPU EPYC VM, whose vCPUs run at different speeds
 * from moment to moment: 1-8% faster than fixed grains of n / 8, medians of six A/B runs). */
static int work_chunks(pj_stream* s) {
    const pj_kernel fn = s->job_fn;
    void* const* bufs = s->job_bufs;
    const int64_t* statics = s->job_statics;
    const int64_t n = s->job_n, share = s->job_share, least = s->job_least;
    t_scratch_tag[0] = s->job_serial;
    for (int ran = 0;; ran = 1) {
        int64_t lo = atomic_load_explicit(&s->job_next, memory_order_relaxed), hi;
        do {
            if (lo >= n) {
                t_scratch_tag[0] = 0;
                return ran;
            }
            const int64_t grain = (n - lo) / share > least ? (n - lo) / share : least;
            hi = grain < n - lo ? lo + grain : n;
        } while (!atomic_compare_exchange_weak_explicit(&s->job_next, &lo, hi, memory_order_relaxed,
                                                        memory_order_relaxed));
        fn(bufs, statics, lo, hi);
    }
}

/* A thread waiting for the stream runs part of the kernel running on it, if any: on a
 * machine of few cores the waiting host thread is the core a team would need. The count
 * goes up before `job_live` is read, so the owner, which clears `job_live` and then waits
 * for the count to drop, never returns while a helper still reads the job or writes its
 * output. */
static int join_chunks(pj_stream* s) {
    atomic_fetch_add_explicit(&s->job_helpers, 1, memory_order_seq_cst);
    const int ran = atomic_load_explicit(&s->job_live, memory_order_seq_cst) && work_chunks(s);
    atomic_fetch_sub_explicit(&s->job_helpers, 1, memory_order_seq_cst);
    return ran;
}

/* Run a kernel's range [0, chunks) on `team` OpenMP threads (this one among them), in
 * grains claimed one at a time, so that a thread that was descheduled or started late
 * takes less, and waiting host threads take part (join_chunks). */
static void run_chunks(pj_stream* s, const pj_task* t, int team) {
    const int64_t n = t->u.launch.chunks;
    const int64_t threads = (int64_t)team + 1; /* a helper counted */
    s->job_fn = t->u.launch.fn;
    s->job_bufs = t->u.launch.bufs;
    s->job_statics = t->statics;
    s->job_n = n;
    s->job_share = 2 * threads;
    s->job_least = n / (16 * threads) > 1 ? n / (16 * threads) : 1; /* a sixteenth of a thread's share */
    s->job_serial = atomic_fetch_add_explicit(&g_launch_serial, 1, memory_order_relaxed) + 1;
    atomic_store_explicit(&s->job_next, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->job_gen, 1, memory_order_seq_cst);
    atomic_store_explicit(&s->job_live, 1, memory_order_seq_cst);
    /* a host thread that would share it, parked in wait_done: call one back (a core is left
     * for it), unless another one is at hand */
    if (team < s->all_threads && atomic_load_explicit(&s->idle_helpers, memory_order_seq_cst) > 0 &&
        atomic_load_explicit(&s->spinning_helpers, memory_order_seq_cst) == 0) {
        atomic_fetch_add_explicit(&s->call_seq, 1, memory_order_seq_cst);
        unpark_one(&s->call_seq);
    }
    if (team > 1) {
#pragma omp parallel num_threads(team)
        work_chunks(s);
    } else {
        work_chunks(s);
    }
    atomic_store_explicit(&s->job_live, 0, memory_order_seq_cst);
    while (atomic_load_explicit(&s->job_helpers, memory_order_seq_cst) > 0) cpu_relax();
}

#define PJ_SPIN_CAP 10
/* Spin until s->done >= ticket (returns 1), running chunks of the stream's kernel when
 * `may_join` (noting in *joined the kernel it last ran a grain of), or until it is time to
 * park (returns 0). */
static int spin_done(pj_stream* s, uint64_t ticket, int may_join, int64_t budget, uint32_t* joined) {
    const int64_t noyield = atomic_load_explicit(&g_wait_noyield_ns, memory_order_relaxed);
    /* The budget runs from the stream's last progress (a task done, or a grain run here),
     * and a wait spins PJ_SPIN_CAP budgets at most since this thread last ran a grain: a long
     * queue of short tasks does not keep a core busy for the whole wait, and a long queue of
     * kernels it can share keeps its help. */
    int64_t start = now_ns();
    int64_t give_up = start + PJ_SPIN_CAP * budget;
    uint64_t seen = atomic_load_explicit(&s->done, memory_order_relaxed);
    for (unsigned i = 1;; i++) {
        cpu_relax();
        const uint64_t done = atomic_load_explicit(&s->done, memory_order_acquire);
        if (done >= ticket) return 1;
        /* the generation read first: a kernel that starts meanwhile is at worst called back */
        const uint32_t gen = atomic_load_explicit(&s->job_gen, memory_order_acquire);
        if (may_join && atomic_load_explicit(&s->job_live, memory_order_relaxed) && join_chunks(s)) {
            *joined = gen;
            start = now_ns();
            give_up = start + PJ_SPIN_CAP * budget;
            continue;
        }
        if ((i & 63) == 0) {
            if (done != seen) {
                seen = done;
                start = now_ns();
            }
            if (spin_tick(start, budget, noyield) || atomic_load_explicit(&g_contended, memory_order_relaxed) ||
                now_ns() > give_up)
                return 0;
        }
    }
}

/* Block until s->done >= ticket: spin (running chunks of the stream's kernel when it may),
 * then park on done_seq. A thread that would help parks on call_seq instead, and one such
 * thread is called back when a kernel it can share starts (run_chunks): the stream's teams
 * leave it a core, so while it sleeps they run on one core fewer than the machine has (a
 * queue of MLP steps: 1.5x slower), and a second one would have no core to run on. */
static void wait_done(pj_stream* s, uint64_t ticket) {
    if (atomic_load_explicit(&s->done, memory_order_acquire) >= ticket) return;
    wake_worker(s); /* a lazily parked worker: the work is wanted now */
    const int may_join = s->helpable && !t_no_help;
    /* The kernel this thread last spun beside (the one running as it came, the last it ran a
     * grain of, or the last it was called back for). Once it has found no grain left in it
     * (its team holds the rest: the kernel's tail), it parks until the next kernel or its
     * ticket, instead of coming back to spin through the tail. */
    uint32_t called_for = atomic_load_explicit(&s->job_gen, memory_order_seq_cst);
    for (;;) {
        const int64_t budget = spin_budget(&g_wait_spin_ns);
        if (budget > 0) {
            if (may_join) atomic_fetch_add_explicit(&s->spinning_helpers, 1, memory_order_seq_cst);
            const int done = spin_done(s, ticket, may_join, budget, &called_for);
            if (may_join) atomic_fetch_sub_explicit(&s->spinning_helpers, 1, memory_order_seq_cst);
            if (done) return;
        }
        const int helper = may_join && budget > 0; /* not while the machine is contended */
        /* Announce first, then read the sequence, then re-check: the worker stores done
         * (and job_live) before reading waiters (and idle_helpers), so it either sees us or
         * we see its store. */
        atomic_fetch_add_explicit(&s->waiters, 1, memory_order_seq_cst);
        if (helper) atomic_fetch_add_explicit(&s->idle_helpers, 1, memory_order_seq_cst);
        /* a helper that gave the role back before it could see us left the worker parked */
        if (!atomic_load_explicit(&s->consuming, memory_order_seq_cst)) wake_worker(s);
        int called = 0;
        _Atomic uint32_t* const word = helper ? &s->call_seq : &s->done_seq;
        for (;;) {
            uint32_t seq = atomic_load_explicit(word, memory_order_seq_cst);
            /* Ask for ticket after reading the sequence: a reset of wake_at that drops this
             * request bumps the sequence after it, so the park below returns and asks again. */
            uint64_t asked = atomic_load_explicit(&s->wake_at, memory_order_seq_cst);
            while (ticket < asked && !atomic_compare_exchange_weak_explicit(&s->wake_at, &asked, ticket,
                                                                            memory_order_seq_cst, memory_order_seq_cst)) {
            }
            if (atomic_load_explicit(&s->done, memory_order_seq_cst) >= ticket) break;
            if (helper && atomic_load_explicit(&s->job_live, memory_order_seq_cst)) {
                const uint32_t gen = atomic_load_explicit(&s->job_gen, memory_order_seq_cst);
                if (gen != called_for) {
                    called_for = gen;
                    called = 1;
                    break;
                }
            }
            park(word, seq);
        }
        if (helper) atomic_fetch_sub_explicit(&s->idle_helpers, 1, memory_order_seq_cst);
        atomic_fetch_sub_explicit(&s->waiters, 1, memory_order_seq_cst);
        if (!called) return;
    }
}

/* Work for the worker: tasks not done, and no host thread running them. */
static inline int has_work(pj_stream* s) {
    return atomic_load_explicit(&s->tail, memory_order_seq_cst) !=
               atomic_load_explicit(&s->done, memory_order_seq_cst) &&
           !atomic_load_explicit(&s->consuming, memory_order_seq_cst);
}

/* Worker: block until has_work. Wakers: publish (new work), and a helping host thread that
 * leaves work behind (release_role). */
static void wait_work(pj_stream* s) {
    int64_t budget = spin_budget(&g_worker_spin_ns);
    int64_t noyield = atomic_load_explicit(&g_worker_noyield_ns, memory_order_relaxed);
    if (budget > 0) {
        int64_t start = now_ns();
        for (unsigned i = 1;; i++) {
            cpu_relax();
            if (has_work(s)) return;
            if ((i & 63) == 0 && spin_tick(start, budget, noyield)) break;
        }
    }
    for (;;) {
        const int lazy = s->helpable && atomic_load_explicit(&g_contended, memory_order_relaxed);
        const uint32_t how = lazy ? PJ_PARKED_LAZY : PJ_PARKED;
        atomic_store_explicit(&s->sleeping, how, memory_order_seq_cst);
        if (has_work(s)) break;
        /* returns at once if a waker already cleared the flag */
        if (lazy) park_for(&s->sleeping, how, PJ_LAZY_NS);
        else park(&s->sleeping, how);
        if (has_work(s)) break;
    }
    atomic_store_explicit(&s->sleeping, 0, memory_order_relaxed);
}


static inline int take_role(pj_stream* s) {
    int free_ = 0;
    return atomic_compare_exchange_strong_explicit(&s->consuming, &free_, 1, memory_order_seq_cst,
                                                   memory_order_relaxed);
}

/* Give the role back; work left behind goes to the worker. */
static void release_role(pj_stream* s) {
    atomic_store_explicit(&s->consuming, 0, memory_order_seq_cst);
    if (atomic_load_explicit(&s->tail, memory_order_seq_cst) !=
        atomic_load_explicit(&s->done, memory_order_seq_cst))
        offer_work(s);
}

static void stream_unref(pj_stream* s) {
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_destroy(&s->prod_mu);
        free(s);
    }
}

/* Host-to-device copies of this many bytes store around the caches (put_bytes). */
#define PJ_STREAM_MIN_BYTES (256u << 10)
#define PJ_STREAM_MAX_BYTES (1536u << 10)

/* Copy n bytes from src to dst, or set them to value when src is NULL; a `streamed` copy (a
 * host-to-device copy: pj_memcpy_in) of PJ_STREAM_MIN_BYTES to PJ_STREAM_MAX_BYTES with
 * non-temporal stores. A plain store first fetches the line it writes, and a line that
 * another core holds (the last step's kernels read a plan's input buffer on both cores)
 * comes from that core, one at a time: on the 2-vCPU EPYC VM the MLP's 800 KB input copy
 * took 66 us a step that way (70-350 us alone, with both cores having read the
 * destination), 31-43 us streamed. A plan's run of x * 2 on 256 KiB to 1.5 MiB inputs took
 * 0.72-0.87 of its plain time streamed, in every run; from 1.75 MiB on, streamed copies were
 * slower in some runs (the memory's write bandwidth, 1.09-1.41x) and faster in others
 * (docs/benchmarks.md, session 14). Other copies keep plain stores: into a destination this
 * core holds (a result copied into the same host array run after run), streaming loses. */
static void put_bytes(void* dst, const void* src, int value, size_t n, int streamed) {
#if defined(__SSE2__)
    if (streamed && src && n >= PJ_STREAM_MIN_BYTES && n <= PJ_STREAM_MAX_BYTES) {
        char* d = (char*)dst;
        const char* s = (const char*)src;
        const size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* to 16-byte alignment, as movntdq needs */
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        const size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            for (size_t k = 0; k < 64; k += 16)
                _mm_stream_si128((__m128i*)(d + i + k), _mm_loadu_si128((const __m128i*)(s + i + k)));
        }
        _mm_sfence(); /* the streamed stores are visible before the task is marked done */
        memcpy(d + body, s + body, n - body);
        return;
    }
#else
    (void)streamed;
#endif
    if (src) memcpy(dst, src, n); else memset(dst, value, n);
}

/* Copy n bytes from src to dst, or set them to value when src is NULL: in 1 MiB chunks
   shared by the OpenMP team when the range is large. */
static void parallel_bytes(void* dst, const void* src, int value, size_t n, int streamed) {
    streamed = streamed && n <= PJ_STREAM_MAX_BYTES; /* by the whole copy's size, not a chunk's */
    if (n < PJ_PARALLEL_COPY || omp_get_max_threads() < 2) {
        put_bytes(dst, src, value, n, streamed);
        return;
    }
    const size_t chunk = 1u << 20;
    const long nchunks = (long)((n + chunk - 1) / chunk);
#pragma omp parallel for schedule(static)
    for (long c = 0; c < nchunks; c++) {
        size_t off = (size_t)c * chunk;
        size_t len = n - off < chunk ? n - off : chunk;
        put_bytes((char*)dst + off, src ? (const char*)src + off : NULL, value, len, streamed);
    }
}

/* The candidate team sizes of a team of n: n, n - 1, n / 2, 1 (distinct, largest first). */
static void init_teams(pj_stream* s, int n) {
    int cand[PJ_MAX_TEAMS] = {n, n - 1, n / 2, 1};
    s->nteams = 0;
    for (int i = 0; i < PJ_MAX_TEAMS; i++) {
        int dup = cand[i] < 1;
        for (int j = 0; j < s->nteams && !dup; j++) dup = s->teams[j] == cand[i];
        if (!dup) s->teams[s->nteams++] = cand[i];
    }
}

/* The kernel's timings; a slot of another kernel is reused when the probe finds no free one. */
static pj_tune* tune_slot(pj_stream* s, pj_kernel fn) {
    uintptr_t h = ((uintptr_t)fn >> 4) * (uintptr_t)0x9E3779B97F4A7C15ull;
    unsigned base = (unsigned)(h >> 32);
    pj_tune* e = NULL;
    for (unsigned i = 0; i < PJ_TUNE_PROBE; i++) {
        pj_tune* c = &s->tune[(base + i) & (PJ_TUNE_SLOTS - 1)];
        if (c->fn == fn) return c;
        if (c->fn == NULL) {
            e = c;
            break;
        }
    }
    if (e == NULL) e = &s->tune[base & (PJ_TUNE_SLOTS - 1)];
    memset(e, 0, sizeof(*e));
    e->fn = fn;
    return e;
}

/* Which of the ncand candidates runs next: while warming up, the one timed least (the first
 * first); then a slower one due for a re-timing (after 200 * (its mean / the best - 1) runs,
 * within PJ_RETIME_MIN and retime_max, or retime_ns after its last), else the fastest.
 * *retime: the pick is not the fastest. */
static int tune_pick(const pj_tune* e, int ncand, int64_t now, int64_t retime_ns, double retime_max,
                     int* retime) {
    int least = 0, best = 0;
    for (int k = 1; k < ncand; k++) {
        if (e->timed[k] < e->timed[least]) least = k;
        if (e->mean[k] < e->mean[best]) best = k;
    }
    *retime = 0;
    if (e->timed[least] < PJ_TUNE_WARM) return least;
    double floor = e->mean[best] > 1.0 ? e->mean[best] : 1.0;
    for (int k = 0; k < ncand; k++) {
        if (k == best) continue;
        double every = 200.0 * (e->mean[k] / floor - 1.0);
        if (every < PJ_RETIME_MIN) every = PJ_RETIME_MIN;
        if (every > retime_max) every = retime_max;
        if (e->since[k] >= (uint32_t)every || now - e->timed_at[k] > retime_ns) {
            *retime = 1;
            return k;
        }
    }
    return best;
}

static void tune_record(pj_tune* e, int ncand, int k, int64_t t1, double dt, int retime) {
    for (int j = 0; j < ncand; j++) e->since[j]++;
    e->since[k] = 0;
    e->timed_at[k] = t1;
    uint32_t n = e->timed[k]++;
    if (n == UINT32_MAX) e->timed[k] = n; /* saturate */
    if (n == 0) return;                   /* the cold run */
    if (n < PJ_TUNE_WARM) e->mean[k] += (dt - e->mean[k]) / n; /* the mean of the warm runs */
    else e->mean[k] += (retime ? PJ_WEIGHT_RETIME : PJ_WEIGHT_USE) * (dt - e->mean[k]);
}

/* The kernel on a team of `team` threads: its range shared (run_chunks), or one call. A
 * kernel without a range that opens its own OpenMP team (a user's kernel, a long reduction)
 * cannot take in the waiting host thread: a team size the stream picked (`picked`) gets the
 * host's core back for it. */
static void call_kernel(pj_stream* s, const pj_task* t, int team, int picked) {
    if (t->u.launch.chunks > 1) {
        run_chunks(s, t, team);
    } else {
        omp_set_num_threads(picked && s->helpable && s->all_threads > 1 ? team + 1 : team);
        t->u.launch.fn(t->u.launch.bufs, t->statics, 0, 1);
    }
}

/* A stream of one pinned thread has nobody to share a kernel's range with. */
static inline int can_share(const pj_stream* s) { return s->helpable || s->all_threads > 1; }

/* Whether the stream's optional kernels run shared now: always without the tuner, else as
 * the tuner picked (share_window). */
static inline int sharing_now(const pj_stream* s) {
    return can_share(s) && (!atomic_load_explicit(&s->adaptive, memory_order_relaxed) ||
                            atomic_load_explicit(&s->share_pick, memory_order_relaxed) == PJ_SHARE_ON);
}

static void run_launch(pj_stream* s, const pj_task* t) {
    pj_kernel fn = t->u.launch.fn;
    int64_t team = t->u.launch.team;
    if (team == PJ_TEAM_OPTIONAL) {
        if (can_share(s) && atomic_load_explicit(&s->adaptive, memory_order_relaxed)) s->window_optional = 1;
        if (!sharing_now(s)) {
            fn(t->u.launch.bufs, t->statics, 0, t->u.launch.chunks);
            return;
        }
        team = PJ_TEAM_ADAPT;
    }
    if (team != PJ_TEAM_ADAPT || s->nteams < 2 ||
        !atomic_load_explicit(&s->adaptive, memory_order_relaxed)) {
        call_kernel(s, t, team > 0 ? (int)team : team == PJ_TEAM_ADAPT ? s->teams[0] : 1, team == PJ_TEAM_ADAPT);
        return;
    }
    pj_tune* e = tune_slot(s, fn);
    int64_t t0 = now_ns();
    int retime;
    int k = tune_pick(e, s->nteams, t0, PJ_RETIME_NS, PJ_RETIME_MAX, &retime);
    call_kernel(s, t, s->teams[k], 1);
    int64_t t1 = now_ns();
    tune_record(e, s->nteams, k, t1, (double)(t1 - t0), retime);
}

/* The account of a task run (with the role held): it took `busy` ns, up to `now`. A window
 * that ran optional kernels with the tuner on is a timing of the sharing in use; the next
 * is picked. (Per task, not per run of tasks: a worker that the host keeps fed runs one
 * for as long as the host runs.) */
static void share_window(pj_stream* s, int64_t busy, int64_t now) {
    s->window_busy += busy;
    s->window_tasks += 1;
    if (s->window_tasks < (uint64_t)atomic_load_explicit(&g_share_window, memory_order_relaxed)) return;
    const int contended = atomic_load_explicit(&g_contended, memory_order_relaxed);
    const int pick = atomic_load_explicit(&s->share_pick, memory_order_relaxed);
    if (contended != s->share_contended) {
        /* Other processes took cores or gave them back: what the way not in use cost before
         * says little now (a benchmark's turns alone came after turns beside busy processes
         * and kept their choice for a second), so it is re-timed next. Not both from
         * scratch: sharing itself moves the sensed contention, and a reset at every change
         * kept the tuner warming up, sharing, on a loaded machine. This window, which
         * straddles the change, times nothing. */
        s->share_contended = contended;
        if (s->share.timed[1 - pick] >= PJ_TUNE_WARM) s->share.since[1 - pick] = 1u << 30;
    } else if (s->window_optional) {
        tune_record(&s->share, 2, pick, now, (double)s->window_busy / (double)s->window_tasks, s->share_retime);
    }
    if (s->window_optional)
        atomic_store_explicit(&s->share_pick,
                              tune_pick(&s->share, 2, now, INT64_MAX, PJ_SHARE_RETIME_MAX, &s->share_retime),
                              memory_order_relaxed);
    s->window_busy = 0;
    s->window_tasks = 0;
    s->window_optional = 0;
}

/* With the role held: run the tasks after `done`, in order, up to ticket `until` (or until
 * the ring is empty); a helper (a host thread) stops before a STOP. Returns 1 after a STOP. */
static int consume(pj_stream* s, uint64_t until, int helper) {
    uint64_t head = atomic_load_explicit(&s->done, memory_order_relaxed);
    int64_t mark = now_ns();
    for (;;) {
        uint64_t tail = atomic_load_explicit(&s->tail, memory_order_acquire);
        if (head >= tail || head >= until) return 0;
        pj_task* t = &s->ring[head & PJ_RING_MASK];
        int kind = t->kind;
        /* A helper leaves the STOP, and kernels that need the worker's large stack, to the
         * worker (release_role wakes it). */
        if (helper && (kind == PJ_STOP || (kind == PJ_LAUNCH && t->u.launch.worker_only))) return 0;
        if (atomic_load_explicit(&g_discard, memory_order_relaxed) && kind != PJ_STOP) {
            if (kind == PJ_WAIT) stream_unref(t->u.wait.other); /* its reference, not its wait */
            kind = 0;                                              /* dropped: the process exits */
        }
        switch (kind) {
            case PJ_LAUNCH:
                run_launch(s, t);
                break;
            case PJ_MEMCPY:
                omp_set_num_threads(s->all_threads);
                parallel_bytes(t->u.copy.dst, t->u.copy.src, 0, t->u.copy.n, t->value);
                break;
            case PJ_MEMSET:
                omp_set_num_threads(s->all_threads);
                parallel_bytes(t->u.copy.dst, NULL, t->value, t->u.copy.n, 0);
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
        /* before `done`: a thread that saw the task done sees the window it closed */
        const int64_t now = now_ns();
        share_window(s, now - mark, now);
        mark = now;
        head++;
        /* Publishing `done` frees the slot; t must not be touched after this. */
        atomic_store_explicit(&s->done, head, memory_order_seq_cst);
        if (atomic_load_explicit(&s->waiters, memory_order_seq_cst) > 0 &&
            head >= atomic_load_explicit(&s->wake_at, memory_order_seq_cst)) {
            /* every waiter wakes, and those still short of their ticket ask again */
            atomic_store_explicit(&s->wake_at, UINT64_MAX, memory_order_seq_cst);
            atomic_fetch_add_explicit(&s->done_seq, 1, memory_order_seq_cst);
            unpark_all(&s->done_seq);
            if (atomic_load_explicit(&s->idle_helpers, memory_order_seq_cst) > 0) {
                atomic_fetch_add_explicit(&s->call_seq, 1, memory_order_seq_cst);
                unpark_all(&s->call_seq);
            }
        }
        if (kind == PJ_STOP) return 1;
    }
}

static void* worker_main(void* arg) {
    pj_stream* s = (pj_stream*)arg;
    /* OpenMP ICVs are per thread: this sets the team size of this stream's kernels. */
    omp_set_num_threads(s->teams[0]);
    for (;;) {
        sense_contention();
        if (!has_work(s) || !take_role(s)) {
            wait_work(s);
            continue;
        }
        int stopped = consume(s, UINT64_MAX, 0);
        release_role(s);
        if (stopped) return NULL;
    }
}

/* A host thread's wait for ticket. While the machine is contended, the waiting thread runs
 * the stream's tasks itself when the worker is not at them (the worker would need a core
 * and a wake-up, each handoff a scheduler round trip on a busy machine: what a step of
 * many small kernels pays most). Alone on the machine the worker, spinning, is faster. */
static void wait_done_host(pj_stream* s, uint64_t ticket) {
    if (atomic_load_explicit(&s->done, memory_order_acquire) >= ticket) return;
    sense_contention();
    if (!t_no_help && s->helpable && atomic_load_explicit(&g_contended, memory_order_relaxed) &&
        take_role(s)) {
        int saved = omp_get_max_threads(); /* the team ICV of this (the user's) thread */
        consume(s, ticket, 1);
        omp_set_num_threads(saved);
        release_role(s);
    }
    wait_done(s, ticket);
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
    /* While a thread holds the role it sees the new tail itself; a helper that leaves work
     * behind wakes the worker (release_role stores `consuming` before it reads `tail`). */
    if (!atomic_load_explicit(&s->consuming, memory_order_seq_cst)) offer_work(s);
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
    atomic_store(&s->adaptive, 1);
    atomic_store(&s->wake_at, UINT64_MAX);
#ifdef __linux__
    s->helpable = cpus == NULL || ncpus <= 0;
#else
    s->helpable = 1; /* no portable pinning API: the worker floats */
#endif
    /* Here, not in the worker: a helping host thread may run the stream's first task. The
     * host thread that waits for a helpable stream takes part in its kernels (join_chunks),
     * so their teams leave it a core (else the tuner's full team would be one thread too
     * many, and three threads on two cores are a preempted team); copies take them all. */
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    s->all_threads = threads;
    init_teams(s, s->helpable && threads > 1 ? threads - 1 : threads);
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
    (void)cpus;
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

/* The share tuner's window in tasks (share_window; <= 0: unchanged), process-wide: for tests,
 * whose kernels are slower than a model's. */
PJ_EXPORT void pj_set_share_window(int64_t tasks) {
    if (tasks > 0) atomic_store(&g_share_window, tasks);
}

/* 1 while the stream workers find the machine contended (nobody spins then). */
PJ_EXPORT int pj_contended(void) { return atomic_load(&g_contended); }

/* The thresholds of g_contended (shares of runnable time spent waiting for a core); on > 1
 * means never contended (spinning always), on < 0 always (host threads help): for
 * benchmarks that compare, and tests of both paths. */
PJ_EXPORT void pj_set_contention(double on, double off) {
    atomic_store(&g_contended_on, on);
    atomic_store(&g_contended_off, off);
    /* Forced modes take effect now; back to sensing, start from uncontended (an idle
     * process senses nothing until it runs again). */
    atomic_store(&g_contended, on < 0.0 ? 1 : 0);
}

/* Whether the stream picks team sizes, and whether it shares optional kernels, by measurement
 * (1, the default), or always runs the full team and shares them (0: for benchmarks that
 * compare the two, and tests). */
PJ_EXPORT void pj_stream_set_adaptive(void* sp, int on) {
    atomic_store(&((pj_stream*)sp)->adaptive, on != 0);
}

/* 1 while the stream shares its optional kernels (PJ_TEAM_OPTIONAL), 0 while one thread runs
 * each (share_window). */
PJ_EXPORT int pj_stream_sharing(void* sp) { return sharing_now((const pj_stream*)sp); }

/* The team size the tuner runs the kernel fn with now on this stream (0: still warming up).
 * Reads worker-only state without a lock: call it while the stream is idle. */
PJ_EXPORT int pj_stream_team(void* sp, void* fn) {
    pj_stream* s = (pj_stream*)sp;
    for (unsigned i = 0; i < PJ_TUNE_SLOTS; i++) {
        const pj_tune* e = &s->tune[i];
        if (e->fn != (pj_kernel)fn) continue;
        int best = 0;
        for (int k = 0; k < s->nteams; k++) {
            if (e->timed[k] < PJ_TUNE_WARM) return 0;
            if (e->mean[k] < e->mean[best]) best = k;
        }
        return s->teams[best];
    }
    return 0;
}

/* At exit: every stream's tasks not yet begun are dropped (each still counts as done). */
PJ_EXPORT void pj_discard_queued(void) { atomic_store(&g_discard, 1); }

PJ_EXPORT void pj_stream_destroy(void* sp) {
    pj_stream* s = (pj_stream*)sp;
    if (s == NULL) return;
    uint64_t ticket;
    pthread_mutex_lock(&s->prod_mu);
    pj_task* t = reserve(s, &ticket);
    t->kind = PJ_STOP;
    publish(s, ticket);
    pthread_mutex_unlock(&s->prod_mu);
    wake_worker(s); /* even a lazily parked worker: it must stop now */
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
        t->u.launch.team = descs[i].team;
        t->u.launch.worker_only = descs[i].worker_only;
        t->u.launch.chunks = descs[i].chunks;
        if (nstatics > 0) memcpy(t->statics, statics, (size_t)nstatics * sizeof(int64_t));
        publish(s, ticket);
    }
    pthread_mutex_unlock(&s->prod_mu);
    return ticket;
}

/* A MEMCPY (value: 1 for a streamed copy) or a MEMSET (src NULL, value: the byte). */
static uint64_t enqueue_bytes(pj_stream* s, int kind, void* dst, const void* src, size_t n, int value) {
    uint64_t ticket;
    pthread_mutex_lock(&s->prod_mu);
    pj_task* t = reserve(s, &ticket);
    t->kind = kind;
    t->value = value;
    t->u.copy.dst = dst;
    t->u.copy.src = src;
    t->u.copy.n = n;
    publish(s, ticket);
    pthread_mutex_unlock(&s->prod_mu);
    return ticket;
}

PJ_EXPORT uint64_t pj_memcpy(void* sp, void* dst, const void* src, size_t n) {
    return enqueue_bytes((pj_stream*)sp, PJ_MEMCPY, dst, src, n, 0);
}

/* A copy into a buffer that the stream's kernels read next (a host-to-device copy): from
 * PJ_STREAM_MIN_BYTES to PJ_STREAM_MAX_BYTES, it stores around the caches (put_bytes). */
PJ_EXPORT uint64_t pj_memcpy_in(void* sp, void* dst, const void* src, size_t n) {
    return enqueue_bytes((pj_stream*)sp, PJ_MEMCPY, dst, src, n, 1);
}

PJ_EXPORT uint64_t pj_memset(void* sp, void* dst, int value, size_t n) {
    return enqueue_bytes((pj_stream*)sp, PJ_MEMSET, dst, NULL, n, value);
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
    pj_stream* s = (pj_stream*)sp;
    const uint64_t done = atomic_load_explicit(&s->done, memory_order_acquire);
    if (done != atomic_load_explicit(&s->tail, memory_order_relaxed)) wake_worker(s); /* polled: wanted */
    return done;
}

PJ_EXPORT void pj_sync(void* sp, uint64_t ticket) { wait_done_host((pj_stream*)sp, ticket); }

PJ_EXPORT void* pj_alloc(size_t nbytes, size_t alignment) {
    void* p = NULL;
    if (alignment & (alignment - 1)) return NULL; /* posix_memalign needs a power of two */
    if (alignment < sizeof(void*)) alignment = sizeof(void*);
    if (posix_memalign(&p, alignment, nbytes ? nbytes : 1) != 0) return NULL;
    return p;
}

PJ_EXPORT void pj_free(void* p) { free(p); }

/* Kernels' scratch memory (a matmul's packed panel, up to a few hundred KiB): one block per
 * thread, grown as needed and freed when the thread exits. On the heap, not the stack: a
 * kernel's range may run on any thread (a host thread that helps, an OpenMP team thread),
 * and their stacks may be small. NULL when the memory is not there; the kernel then works
 * without it. Kernel modules reach this through their `pj_scratch_fn` (set by the driver). */
#define PJ_SCRATCH_HEAD 64 /* the block's capacity, kept in front of its aligned bytes */
static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;
static int g_scratch_ok = 0;
static void scratch_init(void) { g_scratch_ok = pthread_key_create(&g_scratch_key, free) == 0; }

PJ_EXPORT void* pj_scratch(size_t nbytes) {
    pthread_once(&g_scratch_once, scratch_init);
    if (!g_scratch_ok || nbytes > ((size_t)1 << 40)) return NULL;
    char* block = pthread_getspecific(g_scratch_key);
    if (block == NULL || *(size_t*)block < nbytes) {
        const size_t cap = (nbytes + 63) & ~(size_t)63;
        void* grown = NULL;
        if (posix_memalign(&grown, 64, PJ_SCRATCH_HEAD + cap) != 0) return NULL;
        if (pthread_setspecific(g_scratch_key, grown) != 0) {
            free(grown);
            return NULL;
        }
        free(block);
        block = grown;
        *(size_t*)block = cap;
        t_scratch_tag[1] = 0; /* a new block holds no panel */
    }
    return block + PJ_SCRATCH_HEAD;
}

/* This thread's scratch tag (t_scratch_tag): kernel modules reach it through their
 * `pj_scratch_tag_fn` (set by the driver). */
PJ_EXPORT int64_t* pj_scratch_tag(void) { return t_scratch_tag; }

PJ_EXPORT void pj_host_memcpy(void* dst, const void* src, size_t n) { memcpy(dst, src, n); }
