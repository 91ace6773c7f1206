"""LlamaSimpleMLP: forward semantics against an independent float64 numpy reference [S2-S4]."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ppgd_tpu.config import ConfigError, LlamaConfig, TargetConfig, from_dict
from ppgd_tpu.decomp import components as comp_lib
from ppgd_tpu.targets import build
from ppgd_tpu.targets import llama_simple_mlp as lm
from ppgd_tpu.targets.base import SiteMask

CFG = LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=24,
                  max_seq_len=8, rope_base=500.0)
B, T = 2, 7


def _target(cfg=CFG, seed=0):
    # Norm gains away from 1 so a missing or misplaced gain is visible.
    t = lm.init(cfg, jax.random.key(seed))
    sd = lm.state_dict(t)
    for i, k in enumerate(sd):
        if sd[k].ndim == 1:
            sd[k] = 1.0 + 0.3 * jax.random.normal(jax.random.key(100 + i), sd[k].shape)
        else:
            sd[k] = sd[k] * 10.0  # larger weights: attention patterns far from uniform
    return lm.from_state_dict(cfg, sd)


def _tokens(seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)


# ------------------------------------------------------------------ numpy reference


def _ref_forward(sd, cfg, tokens, site=lambda name, x, W: x @ W):
    """Llama (HF convention: rotate-half RoPE, GQA by repeat, causal) + tanh-GELU MLP."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    tokens = np.asarray(tokens)
    H, KV, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_model
    hd = d // H
    Tn = tokens.shape[1]

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + lm.NORM_EPS) * g

    inv = 1.0 / cfg.rope_base ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(Tn)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # [B, heads, T, hd]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    h = sd["wte"][tokens]
    for L in range(cfg.n_layers):
        p = lambda n: sd[f"h.{L}.{n}"]
        x = rms(h, p("ln_1"))
        heads = lambda y, n: y.reshape(*y.shape[:2], n, hd).transpose(0, 2, 1, 3)
        q = rope(heads(site(f"h.{L}.attn.q_proj", x, p("attn.q_proj")), H))
        k = rope(heads(site(f"h.{L}.attn.k_proj", x, p("attn.k_proj")), KV))
        v = heads(site(f"h.{L}.attn.v_proj", x, p("attn.v_proj")), KV)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((Tn, Tn), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = (a / a.sum(-1, keepdims=True)) @ v
        a = a.transpose(0, 2, 1, 3).reshape(*h.shape[:2], H * hd)
        h = h + site(f"h.{L}.attn.o_proj", a, p("attn.o_proj"))
        u = site(f"h.{L}.mlp.c_fc", rms(h, p("ln_2")), p("mlp.c_fc"))
        u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
        h = h + site(f"h.{L}.mlp.down_proj", u, p("mlp.down_proj"))
    return rms(h, sd["ln_f"]) @ sd["wte"].T


def _comps(t, C=5, seed=3):
    return comp_lib.init(jax.random.key(seed), t.site_weights(), {s: C for s in t.site_names})


# ------------------------------------------------------------------ tests


def test_sites_canonical_order_and_shapes():
    t = _target()
    hd = CFG.d_model // CFG.n_heads
    want = []
    for L in range(CFG.n_layers):
        want += [f"h.{L}.attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        want += [f"h.{L}.mlp.c_fc", f"h.{L}.mlp.down_proj"]
    assert t.site_names == tuple(want)
    w = t.site_weights()
    shapes = build.site_shapes(TargetConfig(kind="llama_simple_mlp", llama_simple_mlp=CFG))
    assert list(shapes.items()) == [(n, w[n].shape) for n in want]  # no compute, same order
    assert w["h.0.attn.k_proj"].shape == (CFG.d_model, CFG.n_kv_heads * hd)
    assert w["h.1.mlp.down_proj"].shape == (CFG.d_mlp, CFG.d_model)


def test_clean_forward_matches_reference():
    t, x = _target(), _tokens()
    ref = _ref_forward(lm.state_dict(t), CFG, x)
    np.testing.assert_allclose(np.asarray(t.clean_output(x)), ref, rtol=1e-4, atol=1e-4)


def test_S2_no_live_sites_is_bit_identical_to_clean():
    t, x = _target(), _tokens()
    out = t.masked_forward(x, _comps(t), {})
    np.testing.assert_array_equal(np.asarray(out), np.asarray(t.clean_output(x)))


def test_all_ones_masks_with_delta_and_routing_match_clean():
    t, x = _target(), _tokens()
    comps = _comps(t)  # V U far from W: only the delta channel restores W
    ones = {s: SiteMask(mask=jnp.ones((B, T, 5)), delta=jnp.ones((B, T)),
                        route=jnp.ones((B, T), bool)) for s in t.site_names}
    clean = np.asarray(t.clean_output(x))
    np.testing.assert_allclose(np.asarray(t.masked_forward(x, comps, ones)), clean,
                               rtol=1e-4, atol=1e-4)
    no_delta = {s: SiteMask(mask=jnp.ones((B, T, 5))) for s in t.site_names}
    assert np.abs(np.asarray(t.masked_forward(x, comps, no_delta)) - clean).max() > 1e-2


@pytest.mark.parametrize("site", ["h.0.attn.q_proj", "h.1.mlp.c_fc"])
def test_zeroing_one_site_mask_matches_reference(site):
    """q is decomposed BEFORE RoPE, c_fc BEFORE the GELU: the reference applies RoPE / GELU
    to the masked site output, and the model agrees."""
    t, x = _target(), _tokens()
    comps = _comps(t)
    zero = {site: SiteMask(mask=jnp.zeros((B, T, 5)), delta=jnp.zeros((B, T)))}
    out = np.asarray(t.masked_forward(x, comps, zero))
    assert np.abs(out - np.asarray(t.clean_output(x))).max() > 1e-2
    ref = _ref_forward(lm.state_dict(t), CFG, x,
                       lambda n, h, W: np.zeros((*h.shape[:-1], W.shape[1])) if n == site
                       else h @ W)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_masked_site_output_is_the_spec2_formula_by_hand():
    """One live site with random mask / delta mask / routing: the model equals the reference
    with that site computed as where(route, ((x V) * m) U + (x (W - V U)) * dm, x W)."""
    t, x = _target(), _tokens()
    comps = _comps(t)
    site = "h.1.attn.o_proj"
    ks = jax.random.split(jax.random.key(9), 3)
    m = jax.random.uniform(ks[0], (B, T, 5))
    dm = jax.random.uniform(ks[1], (B, T))
    route = jax.random.bernoulli(ks[2], 0.5, (B, T))
    out = t.masked_forward(x, comps, {site: SiteMask(m, dm, route)})
    V, U = np.asarray(comps.V[site], np.float64), np.asarray(comps.U[site], np.float64)

    def by_hand(n, h, W):
        if n != site:
            return h @ W
        dec = ((h @ V) * np.asarray(m)) @ U + (h @ (W - V @ U)) * np.asarray(dm)[..., None]
        return np.where(np.asarray(route)[..., None], dec, h @ W)

    ref = _ref_forward(lm.state_dict(t), CFG, x, by_hand)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)


def test_S4_taps_have_the_right_widths_and_values():
    t, x = _target(), _tokens()
    hd = CFG.d_model // CFG.n_heads
    wanted = ("resid.0", "resid.1", "h.0.attn.o_proj", "h.1.mlp.down_proj", "h.1.attn.v_proj")
    taps = t.read_activations(x, wanted)
    assert tuple(taps) == wanted
    assert taps["resid.0"].shape == (B, T, CFG.d_model)
    assert taps["h.0.attn.o_proj"].shape == (B, T, CFG.n_heads * hd)
    assert taps["h.1.mlp.down_proj"].shape == (B, T, CFG.d_mlp)
    widths = t.tap_widths()
    assert all(widths[k] == v.shape[-1] for k, v in taps.items())
    np.testing.assert_array_equal(np.asarray(taps["resid.0"]), np.asarray(t.wte[x]))
    # A site input deep in the net equals the reference's.
    seen = {}

    def rec(n, h, W):
        seen[n] = h
        return h @ W

    _ref_forward(lm.state_dict(t), CFG, x, rec)
    np.testing.assert_allclose(np.asarray(taps["h.1.mlp.down_proj"]), seen["h.1.mlp.down_proj"],
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="resid.7"):
        t.read_activations(x, ("resid.7",))
    with pytest.raises(ValueError, match="unknown tap"):
        t.read_activations(x, ("embed",))


def test_read_activations_stops_after_the_last_wanted_layer():
    t, x = _target(), _tokens()
    jaxpr = str(jax.make_jaxpr(lambda t, x: t.read_activations(x, ("resid.0", "h.0.attn.q_proj"))
                               )(t, x))
    full = str(jax.make_jaxpr(lambda t, x: t.read_activations(x, ("resid.1",)))(t, x))
    assert jaxpr.count("dot_general") < full.count("dot_general")


def test_remat_matches_plain_values_and_gradients():
    t, x = _target(), _tokens()
    tr = _target(dataclasses.replace(CFG, remat=True))
    comps = _comps(t)
    masks = {s: SiteMask(mask=jnp.full((B, T, 5), 0.7), delta=jnp.ones((B, T)))
             for s in t.site_names}

    def loss(c, target):
        return target.divergence(target.masked_forward(x, c, masks), target.clean_output(x))

    v0, g0 = jax.jit(jax.value_and_grad(loss))(comps, t)
    v1, g1 = jax.jit(jax.value_and_grad(loss))(comps, tr)
    np.testing.assert_allclose(v0, v1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    assert "remat" in str(jax.make_jaxpr(lambda c: jax.grad(loss)(c, tr))(comps))


def test_divergence_is_kl_and_leading_shape_is_positions():
    t, x = _target(), _tokens()
    clean = t.clean_output(x)
    assert float(t.divergence(clean, clean)) == pytest.approx(0.0, abs=1e-6)
    assert float(t.divergence(jnp.zeros_like(clean), clean)) > 0
    assert t.leading_shape((B, T)) == (B, T)
    assert t.n_features is None


def test_save_load_roundtrip_and_refusals_by_name(tmp_path):
    cfg = TargetConfig(kind="llama_simple_mlp", llama_simple_mlp=CFG)
    t, x = _target(), _tokens()
    path = str(tmp_path / "lm.safetensors")
    build.save(t, cfg, path)
    back = build.load(cfg, path)
    np.testing.assert_array_equal(np.asarray(back.clean_output(x)), np.asarray(t.clean_output(x)))

    sd = load_file(path)
    bad = dict(sd, **{"h.1.attn.k_proj": np.zeros((16, 4), np.float32)})
    save_file(bad, path)
    with pytest.raises(build.TargetError, match=r"'h\.1\.attn\.k_proj' has shape \(16, 4\)"):
        build.load(cfg, path)
    missing = {k: v for k, v in sd.items() if k != "h.0.ln_2"}
    save_file(dict(missing, extra=np.zeros(3, np.float32)), path)
    with pytest.raises(build.TargetError, match=r"missing tensor 'h\.0\.ln_2'.*unexpected tensor "
                                                r"'extra'"):
        build.load(cfg, path)


def test_build_refuses_an_lm_without_a_path():
    with pytest.raises(ConfigError, match="target.path.*ppgd-tpu pretrain"):
        build.build(TargetConfig(kind="llama_simple_mlp", llama_simple_mlp=CFG))


def test_config_refuses_bad_head_counts_by_field():
    with pytest.raises(ConfigError, match="target.llama_simple_mlp.n_kv_heads"):
        from_dict(TargetConfig, {"kind": "llama_simple_mlp",
                                 "llama_simple_mlp": {"n_heads": 4, "n_kv_heads": 3}})
    with pytest.raises(ConfigError, match="target.llama_simple_mlp.n_heads"):
        from_dict(TargetConfig, {"llama_simple_mlp": {"d_model": 12, "n_heads": 4}})


def test_inputs_longer_than_max_seq_len_are_refused():
    t = _target()
    with pytest.raises(ValueError, match="max_seq_len 8"):
        t.clean_output(jnp.zeros((1, 9), jnp.int32))


def test_gelu_is_jax_gelu_with_the_same_derivative():
    """The LM's and the CI transformer's GELU: jax.nn.gelu's tanh form bit for bit, and a
    hand-written derivative as close to the float64 one as autodiff's (both cancel where
    the tanh saturates; XLA's fp32 tanh leaves ~4e-6 either way)."""
    x = jnp.linspace(-6.0, 6.0, 10001, dtype=jnp.float32)
    np.testing.assert_array_equal(lm.gelu(x), jax.nn.gelu(x, approximate=True))
    np.testing.assert_array_equal(jax.jit(lm.gelu)(x), jax.jit(jax.nn.gelu)(x))
    mine = jax.vmap(jax.grad(lm.gelu))(x)
    ref = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(x)
    x64 = np.asarray(x, np.float64)
    t = np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3))
    exact = 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * np.sqrt(2 / np.pi) * (
        1 + 3 * 0.044715 * x64 ** 2)
    err_mine, err_ref = np.abs(mine - exact).max(), np.abs(ref - exact).max()
    assert err_mine < 1e-5 and err_mine <= 1.5 * err_ref + 1e-7, (err_mine, err_ref)
    y, dy = jax.jvp(lm.gelu, (x,), (jnp.ones_like(x),))
    np.testing.assert_array_equal(y, jax.nn.gelu(x, approximate=True))
    np.testing.assert_array_equal(dy, mine)


