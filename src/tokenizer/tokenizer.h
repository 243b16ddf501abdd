// tokenizer: byte-level BPE built from GGUF metadata or a Hugging Face tokenizer.json, a
// streaming UTF-8-safe decoder, and chat templates (the Jinja subset real templates use).
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "gguf/gguf.h"
#include "util/util.h"

// =============================================================================================
// BPE tokenizer
// =============================================================================================

// =============================================================================================
// Chat templates
// =============================================================================================
