/*
 * timeslice-vmm: an LD_PRELOAD shim that lets the node agent move a process's GPU memory to host
 * memory and back at the link's speed, with the device addresses kept (backend `vmm`).
 *
 * Every cudaMalloc of at least TSV_MIN_BYTES (1 MiB) is served with CUDA virtual memory instead of
 * the runtime's allocator: an address range (cuMemAddressReserve) with physical memory mapped into
 * it (cuMemCreate, cuMemMap, cuMemSetAccess); cudaFree of such a pointer undoes it. CUDA Driver API,
 * "Virtual Memory Management" (cuda.h, CUDA >= 10.2). On the agent's command, on a unix socket
 * $TIMESLICE_VMM_DIR/<pid>.sock (default /tmp/timeslice-vmm-<uid>, created 0700; only root or this
 * process's user may connect), a control thread:
 *   checkpoint: synchronises the context (the lock guarantees no phase runs), copies every
 *               allocation into one pinned host buffer (huge pages when the kernel has them
 *               reserved, registered with cuMemHostRegister), then unmaps and releases the
 *               physical memory; the address ranges stay reserved.
 *   restore:    maps new physical memory at the same addresses, copies back, frees the buffer.
 *   state:      says which of the two the process is in.
 * Each step is all-or-nothing: a failure undoes what it did before it answers, and a step whose
 * asker hung up before the answer (the agent timed out) is undone too, so a late step never
 * lands on a GPU given to others. Answers are one line: "ok <running|checkpointed> <bytes>
 * <seconds> <seconds of a checkpoint's copies waiting for host memory>" or "error <CUDA error name
 * or errno text>".
 *
 * What it does not own stays where it is (and resident on the GPU): the CUDA context, module
 * images, allocations under 1 MiB, allocations of a second device, and memory taken without
 * cudaMalloc (cuMemAlloc, cudaMallocAsync, PyTorch's expandable segments, NCCL's buffers).
 * Pointers it serves cannot be shared with cudaIpcGetMemHandle.
 *
 * No CUDA header is needed to build it: the few Driver API types it uses are declared below from
 * cuda.h's definitions, and libcuda.so.1 is opened at the first allocation.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define TSV_EXPORT __attribute__((visibility("default")))
#define TSV_MIN_BYTES (1u << 20)
#define TSV_HUGE (2u << 20)

/* cuda.h (Driver API) */
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_NONE = 0 */
    CUmemLocation location;   /* CU_MEM_LOCATION_TYPE_DEVICE = 1, device ordinal */
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */ } CUmemAccessDesc;
/* cuda_runtime_api.h */
typedef int cudaError_t;
#define cudaSuccess 0
#define cudaErrorMemoryAllocation 2

static struct {
    CUresult (*ctxGetCurrent)(CUcontext *);
    CUresult (*ctxSetCurrent)(CUcontext);
    CUresult (*ctxGetDevice)(CUdevice *);
    CUresult (*ctxSynchronize)(void);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*addressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*addressFree)(CUdeviceptr, size_t);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*setAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*streamCreate)(CUstream *, unsigned int);
    CUresult (*streamSynchronize)(CUstream);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*htod)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*hostRegister)(void *, size_t, unsigned int);
    CUresult (*hostUnregister)(void *);
    CUresult (*errorName)(CUresult, const char **);
    cudaError_t (*cudaMalloc)(void **, size_t);
    cudaError_t (*cudaFree)(void *);
} cu;

typedef struct {
    CUdeviceptr va;
    size_t size; /* rounded to the granularity: reserved, mapped and copied */
    CUmemGenericAllocationHandle handle; /* 0 while checkpointed */
    size_t off; /* where its bytes are in host_buf while checkpointed */
} alloc_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t loaded = PTHREAD_ONCE_INIT;
static int usable;              /* libcuda.so.1 opened and every symbol found */
static alloc_t *allocs;
static size_t n_allocs, cap_allocs;
static CUcontext owner_ctx;     /* the one context whose allocations are ours */
static CUdevice owner_dev;
static size_t granule;
static int checkpointed;
static char *host_buf;
static size_t host_bytes;
static int control_started;
static char socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static pid_t socket_owner;

#define TSV_CHUNK ((size_t)512 << 20) /* $TIMESLICE_VMM_CHUNK_BYTES (rounded up to 2 MiB) overrides */
#define TSV_WORKERS 8

