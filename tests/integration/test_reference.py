"""Self-consistency of the numpy reference (tests/reference) and the files tools/synth_gguf.py writes:
prompt vs step-by-step logits, chunked vs recurrent Gated DeltaNet, legacy ssm_in vs attn_qkv layout, MTP,
names/shapes/metadata, reproducibility, router skew. Needs only numpy + gguf."""
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import gguf
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import synth_gguf  # noqa: E402
from tests.reference import model as ref  # noqa: E402
from tests.reference.model import Model  # noqa: E402

ref.limit_blas_threads(1)


def cfg_of(preset, **kw):
    return dataclasses.replace(synth_gguf.Config(**synth_gguf.PRESETS[preset]), **kw)


# 256-wide shapes, so K and IQ types (256-element blocks) are really used instead of falling back
WIDE_NEXT = dict(n_embd=256, head_dim=64, n_ff_exp=256, n_ff_shexp=256, ssm_d_v=64, n_layer=4, n_expert=4)
WIDE_MOE = dict(n_embd=256, head_dim=64, n_ff_exp=256, n_layer=2, n_expert=4)


def synth(tmp_path, cfg, name="m"):
    path = tmp_path / f"{name}.gguf"
    notes = synth_gguf.write(cfg, path)
    return path, notes


def tokens_for(m, n, seed=0):
    return np.random.default_rng(seed).integers(0, m.hp.n_vocab, n)


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,dense,experts,extra", [
    ("tiny-moe", "f32", "f32", {}),
    ("tiny-moe", "bf16", "q4_1", {}),
    ("tiny-next", "f32", "f32", {}),
    ("tiny-next", "q8_0", "q5_0", {"mtp": True}),
    ("tiny-next", "f16", "q4_K", WIDE_NEXT),
    ("tiny-moe", "q5_1", "iq2_xs", WIDE_MOE),
])
def test_prompt_matches_steps(tmp_path, preset, dense, experts, extra):
    path, notes = synth(tmp_path, cfg_of(preset, dense_type=dense, expert_type=experts, **extra))
    if extra:
        assert not [n for n in notes if "_exps" in n], notes     # the expert type is really used
    m = Model(path)
    toks = tokens_for(m, 70)                                   # > 64: two DeltaNet chunks
    full = m.forward(toks)
    assert full.shape == (70, m.hp.n_vocab) and np.isfinite(full).all()
    assert 0.3 < full.std() < 5.0                              # O(1) logits, not collapsed or exploding
    # the same tokens in pieces through the caches: a short prompt, a multi-token call that starts with
    # non-zero conv/delta-rule/KV state and crosses a chunk boundary, then single-token steps
    cache = m.new_cache()
    parts = [m.forward(toks[:30], cache), m.forward(toks[30:66], cache)]
    parts += [m.forward([t], cache) for t in toks[66:]]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-9 * np.abs(full).max())
    assert cache.n_past == 70


def test_delta_rule_chunked_equals_recurrent():
    rng = np.random.default_rng(3)
    T, H, dk, dv = 150, 3, 16, 8
    q = ref.l2norm(rng.standard_normal((T, H, dk))) / np.sqrt(dk)
    k = ref.l2norm(rng.standard_normal((T, H, dk)))
    v = rng.standard_normal((T, H, dv))
    g = -rng.uniform(0.0, 0.5, (T, H))
    beta = rng.uniform(0.0, 1.0, (T, H))
    S0 = rng.standard_normal((H, dk, dv))
    o1, s1 = ref.delta_rule_recurrent(q, k, v, g, beta, S0)
    for C in (64, 16, 7):
        o2, s2 = ref.delta_rule_chunked(q, k, v, g, beta, S0, C=C)
        np.testing.assert_allclose(o2, o1, atol=1e-10)
        np.testing.assert_allclose(s2, s1, atol=1e-10)


