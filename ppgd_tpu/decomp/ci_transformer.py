"""The chunkwise-transformer CI fn (SPEC 3) for sequence targets.

Sites are partitioned into chunks: the sites of `blocks_per_chunk` consecutive target layers
(the layer is the first integer in the site name, `h.{L}.…`) form one chunk. Each chunk is
an independent pre-norm, bidirectional transformer: it reads the weightless-RMS-normed
concatenation of its taps, projects it to d_model, runs n_blocks RoPE (base 10000, inv_freq
stop-gradient'd [S27]) attention + GELU-MLP blocks, and ends in one Linear head per site
(d_model -> C_s). The chunks' parameters are STACKED on a leading axis and all chunks run
under one vmap, so every chunk must be homogeneous: the same tap widths, site count and C at
each position; `init` refuses a mismatch naming the chunk. The blocks, stacked too, run under
one `lax.scan`, unrolled on CPU (where the scan's stacked residuals cost ~20% of the LM step:
docs/performance-log.md). Every matmul is `lowrank.linear` (one 2-D matmul per weight).
Activations are pinned to the batch rows at block boundaries (tracing.shard_rows) [D1].

Taps (`decomp.ci_fn.taps`):
  * `resid`: `resid.{L}` of every layer of the chunk that has a decomposed site (the
    residual stream entering that block; the production choice: few, narrow taps);
  * `site_inputs`: every site's own input, in canonical order.
"""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import axes
from ppgd_tpu.config import CIFnConfig, ConfigError
from ppgd_tpu.decomp import rng
from ppgd_tpu.targets.llama_simple_mlp import apply_rope, attention, gelu, rms_norm, \
    rope_tables
from ppgd_tpu.targets.lowrank import dense, linear
from ppgd_tpu.tracing import platform, shard_rows

ROPE_BASE = 10000.0


class Blocks(eqx.Module):
    """Transformer blocks, stacked: [K chunks, n_blocks, ...] (axes declared per block)."""

    ln_1: jax.Array = axes.field("norm")  # [K, n, d]
    wq: jax.Array = axes.field("embed", "hidden")  # [K, n, d, d]
    wk: jax.Array = axes.field("embed", "hidden")
    wv: jax.Array = axes.field("embed", "hidden")
    wo: jax.Array = axes.field("hidden", "embed")
    ln_2: jax.Array = axes.field("norm")  # [K, n, d]
    w1: jax.Array = axes.field("embed", "hidden")  # [K, n, d, d_mlp]
    w2: jax.Array = axes.field("hidden", "embed")  # [K, n, d_mlp, d]


class ChunkParams(eqx.Module):
    """Everything with a leading chunk axis K (vmapped over; axes declared per chunk)."""

    w_in: jax.Array = axes.field("embed", "hidden")  # [K, D_in, d]
    blocks: Blocks = axes.field(stack=("layers",))  # scanned over
    ln_f: jax.Array = axes.field("norm")  # [K, d]
    head_w: tuple[jax.Array, ...] = axes.field("embed", "channels")  # per position j: [K, d, C_j]
    head_b: tuple[jax.Array, ...] = axes.field("channels")  # [K, C_j]


class ChunkwiseTransformer(eqx.Module):
    params: ChunkParams = axes.field(stack=("chunks",))
    chunks: tuple[tuple[str, ...], ...] = eqx.field(static=True)  # sites per chunk
    chunk_taps: tuple[tuple[str, ...], ...] = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for taps in self.chunk_taps for t in taps))

    def __call__(self, taps, components):
        first = dense(taps[self.chunk_taps[0][0]])
        if first.ndim != 3:
            raise ValueError(f"the chunkwise transformer needs sequence taps [B, T, d]; tap "
                             f"{self.chunk_taps[0][0]!r} has shape {first.shape}")
        x = jnp.stack([rms_norm(jnp.concatenate([dense(taps[t]) for t in names], axis=-1))
                       for names in self.chunk_taps])  # [K, B, T, D_in]
        out = jax.vmap(self._chunk)(self.params, x)  # per position j: [K, B, T, C_j]
        return {s: out[j][k] for k, sites in enumerate(self.chunks) for j, s in enumerate(sites)}

    def _chunk(self, p: ChunkParams, x):
        d = p.w_in.shape[-1]
        cos, sin = rope_tables(x.shape[1], d // self.n_heads, ROPE_BASE)

        def block(h, b: Blocks):
            B, T, _ = h.shape
            a = rms_norm(h, b.ln_1)
            q, k, v = (jnp.reshape(linear(a, w), (B, T, self.n_heads, -1))
                       for w in (b.wq, b.wk, b.wv))
            a = shard_rows(attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v,
                                     causal=False))
            h = shard_rows(h + linear(a, b.wo))
            return shard_rows(h + linear(gelu(linear(rms_norm(h, b.ln_2), b.w1)), b.w2)), None

        block = jax.checkpoint(block) if self.remat else block
        h = shard_rows(linear(x.astype(p.w_in.dtype), p.w_in))
        if platform() == "cpu":  # unrolled: no stacked residuals to zero, write and slice
            for i in range(p.blocks.wq.shape[0]):
                h, _ = block(h, jax.tree.map(lambda a: a[i], p.blocks))
        else:
            h, _ = jax.lax.scan(block, h, p.blocks)
        h = rms_norm(h, p.ln_f)
        return tuple(shard_rows(linear(h, w) + b) for w, b in zip(p.head_w, p.head_b))


