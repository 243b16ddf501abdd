#!/usr/bin/env python3
"""Generates src/tokenizer/unicode_nfc.c: what NFC normalization needs (canonical combining
classes, full canonical decompositions, primary composition pairs, and quick-check flags).

Strata must normalize exactly as Hugging Face `tokenizers` does, which carries newer Unicode data
(16.0 in tokenizers 0.23) than this Python's unicodedata (14.0 in 3.11). So the data is read
from `tokenizers` itself: decompositions from its NFD normalizer, compositions checked with its
NFC normalizer, and combining classes from unicodedata where Python knows the character, else
measured through the reordering that `tokenizers`' NFD performs. Python's data cross-checks the
characters both know.

Run: .venv/bin/python tools/gen_unicode_nfc.py > src/tokenizer/unicode_nfc.c
"""
import sys
import unicodedata as ud

import tokenizers
from tokenizers import normalizers

MAXCP = 0x110000
SBASE, SCOUNT, VBASE, TBASE = 0xAC00, 11172, 0x1161, 0x11A7
SEP = "\x01"  # a starter that neither decomposes nor composes


def scalars():
    return [c for c in range(MAXCP) if not (0xD800 <= c <= 0xDFFF)]


def per_char(norm, strings):
    """Applies a normalizer to many short strings at once, each behind a separator starter."""
    batch = [s for s in strings if SEP not in s]
    out = norm.normalize_str("".join(SEP + s for s in batch)).split(SEP)
    assert out[0] == "" and len(out) == len(batch) + 1
    it = iter(out[1:])
    return [norm.normalize_str(s) if SEP in s else next(it) for s in strings]


