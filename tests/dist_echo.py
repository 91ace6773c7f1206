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
if mode == "fail":  # p0 records its pid and waits to be killed; p1 fails once p0 is up
    pid_file = Path(os.environ["DIST_ECHO_DIR"]) / "p0.pid"
    if me == 0:
        pid_file.write_text(str(os.getpid()))
        while True:
            time.sleep(1)
    while not pid_file.exists():
        time.sleep(0.01)
    print("failing now", flush=True)
    sys.exit(3)
