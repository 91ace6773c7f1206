"""The experiment schema: frozen dataclasses, YAML loading, dotted overrides, validation.

Every field carries a one-line help and (where it has one) a valid range; `describe()` lists
them for `--helpfull`. Bad input raises ConfigError naming the dotted path, the bad value
and what is valid, before any compute (the CLI turns it into exit status 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import json
import math
import operator
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A refused configuration; the message names the dotted path and what is valid."""


# JAX keys take 32 bits of a seed: a larger or negative one would silently be another's
SEED_MAX = 2 ** 32 - 1


def _f(default=dataclasses.MISSING, help: str = "", lo=None, hi=None, factory=None, gt=None,
       lt=None):
    """A schema field: bounds `lo` <= value <= `hi`, `gt` < value < `lt` (None: unbounded)."""
    meta = {"help": help, "lo": lo, "hi": hi, "gt": gt, "lt": lt}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------- schema


@dataclass(frozen=True)
class Schedule:
    """value(step): optional linear warmup from 0, then constant / linear / cosine decay to
    value*final_frac, reaching it AT step = total-1 [S20]."""

    kind: Literal["constant", "linear", "cosine"] = _f("constant", "shape after warmup")
    value: float = _f(1e-3, "peak value (after warmup)", lo=0.0)
    warmup_steps: int = _f(0, "linear warmup steps from 0", lo=0)
    final_frac: float = _f(0.0, "end value as a fraction of `value` (linear/cosine)", lo=0.0)


@dataclass(frozen=True)
class TMSConfig:
    n_features: int = _f(5, "input/output features", lo=1)
    n_hidden: int = _f(2, "hidden width m (W is [n_features, n_hidden])", lo=1)
    n_identity_layers: int = _f(0, "fixed identity [m, m] layers between the tied matrices", lo=0)
    feature_probability: float = _f(0.05, "P(feature active); active values ~ U[0,1]", lo=0.0, hi=1.0)
    train_steps: int = _f(10000, "target pretraining steps", lo=1)
    train_batch: int = _f(1024, "target pretraining batch", lo=1)
    train_lr: float = _f(5e-3, "target pretraining AdamW lr (constant)", lo=0.0)
    weight_decay: float = _f(0.01, "target pretraining AdamW weight decay", lo=0.0)
    check_tol: float = _f(0.1, "validation: |x_hat_i - 0.75| on the one-hot 0.75 e_i must be "
                          "below this for every feature", lo=0.0)


@dataclass(frozen=True)
class ResidMLPConfig:
    n_features: int = _f(100, "features", lo=1)
    d_embed: int = _f(1000, "residual width", lo=1)
    d_mlp: int = _f(50, "MLP width per layer", lo=1)
    n_layers: int = _f(1, "residual MLP layers", lo=1)
    feature_probability: float = _f(0.01, "P(feature active); active values ~ U[-1,1]", lo=0.0, hi=1.0)
    train_steps: int = _f(1000, "target pretraining steps", lo=1)
    train_batch: int = _f(2048, "target pretraining batch", lo=1)
    train_lr: float = _f(3e-3, "target pretraining AdamW lr (cosine)", lo=0.0)
    weight_decay: float = _f(0.01, "target pretraining AdamW weight decay", lo=0.0)


@dataclass(frozen=True)
class LMPretrainConfig:
    """Pretraining of the LM target on a token store (`ppgd-tpu pretrain --store`)."""

    steps: int = _f(5000, "optimizer steps", lo=1)
    batch_size: int = _f(32, "rows per step (each row: seq_len - 1 predicted tokens)", lo=1)
    lr: float = _f(3e-3, "peak AdamW lr (linear warmup, then cosine to lr * final_lr_frac)", lo=0.0)
    warmup_steps: int = _f(100, "linear lr warmup steps", lo=0)
    final_lr_frac: float = _f(0.1, "end lr as a fraction of lr", lo=0.0, hi=1.0)
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only; norms are not decayed)", lo=0.0)
    grad_clip: float = _f(1.0, "global-norm gradient clip (0 = none)", lo=0.0)
    eval_rows: int = _f(64, "store rows held out (the first ones) for the eval loss", lo=1)
    eval_batches: int = _f(4, "eval batches per eval (of batch_size rows, cycling the held-out rows)", lo=1)
    eval_every: int = _f(500, "eval cadence in steps (and at the end)", lo=1)
    log_every: int = _f(50, "metrics.jsonl cadence in steps", lo=1)
    checkpoint_every: int = _f(500, "resume-state cadence in steps (0 = only on a stop signal)",
                               lo=0)


