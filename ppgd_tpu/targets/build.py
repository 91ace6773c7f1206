"""Building a frozen toy target: load it, or train it deterministically and cache it.

A toy target is a pure function of its config (kind, seed, sizes, pretraining settings),
so it is cached under a hash of that config: `ppgd-tpu train` needs no pre-existing file,
and the second run reuses the first one's weights. Every target is validated before it is
decomposed; a bad one is refused with the reason. Weights are safetensors files whose
tensor names are the target's state-dict names; a missing, extra or mis-shaped tensor is
refused by name.

The cache is only a cache: a cached file that cannot be used (damaged, cut short, edited)
is trained again from its config and replaced, with a warning naming it; a cache that
cannot be written ($PPGD_TPU_CACHE read-only, or a file) costs only the next run's
pretraining: the trained target is used uncached, with a warning. Either way the run
decomposes the weights its config defines, and a resume still checks them (target.json).
"""

from __future__ import annotations

import hashlib
import json
import os
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import optax
import equinox as eqx
from absl import logging
from safetensors import numpy as safetensors_numpy

from ppgd_tpu import cache, storage
from ppgd_tpu.config import ConfigError, TargetConfig, from_dict, leaves, to_dict
from ppgd_tpu.targets import llama_simple_mlp, resid_mlp, tms
from ppgd_tpu.targets.base import Target, frozen

KINDS: dict[str, ModuleType] = {"tms": tms, "resid_mlp": resid_mlp,
                                "llama_simple_mlp": llama_simple_mlp}


class TargetError(ValueError):
    """A target that cannot be used (bad weights file, failed validation)."""


def _kind(cfg: TargetConfig):
    return KINDS[cfg.kind], getattr(cfg, cfg.kind)


