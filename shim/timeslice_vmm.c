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
 *   pool:       (sent with a memfd, SCM_RIGHTS) the node's pinned pool: mapped shared and
 *               registered with cuMemHostRegister in the background, once per process, so that
 *               checkpoints copy into memory already pinned (registering is the slow part).
 *   checkpoint [pool=<inode> <offset>+<length>,...]: synchronises the context (the lock
 *               guarantees no phase runs), copies every allocation into the ranges the agent
 *               names (bytes) of the pool it names, in order, and what they do not hold (all of
 *               it, when this process holds another pool) into a private pinned buffer (huge
 *               pages when the kernel has them reserved), then unmaps and releases the physical
 *               memory; the address ranges stay reserved.
 *   restore:    maps new physical memory at the same addresses, copies back, frees the private
 *               buffer (the pool's ranges are the agent's to give out again once it has the answer).
 *   state:      says which of the two the process is in.
 * Each step is all-or-nothing: a failure undoes what it did before it answers, and a step whose
 * asker hung up before the answer (the agent timed out) is undone too, so a late step never
 * lands on a GPU given to others. Answers are one line: "ok <running|checkpointed> <bytes>
 * <seconds> <seconds of a checkpoint's copies waiting for host memory> <bytes of the checkpoint in
 * the pool>" or "error <CUDA error name or errno text>".
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
    size_t off; /* where its bytes are in the checkpoint's layout while checkpointed */
} alloc_t;

#define TSV_CHUNK ((size_t)512 << 20) /* $TIMESLICE_VMM_CHUNK_BYTES (rounded up to 2 MiB) overrides */
#define TSV_WORKERS 8
#define TSV_MAX_SEGS 129 /* pool ranges in one checkpoint, and the private buffer */

/* Host memory registered in chunks by worker threads (`prepare`): a checkpoint's private buffer,
 * or the node's pool. */
typedef struct {
    char *base;
    size_t len, chunk, n_chunks, next;
    signed char *ready; /* per chunk: 0 pending, 2 being registered, 1 registered, -1 failed */
    CUresult err;
    int stop, shared;
    dev_t dev; /* the pool's memfd, to know it again */
    ino_t ino;
    pthread_mutex_t m;
    pthread_cond_t c;
    pthread_t workers[TSV_WORKERS];
    int n_workers;
} host_t;

/* A piece of a checkpoint's layout: `len` bytes at `off` in `h`. */
typedef struct {
    host_t *h;
    size_t off, len;
} seg_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t loaded = PTHREAD_ONCE_INIT;
static int usable;              /* libcuda.so.1 opened and every symbol found */
static alloc_t *allocs;
static size_t n_allocs, cap_allocs;
static CUcontext owner_ctx;     /* the one context whose allocations are ours */
static CUdevice owner_dev;
static size_t granule;
static int checkpointed;
#define HOST_INIT {.m = PTHREAD_MUTEX_INITIALIZER, .c = PTHREAD_COND_INITIALIZER}
static host_t own = HOST_INIT;                   /* this checkpoint's private buffer */
static host_t pools[2] = {HOST_INIT, HOST_INIT}; /* the node's pool, and an older one a checkpoint is still in */
static host_t *pool = &pools[0];
static seg_t segs[TSV_MAX_SEGS]; /* the checkpoint's layout: allocations one after another over these */
static size_t n_segs;
static int control_started;
static char socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static pid_t socket_owner;

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
    control_started = 0; socket_path[0] = 0; n_segs = 0;
    pthread_mutex_init(&mu, NULL);
    host_t *hosts[] = {&own, &pools[0], &pools[1]};
    for (int i = 0; i < 3; i++) { /* the parent's mappings stay in it; none is registered in the child */
        memset(hosts[i], 0, sizeof *hosts[i]);
        pthread_mutex_init(&hosts[i]->m, NULL);
        pthread_cond_init(&hosts[i]->c, NULL);
    }
    pool = &pools[0];
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

