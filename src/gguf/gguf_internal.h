// gguf: helpers shared by the reader and the writer (not for other modules).
#pragma once

#include <stddef.h>
#include <stdint.h>

// n (<= 8) little-endian bytes at p, whatever their alignment.
uint64_t st_gguf_le(const void *p, int n);
// A name from the file made safe for a message: at most 60 bytes, unprintable bytes as '?',
// "..." when cut. cap >= 4.
void st_gguf_printable(char *dst, size_t cap, const void *src, size_t len);
