"""`ppgd-tpu` and `python -m ppgd_tpu`: the signal handlers first, then the CLI.

Installed before `ppgd_tpu.cli` is imported, so a Ctrl-C or SIGTERM during the imports ends
with one line and exit 130 / 143 instead of a traceback (signals.py).
"""

import sys

from ppgd_tpu import signals


def main() -> None:
    try:
        signals.install()  # a signal already pending is handled (raised) right here
        signals.follow_launcher()
        from ppgd_tpu.cli import main as cli_main
    except BaseException:
        if not signals.seen:
            raise
        name = signals.seen[0]
        print(f"ppgd-tpu: {name} while starting; nothing was written", file=sys.stderr)
        sys.exit(143 if name == "SIGTERM" else 130)
    cli_main()


if __name__ == "__main__":
    main()