/* Host memory is made ready in chunks by worker threads at once (its pages faulted in, then
 * registered with cuMemHostRegister), while copies run into each chunk as soon as it is ready:
 * faulting and pinning tens of GB on one thread took 4.3 s for 31 GB on an H100 host, the copy
 * itself 0.6 s. A private buffer's pages are faulted by writing them (the kernel zeroes them); the
 * node's pool is shared with other processes whose states are in it, so its pages are faulted
 * without writing (MADV_POPULATE_WRITE, Linux 5.14; else cuMemHostRegister faults them itself). */
/* Fault in and register chunk `c` of `h`, claimed by the caller (h->m not held); then mark it. */
static void register_chunk(host_t *h, size_t c) {
    char *a = h->base + c * h->chunk;
    size_t l = h->len - c * h->chunk < h->chunk ? h->len - c * h->chunk : h->chunk;
    if (h->shared) madvise(a, l, 23 /* MADV_POPULATE_WRITE */);
    else for (size_t o = 0; o < l; o += 4096) ((volatile char *)a)[o] = 0;
    CUresult r = cu.hostRegister(a, l, 1 /* CU_MEMHOSTREGISTER_PORTABLE */);
    pthread_mutex_lock(&h->m);
    h->ready[c] = r ? -1 : 1;
    if (r && !h->err) h->err = r;
    pthread_cond_broadcast(&h->c);
    pthread_mutex_unlock(&h->m);
}

/* The next pending chunk from h->next on (wrapping), claimed; n_chunks when none (h->m held). */
static size_t claim_next(host_t *h) {
    for (size_t i = 0; i < h->n_chunks && !h->err && !h->stop; i++) {
        size_t c = (h->next + i) % h->n_chunks;
        if (!h->ready[c]) {
            h->ready[c] = 2;
            h->next = c + 1;
            return c;
        }
    }
    return h->n_chunks;
}

static void *prep_worker(void *arg) {
    host_t *h = arg;
    cu.ctxSetCurrent(owner_ctx);
    for (;;) {
        pthread_mutex_lock(&h->m);
        size_t c = claim_next(h);
        pthread_mutex_unlock(&h->m);
        if (c >= h->n_chunks) return NULL;
        register_chunk(h, c);
    }
}

static void join_workers(host_t *h) {
    for (int i = 0; i < h->n_workers; i++) pthread_join(h->workers[i], NULL);
    h->n_workers = 0;
}

/* Unregister and unmap `h` (its workers stopped first). */
static void free_host(host_t *h) {
    if (!h->base) return;
    pthread_mutex_lock(&h->m);
    h->stop = 1;
    pthread_mutex_unlock(&h->m);
    join_workers(h);
    for (size_t c = 0; c < h->n_chunks; c++)
        if (h->ready[c] == 1) cu.hostUnregister(h->base + c * h->chunk);
    free(h->ready);
    munmap(h->base, h->len);
    h->ready = NULL;
    h->base = NULL;
    h->len = h->n_chunks = h->next = 0;
    h->err = 0;
    h->stop = 0;
}

/* `h` over the mapping `p` of `len` bytes, made ready by workers in the background (`wait_chunk`). */
static const char *prepare(host_t *h, char *p, size_t len, int shared) {
    const char *chunk = getenv("TIMESLICE_VMM_CHUNK_BYTES");
    h->chunk = chunk && strtoull(chunk, NULL, 10) ? (strtoull(chunk, NULL, 10) + TSV_HUGE - 1) / TSV_HUGE * TSV_HUGE : TSV_CHUNK;
    h->n_chunks = (len + h->chunk - 1) / h->chunk;
    h->next = 0;
    h->err = 0;
    h->stop = 0;
    h->shared = shared;
    h->ready = calloc(h->n_chunks, 1);
    if (!h->ready) { munmap(p, len); return strerror(ENOMEM); }
    h->base = p;
    h->len = len;
    madvise(p, len, MADV_DONTFORK); /* a child (a data loader's worker) neither maps it nor copies its pinned pages */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int want = cpus > 1 ? (cpus > TSV_WORKERS ? TSV_WORKERS : (int)cpus) : 1;
    for (h->n_workers = 0; h->n_workers < want; h->n_workers++)
        if (pthread_create(&h->workers[h->n_workers], NULL, prep_worker, h)) break;
    if (!h->n_workers) { free_host(h); return "no thread to prepare host memory"; }
    return NULL;
}

