"""Metal without Apple hardware (design §6): run needle's Metal backend on Linux.

* ``include/metal_stdlib``: the Metal Shading Language standard library subset needle's
  kernels use, as C++ for clang++ 17 or later (with ``include/emulator_runtime.h``, which runs
  threads).
* ``harness``: turns an MSL source into a CPU shared library whose kernels run dispatches,
  threads of a threadgroup as cooperatively scheduled fibers where they synchronise.
* ``fake_metal``: the subset of PyObjC's ``Metal`` module the backend calls, on the harness.
* ``fake_objc``: PyObjC's ``objc.autorelease_pool``, counting open pools.

``install()`` puts ``fake_metal`` in ``sys.modules["Metal"]``, after which
``needle.metal().enabled()`` is true and the backend's own code runs unmodified. The harness
is test support, not product: what it does not prove is listed in docs/metal.md.
"""

from __future__ import annotations

import shutil
import sys

from . import fake_metal, fake_objc, harness


def install() -> None:
    """Make ``import Metal`` (and ``import objc``) give the emulator. Call before anything
    asks ``metal()``."""
    if shutil.which(harness.compiler()) is None:
        raise RuntimeError(f"the Metal emulator needs clang 17 or later ({harness.compiler()}, "
                           "e.g. apt-get install clang-19); set NEEDLE_METAL_EMULATOR_CXX to use "
                           "another")
    sys.modules["Metal"] = fake_metal
    sys.modules["objc"] = fake_objc
