// backend/cuda: STRATA_CUDA_PROFILE=1 times every op with CUDA events (each op waited for, graphs
// off) and prints a table of where the GPU time went when the backend closes: per op, and per
// weight type and shape for the matrix products. STRATA_CUDA_SKIP=KEY[,KEY...] leaves out the
// ops whose table key starts with a KEY (graphs stay on, outputs are wrong): what a step loses
// without an op is that op's cost inside the graph, which timing an op alone cannot show.
// STRATA_CUDA_TRACE=1 times each kernel inside the replayed graphs (cuda_common.cuh, st_pdl_begin)
// and prints their shares of the steps, by op and launch, at close (Hopper and newer).

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cuda_common.cuh"

typedef struct prof_entry {
    char key[96];
    int64_t calls;  // after the first
    double ms;      // GPU time between the events around the op (host gaps inside it included)
    double host_ms; // the host's time in the op's call (launches, and any wait inside it)
    double first_ms; // the first call's GPU time, kept apart: it loads the op's kernels (and
                     // cuBLAS's) and grows its buffers, up to tens of ms that would swamp the mean
} prof_entry;

#define PROF_MAX 512
static prof_entry prof[PROF_MAX];
static int n_prof;
static const st_backend_ops *inner; // the real ops
static cudaEvent_t ev0, ev1;
static bool timing;     // STRATA_CUDA_PROFILE
static char skip[1024]; // STRATA_CUDA_SKIP, ',' separated prefixes of keys

static bool skipped(const char *key) {
    for (const char *p = skip; *p;) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n && !strncmp(key, p, n)) return true;
        if (!e) break;
        p = e + 1;
    }
    return false;
}

static double host_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void prof_add(const char *key, double ms, double host_ms) {
    int i = 0;
    while (i < n_prof && strcmp(prof[i].key, key)) i++;
    if (i == n_prof) {
        if (n_prof == PROF_MAX) return;
        prof[n_prof] = prof_entry{}; // (a table printed at a model's close starts again)
        snprintf(prof[n_prof++].key, sizeof prof[0].key, "%s", key);
        prof[i].first_ms = ms;
        return;
    }
    prof[i].calls++;
    prof[i].ms += ms;
    prof[i].host_ms += host_ms;
}

// ---------------------------------------------------------------------------------------------
// STRATA_CUDA_TRACE. A launch is labelled with its op's key and its number within the op; a
// recorded graph keeps its launches' labels, and after each replay the records (one per kernel,
// in launch order: kernel i + 1 passes its wait only after kernel i, which noted its record
// before, has finished) are matched to them. Kernel i's share of the step is kernel i + 1's
// release minus its own; the last kernel of a graph has no successor and is not counted.

#define TRACE_CAP 16384
#define TRACE_LABEL 160

struct st_trace_labels {
    int n, cap;
    char (*label)[TRACE_LABEL];
};

typedef struct trace_entry {
    char label[TRACE_LABEL];
    int64_t calls;
    double ns, early_ns; // share of the steps; time resident before the release
    double mark_ns[ST_TRACE_MARKS]; // st_trace_mark's points after the release (summed over marks)
    int64_t mark_n[ST_TRACE_MARKS];
    double end_ns[3];               // half, nine tenths, all of the blocks ended (st_trace_end), summed
    double end_blocks;              // blocks counted, summed
    int64_t end_n;                  // launches with blocks counted
    // STRATA_CUDA_TRACE_SM: (multiprocessor, launch) pairs by the blocks of the launch that ended
    // on that multiprocessor (index 8: eight or more), and when the last of them ended, summed.
    int64_t sm_n[9];
    double sm_last_ns[9];
} trace_entry;

#define TRACE_MAX 1024
static trace_entry trace_tab[TRACE_MAX];
static int n_trace;
static int64_t trace_replays, trace_mismatch, trace_backwards;
static double trace_step_ns;
static st_trace_dev trace_dev;           // device buffers (seq, rec)
static unsigned long long *trace_host;   // a replay's records, read back
static unsigned long long *trace_marks;  // and its marks
static unsigned *trace_ends;             // and its histogram of block ends
static unsigned *trace_sm_ends;          // and by multiprocessor (STRATA_CUDA_TRACE_SM)
static char trace_sm_watch[64];          // STRATA_CUDA_TRACE_SM: launches whose label contains it
static char trace_blk_path[512];         // STRATA_CUDA_TRACE_BLOCKS: the file for one replay's blocks
static bool trace_blk_written;
#define TRACE_BLK_CAP (1u << 18)         // block records a replay
#define TRACE_BLK_REPLAY 64              // the counted replay whose blocks are written