/* A private buffer of `bytes` (huge pages when the kernel has them reserved: never MAP_NORESERVE,
 * whose faults past the reservation end the process with SIGBUS, else regular pages with
 * transparent huge pages asked): what of a checkpoint the node's pool does not take. */
static const char *alloc_own(size_t bytes) {
    size_t len = (bytes + TSV_HUGE - 1) / TSV_HUGE * TSV_HUGE;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p == MAP_FAILED) {
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return strerror(errno);
        madvise(p, len, MADV_HUGEPAGE);
    }
    return prepare(&own, p, len, 0);
}

/* The node's pool, handed over by the agent (`pool` with the descriptor of its memfd): mapped
 * shared and registered in the background, once, so checkpoints copy into memory already pinned.
 * One the process is checkpointed in is kept until its restore (an agent that restarted hands
 * over a new pool). */
static const char *take_pool(int fd) {
    struct stat st;
    if (fstat(fd, &st)) return strerror(errno);
    if (pool->base && pool->dev == st.st_dev && pool->ino == st.st_ino) return NULL; /* this one already */
    if (st.st_size <= 0) return "empty pool";
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return strerror(errno);
    madvise(p, (size_t)st.st_size, MADV_HUGEPAGE); /* huge pages where the host allows them for shared memory
                                                     (transparent_hugepage/shmem_enabled: advise): faster to register */
    host_t *used = NULL; /* the pool the process is checkpointed in */
    for (size_t k = 0; k < n_segs; k++) if (segs[k].h != &own) used = segs[k].h;
    host_t *slot = used == &pools[0] ? &pools[1] : &pools[0], *other = slot == &pools[0] ? &pools[1] : &pools[0];
    free_host(slot);
    if (other != used) free_host(other);
    const char *e = prepare(slot, p, (size_t)st.st_size, 1);
    if (e) return e;
    slot->dev = st.st_dev;
    slot->ino = st.st_ino;
    pool = slot;
    return NULL;
}

static double prep_waited; /* seconds the last checkpoint's copies waited for host memory (`wait_chunk`) */

/* 0 once chunk `c` of `h` is registered, or the error that stopped its preparation. A chunk no
 * worker has begun is registered here, and the workers go on from the one after it: a checkpoint
 * into a pool whose registration is still under way (its process was handed it moments ago)
 * waits for the chunks it fills, not for the whole pool (H100 host: 12.5 s for a first
 * checkpoint of 31 GB behind the registration of an 85 GB pool in order). */
static CUresult wait_chunk(host_t *h, size_t c) {
    double t0 = now();
    pthread_mutex_lock(&h->m);
    if (!h->ready[c] && !h->err) {
        h->ready[c] = 2;
        h->next = c + 1;
        pthread_mutex_unlock(&h->m);
        register_chunk(h, c);
        pthread_mutex_lock(&h->m);
    }
    while ((!h->ready[c] || h->ready[c] == 2) && !h->err) pthread_cond_wait(&h->c, &h->m);
    prep_waited += now() - t0;
    CUresult r = h->ready[c] == 1 ? 0 : h->err;
    pthread_mutex_unlock(&h->m);
    return r;
}

/* Copies allocation `a` out (to a->off of the checkpoint's layout, each piece as soon as its
 * chunk of host memory is ready) or back in. One copy never spans two chunks: each chunk is its
 * own registration, and an asynchronous copy must lie within one (CUDA_ERROR_INVALID_VALUE
 * otherwise, seen on an H100). */
