"""Each rank writes DIR/started<rank>, then sleeps a minute; a SIGTERM makes it write
DIR/stopped<rank> and exit 0 (the launcher's SIGTERM handling is what is tested)."""

import os
import signal
import sys
import time
from pathlib import Path

rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1"))
out = Path(sys.argv[1])


def stopped(signum, frame):
    (out / f"stopped{rank}").write_text("1")
    sys.exit(0)


signal.signal(signal.SIGTERM, stopped)
(out / f"started{rank}").write_text("1")
time.sleep(60)
