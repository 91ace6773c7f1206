"""`ppgd-tpu pretrain` for the LM target: next-token training on a token store.

The LM is a pure function of (target config, token store): init from `target.seed`, AdamW
with linear warmup + cosine decay, global-norm clipping, next-token cross-entropy on rows
of the store in the order of the batch schedule (batch j a pure function of (seed, j)).
The first `eval_rows` rows are held out; the eval loss on them is logged at step 0, every
`eval_every` steps and at the end. Progress goes to the console and `<output stem>
.metrics.jsonl`; the weights go to a safetensors file (tensor names = state-dict names,
target config in the metadata) that `build.load` reads back as `target.path`.
The log and the weights go together: the log is written as `<log>.partial` while training
and moved to its name only once the weights are saved, so a run that dies (killed,
diverged, refused) leaves the previous run's weights AND log in place, and its own progress
in the .partial file.
Resume: every `checkpoint_every` steps, and on SIGINT/SIGTERM, the weights, the optimizer
state and the log so far go to `<output stem>.resume.safetensors` (one atomic write). The
same command again continues from there, exactly (batch j is a pure function of (seed, j));
it refuses a state of another config (but the cadences) or another store. The finished run
deletes it.
Single-process: every process of a multi-host launch would train the same model.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from safetensors import numpy as safetensors_numpy

from ppgd_tpu import metrics as metrics_lib
from ppgd_tpu import signals, storage
from ppgd_tpu.config import ConfigError, TargetConfig, leaves
from ppgd_tpu.data.schedule import train_eval_schedules
from ppgd_tpu.data.tokens import DamagedStoreError, IncompleteStoreError, TokenStore
from ppgd_tpu.targets import build
from ppgd_tpu.targets import llama_simple_mlp as lm
from ppgd_tpu.targets.base import frozen


def next_token_loss(target: lm.LlamaSimpleMLP, rows):
    """Mean cross-entropy of predicting rows[:, 1:] from rows[:, :-1], fp32."""
    logits = target.forward(rows[:, :-1], frozen).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]))


def metrics_path(output: str) -> str:
    return os.path.splitext(output)[0] + ".metrics.jsonl"


def partial_metrics_path(output: str) -> str:
    """Where the log of a run in progress is written (local outputs: next to the output)."""
    return metrics_path(output) + ".partial"


def resume_path(output: str) -> str:
    """Where an interrupted pretraining keeps its state (next to the output)."""
    return os.path.splitext(output)[0] + ".resume.safetensors"


def lock_path(output: str) -> str:
    """Held while a pretraining writes `output` and the files beside it (lockfile)."""
    return os.path.splitext(output)[0] + ".lock"


CADENCES = ("log_every", "eval_every", "checkpoint_every")  # a resume may change these


def _trajectory(cfg: TargetConfig) -> dict:
    """The flat config a resume must match: every field but the cadences and target.path
    (weights to decompose; pretrain writes to --output). Scalars: they JSON round-trip."""
    skip = {"path", *(f"llama_simple_mlp.pretrain.{c}" for c in CADENCES)}
    return {f"target.{p}": v for p, _, v, _ in leaves(cfg) if p not in skip}


def _save_state(path: str, done: int, target, opt_state, log_text: str, cfg: TargetConfig,
                store_id: str | None) -> None:
    tensors = {k: np.asarray(v) for k, v in _state_tensors(target, opt_state).items()}
    state = {"step": done, "config": _trajectory(cfg), "store_id": store_id, "log": log_text}
    storage.write_bytes(path, safetensors_numpy.save(
        tensors, metadata={"resume": json.dumps(state)}))


def _state_tensors(target, opt_state) -> dict:
    """The resume state's tensors: the target's state dict and the optimizer's leaves."""
    tensors = {f"target/{k}": v for k, v in lm.state_dict(target).items()}
    tensors.update({f"opt/{i}": v for i, v in enumerate(jax.tree.leaves(opt_state))})
    return tensors


