/*
 * A fake libcuda.so.1 and libcudart for the timeslice-vmm shim on a CPU (tests/test_vmm.py).
 *
 * "Device" memory is host memory with the shim's semantics kept: an address range reserved
 * (cuMemAddressReserve: mmap PROT_NONE), physical memory a memfd (cuMemCreate), mapped at the
 * range's address (cuMemMap: mmap MAP_FIXED; cuMemSetAccess: read-write) and unmapped back to an
 * inaccessible reservation (cuMemUnmap). So a process whose memory is checkpointed faults if it
 * touches it, and a restore must put the bytes back at the same addresses.
 *
 * $TIMESLICE_FAKE_VMM_USED: a file rewritten with the bytes of physical memory held ("GPU used").
 * $TIMESLICE_FAKE_VMM_FAULTS: a file read at every copy and cuMemCreate; each line "<call> <kind>
 * [seconds]" with call dtoh|htod|create|unregister and kind error (CUDA_ERROR_UNKNOWN; create: out of
 * memory), error-once (the same, then the file is emptied: a transient fault), hang (write
 * "<call>" to $TIMESLICE_FAKE_VMM_FAULTS.hit, sleep, add a line of it to
 * $TIMESLICE_FAKE_VMM_FAULTS.after, then do it) or die (_exit(86) before it).
 * cudaMalloc/cudaFree here are the runtime's own allocator (malloc), for allocations the shim
 * leaves to the runtime (left out with -DFAKE_DRIVER_ONLY: a driver apart from its runtime).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

static long long used;
static struct { unsigned long long handle; size_t size; } held[4096];

static void write_used(void) {
    const char *p = getenv("TIMESLICE_FAKE_VMM_USED");
    if (!p) return;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", p);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "%lld\n", used);
    fclose(f);
    rename(tmp, p);
}

/* 0, or the fault's error code; a hang sleeps first, a die ends the process */
static CUresult fault(const char *call) {
    const char *p = getenv("TIMESLICE_FAKE_VMM_FAULTS");
    FILE *f = p ? fopen(p, "r") : NULL;
    char c[32], kind[32];
    double seconds;
    CUresult r = 0;
    while (f && !r) {
        seconds = 0;
        int n = fscanf(f, "%31s %31s %lf", c, kind, &seconds);
        if (n < 2) break;
        if (strcmp(c, call)) continue;
        if (!strcmp(kind, "die")) _exit(86);
        if (!strcmp(kind, "hang")) {
            char hit[4096];
            snprintf(hit, sizeof hit, "%s.hit", p);
            FILE *h = fopen(hit, "w"); /* for a test to act while the call hangs */
            if (h) { fprintf(h, "%s\n", call); fclose(h); }
            usleep((useconds_t)(seconds * 1e6));
            snprintf(hit, sizeof hit, "%s.after", p); /* ... and to count those that ended */
            h = fopen(hit, "a");
            if (h) { fprintf(h, "%s\n", call); fclose(h); }
        }
        if (!strcmp(kind, "error") || !strcmp(kind, "error-once")) r = strcmp(call, "create") ? 999 : 2;
        if (!strcmp(kind, "error-once")) truncate(p, 0); /* a transient fault: the next call succeeds */
    }
    if (f) fclose(f);
    return r;
}

CUresult cuCtxGetCurrent(void **ctx) { *ctx = (void *)0x1; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return 0; }
CUresult cuCtxGetDevice(int *dev) { *dev = 0; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int flags) { (void)prop; (void)flags; *g = 65536; return 0; }
CUresult cuStreamCreate(void **s, unsigned int flags) { (void)flags; *s = (void *)0x2; return 0; }
CUresult cuStreamSynchronize(void *s) { (void)s; return 0; }
/* Registered host ranges: an asynchronous copy must lie within one (the real driver answers
 * CUDA_ERROR_INVALID_VALUE for one that spans two registrations; seen on an H100). */
static struct { char *p; size_t n; } reg[8192];

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
    (void)flags;
    for (int i = 0; i < 8192; i++) if (!reg[i].p) { reg[i].p = p; reg[i].n = n; return 0; }
    return 2;
}

CUresult cuMemHostUnregister(void *p) {
    if (fault("unregister")) return 1;
    for (int i = 0; i < 8192; i++) if (reg[i].p == p) { reg[i].p = NULL; return 0; }
    return 1;
}

static int registered(const void *p, size_t n) {
    for (int i = 0; i < 8192; i++)
        if (reg[i].p && (const char *)p >= reg[i].p && (const char *)p + n <= reg[i].p + reg[i].n) return 1;
    return 0;
}

CUresult cuMemAddressReserve(CUdeviceptr *va, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)align; (void)addr; (void)flags;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return 2;
    *va = (CUdeviceptr)p;
    return 0;
}

CUresult cuMemAddressFree(CUdeviceptr va, size_t size) { return munmap((void *)va, size) ? 1 : 0; }

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const void *prop, unsigned long long flags) {
    (void)prop; (void)flags;
    CUresult r = fault("create");
    if (r) return r;
    int fd = memfd_create("fake-gpu", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size)) return 2;
    for (int i = 0; i < 4096; i++) {
        if (held[i].handle) continue;
        held[i].handle = (unsigned long long)fd + 1;
        held[i].size = size;
        *h = held[i].handle;
        used += (long long)size;
        write_used();
        return 0;
    }
    close(fd);
    return 2;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    for (int i = 0; i < 4096; i++) {
        if (held[i].handle != h) continue;
        close((int)(h - 1));
        used -= (long long)held[i].size;
        held[i].handle = 0;
        write_used();
        return 0;
    }
    return 1;
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long flags) {
    (void)flags;
    void *p = mmap((void *)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)(h - 1), (off_t)off);
    return p == MAP_FAILED ? 1 : 0;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    void *p = mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? 1 : 0;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const void *desc, size_t count) {
    (void)desc; (void)count;
    return mprotect((void *)va, size, PROT_READ | PROT_WRITE) ? 1 : 0;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
    (void)s;
    CUresult r = fault("dtoh");
    if (!r && !registered(dst, n)) r = 1;
    if (!r) memcpy(dst, (void *)src, n);
    return r;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
    (void)s;
    CUresult r = fault("htod");
    if (!r && !registered(src, n)) r = 1;
    if (!r) memcpy((void *)dst, src, n);
    return r;
}

CUresult cuGetErrorName(CUresult r, const char **s) {
    *s = r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : r == 999 ? "CUDA_ERROR_UNKNOWN" : "CUDA_ERROR_INVALID_VALUE";
    return 0;
}

#ifndef FAKE_DRIVER_ONLY /* built without: a driver apart from the runtime, as NVIDIA's are */
int cudaMalloc(void **p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaFree(void *p) { free(p); return 0; }
#endif