static void trace_op(st_backend *b, const char *key) {
    st_cuda *c = st_cuda_of(b);
    if (!c->trace) return;
    snprintf(c->trace_op, sizeof c->trace_op, "%s", key);
    c->trace_k = 0;
}

static void trace_buffers_free(void) {
    cudaFree(trace_dev.seq);
    cudaFree(trace_dev.rec);
    cudaFree(trace_dev.marks);
    cudaFree(trace_dev.ends);
    cudaFree(trace_dev.sm_ends);
    cudaFree(trace_dev.blk);
    cudaFree(trace_dev.blk_n);
    free(trace_sm_ends);
    trace_sm_ends = NULL;
    free(trace_host);
    free(trace_marks);
    free(trace_ends);
    trace_dev = st_trace_dev{};
    trace_host = NULL;
    trace_marks = NULL;
    trace_ends = NULL;
}

bool st_cuda_trace_start(st_cuda *c) {
    if (trace_dev.seq) { // one buffer, bound on one device
        fprintf(stderr, "STRATA_CUDA_TRACE: tracing another GPU already; not tracing GPU %d\n", c->device);
        return false;
    }
    if (!c->pdl) {
        fprintf(stderr, "STRATA_CUDA_TRACE: needs programmatic dependent launch (compute capability 9.0 or newer, "
                        "STRATA_CUDA_PDL not 0): not tracing\n");
        return false;
    }
    trace_host = (unsigned long long *)malloc(sizeof(unsigned long long) * 2 * TRACE_CAP);
    trace_marks = (unsigned long long *)malloc(sizeof(unsigned long long) * ST_TRACE_MARKS * TRACE_CAP);
    trace_ends = (unsigned *)malloc(sizeof(unsigned) * ST_TRACE_BINS);
    trace_dev.cap = TRACE_CAP;
    cudaError_t e = trace_host && trace_marks && trace_ends ? cudaSuccess : cudaErrorMemoryAllocation;
    if (e == cudaSuccess) e = cudaMalloc((void **)&trace_dev.seq, sizeof(unsigned));
    if (e == cudaSuccess) e = cudaMalloc((void **)&trace_dev.rec, sizeof(unsigned long long) * 2 * TRACE_CAP);
    if (e == cudaSuccess) e = cudaMalloc((void **)&trace_dev.marks, sizeof(unsigned long long) * ST_TRACE_MARKS * TRACE_CAP);
    if (e == cudaSuccess) e = cudaMemset(trace_dev.marks, 0, sizeof(unsigned long long) * ST_TRACE_MARKS * TRACE_CAP);
    if (e == cudaSuccess) e = cudaMalloc((void **)&trace_dev.ends, sizeof(unsigned) * ST_TRACE_BINS);
    if (e == cudaSuccess) e = cudaMemset(trace_dev.ends, 0, sizeof(unsigned) * ST_TRACE_BINS);
    const char *watch = getenv("STRATA_CUDA_TRACE_SM");
    snprintf(trace_sm_watch, sizeof trace_sm_watch, "%s", watch ? watch : "");
    if (trace_sm_watch[0]) {
        size_t sm_bytes = sizeof(unsigned) * ST_TRACE_SMS * ST_TRACE_SM_BINS;
        trace_sm_ends = (unsigned *)malloc(sm_bytes);
        if (e == cudaSuccess && !trace_sm_ends) e = cudaErrorMemoryAllocation;
        if (e == cudaSuccess) e = cudaMalloc((void **)&trace_dev.sm_ends, sm_bytes);
        if (e == cudaSuccess) e = cudaMemset(trace_dev.sm_ends, 0, sm_bytes);
    }
    const char *at = getenv("STRATA_CUDA_TRACE_MARK_BLOCK");
    if (at && sscanf(at, "%u,%u,%u", &trace_dev.mark_at[0], &trace_dev.mark_at[1], &trace_dev.mark_at[2]) != 3) {
        fprintf(stderr, "STRATA_CUDA_TRACE_MARK_BLOCK: '%s' is not X,Y,Z (a block index); marking block 0\n", at);
        trace_dev.mark_at[0] = trace_dev.mark_at[1] = trace_dev.mark_at[2] = 0;
    }
    const char *blk = getenv("STRATA_CUDA_TRACE_BLOCKS");
    snprintf(trace_blk_path, sizeof trace_blk_path, "%s", blk ? blk : "");
    trace_blk_written = false;
    if (trace_blk_path[0]) {
        trace_dev.blk_cap = TRACE_BLK_CAP;
        if (e == cudaSuccess) e = cudaMalloc((void **)&trace_dev.blk, sizeof(unsigned long long) * 3 * TRACE_BLK_CAP);
        if (e == cudaSuccess) e = cudaMalloc((void **)&trace_dev.blk_n, sizeof(unsigned));
        if (e == cudaSuccess) e = cudaMemset(trace_dev.blk_n, 0, sizeof(unsigned));
    }
    if (e == cudaSuccess) e = cudaMemset(trace_dev.seq, 0, sizeof(unsigned));
    cudaError_t (*bind[])(const st_trace_dev *) = {st_trace_bind_attention, st_trace_bind_cuda, st_trace_bind_gdn,
                                                   st_trace_bind_ops, st_trace_bind_quant};
    for (size_t i = 0; i < sizeof bind / sizeof bind[0] && e == cudaSuccess; i++) e = bind[i](&trace_dev);
    if (e != cudaSuccess) {
        fprintf(stderr, "STRATA_CUDA_TRACE: cannot start: %s; not tracing\n", cudaGetErrorString(e));
        cudaGetLastError();
        trace_buffers_free();
        return false;
    }
    fprintf(stderr, "STRATA_CUDA_TRACE: timing the kernels of replayed graphs (a wait after each replay)\n");
    c->trace = true;
    return true;
}

