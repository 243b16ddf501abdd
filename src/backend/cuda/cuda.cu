// backend/cuda: the CUDA backend object: device choice and listing, memory, the stream, errors,
// scratch buffers, and CUDA graphs of decode windows. The kernels live in the other .cu files.

#include <stdarg.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

// ---------------------------------------------------------------------------------------------
// Errors: ops are void, so the first failure is kept and reported by sync.

void st_cuda_fail_msg(st_cuda *c, const char *file, int line, const char *fmt, ...) {
    if (c->err) return;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(c->err_msg, sizeof c->err_msg, "GPU %d: %s (%s:%d)", c->device, msg, file, line);
    c->err = ST_ERR_IO;
}

void st_cuda_fail(st_cuda *c, cudaError_t e, const char *what, const char *file, int line) {
    if (e == cudaErrorMemoryAllocation) {
        if (!c->err) {
            snprintf(c->err_msg, sizeof c->err_msg, "GPU %d: out of memory in %s (%s:%d)", c->device, what,
                     file, line);
            c->err = ST_ERR_NOMEM;
        }
        return;
    }
    st_cuda_fail_msg(c, file, line, "%s: %s", what, cudaGetErrorString(e));
}

static st_status cuda_sync(st_backend *b) {
    st_cuda *c = st_cuda_of(b);
    st_cuda_join_shared(c);
    if (!c->capturing) ST_CU(c, cudaStreamSynchronize(c->stream));
    if (!c->err) return ST_OK;
    st_status s = st_fail(c->err, "%s", c->err_msg);
    c->err = ST_OK; // reported once; a sticky device fault shows again on the next call
    return s;
}

// ---------------------------------------------------------------------------------------------
// Memory