static struct {
    char *base;
    size_t len, chunk, n_chunks, next;
    signed char *ready; /* per chunk: 0 pending, 1 registered, -1 failed */
    CUresult err;
    pthread_mutex_t m;
    pthread_cond_t c;
    pthread_t workers[TSV_WORKERS];
    int n_workers;
} prep = {.m = PTHREAD_MUTEX_INITIALIZER, .c = PTHREAD_COND_INITIALIZER};

static void say(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "timeslice-vmm[%d]: ", (int)getpid());
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
}

static const char *err_name(CUresult r) {
    const char *s = NULL;
    if (cu.errorName && cu.errorName(r, &s) == 0 && s) return s;
    return "CUDA_ERROR_UNKNOWN";
}

/* dl_iterate_phdr: the first loaded object whose name holds "libcudart" (a CUDA runtime loaded
 * with RTLD_LOCAL, as Python loads extension modules, is not in RTLD_NEXT's global scope). */
static int find_runtime(struct dl_phdr_info *info, size_t size, void *out) {
    (void)size;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libcudart")) return 0;
    void *h = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return 0;
    *(void **)out = h;
    return 1;
}

/* The runtime's own cudaMalloc and cudaFree: the next in the global scope, else those of a
 * runtime loaded locally. Looked up again at each call until found (the runtime may load later). */
static void load_runtime(void) {
    void *rt = NULL;
    if (cu.cudaMalloc && cu.cudaFree) return;
    *(void **)&cu.cudaMalloc = dlsym(RTLD_NEXT, "cudaMalloc");
    *(void **)&cu.cudaFree = dlsym(RTLD_NEXT, "cudaFree");
    if ((!cu.cudaMalloc || !cu.cudaFree) && dl_iterate_phdr(find_runtime, &rt) && rt) {
        *(void **)&cu.cudaMalloc = dlsym(rt, "cudaMalloc");
        *(void **)&cu.cudaFree = dlsym(rt, "cudaFree");
    }
}

#define SYM(field, name) (*(void **)&cu.field = dlsym(lib, name)) != NULL
static void load(void) {
    load_runtime();
    void *lib = dlopen(getenv("TIMESLICE_VMM_LIBCUDA") ? getenv("TIMESLICE_VMM_LIBCUDA") : "libcuda.so.1",
                       RTLD_NOW | RTLD_GLOBAL);
    if (!lib) { say("cannot open libcuda.so.1 (%s): allocations are the runtime's own%s", dlerror(), ""); return; }
    usable = SYM(ctxGetCurrent, "cuCtxGetCurrent") && SYM(ctxSetCurrent, "cuCtxSetCurrent")
        && SYM(ctxGetDevice, "cuCtxGetDevice") && SYM(ctxSynchronize, "cuCtxSynchronize")
        && SYM(granularity, "cuMemGetAllocationGranularity") && SYM(addressReserve, "cuMemAddressReserve")
        && SYM(addressFree, "cuMemAddressFree") && SYM(create, "cuMemCreate") && SYM(release, "cuMemRelease")
        && SYM(map, "cuMemMap") && SYM(unmap, "cuMemUnmap") && SYM(setAccess, "cuMemSetAccess")
        && SYM(streamCreate, "cuStreamCreate") && SYM(streamSynchronize, "cuStreamSynchronize")
        && SYM(dtoh, "cuMemcpyDtoHAsync_v2") && SYM(htod, "cuMemcpyHtoDAsync_v2")
        && SYM(hostRegister, "cuMemHostRegister_v2") && SYM(hostUnregister, "cuMemHostUnregister")
        && SYM(errorName, "cuGetErrorName");
    if (!usable) say("libcuda.so.1 lacks a symbol it needs: allocations are the runtime's own%s%s", "", "");
}

static void after_fork_child(void) {
    /* CUDA is not usable in a forked child; the table is the parent's. */
    allocs = NULL; n_allocs = cap_allocs = 0; owner_ctx = NULL; checkpointed = 0;
    host_buf = NULL; host_bytes = 0; control_started = 0; socket_path[0] = 0;
    pthread_mutex_init(&mu, NULL);
    pthread_mutex_init(&prep.m, NULL);
    prep.n_workers = 0;
    prep.ready = NULL;
}

