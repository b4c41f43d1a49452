"""Run one group of the bad-input catalogue and print one JSON result per case.

Usage: ``python worker.py GROUP [DEVICE]``. Each case runs in this process (the whole group
in one subprocess of the test), with a per-case alarm so that a hang is reported as such.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import CASES, SETUP  # noqa: E402

CASE_SECONDS = 60


class CaseTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise CaseTimeout()


def _mentions(text: str, names) -> bool:
    names = (names,) if isinstance(names, str) else names
    return any(n.lower() in text.lower() for n in names)


def run_python(code: str, names, ns: dict) -> dict:
    from needle.errors import NeedleError

    try:
        exec(code, ns)
    except CaseTimeout:
        return {"ok": False, "why": f"no answer in {CASE_SECONDS} s"}
    except BaseException as e:  # noqa: BLE001 - everything is reported, nothing escapes
        message = str(e)
        where = traceback.extract_tb(e.__traceback__)[-1]
        kind = f"{type(e).__module__}.{type(e).__name__}"
        # Python's own operator protocol (an operand type with no method for the operator)
        # is a TypeError naming both operand types: the standard, clear answer
        protocol = type(e) is TypeError and message.startswith("unsupported operand type")
        if not isinstance(e, NeedleError) and not protocol:
            return {"ok": False, "why": f"{kind} (not a NeedleError) at "
                    f"{os.path.basename(where.filename)}:{where.lineno}: {message}"}
        if not protocol and not _mentions(message, names):
            return {"ok": False, "why": f"{kind} does not name {names!r}: {message}"}
        return {"ok": True, "why": f"{type(e).__name__}: {message}"}
    return {"ok": False, "why": "no error was raised"}


def run_cli(code: str, names, ns: dict) -> dict:
    from needle import cli

    argv = eval(code, ns)
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except CaseTimeout:
        return {"ok": False, "why": f"no answer in {CASE_SECONDS} s"}
    except BaseException as e:  # noqa: BLE001
        return {"ok": False, "why": f"raised {type(e).__name__}: {e}"}
    text = err.getvalue()
    if not rc:
        return {"ok": False, "why": f"exit status {rc!r}; stderr: {text[-300:]}"}
    if "Traceback" in text:
        return {"ok": False, "why": f"traceback on stderr: {text[-300:]}"}
    if not _mentions(text, names):
        return {"ok": False, "why": f"stderr does not name {names!r}: {text[-300:]}"}
    return {"ok": True, "why": text.strip().splitlines()[-1] if text.strip() else ""}


def main() -> None:
    group = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "None"
    ns: dict = {}
    exec(SETUP[group].replace("DEVICE", device), ns)
    signal.signal(signal.SIGALRM, _alarm)
    runner = run_cli if group == "cli" else run_python
    for i, (code, names) in enumerate(CASES[group]):
        signal.alarm(CASE_SECONDS)
        result = runner(code, names, ns)
        signal.alarm(0)
        print(json.dumps({"i": i, "code": code, **result}), flush=True)


if __name__ == "__main__":
    main()
