"""Tokenizer parity: `strata tokenize` against Hugging Face `tokenizers` on the real Qwen3
vocabulary (/work/shared/data/qwen3-tokenizer/tokenizer.json, or $STRATA_QWEN3_TOKENIZER), loaded
from the tokenizer.json and from a GGUF written from it with the `gguf` package. Also decoding,
round trips, streaming, invalid UTF-8 and the CLI's errors.
"""
import json
import os
import random
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STRATA = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))
TOKJSON = Path(os.environ.get("STRATA_QWEN3_TOKENIZER",
                              ROOT.parent / "shared" / "data" / "qwen3-tokenizer" / "tokenizer.json"))

tokenizers = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.skipif(not TOKJSON.exists(), reason=f"{TOKJSON} not found")


def looks_special(s):
    return s.startswith("<|") and s.endswith("|>")


@pytest.fixture(scope="module")
def hf():
    return tokenizers.Tokenizer.from_file(str(TOKJSON))


@pytest.fixture(scope="module")
def hf_plain(tmp_path_factory):
    """HF with special-token parsing off. Strata treats added tokens that are special or look
    special (<|...|>, as llama.cpp's converter does) as control tokens; mark those special so
    that HF's encode_special_tokens skips exactly the same set."""
    j = json.loads(TOKJSON.read_text(encoding="utf-8"))
    for a in j["added_tokens"]:
        if looks_special(a["content"]):
            a["special"] = True
    p = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    p.write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")
    t = tokenizers.Tokenizer.from_file(str(p))
    t.encode_special_tokens = True
    return t


def write_gguf(path, pre):
    """A GGUF holding only the tokenizer, written the way llama.cpp's converter writes Qwen3."""
    gguf = pytest.importorskip("gguf")
    j = json.loads(TOKJSON.read_text(encoding="utf-8"))
    cfg = json.loads((TOKJSON.parent / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = j["model"]["vocab"]
    added = {a["id"]: a for a in j["added_tokens"]}
    n = 151936  # the model's embedding rows; the rest are [PADn] fillers
    tokens, types = [], []
    inv = {v: k for k, v in vocab.items()}
    for i in range(n):
        if i in added:
            a = added[i]
            tokens.append(a["content"])
            types.append(3 if a["special"] or looks_special(a["content"]) else 4)
        elif i in inv:
            tokens.append(inv[i])
            types.append(1)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(151643)
    w.add_eos_token_id(next(a["id"] for a in j["added_tokens"] if a["content"] == cfg["eos_token"]))
    w.add_pad_token_id(151643)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "qwen3-tokenizer.gguf", "qwen2")


def strata(*args, input=None, check=True):
    r = subprocess.run([STRATA, *args], input=input, capture_output=True, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"strata {' '.join(args[:4])} failed ({r.returncode}): "
                             f"{r.stderr.decode(errors='replace')}")
    return r


def strata_batch(texts, special, src):
    args = ["tokenize", *src, "--batch", "-"] + (["--special"] if special else [])
    r = strata(*args, input=json.dumps(texts).encode())
    return json.loads(r.stdout)


# ---------------------------------------------------------------------------------------------
# The corpus

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_pad|>", "<tool_call>",
            "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|file_sep|>", "<think>",
            "</think>", "<tool_response>", "<|im_", "<|", "|>", "<", "<think", "[PAD151700]"]