__attribute__((constructor)) static void init(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* The socket goes with the process that made it: a file left behind would look like a shim that
 * no longer answers (a later process of that PID, or one that exec'd). */
__attribute__((destructor)) static void fini(void) {
    if (socket_path[0] && socket_owner == getpid()) unlink(socket_path);
}

static CUmemAllocationProp prop_of(CUdevice dev) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = 1;
    p.location.type = 1;
    p.location.id = dev;
    return p;
}

/* Physical memory of `a->size` bytes mapped read-write at a->va; 0 or the CUDA error. */
static CUresult back(alloc_t *a) {
    CUmemAllocationProp p = prop_of(owner_dev);
    CUmemAccessDesc access = {{1, owner_dev}, 3};
    CUmemGenericAllocationHandle h;
    CUresult r = cu.create(&h, a->size, &p, 0);
    if (r) return r;
    if ((r = cu.map(a->va, a->size, 0, h, 0))) { cu.release(h); return r; }
    if ((r = cu.setAccess(a->va, a->size, &access, 1))) { cu.unmap(a->va, a->size); cu.release(h); return r; }
    a->handle = h;
    return 0;
}

static void unback(alloc_t *a) {
    cu.unmap(a->va, a->size);
    cu.release(a->handle);
    a->handle = 0;
}

static void start_control(void);

TSV_EXPORT cudaError_t cudaMalloc(void **ptr, size_t size) {
    pthread_once(&loaded, load);
    load_runtime();
    if (!cu.cudaMalloc || !cu.cudaFree) {
        say("no CUDA runtime found beside the shim: cudaMalloc fails%s%s", "", "");
        return cudaErrorMemoryAllocation;
    }
    if (!usable) return cu.cudaMalloc(ptr, size);
    CUcontext ctx = NULL;
    if (size >= TSV_MIN_BYTES && (cu.ctxGetCurrent(&ctx) || !ctx)) {
        cu.cudaFree(NULL); /* the runtime makes its primary context current */
        cu.ctxGetCurrent(&ctx);
    }
    pthread_mutex_lock(&mu);
    if (size < TSV_MIN_BYTES || !ctx || (owner_ctx && ctx != owner_ctx)) {
        pthread_mutex_unlock(&mu);
        return cu.cudaMalloc(ptr, size);
    }
    if (!owner_ctx) {
        CUmemAllocationProp p;
        if (cu.ctxGetDevice(&owner_dev)) { pthread_mutex_unlock(&mu); return cu.cudaMalloc(ptr, size); }
        p = prop_of(owner_dev);
        if (cu.granularity(&granule, &p, 0) || !granule) granule = TSV_HUGE;
        owner_ctx = ctx;
    }
    if (n_allocs == cap_allocs) {
        size_t cap = cap_allocs ? 2 * cap_allocs : 256;
        alloc_t *grown = realloc(allocs, cap * sizeof *grown);
        if (!grown) { pthread_mutex_unlock(&mu); return cudaErrorMemoryAllocation; }
        allocs = grown;
        cap_allocs = cap;
    }
    alloc_t a = {0, (size + granule - 1) / granule * granule, 0, 0};
    if (cu.addressReserve(&a.va, a.size, 0, 0, 0)) { pthread_mutex_unlock(&mu); return cudaErrorMemoryAllocation; }
    if (back(&a)) {
        cu.addressFree(a.va, a.size);
        pthread_mutex_unlock(&mu);
        return cudaErrorMemoryAllocation; /* PyTorch's allocator then frees its cache and retries */
    }
    allocs[n_allocs++] = a;
    pthread_mutex_unlock(&mu);
    *ptr = (void *)(uintptr_t)a.va;
    if (!__atomic_exchange_n(&control_started, 1, __ATOMIC_SEQ_CST)) start_control();
    return cudaSuccess;
}

TSV_EXPORT cudaError_t cudaFree(void *ptr) {
    pthread_once(&loaded, load);
    load_runtime();
    if (!cu.cudaFree) return ptr ? 1 /* cudaErrorInvalidValue: nothing of ours, no runtime to free it */ : cudaSuccess;
    if (!usable) return cu.cudaFree(ptr);
    if (ptr) {
        pthread_mutex_lock(&mu);
        for (size_t i = 0; i < n_allocs; i++) {
            if (allocs[i].va != (CUdeviceptr)(uintptr_t)ptr) continue;
            alloc_t a = allocs[i];
            allocs[i] = allocs[--n_allocs];
            if (a.handle) {
                cu.ctxSynchronize(); /* cudaFree's own contract: no work still uses it */
                unback(&a);
            }
            cu.addressFree(a.va, a.size);
            pthread_mutex_unlock(&mu);
            return cudaSuccess;
        }
        pthread_mutex_unlock(&mu);
    }
    return cu.cudaFree(ptr);
}

/* ---------------------------------------------------------------- steps (caller holds mu) */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static size_t total_bytes(void) {
    size_t s = 0;
    for (size_t i = 0; i < n_allocs; i++) s += allocs[i].size;
    return s;
}

/* What the answer reports: while checkpointed, the bytes in host memory (not an allocation the
 * process made since, which is on the GPU); else every allocation's. */
static size_t reported_bytes(void) {
    size_t s = 0;
    for (size_t i = 0; i < n_allocs; i++) if (!checkpointed || !allocs[i].handle) s += allocs[i].size;
    return s;
}

/* The host buffer of a checkpoint is made ready in chunks by worker threads at once (its pages faulted
 * in, i.e. zeroed by the kernel, then registered with cuMemHostRegister), while the copies run into
 * each chunk as soon as it is ready: faulting and pinning tens of GB on one thread took 4.3 s for
 * 31 GB on an H100 host, the copy itself 0.6 s. */

static void *prep_worker(void *arg) {
    (void)arg;
    cu.ctxSetCurrent(owner_ctx);
    for (;;) {
        pthread_mutex_lock(&prep.m);
        size_t c = prep.err ? prep.n_chunks : prep.next++;
        pthread_mutex_unlock(&prep.m);
        if (c >= prep.n_chunks) return NULL;
        char *a = prep.base + c * prep.chunk;
        size_t l = prep.len - c * prep.chunk < prep.chunk ? prep.len - c * prep.chunk : prep.chunk;
        for (size_t o = 0; o < l; o += 4096) ((volatile char *)a)[o] = 0;
        CUresult r = cu.hostRegister(a, l, 1 /* CU_MEMHOSTREGISTER_PORTABLE */);
        pthread_mutex_lock(&prep.m);
        prep.ready[c] = r ? -1 : 1;
        if (r && !prep.err) prep.err = r;
        pthread_cond_broadcast(&prep.c);
        pthread_mutex_unlock(&prep.m);
    }
}

static void join_workers(void) {
    for (int i = 0; i < prep.n_workers; i++) pthread_join(prep.workers[i], NULL);
    prep.n_workers = 0;
}

static void free_host(void) {
    if (!host_buf) return;
    join_workers();
    for (size_t c = 0; c < prep.n_chunks; c++)
        if (prep.ready[c] == 1) cu.hostUnregister(prep.base + c * prep.chunk);
    free(prep.ready);
    prep.ready = NULL;
    munmap(host_buf, host_bytes);
    host_buf = NULL;
    host_bytes = 0;
}

/* Host memory of `bytes` (huge pages when the kernel has them reserved: never MAP_NORESERVE, whose
 * faults past the reservation end the process with SIGBUS, else regular pages with
 * transparent huge pages asked), made ready by the workers in the background (`wait_chunk`). */
static const char *alloc_host(size_t bytes) {
    size_t len = (bytes + TSV_HUGE - 1) / TSV_HUGE * TSV_HUGE;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p == MAP_FAILED) {
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return strerror(errno);
        madvise(p, len, MADV_HUGEPAGE);
    }
    prep.base = p;
    prep.len = len;
    const char *chunk = getenv("TIMESLICE_VMM_CHUNK_BYTES");
    prep.chunk = chunk && strtoull(chunk, NULL, 10) ? (strtoull(chunk, NULL, 10) + TSV_HUGE - 1) / TSV_HUGE * TSV_HUGE : TSV_CHUNK;
    prep.n_chunks = (len + prep.chunk - 1) / prep.chunk;
    prep.next = 0;
    prep.err = 0;
    prep.ready = calloc(prep.n_chunks, 1);
    if (!prep.ready) { munmap(p, len); return strerror(ENOMEM); }
    host_buf = p;
    host_bytes = len;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int want = cpus > 1 ? (cpus > TSV_WORKERS ? TSV_WORKERS : (int)cpus) : 1;
    for (prep.n_workers = 0; prep.n_workers < want; prep.n_workers++)
        if (pthread_create(&prep.workers[prep.n_workers], NULL, prep_worker, NULL)) break;
    if (!prep.n_workers) { free_host(); return "no thread to prepare host memory"; }
    return NULL;
}

