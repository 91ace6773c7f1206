"""What many test modules need, written once: a `ppgd-tpu` command run in this process with
its exit status and output."""

from __future__ import annotations

from ppgd_tpu import cli


def run_command(argv: list[str], capsys) -> tuple[int, str, str]:
    """`ppgd-tpu ARGV` in this process (cli.run: the dispatch and the refusals' exit 2, not
    the process setup of cli.main) -> (exit status, stdout, stderr)."""
    rc = cli.run(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err