@dataclass(frozen=True)
class LlamaConfig:
    """LlamaSimpleMLP: tied embedding, pre-RMSNorm, RoPE GQA (causal), c_fc -> GELU -> down_proj."""

    vocab_size: int = _f(384, "token ids [0, vocab_size) (384 = the byte tokenizer)", lo=1)
    d_model: int = _f(128, "residual width", lo=1)
    n_layers: int = _f(2, "transformer blocks", lo=1)
    n_heads: int = _f(4, "query heads (head_dim = d_model / n_heads, even)", lo=1)
    n_kv_heads: int = _f(2, "key/value heads (divides n_heads; grouped-query attention)", lo=1)
    d_mlp: int = _f(512, "MLP hidden width", lo=1)
    max_seq_len: int = _f(512, "longest sequence the target accepts", lo=1)
    rope_base: float = _f(10000.0, "rotary base theta", lo=1.0)
    remat: bool = _f(False, "rematerialize each block in the backward (memory for compute)")
    pretrain: LMPretrainConfig = _f(factory=LMPretrainConfig, help="LM pretraining")

    def __post_init__(self):
        where = "target.llama_simple_mlp"
        if self.n_heads and self.d_model % self.n_heads:
            raise ConfigError(f"{where}.n_heads: {self.n_heads} does not divide d_model "
                              f"{self.d_model}")
        if self.n_heads and (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"{where}.n_heads: head_dim d_model / n_heads = "
                              f"{self.d_model // self.n_heads} must be even (rotary pairs)")
        if self.n_kv_heads and self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{where}.n_kv_heads: {self.n_kv_heads} must divide n_heads "
                              f"{self.n_heads}")


@dataclass(frozen=True)
class TargetConfig:
    kind: Literal["tms", "resid_mlp", "llama_simple_mlp"] = _f("tms", "which frozen target")
    seed: int = _f(0, "target pretraining seed (the target is a pure function of its config)",
                   lo=0, hi=SEED_MAX)
    path: str = _f("", "safetensors weights to load (local or gs://); empty = train from this "
                   "config and cache")
    tms: TMSConfig = _f(factory=TMSConfig, help="TMS target")
    resid_mlp: ResidMLPConfig = _f(factory=ResidMLPConfig, help="ResidMLP target")
    llama_simple_mlp: LlamaConfig = _f(factory=LlamaConfig,
                                       help="LlamaSimpleMLP LM target (loaded from path)")


@dataclass(frozen=True)
class CIFnConfig:
    kind: Literal["per_component_mlp", "per_site_mlp", "global_mlp", "chunkwise_transformer"] = _f(
        "per_component_mlp", "CI function family (SPEC 3)")
    hidden: int = _f(16, "hidden width of the CI MLPs", lo=1)
    detach_inputs: bool = _f(False, "per_component_mlp: stop CI gradients into V (the SPD "
                             "reference lets them through; replay modes need true)")
    d_model: int = _f(128, "chunkwise_transformer: width of each chunk's transformer", lo=2)
    n_blocks: int = _f(2, "chunkwise_transformer: blocks per chunk transformer", lo=1)
    n_heads: int = _f(4, "chunkwise_transformer: attention heads (d_model / n_heads even)", lo=1)
    d_mlp: int = _f(512, "chunkwise_transformer: MLP hidden width", lo=1)
    blocks_per_chunk: int = _f(1, "chunkwise_transformer: consecutive target layers per chunk", lo=1)
    taps: Literal["resid", "site_inputs"] = _f(
        "resid", "chunkwise_transformer input: resid.{L} of the chunk's layers, or each "
        "site's input")
    remat: bool = _f(False, "chunkwise_transformer: rematerialize each block in the backward")