PROSE = {
    "en": "The quick brown fox jumps over the lazy dog. It's a well-known pangram; they'll "
          "say it's used for testing typewriters, and we've found it DOESN'T hurt. I'm sure "
          "you'd agree: 3.14159 isn't 22/7 -- it's close (about 0.04% off)!",
    "zh": "自然语言处理是人工智能的一个重要分支。它研究如何让计算机理解和生成人类语言，"
          "包括机器翻译、情感分析、问答系统等应用。２０２４年，大模型取得了巨大进展。",
    "ja": "日本語の文章には、ひらがな・カタカナ・漢字が混在します。東京は日本の首都で、"
          "人口は約１４００万人です。ｶﾀｶﾅの半角も使われることがあります。",
    "ko": "한국어는 한글로 표기합니다. 서울은 대한민국의 수도이며, 인구는 약 천만 명입니다. "
          "안녕하세요! 반갑습니다.",
    "ru": "Съешь же ещё этих мягких французских булок, да выпей чаю. Москва — столица России; "
          "население — около 13 миллионов человек.",
    "ar": "اللغة العربية هي إحدى أكثر اللغات انتشاراً في العالم، يتحدثها أكثر من ٤٠٠ مليون "
          "نسمة. مَرْحَبًا بِكُمْ!",
    "hi": "हिन्दी भारत की राजभाषा है। नमस्ते, आप कैसे हैं? मैं ठीक हूँ। १२३४५ संख्याएँ।",
    "th": "ภาษาไทยเป็นภาษาราชการของประเทศไทย สวัสดีครับ",
    "el": "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Η Αθήνα είναι η πρωτεύουσα.",
    "he": "עברית היא שפה שמית. שָׁלוֹם עֲלֵיכֶם",
    "emoji": "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇯🇵🇺🇸 1️⃣ #️⃣ 🧑🏿‍🚀 ✊🏻✊🏼✊🏽",
    "mixed": "Mixed: naïve café résumé Ångström ﬁ ﬂ Ⅻ ½ ² ℃ № ™ … “quotes” ‘single’ «guillemets» — "
             "tab\there, nbsp\u00a0here, ideographic\u3000space, zwsp\u200bx, nel\u0085x, "
             "ls\u2028x ps\u2029x, soft\u00adhyphen, bom\ufeffx",
}

CODE_SNIPPETS = [
    '#include <stdio.h>\n\nint main(int argc, char **argv) {\n\tfor (int i = 0; i < argc; i++)\n'
    '\t\tprintf("%d: %s\\n", i, argv[i]);\n\treturn 0;\n}\n',
    'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
    '    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nprint(fib(100))\n',
    'fn main() {\n    let v: Vec<u64> = (1..=10).map(|x| x * x).collect();\n'
    '    println!("{:?} {}", v, v.iter().sum::<u64>());\n}\n',
    'const add = (a, b) => a + b;\nexport default async function f() {\n  const r = await '
    'fetch("https://example.com/api?q=1&x=2");\n  return r.json();\n}\n',
    'package main\n\nimport "fmt"\n\nfunc main() {\n\tm := map[string]int{"a": 1}\n'
    '\tfmt.Println(m["a"])\n}\n',
    'SELECT u.id, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id\r\n'
    'WHERE o.created_at >= \'2024-01-01\' GROUP BY u.id HAVING n > 10;\r\n',
    '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>T</title></head>\n'
    '<body><div class="a b" id=\'x\'>&amp; &lt;tag&gt;</div></body>\n</html>\n',
    '#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l "$f" | awk \'{print $1}\'\ndone\n',
    '\\documentclass{article}\n\\begin{document}\n$E = mc^2$ and $\\sum_{i=1}^{n} i^2$\n'
    '\\end{document}\n',
    '{"name": "strata", "version": "0.1.0", "tags": ["moe", "gguf"], "nested": {"x": [1, 2.5, '
    'null, true]}}\n',
]


def system_files(limit_bytes, seed):
    """Code and prose from files found on the machine (skipped when absent)."""
    dirs = [("/usr/lib/python3.11", ".py"), ("/usr/include", ".h"),
            ("/usr/share/doc/nodejs/api", ".md"), ("/usr/share/common-licenses", ""),
            (str(ROOT / "src"), ".c")]
    files = []
    for d, ext in dirs:
        p = Path(d)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*" + ext) if f.is_file())[:400]
    rnd = random.Random(seed)
    rnd.shuffle(files)
    out, total = [], 0
    for f in files:
        try:
            t = f.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not t or len(t) > 200_000:
            continue
        out.append(t)
        total += len(t.encode())
        if total >= limit_bytes:
            break
    return out


