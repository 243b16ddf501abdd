// experts: reading and writing expert profiles (docs/EXPERT_PROFILE.md): routing counts per
// (layer, expert), the data the cache plan starts from. Every field is checked against the model
// the profile is loaded for, and a save never leaves a truncated file behind.

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "experts/experts.h"

#define PROFILE_MAGIC "STXP"
#define PROFILE_VERSION 1u
#define PROFILE_HEADER 16 // magic, version, n_layer, n_expert

static uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd_u64(const uint8_t *p) { return (uint64_t)rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32; }
static void wr_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void wr_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

// Reads exactly n bytes at the file's current offset.
static st_status read_all(int fd, const char *path, void *buf, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return st_fail(ST_ERR_IO, "%s: cannot read the expert profile: %s", path, strerror(errno));
        if (r == 0) return st_fail(ST_ERR_IO, "%s: the expert profile ended after %zu of %zu bytes (changed while reading?)",
                                   path, got, n);
        got += (size_t)r;
    }
    return ST_OK;
}

// The checks against the model, once the file is known to hold a well-formed profile.
static st_status check_header(const char *path, const uint8_t *h, uint64_t size, int n_layer, int n_mtp,
                              int n_expert) {
    if (memcmp(h, PROFILE_MAGIC, 4) != 0)
        return st_fail(ST_ERR_FORMAT, "%s: not an expert profile: magic is %02x %02x %02x %02x, expected 'STXP'",
                       path, h[0], h[1], h[2], h[3]);
    uint32_t version = rd_u32(h + 4), nl = rd_u32(h + 8), ne = rd_u32(h + 12);
    if (version != PROFILE_VERSION)
        return st_fail(ST_ERR_UNSUPPORTED, "%s: expert profile version %u is not supported (this build reads version %u)",
                       path, version, PROFILE_VERSION);
    // nl * ne fits in 64 bits (both are below 2^32); 16 + 8 * it may not, but then it is far
    // larger than any file can be.
    uint64_t cells = (uint64_t)nl * ne;
    if (cells > (UINT64_MAX - PROFILE_HEADER) / 8 || size != PROFILE_HEADER + 8 * cells)
        return st_fail(ST_ERR_FORMAT, "%s: the expert profile is %llu bytes, but its n_layer %u x n_expert %u "
                       "needs exactly 16 + 8 x %llu bytes", path, (unsigned long long)size, nl, ne,
                       (unsigned long long)cells);
    if (ne != (uint32_t)n_expert)
        return st_fail(ST_ERR_FORMAT, "%s: n_expert is %u, but the model has %d experts per layer (a profile of "
                       "another model?)", path, ne, n_expert);
    if (nl != (uint32_t)n_layer && nl != (uint32_t)(n_layer + n_mtp)) {
        if (n_mtp)
            return st_fail(ST_ERR_FORMAT, "%s: n_layer is %u, but the model has %d layers (%d with its MTP layer; "
                           "a profile of another model?)", path, nl, n_layer, n_layer + n_mtp);
        return st_fail(ST_ERR_FORMAT, "%s: n_layer is %u, but the model has %d layers (a profile of another model?)",
                       path, nl, n_layer);
    }
    return ST_OK;
}

st_status st_profile_load(const char *path, int n_layer, int n_mtp, int n_expert, uint64_t *counts) {
    if (n_layer < 1 || n_mtp < 0 || n_expert < 1)
        return st_fail(ST_ERR_ARG, "%s: loading an expert profile for %d layers, %d MTP layers, %d experts",
                       path, n_layer, n_mtp, n_expert);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return st_fail(ST_ERR_IO, "%s: cannot open the expert profile: %s", path, strerror(errno));
    struct stat sb;
    st_status s = ST_OK;
    uint8_t h[PROFILE_HEADER];
    uint8_t *row = NULL;
    if (fstat(fd, &sb) != 0) {
        s = st_fail(ST_ERR_IO, "%s: cannot stat the expert profile: %s", path, strerror(errno));
        goto done;
    }
    if (!S_ISREG(sb.st_mode)) {
        s = st_fail(ST_ERR_IO, "%s: the expert profile is not a regular file", path);
        goto done;
    }
    if ((uint64_t)sb.st_size < PROFILE_HEADER) {
        s = st_fail(ST_ERR_FORMAT, "%s: %lld bytes, too short for an expert profile (the header alone is %d bytes)",
                    path, (long long)sb.st_size, PROFILE_HEADER);
        goto done;
    }
    if ((s = read_all(fd, path, h, sizeof h))) goto done;
    if ((s = check_header(path, h, (uint64_t)sb.st_size, n_layer, n_mtp, n_expert))) goto done;

    // A profile without the MTP row leaves that row zero.
    uint32_t nl = rd_u32(h + 8);
    memset(counts, 0, sizeof(uint64_t) * (size_t)(n_layer + n_mtp) * n_expert);
    size_t row_bytes = 8 * (size_t)n_expert;
    row = st_alloc(row_bytes);
    if (!row) {
        s = st_fail_prefix(ST_ERR_NOMEM, "%s: reading the expert profile", path);
        goto done;
    }
    for (uint32_t l = 0; l < nl && !s; l++) {
        s = read_all(fd, path, row, row_bytes);
        for (int e = 0; e < n_expert && !s; e++) counts[(size_t)l * n_expert + e] = rd_u64(row + 8 * (size_t)e);
    }
done:
    st_free(row);
    close(fd);
    return s;
}

st_status st_profile_save(const char *path, int n_rows, int n_expert, const uint64_t *counts) {
    if (n_rows < 1 || n_expert < 1)
        return st_fail(ST_ERR_ARG, "%s: an expert profile needs at least one row and one expert (asked %d x %d)",
                       path, n_rows, n_expert);
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return st_fail(ST_ERR_ARG, "%.200s...: the expert profile's path is longer than %zu bytes", path,
                       sizeof tmp - 5);
    FILE *f = fopen(tmp, "wb");
    if (!f) return st_fail(ST_ERR_IO, "%s: cannot write the expert profile (creating %s): %s", path, tmp, strerror(errno));
    uint8_t h[PROFILE_HEADER], cell[8];
    memcpy(h, PROFILE_MAGIC, 4);
    wr_u32(h + 4, PROFILE_VERSION);
    wr_u32(h + 8, (uint32_t)n_rows);
    wr_u32(h + 12, (uint32_t)n_expert);
    bool ok = fwrite(h, 1, sizeof h, f) == sizeof h;
    for (size_t i = 0; ok && i < (size_t)n_rows * n_expert; i++) {
        wr_u64(cell, counts[i]);
        ok = fwrite(cell, 1, 8, f) == 8;
    }
    // The data reaches the disk before the rename makes it the profile.
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int err = errno;
    if (fclose(f) != 0 && ok) ok = false, err = errno;
    if (!ok) {
        unlink(tmp);
        return st_fail(ST_ERR_IO, "%s: cannot write the expert profile (writing %s): %s", path, tmp, strerror(err));
    }
    if (rename(tmp, path) != 0) {
        err = errno;
        unlink(tmp);
        return st_fail(ST_ERR_IO, "%s: cannot write the expert profile (renaming %s to it): %s", path, tmp,
                       strerror(err));
    }
    return ST_OK;
}