def layer_of(site: str) -> int:
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", site)
    if m is None:
        raise ConfigError(f"decomp.ci_fn.kind: chunkwise_transformer groups sites by layer, "
                          f"but site {site!r} names no layer index")
    return int(m.group(1))


def partition(sites, blocks_per_chunk: int, taps: str):
    """(sites per chunk, taps per chunk) in canonical order."""
    groups: dict[int, list[str]] = {}
    for s in sites:
        groups.setdefault(layer_of(s) // blocks_per_chunk, []).append(s)
    chunks = tuple(tuple(g) for _, g in sorted(groups.items()))
    if taps == "site_inputs":
        return chunks, chunks
    return chunks, tuple(tuple(f"resid.{L}" for L in sorted({layer_of(s) for s in c}))
                         for c in chunks)


def _check_homogeneous(chunks, chunk_taps, d_in, C):
    def signature(k):
        return {"site count": len(chunks[k]),
                "tap widths": tuple(d_in[t] for t in chunk_taps[k]),
                "C per position": tuple(C[s] for s in chunks[k])}

    ref = signature(0)
    for k in range(1, len(chunks)):
        sig = signature(k)
        for what in ref:
            if sig[what] != ref[what]:
                raise ConfigError(
                    f"decomp.ci_fn: chunk {k} ({', '.join(chunks[k])}) differs from chunk 0 "
                    f"({', '.join(chunks[0])}) in {what}: {sig[what]} vs {ref[what]}; the "
                    "chunkwise transformer stacks chunks, so they must be homogeneous "
                    "(choose decomp.sites / decomp.ci_fn.blocks_per_chunk so every chunk "
                    "has the same sites and C)")


def init(cfg: CIFnConfig, key, d_in: dict[str, int], C: dict[str, int]) -> ChunkwiseTransformer:
    """`d_in`: width of every tap the target offers (site inputs, and `resid.{L}` for
    taps=resid); `C`: {site: C_s} in canonical order."""
    d, H, n, m = cfg.d_model, cfg.n_heads, cfg.n_blocks, cfg.d_mlp
    if d % H or (d // H) % 2:
        raise ConfigError(f"decomp.ci_fn.n_heads: {H} must divide d_model {d} into an even "
                          "head_dim (rotary pairs)")
    chunks, chunk_taps = partition(tuple(C), cfg.blocks_per_chunk, cfg.taps)
    missing = [t for names in chunk_taps for t in names if t not in d_in]
    if missing:
        raise ConfigError(f"decomp.ci_fn.taps: {cfg.taps!r} reads {missing[0]!r}, whose width "
                          "the target did not declare (the caller must pass the target's "
                          "tap_widths())")
    _check_homogeneous(chunks, chunk_taps, d_in, C)
    K, D_in = len(chunks), sum(d_in[t] for t in chunk_taps[0])
    ks = iter(jax.random.split(key, 8 + len(chunks[0])))

    def normal(shape, fan_in, scale=1.0):
        return rng.normal(next(ks), shape) * (scale / np.sqrt(fan_in))

    out_scale = 1.0 / np.sqrt(2 * n)  # residual writers
    blocks = Blocks(
        ln_1=jnp.ones((K, n, d)), ln_2=jnp.ones((K, n, d)),
        wq=normal((K, n, d, d), d), wk=normal((K, n, d, d), d), wv=normal((K, n, d, d), d),
        wo=normal((K, n, d, d), d, out_scale), w1=normal((K, n, d, m), d),
        w2=normal((K, n, m, d), m, out_scale))
    params = ChunkParams(
        w_in=normal((K, D_in, d), D_in), blocks=blocks, ln_f=jnp.ones((K, d)),
        head_w=tuple(normal((K, d, C[s]), d) for s in chunks[0]),
        head_b=tuple(jnp.zeros((K, C[s])) for s in chunks[0]))
    return ChunkwiseTransformer(params=params, chunks=chunks, chunk_taps=chunk_taps,
                                n_heads=H, remat=cfg.remat)


def n_params(ci_fn: ChunkwiseTransformer) -> int:
    """Its parameter count (to size a CI fn against its target)."""
    return sum(x.size for x in jax.tree.leaves(ci_fn))