def _load_state(path: str, cfg: TargetConfig, store: TokenStore, store_path: str, target,
                opt_state):
    """(step, target, optimizer state, log text) of the state an interrupted run left;
    `target` and `opt_state` (fresh ones) give the tensors it must hold."""
    def damaged(why):
        return ConfigError(f"--output: {path} (the resume state of an interrupted pretrain) "
                           f"is damaged ({why}); delete it to start over")

    blob = storage.read_bytes(path)
    state = build.recorded(blob, "resume")
    try:
        tensors = safetensors_numpy.load(blob)
    except Exception:  # safetensors raises several types for a damaged file
        raise damaged("not a readable safetensors file") from None
    if state is None or not {"step", "config", "store_id", "log"} <= set(state):
        raise damaged("no resume record")
    here = _trajectory(cfg)
    differ = [f"{k}: {state['config'].get(k)!r} there, {here.get(k)!r} here"
              for k in sorted(set(here) | set(state["config"]))
              if state["config"].get(k) != here.get(k)]
    if differ:
        raise ConfigError(
            f"--output: {path} holds an interrupted pretraining of another config ("
            + "; ".join(differ) + "); re-run that config to finish it, or delete the file "
            "to start this one")
    if state["store_id"] != store.store_id:
        raise ConfigError(
            f"--store: {store_path} is not the store the interrupted pretraining in {path} "
            "trained on (its rows differ); pass that store, or delete the file to "
            "start over")
    want = {k: tuple(v.shape) for k, v in _state_tensors(target, opt_state).items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:  # the config matches: a file edited, or not what was saved
        bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        raise damaged(f"{len(bad)} tensors missing, extra or mis-shaped, e.g. {bad[0]!r}: "
                      f"{got.get(bad[0])} there, {want.get(bad[0])} here")
    target = lm.from_state_dict(cfg.llama_simple_mlp, {
        k[len("target/"):]: v for k, v in tensors.items() if k.startswith("target/")})
    leaves, treedef = jax.tree.flatten(opt_state)
    opt_state = jax.tree.unflatten(treedef, [jnp.asarray(tensors[f"opt/{i}"])
                                             for i in range(len(leaves))])
    return state["step"], target, opt_state, state["log"]


def _optimizer(cfg: TargetConfig) -> optax.GradientTransformation:
    pc = cfg.llama_simple_mlp.pretrain
    lr = optax.warmup_cosine_decay_schedule(0.0, pc.lr, pc.warmup_steps, pc.steps,
                                            end_value=pc.lr * pc.final_lr_frac)
    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # not the norm gains
    opt = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=pc.weight_decay, mask=decay)
    return optax.chain(optax.clip_by_global_norm(pc.grad_clip), opt) if pc.grad_clip > 0 else opt