@dataclass(frozen=True)
class DecompConfig:
    sites: dict[str, int] = _f(factory=lambda: {"*": 20},
                               help="site name or glob -> number of components C")
    use_delta: bool = _f(True, "mask the delta W - VU as a (C+1)-th channel")
    tie: dict[str, str] = _f(factory=dict, help="site -> source site whose components it "
                             "shares, transposed: V = U_src^T, U = V_src^T (the reference's "
                             "tied_weights; TMS: {linear2: linear1})")
    ci_fn: CIFnConfig = _f(factory=CIFnConfig, help="CI function")
    steps: int = _f(20000, "optimizer steps", lo=1)
    lr_components: Schedule = _f(factory=lambda: Schedule("cosine", 1e-3), help="V/U lr")
    lr_ci_fn: Schedule = _f(factory=lambda: Schedule("cosine", 1e-3), help="CI fn lr")
    weight_decay: float = _f(0.0, "AdamW weight decay (components and CI fn)", lo=0.0)
    grad_clip_components: float = _f(
        0.01, "global-norm clip of the component gradient, 0 = none [S19]", lo=0.0)
    faithfulness_warmup_steps: int = _f(0, "AdamW steps on faithfulness alone before step 0 [S21]", lo=0)
    faithfulness_warmup_lr: float = _f(1e-3, "lr of the faithfulness warmup", lo=0.0)
    faithfulness_warmup_weight_decay: float = _f(0.0, "AdamW weight decay of the faithfulness "
                                                 "warmup", lo=0.0)
    compute_dtype: Literal["float32", "bfloat16"] = _f("float32", "forward dtype (masters stay fp32)")


@dataclass(frozen=True)
class ImpMinConfig:
    coeff: float = _f(3e-3, "importance-minimality coefficient", lo=0.0)
    kind: Literal["lp", "smooth_l0"] = _f("lp", "psi: (u+eps)^p or u^2/(u^2+gamma^2) [S7]")
    p: Schedule = _f(factory=lambda: Schedule("constant", 1.0), help="L_p exponent schedule")
    gamma: Schedule = _f(factory=lambda: Schedule("constant", 0.1), help="smooth-L0 gamma schedule")
    eps: float = _f(1e-12, "L_p epsilon (> 0: at u = 0 the gradient of u^p is infinite for "
                    "p < 1)", gt=0.0)
    freq_coeff: float = _f(0.0, "frequency-term coefficient (0 = absent) [S8]", lo=0.0)
    reference_token_count: float = _f(0.0, "a in log2(1 + a f) of the frequency term", lo=0.0)


@dataclass(frozen=True)
class StochasticTerm:
    coeff: float = _f(1.0, "term coefficient", lo=0.0)
    plan: Literal["all", "chunked"] = _f("all", "all sites live at once, or sequential chunks [S10]")
    chunk_size: int = _f(1, "sites per chunk for plan=chunked (1 = layerwise)", lo=1)
    routing: Literal["all", "uniform_k"] = _f("all", "route every live site, or uniform_k [S11]")
    n_draws: int = _f(1, "mask draws per plan entry", lo=1)


@dataclass(frozen=True)
class PersistentPGDTerm:
    coeff: float = _f(1.0, "term coefficient (the final ascent divides by it [S14])", gt=0.0)
    scope: Literal["sc", "bsc"] = _f("sc", "sources shared across the batch or one per row "
                                     "(SPEC 5)")
    n_warmup: int = _f(0, "supplemental ascents per step [S24]", lo=0)
    lr: Schedule = _f(factory=lambda: Schedule("constant", 0.01), help="source Adam-ascent lr")
    beta1: float = _f(0.9, "Adam beta1 (bias correction divides by 1 - beta1^t)", lo=0.0,
                      lt=1.0)
    beta2: float = _f(0.999, "Adam beta2 (bias correction divides by 1 - beta2^t)", lo=0.0,
                      lt=1.0)
    eps: float = _f(1e-8, "Adam eps (outside the sqrt; > 0: a zero gradient must give a "
                    "zero step) [S15]", gt=0.0)


@dataclass(frozen=True)
class FreshPGDTerm:
    coeff: float = _f(1.0, "term coefficient", lo=0.0)
    scope: Literal["sc", "bsc"] = _f("sc", "source scope")
    n_steps: int = _f(20, "sign-ascent steps", lo=1)
    step_size: float = _f(0.1, "sign-ascent step", lo=0.0)


@dataclass(frozen=True)
class LossConfig:
    faithfulness_coeff: float = _f(1.0, "faithfulness coefficient [S17]", lo=0.0)
    imp_min: ImpMinConfig = _f(factory=ImpMinConfig, help="importance minimality")
    stochastic: dict[str, StochasticTerm] = _f(
        factory=lambda: {"stochastic": StochasticTerm(),
                         "layerwise": StochasticTerm(plan="chunked", chunk_size=1)},
        help="stochastic recon terms by name")
    persistent_pgd: dict[str, PersistentPGDTerm] = _f(
        factory=dict, help="persistent-PGD recon terms by name")
    fresh_pgd: dict[str, FreshPGDTerm] = _f(factory=dict, help="fresh sign-PGD training terms by name")


