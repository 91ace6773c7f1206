"""LlamaSimpleMLP: the LM target (SPEC 2), a Llama-style decoder with a plain GELU MLP.

    h = wte[tokens]
    per block L:  h += o_proj(attn(rope(q_proj(x)), rope(k_proj(x)), v_proj(x))),  x = rms(h) g1
                  h += down_proj(gelu_tanh(c_fc(rms(h) g2)))
    logits = (rms(h) g_f) wte^T                       (embedding tied with the LM head)

Attention is causal grouped-query (n_kv_heads divides n_heads), RoPE rotate-half with a
configurable base; there are no biases. Sites, in canonical order (layer ascending, then
q, k, v, o, c_fc, down_proj): `h.{L}.attn.{q,k,v,o}_proj`, `h.{L}.mlp.{c_fc,down_proj}`,
each W [d_in, d_out]. q/k/v are decomposed BEFORE RoPE/attention, o after attention,
c_fc before the GELU, down_proj after it: every projection goes through `site_fn`, so a
block with no live site runs the frozen path [S2]. Activations are pinned to the batch rows
at block boundaries (tracing.shard_rows) [D1].

Taps [S4]: `resid.{L}` (the residual entering block L) and every site name (its input).
The safetensors names are the state-dict names: `wte`, `ln_f`, `h.{L}.ln_1`, `h.{L}.ln_2`
and the site names.
"""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import axes
from ppgd_tpu.config import ConfigError, LlamaConfig
from ppgd_tpu.tracing import shard_rows
from ppgd_tpu.decomp.divergence import kl
from ppgd_tpu.targets.base import Target, frozen, nonfinite
from ppgd_tpu.targets.lowrank import linear

NORM_EPS = 1e-5
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("c_fc", "down_proj")
# `ppgd-tpu train` never pretrains an LM implicitly: it is loaded from target.path.
NEEDS_PATH = ("target.path: the llama_simple_mlp target is loaded from a file; make one from "
              "this same config (its target section defines the LM) with `ppgd-tpu pretrain "
              "--config CONFIG --store STORE --output PATH` and pass --target.path=PATH")


# The config fields that decide what given weights compute (build.load checks a file's
# recorded config against them; the others are how it was trained, or compute only).
ARCHITECTURE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp",
                 "rope_base")