static double prep_waited; /* seconds the last checkpoint's copies waited for host memory (`wait_chunk`) */

/* 0 once chunk `c` of the host buffer is registered, or the error that stopped its preparation. */
static CUresult wait_chunk(size_t c) {
    double t0 = now();
    pthread_mutex_lock(&prep.m);
    while (!prep.ready[c] && !prep.err) pthread_cond_wait(&prep.c, &prep.m);
    prep_waited += now() - t0;
    CUresult r = prep.ready[c] == 1 ? 0 : prep.err;
    pthread_mutex_unlock(&prep.m);
    return r;
}

/* Copies allocation `a` out (into host_buf at a->off, each piece as soon as its chunk of host memory
 * is ready) or back in. One copy never spans two chunks: each chunk is its own registration, and
 * an asynchronous copy must lie within one (CUDA_ERROR_INVALID_VALUE otherwise, seen on an H100). */
static CUresult copy_alloc(const alloc_t *a, int out, CUstream s) {
    for (size_t done = 0; done < a->size;) {
        size_t at = a->off + done, c = at / prep.chunk;
        size_t piece = (c + 1) * prep.chunk - at < a->size - done ? (c + 1) * prep.chunk - at : a->size - done;
        CUresult r = out ? wait_chunk(c) : 0;
        if (!r) r = out ? cu.dtoh(host_buf + at, a->va + done, piece, s) : cu.htod(a->va + done, host_buf + at, piece, s);
        if (r) return r;
        done += piece;
    }
    return 0;
}