# Character pools for random strings: scripts, whitespace, marks, digits, emoji, specials.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789٠١٢٣٤٥٦٧٨٩०१२३४५६७८९０１２３",
    " \t\n\r\u000b\u000c\u00a0\u1680\u2000\u2007\u200a\u2028\u2029\u202f\u205f\u3000\u0085\u200b\ufeff",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~¡¿«»–—‘’“”…•·",
    "\u0300\u0301\u0302\u0303\u0308\u0323\u0327\u0338\u0345\u05b0\u064b\u093c\u094d\u0e31\u3099\u309a\u20d7\u1ab0",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可",
    "あいうえおかきくけこアイウエオカキクケコｱｲｳｴｵ",
    "가각간갇갈감갑강개객ᄀᄁ나ᅢᅣᆨᆩᆪ",
    "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГД",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह",
    "😀😁😂🤣👍🏻👍🏿‍♀️♂️\u200d\ufe0f\ufe0e🇦🇧🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "ÅåÉéÑñÖöÜüßẞǅǈǋﬁﬂſƒΩℵ∀∂∑√∞≈≠≤≥",
    "ÀÁÂÃÄ\u212b\u2126\u1e9b\u0344\u0958\u2adc\u1f80\u1fb7",
]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL",
                "'D", "'ſ", "'x", "''", "’s"]


def random_texts(n, seed, specials=True):
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rnd.randint(1, 40)):
            r = rnd.random()
            if r < 0.05 and specials:
                parts.append(rnd.choice(SPECIALS))
            elif r < 0.12:
                parts.append(rnd.choice(CONTRACTIONS))
            elif r < 0.2:
                parts.append(rnd.choice([" ", "\t", "\n", "\r\n", "  ", "\n\n", " \n"]) *
                             rnd.randint(1, 6))
            else:
                pool = rnd.choice(POOLS)
                parts.append("".join(rnd.choice(pool) for _ in range(rnd.randint(1, 8))))
        out.append("".join(parts))
    return out


def random_codepoints(n, seed):
    """Any scalar value (no surrogates), unassigned ones included: the regexes' Unicode
    classes must agree with HF's everywhere."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        s = []
        for _ in range(rnd.randint(1, 24)):
            r = rnd.random()
            if r < 0.3:
                cp = rnd.randint(0x20, 0x7E)
            elif r < 0.7:
                cp = rnd.randint(0x80, 0x2FFFF)
            else:
                cp = rnd.randint(0x80, 0x10FFFF)
            if 0xD800 <= cp <= 0xDFFF:
                cp = 0x20
            s.append(chr(cp))
        out.append("".join(s))
    return out


def all_codepoints():
    """Every BMP scalar value and every 7th supplementary one, shuffled into 64-character texts
    with letters, digits, spaces and punctuation around them: HF's Unicode classes everywhere."""
    cps = [c for c in range(0x20, 0x10000) if not 0xD800 <= c <= 0xDFFF]
    cps += list(range(0x10000, 0x110000, 7))
    rnd = random.Random(17)
    rnd.shuffle(cps)
    glue = ["a", "1", " ", "  ", "'", ".", "\n", "x y"]
    return ["".join(chr(c) + (rnd.choice(glue) if rnd.random() < 0.3 else "")
                    for c in cps[i:i + 64]) for i in range(0, len(cps), 64)]