static CUresult copy_alloc(const alloc_t *a, int out, CUstream s) {
    size_t k = 0, start = 0;
    for (size_t done = 0; done < a->size;) {
        size_t at = a->off + done;
        while (k < n_segs && at >= start + segs[k].len) start += segs[k++].len;
        if (k == n_segs) return 1; /* CUDA_ERROR_INVALID_VALUE: the layout is too short (cannot happen) */
        host_t *h = segs[k].h;
        size_t ho = segs[k].off + (at - start), c = ho / h->chunk;
        size_t piece = a->size - done;
        if ((c + 1) * h->chunk - ho < piece) piece = (c + 1) * h->chunk - ho;
        if (start + segs[k].len - at < piece) piece = start + segs[k].len - at;
        CUresult r = wait_chunk(h, c);
        if (!r) r = out ? cu.dtoh(h->base + ho, a->va + done, piece, s) : cu.htod(a->va + done, h->base + ho, piece, s);
        if (r) return r;
        done += piece;
    }
    return 0;
}

/* The checkpoint's layout: the pool's ranges `spec` ("pool=<inode> <offset>+<length>,...", bytes;
 * empty: none) in order, then a private buffer for what they do not hold. Ranges of another pool
 * than the one this process holds (an agent restarted, and this process did not take its new one)
 * or of one whose registration failed are not used: the private buffer takes it all. NULL or the
 * reason it cannot be made. */
static const char *lay_out(const char *spec) {
    size_t need = total_bytes(), have = 0;
    n_segs = 0;
    if (spec && *spec) {
        char *end;
        if (strncmp(spec, "pool=", 5)) return "malformed pool ranges";
        unsigned long long ino = strtoull(spec + 5, &end, 10);
        if (*end != ' ') return "malformed pool ranges";
        pthread_mutex_lock(&pool->m);
        int usable = pool->base && !pool->err && pool->ino == (ino_t)ino;
        pthread_mutex_unlock(&pool->m);
        spec = usable ? end + 1 : NULL;
    }
    while (spec && *spec && have < need) {
        char *end;
        unsigned long long off = strtoull(spec, &end, 10), len;
        if (*end != '+') return "malformed pool ranges";
        len = strtoull(end + 1, &end, 10);
        if (*end && *end != ',') return "malformed pool ranges";
        if (!len || off > pool->len || len > pool->len - off) return "pool range outside the pool";
        if (n_segs == TSV_MAX_SEGS - 1) return "too many pool ranges";
        if (len > need - have) len = need - have;
        segs[n_segs++] = (seg_t){pool, off, len};
        have += len;
        spec = *end ? end + 1 : end;
    }
    if (have < need) {
        const char *e = alloc_own(need - have);
        if (e) { n_segs = 0; return e; }
        segs[n_segs++] = (seg_t){&own, 0, need - have};
    }
    return NULL;
}

static size_t layout_bytes(void) {
    size_t n = 0;
    for (size_t k = 0; k < n_segs; k++) n += segs[k].len;
    return n;
}

/* The layout of a restore being undone, made to hold what the process allocated while it was
 * checkpointed too: its pool ranges kept, a new private buffer for the rest (what the old one
 * held is back on the GPU). NULL or the reason it cannot be made. */
static const char *relay_out(void) {
    size_t have = 0, n = 0, need = total_bytes();
    for (size_t k = 0; k < n_segs; k++)
        if (segs[k].h != &own) { segs[n++] = segs[k]; have += segs[k].len; }
    n_segs = n;
    free_host(&own);
    if (have >= need) return NULL;
    const char *e = alloc_own(need - have);
    if (e) return e;
    segs[n_segs++] = (seg_t){&own, 0, need - have};
    return NULL;
}

/* Copies every allocation into the layout, one after another, and waits for the copies. */
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

/* The layout is gone once the process runs again: its private buffer freed (after the answer, off
 * the switch's path), a pool no longer the current one unmapped. */
static void drop_layout(void) {
    free_host(&own);
    n_segs = 0;
    free_host(pool == &pools[0] ? &pools[1] : &pools[0]);
}

/* Into the layout made by `lay_out` (a restore undone re-uses the one it restored from). */
static const char *do_checkpoint(CUstream s) {
    if (checkpointed) return NULL;
    CUresult r;
    if ((r = cu.ctxSynchronize())) return err_name(r);
    prep_waited = 0;
    if ((r = copy_out(s))) {
        cu.streamSynchronize(s); /* copies already queued still write into the buffer */
        return err_name(r);
    }
    join_workers(&own);
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
    checkpointed = 0; /* the layout is dropped after the answer (`serve_one`): not on the switch's path */
    return NULL;
}