def rms_norm(x, weight=None):
    """RMSNorm in fp32 (then back to x's dtype); `weight` None = weightless."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + NORM_EPS)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


@jax.custom_jvp
def gelu(x):
    """tanh-GELU, jax.nn.gelu(x, approximate=True) bit for bit, with its derivative from the
    same tanh. Autodiff of jax.nn.gelu sums x's cotangent over its three uses, and XLA:CPU
    fused that sum with a transposing copy of the [B*T, d_mlp] cotangent (the CI
    transformer's costliest op: docs/performance-log.md)."""
    return jax.nn.gelu(x, approximate=True)


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    k0 = np.sqrt(2 / np.pi).astype(x.dtype)
    t = jnp.tanh(k0 * (x + 0.044715 * (x ** 3)))
    cdf = 0.5 * (1.0 + t)  # jax.nn.gelu's own ops: the same value
    slope = cdf + 0.5 * x * (1.0 - t * t) * k0 * (1.0 + 3 * 0.044715 * x * x)
    return x * cdf, slope * dx


def rope_tables(seq_len: int, head_dim: int, base: float):
    """cos, sin [T, head_dim] for rotate-half RoPE; inv_freq is a constant [S27]."""
    inv_freq = jax.lax.stop_gradient(
        1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)))
    ang = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """x [..., T, heads, head_dim]; rotate-half convention (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * c + rot * s


def attention(q, k, v, causal: bool):
    """q [B,T,H,hd], k/v [B,T,Hkv,hd] -> [B,T,H*hd]; fp32 softmax, GQA by head groups (query
    head h reads kv head h // (H / Hkv)).

    The query heads of a kv group are laid out next to each other along the rows,
    [B, Hkv, G*T, hd]: each einsum, and each of its gradients, is then one batched matmul
    contracting ONE dim, so XLA:CPU never copies the [.., T, T] scores or probabilities
    into another layout (docs/performance-log.md)."""
    B, T, H, hd = q.shape
    kv = k.shape[2]
    G = H // kv
    q = q.reshape(B, T, kv, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, kv, G * T, hd)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, hd]
    scores = jnp.einsum("bkqd,bksd->bkqs", q, k).astype(jnp.float32) / np.sqrt(hd)
    if causal:  # row g*T + t of a group is query position t
        scores = jnp.where(jnp.tile(jnp.tril(jnp.ones((T, T), bool)), (G, 1)), scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqs,bksd->bkqd", p, v).reshape(B, kv, G, T, hd)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H * hd)


class Block(eqx.Module):
    ln_1: jax.Array = axes.field("norm")  # [d]
    q_proj: jax.Array = axes.field("embed", "heads")  # [d, H*hd]
    k_proj: jax.Array = axes.field("embed", "heads")  # [d, Hkv*hd]
    v_proj: jax.Array = axes.field("embed", "heads")  # [d, Hkv*hd]
    o_proj: jax.Array = axes.field("heads", "embed")  # [H*hd, d]
    ln_2: jax.Array = axes.field("norm")  # [d]
    c_fc: jax.Array = axes.field("embed", "hidden")  # [d, d_mlp]
    down_proj: jax.Array = axes.field("hidden", "embed")  # [d_mlp, d]


def _layer_of(name: str) -> int:
    m = re.fullmatch(r"(?:resid\.(\d+)|h\.(\d+)\.(?:attn|mlp)\.\w+)", name)
    if m is None:
        raise ValueError(f"unknown tap {name!r}: the LM offers resid.{{L}} and its site names")
    return int(m.group(1) or m.group(2))


class LlamaSimpleMLP(Target):
    wte: jax.Array = axes.field("vocab", "embed")  # [vocab, d], tied with the LM head
    blocks: tuple[Block, ...]
    ln_f: jax.Array = axes.field("norm")  # [d]
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    rope_base: float = eqx.field(static=True)
    max_seq_len: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True, default=False)

    # ------------------------------------------------------------ Target protocol

    def site_weights(self):
        sites = {}
        for L, b in enumerate(self.blocks):
            for p in ATTN:
                sites[f"h.{L}.attn.{p}"] = getattr(b, p)
            for p in MLP:
                sites[f"h.{L}.mlp.{p}"] = getattr(b, p)
        return sites

    def forward(self, inputs, site_fn):
        h, tables = self._embed(inputs)
        for L in range(len(self.blocks)):
            block = lambda h, L=L: self._block(L, h, site_fn, tables)
            h = jax.checkpoint(block)(h) if self.remat else block(h)
        return shard_rows(linear(rms_norm(h, self.ln_f), self.wte.T))

    def read_activations(self, inputs, wanted):
        """[S4] `resid.{L}` and site inputs, clean path, gradient-stopped; the forward stops
        after the last layer a wanted tap lives in."""
        wanted = tuple(wanted)
        layers = {k: _layer_of(k) for k in wanted}
        for k, L in layers.items():
            if L >= len(self.blocks):
                raise ValueError(f"tap {k!r}: layer {L} is out of range (the LM has "
                                 f"{len(self.blocks)} layers)")
        last = max(layers.values())
        taps = {}

        def record(name, x, W):
            if name in wanted:
                taps[name] = jax.lax.stop_gradient(x)
            return frozen(name, x, W)

        h, tables = self._embed(inputs)
        for L in range(last + 1):
            if f"resid.{L}" in wanted:
                taps[f"resid.{L}"] = jax.lax.stop_gradient(h)
            h = self._block(L, h, record, tables)
        return {k: taps[k] for k in wanted}

    def tap_widths(self) -> dict[str, int]:
        """Width of every tap this target offers: site inputs and `resid.{L}`."""
        widths = {s: W.shape[0] for s, W in self.site_weights().items()}
        widths.update({f"resid.{L}": self.d_model for L in range(len(self.blocks))})
        return widths

    def divergence(self, masked, clean):
        """[S25] KL(softmax(clean) || softmax(masked)), mean over positions."""
        return kl(clean, masked)

    input_axes = axes.Axes((axes.ROWS,))  # tokens [B, T]

    def leading_shape(self, batch_shape):
        """Token inputs [B, T]: CI and masks are per position."""
        return tuple(batch_shape)

    # ------------------------------------------------------------ internals

    @property
    def d_model(self) -> int:
        return self.wte.shape[1]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def _embed(self, tokens):
        if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 2:
            raise ValueError(f"LM inputs must be int token ids [B, T], got {tokens.dtype} "
                             f"{tokens.shape}")
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the target's "
                             f"max_seq_len {self.max_seq_len}")
        return (shard_rows(self.wte[tokens]),
                rope_tables(tokens.shape[1], self.head_dim, self.rope_base))

    def _block(self, L, h, site_fn, tables):
        b = self.blocks[L]
        B, T, _ = h.shape
        hd = self.head_dim
        x = rms_norm(h, b.ln_1)
        q = site_fn(f"h.{L}.attn.q_proj", x, b.q_proj).reshape(B, T, self.n_heads, hd)
        k = site_fn(f"h.{L}.attn.k_proj", x, b.k_proj).reshape(B, T, self.n_kv_heads, hd)
        v = site_fn(f"h.{L}.attn.v_proj", x, b.v_proj).reshape(B, T, self.n_kv_heads, hd)
        cos, sin = tables
        a = shard_rows(attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v,
                                 causal=True))
        h = shard_rows(h + site_fn(f"h.{L}.attn.o_proj", a, b.o_proj))
        x = rms_norm(h, b.ln_2)
        u = gelu(site_fn(f"h.{L}.mlp.c_fc", x, b.c_fc))
        return shard_rows(h + site_fn(f"h.{L}.mlp.down_proj", u, b.down_proj))


# ---------------------------------------------------------------- build.py module protocol


def _shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
    shapes = {"wte": (cfg.vocab_size, d), "ln_f": (d,)}
    per = {"ln_1": (d,), "attn.q_proj": (d, cfg.n_heads * hd),
           "attn.k_proj": (d, cfg.n_kv_heads * hd), "attn.v_proj": (d, cfg.n_kv_heads * hd),
           "attn.o_proj": (cfg.n_heads * hd, d), "ln_2": (d,), "mlp.c_fc": (d, cfg.d_mlp),
           "mlp.down_proj": (cfg.d_mlp, d)}
    for L in range(cfg.n_layers):
        shapes.update({f"h.{L}.{k}": v for k, v in per.items()})
    return shapes


def init(cfg: LlamaConfig, key) -> LlamaSimpleMLP:
    """GPT-2 style init: N(0, 0.02), residual writers scaled by 1/sqrt(2 n_layers), norms 1."""
    sd = {}
    for i, (name, shape) in enumerate(_shapes(cfg).items()):
        if len(shape) == 1:
            sd[name] = jnp.ones(shape, jnp.float32)
            continue
        std = 0.02 / (np.sqrt(2 * cfg.n_layers) if name.endswith(("o_proj", "down_proj"))
                      else 1.0)
        sd[name] = std * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    return from_state_dict(cfg, sd)


def trainable_filter(target: LlamaSimpleMLP):
    return jax.tree.map(lambda _: True, target)


def state_dict(target: LlamaSimpleMLP) -> dict[str, jax.Array]:
    sd = {"wte": target.wte, "ln_f": target.ln_f}
    for L, b in enumerate(target.blocks):
        sd[f"h.{L}.ln_1"] = b.ln_1
        sd[f"h.{L}.ln_2"] = b.ln_2
    sd.update(target.site_weights())
    return sd


def from_state_dict(cfg: LlamaConfig, sd) -> LlamaSimpleMLP:
    blocks = tuple(
        Block(ln_1=jnp.asarray(sd[f"h.{L}.ln_1"]), ln_2=jnp.asarray(sd[f"h.{L}.ln_2"]),
              **{p: jnp.asarray(sd[f"h.{L}.attn.{p}"]) for p in ATTN},
              **{p: jnp.asarray(sd[f"h.{L}.mlp.{p}"]) for p in MLP})
        for L in range(cfg.n_layers))
    return LlamaSimpleMLP(wte=jnp.asarray(sd["wte"]), blocks=blocks, ln_f=jnp.asarray(sd["ln_f"]),
                          n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                          rope_base=cfg.rope_base, max_seq_len=cfg.max_seq_len,
                          remat=cfg.remat)


def check(target: LlamaSimpleMLP, cfg: LlamaConfig) -> list[str]:
    """Every weight finite (a diverged pretraining run is refused by name)."""
    return nonfinite(state_dict(target))


def check_tokens(cfg: LlamaConfig, vocab_size: int, seq_len: int, where: str) -> None:
    """Refuses data the target cannot read (ids past its vocabulary, rows past max_seq_len)."""
    if vocab_size > cfg.vocab_size:
        raise ConfigError(f"target.llama_simple_mlp.vocab_size: {cfg.vocab_size} is smaller "
                          f"than the vocabulary of {where} ({vocab_size})")
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"target.llama_simple_mlp.max_seq_len: {cfg.max_seq_len} is shorter "
                          f"than the sequences of {where} ({seq_len})")