def test_delta_rule_step_matches_definition():
    # One step by hand: S <- e^g S; S += k (beta (v - S^T k))^T; o = S^T q.
    rng = np.random.default_rng(4)
    dk, dv = 4, 3
    q, k, v = rng.standard_normal((1, 1, dk)), rng.standard_normal((1, 1, dk)), rng.standard_normal((1, 1, dv))
    g, beta, S = np.array([[-0.3]]), np.array([[0.7]]), rng.standard_normal((1, dk, dv))
    o, S1 = ref.delta_rule_recurrent(q, k, v, g, beta, S)
    Sd = np.exp(-0.3) * S[0]
    Sd = Sd + np.outer(k[0, 0], 0.7 * (v[0, 0] - Sd.T @ k[0, 0]))
    np.testing.assert_allclose(S1[0], Sd, atol=1e-12)
    np.testing.assert_allclose(o[0, 0], Sd.T @ q[0, 0], atol=1e-12)


def test_model_chunked_equals_recurrent(tmp_path):
    path, _ = synth(tmp_path, cfg_of("tiny-next", n_layer=4, dense_type="q8_0"))
    toks = tokens_for(Model(path), 100, seed=1)
    a = Model(path, deltanet="chunked").forward(toks)
    b = Model(path, deltanet="recurrent").forward(toks)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-9 * np.abs(b).max())


@pytest.mark.parametrize("dense", ["f32", "q4_0", "q6_K"])
def test_legacy_ssm_in_same_logits(tmp_path, dense):
    extra = WIDE_NEXT if dense == "q6_K" else {}
    base = cfg_of("tiny-next", dense_type=dense, **extra)
    p1, _ = synth(tmp_path, base, "new")
    p2, _ = synth(tmp_path, dataclasses.replace(base, legacy_ssm_in=True), "legacy")
    r1, r2 = gguf.GGUFReader(p1), gguf.GGUFReader(p2)
    names1 = {t.name for t in r1.tensors}
    names2 = {t.name for t in r2.tensors}
    assert "blk.0.attn_qkv.weight" in names1 and "blk.0.ssm_in.weight" not in names1
    assert "blk.0.ssm_in.weight" in names2 and "blk.0.attn_qkv.weight" not in names2
    m1, m2 = Model(p1), Model(p2)
    toks = tokens_for(m1, 40, seed=2)
    a, b = m1.forward(toks), m2.forward(toks)
    assert np.abs(a - b).max() <= 1e-12 * np.abs(a).max()


def test_mtp(tmp_path):
    path, _ = synth(tmp_path, cfg_of("tiny-next", mtp=True))
    m = Model(path)
    assert m.hp.n_mtp == 1 and m.hp.n_layer == 4
    toks = tokens_for(m, 30, seed=5)
    cache = m.new_cache()
    logits, hidden = m.forward(toks, cache, return_hidden=True)
    # prompt mode: row i drafts token i+2 from (h_i, x_{i+1})
    draft, mh = m.mtp(hidden[:-1], toks[1:], cache)
    assert draft.shape == (29, m.hp.n_vocab) and np.isfinite(draft).all() and 0.3 < draft.std() < 5.0
    assert mh.shape == hidden[:-1].shape
    assert np.abs(draft - logits[1:]).max() > 1e-3          # the MTP layer really does something
    # the same rows one at a time through the MTP layer's own KV cache
    c2 = m.new_cache()
    rows = np.concatenate([m.mtp(hidden[i:i + 1], toks[i + 1:i + 2], c2)[0] for i in range(29)])
    np.testing.assert_allclose(rows, draft, rtol=0, atol=1e-9 * np.abs(draft).max())
    # position i (vLLM) vs i+1 (REFERENCE): RoPE attention sees only differences, so the same drafts
    d_vllm, _ = m.mtp(hidden[:-1], toks[1:], m.new_cache(), pos=np.arange(29))
    np.testing.assert_allclose(d_vllm, draft, rtol=0, atol=1e-9 * np.abs(draft).max())
    # MTP off: a model without nextn tensors refuses
    p0, _ = synth(tmp_path, cfg_of("tiny-next"), "nomtp")
    with pytest.raises(ValueError):
        Model(p0).mtp(hidden[:1], toks[1:2], m.new_cache())


