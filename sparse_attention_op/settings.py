"""Every setting of the package: a session's, and the process's environment variables.

A session's settings are one frozen value, :class:`SessionSettings`. prepare_model stamps it
on each SparseAttention node as one attribute (:meth:`SessionSettings.to_attribute`), the
op's kernel reads it back once when ORT creates the node, and the executor compares two of
them by value. So a node reads its settings from its own attribute in every kind of
session (create_session's, a plain InferenceSession's, ORT GenAI's): there is no second
route.

The environment variables are read here and nowhere else, under one prefix, ``SAO_``;
README lists them. ``SPARSE_ATTENTION_OP_ADAPTER``, the adapter variable's old name, is
still read, with a deprecation warning, for one release.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

#: The resident cache's checks (create_session's ``kv_check``).
KV_CHECKS = ("exact", "fast")
#: The profile modes: off, one timed pass per dispatch, the call's dispatches timed as one pass.
PROFILES = ("off", "dispatches", "pass")


class SettingsError(ValueError):
    """A setting out of its range; the message names the setting and what it accepts."""


@dataclass(frozen=True)
class SessionSettings:
    """What a session chooses for its SparseAttention nodes (create_session's keywords).

    * ``kv_check``: ``"exact"`` compares every history row with the GPU's cache through
      digests; ``"fast"`` compares the lengths and a few probe rows, on the GPU.
    * ``profile``: ``"off"``; ``"dispatches"`` times every dispatch in a timed pass of its
      own; ``"pass"`` times the call's dispatches as the one pass an untimed call records
      (each timed pass carries a few microseconds of its own).
    * ``f16_cache``: float16 nodes keep their GPU caches in f16 where the adapter has
      shader-f16 (lossless: every cached value is an f16 value).
    """

    kv_check: str = "exact"
    profile: str = "off"
    f16_cache: bool = True

    def __post_init__(self):
        if self.kv_check not in KV_CHECKS:
            raise SettingsError(f"kv_check must be one of {KV_CHECKS}, got {self.kv_check!r}")
        if self.profile not in PROFILES:
            raise SettingsError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        if not isinstance(self.f16_cache, bool):
            raise SettingsError(f"f16_cache must be True or False, got {self.f16_cache!r}")

    @classmethod
    def of(cls, *, kv_check: str = "exact", profile: bool | str = False, f16_cache: bool = True) -> SessionSettings:
        """From create_session's keywords, where ``profile`` may also be a bool (True:
        ``"dispatches"``, False: ``"off"``)."""
        if profile is True or profile is False:
            profile = "dispatches" if profile else "off"
        elif profile not in PROFILES:
            raise SettingsError(f"profile must be True, False or one of {PROFILES}, got {profile!r}")
        return cls(kv_check=kv_check, profile=profile, f16_cache=f16_cache)

    @property
    def profiled(self) -> bool:
        return self.profile != "off"

    @property
    def profile_whole_pass(self) -> bool:
        return self.profile == "pass"

    def to_attribute(self) -> str:
        """The node attribute's text, ``kv_check=fast;profile=off;f16_cache=1``."""
        return f"kv_check={self.kv_check};profile={self.profile};f16_cache={int(self.f16_cache)}"

    @classmethod
    def from_attribute(cls, text: str) -> SessionSettings:
        """The settings :meth:`to_attribute` wrote; raises SettingsError for anything else."""
        fields = {}
        for part in text.split(";") if text else ():
            name, sep, value = part.partition("=")
            if not sep or name not in ("kv_check", "profile", "f16_cache") or name in fields:
                raise SettingsError(f"session settings attribute {text!r}: cannot read {part!r}")
            fields[name] = value
        if "f16_cache" in fields:
            if fields["f16_cache"] not in ("0", "1"):
                raise SettingsError(f"session settings attribute {text!r}: f16_cache must be 0 or 1")
            fields["f16_cache"] = fields["f16_cache"] == "1"
        return cls(**fields)


#: The settings of a node whose model stamped none.
DEFAULT_SETTINGS = SessionSettings()


# -- the environment ----------------------------------------------------------------------

PREFIX = "SAO_"
#: name -> what it does (README's table says the same).
VARIABLES = {
    "SAO_ADAPTER": "a substring of the wanted wgpu adapter's description (default: the best adapter)",
    "SAO_SHADER_CHECKS": "1 compiles the kernels with Naga's runtime checks (bounds clamps, loop counters)",
    "SAO_TRANSFER_CHUNK_BYTES": "uploads and read-backs move in chunks of this many bytes (0: whole)",
    "SAO_STAGING_BYTES": "uploads above this size go through the package's own mapped staging buffer",
    "SAO_WGPU_COMMANDS": "public records commands through wgpu-py's classes instead of wgpu-native directly",
    "SAO_WGPU_MAPS": "public maps buffers through wgpu-py instead of wgpu-native directly",
}
#: Old names still read for one release: old -> new.
DEPRECATED = {"SPARSE_ATTENTION_OP_ADAPTER": "SAO_ADAPTER"}
_warned: set[str] = set()


def environment(name: str, default: str = "") -> str:
    """The value of one of :data:`VARIABLES` (or its deprecated old name, with a warning)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of the package's environment variables: {sorted(VARIABLES)}")
    value = os.environ.get(name)
    if value is not None:
        return value
    for old, new in DEPRECATED.items():
        if new == name and old in os.environ:
            if old not in _warned:
                _warned.add(old)
                # A FutureWarning: Python shows it by default (a DeprecationWarning raised
                # inside the package would stay hidden from the user who set the variable).
                warnings.warn(f"{old} is deprecated: set {new} instead (the old name goes in the next release)", FutureWarning, stacklevel=2)
            return os.environ[old]
    return default


def environment_name(name: str) -> str:
    """The variable a user set for ``name``: the deprecated old one where only it is set."""
    if name not in os.environ:
        for old, new in DEPRECATED.items():
            if new == name and old in os.environ:
                return old
    return name


def environment_int(name: str, default: int) -> int:
    text = environment(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise SettingsError(f"{name}={text!r} is not an integer") from None


def environment_flag(name: str) -> bool:
    """True where the variable is set to anything but empty or 0."""
    return environment(name, "").strip() not in ("", "0")