@dataclass(frozen=True)
class DataConfig:
    batch_size: int = _f(1024, "global training batch", lo=1)
    train_batch_replay: int = _f(1, "k: steps per data batch (SPEC 7) [W1]", lo=1)
    replay_ci_update: Literal["every", "first", "last", "mean"] = _f(
        "every", "how often the CI fn trains inside a replay window [W2]")
    store: str = _f("", "LM targets: token store (`ppgd-tpu tokenize`; local path or "
                    "gs://bucket/prefix); rows give inputs row[:-1] and labels row[1:]")
    eval_rows: int = _f(0, "LM targets: store rows held out (the first ones) for eval, as "
                        "in LM pretraining; 0 = eval draws from all rows", lo=0)
    eval_seed: int = _f(1, "LM targets: seed of the eval rows' order (the eval batch)", lo=0,
                        hi=SEED_MAX)


@dataclass(frozen=True)
class EvalConfig:
    every: int = _f(1000, "fast-tier eval cadence in global steps (0 = only at the end)", lo=0)
    batch_size: int = _f(4096, "eval batch", lo=1)
    ci_alive_threshold: float = _f(0.1, "CI above this counts as active", lo=0.0, hi=1.0)
    identity_tol: float = _f(0.1, "tolerance of the identity- and dense-CI errors", lo=0.0, hi=1.0)
    pgd_steps: int = _f(20, "fresh sign-PGD probe steps", lo=0)
    pgd_step_size: float = _f(0.1, "fresh sign-PGD probe step size", lo=0.0)
    figures: bool = _f(True, "write the slow-tier PNG figures at the end")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging (ppgd_tpu/wandb_sink.py; needs `pip install -e '.[wandb]'`):
    process 0 logs the config, every metrics.jsonl record, the figures and the summary; a
    resumed run continues the same W&B run; a W&B failure only warns."""

    mode: Literal["disabled", "online", "offline"] = _f(
        "disabled", "disabled: no W&B; online: to the W&B server (`wandb login` first); "
        "offline: files under RUN_DIR/wandb for `wandb sync`")
    project: str = _f("ppgd-tpu", "W&B project")
    entity: str = _f("", "W&B entity, a team or user ('' = your default)")
    name: str = _f("", "W&B run name ('' = the run dir's name)")
    tags: str = _f("", "comma-separated W&B tags, e.g. tms,seed0")


@dataclass(frozen=True)
class LogConfig:
    every: int = _f(100, "metrics.jsonl cadence in global steps", lo=1)
    progress: bool = _f(True, "console progress bar")
    tensorboard: bool = _f(True, "TensorBoard event files in RUN_DIR/tb")
    profile_start: int = _f(-1, "trace the log.profile_steps steps after this global step with "
                            "jax.profiler into RUN_DIR/profile (-1 = off)", lo=-1)
    profile_steps: int = _f(5, "steps in the profile window", lo=1)
    wandb: WandbConfig = _f(factory=WandbConfig, help="Weights & Biases logging")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = _f(0, "checkpoint cadence in global steps (0 = only at the end and on a stop "
                    "signal)", lo=0)
    keep_last_n: int = _f(2, "committed checkpoints kept (older ones deleted after a newer "
                          "one commits)", lo=1)
    keep_every: int = _f(0, "also keep every checkpoint whose step is a multiple of this "
                         "(0 = none)", lo=0)


@dataclass(frozen=True)
class MeshConfig:
    """The device mesh (ppgd_tpu/mesh.py) [D1-D3]: axes `data` (batch rows) and `fsdp` (batch
    rows AND large weights), each the product of an ICI part (devices within one slice, or
    one process on CPU/GPU) and a DCN part (across slices / processes). -1 = the rest."""

    data: int = _f(-1, "ICI data-parallel size within a slice/process (-1 = the rest)", lo=-1)
    fsdp: int = _f(1, "ICI FSDP size within a slice/process (-1 = the rest)", lo=-1)
    dcn_data: int = _f(-1, "DCN data-parallel size across slices/processes (-1 = the rest)",
                       lo=-1)
    dcn_fsdp: int = _f(1, "DCN FSDP size across slices/processes (-1 = the rest)", lo=-1)
    fsdp_min_elements: int = _f(1 << 18, "weights (and their moments) with fewer elements "
                                "stay replicated instead of FSDP-sharded", lo=0)


@dataclass(frozen=True)
class Config:
    name: str = _f("tms_5-2", "experiment name (run dir prefix)")
    seed: int = _f(0, "run seed: every draw is fold_in(seed, global step, ...) [R1]", lo=0,
                   hi=SEED_MAX)
    target: TargetConfig = _f(factory=TargetConfig, help="frozen target")
    decomp: DecompConfig = _f(factory=DecompConfig, help="decomposition")
    loss: LossConfig = _f(factory=LossConfig, help="losses")
    data: DataConfig = _f(factory=DataConfig, help="data")
    eval: EvalConfig = _f(factory=EvalConfig, help="evaluation")
    log: LogConfig = _f(factory=LogConfig, help="logging")
    checkpoint: CheckpointConfig = _f(factory=CheckpointConfig, help="checkpoints")
    mesh: MeshConfig = _f(factory=MeshConfig, help="device mesh")


# Fields that may differ when resuming a run: they do not change the trajectory (another
# mesh changes it only by float reassociation [C3, D3]).
RESUMABLE_PREFIXES = ("name", "eval.", "log.", "checkpoint.", "data.eval_seed", "mesh.")
# What `ppgd-tpu eval` may change in a run's config: how it is evaluated, on which mesh, and
# where the same target weights and a token store are found.
EVAL_FIELDS = ("eval.", "data.eval_seed", "data.store", "target.path", "mesh.")


# ---------------------------------------------------------------- building from dicts


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, path: str):
    """Checks `value` against the annotation `tp`; returns the typed value."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise not_a(path, value, tp)
        return value
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise not_a(path, value, bool)
    if tp is int:
        n = _whole_number(value)
        if n is None:
            raise not_a(path, value, int)
        return n
    if tp is float:
        x = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            x = float(value)
        elif isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
            try:
                x = float(value)
            except ValueError:
                pass
        if x is None or not math.isfinite(x):  # nan / inf would only surface mid-run
            raise not_a(path, value, float)
        return x
    if tp is str:
        if isinstance(value, str):
            return value
        raise not_a(path, value, str)
    raise TypeError(f"unsupported schema type {tp} at {path}")


