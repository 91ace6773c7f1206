"""The chunkwise-transformer CI fn (SPEC 3) and a full Decomposer step on a tiny LM."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppgd_tpu.config import CIFnConfig, Config, ConfigError, LlamaConfig, from_dict
from ppgd_tpu.decomp import ci_fn as ci_lib
from ppgd_tpu.decomp import ci_transformer
from ppgd_tpu.step import Decomposer
from ppgd_tpu.targets import llama_simple_mlp as lm

LM = LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=24,
                 max_seq_len=8)
CI = CIFnConfig(kind="chunkwise_transformer", d_model=16, n_blocks=2, n_heads=2, d_mlp=32)
B, T = 2, 6


def _target(cfg=LM):
    return lm.init(cfg, jax.random.key(0))


def _tokens(seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, LM.vocab_size)


@jax.jit
def _apply(f, taps):
    return f(taps, None)


def _ci(cfg=CI, C=None, target=None):
    t = target or _target()
    C = C or {s: 3 for s in t.site_names}
    return ci_lib.init(cfg, jax.random.key(2), t.tap_widths(), C), t


@pytest.mark.parametrize("taps", ["resid", "site_inputs"])
def test_logits_per_site_and_taps(taps):
    f, t = _ci(dataclasses.replace(CI, taps=taps), C={s: 3 + (i % 6) for i, s in
                                                     enumerate(_target().site_names)})
    if taps == "resid":
        assert f.input_names == ("resid.0", "resid.1")
    else:
        assert f.input_names == t.site_names
    assert f.chunks == (t.site_names[:6], t.site_names[6:])
    out = _apply(f, t.read_activations(_tokens(), f.input_names))
    assert set(out) == set(t.site_names)
    for i, s in enumerate(t.site_names):
        assert out[s].shape == (B, T, 3 + i % 6)
    # Chunks are independent: chunk 1's logits do not depend on chunk 0's taps.
    taps_ = t.read_activations(_tokens(), f.input_names)
    first = f.chunk_taps[0][0]
    moved = _apply(f, dict(taps_, **{first: taps_[first] * 3 + 1}))
    assert not np.allclose(moved[t.site_names[0]], out[t.site_names[0]])
    np.testing.assert_array_equal(moved[t.site_names[6]], out[t.site_names[6]])


def test_blocks_per_chunk_groups_layers():
    t = _target(dataclasses.replace(LM, n_layers=4))
    f, _ = _ci(dataclasses.replace(CI, blocks_per_chunk=2, taps="resid"), target=t)
    assert len(f.chunks) == 2 and f.chunks[0] == t.site_names[:12]
    assert f.chunk_taps == (("resid.0", "resid.1"), ("resid.2", "resid.3"))
    assert f.params.w_in.shape == (2, 2 * LM.d_model, CI.d_model)


def test_attention_is_bidirectional():
    """A later token changes the CI of an earlier position (the CI fn is not causal)."""
    f, t = _ci(dataclasses.replace(CI, taps="resid"))
    x = _tokens()
    y = x.at[:, -1].set((x[:, -1] + 1) % LM.vocab_size)
    a = _apply(f, t.read_activations(x, f.input_names))["h.0.attn.q_proj"]
    b = _apply(f, t.read_activations(y, f.input_names))["h.0.attn.q_proj"]
    assert np.abs(np.asarray(a[:, 0] - b[:, 0])).max() > 1e-6


def test_chunk_homogeneity_is_checked_at_init_naming_the_chunk():
    t = _target(dataclasses.replace(LM, n_layers=3))
    names = t.site_names
    with pytest.raises(ConfigError, match=r"chunk 1 \(h\.1\..*C per position"):
        _ci(C={s: 3 if s.startswith("h.0") else 4 for s in names}, target=t)
    with pytest.raises(ConfigError, match=r"chunk 1 .*site count"):
        _ci(C={s: 3 for s in names if not s.startswith("h.1.mlp")}, target=t)
    with pytest.raises(ConfigError, match=r"chunk 1 \(h\.1\.mlp\.c_fc\).*tap widths: \(16,\) "
                                          r"vs \(24,\)"):
        _ci(dataclasses.replace(CI, taps="site_inputs"),
            C={"h.0.mlp.down_proj": 3, "h.1.mlp.c_fc": 3}, target=t)
    with pytest.raises(ConfigError, match=r"chunk 1 \(h\.2\..*site count"):
        _ci(dataclasses.replace(CI, blocks_per_chunk=2), target=t)  # 3 layers, chunks of 2
    with pytest.raises(ConfigError, match="decomp.ci_fn.n_heads"):
        _ci(dataclasses.replace(CI, n_heads=3))
    with pytest.raises(ConfigError, match="resid.0"):
        ci_lib.init(dataclasses.replace(CI, taps="resid"), jax.random.key(0),
                    {s: w.shape[0] for s, w in t.site_weights().items()}, {names[0]: 3})


def test_S27_rope_has_base_10000_and_its_inv_freq_gets_no_gradient():
    """The tables the CI fn rotates by are cos/sin of t * 10000^(-2i/d) (rotate-half), and
    no gradient reaches the frequencies, not even from a traced base. (That inv_freq is no
    parameter of the CI fn: test_parameter_count_follows_the_config counts every one.)"""
    T, hd = 6, 8
    inv = ci_transformer.ROPE_BASE ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(T)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    cos, sin = lm.rope_tables(T, hd, ci_transformer.ROPE_BASE)
    np.testing.assert_allclose(cos, np.cos(ang), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(ang), rtol=1e-5, atol=1e-6)
    assert ci_transformer.ROPE_BASE == 10000.0  # SPEC's base
    tables = lambda base: sum(jnp.sum(x) for x in lm.rope_tables(T, hd, base))
    assert float(jax.grad(tables)(10000.0)) == 0.0
    # ... while the same tables do depend on the base (the zero is the stop-gradient's)
    assert tables(10000.0) != tables(5000.0)


def test_every_ci_transformer_parameter_gets_a_finite_nonzero_gradient():
    f, t = _ci(dataclasses.replace(CI, taps="resid"))
    taps = t.read_activations(_tokens(), f.input_names)
    g = jax.jit(jax.grad(lambda f: sum(jnp.sum(v ** 2) for v in f(taps, None).values())))(f)
    for path, leaf in jax.tree_util.tree_leaves_with_path(g):
        assert np.all(np.isfinite(leaf)) and np.abs(np.asarray(leaf)).max() > 0, path


def test_remat_matches_plain():
    f, t = _ci(dataclasses.replace(CI, taps="resid"))
    fr, _ = _ci(dataclasses.replace(CI, taps="resid", remat=True))
    taps = t.read_activations(_tokens(), f.input_names)
    loss = lambda f: sum(jnp.sum(jnp.sin(v)) for v in f(taps, None).values())
    (v0, g0), (v1, g1) = jax.jit(jax.value_and_grad(loss))(f), jax.jit(jax.value_and_grad(loss))(fr)
    np.testing.assert_allclose(v0, v1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_cpu_block_loop_computes_what_the_scan_does(monkeypatch):
    """On CPU the blocks run as a Python loop (no stacked residuals), elsewhere under
    lax.scan: both paths, here both run on the CPU, give the same logits and gradients
    (float reassociation aside)."""
    f, t = _ci(dataclasses.replace(CI, taps="resid", n_blocks=3))
    taps = t.read_activations(_tokens(), f.input_names)
    results = {}
    for where in ("cpu", "tpu"):
        monkeypatch.setattr(ci_transformer, "platform", lambda where=where: where)
        # a new function per path: JAX caches a trace by function
        loss = lambda f: sum(jnp.sum(jnp.sin(v)) for v in f(taps, None).values())
        results[where] = jax.jit(jax.value_and_grad(loss))(f)
        jaxpr = str(jax.make_jaxpr(loss)(f))
        assert ("scan[" in jaxpr) == (where == "tpu"), where
    (v0, g0), (v1, g1) = results["cpu"], results["tpu"]
    np.testing.assert_allclose(v0, v1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_parameter_count_follows_the_config():
    """Size is set by config (d_model, n_blocks, d_mlp), so a run can size the CI fn at ~10x
    the target: K * (D_in d + n (4 d^2 + 2 d d_mlp + 2 d) + d + sum_s (d + 1) C_s)."""
    cfg = dataclasses.replace(CI, d_model=32, n_blocks=3, n_heads=4, d_mlp=48, taps="resid")
    t = _target()
    C = {s: 2 + i % 6 for i, s in enumerate(t.site_names)}
    f = jax.eval_shape(lambda: ci_lib.init(cfg, jax.random.key(0), t.tap_widths(), C))
    d, n, m = 32, 3, 48
    per_chunk = LM.d_model * d + n * (4 * d * d + 2 * d * m + 2 * d) + d + sum(
        (d + 1) * C[s] for s in t.site_names[:6])
    assert ci_transformer.n_params(f) == 2 * per_chunk


@pytest.mark.parametrize("scope", ["bsc", "sc"])
def test_decomposer_full_step_on_tiny_lm(scope):
    """SPEC 6 on the LM: chunkwise CI fn + a persistent-PGD term; loss finite, V/U, CI fn and
    sources all move; sources are [B,T,C+1] (bsc) or [1,T,C+1] (sc)."""
    cfg = from_dict(Config, {
        "target": {"kind": "llama_simple_mlp"},
        "decomp": {"sites": {"*": 3}, "steps": 10,
                   "ci_fn": {"kind": "chunkwise_transformer", "d_model": 16, "n_blocks": 1,
                             "n_heads": 2, "d_mlp": 16}},
        "loss": {"stochastic": {"stoch": {}},
                 "persistent_pgd": {"ppgd": {"scope": scope, "n_warmup": 1}}},
    })
    t = _target()
    dec = Decomposer(cfg, t, (B, T))
    state = dec.init(t)
    src = state.adversaries["ppgd"].sources["h.1.mlp.c_fc"]
    assert src.shape == ((B, T, 4) if scope == "bsc" else (1, T, 4))
    new, metrics = jax.jit(dec.full)(state, t, _tokens())
    for k, v in metrics.items():
        assert np.isfinite(float(v)), k
    assert float(metrics["train/loss/ppgd"]) > 0
    for before, after in [(state.components, new.components), (state.ci_fn, new.ci_fn),
                          (state.adversaries["ppgd"].sources, new.adversaries["ppgd"].sources)]:
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
            assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_S25_the_lm_recon_term_is_kl_of_masked_from_clean():
    """A masked forward's recon term on the LM is KL(softmax(clean) || softmax(masked)) summed
    over the vocabulary and averaged over positions, in float64 here; the reversed KL (a
    swapped argument anywhere on the path) differs, and the toys' symmetric MSE cannot see it."""
    from ppgd_tpu.targets.base import SiteMask

    cfg = from_dict(Config, {"target": {"kind": "llama_simple_mlp"},
                             "decomp": {"sites": {"*": 3}, "steps": 10}})
    # larger weights: peaked distributions, far apart, whose two KLs differ
    t = lm.from_state_dict(LM, {k: v * 8.0 if v.ndim == 2 else v
                                for k, v in lm.state_dict(_target()).items()})
    dec = Decomposer(cfg, t, (B, T))
    comps = dec.init(t).components
    tok = _tokens()
    masks = {s: SiteMask(jax.random.uniform(jax.random.key(i), (B, T, 3)),
                         jax.random.uniform(jax.random.key(100 + i), (B, T)) ** 4)
             for i, s in enumerate(dec.sites)}  # mostly ablated deltas: far from clean
    got = float(dec.recon(t, tok, comps, masks, t.clean_output(tok)))

    def log_softmax(z):
        z = np.asarray(z, np.float64)
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(t.clean_output(tok)), log_softmax(t.masked_forward(tok, comps, masks))
    want = np.mean(np.sum(np.exp(lp) * (lp - lq), -1))
    reverse = np.mean(np.sum(np.exp(lq) * (lq - lp), -1))
    assert want > 1e-3 and abs(reverse - want) > 0.02 * want, (want, reverse)
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("taps,per_chunk", [("resid", 1), ("site_inputs", 2)])
def test_S3_S27_chunkwise_transformer_forward_matches_a_float64_reference(taps, per_chunk):
    """SPEC 3, written out in numpy float64: per chunk, the weightless RMS norm of its taps'
    concatenation -> w_in -> n_blocks of pre-norm bidirectional RoPE (base 10000) attention
    and GELU MLP -> final norm -> one head per site. Every parameter is perturbed, so a
    misplaced gain, bias or block (or a dropped RoPE) shows."""
    cfg = LlamaConfig(vocab_size=16, d_model=8, n_layers=4, n_heads=2, n_kv_heads=1, d_mlp=12,
                      max_seq_len=8)
    t = lm.init(cfg, jax.random.key(0))
    ci_cfg = CIFnConfig(kind="chunkwise_transformer", d_model=8, n_blocks=2, n_heads=2,
                        d_mlp=10, taps=taps, blocks_per_chunk=per_chunk)
    f = ci_lib.init(ci_cfg, jax.random.key(2), t.tap_widths(), {s: 3 for s in t.site_names})
    leaves, tree = jax.tree.flatten(f)
    f = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(jax.random.key(10 + i), x.shape)
                                  for i, x in enumerate(leaves)])
    tok = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    tapped = t.read_activations(tok, f.input_names)
    got = jax.jit(lambda f, x: f(x, None))(f, tapped)
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), f.params)
    d, H = ci_cfg.d_model, ci_cfg.n_heads
    hd = d // H

    def rms(x, g=None):
        y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + lm.NORM_EPS)
        return y if g is None else y * g

    inv = 1.0 / 10000 ** (np.arange(0, hd, 2) / hd)
    ang = np.concatenate([np.arange(T)[:, None] * inv] * 2, -1)

    def rope(x):  # [B, H, T, hd], rotate-half
        return x * np.cos(ang) + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]],
                                                -1) * np.sin(ang)

    def gelu(z):
        return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))

    def heads(y):
        return y.reshape(B, T, H, hd).transpose(0, 2, 1, 3)

    assert len(f.chunks) == cfg.n_layers // per_chunk
    for k, (sites, names) in enumerate(zip(f.chunks, f.chunk_taps)):
        h = rms(np.concatenate([np.asarray(tapped[n], np.float64) for n in names], -1))
        h = h @ P.w_in[k]
        b = P.blocks
        for j in range(ci_cfg.n_blocks):
            a = rms(h, b.ln_1[k, j])
            q, kk, v = heads(a @ b.wq[k, j]), heads(a @ b.wk[k, j]), heads(a @ b.wv[k, j])
            s = rope(q) @ rope(kk).transpose(0, 1, 3, 2) / np.sqrt(hd)  # no causal mask
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            h = h + (p @ v).transpose(0, 2, 1, 3).reshape(B, T, d) @ b.wo[k, j]
            h = h + gelu(rms(h, b.ln_2[k, j]) @ b.w1[k, j]) @ b.w2[k, j]
        h = rms(h, P.ln_f[k])
        for i, site in enumerate(sites):
            want = h @ P.head_w[i][k] + P.head_b[i][k]
            np.testing.assert_allclose(np.asarray(got[site], np.float64), want,
                                       rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=site)
