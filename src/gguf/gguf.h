// gguf: the GGUF reader (mmap, every value type, shards loaded as one, full validation before
// use) and writer. Tensor data are views into the mapping; nothing is copied.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "quant/quant.h"
#include "util/util.h"

// Metadata value types, as stored.
typedef enum st_gguf_vtype {
    ST_GGUF_U8 = 0,
    ST_GGUF_I8 = 1,
    ST_GGUF_U16 = 2,
    ST_GGUF_I16 = 3,
    ST_GGUF_U32 = 4,
    ST_GGUF_I32 = 5,
    ST_GGUF_F32 = 6,
    ST_GGUF_BOOL = 7,
    ST_GGUF_STRING = 8,
    ST_GGUF_ARRAY = 9,
    ST_GGUF_U64 = 10,
    ST_GGUF_I64 = 11,
    ST_GGUF_F64 = 12,
    ST_GGUF_VTYPE_COUNT,
} st_gguf_vtype;
const char *st_gguf_vtype_name(st_gguf_vtype t); // "u8", ..., "string", "array"; "unknown"
size_t st_gguf_vtype_size(st_gguf_vtype t);      // bytes of a fixed-size value; 0 for string/array

#define ST_GGUF_MAX_DIMS          4
#define ST_GGUF_DEFAULT_ALIGNMENT 32
// Why a cap: alignment pads the header and every tensor; beyond 1 GiB it is a corrupt value, and
// the cap keeps align-up arithmetic far from overflow.
#define ST_GGUF_MAX_ALIGNMENT (1u << 30)

typedef struct st_gguf_tensor {
    const char *name;
    st_type type;
    int n_dims;
    int64_t ne[ST_GGUF_MAX_DIMS]; // ggml order: ne[0] is contiguous; unused dims are 1
    size_t bytes;                 // total bytes of data
    const void *data;             // view into the mapping
    int shard;                    // which file of a split model holds it
    uint64_t offset;              // absolute byte offset of the data in that file
} st_gguf_tensor;

// One metadata pair as stored (a read-only view; pointers into the mapping, which may be
// unaligned: read multi-byte values with memcpy or the getters below).
typedef struct st_gguf_kv {
    char *key; // NUL-terminated copy
    st_gguf_vtype type;
    const uint8_t *value; // the encoded value (after the type field), value_bytes long
    size_t value_bytes;
    st_gguf_vtype elem;  // arrays: element type,
    uint64_t count;      //   element count,
    const uint8_t *data; //   first element (numbers packed little-endian; strings as u64 length + bytes)
    size_t *str_at;      //   string arrays: offset of element i from data
} st_gguf_kv;

typedef struct st_gguf st_gguf;

// Opens and validates a GGUF file. A path like "m-00001-of-00003.gguf" (or any shard of one)
// loads every shard and presents them as one file: metadata from the first, tensors from all.
// Every shard must exist and carry split.no (0-based) and split.count matching its name.
// Every failure names the file, the byte offset and the key or tensor at fault.
st_status st_gguf_open(const char *path, st_gguf **out);
// The same, with each shard read into anonymous memory instead of mapped (in_memory): 2 MiB
// aligned and given to transparent huge pages where the kernel allows (MADV_HUGEPAGE), so
// products streaming the weights take a TLB miss per 2 MiB instead of per 4 KiB. Costs a copy
// of the file's bytes in RAM and the time to read it.
st_status st_gguf_open_ex(const char *path, bool in_memory, st_gguf **out);
// Parses and validates a file held in memory (used by the fuzz target and tests). The buffer
// must outlive the returned object. `name` appears in error messages. No shard lookup.
st_status st_gguf_open_memory(const void *data, size_t size, const char *name, st_gguf **out);
void st_gguf_free(st_gguf *g);

const char *st_gguf_path(const st_gguf *g); // the first shard's path (or the memory name)
uint32_t st_gguf_version(const st_gguf *g);
int st_gguf_shard_count(const st_gguf *g);
const char *st_gguf_shard_path(const st_gguf *g, int i);
size_t st_gguf_file_bytes(const st_gguf *g);  // all shards together
uint32_t st_gguf_alignment(const st_gguf *g); // of the first file

// ---- metadata
int64_t st_gguf_kv_count(const st_gguf *g);
int64_t st_gguf_find_key(const st_gguf *g, const char *key); // -1 if absent
const char *st_gguf_key(const st_gguf *g, int64_t i);
st_gguf_vtype st_gguf_kv_type(const st_gguf *g, int64_t i);
const st_gguf_kv *st_gguf_kv_at(const st_gguf *g, int64_t i); // NULL if out of range

// Typed getters by key. They return false when the key is absent or has an incompatible type.
// Integer getters accept any integer width whose value fits (writers differ in widths).
bool st_gguf_get_u32(const st_gguf *g, const char *key, uint32_t *out);
bool st_gguf_get_u64(const st_gguf *g, const char *key, uint64_t *out);
bool st_gguf_get_i64(const st_gguf *g, const char *key, int64_t *out);
bool st_gguf_get_f32(const st_gguf *g, const char *key, float *out);  // f32 or f64
bool st_gguf_get_f64(const st_gguf *g, const char *key, double *out); // f32 or f64
bool st_gguf_get_bool(const st_gguf *g, const char *key, bool *out);
// String value (not NUL-terminated in the file: use len; *s points into the mapping).
bool st_gguf_get_str(const st_gguf *g, const char *key, const char **s, size_t *len);

