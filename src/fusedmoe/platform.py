"""The machine the oracle selects for: device kind, compute capability, importable packages.

`Platform.current()` reads the real machine; tests build fakes such as
`Platform("cuda", (9, 0), packages=("flashinfer",))` to walk every rule on a CPU.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

PlatformKind = Literal["cuda", "rocm", "xpu", "cpu", "tpu", "oot"]
KINDS: tuple[str, ...] = ("cuda", "rocm", "xpu", "cpu", "tpu", "oot")

# Optional backend packages, by import name, that the oracle asks about.
KNOWN_PACKAGES: tuple[str, ...] = (
    "flashinfer",
    "deep_gemm",
    "aiter",
    "intel_extension_for_pytorch",
    "tpu_inference",
    "triton_kernels",
)
# Kinds whose machines run Triton kernels when triton imports (a dependency on Linux).
TRITON_KINDS = ("cuda", "rocm", "xpu")


@dataclass(frozen=True)
class Platform:
    """A device kind, its capability (major, minor) and the optional packages importable on it.

    `has_triton` defaults to True on cuda/rocm/xpu (triton ships with torch there) and False
    elsewhere; `Platform.current()` sets it from a real import check.
    """

    kind: PlatformKind
    capability: tuple[int, int] | None = None
    packages: tuple[str, ...] = ()
    has_triton: bool | None = None
    device_name: str | None = None
    num_sms: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"platform kind={self.kind!r}; expected one of {list(KINDS)}")
        if self.capability is not None:
            cap = tuple(self.capability)
            if len(cap) != 2 or not all(isinstance(c, int) for c in cap):
                raise ValueError(f"capability={self.capability!r} must be a (major, minor) tuple")
            object.__setattr__(self, "capability", cap)
        if isinstance(self.packages, str):
            raise ValueError(f"packages={self.packages!r} must be a sequence of import names")
        object.__setattr__(self, "packages", tuple(sorted(set(self.packages))))
        if self.has_triton is None:
            object.__setattr__(self, "has_triton", self.kind in TRITON_KINDS)

    def has(self, package: str) -> bool:
        return package in self.packages

    def capability_at_least(self, major: int, minor: int = 0) -> bool:
        return self.capability is not None and self.capability >= (major, minor)

    @property
    def capability_str(self) -> str:
        return "-" if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"

    def __str__(self) -> str:
        parts = [self.kind]
        if self.capability is not None:
            parts.append(f"sm{self.capability[0]}{self.capability[1]}")
        if self.device_name:
            parts.append(repr(self.device_name))
        if self.packages:
            parts.append("+" + ",".join(self.packages))
        return " ".join(parts)

    # Real machines --------------------------------------------------------------------------
    @staticmethod
    def current() -> Platform:
        """The platform of the default accelerator, or the CPU when there is none."""
        return _current_platform()

    @staticmethod
    def for_device(device: torch.device | str) -> Platform:
        """The platform that runs tensors living on `device` (CPU tensors -> the CPU)."""
        device = torch.device(device)
        if device.type == "cpu":
            return _cpu_platform()
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return _cuda_platform(index)
        if device.type == "xpu":
            return Platform("xpu", packages=_importable(), has_triton=_has_triton())
        if device.type in ("xla", "tpu"):
            return Platform("tpu", packages=_importable(), has_triton=False)
        return Platform("oot", packages=_importable(), has_triton=False, device_name=device.type)


def _module_importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _importable() -> tuple[str, ...]:
    return tuple(p for p in KNOWN_PACKAGES if _module_importable(p))


@functools.cache
def _has_triton() -> bool:
    return _module_importable("triton")


@functools.cache
def _cpu_platform() -> Platform:
    return Platform("cpu", packages=_importable(), has_triton=False)


@functools.cache
def _cuda_platform(index: int) -> Platform:
    props = torch.cuda.get_device_properties(index)
    kind = "rocm" if torch.version.hip is not None else "cuda"
    return Platform(
        kind,
        (props.major, props.minor),
        packages=_importable(),
        has_triton=_has_triton(),
        device_name=props.name,
        num_sms=props.multi_processor_count,
    )


@functools.cache
def _current_platform() -> Platform:
    if torch.cuda.is_available():
        return _cuda_platform(torch.cuda.current_device())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return Platform.for_device("xpu")
    return _cpu_platform()