/* Copies every allocation into host_buf, one after another, and waits for the copies. */
static CUresult copy_out(CUstream s) {
    size_t off = 0;
    for (size_t i = 0; i < n_allocs; i++) {
        allocs[i].off = off;
        off += allocs[i].size;
        CUresult r = copy_alloc(&allocs[i], 1, s);
        if (r) return r;
    }
    return cu.streamSynchronize(s);
}

static const char *do_checkpoint(CUstream s) {
    if (checkpointed) return NULL;
    CUresult r;
    if ((r = cu.ctxSynchronize())) return err_name(r);
    free_host(); /* one a restore left to free after its answer */
    prep_waited = 0;
    const char *e = alloc_host(total_bytes() ? total_bytes() : 1);
    if (e) return e;
    if ((r = copy_out(s))) {
        cu.streamSynchronize(s); /* copies already queued still write into the buffer */
        free_host();
        return err_name(r);
    }
    join_workers();
    for (size_t i = 0; i < n_allocs; i++) unback(&allocs[i]);
    checkpointed = 1;
    return NULL;
}

static const char *do_restore(CUstream s) {
    if (!checkpointed) return NULL;
    CUresult r = 0;
    size_t i, backed = 0;
    alloc_t **mapped = calloc(n_allocs + 1, sizeof *mapped);
    if (!mapped) return strerror(ENOMEM);
    for (i = 0; i < n_allocs && !r; i++) {
        if (allocs[i].handle) continue;
        if (!(r = back(&allocs[i]))) mapped[backed++] = &allocs[i];
    }
    /* an allocation made while checkpointed (handle set) is left as it is */
    for (i = 0; i < backed && !r; i++) r = copy_alloc(mapped[i], 0, s);
    if (!r) r = cu.streamSynchronize(s);
    if (r) {
        cu.streamSynchronize(s); /* copies already queued still write into the memory */
        for (i = 0; i < backed; i++) unback(mapped[i]);
        free(mapped);
        return err_name(r);
    }
    free(mapped);
    checkpointed = 0; /* the host buffer is freed after the answer (`serve_one`): not on the switch's path */
    return NULL;
}

/* ---------------------------------------------------------------- control socket */

