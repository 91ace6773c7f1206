"""`ppgd-tpu ckpt ls|digest|verify RUN_DIR`: inspect checkpoints on local disk or gs://.

Exit codes: 0 fine, 1 damage found (`verify` lists it all; `digest` stops at the first),
2 bad usage or path (message on stderr).
"""

from __future__ import annotations

import argparse
import posixpath
import sys

from ppgd_tpu.checkpoint import audit
from ppgd_tpu.checkpoint import manifest as mf
from ppgd_tpu import storage
from ppgd_tpu.workspace import CONFIG


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ppgd-tpu ckpt", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list steps (committed or not) and their size").add_argument("run_dir")
    d = sub.add_parser("digest", help="per-leaf sha256 of the logical arrays + overall digest")
    d.add_argument("run_dir")
    d.add_argument("--step", type=int, default=None, help="default: latest committed step")
    sub.add_parser("verify", help="read every checkpoint back and report damage").add_argument("run_dir")
    return p


def _not_a_run_dir(run_dir: str, given: str) -> str:
    """What to say of a path with no ckpts/: it may be the run's ckpts/ or a step in it."""
    head, name = posixpath.split(run_dir)
    if name == mf.CKPTS:
        return f"{given} is a checkpoint directory: give its run directory, {head}"
    if posixpath.basename(head) == mf.CKPTS and name.isdigit():
        return f"{given} is one step's checkpoint: give its run directory, {posixpath.dirname(head)}"
    if storage.exists(storage.join(run_dir, CONFIG)):
        return f"{given} is a run directory with no checkpoint yet"
    return f"is {given!r} a run directory?"


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage error
        return int(e.code or 0)
    try:
        run_dir = storage.normalize(args.run_dir)
        if not storage.exists(mf.ckpts_dir(run_dir)):
            raise FileNotFoundError(f"{mf.ckpts_dir(run_dir)} does not exist; "
                                    + _not_a_run_dir(run_dir, args.run_dir))
        if not mf.list_steps(run_dir):  # an empty ckpts/, or a file in its place
            raise FileNotFoundError(f"{mf.ckpts_dir(run_dir)} holds no checkpoint (no step "
                                    "directory): nothing to list or check")
        if args.cmd == "ls":
            print(f"{'step':>10}  {'state':<10}  {'bytes':>14}  path")
            for e in audit.ls(run_dir):
                state = "committed" if e.committed else "INCOMPLETE"
                print(f"{e.step:>10}  {state:<10}  {e.bytes:>14}  {e.path}")
            return 0
        if args.cmd == "digest":
            d = audit.digest(run_dir, args.step)
            for name, h in d.leaves.items():
                print(f"{h}  {name}")
            print(f"{d.overall}  step {d.step} overall")
            return 0
        report = audit.verify(run_dir)
        for r in report:
            status = "DAMAGED" if r.damaged else ("ok" if r.committed else "incomplete")
            print(f"step {r.step}: {status}")
            for p in r.problems:
                print(f"  {p}")
        return 1 if any(r.damaged for r in report) else 0
    except mf.DamagedCheckpoint as e:
        print(f"ppgd-tpu ckpt {args.cmd}: {e} (`ppgd-tpu ckpt verify {args.run_dir}` lists "
              "all the damage)", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"ppgd-tpu ckpt {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
