"""Recon divergences (SPEC 4), fp32: MSE for toys, KL(clean || masked) for LMs [S25]."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mse(masked, clean):
    """Toy recon divergence: mean over elements, fp32."""
    return jnp.mean(jnp.square(masked.astype(jnp.float32) - clean.astype(jnp.float32)))


def kl(clean_logits, masked_logits):
    """[S25] KL(softmax(clean) || softmax(masked)) summed over vocab, mean over positions."""
    p_log = jax.nn.log_softmax(clean_logits.astype(jnp.float32), axis=-1)
    q_log = jax.nn.log_softmax(masked_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1))
