// util: status codes and error messages, logging, aligned memory, timing, half-precision
// conversion, and the thread pool. Everything here is used by every other module.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdio.h>

// The CUDA files include these headers from C++: spell the two C11 keywords they use portably.
#ifdef __cplusplus
#define ST_NORETURN [[noreturn]]
#define _Static_assert static_assert
#else
#define ST_NORETURN _Noreturn
#endif

// ---------------------------------------------------------------------------------------------
// Status and errors
//
// Anything input, a request or the machine can cause returns an st_status and leaves a message
// in a thread-local buffer (read it with st_error()). Broken internal invariants stop the
// process through ST_ASSERT, naming the check, function, file and line.

typedef enum st_status {
    ST_OK = 0,
    ST_ERR_IO,          // a file or socket could not be opened, read or written
    ST_ERR_FORMAT,      // a file or value is malformed (bad GGUF, bad JSON, bad tensor)
    ST_ERR_ARG,         // a wrong flag, option or argument
    ST_ERR_NOMEM,       // RAM or VRAM exhausted (the message says how much was asked / free)
    ST_ERR_UNSUPPORTED, // valid input this build cannot handle (unknown type, architecture)
    ST_ERR_RANGE,       // an index, size or count outside what is allowed
} st_status;

// Formats a message into the thread's error buffer and returns `code`, so a failure reads
// `return st_fail(ST_ERR_FORMAT, "%s: bad magic", path);`.
st_status st_fail(st_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Prepends context to the current message: "loading x.gguf: <old message>".
st_status st_fail_prefix(st_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *st_error(void);          // the thread's last message ("" if none)
const char *st_status_name(st_status s);
void st_error_clear(void);

#define ST_ASSERT(cond)                                                                    \
    do {                                                                                   \
        if (!(cond)) st_assert_fail(#cond, __func__, __FILE__, __LINE__);                  \
    } while (0)
ST_NORETURN void st_assert_fail(const char *cond, const char *func, const char *file, int line);

// Propagate a failing status.
#define ST_TRY(expr)                                                                       \
    do {                                                                                   \
        st_status st_try_s_ = (expr);                                                      \
        if (st_try_s_ != ST_OK) return st_try_s_;                                          \
    } while (0)

// ---------------------------------------------------------------------------------------------
// Logging (stderr). Level from STRATA_LOG=debug|info|warn|error, default info.

typedef enum st_log_level { ST_LOG_DEBUG, ST_LOG_INFO, ST_LOG_WARN, ST_LOG_ERROR } st_log_level;
void st_log(st_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void st_log_set_level(st_log_level level);
#define st_log_debug(...) st_log(ST_LOG_DEBUG, __VA_ARGS__)
#define st_log_info(...)  st_log(ST_LOG_INFO, __VA_ARGS__)
#define st_log_warn(...)  st_log(ST_LOG_WARN, __VA_ARGS__)

// ---------------------------------------------------------------------------------------------
// Memory. Allocation failures are reported as ST_ERR_NOMEM with the size asked.

#define ST_ALIGN 64 // cache line; also enough for AVX-512 loads
void *st_alloc(size_t size);              // aligned to ST_ALIGN, NULL + st_error on failure
void *st_calloc(size_t n, size_t size);   // zeroed, overflow-checked
void st_free(void *p);
size_t st_ram_available(void);            // bytes of RAM available now (MemAvailable), 0 if unknown

// Reads a whole file into memory (NUL-terminated for convenience; *size excludes the NUL).
st_status st_read_file(const char *path, char **data, size_t *size);

// ---------------------------------------------------------------------------------------------
// UTF-8

// Writes code point cp (< 0x110000) to out as 1-4 bytes; returns the count.
int st_utf8_encode(char *out, uint32_t cp);

// ---------------------------------------------------------------------------------------------
// Time

double st_time_s(void);  // monotonic seconds

// ---------------------------------------------------------------------------------------------
// Half precision (IEEE binary16 and bfloat16), exact round-to-nearest-even conversions.

typedef uint16_t st_f16;
typedef uint16_t st_bf16;
float st_f16_to_f32(st_f16 h);
st_f16 st_f32_to_f16(float f);
static inline float st_bf16_to_f32(st_bf16 h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}
st_bf16 st_f32_to_bf16(float f);

// ---------------------------------------------------------------------------------------------
// Thread pool: a fixed set of workers that run one function on every thread and return when
// all are done. The caller takes part as thread 0. Decode calls it hundreds of times a token,
// so a call costs microseconds (workers spin briefly before sleeping).

typedef struct st_pool st_pool;
typedef void (*st_pool_fn)(void *ctx, int ith, int nth);
st_pool *st_pool_create(int n_threads); // n_threads >= 1 including the caller; NULL on failure
void st_pool_free(st_pool *pool);
int st_pool_size(const st_pool *pool);
void st_pool_run(st_pool *pool, st_pool_fn fn, void *ctx); // pool may be NULL: runs fn(ctx,0,1)
// Inside a job: returns once every thread of the current st_pool_run has called it (so every
// thread must call it the same number of times), with all their writes before it visible.
// Reusable back to back; a thread that waits long sleeps. No-op for a NULL or one-thread pool.
void st_pool_barrier(st_pool *pool);
// While held, idle workers (and waits inside jobs) spin instead of sleeping, and sleeping workers
// are woken to spin: for a run of small jobs with gaps longer than the spin time (a hybrid decode
// window's missed experts, one job every few layers), where a futex wake would cost each job tens
// of microseconds. Burns the pool's cores until released. No-op for a NULL or one-thread pool.
void st_pool_hold(st_pool *pool, bool on);
int st_cpu_count(void);  // online logical CPUs
// Physical cores among the CPUs this process may run on: SMT siblings (one thread_siblings_list
// in sysfs) count once. Where the topology cannot be read, the logical count; never fewer than
// half of it (x86 cores run at most two threads: a topology claiming more is not trusted).
int st_cpu_cores(void);
// The same over CPUs cpus[0..n) with the topology read under root (the layout of
// /sys/devices/system/cpu): for tests.
int st_cpu_cores_at(const char *root, const int *cpus, int n);