// A launch's label also says when its blocks cannot all be resident at once (the kernel alone on
// the card): a second wave starts only as the first ends, with nothing fetched early.
void st_cuda_trace_launch(st_cuda *c, const void *k, dim3 grid, dim3 block, size_t smem) {
    if (!c->capturing) return; // only recordings are matched to records
    st_trace_labels *l = c->trace_labels;
    if (!l) l = c->trace_labels = (st_trace_labels *)calloc(1, sizeof *l);
    if (!l) return;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 512;
        void *p = realloc(l->label, sizeof l->label[0] * (size_t)cap);
        if (!p) return;
        l->label = (char(*)[TRACE_LABEL])p, l->cap = cap;
    }
    char waves[96] = "";
    int per_sm = 0;
    unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, (int)(block.x * block.y * block.z), smem) != cudaSuccess)
        cudaGetLastError(), per_sm = 0;
    unsigned long long once = (unsigned long long)per_sm * (unsigned long long)c->prop.multiProcessorCount;
    if (once && blocks > once)
        snprintf(waves, sizeof waves, " [%llu waves: %llu blocks, %llu at once]", (blocks + once - 1) / once, blocks, once);
    snprintf(l->label[l->n++], TRACE_LABEL, "%s #%d%s", c->trace_op[0] ? c->trace_op : "(outside an op)", ++c->trace_k,
             waves);
}

st_trace_labels *st_cuda_trace_take(st_cuda *c) {
    st_trace_labels *l = c->trace_labels;
    c->trace_labels = NULL;
    return l;
}

void st_cuda_trace_free(st_trace_labels *l) {
    if (!l) return;
    free(l->label);
    free(l);
}

// The blocks of a kernel released at t0 that ended before t1 (the next kernel's release), from
// the histogram of end times: when half, nine tenths and all of them had ended (after t0, ns;
// each end at its bin's middle). Returns how many (0: the kernel counts no ends).
static unsigned trace_ends_between(unsigned long long t0, unsigned long long t1, double at[3]) {
    unsigned long long b0 = t0 >> ST_TRACE_BIN_SHIFT, b1 = t1 >> ST_TRACE_BIN_SHIFT;
    if (b1 <= b0 || b1 - b0 >= ST_TRACE_BINS) return 0;
    unsigned total = 0;
    for (unsigned long long b = b0; b < b1; b++) total += trace_ends[b & (ST_TRACE_BINS - 1)];
    if (!total) return 0;
    const double frac[3] = {0.5, 0.9, 1.0};
    unsigned seen = 0;
    int k = 0;
    for (unsigned long long b = b0; b < b1 && k < 3; b++) {
        seen += trace_ends[b & (ST_TRACE_BINS - 1)];
        double mid = (double)(((b << ST_TRACE_BIN_SHIFT) + (1ull << (ST_TRACE_BIN_SHIFT - 1)))) - (double)t0;
        while (k < 3 && seen >= frac[k] * total) at[k++] = mid;
    }
    return total;
}

