"""Launch overhead of the native CPU stream runtime.

Compares, for a tiny kernel (a few floats), the median time of
(a) a bare ctypes call of the kernel and (b) ``launch_seq`` + ``sync`` through
a stream: (b) - (a) is what a stream costs per kernel run.

    polyjit bench cpu_stream
"""

from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np

from polyjit.backends.cpu.compiler import load_shared
from polyjit.backends.cpu.native import load_runtime
from polyjit.bench.timing import median_ns, median_per_call

KERNEL_SOURCE = r"""
#include <stdint.h>
void tiny(void* const* b, const int64_t* s, int64_t lo, int64_t hi) {
    float* x = (float*)b[0];
    for (int64_t i = 0; i < 4; i++) x[i] += (float)s[0];
}
"""


def measure_launch_overhead(reps: int = 2000, rounds: int = 15) -> dict[str, float]:
    """Median microseconds of a bare kernel call and of launch + sync through a stream."""
    rt = load_runtime()
    library = load_shared(KERNEL_SOURCE, "bench")
    lib = library.lib
    kernel = lib.tiny
    kernel.restype = None
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    fn_addr = ctypes.cast(kernel, ctypes.c_void_p).value
    assert fn_addr is not None

    x = np.zeros(4, dtype=np.float32)
    bufs = rt.make_ptr_array([x.ctypes.data])
    descs = rt.make_descs([(fn_addr, ctypes.addressof(bufs))])
    statics = rt.make_statics()
    statics[0] = 1
    stream = rt.stream_create(1, None)
    launch_seq, launch_seq_raw, sync = rt.launch_seq, rt.launch_seq_raw, rt.sync
    handle = rt.stream_handle(stream)

    def bare() -> None:
        kernel(bufs, statics, 0, 1)

    def streamed() -> None:
        sync(stream, launch_seq(stream, descs, 1, statics, 1))

    def streamed_raw() -> None:
        sync(stream, launch_seq_raw(handle, descs, 1, statics, 1))

    def enqueue_only() -> None:
        launch_seq(stream, descs, 1, statics, 1)

    try:
        for f in (bare, streamed, streamed_raw):  # warm up caches, the worker, predictors
            median_per_call(f, reps=reps, rounds=2, warmup=0)
        # Throughput: median over rounds of the mean call in a round; latency: single calls.
        bare_us = median_per_call(bare, reps=reps, rounds=rounds, warmup=0) * 1e6
        stream_us = median_per_call(streamed, reps=reps, rounds=rounds, warmup=0) * 1e6
        raw_us = median_per_call(streamed_raw, reps=reps, rounds=rounds, warmup=0) * 1e6
        bare_single = median_ns(bare, reps * 5, warmup=0) / 1e3
        stream_single = median_ns(streamed, reps * 5, warmup=0) / 1e3
        enq_us = median_per_call(enqueue_only, reps=min(reps, 1000), rounds=rounds, warmup=0) * 1e6
        sync(stream, rt.last_ticket(stream))
        # One launch after the worker has fallen asleep: the cold wake-up path.
        cold: list[float] = []
        for _ in range(20):
            time.sleep(0.002)
            t0 = time.perf_counter_ns()
            streamed()
            cold.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        rt.stream_destroy(stream)
    return {
        "bare_call_us": bare_us,
        "launch_sync_us": stream_us,
        "overhead_us": stream_us - bare_us,
        "launch_raw_sync_us": raw_us,
        "overhead_raw_us": raw_us - bare_us,
        "bare_call_single_us": bare_single,
        "launch_sync_single_us": stream_single,
        "overhead_single_us": stream_single - bare_single,
        "enqueue_only_us": enq_us,
        "cold_launch_sync_us": statistics.median(cold),
    }


if __name__ == "__main__":
    for name, value in measure_launch_overhead().items():
        print(f"{name:24s} {value:8.2f}")