def _whole_number(value) -> int | None:
    """An int field's value: an int, or a number or numeric string equal to one (`steps: 2e4`;
    YAML reads 2e4 as a string and 2.0e+4 as a float); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    return value if isinstance(value, int) else None


_KINDS = {bool: "a bool; expected true or false", int: "an integer", float: "a finite number",
          str: "a string"}


def not_a(path: str, value, tp) -> ConfigError:
    """The one wording of a value of the wrong type, from YAML or from a flag."""
    if typing.get_origin(tp) is Literal:
        return ConfigError(f"{path}: {value!r} is not valid; expected {_type_name(tp)}")
    return ConfigError(f"{path}: {value!r} is not {_KINDS[tp]}")


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls, data: dict, path: str = ""):
    """Builds dataclass `cls` from a (partial) nested dict; unknown keys are refused."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{sub}: unknown key{hint}; valid keys here: {', '.join(names)}")
        tp = hints[key]
        if _is_dataclass_type(tp) and isinstance(value, dict):
            kwargs[key] = from_dict(tp, value, sub)
        else:
            kwargs[key] = _coerce(value, tp, sub)
    obj = cls(**kwargs)
    _check_ranges(obj, path)
    return obj


_BOUNDS = (("lo", operator.ge, ">="), ("gt", operator.gt, ">"), ("hi", operator.le, "<="),
           ("lt", operator.lt, "<"))


def _check_ranges(obj, path: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            sub = f"{path}.{f.name}" if path else f.name
            for key, ok, word in _BOUNDS:
                bound = f.metadata.get(key)
                if bound is not None and not ok(value, bound):
                    raise ConfigError(f"{sub}: {value!r} is out of range; must be {word} {bound}")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error (YAML keeps the last,
    so `{kind: tms, kind: resid_mlp}` would silently mean resid_mlp)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line error as one line: the problem and where."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(e).split())


def load_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path!r}") from None
    except OSError as e:  # a directory, no permission, ...
        raise ConfigError(f"--config: cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config: {path} is not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML ({yaml_problem(e)})") from None
    if data is None:  # an empty file (or only comments): most likely not what was meant
        raise ConfigError(f"--config: {path} is empty; leave --config out to run the embedded "
                          "default")
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping at the top level")
    return data