def nfc_texts():
    """Inputs that NFC changes: decomposed letters, singletons, reordering, Hangul jamo."""
    base = ["e\u0301", "A\u030a", "\u212b", "\u2126", "a\u0323\u0301", "a\u0301\u0323",
            "\u1100\u1161\u11a8", "\u1100\u1161", "\uac00\u11a8", "o\u0308\u0304", "\u0958",
            "\u1e9b\u0323", "\u0344", "\u0f73", "\u2adc", "e\u0301\u0301\u0301", "\u0301start",
            "q\u0307\u0323", "\u00c5\u0301", "\u1fb7", "\u0b47\u0b3e", "\u0dd9\u0dcf\u0dca",
            "\u3099\u304b\u3099", "ka\u3099", "\u05d0\u05b7\u05bc", "\u0627\u0653"]
    texts = ["".join(base), " ".join(base), unicodedata.normalize("NFD", PROSE["mixed"]),
             unicodedata.normalize("NFD", PROSE["ko"]), unicodedata.normalize("NFD", PROSE["he"]),
             unicodedata.normalize("NFKD", PROSE["ja"]), unicodedata.normalize("NFD", PROSE["hi"])]
    rnd = random.Random(7)
    marks = [chr(c) for c in range(0x300, 0x370)] + ["\u0591", "\u05b0", "\u093c", "\u3099"]
    bases = list("aeiouAEIOUnNcCsSzZ") + ["\u1100", "\uac00", "\u0915", "\u05d0", "\u03b1"]
    for _ in range(200):
        texts.append("".join(rnd.choice(bases) + "".join(rnd.choice(marks)
                                                         for _ in range(rnd.randint(0, 4)))
                             for _ in range(rnd.randint(1, 12))))
    return texts


def edge_texts():
    return [
        "", " ", "\n", "\t", "\r\n", "a", "'", "'s", "1", "<|im_start|>", "<think>",
        " " * 1000, "\t" * 300, "\n" * 500, " \t\n\r\n" * 200, "\r\n\r\n  \r\n\t\r", "x" + " " * 50 + "y",
        "1234567890" * 50, "3.14159265358979323846264338327950288419716939937510",
        "word " * 2000, "\u00a0" * 20 + "x", " \u3000 \u3000x", "a\u200db",
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|im_start|><|im_start|>", "<|im_start|<|im_end|>>", "<<|im_end|>|>", "</think></think>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        "x<|endoftext|>y<|fim_prefix|>z<|fim_middle|>", "<|fim_pad|>" * 3,
        "  <|im_end|>  \n", "\n<|im_end|>\n", "'s<|im_end|>'ll",
        "e<|im_end|>\u0301", "e\u0301<think>\u0301",
        "ſ'ſ'ſ's'S'ſt", "I'M YOU'LL WE'VE THEY'D", "don't won’t",
        "..." * 100, "!!!\n\n\n???\r\n", "-" * 200 + "\n" + "=" * 200,
        "a\nb\rc\r\nd\n\re", "﻿BOM at start", "🏳️‍🌈" * 30, "👨‍👩‍👧‍👦 " * 20,
    ]


def build_corpus():
    texts = []
    texts += list(PROSE.values())
    texts += [" ".join(PROSE.values())]
    texts += CODE_SNIPPETS
    texts += edge_texts()
    texts += nfc_texts()
    texts += random_texts(1500, seed=1)
    texts += random_codepoints(800, seed=2)
    texts += all_codepoints()
    texts += system_files(1_500_000, seed=3)
    return texts


@pytest.fixture(scope="module")
def corpus():
    return build_corpus()


# ---------------------------------------------------------------------------------------------
# Parity

def compare(texts, got, ref_ids, what):
    assert len(got) == len(texts)
    bad = [i for i in range(len(texts)) if got[i] != ref_ids[i]]
    if bad:
        i = bad[0]
        g, r = got[i], ref_ids[i]
        k = next((k for k in range(min(len(g), len(r))) if g[k] != r[k]), min(len(g), len(r)))
        raise AssertionError(f"{what}: {len(bad)}/{len(texts)} texts differ; first: text "
                             f"{texts[i][:200]!r}, ids from {k}: strata {g[k:k+8]} vs HF {r[k:k+8]}")
    return sum(len(r) for r in ref_ids)


def test_parity_special(corpus, hf):
    ref = [e.ids for e in hf.encode_batch(corpus, add_special_tokens=False)]
    got = strata_batch(corpus, True, ["--tokenizer-json", str(TOKJSON)])
    n = compare(corpus, got, ref, "tokenizer.json, special parsing on")
    print(f"\nparity (special on): {len(corpus)} texts, {n} ids identical")


