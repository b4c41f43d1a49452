# ruff: noqa: N802 -- method names are the Objective-C selectors PyObjC exposes
"""What the fake Metal module takes from the system: the emulated macOS release
(``NEEDLE_METAL_EMULATOR_MACOS``, default 15.0; Foundation's ``NSProcessInfo``, which PyObjC's
Metal module re-exports) and ``MTLCompileOptions``, whose API depends on it: MSL 3.1 compiles
from macOS 14, ``setMathMode:`` exists from macOS 15.
"""

from __future__ import annotations

import os

MTLLanguageVersion2_4 = (2 << 16) + 4
MTLLanguageVersion3_0 = 3 << 16
MTLLanguageVersion3_1 = (3 << 16) + 1
MTLMathModeSafe = 0
MTLMathModeRelaxed = 1
MTLMathModeFast = 2


def macos_version() -> tuple[int, int, int]:
    """The macOS release the emulator pretends to be (``NEEDLE_METAL_EMULATOR_MACOS``)."""
    text = os.environ.get("NEEDLE_METAL_EMULATOR_MACOS", "15.0")
    parts = [int(p) for p in text.split(".")] + [0, 0]
    return parts[0], parts[1], parts[2]


class _OSVersion:
    def __init__(self, major: int, minor: int, patch: int):
        self.majorVersion, self.minorVersion, self.patchVersion = major, minor, patch


class NSProcessInfo:
    """Foundation's, which PyObjC's Metal module re-exports."""

    @classmethod
    def processInfo(cls):
        return cls()

    def operatingSystemVersion(self) -> _OSVersion:
        return _OSVersion(*macos_version())


class _ObjC:
    """``Cls.alloc().init()`` and ``Cls.new()``, as PyObjC spells construction."""

    @classmethod
    def alloc(cls):
        return cls.__new__(cls)

    @classmethod
    def new(cls):
        return cls.alloc().init()

    def init(self):
        return self


class MTLCompileOptions(_ObjC):
    def init(self):
        self._fast_math = True  # Metal's default
        self._math_mode: int | None = None
        self._language_version: int | None = None
        return self

    def respondsToSelector_(self, selector: str) -> bool:
        if selector in ("setMathMode:", "mathMode"):
            return macos_version() >= (15, 0, 0)
        return hasattr(self, selector.replace(":", "_"))

    def fastMathEnabled(self) -> bool:
        return self._fast_math

    def setFastMathEnabled_(self, on: bool) -> None:
        self._fast_math = bool(on)

    def mathMode(self) -> int:
        self._need_math_mode()
        return self._math_mode if self._math_mode is not None else MTLMathModeFast

    def setMathMode_(self, mode: int) -> None:
        self._need_math_mode()
        self._math_mode = int(mode)

    def _need_math_mode(self) -> None:
        if macos_version() < (15, 0, 0):
            raise AttributeError("'MTLCompileOptions' object has no attribute 'setMathMode_' "
                                 "(mathMode needs macOS 15)")

    def languageVersion(self) -> int:
        return self._language_version or MTLLanguageVersion3_1

    def setLanguageVersion_(self, version) -> None:
        self._language_version = int(version)

    def effective_fast_math(self) -> bool:
        """mathMode wins over fastMathEnabled when both were set, as in Metal."""
        if self._math_mode is not None:
            return self._math_mode != MTLMathModeSafe
        return self._fast_math

    def msl(self) -> int:
        """__METAL_VERSION__ of the chosen language version (the OS default when unset)."""
        version = self._language_version
        if version is None:
            version = MTLLanguageVersion3_1 if macos_version() >= (14, 0, 0) \
                else MTLLanguageVersion3_0
        return 100 * (version >> 16) + 10 * (version & 0xFFFF)