// Arrays: element type and count; numeric elements are packed little-endian at *data (maybe
// unaligned). For string and nested arrays *data is the raw encoding; use st_gguf_arr_str.
bool st_gguf_get_arr(const st_gguf *g, const char *key, st_gguf_vtype *elem_type, uint64_t *count,
                     const void **data);
// The i-th string of a string array (bounds checked; false if out of range or not strings).
bool st_gguf_arr_str(const st_gguf *g, const char *key, uint64_t i, const char **s, size_t *len);
// Numeric array element i converted to int64 / double (false if not numeric or out of range).
bool st_gguf_arr_i64(const st_gguf *g, const char *key, uint64_t i, int64_t *out);
bool st_gguf_arr_f64(const st_gguf *g, const char *key, uint64_t i, double *out);
// The same on a pair from st_gguf_kv_at (for walking every key).
bool st_gguf_kv_arr_str(const st_gguf_kv *kv, uint64_t i, const char **s, size_t *len);
bool st_gguf_kv_arr_i64(const st_gguf_kv *kv, uint64_t i, int64_t *out);
bool st_gguf_kv_arr_f64(const st_gguf_kv *kv, uint64_t i, double *out);

// ---- tensors
int64_t st_gguf_tensor_count(const st_gguf *g);
const st_gguf_tensor *st_gguf_tensor_at(const st_gguf *g, int64_t i);
const st_gguf_tensor *st_gguf_find_tensor(const st_gguf *g, const char *name); // NULL if absent

// ---------------------------------------------------------------------------------------------
// Writer. Collects metadata and tensors, then writes one file (v3, alignment 32 unless set).
// Keys and tensor names must be unique (a duplicate is an error). An alignment other than 32
// is written as general.alignment; adding general.alignment sets the alignment.

typedef struct st_gguf_writer st_gguf_writer;
st_gguf_writer *st_gguf_writer_create(void);
void st_gguf_writer_free(st_gguf_writer *w);
st_status st_gguf_writer_set_alignment(st_gguf_writer *w, uint32_t alignment); // power of two
// Any scalar value type (not string/array); `value` points to the value in its C type.
st_status st_gguf_writer_add_scalar(st_gguf_writer *w, const char *key, st_gguf_vtype type,
                                    const void *value);
st_status st_gguf_writer_add_u32(st_gguf_writer *w, const char *key, uint32_t v);
st_status st_gguf_writer_add_i32(st_gguf_writer *w, const char *key, int32_t v);
st_status st_gguf_writer_add_u64(st_gguf_writer *w, const char *key, uint64_t v);
st_status st_gguf_writer_add_f32(st_gguf_writer *w, const char *key, float v);
st_status st_gguf_writer_add_bool(st_gguf_writer *w, const char *key, bool v);
st_status st_gguf_writer_add_str(st_gguf_writer *w, const char *key, const char *v);
st_status st_gguf_writer_add_strn(st_gguf_writer *w, const char *key, const char *v, size_t len);
// Numeric array of `count` elements of elem_type, packed little-endian.
st_status st_gguf_writer_add_arr(st_gguf_writer *w, const char *key, st_gguf_vtype elem_type,
                                 const void *data, uint64_t count);
st_status st_gguf_writer_add_str_arr(st_gguf_writer *w, const char *key, const char *const *v,
                                     uint64_t count);
// Copies a key (any type, arrays included) from an open file.
st_status st_gguf_writer_copy_kv(st_gguf_writer *w, const st_gguf *g, int64_t i);
// Adds a tensor; `data` (bytes long, must match type and shape) is read when the file is
// written, so it must stay valid until st_gguf_writer_write returns.
st_status st_gguf_writer_add_tensor(st_gguf_writer *w, const char *name, st_type type, int n_dims,
                                    const int64_t *ne, const void *data, size_t bytes);
// Streaming form, for outputs larger than RAM (`strata quantize`): the data are produced when the
// file is written, in tensor order: `fill` is called once for this tensor (index = its position)
// and must pass exactly `bytes` bytes to `put(sink, ...)`, in any number of calls. A failing fill
// or put status ends the write (and removes the partial file).
typedef st_status (*st_gguf_put_fn)(void *sink, const void *data, size_t n);
typedef st_status (*st_gguf_fill_fn)(void *ctx, int64_t index, st_gguf_put_fn put, void *sink);
st_status st_gguf_writer_add_tensor_fn(st_gguf_writer *w, const char *name, st_type type, int n_dims,
                                       const int64_t *ne, size_t bytes, st_gguf_fill_fn fill, void *ctx);
// Writes the file, streaming each tensor from the caller's pointer (padding between them).
// A failed write removes the partial file.
st_status st_gguf_writer_write(st_gguf_writer *w, const char *path);
// The same into a malloc'd buffer (free with st_free), for tests and the fuzz seeds.
st_status st_gguf_writer_write_memory(st_gguf_writer *w, void **data, size_t *size);
