"""Where the gateway's API keys come from: a file (one key a line; blank lines and '#' comments skipped) that is
read again when it changes or on SIGHUP, so that keys rotate without a restart; or $DDTREE_API_KEYS (keys
separated by commas or whitespace), fixed at start. Keys are never logged: a file that fails to load is named
with its problem and the keys in force stay."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from gateway.auth import ApiKeys
from proto.serving import describe

log = logging.getLogger(__name__)

API_KEYS_ENV = "DDTREE_API_KEYS"


def read_keys(path: str) -> list[str]:
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def env_keys() -> ApiKeys:
    """The keys of $DDTREE_API_KEYS; none (auth off) when it is unset or empty."""
    return ApiKeys(key for key in re.split(r"[\s,]+", os.environ.get(API_KEYS_ENV, "")) if key)


def load_api_keys(path: str | None) -> tuple[ApiKeys, KeyFile | None]:
    """The keys, and the file they come from (None: from $DDTREE_API_KEYS, or none at all: auth off)."""
    if path is None:
        return env_keys(), None
    if os.environ.get(API_KEYS_ENV):
        raise ValueError(f"API keys come from --api-keys-file or ${API_KEYS_ENV}, not both")
    key_file = KeyFile(path)
    return key_file.keys, key_file


class KeyFile:
    """`keys` as the file says; a file that cannot be read at construction is a start failure."""

    def __init__(self, path: str):
        self.path = path
        self._seen = self._stamp()
        self.keys = ApiKeys(read_keys(path))

    def _stamp(self) -> tuple[int, int, int] | None:
        """What changes when the file is rewritten or replaced (a Kubernetes secret swaps a symlink)."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def reload(self) -> None:
        try:
            self.keys.replace(read_keys(self.path))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            log.error("%s: API keys not reloaded (%s); the keys in force stay", self.path, describe(error))
            return
        log.info("API keys reloaded from %s: %d in force", self.path, len(self.keys))

    def reload_if_changed(self) -> None:
        """Cheap (one stat): the gateway's housekeeping calls it every round."""
        stamp = self._stamp()
        if stamp != self._seen:
            self._seen = stamp
            self.reload()