# ---------------------------------------------------------------- dotted leaves and overrides


def _walk(cfg, keys: tuple = ()):
    """Yields (keys, annotation, value, help) for every scalar leaf of `cfg`: keys are the
    field names and mapping keys from the root; a key may hold dots (`layers.0.mlp_in`)."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        sub = (*keys, f.name)
        tp, value, help_ = hints[f.name], getattr(cfg, f.name), f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            yield from _walk(value, sub)
        elif typing.get_origin(tp) is dict:
            val_tp = typing.get_args(tp)[1]
            for k, v in value.items():
                if dataclasses.is_dataclass(v):
                    yield from _walk(v, (*sub, k))
                else:
                    yield (*sub, k), val_tp, v, help_
        else:
            yield sub, tp, value, help_


def leaves(cfg):
    """Yields (dotted_path, annotation, value, help) for every scalar leaf of `cfg`."""
    for keys, tp, value, help_ in _walk(cfg):
        yield ".".join(keys), tp, value, help_


def parse_override(text: str, tp, path: str):
    """Parses a command-line string for a leaf of annotation `tp`."""
    if tp is bool or typing.get_origin(tp) is None and tp in (int, float):
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
    else:
        value = text
    return _coerce(value, tp, path)


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Applies {dotted.path: value or string} overrides, typed by the schema."""
    known = {".".join(keys): (keys, tp) for keys, tp, _, _ in _walk(cfg)}
    data = to_dict(cfg)
    for path, text in overrides.items():
        if path not in known:
            close = difflib.get_close_matches(path, list(known), n=3)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ConfigError(f"--{path}: unknown config field{hint} (see --helpfull)")
        (*parents, last), tp = known[path]
        value = parse_override(text, tp, path) if isinstance(text, str) \
            else _coerce(text, tp, path)
        node = data
        for p in parents:
            node = node[p]
        node[last] = value
    return validate(from_dict(Config, data))


def with_entries(cfg: Config, named: dict[str, str | None]) -> Config:
    """Adds the mapping entries that command-line flags {dotted.name: value text} name and
    `cfg` lacks, so they get flags as the YAML's entries do: `decomp.tie.linear2=linear1`
    adds that tie, `loss.stochastic.extra.coeff=...` a term `extra` at its fields' defaults
    (the flag then sets `coeff`). Other names are left for the flag parser to refuse."""
    known = {p for p, _, _, _ in leaves(cfg)}
    data = to_dict(cfg)
    before = to_dict(cfg)  # the entries the config had: a flag's new one may not be their typo
    for name, text in named.items():
        if name in known:
            continue
        for path, val_tp, _ in _mappings(cfg):
            if not name.startswith(path + "."):
                continue
            rest, node, had = name[len(path) + 1:], data, before
            for p in path.split("."):  # a mapping's path is field names: no dots inside
                node, had = node[p], had[p]
            if _is_dataclass_type(val_tp):
                for leaf, _, _, _ in leaves(val_tp()):
                    if rest.endswith("." + leaf):
                        entry = rest[:-len(leaf) - 1]
                        if entry not in node:
                            _check_not_a_typo(f"{path}.{entry}", list(had), leaf)
                        node.setdefault(entry, {})
            else:
                node[rest] = parse_override(text or "", val_tp, name)
    return from_dict(Config, data)


def _check_not_a_typo(new: str, entries: list[str], leaf: str) -> None:
    """A flag that adds an entry (a loss term) one typo away from an existing one most likely
    meant that one: refused (a name that extends one, like `stochastic2`, is not a typo)."""
    path, name = new.rsplit(".", 1)
    for close in difflib.get_close_matches(name, entries, n=1, cutoff=0.8):
        if not (name.startswith(close) or close.startswith(name)):
            raise ConfigError(
                f"--{new}.{leaf}: {path} has no entry {name!r}; did you mean "
                f"--{path}.{close}.{leaf}? (a flag adds a new entry at its fields' defaults, "
                f"but not one this close to {close!r}: to add it, define it in the --config "
                "YAML)")