def pretrain_lm(cfg: TargetConfig, store_path: str, output: str, *,
                progress: bool = True) -> dict | None:
    """Trains the LM of `cfg` on the store at `store_path`, saves it to `output`; returns
    the final {"train/loss", "eval/loss", ...}, or None when `output` already holds it."""
    if cfg.kind != "llama_simple_mlp":
        raise ConfigError(f"target.kind: {cfg.kind!r} is not an LM; lm_pretrain trains "
                          "'llama_simple_mlp' (toy targets pretrain without a store)")
    lcfg, pc = cfg.llama_simple_mlp, cfg.llama_simple_mlp.pretrain
    if pc.warmup_steps >= pc.steps:
        raise ConfigError(f"target.llama_simple_mlp.pretrain.warmup_steps: {pc.warmup_steps} "
                          f"must be < steps ({pc.steps})")
    try:
        store = TokenStore.open(store_path)
    except IncompleteStoreError as e:
        raise ConfigError(f"--store: {e}") from None
    lm.check_tokens(lcfg, store.vocab_size, store.seq_len - 1, f"the token store at {store_path}")
    if pc.batch_size > store.n_rows:
        raise ConfigError(f"target.llama_simple_mlp.pretrain.batch_size: {pc.batch_size} rows "
                          f"exceed the store's {store.n_rows} rows; lower it, or tokenize "
                          "more text")
    if not pc.eval_rows < store.n_rows - pc.batch_size + 1:
        raise ConfigError(
            f"target.llama_simple_mlp.pretrain.eval_rows: {pc.eval_rows} held-out rows leave "
            f"fewer than one batch ({pc.batch_size}) of the store's {store.n_rows} rows")
    if not storage.exists(resume_path(output)) and build.already_pretrained(
            output, cfg, store.store_id):
        return None
    train, held_out = train_eval_schedules(
        store.n_rows, train_batch=pc.batch_size, train_seed=cfg.seed,
        eval_batch=min(pc.batch_size, pc.eval_rows), eval_seed=cfg.seed + 1,
        eval_rows=pc.eval_rows)

    def read(rows):
        try:
            return jnp.asarray(store.read_rows(rows), jnp.int32)
        except DamagedStoreError as e:  # damage the size check at open could not see
            raise ConfigError(f"--store: {e}") from None

    eval_rows = [read(held_out.rows(j)) for j in range(pc.eval_batches)]

    target = lm.init(lcfg, jax.random.key(cfg.seed))
    opt = _optimizer(cfg)
    opt_state = opt.init(target)
    state_path, start, log_text = resume_path(output), 0, ""
    if storage.exists(state_path):
        start, target, opt_state, log_text = _load_state(state_path, cfg, store, store_path,
                                                         target, opt_state)
        print(f"resuming the pretraining at step {start} from {state_path}")

    @eqx.filter_jit
    def step(target, opt_state, rows):
        loss, grads = eqx.filter_value_and_grad(next_token_loss)(target, rows)
        updates, opt_state = opt.update(grads, opt_state, target)
        return eqx.apply_updates(target, updates), opt_state, loss, optax.tree.norm(grads)

    eval_loss = eqx.filter_jit(next_token_loss)
    all_finite = eqx.filter_jit(lambda t: jnp.all(jnp.stack(
        [jnp.isfinite(x).all() for x in jax.tree.leaves(eqx.filter(t, eqx.is_array))])))

    def evaluate(target):
        return float(np.mean([eval_loss(target, rows) for rows in eval_rows]))

    remote = storage.is_gcs(output)
    if remote:  # the log is kept locally and uploaded whole once the weights are
        fd, partial = tempfile.mkstemp(suffix=".metrics.jsonl.partial")
        os.close(fd)
    else:
        partial = partial_metrics_path(output)
        os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
    bar = metrics_lib.Progress(pc.steps, start, progress)
    summary: dict = {}
    lines = [log_text] if log_text else []
    try:
        with open(partial, "w") as log:
            def write(values):
                lines.append(metrics_lib.json_line(values))
                log.write(lines[-1])
                log.flush()

            diverged = (f"the pretraining diverged. It is deterministic, so re-running "
                        f"would repeat it: delete {state_path} if it exists (the last "
                        "checkpoint of this config), and lower target.llama_simple_mlp."
                        "pretrain.lr or set its grad_clip > 0")

            def check(values):
                metrics_lib.check_finite(values["step"], values, ("train/loss", "eval/loss"),
                                         diverged)

            def save(done):
                """The state after step `done` with the log up to it: lines of a later step
                (a stop's raise after its lines, before its state) are left out."""
                if not all_finite(target):  # a finite loss came before this step's update
                    raise metrics_lib.Diverged(f"step {done}: the weights have non-finite "
                                               f"values; {diverged}")
                kept = "".join(ln for text in lines for ln in text.splitlines(keepends=True)
                               if json.loads(ln)["step"] <= done)
                _save_state(state_path, done, target, opt_state, kept, cfg, store.store_id)

            log.write(log_text)
            if start == 0:
                write({"step": 0, "eval/loss": evaluate(target)})
            done = start
            try:
                for s in range(start, pc.steps):
                    signals.raise_if_seen()
                    rows = read(train.rows(s))
                    new_target, new_opt_state, loss, gnorm = step(target, opt_state, rows)
                    # Step n's lines are written before its state is kept: a stop's raise
                    # lands before the state moves on (save leaves them out) or after.
                    n, logged = s + 1, None
                    if n % pc.log_every == 0 or n == pc.steps:
                        summary = {"step": n, "train/loss": float(loss),
                                   "train/grad_norm": float(gnorm),
                                   "train/epoch": train.epoch(s)}
                        write(summary)
                        check(summary)
                        logged = summary["train/loss"]
                        logging.info("pretrain step %d: loss %.4f", n, logged)
                    if n % pc.eval_every == 0 or n == pc.steps:
                        ev = {"step": n, "eval/loss": evaluate(new_target)}
                        write(ev)
                        check(ev)
                        summary.update(ev)
                        logging.info("pretrain step %d: eval loss %.4f", n, ev["eval/loss"])
                    target, opt_state, done = new_target, new_opt_state, n  # one store
                    bar.update(1, logged)  # each step: a stop leaves the bar where it is
                    if pc.checkpoint_every and done % pc.checkpoint_every == 0 \
                            and done != pc.steps:
                        save(done)
            except (KeyboardInterrupt, signals.Terminated):
                if done > start:  # (else the state there, if any, is already this one)
                    save(done)  # the last completed step's
                    print(f"pretraining stopped at step {done}; {state_path} holds it: the "
                          "same command resumes it", file=sys.stderr)
                raise
        bar.close()
        build.check(target, cfg)
        build.save(target, cfg, output, data={
            "store": store_path, "store_id": store.store_id,
            "tokenizer": store.meta.get("tokenizer"), "tokenizer_id": store.tokenizer_id})
        # The weights are in place: now their log replaces the previous run's.
        if remote:
            with open(partial, "rb") as f:
                storage.write_bytes(metrics_path(output), f.read())
        else:
            os.replace(partial, metrics_path(output))
        storage.remove(state_path)
    finally:
        if remote and os.path.exists(partial):
            os.remove(partial)
    return summary