/* ---------------------------------------------------------------- control socket */

static int asker_gone(int fd) {
    struct pollfd p = {fd, POLLIN | POLLRDHUP, 0};
    char c;
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)
                                  || ((p.revents & POLLIN) && recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0));
}

/* One command line (up to its newline, at most sizeof line - 1 bytes) and the descriptor sent with
 * it, if any (*passed, else -1). Its length, or -1. */
static ssize_t read_command(int fd, char *line, size_t size, int *passed) {
    size_t n = 0;
    double until = now() + 2.0; /* the whole line, however it is split */
    *passed = -1;
    while (n < size - 1 && !memchr(line, '\n', n) && now() < until) {
        union { struct cmsghdr h; char buf[CMSG_SPACE(4 * sizeof(int))]; } ctl;
        struct iovec io = {line + n, size - 1 - n};
        struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
        ssize_t got = recvmsg(fd, &m, MSG_CMSG_CLOEXEC);
        if (got <= 0) break;
        /* every descriptor passed is closed but the last one (descriptors past this buffer the kernel
         * does not install: MSG_CTRUNC) */
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
                int d;
                memcpy(&d, CMSG_DATA(c) + i * sizeof(int), sizeof d);
                if (*passed >= 0) close(*passed);
                *passed = d;
            }
        }
        n += (size_t)got;
    }
    line[n] = 0;
    line[strcspn(line, "\r\n")] = 0;
    return n ? (ssize_t)n : -1;
}

static void serve_one(int fd, CUstream *s) {
    char line[4096];
    int passed;
    if (read_command(fd, line, sizeof line, &passed) < 0) { if (passed >= 0) close(passed); return; }
    char *args = strchr(line, ' ');
    if (args) *args++ = 0;
    pthread_mutex_lock(&mu);
    double t0 = now();
    const char *e = NULL;
    int was = checkpointed, step = !strcmp(line, "checkpoint") || !strcmp(line, "restore");
    if (!step && strcmp(line, "state") && strcmp(line, "pool")) e = "unknown command";
    else if (!strcmp(line, "pool")) e = passed < 0 ? "pool: no descriptor passed with it" : take_pool(passed);
    else if (step && asker_gone(fd)) {
        e = "asker gone before the step began: not run"; /* it timed out waiting behind another */
    } else if (step) {
        CUresult r = cu.ctxSetCurrent(owner_ctx);
        if (!r && !*s) r = cu.streamCreate(s, 1 /* CU_STREAM_NON_BLOCKING */);
        if (r) e = err_name(r);
        else if (line[0] == 'r') e = do_restore(*s);
        else if (!checkpointed) {
            drop_layout(); /* one a restore left to drop after its answer */
            e = lay_out(args);
            if (!e) e = do_checkpoint(*s);
            if (e) drop_layout();
        }
        if (!e && checkpointed != was && asker_gone(fd)) {
            /* the agent gave up waiting: put the process back as it was (into the layout it restored from) */
            if (was && layout_bytes() < total_bytes()) e = relay_out();
            if (!e) e = was ? do_checkpoint(*s) : do_restore(*s);
            say("%s finished after its asker left: undone%s", line, e ? " FAILED" : "");
        }
    }
    if (passed >= 0) close(passed);
    size_t in_pool = 0;
    for (size_t k = 0; checkpointed && k < n_segs; k++) if (segs[k].h != &own) in_pool += segs[k].len;
    char out[200];
    if (e) snprintf(out, sizeof out, "error %s\n", e);
    else snprintf(out, sizeof out, "ok %s %zu %.3f %.3f %zu\n", checkpointed ? "checkpointed" : "running", reported_bytes(),
                  now() - t0, line[0] == 'c' && checkpointed != was ? prep_waited : 0.0, in_pool);
    send(fd, out, strlen(out), MSG_NOSIGNAL);
    if (!checkpointed) drop_layout();
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