def _mappings(cfg, path: str = ""):
    """Yields (dotted_path, key -> value annotation, help) for every mapping field of `cfg`."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        sub, tp = f"{path}.{f.name}" if path else f.name, hints[f.name]
        if dataclasses.is_dataclass(getattr(cfg, f.name)):
            yield from _mappings(getattr(cfg, f.name), sub)
        elif typing.get_origin(tp) is dict:
            yield sub, typing.get_args(tp)[1], f.metadata.get("help", "")


def describe(cfg: Config, only: tuple[str, ...] = ("",)) -> str:
    """One line per leaf whose path starts with one of `only`: dotted path, type, default,
    meaning (for --helpfull); then, when every leaf is listed, the mappings, whose entries
    (flags above) come from the YAML, an empty one included."""
    rows = []
    for path, tp, value, help_ in leaves(cfg):
        if path.startswith(only):
            rows.append(f"  --{path}={json.dumps(value)}  [{_type_name(tp)}]  {help_}")
    if only != ("",):
        return "\n".join(rows)
    rows.append("mappings (entries come from the --config YAML, or from a flag naming a new one: "
                "--decomp.tie.linear2=linear1, --loss.stochastic.<new>.coeff=1 with the "
                "term's other fields at their defaults; each entry's fields are then flags):")
    for path, val_tp, help_ in _mappings(cfg):
        if _is_dataclass_type(val_tp):
            fields = ", ".join(f.name for f in dataclasses.fields(val_tp))
            entry = f"{val_tp.__name__} {{{fields}}}"
        else:
            entry = _type_name(val_tp)
        rows.append(f"  {path}: {{<name>: {entry}}}  {help_}")
    return "\n".join(rows)


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()[:16]


def changed_fields(old: Config, new: Config, free: tuple[str, ...] = ()) -> dict[str, tuple]:
    """{path: (old value, new value)} of the leaves that differ (one config lacking a leaf:
    '<absent>'), but those whose path starts with one of `free`; in `new`'s field order."""
    a = {p: v for p, _, v, _ in leaves(old)}
    b = {p: v for p, _, v, _ in leaves(new)}
    return {p: (a.get(p, "<absent>"), b.get(p, "<absent>")) for p in [*b, *(set(a) - set(b))]
            if a.get(p) != b.get(p) and not p.startswith(free)}


def trajectory_diff(old: Config, new: Config, also_resumable: tuple[str, ...] = ()) -> list[str]:
    """Fields that differ and change the trajectory (refused on resume)."""
    return [f"  {p}: {a!r} -> {b!r}" for p, (a, b) in
            sorted(changed_fields(old, new, RESUMABLE_PREFIXES + also_resumable).items())]


# ---------------------------------------------------------------- cross-field validation


# The logged loss parts (train/loss/<part>) that are not recon terms: a recon term may not
# take one of these names.
LOSS_PARTS_BESIDE_RECON = frozenset({"faithfulness", "imp_min", "total"})


