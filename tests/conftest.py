import os
import struct

import ppgd_tpu

ppgd_tpu.configure_cpu()  # before anything imports JAX: the programs `ppgd-tpu` compiles [C3]

import numpy as np
import pytest

from gcs_emulator import GcsEmulator

# The longest module (its multi-process matrices: ~7 of the suite's ~40 CPU minutes):
# xdist's loadfile (without its reorder by test count) hands modules out in collection
# order; last, it ran alone at the end.
FIRST = "test_sharding.py"


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name != FIRST)  # stable: the rest keep their order


# The tiny LM of the LM tests: the config of its pretraining and of a 20-step decomposition.
TINY_YAML = """
name: tiny_lm
seed: 3
target:
  kind: llama_simple_mlp
  llama_simple_mlp:
    d_model: 32
    n_layers: 2
    n_heads: 2
    n_kv_heads: 1
    d_mlp: 64
    max_seq_len: 32
    pretrain: {steps: 30, batch_size: 16, lr: 0.01, warmup_steps: 5, eval_rows: 32,
               eval_batches: 1, eval_every: 30, log_every: 10}
decomp:
  sites: {"h.*.mlp.c_fc": 16, "h.*.mlp.down_proj": 16}
  ci_fn: {kind: chunkwise_transformer, d_model: 16, n_blocks: 1, n_heads: 2, d_mlp: 32}
  steps: 20
  faithfulness_warmup_steps: 50
  lr_components: {kind: cosine, value: 2.0e-3}
  lr_ci_fn: {kind: cosine, value: 2.0e-3}
loss:
  imp_min: {coeff: 1.0e-3, kind: lp, p: {kind: constant, value: 2.0}}
  stochastic:
    stochastic: {coeff: 1.0, plan: all}
  persistent_pgd:
    ppgd: {coeff: 1.0, scope: bsc, n_warmup: 0}
data: {batch_size: 8, eval_rows: 32, eval_seed: 5}
eval: {every: 10, batch_size: 16, pgd_steps: 2}
log: {every: 10, progress: false, tensorboard: false}
"""


def bpe_tokenizer(path: str, docs: list[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json trained on `docs`, with `<|endoftext|>` as its EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A real byte-tokenized store (rows of 17 tokens: 16 inputs + the next token), the tiny
    config and an LM pretrained on it for 30 steps through the CLI (one per test session:
    the LM tests, the LM sharding matrix and the LM bench share it)."""
    from ppgd_tpu import cli

    root = tmp_path_factory.mktemp("lm")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it"]
    rng = np.random.default_rng(0)
    for i in range(4):
        (root / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 1500)) + ".")
    store = str(root / "store")
    assert cli.run(["tokenize", "--input", str(root / "*.txt"), "--output", store,
                    "--seq_len", "17"]) == 0
    config = root / "tiny.yaml"
    config.write_text(TINY_YAML)
    target = str(root / "lm.safetensors")
    assert cli.run(["pretrain", f"--config={config}", "--store", store,
                    "--output", target]) == 0
    return {"store": store, "config": str(config), "target": target, "root": root}


def _session_env(values: dict):
    """Sets environment variables for the session (subprocesses inherit them); a generator
    that restores what was there."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session", autouse=True)
def target_cache(tmp_path_factory):
    """Trained toy targets are cached per test session, never in the user's ~/.cache."""
    path = str(tmp_path_factory.mktemp("target_cache"))
    for _ in _session_env({"PPGD_TPU_CACHE": path}):
        yield path


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """One persistent XLA cache for the session, in this process and every subprocess: the
    many runs of one config (resume at each step, the sharding matrix, the CLI tests) load
    a program compiled once instead of compiling it again; fresh per session, so each
    program is still compiled at least once. JAX's own feature, as users can enable it."""
    import jax

    path = str(tmp_path_factory.mktemp("xla_cache"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    for _ in _session_env({"JAX_COMPILATION_CACHE_DIR": path,
                           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}):
        yield path


@pytest.fixture(scope="session")
def gcs_emulator():
    """A running fake-gcs-server with a bucket; the env points gcsfs and tensorstore at it."""
    emulator = GcsEmulator().start()
    yield emulator
    emulator.stop()


def tensorboard_series(tb_dir) -> dict[tuple[str, int], float]:
    """{(tag, step): value} as TensorBoard shows it: event files in name order, and a
    SessionLog START at step s (a resumed writer's purge) hides every earlier event with a
    step >= s. Records: u64 length, u32 masked crc32c of it, the Event, u32 masked crc32c
    of it (checked: TensorBoard drops a file from a bad record on)."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    seen: dict[tuple[str, int], float] = {}
    for name in sorted(os.listdir(tb_dir)):
        data = (tb_dir / name).read_bytes()
        at = 0
        while at < len(data):
            header, (length,) = data[at:at + 8], struct.unpack("<Q", data[at:at + 8])
            body = data[at + 12:at + 12 + length]
            assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header)
            assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == \
                masked_crc32c(body)
            event = event_pb2.Event.FromString(body)
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == \
                    event_pb2.SessionLog.START:
                seen = {key: v for key, v in seen.items() if key[1] < event.step}
            for value in event.summary.value:
                key = (value.tag, event.step)
                assert key not in seen, f"{key} shown twice"
                seen[key] = value.simple_value
    return seen


def snapshot(root, skip: tuple[str, ...] = ()) -> dict:
    """Every entry below `root` (but the relative paths in `skip` and what is under them):
    a file's bytes, a dir's mode; equal before and after = nothing was touched."""
    out = {}
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if os.path.relpath(os.path.join(here, d), root) not in skip]
        for d in dirs:
            path = os.path.join(here, d)
            out[os.path.relpath(path, root)] = os.stat(path).st_mode
        for f in files:
            with open(os.path.join(here, f), "rb") as fh:
                out[os.path.relpath(os.path.join(here, f), root)] = fh.read()
    return out