static int asker_gone(int fd) {
    struct pollfd p = {fd, POLLIN | POLLRDHUP, 0};
    char c;
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)
                                  || ((p.revents & POLLIN) && recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0));
}

static void serve_one(int fd, CUstream *s) {
    char line[64];
    ssize_t n = recv(fd, line, sizeof line - 1, 0);
    if (n <= 0) return;
    line[n] = 0;
    line[strcspn(line, "\r\n")] = 0;
    pthread_mutex_lock(&mu);
    double t0 = now();
    const char *e = NULL;
    int was = checkpointed;
    if (strcmp(line, "checkpoint") && strcmp(line, "restore") && strcmp(line, "state")) e = "unknown command";
    else if (strcmp(line, "state") && asker_gone(fd)) {
        e = "asker gone before the step began: not run"; /* it timed out waiting behind another */
    } else if (strcmp(line, "state")) {
        CUresult r = cu.ctxSetCurrent(owner_ctx);
        if (!r && !*s) r = cu.streamCreate(s, 1 /* CU_STREAM_NON_BLOCKING */);
        e = r ? err_name(r) : line[0] == 'c' ? do_checkpoint(*s) : do_restore(*s);
        if (!e && checkpointed != was && asker_gone(fd)) {
            /* the agent gave up waiting: put the process back as it was */
            e = was ? do_checkpoint(*s) : do_restore(*s);
            say("%s finished after its asker left: undone%s", line, e ? " FAILED" : "");
        }
    }
    char out[160];
    if (e) snprintf(out, sizeof out, "error %s\n", e);
    else snprintf(out, sizeof out, "ok %s %zu %.3f %.3f\n", checkpointed ? "checkpointed" : "running", reported_bytes(),
                  now() - t0, line[0] == 'c' && checkpointed != was ? prep_waited : 0.0);
    send(fd, out, strlen(out), MSG_NOSIGNAL);
    if (!checkpointed) free_host();
    pthread_mutex_unlock(&mu);
}

static void *control(void *arg) {
    int lfd = (int)(intptr_t)arg;
    CUstream s = NULL;
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EBADF || errno == EINVAL || errno == ENOTSOCK) break;
            if (errno != EINTR && errno != ECONNABORTED) usleep(100000); /* out of descriptors or memory: later */
            continue;
        }
        struct timeval limit = {2, 0}; /* a command is one short line: an asker that sends nothing is dropped */
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
        struct ucred who;
        socklen_t len = sizeof who;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &who, &len) == 0 && (who.uid == 0 || who.uid == getuid()))
            serve_one(fd, &s);
        close(fd);
    }
    return NULL;
}

static void start_control(void) {
    char own[64];
    snprintf(own, sizeof own, "/tmp/timeslice-vmm-%u", (unsigned)getuid()); /* one per user: no user blocks another */
    const char *dir = getenv("TIMESLICE_VMM_DIR") ? getenv("TIMESLICE_VMM_DIR") : own;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    struct stat st;
    if (mkdir(dir, 0700) && errno != EEXIST) { say("cannot make %s: %s; the agent moves this process by the cuda backend", dir, strerror(errno)); return; }
    if (lstat(dir, &st) || !S_ISDIR(st.st_mode) || st.st_uid != getuid() || (st.st_mode & 077)) {
        say("%s is not a directory of this user with mode 0700%s: the agent moves this process by the cuda backend", dir, "");
        return;
    }
    if ((size_t)snprintf(addr.sun_path, sizeof addr.sun_path, "%s/%d.sock", dir, (int)getpid()) >= sizeof addr.sun_path) {
        say("socket path under %s is too long%s", dir, "");
        return;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    unlink(addr.sun_path); /* a PID's socket left by an earlier process of that PID */
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) || listen(fd, 4)) {
        say("cannot listen on %s: %s", addr.sun_path, strerror(errno));
        if (fd >= 0) close(fd);
        return;
    }
    memcpy(socket_path, addr.sun_path, sizeof socket_path);
    socket_owner = getpid();
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, control, (void *)(intptr_t)fd)) { say("no control thread: %s%s", strerror(errno), ""); close(fd); }
    pthread_attr_destroy(&attr);
}

/* For `timeslice` to tell that the shim is loaded in a process (ctypes.CDLL(None)). */
TSV_EXPORT const char *timeslice_vmm_version(void) { return "1"; }