static void *cuda_alloc(st_backend *b, size_t bytes) {
    st_cuda *c = st_cuda_of(b);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        size_t free_b = 0, total = 0;
        cudaGetLastError(); // clear it: an allocation failure is not sticky
        cudaMemGetInfo(&free_b, &total);
        st_fail(ST_ERR_NOMEM, "GPU %d: cannot allocate %.1f MiB (%.1f MiB free of %.1f MiB): %s", c->device,
                bytes / 1048576.0, free_b / 1048576.0, total / 1048576.0, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cuda_free(st_backend *b, void *p) {
    if (p) ST_CU(st_cuda_of(b), cudaFree(p));
}

static void cuda_zero(st_backend *b, void *p, size_t bytes) {
    st_cuda *c = st_cuda_of(b);
    ST_CU(c, cudaMemsetAsync(p, 0, bytes, c->stream));
}

static size_t cuda_mem_free(st_backend *b) {
    st_cuda *c = st_cuda_of(b);
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 1; // unknown; but not "unlimited"
    return free_b > c->reserve ? free_b - c->reserve : 1;
}

static size_t cuda_mem_total(st_backend *b) {
    (void)b;
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 0;
    return total;
}

static void *cuda_upload(st_backend *b, const void *host, size_t bytes) {
    st_cuda *c = st_cuda_of(b);
    void *p = cuda_alloc(b, bytes);
    if (!p) return NULL;
    // Pageable source: the copy is staged by the driver and returns when the source was read.
    cudaError_t e = cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaFree(p);
        st_fail(ST_ERR_IO, "GPU %d: copying %.1f MiB of weights: %s", c->device, bytes / 1048576.0,
                cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cuda_to_host(st_backend *b, void *host, const void *src, size_t bytes) {
    st_cuda *c = st_cuda_of(b);
    st_cuda_join_shared(c); // (src may be the shared expert's output)
    ST_CU(c, cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    ST_CU(c, cudaStreamSynchronize(c->stream));
}

static void cuda_from_host_async(st_backend *b, void *dst, const void *host, size_t bytes) {
    st_cuda *c = st_cuda_of(b);
    ST_CU(c, cudaEventRecord(c->h2d_start, c->stream));
    ST_CU(c, cudaStreamWaitEvent(c->h2d, c->h2d_start, 0));
    ST_CU(c, cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, c->h2d));
    ST_CU(c, cudaEventRecord(c->h2d_end, c->h2d));
}

static bool cuda_h2d_done(st_backend *b) {
    st_cuda *c = st_cuda_of(b);
    cudaError_t e = cudaEventQuery(c->h2d_end);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) st_cuda_fail(c, e, "cudaEventQuery(h2d_end)", __FILE__, __LINE__);
    return true;
}

// STRATA_H2D_WAIT=1: every copy to the device waits for itself, as before the pinned slots (A/B
// runs); read once.
static bool h2d_wait(void) {
    static int on = -1;
    if (on < 0) on = st_env_is("STRATA_H2D_WAIT", "1");
    return on == 1;
}

static void cuda_from_host(st_backend *b, void *dst, const void *host, size_t bytes) {
    st_cuda *c = st_cuda_of(b);
    // Small copies (a step's ids and positions, one copy a step; a cache map entry): into a
    // pinned slot and queued on the stream, not waited for (a wait is a round trip to the GPU
    // before the step's graph can launch). The caller may reuse its buffer at once: the slot
    // holds the bytes. Larger copies wait as before.
    if (c->stage && bytes <= ST_STAGE_BYTES && !c->capturing && !h2d_wait()) {
        unsigned i = c->stage_next++ % ST_STAGE_SLOTS;
        if (c->stage_used >> i & 1u) ST_CU(c, cudaEventSynchronize(c->stage_ev[i])); // its last copy has left
        uint8_t *slot = c->stage + (size_t)i * ST_STAGE_BYTES;
        memcpy(slot, host, bytes);
        ST_CU(c, cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, c->stream));
        ST_CU(c, cudaEventRecord(c->stage_ev[i], c->stream));
        c->stage_used |= 1u << i;
        return;
    }
    ST_CU(c, cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, c->stream));
    // The host buffer may be reused as soon as we return (callers pass stack arrays).
    ST_CU(c, cudaStreamSynchronize(c->stream));
}

static void *cuda_host_alloc(st_backend *b, size_t bytes) {
    st_cuda *c = st_cuda_of(b);
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable | cudaHostAllocMapped);
    if (e != cudaSuccess) {
        cudaGetLastError(); // not sticky
        st_fail(ST_ERR_NOMEM, "GPU %d: cannot lock %.1f MiB of host memory: %s", c->device, bytes / 1048576.0,
                cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cuda_host_free(st_backend *b, void *p) {
    if (p) ST_CU(st_cuda_of(b), cudaFreeHost(p));
}

static void cuda_to_host_async(st_backend *b, void *host, const void *src, size_t bytes) {
    st_cuda *c = st_cuda_of(b);
    st_cuda_join_shared(c);
    ST_CU(c, cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    ST_CU(c, cudaEventRecord(c->copies, c->stream));
}

static void cuda_wait_copies(st_backend *b) {
    st_cuda *c = st_cuda_of(b);
    ST_CU(c, cudaEventSynchronize(c->copies));
}

// STRATA_CLUSTER=0: no clusters (cuda_common.cuh); read once.
bool st_cluster_on(void) {
    static int on = -1;
    if (on < 0) on = !st_env_is("STRATA_CLUSTER", "0");
    return on == 1;
}

int st_cluster_known(int device, const void *k, dim3 cluster, unsigned block, size_t smem, int max) {
    static struct {
        int device, max;
        dim3 cluster;
        const void *k;
        unsigned block;
        size_t smem;
    } seen[256];
    static int n_seen;
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; // (one thread a device)
    pthread_mutex_lock(&lock);
    int r = max;
    for (int i = 0; i < n_seen && r < 0; i++)
        if (seen[i].device == device && seen[i].k == k && seen[i].cluster.x == cluster.x &&
            seen[i].cluster.y == cluster.y && seen[i].cluster.z == cluster.z && seen[i].block == block &&
            seen[i].smem == smem)
            r = seen[i].max;
    if (max >= 0 && n_seen < 256) {
        seen[n_seen].device = device, seen[n_seen].k = k, seen[n_seen].cluster = cluster;
        seen[n_seen].block = block, seen[n_seen].smem = smem, seen[n_seen++].max = max;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

// The hybrid hand-off. The slot is mapped host memory (with unified addressing its host
// address works here): publish writes into it directly, every thread's writes fenced to the
// system before thread 0 raises the flag, so a host that sees the flag sees the data.
// With the logits, it routes the rows itself, straight into the slot (the device's ids and
// weights are left to the moe op, which routes for itself), so nothing on the device waits for
// it but collect: cuda_hand_publish runs it beside the layer's expert kernels.
__global__ void hand_publish_kernel(st_hand_args h) {
    st_pdl_begin();
    int t = threadIdx.x, na = h.n * h.k;
    bool miss = false;
    if (h.logits) {
        __shared__ st_route_smem rs;
        for (int i = 0; i < h.n; i++) {
            route_load(h.logits + (size_t)i * h.n_expert, h.n_expert, rs);
            __syncthreads();
            route_rank(h.n_expert, h.k, rs, true);
            route_weights(h.n_expert, h.k, rs, h.h_ids + (size_t)i * h.k, h.h_w + (size_t)i * h.k, NULL);
            if (t < h.k) {
                int e = rs.top[t];
                miss = miss || h.slot_map[e] < 0;
            }
            __syncthreads(); // the next row overwrites rs
        }
    } else {
        for (int a = t; a < na; a += blockDim.x) {
            int e = h.ids[a];
            h.h_ids[a] = e;
            h.h_w[a] = h.weights[a];
            miss = miss || (e >= 0 && e < h.n_expert && h.slot_map[e] < 0);
        }
    }
    int need = __syncthreads_or(miss);
    if (need)
        for (int i = t; i < h.n * h.d; i += blockDim.x) h.h_x[i] = h.x[i];
    __threadfence_system();
    __syncthreads();
    if (t == 0) {
        *h.need = need;
        ((volatile uint32_t *)h.pub)[1] = need;
        __threadfence_system();
        ((volatile uint32_t *)h.pub)[0] = *h.seq;
        __threadfence_system();
    }
}

__global__ void hand_collect_kernel(st_hand_args h) {
    st_pdl_begin();
    if (!*h.need) return;
    if (threadIdx.x == 0) {
        uint32_t want = *h.seq;
        const volatile uint32_t *done = h.done;
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        t = t0;
        while (*done != want) {
            __nanosleep(100);
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if (t - t0 > (unsigned long long)ST_HOST_WAIT_S * 1000000000ull) break; // the host is gone
        }
        if (h.wait_ns) *(volatile unsigned long long *)h.wait_ns = t - t0; // a posted write: no round trip
        __threadfence_system();
    }
    __syncthreads();
    const volatile float *src = h.h_y;
    for (int i = threadIdx.x; i < h.n * h.d; i += blockDim.x) h.y[i] += src[i];
}

// Given the logits of a window of a few rows (routed one after another in the kernel), publish
// runs on the side stream, forked from the queued work and joined by collect. Otherwise the
// router's kernel writes the ids first and publish copies them, in line.
static void cuda_hand_publish(st_backend *b, const st_hand_args *h) {
    st_cuda *c = st_cuda_of(b);
    const char *inl = getenv("STRATA_HAND_INLINE"); // A/B runs
    if (h->logits && route_folds(h->n_expert, h->k) && h->n <= 4 && !(inl && inl[0] == '1')) {
        ST_CU(c, cudaEventRecord(c->fork, c->stream));
        ST_CU(c, cudaStreamWaitEvent(c->side, c->fork, 0));
        st_launch_on(c, c->side, false, hand_publish_kernel, 1, 256, 0, *h);
        ST_CU_LAUNCHED(c, "hand_publish_kernel");
        ST_CU(c, cudaEventRecord(c->join, c->side));
        c->joining = true;
        return;
    }
    st_hand_args r = *h;
    if (h->logits) {
        st_cuda_moe_route(b, h->logits, h->n, h->n_expert, h->k, (int32_t *)h->ids, (float *)h->weights);
        r.logits = NULL;
    }
    st_launch(c, hand_publish_kernel, 1, 256, 0, r);
    ST_CU_LAUNCHED(c, "hand_publish_kernel");
}

// STRATA_HAND_NOCOLLECT=1 leaves the collect kernel out (the host's rows are not added; a
// measuring aid like STRATA_CUDA_SKIP: what the launch and the waits for the host cost a step).
static void cuda_hand_collect(st_backend *b, const st_hand_args *h) {
    st_cuda *c = st_cuda_of(b);
    if (c->joining) ST_CU(c, cudaStreamWaitEvent(c->stream, c->join, 0)); // publish on the side stream
    c->joining = false;
    if (st_env_is("STRATA_HAND_NOCOLLECT", "1")) return;
    st_launch(c, hand_collect_kernel, 1, 1024, 0, *h);
    ST_CU_LAUNCHED(c, "hand_collect_kernel");
}

static void cuda_copy(st_backend *b, float *dst, const float *src, int64_t n) {
    st_cuda *c = st_cuda_of(b);
    ST_CU(c, cudaMemcpyAsync(dst, src, sizeof(float) * (size_t)n, cudaMemcpyDeviceToDevice, c->stream));
}

void *st_cuda_scratch(st_cuda *c, int slot, size_t bytes) {
    if (bytes <= c->scratch_bytes[slot]) return c->scratch[slot];
    if (c->capturing) {
        st_cuda_fail_msg(c, __FILE__, __LINE__, "scratch %d must grow to %zu bytes while recording a graph", slot,
                         bytes);
        return NULL;
    }
    // Grow with headroom so a slowly rising size does not reallocate every call.
    size_t want = bytes + bytes / 4;
    if (c->scratch[slot]) {
        ST_CU(c, cudaStreamSynchronize(c->stream)); // kernels queued may still read the old one
        ST_CU(c, cudaFree(c->scratch[slot]));
    }
    c->scratch[slot] = NULL;
    c->scratch_bytes[slot] = 0;
    c->scratch_gen++;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
        cudaGetLastError();
        st_cuda_fail_msg(c, __FILE__, __LINE__, "out of memory for a %.1f MiB work buffer", want / 1048576.0);
        c->err = ST_ERR_NOMEM;
        return NULL;
    }
    c->scratch[slot] = p;
    c->scratch_bytes[slot] = want;
    return p;
}

// ---------------------------------------------------------------------------------------------
// Graphs. A window's work runs eagerly the first time (scratch buffers reach their size), is
// recorded the second time, and replayed from then on while no scratch buffer has moved.

typedef struct cuda_graph {
    cudaGraphExec_t exec;
    unsigned gen;   // scratch generation it was recorded with
    int runs;       // eager runs so far
    struct st_trace_labels *trace; // STRATA_CUDA_TRACE: its launches
} cuda_graph;

static void graph_launch(st_cuda *c, const cuda_graph *g) {
    if (c->trace) st_cuda_trace_reset(c);
    ST_CU(c, cudaGraphLaunch(g->exec, c->stream));
    if (c->trace) st_cuda_trace_replayed(c, g->trace);
}

static st_status cuda_run(st_backend *b, void **slot, st_work_fn fn, void *ctx) {
    st_cuda *c = st_cuda_of(b);
    if (b->eager || st_env_is("STRATA_CUDA_GRAPHS", "0") || st_env_is("STRATA_CUDA_PROFILE", "1")) return fn(ctx);
    cuda_graph *g = (cuda_graph *)*slot;
    if (!g) {
        g = (cuda_graph *)st_calloc(1, sizeof *g);
        if (!g) return ST_ERR_NOMEM;
        *slot = g;
    }
    if (g->exec && g->gen == c->scratch_gen) {
        graph_launch(c, g);
        return ST_OK;
    }
    if (g->exec) {
        cudaGraphExecDestroy(g->exec);
        g->exec = NULL;
        g->runs = 0;
    }
    if (g->runs++ < 1) return fn(ctx);
    unsigned gen = c->scratch_gen;
    cudaGraph_t graph = NULL;
    ST_CU(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    if (c->err) return cuda_sync(b);
    c->capturing = true;
    st_cuda_trace_free(st_cuda_trace_take(c));
    st_status s = fn(ctx);
    st_cuda_join_shared(c); // (a recording ends with every fork joined)
    c->capturing = false;
    st_cuda_trace_free(g->trace);
    g->trace = st_cuda_trace_take(c);
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    if (s) {
        if (graph) cudaGraphDestroy(graph);
        return s;
    }
    if (e != cudaSuccess || c->err || gen != c->scratch_gen) {
        if (graph) cudaGraphDestroy(graph);
        if (e != cudaSuccess) st_cuda_fail(c, e, "recording a decode graph", __FILE__, __LINE__);
        cudaGetLastError();
        return cuda_sync(b);
    }
    ST_CU(c, cudaGraphInstantiate(&g->exec, graph, 0));
    cudaGraphDestroy(graph);
    if (c->err) return cuda_sync(b);
    g->gen = gen;
    graph_launch(c, g);
    return ST_OK;
}

static void cuda_graph_free(st_backend *b, void *graph) {
    (void)b;
    cuda_graph *g = (cuda_graph *)graph;
    if (!g) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    st_cuda_trace_free(g->trace);
    st_free(g);
}

// ---------------------------------------------------------------------------------------------
// The backend

static void cuda_destroy(st_backend *b) {
    st_cuda *c = st_cuda_of(b);
    cudaStreamSynchronize(c->stream);
    st_cuda_profile_report(c);
    st_cuda_trace_stop(c);
    for (int i = 0; i < ST_SCR_COUNT; i++)
        if (c->scratch[i]) cudaFree(c->scratch[i]);
    if (c->cublas) cublasDestroy(c->cublas);
    if (c->copies) cudaEventDestroy(c->copies);
    if (c->fork) cudaEventDestroy(c->fork);
    if (c->join) cudaEventDestroy(c->join);
    if (c->sh_fork) cudaEventDestroy(c->sh_fork);
    if (c->sh_join) cudaEventDestroy(c->sh_join);
    if (c->side) cudaStreamDestroy(c->side);
    if (c->h2d) cudaStreamSynchronize(c->h2d), cudaStreamDestroy(c->h2d);
    for (int i = 0; i < ST_STAGE_SLOTS; i++)
        if (c->stage_ev[i]) cudaEventDestroy(c->stage_ev[i]);
    if (c->stage) cudaFreeHost(c->stage);
    if (c->h2d_start) cudaEventDestroy(c->h2d_start);
    if (c->h2d_end) cudaEventDestroy(c->h2d_end);
    if (c->stream) cudaStreamDestroy(c->stream);
    st_pool_free(b->pool);
    st_free(b->scratch);
    st_free(c);
}

static const st_backend_ops cuda_ops = {
    .name = "cuda",
    .host_memory = false,
    .destroy = cuda_destroy,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .upload = cuda_upload,
    .sync = cuda_sync,
    .run = cuda_run,
    .graph_free = cuda_graph_free,
    .zero = cuda_zero,
    .mem_free = cuda_mem_free,
    .mem_total = cuda_mem_total,
    .matmul = st_cuda_matmul,
    .matmul_many = st_cuda_matmul_many,
    .get_rows = st_cuda_get_rows,
    .rmsnorm = st_cuda_rmsnorm,
    .rmsnorm_silu = st_cuda_rmsnorm_silu,
    .norm_matmul = st_cuda_norm_matmul,
    .norm_rope = st_cuda_norm_rope,
    .l2norm = st_cuda_l2norm,
    .rope = st_cuda_rope,
    .attention = st_cuda_attention,
    .conv = st_cuda_conv,
    .gdn = st_cuda_gdn,
    .gdn_chunked = st_cuda_gdn_chunked,
    .gdn_chunked_from = ST_CUDA_GDN_CHUNKED_FROM,
    .deltanet = st_cuda_deltanet,
    .add = st_cuda_add,
    .swiglu = st_cuda_swiglu,
    .mul_sigmoid = st_cuda_mul_sigmoid,
    .mul_silu = st_cuda_mul_silu,
    .add_gated_rows = st_cuda_add_gated_rows,
    .shared_ffn = st_cuda_shared_ffn,
    .gdn_gates = st_cuda_gdn_gates,
    .split_heads = st_cuda_split_heads,
    .copy_cols = st_cuda_copy_cols,
    .copy = cuda_copy,
    .moe_route = st_cuda_moe_route,
    .moe = st_cuda_moe,
    .argmax = st_cuda_argmax,
    .to_host = cuda_to_host,
    .from_host = cuda_from_host,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .to_host_async = cuda_to_host_async,
    .wait_copies = cuda_wait_copies,
    .from_host_async = cuda_from_host_async,
    .h2d_done = cuda_h2d_done,
    .hand_publish = cuda_hand_publish,
    .hand_collect = cuda_hand_collect,
};

// A decode window's shared expert on the side stream, forked after the router and joined before
// the routed experts' down kernel, which adds its gated output: its products, swiglu and down
// product (~10 us a layer in line on the H200 at the Next-80B-A3B shape) then overlap the routed
// gate/up kernel, which leaves multiprocessors and memory bandwidth unused (2026-12-01, an
// 8-layer model of that shape: decode +9%, ~8 us a layer; the same tokens). Its ops launch on
// side by pointing the backend's stream there for the call (the windows' products quantize their
// input in shared memory: no scratch buffer is shared with the main stream's kernels), without
// programmatic launch (they follow an event). In line: larger windows, a hybrid layer's pending
// publish (which has side), the profiling wrappers (their timers and labels follow the main
// stream), and STRATA_SHARED_SIDE=0 (for tests and A/B runs); read once.
#define SHARED_SIDE_ROWS 4 // (quant_matmul.cu's ST_MV_FUSED_MAX: inputs quantized in shared memory)
static bool shared_side_on(void) {
    static int on = -1;
    if (on < 0) on = !st_env_is("STRATA_SHARED_SIDE", "0");
    return on == 1;
}

// Whether the window's products quantize their input in shared memory (quant_matmul.cu's
// mmv2_launch: 16-byte aligned rows of whole blocks of 32, at most 48 KB of them with their
// scales), so none of them touches the scratch buffer the main stream's kernels share;
// STRATA_CUQ_OLD=1's kernels quantize into it.
static bool shared_side_private(const st_shared_ffn_args *a) {
    auto fits = [&](int64_t cols) { return cols % 32 == 0 && (size_t)a->n * cols * 5 / 4 <= 48 * 1024; };
    return fits(a->gate->cols) && fits(a->down->cols) && ((uintptr_t)a->x & 15) == 0 && ((uintptr_t)a->g & 15) == 0 &&
           !st_env_is("STRATA_CUQ_OLD", "1");
}

void st_cuda_shared_ffn(st_backend *b, const st_shared_ffn_args *a) {
    st_cuda *c = st_cuda_of(b);
    if (!shared_side_on() || a->n > SHARED_SIDE_ROWS || c->joining || c->sh_pending || b->ops != &cuda_ops || c->err ||
        !shared_side_private(a)) {
        st_shared_ffn_ops(b, a);
        return;
    }
    ST_CU(c, cudaEventRecord(c->sh_fork, c->stream));
    ST_CU(c, cudaStreamWaitEvent(c->side, c->sh_fork, 0));
    cudaStream_t main_stream = c->stream;
    bool pdl = c->pdl;
    c->stream = c->side, c->pdl = false;
    st_shared_ffn_ops(b, a);
    c->stream = main_stream, c->pdl = pdl;
    ST_CU(c, cudaEventRecord(c->sh_join, c->side));
    c->sh_pending = true;
}

void st_cuda_join_shared(st_cuda *c) {
    if (!c->sh_pending) return;
    ST_CU(c, cudaStreamWaitEvent(c->stream, c->sh_join, 0));
    c->sh_pending = false;
}

extern "C" bool st_cuda_available(void) { return true; }

// PCIe link of a device through sysfs (the runtime does not report it); 0 when unknown.
static void pcie_link(int device, int *gen, int *width) {
    *gen = *width = 0;
    char bus[32];
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) != cudaSuccess) return;
    for (char *p = bus; *p; p++) *p = (char)(*p >= 'A' && *p <= 'F' ? *p - 'A' + 'a' : *p);
    char path[160], buf[64];
    // sysfs names the device with a 4-digit domain; the runtime may give 8 digits.
    const char *id = strlen(bus) > 12 ? bus + strlen(bus) - 12 : bus;
    snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/current_link_speed", id);
    FILE *f = fopen(path, "r");
    if (f) {
        if (fgets(buf, sizeof buf, f)) {
            double gts = atof(buf); // "32.0 GT/s PCIe"
            *gen = gts >= 60 ? 6 : gts >= 30 ? 5 : gts >= 15 ? 4 : gts >= 7 ? 3 : gts >= 4 ? 2 : gts > 0 ? 1 : 0;
        }
        fclose(f);
    }
    snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/current_link_width", id);
    f = fopen(path, "r");
    if (f) {
        if (fgets(buf, sizeof buf, f)) *width = atoi(buf);
        fclose(f);
    }
}

extern "C" st_status st_cuda_devices(st_gpu_info *out, int max, int *n, char *why, size_t why_len) {
    *n = 0;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        if (why) snprintf(why, why_len, "no usable NVIDIA driver or GPU (%s)", cudaGetErrorString(e));
        return ST_OK;
    }
    if (count == 0 && why) snprintf(why, why_len, "no NVIDIA GPU found");
    for (int i = 0; i < count && *n < max; i++) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
        st_gpu_info *g = &out[(*n)++];
        memset(g, 0, sizeof *g);
        g->index = i;
        snprintf(g->name, sizeof g->name, "%s", p.name);
        g->vram_total = p.totalGlobalMem;
        g->cc_major = p.major;
        g->cc_minor = p.minor;
        g->sm_count = p.multiProcessorCount;
        int clock_khz = 0;
        cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, i);
        g->clock_mhz = clock_khz / 1000;
        pcie_link(i, &g->pcie_gen, &g->pcie_width);
        int prev = 0;
        cudaGetDevice(&prev);
        if (cudaSetDevice(i) == cudaSuccess) {
            size_t free_b = 0, total = 0;
            if (cudaMemGetInfo(&free_b, &total) == cudaSuccess) g->vram_free = free_b;
            cudaSetDevice(prev);
        }
        cudaGetLastError();
        g->usable = p.major * 10 + p.minor >= 75;
        if (!g->usable)
            snprintf(g->why, sizeof g->why, "not supported - older than the RTX 20 series (compute capability %d.%d; "
                     "Strata needs 7.5 or newer)", p.major, p.minor);
    }
    return ST_OK;
}

extern "C" double st_cuda_copy_gbs(int device) {
    size_t bytes = (size_t)1 << 30;
    char *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ms = 0;
    double gbs = 0;
    if (cudaSetDevice(device) == cudaSuccess && cudaMalloc(&a, bytes) == cudaSuccess &&
        cudaMalloc(&b, bytes) == cudaSuccess && cudaEventCreate(&e0) == cudaSuccess &&
        cudaEventCreate(&e1) == cudaSuccess) {
        cudaMemset(a, 1, bytes);
        cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice); // warm-up
        cudaEventRecord(e0);
        for (int i = 0; i < 10; i++) cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
        cudaEventRecord(e1);
        if (cudaEventSynchronize(e1) == cudaSuccess && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms > 0)
            gbs = 10 * 2.0 * bytes / (ms * 1e-3) / 1e9;
    }
    cudaGetLastError();
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return gbs;
}

