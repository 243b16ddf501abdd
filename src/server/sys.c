// server: the machine's numbers for /status and /metrics (Linux /proc): CPU use since the
// previous reading, RAM in use and the process's resident size.

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "server/server.h"

static pthread_mutex_t cpu_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long last_busy, last_total; // the previous reading, for the difference

static double cpu_percent(void) {
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return 0;
    unsigned long long v[8] = {0};
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                   &v[6], &v[7]);
    fclose(f);
    if (n < 4) return 0;
    unsigned long long idle = v[3] + v[4], total = 0; // idle + iowait
    for (int i = 0; i < 8; i++) total += v[i];
    unsigned long long busy = total - idle;
    pthread_mutex_lock(&cpu_mu);
    double pct = 0;
    if (last_total && total > last_total) pct = 100.0 * (double)(busy - last_busy) / (double)(total - last_total);
    last_busy = busy, last_total = total;
    pthread_mutex_unlock(&cpu_mu);
    return pct < 0 ? 0 : pct > 100 ? 100 : pct;
}

void st_sys_read(st_sys_info *out) {
    memset(out, 0, sizeof *out);
    out->cpu_percent = cpu_percent();
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long total = 0, avail = 0, kb;
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) total = kb;
            else if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = kb;
        }
        fclose(f);
        out->ram_total = total * 1024;
        out->ram_used = total > avail ? (total - avail) * 1024 : 0;
    }
    f = fopen("/proc/self/statm", "r");
    if (f) {
        unsigned long long size, rss;
        if (fscanf(f, "%llu %llu", &size, &rss) == 2) out->rss = rss * (uint64_t)sysconf(_SC_PAGESIZE);
        fclose(f);
    }
}