def test_parity_plain(corpus, hf_plain):
    ref = [e.ids for e in hf_plain.encode_batch(corpus, add_special_tokens=False)]
    got = strata_batch(corpus, False, ["--tokenizer-json", str(TOKJSON)])
    n = compare(corpus, got, ref, "tokenizer.json, special parsing off")
    print(f"\nparity (special off): {len(corpus)} texts, {n} ids identical")


def test_parity_gguf(corpus, hf, hf_plain, gguf_path):
    for special, ref_tok in ((True, hf), (False, hf_plain)):
        ref = [e.ids for e in ref_tok.encode_batch(corpus, add_special_tokens=False)]
        got = strata_batch(corpus, special, ["-m", str(gguf_path)])
        compare(corpus, got, ref, f"GGUF, special parsing {'on' if special else 'off'}")


LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2"])
def test_parity_other_pretokenizers(corpus, tmp_path, pre):
    """The Llama 3 and GPT-2 pre-tokenizers (no NFC; Llama 3 with ignore_merges), on the Qwen3
    vocabulary: HF from a tokenizer.json rewritten that way, Strata from that file and from a
    GGUF with tokenizer.ggml.pre set."""
    j = json.loads(TOKJSON.read_text(encoding="utf-8"))
    j["normalizer"] = None
    if pre == "llama-bpe":
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_REGEX
        j["model"]["ignore_merges"] = True
    else:
        j["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": True, "use_regex": True}
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(j, ensure_ascii=False), encoding="utf-8")
    ref_tok = tokenizers.Tokenizer.from_file(str(p))
    texts = corpus[:2500]
    ref = [e.ids for e in ref_tok.encode_batch(texts, add_special_tokens=False)]
    compare(texts, strata_batch(texts, True, ["--tokenizer-json", str(p)]), ref, pre + " json")
    g = write_gguf(tmp_path / "t.gguf", pre)
    compare(texts, strata_batch(texts, True, ["-m", str(g)]), ref, pre + " gguf")


def test_one_megabyte_line(hf, tmp_path):
    rnd = random.Random(5)
    words = (PROSE["en"] + " " + PROSE["zh"] + " " + PROSE["ru"]).split()
    line = " ".join(rnd.choice(words) for _ in range(140_000))
    line = line.encode()[:1 << 20].decode(errors="ignore")
    assert len(line.encode()) > 1_000_000 and "\n" not in line
    for text in (line, "a" * (1 << 20), " " * (1 << 20)):
        r = strata("tokenize", "--tokenizer-json", str(TOKJSON), "--ids", "-", input=text.encode())
        assert [int(x) for x in r.stdout.split()] == hf.encode(text, add_special_tokens=False).ids


def test_cli_single_text_and_pieces(hf):
    text = "Hello world<|im_end|>"
    r = strata("tokenize", "--tokenizer-json", str(TOKJSON), "--special", text)
    rows = [line.split("\t") for line in r.stdout.decode().splitlines()]
    enc = hf.encode(text, add_special_tokens=False)
    assert [int(a) for a, _ in rows] == enc.ids
    assert [b for _, b in rows] == enc.tokens
    r = strata("tokenize", "--tokenizer-json", str(TOKJSON), "--pieces", text)
    assert r.stdout.decode().splitlines()[0] == "Hello"


# ---------------------------------------------------------------------------------------------
# Decoding

def test_roundtrip(corpus, hf):
    """decode(encode(x)) == x for valid UTF-8 (NFC texts: Strata normalizes like HF)."""
    texts = [t for t in corpus if t and unicodedata.is_normalized("NFC", t)][:400]
    for special in (True, False):
        ids = strata_batch(texts, special, ["--tokenizer-json", str(TOKJSON)])
        for t, i in zip(texts, ids):
            r = strata("detokenize", "--tokenizer-json", str(TOKJSON), "-",
                       input=" ".join(map(str, i)).encode())
            assert r.stdout == t.encode(), t[:80]
            break  # one process per text is slow; the rest go in one batch below
        joined = [x for i in ids for x in i]
        r = strata("detokenize", "--tokenizer-json", str(TOKJSON), "-",
                   input=" ".join(map(str, joined)).encode())
        assert r.stdout == "".join(texts).encode()
        assert r.stdout.decode() == hf.decode(joined, skip_special_tokens=False)
    # Text that is not NFC comes back normalized, as from HF.
    texts = [t for t in nfc_texts() if not unicodedata.is_normalized("NFC", t)]
    ids = strata_batch(texts, False, ["--tokenizer-json", str(TOKJSON)])
    joined = [x for i in ids for x in i]
    r = strata("detokenize", "--tokenizer-json", str(TOKJSON), "-",
               input=" ".join(map(str, joined)).encode())
    assert r.stdout.decode() == "".join(unicodedata.normalize("NFC", t) for t in texts)