extern "C" st_status st_backend_cuda_create(int device, size_t reserve_bytes, int n_threads, st_backend **out) {
    *out = NULL;
    if (n_threads < 1) return st_fail(ST_ERR_ARG, "threads: %d (must be at least 1)", n_threads);
    st_gpu_info gpus[64];
    int n = 0;
    char why[256] = "";
    st_cuda_devices(gpus, 64, &n, why, sizeof why);
    if (n == 0) return st_fail(ST_ERR_UNSUPPORTED, "cannot use a GPU: %s", why);
    if (device < 0 || device >= n)
        return st_fail(ST_ERR_ARG, "--gpu %d: this machine has %d GPU%s (0 .. %d)", device, n, n == 1 ? "" : "s", n - 1);
    if (!gpus[device].usable) return st_fail(ST_ERR_UNSUPPORTED, "GPU %d (%s): %s", device, gpus[device].name, gpus[device].why);
    st_cuda *c = (st_cuda *)st_calloc(1, sizeof *c);
    if (!c) return ST_ERR_NOMEM;
    c->device = device;
    c->reserve = reserve_bytes;
    const char *skip = getenv("STRATA_CUDA_SKIP");
    bool timing = st_env_is("STRATA_CUDA_PROFILE", "1"), trace = st_env_is("STRATA_CUDA_TRACE", "1");
    c->base.ops = timing || trace || (skip && *skip) ? st_cuda_profile_ops(&cuda_ops, timing, skip) : &cuda_ops;
    st_status s = ST_OK;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&c->prop, device);
    c->pdl = e == cudaSuccess && c->prop.major >= 9 && !st_env_is("STRATA_CUDA_PDL", "0");
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->copies, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->join, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->sh_fork, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->sh_join, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->h2d, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->h2d_start, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->h2d_end, cudaEventDisableTiming);
    for (int i = 0; i < ST_STAGE_SLOTS && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&c->stage_ev[i], cudaEventDisableTiming);
    if (e != cudaSuccess) s = st_fail(ST_ERR_IO, "GPU %d: cannot start: %s", device, cudaGetErrorString(e));
    // The pinned slots of small copies (without them, each copy waits for itself).
    if (!s && cudaHostAlloc((void **)&c->stage, (size_t)ST_STAGE_SLOTS * ST_STAGE_BYTES, cudaHostAllocPortable) !=
                  cudaSuccess) {
        cudaGetLastError(); // not sticky
        c->stage = NULL;
    }
    if (!s && cublasCreate(&c->cublas) != CUBLAS_STATUS_SUCCESS)
        s = st_fail(ST_ERR_IO, "GPU %d: cannot start cuBLAS", device);
    if (!s) cublasSetStream(c->cublas, c->stream);
    if (!s && trace && !timing) st_cuda_trace_start(c);
    if (!s) {
        c->base.pool = st_pool_create(n_threads);
        if (!c->base.pool) s = st_fail(ST_ERR_NOMEM, "cannot start %d CPU threads", n_threads);
    }
    if (s) {
        cuda_destroy(&c->base);
        return s;
    }
    *out = &c->base;
    return ST_OK;
}

// STRATA_CUDA_TRACE: binds this file's copy of st_trace (cuda_common.cuh).
cudaError_t st_trace_bind_cuda(const st_trace_dev *t) { return st_trace_bind_unit(t); }
