"""Child program for the launcher tests: echoes its argv and the launcher's PPGD_* variables as JSON,
then behaves as told by DIST_ECHO_MODE (run as `python -m tests.dist_echo` or by path)."""

import json
import os
import sys
import time
from pathlib import Path

LAUNCHER_VARS = ("PPGD_COORDINATOR_ADDRESS", "PPGD_NUM_PROCESSES", "PPGD_PROCESS_ID",
                 "PPGD_LOCAL_DEVICE_COUNT")
env = {k: v for k, v in os.environ.items() if k in LAUNCHER_VARS}
print("ECHO " + json.dumps({"argv": sys.argv[1:], "env": env}), flush=True)
me = int(os.environ["PPGD_PROCESS_ID"])
print(f"[p{me}/{os.environ['PPGD_NUM_PROCESSES']}] a line tagged as dist.tag() does", flush=True)
mode = os.environ.get("DIST_ECHO_MODE", "exit")
if mode in ("fail", "fail_told"):
    # p1 fails once p0 is up; p0 waits to be killed ("fail"), or ("fail_told") ends on its
    # own half a second after p1's failure, as a ppgd-tpu child told of it does
    here = Path(os.environ["DIST_ECHO_DIR"])
    if me == 0:
        (here / "p0.pid.tmp").write_text(str(os.getpid()))
        os.replace(here / "p0.pid.tmp", here / "p0.pid")  # p1 never reads a partial file
        while mode == "fail" or not (here / "p1.failed").exists():
            time.sleep(0.01)
        time.sleep(0.5)
        print("told of p1's failure, ending", flush=True)
        sys.exit(3)
    while not (here / "p0.pid").exists():
        time.sleep(0.01)
    (here / "p1.failed").touch()
    print("failing now", flush=True)
    sys.exit(3)