def test_detokenize_matches_hf_lossy(hf):
    """Random ids (byte tokens that split characters) decode to HF's text after a lossy UTF-8
    conversion; the raw bytes are the tokens' bytes."""
    rnd = random.Random(11)
    ids = [rnd.randrange(151643) for _ in range(3000)]
    r = strata("detokenize", "--tokenizer-json", str(TOKJSON), *map(str, ids))
    assert r.stdout.decode("utf-8", errors="replace") == hf.decode(ids)
    # The streaming decoder gives HF's text directly (valid UTF-8 at every step: unit-tested).
    r = strata("detokenize", "--tokenizer-json", str(TOKJSON), "--stream", *map(str, ids))
    assert r.stdout.decode("utf-8") == hf.decode(ids)
    r2 = strata("detokenize", "--tokenizer-json", str(TOKJSON), "--skip-special",
                "151644,9707,151645,151667")
    assert r2.stdout == hf.decode([151644, 9707, 151645, 151667], skip_special_tokens=True).encode()


def test_invalid_utf8_roundtrip():
    """Invalid UTF-8 is kept byte for byte: each run of invalid bytes becomes its own piece, so
    decode(encode(x)) == x for any bytes."""
    rnd = random.Random(13)
    samples = [b"\xff", b"\xc3", b"a\xffb", b"\xe4\xbd", b"caf\xc3\xa9\xe9", b"\xed\xa0\x80",
               b"\xf4\x90\x80\x80", b"\xc0\xaf", b"  \xfe\xfe  x", b"<|im_end|>\x80<think>\x80"]
    samples += [bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 200))) for _ in range(30)]
    for s in samples[:3]:  # alone, so nothing else is in the same piece
        r = strata("tokenize", "--tokenizer-json", str(TOKJSON), "--ids", "-", input=s)
        r2 = strata("detokenize", "--tokenizer-json", str(TOKJSON), "-", input=r.stdout)
        assert r2.stdout == s
    blob = b"\n|\n".join(samples)  # the rest in one process each way
    for special in ([], ["--special"]):
        r = strata("tokenize", "--tokenizer-json", str(TOKJSON), *special, "--ids", "-", input=blob)
        r2 = strata("detokenize", "--tokenizer-json", str(TOKJSON), "-", input=r.stdout)
        assert r2.stdout == blob


def test_cli_errors(tmp_path):
    r = strata("tokenize", "--tokenizer-json", str(tmp_path / "missing.json"), "x", check=False)
    assert r.returncode == 1 and b"missing.json" in r.stderr
    r = strata("detokenize", "--tokenizer-json", str(TOKJSON), "999999999", check=False)
    assert r.returncode == 1 and b"999999999" in r.stderr
    r = strata("detokenize", "--tokenizer-json", str(TOKJSON), "12x", check=False)
    assert r.returncode == 2
    r = strata("tokenize", "x", check=False)
    assert r.returncode == 2
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "Unigram", "vocab": []}}')
    r = strata("tokenize", "--tokenizer-json", str(bad), "x", check=False)
    assert r.returncode == 1 and b"BPE" in r.stderr


if __name__ == "__main__":  # quick manual run: python tests/integration/test_tokenizer.py
    c = build_corpus()
    print(len(c), "texts,", sum(len(t.encode()) for t in c), "bytes")