static void trace_add(const char *label, double ns, double early, unsigned long long released,
                      unsigned long long next, const unsigned long long *marks) {
    int i = 0;
    while (i < n_trace && strcmp(trace_tab[i].label, label)) i++;
    if (i == n_trace) {
        if (n_trace == TRACE_MAX) return;
        trace_tab[n_trace] = trace_entry{};
        snprintf(trace_tab[n_trace++].label, TRACE_LABEL, "%s", label);
    }
    trace_tab[i].calls++;
    trace_tab[i].ns += ns;
    trace_tab[i].early_ns += early;
    for (int k = 0; k < ST_TRACE_MARKS; k++)
        if (marks[k]) { // (a point may come before the release: a negative time)
            trace_tab[i].mark_ns[k] += (double)(long long)(marks[k] - released);
            trace_tab[i].mark_n[k]++;
        }
    double at[3];
    unsigned blocks = next > released ? trace_ends_between(released, next, at) : 0;
    if (blocks) {
        for (int k = 0; k < 3; k++) trace_tab[i].end_ns[k] += at[k];
        trace_tab[i].end_blocks += blocks;
        trace_tab[i].end_n++;
    }
    if (blocks && trace_sm_ends && strstr(label, trace_sm_watch)) {
        unsigned long long b0 = released >> ST_TRACE_BIN_SHIFT, b1 = next >> ST_TRACE_BIN_SHIFT;
        if (b1 - b0 >= ST_TRACE_SM_BINS) return;
        for (int sm = 0; sm < ST_TRACE_SMS; sm++) {
            const unsigned *h = trace_sm_ends + (size_t)sm * ST_TRACE_SM_BINS;
            unsigned n = 0;
            unsigned long long last = 0;
            for (unsigned long long b = b0; b < b1; b++) {
                unsigned c = h[b & (ST_TRACE_SM_BINS - 1)];
                if (c) n += c, last = b;
            }
            if (!n) continue;
            int k = n < 8 ? (int)n : 8;
            trace_tab[i].sm_n[k]++;
            trace_tab[i].sm_last_ns[k] +=
                (double)((last << ST_TRACE_BIN_SHIFT) + (1ull << (ST_TRACE_BIN_SHIFT - 1))) - (double)released;
        }
    }
}

// STRATA_CUDA_TRACE_BLOCKS: this replay's block records to the file, one line a block with its
// launch (the kernel whose release came last before the block's end), us after that release.
static void trace_blocks_write(const st_trace_labels *l, unsigned n) {
    unsigned nb = 0;
    unsigned long long *r = NULL;
    FILE *f = NULL;
    if (cudaMemcpy(&nb, trace_dev.blk_n, sizeof nb, cudaMemcpyDeviceToHost) != cudaSuccess) goto fail;
    if (nb > trace_dev.blk_cap) nb = trace_dev.blk_cap;
    r = (unsigned long long *)malloc(sizeof(unsigned long long) * 3 * (nb ? nb : 1));
    if (!r || cudaMemcpy(r, trace_dev.blk, sizeof(unsigned long long) * 3 * nb, cudaMemcpyDeviceToHost) != cudaSuccess)
        goto fail;
    f = fopen(trace_blk_path, "w");
    if (!f) {
        fprintf(stderr, "STRATA_CUDA_TRACE_BLOCKS: cannot write %s\n", trace_blk_path);
        free(r);
        return;
    }
    fprintf(f, "launch,label,block_x,block_y,block_z,sm,release_us,end_us\n");
    for (unsigned b = 0; b < nb; b++) {
        const unsigned long long *x = r + 3 * (size_t)b;
        unsigned lo = 0, hi = n; // the last launch released at or before the block's end
        while (hi - lo > 1) {
            unsigned mid = (lo + hi) / 2;
            if (trace_host[2 * mid + 1] <= x[1]) lo = mid;
            else hi = mid;
        }
        double t0 = (double)trace_host[2 * lo + 1];
        fprintf(f, "%u,\"%s\",%llu,%llu,%llu,%llu,%.3f,%.3f\n", lo, l->label[lo], (x[2] >> 8) & 0xffffffull,
                (x[2] >> 32) & 0xffffull, x[2] >> 48, x[2] & 0xffull, ((double)x[0] - t0) / 1e3, ((double)x[1] - t0) / 1e3);
    }
    fclose(f);
    fprintf(stderr, "STRATA_CUDA_TRACE_BLOCKS: %u blocks of replay %d written to %s\n", nb, TRACE_BLK_REPLAY,
            trace_blk_path);
    free(r);
    return;
fail:
    cudaGetLastError();
    free(r);
    fprintf(stderr, "STRATA_CUDA_TRACE_BLOCKS: cannot read the block records back\n");
}

