// The kernel behind aiostream.delay() on CUDA devices.
//
// One thread sleeps until `ns` nanoseconds of the device's global timer have passed, in naps of
// at most 1 microsecond, so the GPU does other work meanwhile. sleep.ptx is generated from this
// file by tools/build_ptx.py (NVRTC, compute_70: the first architecture with __nanosleep) and
// shipped beside it, so no compiler is needed at run time: the driver JIT-compiles the PTX for
// the device it loads on (cuModuleLoadData).

extern "C" __global__ void aiostream_sleep(unsigned long long ns)
{
    unsigned long long start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= ns) {
            break;
        }
        __nanosleep(1000);
    }
}