def validate(cfg: Config) -> Config:
    """Cross-field rules; single-field ranges are checked in from_dict."""
    names = list(cfg.loss.stochastic) + list(cfg.loss.persistent_pgd) + list(cfg.loss.fresh_pgd)
    for n in names:
        plain = n.replace("_", "").replace("-", "").isalnum()
        if n in LOSS_PARTS_BESIDE_RECON or names.count(n) > 1 or not plain:
            raise ConfigError(
                f"loss.*.{n}: recon term names must be unique identifiers across "
                "loss.stochastic, loss.persistent_pgd and loss.fresh_pgd, and not one of "
                f"{sorted(LOSS_PARTS_BESIDE_RECON)}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.name):
        raise ConfigError(
            f"name: {cfg.name!r} is not a plain name (letters, digits and . _ - , not "
            "starting with . _ -): without --run_dir the run dir is runs/<name>-<timestamp>")
    if not names:
        raise ConfigError("loss: at least one recon term (loss.stochastic / persistent_pgd / "
                          "fresh_pgd) is required")
    if cfg.data.replay_ci_update != "every" and cfg.data.train_batch_replay == 1:
        raise ConfigError(
            f"data.replay_ci_update: {cfg.data.replay_ci_update!r} needs "
            "data.train_batch_replay >= 2 (with k = 1 every step is a full step; use 'every')")
    if (cfg.data.replay_ci_update != "every" and cfg.decomp.ci_fn.kind == "per_component_mlp"
            and not cfg.decomp.ci_fn.detach_inputs):
        raise ConfigError(
            "decomp.ci_fn.detach_inputs: must be true with data.replay_ci_update = "
            f"{cfg.data.replay_ci_update!r}: a replayed envelope is a constant, so the CI path "
            "may not carry gradient into the components [W3]")
    if cfg.decomp.steps % cfg.data.train_batch_replay:
        raise ConfigError(
            f"decomp.steps: {cfg.decomp.steps} must be a multiple of data.train_batch_replay "
            f"({cfg.data.train_batch_replay}) so every replay window is whole [W1]")
    if not cfg.decomp.sites:
        raise ConfigError("decomp.sites: at least one site pattern -> C is required")
    for pat, c in cfg.decomp.sites.items():
        if c < 1:
            raise ConfigError(f"decomp.sites.{pat}: C = {c} must be >= 1")
    for sched_path, sched in _schedules(cfg):
        if sched.warmup_steps >= cfg.decomp.steps and sched.kind != "constant":
            raise ConfigError(
                f"{sched_path}.warmup_steps: {sched.warmup_steps} leaves no decay steps "
                f"(decomp.steps = {cfg.decomp.steps}); it must be below decomp.steps [S20]")
    if cfg.log.profile_start >= cfg.decomp.steps:
        raise ConfigError(
            f"log.profile_start: {cfg.log.profile_start} leaves no step to trace (decomp.steps "
            f"= {cfg.decomp.steps}); use -1 (off) or 0 .. {cfg.decomp.steps - 1}")
    if cfg.log.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"log.wandb.mode: {cfg.log.wandb.mode!r} needs the wandb package: "
                          "pip install -e '.[wandb]' (or use 'disabled')")
    imp = cfg.loss.imp_min
    g = imp.gamma
    if imp.kind == "smooth_l0" and (g.value <= 0 or g.warmup_steps > 0
                                    or (g.kind != "constant" and g.final_frac <= 0)):
        raise ConfigError(
            f"loss.imp_min.gamma: {g} reaches 0, where smooth-L0's u^2 / (u^2 + gamma^2) is "
            "0/0 at u = 0 [S7]; use value > 0, warmup_steps 0, and final_frac > 0 unless "
            "kind is constant")
    if imp.freq_coeff > 0 and imp.reference_token_count <= 0:
        raise ConfigError("loss.imp_min.reference_token_count: must be > 0 when "
                          "loss.imp_min.freq_coeff > 0 (it is the explicit `a` of [S8])")
    return cfg


def _schedules(cfg: Config):
    yield "decomp.lr_components", cfg.decomp.lr_components
    yield "decomp.lr_ci_fn", cfg.decomp.lr_ci_fn
    yield "loss.imp_min.p", cfg.loss.imp_min.p
    yield "loss.imp_min.gamma", cfg.loss.imp_min.gamma
    for n, t in cfg.loss.persistent_pgd.items():
        yield f"loss.persistent_pgd.{n}.lr", t.lr


# The SPD paper's TMS setup: the reference decomposes a tied TMS target with linear2's
# components tied to linear1's (its tied_weights); untied, 5 of 16 seeds recover both
# matrices, tied all 16 (docs/toy-results.md, configs/tms_5-2-untied.yaml).
DEFAULT_TIE = {"linear2": "linear1"}


def default() -> Config:
    """The embedded default, what `ppgd-tpu train` runs without --config: TMS 5-2 with
    linear2 tied to linear1, configs/tms_5-2.yaml field for field. It is the dataclass
    defaults plus DEFAULT_TIE: a YAML file starts from the dataclass defaults, so a file
    that names no `decomp.tie` (any other target's, an untied TMS) ties nothing."""
    return Config(decomp=dataclasses.replace(DecompConfig(), tie=dict(DEFAULT_TIE)))


def read(path: str | None) -> Config:
    """The embedded default (default()), or the YAML file over the dataclass defaults; not
    yet validated: the cross-field rules hold for the config its flags make, which may fix
    what the file alone breaks."""
    return default() if path is None else from_dict(Config, load_yaml(path))


def load(path: str | None, overrides: dict[str, str] | None = None) -> Config:
    """Default config, then YAML file, then dotted overrides; validated."""
    return with_overrides(read(path), overrides or {})


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)