// After a replay of the graph whose launches l labels (queued on c->stream with the records
// reset before it): waits for it and adds its kernels' times.
void st_cuda_trace_replayed(st_cuda *c, const st_trace_labels *l) {
    unsigned n = 0;
    if (cudaStreamSynchronize(c->stream) != cudaSuccess ||
        cudaMemcpy(&n, trace_dev.seq, sizeof n, cudaMemcpyDeviceToHost) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    if (!l || n != (unsigned)l->n || n < 2 || n > TRACE_CAP) {
        if (!trace_mismatch++)
            fprintf(stderr, "STRATA_CUDA_TRACE: a replay wrote %u records for %d launches: not counted\n", n, l ? l->n : 0);
        return;
    }
    if (cudaMemcpy(trace_host, trace_dev.rec, sizeof(unsigned long long) * 2 * n, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(trace_marks, trace_dev.marks, sizeof(unsigned long long) * ST_TRACE_MARKS * n,
                   cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(trace_ends, trace_dev.ends, sizeof(unsigned) * ST_TRACE_BINS, cudaMemcpyDeviceToHost) != cudaSuccess ||
        (trace_sm_ends && cudaMemcpy(trace_sm_ends, trace_dev.sm_ends, sizeof(unsigned) * ST_TRACE_SMS * ST_TRACE_SM_BINS,
                                     cudaMemcpyDeviceToHost) != cudaSuccess)) {
        cudaGetLastError();
        return;
    }
    // Kernel i + 1 is released after kernel i, but the records come from different
    // multiprocessors, whose %globaltimer readings may disagree by a tick: a pair out of order
    // counts as 0 (and is counted), which averages out over many replays.
    for (unsigned i = 0; i + 1 < n; i++) {
        unsigned long long r0 = trace_host[2 * i + 1], r1 = trace_host[2 * i + 3], at = trace_host[2 * i];
        if (r1 < r0) trace_backwards++;
        trace_add(l->label[i], r1 > r0 ? (double)(r1 - r0) : 0.0, r0 > at ? (double)(r0 - at) : 0.0, r0, r1,
                  trace_marks + (size_t)i * ST_TRACE_MARKS);
    }
    trace_step_ns += (double)(trace_host[2 * n - 1] - trace_host[1]);
    trace_replays++;
    if (trace_dev.blk && !trace_blk_written && trace_replays == TRACE_BLK_REPLAY) {
        trace_blk_written = true;
        trace_blocks_write(l, n);
    }
}

// Resets the records before a replay (queued on the stream).
void st_cuda_trace_reset(st_cuda *c) {
    cudaMemsetAsync(trace_dev.seq, 0, sizeof(unsigned), c->stream);
    cudaMemsetAsync(trace_dev.marks, 0, sizeof(unsigned long long) * ST_TRACE_MARKS * TRACE_CAP, c->stream);
    cudaMemsetAsync(trace_dev.ends, 0, sizeof(unsigned) * ST_TRACE_BINS, c->stream);
    if (trace_dev.sm_ends)
        cudaMemsetAsync(trace_dev.sm_ends, 0, sizeof(unsigned) * ST_TRACE_SMS * ST_TRACE_SM_BINS, c->stream);
    if (trace_dev.blk_n) cudaMemsetAsync(trace_dev.blk_n, 0, sizeof(unsigned), c->stream);
}

static int trace_by_time(const void *a, const void *b) {
    double x = ((const trace_entry *)a)->ns, y = ((const trace_entry *)b)->ns;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void trace_report(void) {
    if (!trace_replays && !trace_mismatch) {
        fprintf(stderr, "STRATA_CUDA_TRACE: no decode graph was replayed (graphs off, or no decode)\n");
        return;
    }
    double total = 0;
    for (int i = 0; i < n_trace; i++) total += trace_tab[i].ns;
    qsort(trace_tab, (size_t)n_trace, sizeof trace_tab[0], trace_by_time);
    fprintf(stderr, "\nKernels inside the replayed graphs (STRATA_CUDA_TRACE): %lld replays, %.1f us a replay from the "
                    "first kernel's release to the last's\n",
            (long long)trace_replays, trace_replays ? trace_step_ns / 1e3 / (double)trace_replays : 0.0);
    if (trace_mismatch)
        fprintf(stderr, "  %lld replays not counted: their records did not match their launches\n", (long long)trace_mismatch);
    if (trace_backwards)
        fprintf(stderr, "  %lld kernels released before the kernel ahead of them by the timers (counted as 0 us)\n",
                (long long)trace_backwards);
    fprintf(stderr, "%-60s %9s %10s %9s %9s %6s  %-26s %s\n", "op #launch", "calls", "total ms", "us/call", "early us",
            "share", "blocks ended 50/90/100% us", "marks (us after the release)");
    for (int i = 0; i < n_trace; i++) {
        const trace_entry *t = &trace_tab[i];
        fprintf(stderr, "%-60s %9lld %10.3f %9.2f %9.2f %5.1f%% ", t->label, (long long)t->calls, t->ns / 1e6,
                t->ns / 1e3 / (double)t->calls, t->early_ns / 1e3 / (double)t->calls, 100.0 * t->ns / total);
        char ends[64] = "";
        if (t->end_n) {
            double n = (double)t->end_n;
            snprintf(ends, sizeof ends, "%.0f: %.2f %.2f %.2f", t->end_blocks / n, t->end_ns[0] / 1e3 / n,
                     t->end_ns[1] / 1e3 / n, t->end_ns[2] / 1e3 / n);
        }
        fprintf(stderr, " %-26s", ends);
        for (int k = 0; k < ST_TRACE_MARKS; k++)
            if (t->mark_n[k]) fprintf(stderr, " %d:%.2f", k, t->mark_ns[k] / 1e3 / (double)t->mark_n[k]);
        fprintf(stderr, "\n");
    }
    if (trace_dev.blk && !trace_blk_written)
        fprintf(stderr, "STRATA_CUDA_TRACE_BLOCKS: fewer than %d replays were counted: nothing written\n",
                TRACE_BLK_REPLAY);
    if (trace_sm_ends) {
        fprintf(stderr, "\nBlocks by multiprocessor (STRATA_CUDA_TRACE_SM=%s): for the launches with k of their blocks "
                        "ending on one multiprocessor, how many such (multiprocessor, launch) pairs a launch had, and "
                        "when the last of those k blocks ended (us after the release)\n", trace_sm_watch);
        for (int i = 0; i < n_trace; i++) {
            const trace_entry *t = &trace_tab[i];
            int64_t pairs = 0;
            for (int k = 1; k <= 8; k++) pairs += t->sm_n[k];
            if (!pairs) continue;
            fprintf(stderr, "%-60s", t->label);
            for (int k = 1; k <= 8; k++)
                if (t->sm_n[k])
                    fprintf(stderr, "  k=%d%s: %.1f at %.2f", k, k == 8 ? "+" : "", (double)t->sm_n[k] / (double)t->end_n,
                            t->sm_last_ns[k] / 1e3 / (double)t->sm_n[k]);
            fprintf(stderr, "\n");
        }
    }
    n_trace = 0;
    trace_replays = trace_mismatch = trace_backwards = 0;
    trace_step_ns = 0;
}

void st_cuda_trace_stop(st_cuda *c) {
    if (!c->trace) return;
    trace_report();
    st_cuda_trace_free(st_cuda_trace_take(c));
    trace_buffers_free();
    c->trace = false;
}

static const char *rows_class(int n) { return n == 1 ? "n=1" : n <= ST_CUDA_GRAPH_ROWS ? "n<=16" : "n>16"; }

#define TIMED(b, key, call)                                                                          \
    do {                                                                                             \
        if (skipped(key)) break;                                                                     \
        if (!timing) {                                                                               \
            trace_op(b, key);                                                                        \
            call;                                                                                    \
            break;                                                                                   \
        }                                                                                            \
        cudaStream_t s_ = st_cuda_of(b)->stream;                                                     \
        cudaEventRecord(ev0, s_);                                                                    \
        double h0_ = host_now_ms();                                                                  \
        call;                                                                                        \
        double h_ = host_now_ms() - h0_;                                                             \
        cudaEventRecord(ev1, s_);                                                                    \
        float ms_ = 0;                                                                               \
        if (cudaEventSynchronize(ev1) == cudaSuccess && cudaEventElapsedTime(&ms_, ev0, ev1) == cudaSuccess) \
            prof_add(key, ms_, h_);                                                                  \
    } while (0)

static void p_matmul(st_backend *b, const st_mat *w, const float *x, int n, float *y) {
    char key[96];
    snprintf(key, sizeof key, "matmul %s %lldx%lld %s", st_type_name(w->type), (long long)w->rows,
             (long long)w->cols, rows_class(n));
    TIMED(b, key, inner->matmul(b, w, x, n, y));
}
static void p_matmul_many(st_backend *b, int nw, const st_mat *const *w, const float *x, int n, float *const *y) {
    char key[96];
    snprintf(key, sizeof key, "matmul_many %d x %s %lldx%lld %s", nw, st_type_name(w[0]->type), (long long)w[0]->rows,
             (long long)w[0]->cols, rows_class(n));
    TIMED(b, key, inner->matmul_many(b, nw, w, x, n, y));
}
static void p_moe(st_backend *b, const st_moe_args *a) {
    char key[96];
    snprintf(key, sizeof key, "moe %s/%s %s", st_type_name(a->gate->type), st_type_name(a->down->type),
             rows_class(a->n));
    TIMED(b, key, inner->moe(b, a));
}
static void p_attention(st_backend *b, const st_attn_args *a) {
    char key[96];
    snprintf(key, sizeof key, "attention %s", rows_class(a->n));
    TIMED(b, key, inner->attention(b, a));
}
static void p_gdn(st_backend *b, const st_gdn_args *a) {
    char key[96];
    snprintf(key, sizeof key, "gdn step %s", rows_class(a->n));
    TIMED(b, key, inner->gdn(b, a));
}
static void p_gdn_chunked(st_backend *b, const st_gdn_args *a) {
    char key[96];
    snprintf(key, sizeof key, "gdn chunked %s", rows_class(a->n));
    TIMED(b, key, inner->gdn_chunked(b, a));
}
static void p_get_rows(st_backend *b, const st_mat *w, const int32_t *ids, int n, float *y) { TIMED(b, "get_rows", inner->get_rows(b, w, ids, n, y)); }
static void p_rmsnorm_silu(st_backend *b, const float *x, const float *w, const float *g, float *y, int n, int d, float eps) { TIMED(b, "rmsnorm_silu", inner->rmsnorm_silu(b, x, w, g, y, n, d, eps)); }
static void p_rmsnorm(st_backend *b, const float *x, const float *w, float *y, int n, int d, float eps) { TIMED(b, "rmsnorm", inner->rmsnorm(b, x, w, y, n, d, eps)); }
static void p_norm_matmul(st_backend *b, const float *x, const float *y, float *xo, const float *nw_, float eps, float *xn,
                          int n, int d, int nw, const st_mat *const *w, float *const *out) {
    char key[96];
    if (nw > 0)
        snprintf(key, sizeof key, "norm_matmul %d x %s %lldx%lld %s", nw, st_type_name(w[0]->type), (long long)w[0]->rows,
                 (long long)w[0]->cols, rows_class(n));
    else
        snprintf(key, sizeof key, "norm_matmul 0 %s", rows_class(n));
    TIMED(b, key, inner->norm_matmul(b, x, y, xo, nw_, eps, xn, n, d, nw, w, out));
}
static void p_norm_rope(st_backend *b, float *x, const float *w, int n, int h, int hd, int nr, const int32_t *pos, float base, float eps) { TIMED(b, "norm_rope", inner->norm_rope(b, x, w, n, h, hd, nr, pos, base, eps)); }
static void p_l2norm(st_backend *b, float *x, int n, int d, float eps, float scale) { TIMED(b, "l2norm", inner->l2norm(b, x, n, d, eps, scale)); }
static void p_rope(st_backend *b, float *x, int n, int h, int hd, int nr, const int32_t *pos, float base) { TIMED(b, "rope", inner->rope(b, x, n, h, hd, nr, pos, base)); }
static void p_conv(st_backend *b, const st_conv_args *a) { TIMED(b, "conv", inner->conv(b, a)); }
static void p_add(st_backend *b, float *y, const float *x, int64_t n) { TIMED(b, "add", inner->add(b, y, x, n)); }
static void p_swiglu(st_backend *b, const float *g, const float *u, float *y, int64_t n) { TIMED(b, "swiglu", inner->swiglu(b, g, u, y, n)); }
static void p_mul_sigmoid(st_backend *b, float *y, const float *g, int64_t n) { TIMED(b, "mul_sigmoid", inner->mul_sigmoid(b, y, g, n)); }
static void p_mul_silu(st_backend *b, float *y, const float *g, int64_t n) { TIMED(b, "mul_silu", inner->mul_silu(b, y, g, n)); }
static void p_add_gated_rows(st_backend *b, float *y, const float *x, const float *g, int n, int d) { TIMED(b, "add_gated_rows", inner->add_gated_rows(b, y, x, g, n, d)); }
// The fused mixer timed as one op; otherwise its ops, each timed (st_deltanet_ops calls them
// through this table).
static void p_deltanet(st_backend *b, const st_deltanet_args *a) {
    if (!st_cuda_deltanet_fuses(a)) {
        st_deltanet_ops(b, a);
        return;
    }
    char key[96];
    snprintf(key, sizeof key, "deltanet fused%s %s", a->wo ? " + out projection" : "", rows_class(a->n));
    TIMED(b, key, inner->deltanet(b, a));
}
static void p_gdn_gates(st_backend *b, const float *ba, const float *a, const float *dt, float *beta, float *g, int n, int hk, int hv) { TIMED(b, "gdn_gates", inner->gdn_gates(b, ba, a, dt, beta, g, n, hk, hv)); }
static void p_split_heads(st_backend *b, const float *x, float *ya, float *yb, int n, int h, int a, int bd) { TIMED(b, "split_heads", inner->split_heads(b, x, ya, yb, n, h, a, bd)); }
static void p_copy_cols(st_backend *b, const float *x, int64_t ldx, int64_t xf, float *y, int64_t ldy, int64_t yf, int n, int64_t w) { TIMED(b, "copy_cols", inner->copy_cols(b, x, ldx, xf, y, ldy, yf, n, w)); }
static void p_copy(st_backend *b, float *d, const float *s, int64_t n) { TIMED(b, "copy", inner->copy(b, d, s, n)); }
static void p_moe_route(st_backend *b, const float *l, int n, int E, int k, int32_t *ids, float *w) { TIMED(b, "moe_route", inner->moe_route(b, l, n, E, k, ids, w)); }
static void p_argmax(st_backend *b, const float *x, int n, int d, int32_t *ids) { TIMED(b, "argmax", inner->argmax(b, x, n, d, ids)); }

static int by_time(const void *a, const void *b) {
    double x = ((const prof_entry *)a)->ms, y = ((const prof_entry *)b)->ms;
    return x < y ? 1 : x > y ? -1 : 0;
}

void st_cuda_profile_report(const st_cuda *c) {
    if (!inner || !n_prof) return;
    // The work buffers only grow, so at close they show the peak a run needed: what the memory
    // plan's allowance for them (st_state_plan_bytes) has to cover.
    static const char *names[] = {"act", "deq", "attn", "moe", "moe2", "gdn", "misc", "moemap", "attq"};
    static_assert(sizeof names / sizeof names[0] == ST_SCR_COUNT, "a name per work buffer");
    size_t all = 0;
    fprintf(stderr, "\nGPU work buffers at close (MiB):");
    for (int i = 0; i < ST_SCR_COUNT; i++) {
        fprintf(stderr, " %s %.1f", names[i], c->scratch_bytes[i] / 1048576.0);
        all += c->scratch_bytes[i];
    }
    fprintf(stderr, "; %.1f in all\n", all / 1048576.0);
    double total = 0;
    for (int i = 0; i < n_prof; i++) total += prof[i].ms;
    qsort(prof, (size_t)n_prof, sizeof prof[0], by_time);
    // The stream is idle when each op starts (every op is waited for), so an op whose host call
    // takes about as long as its GPU time kept the GPU waiting on the host (its launches, a
    // wait inside it), and its GPU time is not its kernels' time.
    fprintf(stderr, "\nGPU time per op (STRATA_CUDA_PROFILE; each op timed alone, graphs off; calls after each "
                    "op's first): %.1f ms in all\n", total);
    fprintf(stderr, "%-48s %9s %11s %9s %6s %12s %14s\n", "op", "calls", "total ms", "us/call", "share", "host us/call",
            "first call ms");
    for (int i = 0; i < n_prof; i++) {
        double k = prof[i].calls ? (double)prof[i].calls : 1.0; // (an op called once has only its first)
        fprintf(stderr, "%-48s %9lld %11.3f %9.2f %5.1f%% %12.2f %14.3f\n", prof[i].key, (long long)prof[i].calls,
                prof[i].ms, 1000.0 * prof[i].ms / k, 100.0 * prof[i].ms / total, 1000.0 * prof[i].host_ms / k,
                prof[i].first_ms);
    }
    n_prof = 0;
}

const st_backend_ops *st_cuda_profile_ops(const st_backend_ops *real, bool time_ops, const char *skip_keys) {
    static st_backend_ops ops;
    inner = real;
    timing = time_ops;
    snprintf(skip, sizeof skip, "%s", skip_keys ? skip_keys : "");
    if (skip[0]) fprintf(stderr, "STRATA_CUDA_SKIP: leaving out ops %s (outputs are wrong; for timing)\n", skip);
    if (timing && !ev0) {
        cudaEventCreate(&ev0);
        cudaEventCreate(&ev1);
    }
    ops = *real;
    ops.name = "cuda";
    ops.matmul = p_matmul;
    ops.matmul_many = p_matmul_many;
    ops.moe = p_moe;
    ops.attention = p_attention;
    ops.gdn = p_gdn;
    ops.gdn_chunked = p_gdn_chunked;
    ops.get_rows = p_get_rows;
    ops.rmsnorm = p_rmsnorm;
    ops.rmsnorm_silu = p_rmsnorm_silu;
    ops.l2norm = p_l2norm;
    ops.norm_matmul = p_norm_matmul;
    ops.norm_rope = p_norm_rope;
    ops.rope = p_rope;
    ops.conv = p_conv;
    ops.add = p_add;
    ops.swiglu = p_swiglu;
    ops.mul_sigmoid = p_mul_sigmoid;
    ops.mul_silu = p_mul_silu;
    ops.add_gated_rows = p_add_gated_rows;
    ops.gdn_gates = p_gdn_gates;
    ops.deltanet = p_deltanet;
    ops.split_heads = p_split_heads;
    ops.copy_cols = p_copy_cols;
    ops.copy = p_copy;
    ops.moe_route = p_moe_route;
    ops.argmax = p_argmax;
    return &ops;
}
