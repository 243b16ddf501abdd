// util: error messages, logging, memory, time and half-precision conversions.

#include "util/util.h"

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

// ---------------------------------------------------------------------------------------------
// Errors

static _Thread_local char err_msg[2048];

st_status st_fail(st_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_msg, sizeof err_msg, fmt, ap);
    va_end(ap);
    return code;
}

st_status st_fail_prefix(st_status code, const char *fmt, ...) {
    char old[sizeof err_msg];
    memcpy(old, err_msg, sizeof old);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err_msg, sizeof err_msg, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n + 2 < sizeof err_msg) { // append ": old", truncating old
        size_t room = sizeof err_msg - (size_t)n - 3, len = strlen(old);
        if (len > room) len = room;
        memcpy(err_msg + n, ": ", 2);
        memcpy(err_msg + n + 2, old, len);
        err_msg[n + 2 + len] = 0;
    }
    return code;
}

const char *st_error(void) { return err_msg; }
void st_error_clear(void) { err_msg[0] = 0; }

const char *st_status_name(st_status s) {
    switch (s) {
    case ST_OK: return "ok";
    case ST_ERR_IO: return "i/o error";
    case ST_ERR_FORMAT: return "format error";
    case ST_ERR_ARG: return "invalid argument";
    case ST_ERR_NOMEM: return "out of memory";
    case ST_ERR_UNSUPPORTED: return "unsupported";
    case ST_ERR_RANGE: return "out of range";
    }
    return "unknown error";
}

void st_assert_fail(const char *cond, const char *func, const char *file, int line) {
    fprintf(stderr, "strata: internal error: check '%s' failed in %s (%s:%d)\n", cond, func, file, line);
    fflush(stderr);
    abort();
}

// ---------------------------------------------------------------------------------------------
// Logging

static st_log_level log_level = (st_log_level)-1;

void st_log_set_level(st_log_level level) { log_level = level; }

static st_log_level log_level_get(void) {
    if ((int)log_level == -1) {
        const char *e = getenv("STRATA_LOG");
        log_level = ST_LOG_INFO;
        if (e && !strcmp(e, "debug")) log_level = ST_LOG_DEBUG;
        else if (e && !strcmp(e, "warn")) log_level = ST_LOG_WARN;
        else if (e && !strcmp(e, "error")) log_level = ST_LOG_ERROR;
    }
    return log_level;
}

void st_log(st_log_level level, const char *fmt, ...) {
    if (level < log_level_get()) return;
    static const char *tag[] = {"debug: ", "", "warning: ", "error: "};
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "strata: %s%s\n", tag[level], buf);
}

// ---------------------------------------------------------------------------------------------
// Memory

void *st_alloc(size_t size) {
    if (size == 0) size = 1;
    size_t rounded = (size + ST_ALIGN - 1) / ST_ALIGN * ST_ALIGN;
    if (rounded < size) {
        st_fail(ST_ERR_NOMEM, "allocation of %zu bytes overflows", size);
        return NULL;
    }
    void *p = aligned_alloc(ST_ALIGN, rounded);
    if (!p) {
        size_t avail = st_ram_available();
        st_fail(ST_ERR_NOMEM, "out of memory: asked for %.1f MiB, %.1f MiB available",
                size / 1048576.0, avail / 1048576.0);
    }
    return p;
}

void *st_calloc(size_t n, size_t size) {
    if (size && n > SIZE_MAX / size) {
        st_fail(ST_ERR_NOMEM, "allocation of %zu x %zu bytes overflows", n, size);
        return NULL;
    }
    void *p = st_alloc(n * size);
    if (p) memset(p, 0, n * size);
    return p;
}

void st_free(void *p) { free(p); }

size_t st_ram_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    size_t kib = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long v;
        if (sscanf(line, "MemAvailable: %llu kB", &v) == 1) { kib = (size_t)v; break; }
    }
    fclose(f);
    return kib * 1024;
}

st_status st_read_file(const char *path, char **data, size_t *size) {
    *data = NULL;
    *size = 0;
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) return st_fail(ST_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) goto nomem;
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) goto nomem;
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        free(buf);
        if (f != stdin) fclose(f);
        return st_fail(ST_ERR_IO, "%s: read error", path);
    }
    if (f != stdin) fclose(f);
    buf[n] = 0;
    *data = buf;
    *size = n;
    return ST_OK;
nomem:
    free(buf);
    if (f != stdin) fclose(f);
    return st_fail(ST_ERR_NOMEM, "%s: out of memory reading the file", path);
}

// ---------------------------------------------------------------------------------------------
// UTF-8

int st_utf8_encode(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// ---------------------------------------------------------------------------------------------
// Time

double st_time_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int st_cpu_count(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

int st_cpu_cores_at(const char *root, const int *cpus, int n) {
    if (n < 1) return 1;
    int *first = st_alloc(sizeof(int) * (size_t)n), cores = 0; // each core's lowest sibling
    if (!first) return n;
    for (int i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/cpu%d/topology/thread_siblings_list", root, cpus[i]);
        FILE *f = fopen(path, "r");
        int lo = -1;
        if (f) {
            if (fscanf(f, "%d", &lo) != 1) lo = -1; // "3,67" or "2-3": the list is sorted
            fclose(f);
        }
        if (lo < 0) {
            cores = -1; // unreadable: the logical count
            break;
        }
        bool seen = false;
        for (int j = 0; j < cores && !seen; j++) seen = first[j] == lo;
        if (!seen) first[cores++] = lo;
    }
    st_free(first);
    if (cores < 1) return n;
    return cores < (n + 1) / 2 ? (n + 1) / 2 : cores;
}

int st_cpu_cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return st_cpu_count();
    int cpus[CPU_SETSIZE], n = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) cpus[n++] = c;
    return n ? st_cpu_cores_at("/sys/devices/system/cpu", cpus, n) : st_cpu_count();
}

// ---------------------------------------------------------------------------------------------
// Half precision. Bit-exact with IEEE round-to-nearest-even (what numpy's float16 does).

float st_f16_to_f32(st_f16 h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { // subnormal: normalise
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    union { uint32_t u; float f; } v = { .u = bits };
    return v.f;
}

st_f16 st_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    uint32_t x = v.u, sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffff;
    if (absx >= 0x7f800000) // inf or nan
        return (st_f16)(sign | 0x7c00 | (absx > 0x7f800000 ? 0x200 | ((absx >> 13) & 0x3ff) : 0));
    if (absx >= 0x477ff000) return (st_f16)(sign | 0x7c00); // rounds to >= 65520: inf
    if (absx < 0x38800000) { // result is subnormal or zero
        if (absx < 0x33000000) return (st_f16)sign; // < 2^-25: rounds to zero
        uint32_t e = absx >> 23, man = (absx & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e; // 14..24 bits to drop
        uint32_t q = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (st_f16)(sign | q);
    }
    uint32_t q = ((absx >> 13) - (112 << 10)), rem = absx & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (q & 1))) q++;
    return (st_f16)(sign | q);
}

st_bf16 st_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    if ((v.u & 0x7fffffff) > 0x7f800000) return (st_bf16)((v.u >> 16) | 0x40); // quiet nan
    return (st_bf16)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}
