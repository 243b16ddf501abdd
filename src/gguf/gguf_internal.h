// gguf: helpers shared by the reader and the writer (not for other modules).
#pragma once

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#include "gguf/gguf.h"

// n (<= 8) little-endian bytes at p, whatever their alignment.
uint64_t st_gguf_le(const void *p, int n);
// A name from the file made safe for a message: at most 60 bytes, unprintable bytes as '?',
// "..." when cut. cap >= 4.
void st_gguf_printable(char *dst, size_t cap, const void *src, size_t len);
// A non-negative integer value of type t at p (any width); false for other types or negatives.
bool st_gguf_uint_value(st_gguf_vtype t, const uint8_t *p, uint64_t *v);
