"""Runs inside a subprocess with 4 forced CPU devices (tests/test_sharding.py); prints
`RESULT {json}` with what the test asserts: placed init == eager init [R1], the sharded
batch == the unsharded draw, imp-min on 4 devices == its global value [D2], and the `sc`
source gradient == the average of per-shard gradients [D1]."""

import json
import sys

import ppgd_tpu

ppgd_tpu.configure_cpu()  # before JAX is imported: the programs a `ppgd-tpu` command compiles

import jax
import numpy as np

from helpers import max_rel

from ppgd_tpu import axes
from ppgd_tpu import config as config_lib
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu.config import ImpMinConfig
from ppgd_tpu.data.toy import batch_key
from ppgd_tpu.decomp import losses
from ppgd_tpu.engine import Trainer
from ppgd_tpu.resume import state_leaves
from ppgd_tpu.step import Envelope


def n_shards(x) -> int:
    return len({str(s.index) for s in x.addressable_shards})


def main(config_path: str) -> None:
    assert jax.device_count() == 4, jax.devices()
    cfg = config_lib.load(config_path, {"decomp.faithfulness_warmup_steps": "0"})
    tr = Trainer(cfg)
    out = {"mesh": dict(tr.mesh.shape)}
    host_target = tr.to_host(tr.target)

    # [R1] placed init == the one-device jitted init bit for bit, and == the eager
    # (op-by-op) init up to XLA's folding of x / c into x * (1 / c)
    placed = {n: tr.to_host(x) for n, x in state_leaves(tr.init_state()).items()}
    single = state_leaves(jax.jit(tr.dec.init)(jax.device_put(host_target, jax.devices()[0])))
    eager = state_leaves(tr.dec.init(host_target))
    out["init_equal_jit"] = all(np.array_equal(placed[n], np.asarray(single[n])) for n in single)
    out["init_eager_rel"] = max(max_rel(eager[n], placed[n]) for n in eager)
    out["init_shards"] = {n: n_shards(x) for n, x in state_leaves(tr.init_state()).items()
                          if "adversaries" in n}

    # the batch drawn sharded by rows == the whole batch drawn on one device
    b = tr.batch(3)
    whole = host_target.sample(batch_key(cfg.seed, 3), cfg.data.batch_size)
    out["batch_equal"] = bool(np.array_equal(tr.to_host(b), np.asarray(whole)))
    out["batch_shards"] = n_shards(b)

    # the token-store path: a global batch from per-shard row reads (only the rows each
    # device holds are fetched, once per distinct row range)
    reads = []
    rows_np = np.arange(32 * 5, dtype=np.int32).reshape(32, 5)

    def fetch(start, stop):
        reads.append([start, stop])
        return rows_np[start:stop]

    gb = mesh_lib.global_batch(fetch, (32, 5), tr.placement.sharding("batch", (32, 5),
                                                                      tr.target.input_axes))
    out["global_batch_equal"] = bool(np.array_equal(tr.to_host(gb), rows_np))
    out["global_batch_reads"] = sorted(reads)

    # [D2] imp-min with the frequency term: exact global sums inside the log2
    imp = ImpMinConfig(coeff=1.0, freq_coeff=1.0, reference_token_count=50.0)
    rng = np.random.default_rng(0)
    u = {"a": (rng.uniform(0, 1.2, (32, 6)) * (rng.uniform(size=(32, 6)) < 0.3)).astype(
        np.float32)}
    f = lambda up: losses.imp_min(up, imp, 1.0, 0.1)[0]
    rows = tr.placement.sharding("training/replay/envelope/upper/a", (32, 6),
                                 axes.of(Envelope(u, u)).upper["a"])  # an envelope's rows
    u_placed = jax.device_put(u, {"a": rows})
    sharded = jax.jit(jax.value_and_grad(f), out_shardings=(tr.placement.replicated, {"a": rows}))
    val, grad = sharded(u_placed)
    u64 = u["a"].astype(np.float64)
    fr = np.mean(u64 + 1e-12, axis=0)
    want = np.sum(fr) + np.sum(fr * np.log2(1 + 50.0 * fr))
    per_shard = np.mean([float(f({"a": q})) for q in np.split(u["a"], 4)])
    out["imp_rel"] = abs(float(val) - want) / want
    out["imp_per_shard_mean_rel"] = abs(per_shard - want) / want  # Jensen: must differ
    out["imp_grad_rel"] = max_rel(jax.grad(f)(u)["a"], tr.to_host(grad)["a"])
    out["imp_grad_shards"] = n_shards(grad["a"])

    # [D1] shared-source gradient: global mean == average (not sum) of per-shard gradients
    state = tr.init_state()
    lower = tr.replay.compute_ci(tr.target, state, b).lower

    def recon(src, target, batch, comps, low):
        clean = target.clean_output(batch)
        return tr.dec.recon(target, batch, comps, tr.dec.ppgd_masks(low, src), clean)

    name = next(n for n, t in cfg.loss.persistent_pgd.items() if t.scope == "sc")
    # near 1 the masked TMS output is alive (fresh U[0,1] sources can leave every ReLU dead)
    src = jax.tree.map(lambda x: 1.0 - 0.2 * x, state.adversaries[name].sources)
    g = tr.to_host(jax.jit(jax.grad(recon), out_shardings=tr.placement.replicated)(
        src, tr.target, b, state.components, lower))
    h_src, h_comps, h_b, h_low = tr.to_host((src, state.components, b, lower))
    shard_g = [jax.grad(recon)(h_src, host_target, np.split(h_b, 4)[i],
                                h_comps, {s: np.split(v, 4)[i] for s, v in h_low.items()})
               for i in range(4)]
    avg = jax.tree.map(lambda *x: np.mean(x, axis=0), *shard_g)
    tot = jax.tree.map(lambda *x: np.sum(x, axis=0), *shard_g)
    out["src_grad_max_abs"] = max(float(np.max(np.abs(v))) for v in g.values())
    out["src_grad_vs_avg_rel"] = max(max_rel(avg[s], g[s]) for s in g)
    out["src_grad_vs_sum_rel"] = min(max_rel(tot[s], g[s]) for s in g)
    out["src_grad_shards"] = n_shards(src[next(iter(src))])
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