def cache_path(cfg: TargetConfig) -> str:
    sub = getattr(cfg, cfg.kind)
    blob = json.dumps({"kind": cfg.kind, "seed": cfg.seed, cfg.kind: to_dict(sub)}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return os.path.join(cache.root(), "targets", f"{cfg.kind}-{digest}.safetensors")


def pretrain(cfg: TargetConfig) -> Target:
    """Trains the toy target of `cfg` from `cfg.seed` (AdamW; one jitted scan)."""
    mod, sub = _kind(cfg)
    key = jax.random.key(cfg.seed)
    target = mod.init(sub, jax.random.fold_in(key, 0))
    params, static = eqx.partition(target, mod.trainable_filter(target))
    if cfg.kind == "resid_mlp":
        lr = optax.cosine_decay_schedule(sub.train_lr, sub.train_steps)
    else:
        lr = sub.train_lr
    opt = optax.adamw(lr, weight_decay=sub.weight_decay)

    def loss(p, x):
        t = eqx.combine(p, static)
        out = t.forward(x, frozen)
        return jnp.mean(jnp.square(out - t.labels(x)))

    def step(carry, i):
        p, s = carry
        x = eqx.combine(p, static).sample(jax.random.fold_in(key, i + 1), sub.train_batch)
        val, g = jax.value_and_grad(loss)(p, x)
        upd, s = opt.update(g, s, p)
        return (optax.apply_updates(p, upd), s), val

    @jax.jit
    def run(p):
        (p, _), losses = jax.lax.scan(step, (p, opt.init(p)), jnp.arange(sub.train_steps))
        return p, losses

    params, losses = run(params)
    logging.info("pretrained %s target: final loss %.3e", cfg.kind, float(losses[-1]))
    return eqx.combine(params, static)


def save(target: Target, cfg: TargetConfig, path: str, data: dict | None = None) -> None:
    """Writes safetensors + the target config (metadata), atomically, locally or on gs://.
    `data`: what an LM was pretrained on (its token store's tokenizer and id), which
    `check_tokenizer` holds a decomposition's store to."""
    mod, _ = _kind(cfg)
    tensors = {k: np.asarray(v) for k, v in mod.state_dict(target).items()}
    metadata = {"target": json.dumps(to_dict(cfg))}
    if data is not None:
        metadata["data"] = json.dumps(data)
    storage.write_bytes(path, safetensors_numpy.save(tensors, metadata=metadata))


def load(cfg: TargetConfig, path: str, what: str = "target.path") -> Target:
    """Loads weights named as the target's state dict; refuses missing/extra/mis-shaped.
    `what` names the file's origin in the refusal (the flag, or the toy target cache)."""
    mod, sub = _kind(cfg)
    if not storage.exists(path):
        raise ConfigError(f"{what}: no such file {path!r}")
    if storage.is_dir(path):
        raise ConfigError(f"{what}: {path} is a directory; expected a safetensors file "
                          "(`ppgd-tpu pretrain --output` writes one)")
    blob = storage.read_bytes(path)
    try:
        sd = safetensors_numpy.load(blob)
    except Exception as e:  # safetensors raises several types for a damaged header
        raise TargetError(f"{what}: {path} is not a readable safetensors file ({e})") from None
    if recorded(blob, "resume") is not None:  # pretrain's <stem>.resume.safetensors
        raise ConfigError(f"{what}: {path} is the saved state of an interrupted pretraining, "
                          "not a target: re-run that pretrain command to finish it, and give "
                          "its --output here")
    _check_recorded_config(cfg, recorded(blob, "target"), path, what)
    template = jax.eval_shape(lambda: mod.state_dict(mod.init(sub, jax.random.key(0))))
    problems = [f"missing tensor {k!r} (expected shape {tuple(v.shape)})"
                for k, v in template.items() if k not in sd]
    problems += [f"unexpected tensor {k!r}" for k in sd if k not in template]
    problems += [f"tensor {k!r} has shape {tuple(sd[k].shape)}, expected {tuple(v.shape)}"
                 for k, v in template.items() if k in sd and sd[k].shape != tuple(v.shape)]
    if problems:
        raise TargetError(f"{what}: {path} does not match target.{cfg.kind}: "
                          + "; ".join(problems))
    return mod.from_state_dict(sub, {k: v.astype(np.float32) for k, v in sd.items()})


def recorded(head: bytes, name: str) -> dict | None:
    """The dict `save` wrote as metadata entry `name` ("target": the config, "data": what
    an LM was pretrained on) into a safetensors file starting with `head`; None for files
    from elsewhere. The header: a little-endian u64 length, then that much JSON."""
    try:
        header = json.loads(head[8:8 + int.from_bytes(head[:8], "little")])
        recorded = json.loads(header.get("__metadata__", {}).get(name, "null"))
    except (ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, dict) else None


MAX_HEADER = 100 << 20  # the safetensors format's own bound on its header


def header(path: str) -> bytes | None:
    """The safetensors header of the file at `path` (read alone: weights can be large);
    None if it cannot be read as one."""
    try:
        size = int.from_bytes(storage.read_range(path, 0, 8), "little")
        if size > MAX_HEADER:  # not safetensors (any 8 bytes of text read as a length)
            return None
        return storage.read_range(path, 0, 8 + size)
    except (OSError, ValueError):
        return None


def pretrained_differences(path: str, cfg: TargetConfig, store_id: str | None = None
                           ) -> list[str] | None:
    """What `pretrain` would do differently than the pretraining that wrote the target at
    `path`: the config fields (and, for an LM, the token store) that differ; [] when it
    would write the same target; None when `path` holds no target `pretrain` wrote."""
    head = header(path) if storage.exists(path) else None
    saved = recorded(head or b"", "target")
    if saved is None:
        return None
    try:
        theirs = {p: v for p, _, v, _ in leaves(from_dict(TargetConfig, saved))}
    except ConfigError as e:
        return [f"its target config, which this version cannot read ({e})"]
    out = [f"target.{p}: {theirs.get(p)!r} there, {v!r} here"
           for p, _, v, _ in leaves(cfg) if _makes_weights(cfg.kind, p) and theirs.get(p) != v]
    data = recorded(head, "data") or {}
    if store_id is not None and data.get("store_id") != store_id:
        out.append(f"the token store: {data.get('store')} there (id "
                   f"{str(data.get('store_id'))[:12]}...), id {store_id[:12]}... here")
    return out


# Fields of a kind's config that its pretraining's weights do not depend on (memory,
# cadences of logs, evals and resume states): a change there pretrains the same target.
NOT_WEIGHTS = {"llama_simple_mlp": ("remat", "pretrain.eval_batches", "pretrain.eval_every",
                                    "pretrain.log_every", "pretrain.checkpoint_every")}


def _makes_weights(kind: str, path: str) -> bool:
    """Whether target config field `path` can change the weights pretraining `kind` gives:
    the kind, the seed and the kind's own fields (the toy cache's key), but NOT_WEIGHTS."""
    if path in ("kind", "seed"):
        return True
    head, _, field = path.partition(".")
    return head == kind and field not in NOT_WEIGHTS.get(kind, ())


def already_pretrained(path: str, cfg: TargetConfig, store_id: str | None = None) -> bool:
    """True, said, when `path` holds the target `pretrain` would write for `cfg` (on the
    store `store_id`): pretraining is deterministic, so it would write it again. A target
    pretrained otherwise there is said to be replaced (False)."""
    differ = pretrained_differences(path, cfg, store_id)
    if differ == []:
        on = ", pretrained on this token store" if store_id else ""
        print(f"{path}: already complete: it holds the target of this config{on}; nothing to "
              "do (move it away to pretrain it again)")
        return True
    if differ:
        more = f"; ... {len(differ)} in all" if len(differ) > 4 else ""
        print(f"{path} holds a target pretrained otherwise ({'; '.join(differ[:4])}{more}); "
              "this pretraining replaces it once done (runs started from it will refuse to "
              "resume on the new weights)")
    return False


def check_tokenizer(path: str, tokenizer_id: str | None, store_id: str | None,
                    store: str) -> None:
    """Refuses a token store whose ids mean other tokens than the ones the LM at `path` was
    pretrained on (same vocabulary size or not). Weights from elsewhere (no record of their
    data) are the user's to match. Where `pretrain` made the weights but a side does not
    know its tokenizer (pre-tokenized input) nothing can be checked, which is said, unless
    the store is the one the LM was pretrained on. Reads the file's header only."""
    head = header(path)
    if head is None:
        return  # load() names what is wrong with the file
    data = recorded(head, "data")
    if data is None:
        return
    pretrained = data.get("tokenizer_id")
    if tokenizer_id and pretrained:
        if tokenizer_id != pretrained:
            raise ConfigError(
                f"data.store: {store} was tokenized with another tokenizer ({tokenizer_id}) "
                f"than the target at target.path {path} was pretrained on "
                f"({data.get('tokenizer')}: {pretrained}), so its ids are other tokens to "
                "the target; tokenize the data with that tokenizer (`ppgd-tpu tokenize "
                "--tokenizer ...`)")
        return
    if store_id is not None and store_id == data.get("store_id"):
        return  # the pretraining's own store
    unknown = ([f"data.store {store} (pre-tokenized input)"] if not tokenizer_id else []) + (
        [f"target.path {path} (pretrained on pre-tokenized input)"] if not pretrained else [])
    logging.warning("%s record%s no tokenizer, so nothing checks that the store's ids are "
                    "the tokens the target was trained on", " and ".join(unknown),
                    "s" if len(unknown) == 1 else "")


def _check_recorded_config(cfg: TargetConfig, saved: dict | None, path: str,
                           what: str) -> None:
    """Weights are only the target together with the architecture they were trained in:
    other heads or another rope base read the same tensors as another function."""
    if saved is None:
        return
    kind = saved.get("kind")
    if kind != cfg.kind:
        raise TargetError(f"{what}: {path} holds a {kind!r} target (per its metadata), not "
                          f"target.kind {cfg.kind!r}; set --target.kind={kind} and its config")
    mod, sub = _kind(cfg)
    stored = saved.get(cfg.kind) or {}
    differ = [f"target.{cfg.kind}.{f}: {getattr(sub, f)!r} here, {stored[f]!r} in the file"
              for f in mod.ARCHITECTURE if f in stored and stored[f] != getattr(sub, f)]
    if differ:
        raise TargetError(f"{what}: {path} was made with another architecture than this "
                          "config's (" + "; ".join(differ) + "); the weights compute the "
                          "function of the file's values: use them")


def fingerprint(target: Target, cfg: TargetConfig) -> str:
    """sha256 of the weights the run decomposes (names, shapes, fp32 bytes): [C1] rebuilds
    the target instead of storing it, so a resume checks it rebuilt the same one."""
    mod, _ = _kind(cfg)
    h = hashlib.sha256()
    for name, w in sorted(mod.state_dict(target).items()):
        w = np.ascontiguousarray(np.asarray(w, np.float32))
        h.update(json.dumps([name, list(w.shape)]).encode())
        h.update(w.tobytes())
    return h.hexdigest()


def check(target: Target, cfg: TargetConfig) -> None:
    mod, sub = _kind(cfg)
    problems = mod.check(target, sub)
    if problems:
        raise TargetError(f"target ({cfg.kind}) failed validation, refusing to decompose it: "
                          + "; ".join(problems))


def build(cfg: TargetConfig) -> Target:
    """The frozen, validated target of `cfg`: from target.path, the cache, or pretraining."""
    if cfg.path:
        target = load(cfg, cfg.path)
    elif hasattr(KINDS[cfg.kind], "NEEDS_PATH"):
        raise ConfigError(KINDS[cfg.kind].NEEDS_PATH)
    else:
        return _cached(cfg)  # validated there
    check(target, cfg)
    return target


def _cached(cfg: TargetConfig) -> Target:
    """The toy target of `cfg` from the cache, or trained (and cached when the cache can be
    written). A cached file that does not load or validate is trained again: the cache
    holds a pure function of the config, so nothing is lost."""
    path = cache_path(cfg)
    if os.path.exists(path):
        what = "the toy target cache"
        try:
            target = load(cfg, path, what=what)
        except (TargetError, ConfigError) as e:
            problem = str(e)
        else:
            try:
                check(target, cfg)
                return target
            except TargetError as e:
                problem = f"{what}: {path} holds weights that fail validation ({e})"
        logging.warning("%s; training the target again from its config to replace it (a "
                        "cache entry is a pure function of its config)", problem)
    target = pretrain(cfg)
    check(target, cfg)
    try:
        save(target, cfg, path)
    except OSError as e:
        logging.warning(
            "cannot cache the trained target at %s (%s): the cache root %s (PPGD_TPU_CACHE, "
            "default ~/.cache/ppgd_tpu) must be a directory this user can write. Using the "
            "target uncached; the next run of this config trains it again.", path,
            e.strerror or e, cache.root())
    else:
        logging.info("cached the trained target at %s", path)
    return target


def site_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """The target's sites and weight shapes in canonical order, from shapes alone (no compute)."""
    mod, sub = _kind(cfg)
    shapes: dict[str, tuple[int, ...]] = {}

    def trace():  # dict outputs come back key-sorted, so record the order while tracing
        t = mod.init(sub, jax.random.key(0))
        weights = t.site_weights()
        shapes.update((n, tuple(weights[n].shape)) for n in t.site_names)

    jax.eval_shape(trace)
    return shapes
