"""One rank of an mpiexec job started by ``needle run``: run the script as ``__main__``
and, if it fails, say which rank failed and end the whole job (MPI_Abort), so that no
other rank waits for it."""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def _rank() -> str:
    return os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "?"))


def _run(argv: list[str]) -> None:
    """Run ``script args`` or ``-m module args`` as the __main__ module."""
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    code = 0
    try:
        _run(sys.argv[1:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- any failure of the script ends this rank
        traceback.print_exc()
        code = 1
    if code:
        print(f"needle run: rank {_rank()} exited with status {code}; stopping the other "
              "ranks", file=sys.stderr, flush=True)
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