def main():
    nfd, nfc = normalizers.NFD(), normalizers.NFC()
    cps = scalars()
    chars = [chr(c) for c in cps]
    dec = dict(zip(cps, per_char(nfd, chars)))
    com = dict(zip(cps, per_char(nfc, chars)))

    # Combining classes. Python knows assigned characters of its version; for the others, ask
    # tokenizers: a mark with class k > 0 moves after a following U+0334 (class 1) when k > 1
    # and before a preceding U+0345 (class 240) when k < 240.
    ccc = {}
    unknown = [c for c in cps if ud.category(chr(c)) == "Cn"]
    unk = set(unknown)
    for c in cps:
        if c not in unk:
            ccc[c] = ud.combining(chr(c))
    t1 = per_char(nfd, ["a" + chr(c) + "\u0334" for c in unknown])
    t2 = per_char(nfd, ["a\u0345" + chr(c) for c in unknown])
    marks = []
    for c, a, b in zip(unknown, t1, t2):
        if a != "a" + dec[c] + "\u0334" or b != "a\u0345" + dec[c]:
            marks.append(c)
        else:
            ccc[c] = 0
    # Reference marks, one per class value Python knows; bisect each new mark against them.
    ref = {}
    for c in cps:
        k = ccc.get(c, 0)
        if k and k not in ref and dec[c] == chr(c):
            ref[k] = c
    for m in marks:
        if len(dec[m]) != 1:  # decomposes: its class is the one of its first character
            ccc[m] = ccc.get(ord(dec[m][0]), 0)
            continue
        lower = [k for k, x in ref.items()
                 if nfd.normalize_str("a" + chr(m) + chr(x)) == "a" + chr(x) + chr(m)]
        higher = [k for k, x in ref.items()
                  if nfd.normalize_str("a" + chr(x) + chr(m)) == "a" + chr(m) + chr(x)]
        lo = max(lower, default=0)
        hi = min(higher, default=256)
        same = [k for k in ref if lo < k < hi]
        ccc[m] = same[0] if same else lo + 1
        assert 0 < ccc[m] < 256
    for c in unk:
        ccc.setdefault(c, 0)

    # Full decompositions (Hangul syllables by formula), checked against Python where it knows.
    decomp = {}
    for c in cps:
        if SBASE <= c < SBASE + SCOUNT:
            continue
        if dec[c] != chr(c):
            decomp[c] = [ord(x) for x in dec[c]]
            if c not in unk and ud.normalize("NFD", chr(c)) != dec[c]:
                print("note: U+%04X: tokenizers and Python disagree on NFD; following tokenizers"
                      % c, file=sys.stderr)

    # Primary composites: a character NFC keeps that decomposes; its pair is (NFC of all but
    # the last character of its decomposition, last character), confirmed by composing it.
    comps = {}
    for c, d in decomp.items():
        if com[c] != chr(c) or len(d) < 2:
            continue
        first = nfc.normalize_str("".join(chr(x) for x in d[:-1]))
        if len(first) != 1:
            continue
        if nfc.normalize_str(first + chr(d[-1])) == chr(c):
            comps[(ord(first), d[-1])] = c
    for c in cps:  # cross-check with Python's raw mappings
        if c in unk:
            continue
        raw = ud.decomposition(chr(c))
        if raw and not raw.startswith("<"):
            parts = [int(x, 16) for x in raw.split()]
            if (len(parts) == 2 and ud.normalize("NFC", chr(c)) == chr(c) and
                    comps.get((parts[0], parts[1])) != c):
                print("note: U+%04X: tokenizers does not compose it; following tokenizers" % c,
                      file=sys.stderr)

    seconds = {b for (_, b) in comps}
    seconds.update(range(VBASE, VBASE + 21))
    seconds.update(range(TBASE + 1, TBASE + 28))
    vals = [0] * MAXCP
    for c in cps:
        v = ccc[c]
        if ccc[c] != 0 or c in seconds or com[c] != chr(c):
            v |= 0x100
        if c in decomp:
            v |= 0x200
        vals[c] = v

    blocks, index, block_list = {}, [], []
    for hi in range(MAXCP >> 8):
        blk = tuple(vals[hi << 8:(hi + 1) << 8])
        if blk not in blocks:
            blocks[blk] = len(block_list)
            block_list.append(blk)
        index.append(blocks[blk])

    out = sys.stdout
    out.write("// unicode_nfc: Unicode data for NFC normalization, as Hugging Face tokenizers %s\n"
              "// applies it; generated by tools/gen_unicode_nfc.py. Do not edit by hand.\n\n"
              % tokenizers.__version__)
    out.write('#include "tokenizer/bpe_nfc.h"\n\n')
    out.write("const char st_nfc_source[] = \"tokenizers %s\";\n\n" % tokenizers.__version__)
    out.write("// Block index per 256 code points (0x110000 >> 8 entries).\n")
    out.write("const uint16_t st_nfc_index[%d] = {\n" % len(index))
    for i in range(0, len(index), 16):
        out.write("    " + ", ".join(str(x) for x in index[i:i + 16]) + ",\n")
    out.write("};\n\n")
    out.write("// Blocks of 256 entries: combining class | ST_NFC_FLAG | ST_NFC_DECOMP.\n")
    out.write("const uint16_t st_nfc_blocks[%d] = {\n" % (len(block_list) * 256))
    for blk in block_list:
        for i in range(0, 256, 16):
            out.write("    " + ", ".join(str(x) for x in blk[i:i + 16]) + ",\n")
    out.write("};\n\n")
    keys = sorted(decomp)
    seq, offs = [], []
    for k in keys:
        offs.append((k, len(seq), len(decomp[k])))
        seq.extend(decomp[k])
    out.write("// Full canonical decompositions (Hangul syllables excluded: done by formula).\n")
    out.write("const st_nfc_decomp st_nfc_decomps[%d] = {\n" % len(offs))
    for k, o, n in offs:
        out.write("    {0x%X, %d, %d},\n" % (k, o, n))
    out.write("};\n")
    out.write("const int st_nfc_n_decomps = %d;\n" % len(offs))
    out.write("const uint32_t st_nfc_decomp_seq[%d] = {\n" % len(seq))
    for i in range(0, len(seq), 12):
        out.write("    " + ", ".join("0x%X" % x for x in seq[i:i + 12]) + ",\n")
    out.write("};\n\n")
    pairs = sorted(((a << 21) | b, c) for (a, b), c in comps.items())
    out.write("// Primary composites: key (first << 21 | second), sorted; Hangul by formula.\n")
    out.write("const st_nfc_comp st_nfc_comps[%d] = {\n" % len(pairs))
    for k, c in pairs:
        out.write("    {0x%XULL, 0x%X},\n" % (k, c))
    out.write("};\n")
    out.write("const int st_nfc_n_comps = %d;\n" % len(pairs))
    print("unicode_nfc: %d decompositions, %d compositions, %d marks measured"
          % (len(offs), len(pairs), len(marks)), file=sys.stderr)


if __name__ == "__main__":
    main()