def test_float32_mode_close_to_float64(tmp_path):
    path, _ = synth(tmp_path, cfg_of("tiny-next", dense_type="q8_0", expert_type="q4_0"))
    toks = tokens_for(Model(path), 70, seed=6)
    a = Model(path).forward(toks)
    b = Model(path, dtype=np.float32).forward(toks)
    assert b.dtype == np.float32
    assert np.abs(a - b).max() < 1e-4 * np.abs(a).max()


# ---------------------------------------------------------------------------------------------------------
# What synth_gguf writes


def ne(t):
    return tuple(int(x) for x in t.shape)


def test_synth_qwen3moe_layout(tmp_path):
    cfg = cfg_of("tiny-moe", dense_type="q8_0", expert_type="q4_0")
    path, _ = synth(tmp_path, cfg)
    r = gguf.GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    H, V, E, F = cfg.n_embd, len(synth_gguf.byte_vocab(cfg.byte_merges)["tokens"]), cfg.n_expert, cfg.n_ff_exp
    nq, nkv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    want = {"token_embd.weight": (H, V), "output_norm.weight": (H,), "output.weight": (H, V)}
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        want.update({p + "attn_norm.weight": (H,), p + "attn_q.weight": (H, nq), p + "attn_k.weight": (H, nkv),
                     p + "attn_v.weight": (H, nkv), p + "attn_output.weight": (nq, H),
                     p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,),
                     p + "ffn_norm.weight": (H,), p + "ffn_gate_inp.weight": (H, E),
                     p + "ffn_gate_exps.weight": (H, F, E), p + "ffn_up_exps.weight": (H, F, E),
                     p + "ffn_down_exps.weight": (F, H, E)})
    assert {n: ne(x) for n, x in t.items()} == want
    assert t["blk.0.ffn_gate_exps.weight"].tensor_type == QT.Q4_0
    assert t["blk.0.attn_q.weight"].tensor_type == QT.Q8_0
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == QT.F32
    assert t["blk.0.attn_norm.weight"].tensor_type == QT.F32
    meta = lambda k: r.fields[k].contents()
    assert meta("general.architecture") == "qwen3moe"
    assert meta("general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    for k, v in {"block_count": cfg.n_layer, "embedding_length": H, "expert_count": E,
                 "expert_used_count": cfg.n_expert_used, "expert_feed_forward_length": F,
                 "attention.head_count": cfg.n_head, "attention.head_count_kv": cfg.n_head_kv,
                 "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim}.items():
        assert meta("qwen3moe." + k) == v, k
    assert "qwen3moe.rope.dimension_count" not in r.fields
    assert meta("tokenizer.ggml.model") == "gpt2" and meta("tokenizer.ggml.pre") == "qwen2"
    toks = meta("tokenizer.ggml.tokens")
    assert len(toks) == V and toks[32] == "Ġ" and toks[ord("a")] == "a"
    assert toks[meta("tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert toks[meta("tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert meta("tokenizer.ggml.add_bos_token") is False
    assert len(meta("tokenizer.ggml.merges")) == cfg.byte_merges


def test_synth_qwen3next_layout(tmp_path):
    cfg = cfg_of("tiny-next", mtp=True, n_layer=4)
    path, _ = synth(tmp_path, cfg)
    r = gguf.GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    H, cd, vd = cfg.n_embd, cfg.ssm_conv_dim, cfg.ssm_value_dim
    # DeltaNet layer
    assert ne(t["blk.0.attn_qkv.weight"]) == (H, cd) and cd == 2 * cfg.ssm_d_k * cfg.ssm_n_k + vd
    assert ne(t["blk.0.attn_gate.weight"]) == (H, vd)
    assert ne(t["blk.0.ssm_ba.weight"]) == (H, 2 * cfg.ssm_n_v)
    assert ne(t["blk.0.ssm_conv1d.weight"]) == (cfg.ssm_conv, cd)
    assert ne(t["blk.0.ssm_dt.bias"]) == (cfg.ssm_n_v,) and ne(t["blk.0.ssm_a"]) == (cfg.ssm_n_v,)
    assert ne(t["blk.0.ssm_norm.weight"]) == (cfg.ssm_d_v,) and ne(t["blk.0.ssm_out.weight"]) == (vd, H)
    assert (np.asarray(t["blk.0.ssm_a"].data) < 0).all()                 # stores -exp(A_log)
    assert "blk.0.attn_q.weight" not in t and "blk.0.ffn_norm.weight" not in t
    # full attention layer 3: gated q (query + gate per head)
    assert ne(t["blk.3.attn_q.weight"]) == (H, 2 * cfg.n_head * cfg.head_dim)
    assert ne(t["blk.3.attn_output.weight"]) == (cfg.n_head * cfg.head_dim, H)
    assert "blk.3.attn_qkv.weight" not in t
    for i in range(4):
        assert ne(t[f"blk.{i}.post_attention_norm.weight"]) == (H,)
        assert ne(t[f"blk.{i}.ffn_gate_inp_shexp.weight"]) == (H, 1)
        assert ne(t[f"blk.{i}.ffn_down_shexp.weight"]) == (cfg.n_ff_shexp, H)
    # MTP layer at blk.4 (REFERENCE §2.4)
    assert ne(t["blk.4.nextn.eh_proj.weight"]) == (2 * H, H)
    for n in ("enorm", "hnorm", "shared_head_norm"):
        assert ne(t[f"blk.4.nextn.{n}.weight"]) == (H,)
    assert ne(t["blk.4.attn_q.weight"]) == (H, 2 * cfg.n_head * cfg.head_dim)
    assert ne(t["blk.4.ffn_up_exps.weight"]) == (H, cfg.n_ff_exp, cfg.n_expert)
    meta = lambda k: r.fields[k].contents()
    for k, v in {"block_count": 4, "nextn_predict_layers": 1, "ssm.conv_kernel": cfg.ssm_conv,
                 "ssm.state_size": cfg.ssm_d_k, "ssm.group_count": cfg.ssm_n_k, "ssm.time_step_rank": cfg.ssm_n_v,
                 "ssm.inner_size": vd, "full_attention_interval": 4, "rope.dimension_count": cfg.rope_dim,
                 "expert_shared_feed_forward_length": cfg.n_ff_shexp}.items():
        assert meta("qwen3next." + k) == v, k


def test_legacy_rows_are_a_permutation():
    cfg = cfg_of("tiny-next")
    idx = synth_gguf.legacy_ssm_in_rows(cfg)
    assert sorted(idx.tolist()) == list(range(cfg.ssm_conv_dim + cfg.ssm_value_dim))
    # group 0 starts with q_0 then k_0
    dk = cfg.ssm_d_k
    assert idx[:dk].tolist() == list(range(dk))
    assert idx[dk:2 * dk].tolist() == list(range(cfg.ssm_key_dim, cfg.ssm_key_dim + dk))


def test_synth_reproducible_and_seeded(tmp_path):
    cfg = cfg_of("tiny-next", dense_type="q4_1", expert_type="iq3_xxs", **WIDE_NEXT)
    a, _ = synth(tmp_path, cfg, "a")
    b, _ = synth(tmp_path, cfg, "b")
    c, _ = synth(tmp_path, dataclasses.replace(cfg, seed=1), "c")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    # a tensor does not depend on how many layers follow it
    d, _ = synth(tmp_path, dataclasses.replace(cfg, n_layer=2), "d")
    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    td = {t.name: t for t in gguf.GGUFReader(d).tensors}
    assert np.array_equal(ta["blk.1.ffn_up_exps.weight"].data, td["blk.1.ffn_up_exps.weight"].data)


@pytest.mark.parametrize("qt", sorted(synth_gguf.RANDOM_BLOCK, key=int))
def test_random_blocks_have_requested_scale(qt):
    rng = np.random.default_rng(7)
    blocks = synth_gguf.random_blocks(rng, 16, 1024, qt, std=0.05)
    y = gguf.quants.dequantize(blocks, qt).astype(np.float64)
    assert y.shape == (16, 1024) and np.isfinite(y).all()
    assert 0.04 < y.std() < 0.06
    assert abs(y.mean()) < 0.2 * y.std()


def test_type_fallback_is_reported(tmp_path):
    _, notes = synth(tmp_path, cfg_of("tiny-moe", expert_type="q4_K"))    # n_embd 128: no 256-blocks
    assert any("ffn_gate_exps" in n and "Q8_0" in n for n in notes)
    with pytest.raises(ValueError):
        synth_gguf.parse_type("q8_1")


def test_router_skew_concentrates_traffic(tmp_path):
    def top_share(skew):
        cfg = cfg_of("tiny-moe", n_expert=32, n_expert_used=4, n_layer=1, router_skew=skew)
        path, _ = synth(tmp_path, cfg, f"skew{skew}")
        m = Model(path)
        log = []
        m.forward(tokens_for(m, 256, seed=8), router_log=log)
        counts = np.bincount(log[0][1].ravel(), minlength=32)
        return np.sort(counts)[::-1][:6].sum() / counts.sum()     # share of the busiest ~20% of experts
    flat, skewed = top_share(0.0), top_share(1.5)
    assert flat < 0.45 and skewed > 0.6, (flat, skewed)


def test_cli_writes_file(tmp_path):
    out = tmp_path / "cli.gguf"
    assert synth_gguf.main([str(out), "--preset", "tiny-next", "--layers", "1", "--n-expert", "4",
                            "--dense-type", "bf16", "--legacy-ssm-in"]) == 0
    r = gguf.GGUFReader(out)
    assert r.fields["qwen3next.block_count"].contents() == 1
    assert {t.name for t in r.tensors} >= {"blk.0.ssm_in.weight", "blk.0.ssm_ba.weight"}
    assert synth_gguf.main([str(tmp_path / "bad.gguf"), "--dense-type", "q9_9"]) == 1


def test_mtp_counted_in_block_count(tmp_path):
    # newer llama.cpp (Qwen3.5 MTP) writes block_count = main layers + MTP layers; same model, same numbers
    path, _ = synth(tmp_path, cfg_of("tiny-next", mtp=True))
    alt = tmp_path / "alt.gguf"
    alt.write_bytes(path.read_bytes())
    r = gguf.GGUFReader(alt, "r+")
    r.fields["qwen3next.block_count"].parts[-1][0] = 5
    r.data.flush()
    del r
    m1, m2 = Model(path), Model(alt)
    assert m2.w.meta("qwen3next.block_count") == 5 and m2.hp.n_layer == 4
    toks = tokens_for(m1, 12, seed=9)
    c1, c2 = m1.new_cache(), m2.new_cache()
    l1, h1 = m1.forward(toks, c1, return_hidden=True)
    l2, h2 = m2.forward(toks, c2, return_hidden=True)
    assert np.array_equal(l1, l2)
    assert np.array_equal(m1.mtp(h1, toks, c1)[0], m2.mtp(h2, toks, c2)[0])


def test_residual_gain_scales_branch_outputs_only(tmp_path):
    base = cfg_of("tiny-next", n_layer=4, mtp=True)
    a, _ = synth(tmp_path, base, "g1")
    b, _ = synth(tmp_path, dataclasses.replace(base, residual_gain=2.0), "g2")
    ta = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(b).tensors}
    scaled = ("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
    for name in ta:
        if name.endswith(scaled):
            np.testing.assert_allclose(tb[name], 2 * ta[name], rtol=1e-6)
        else:
            assert np.array_equal(ta[name], tb[name]), name
