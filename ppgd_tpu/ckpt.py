"""`ppgd-tpu ckpt ls|digest|verify RUN_DIR`: inspect checkpoints on local disk or gs://.

Exit codes: 0 fine, 1 damage found (`verify` lists it all; `digest` stops at the first),
2 bad usage or path (message on stderr).
"""

from __future__ import annotations

import posixpath
import sys

from ppgd_tpu import cmdline, storage
from ppgd_tpu.checkpoint import audit
from ppgd_tpu.checkpoint import manifest as mf
from ppgd_tpu.workspace import CONFIG

TOOLS = {"ls": "list steps (committed or not) and their size",
         "digest": "per-leaf sha256 of the logical arrays + overall digest",
         "verify": "read every checkpoint back and report damage"}
USAGE = "usage: ppgd-tpu ckpt ls|digest|verify RUN_DIR\n\n" + "\n".join(
    f"  {name:<7} {what}" for name, what in TOOLS.items())


def _parse(argv: list[str]) -> tuple[str, str, int | None]:
    """-> (tool, run dir, --step); a bad command line raises cmdline.UsageError."""
    if not argv or argv[0] not in TOOLS:
        _, positional = cmdline.parse_flags(argv, {}, USAGE)  # --helpfull: the usage
        raise cmdline.UsageError(f"{positional[0]!r}: not a tool; one of {', '.join(TOOLS)}"
                                 if positional else f"which tool? one of {', '.join(TOOLS)} "
                                 "(e.g. ppgd-tpu ckpt ls RUN_DIR)")
    tool = argv[0]
    own = {"step": ("", "a committed step (default: the latest)",
                    cmdline.optional(cmdline.integer(0)))} if tool == "digest" else {}
    values, positional = cmdline.parse_flags(
        argv[1:], own, f"usage: ppgd-tpu ckpt {tool} RUN_DIR{' [--step N]' * bool(own)}: "
        f"{TOOLS[tool]}")
    if len(positional) != 1:
        raise cmdline.UsageError(f"RUN_DIR: one run directory, got {' '.join(positional)!r}"
                                 if positional else
                                 f"RUN_DIR: which run? e.g. ppgd-tpu ckpt {tool} runs/tms52")
    return tool, positional[0], values.get("step")


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
    tool, given, step = _parse(argv)
    try:
        run_dir = storage.normalize(given)
        if not storage.exists(mf.ckpts_dir(run_dir)):
            raise FileNotFoundError(f"{mf.ckpts_dir(run_dir)} does not exist; "
                                    + _not_a_run_dir(run_dir, given))
        if not mf.list_steps(run_dir):  # an empty ckpts/, or a file in its place
            raise FileNotFoundError(f"{mf.ckpts_dir(run_dir)} holds no checkpoint (no step "
                                    "directory): nothing to list or check")
        if tool == "ls":
            print(f"{'step':>10}  {'state':<10}  {'bytes':>14}  path")
            for e in audit.ls(run_dir):
                state = "committed" if e.committed else "INCOMPLETE"
                print(f"{e.step:>10}  {state:<10}  {e.bytes:>14}  {e.path}")
            return 0
        if tool == "digest":
            d = audit.digest(run_dir, step)
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
        print(f"ppgd-tpu ckpt {tool}: {e} (`ppgd-tpu ckpt verify {given}` lists "
              "all the damage)", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"ppgd-tpu ckpt {tool}: {e}", file=sys.stderr)
        return 2