def _copied_sizes(compiled) -> list[int]:
    """Element counts of the arrays a compiled program copies into another layout: its
    top-level copies and transposes, and fusions XLA named after one (their root)."""
    from ppgd_tpu import hlo

    module, sizes = hlo.Module(compiled.as_text()), []
    for comp, instrs in module.computations.items():
        fused = comp.startswith(("fused_", "wrapped_"))
        for ins in instrs:
            if (ins.opcode in ("copy", "transpose") and not fused) or (
                    ins.opcode == "fusion" and ins.name.startswith(("copy", "transpose"))):
                sizes += [int(np.prod(dims)) for _, dims in hlo.arrays(ins.shape)[:1]]
    return sizes


def test_the_mlp_and_attention_gradients_copy_no_activation_sized_array():
    """On XLA:CPU a weight gradient contracting both B and T, or an attention einsum whose
    batch dims are not leading, copies the [B, T, d_mlp] cotangent or the [B, H, T, T]
    scores into a transposed layout, in every block's backward (docs/performance-log.md).
    `linear` and `attention` are laid out so the gradient of an MLP + attention block
    copies nothing that large."""
    from ppgd_tpu.targets.lowrank import linear

    Bx, Tx, d, m, H, kv = 4, 32, 16, 96, 4, 2
    hd = d // H

    def block(w, x):
        q = linear(x, w["q"]).reshape(Bx, Tx, H, hd)
        k, v = (linear(x, w[n]).reshape(Bx, Tx, kv, hd) for n in ("k", "v"))
        h = x + linear(lm.attention(q, k, v, causal=True), w["o"])
        return jnp.sum(linear(lm.gelu(linear(h, w["fc"])), w["down"]) ** 2)

    shapes = {"q": (d, d), "k": (d, kv * hd), "v": (d, kv * hd), "o": (d, d), "fc": (d, m),
              "down": (m, d)}
    w = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in shapes.items()}
    x = jax.ShapeDtypeStruct((Bx, Tx, d), jnp.float32)
    compiled = jax.jit(jax.grad(block, argnums=(0, 1))).lower(w, x).compile()
    sizes = _copied_sizes(compiled)
    assert max(sizes, default=0) < min(Bx * Tx * m, Bx * H * Tx * Tx), sorted(sizes)[-5:]
