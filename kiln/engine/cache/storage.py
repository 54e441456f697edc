"""HiCache's disk tier (L3): one file per page, keyed by a hash chained over the token prefix.

Page i of a sequence is keyed by `sha256(key of page i-1 + tokens of page i)`, and page 0 chains
from the model's namespace hash, which covers everything that changes the cached state: the
model's config and weight files (or dummy-weight seed), dtype, page size and state components.
A key therefore names one exact prefix of one exact model: two models never share files, and a
server restarted with the same model finds its pages again.

Layout: `<dir>/<namespace>/<key[:2]>/<key>.pt`, a `torch.save`d dict {space name: [tensor per
buffer]} ("main" always; a window space only where the page's window data was on the host).
Files are written to a temporary name in the same folder and renamed into place, so a reader (or
a crash) never sees half a page. `clear()` removes this model's folder only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from array import array
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)


def default_storage_dir() -> str:
    from kiln.loader.source import cache_dir

    return os.path.join(cache_dir(), "hicache")


def model_namespace(identity: dict) -> str:
    """A short stable hash of everything that identifies the cached state of one model."""
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def page_hash(parent: str, tokens: Sequence[int]) -> str:
    """Key of a page: chained over the parent page's key and this page's token ids."""
    return hashlib.sha256(parent.encode() + array("q", tokens).tobytes()).hexdigest()


class FileStorage:
    """Pages of one model in one folder."""

    def __init__(self, root: str, namespace: str, identity: Optional[dict] = None):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.namespace = namespace
        self.dir = os.path.join(self.root, namespace)
        self.identity = identity
        self._init_dir()

    def _init_dir(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        if self.identity is not None:  # for people browsing the folder; never read back
            self._write_atomic(os.path.join(self.dir, "model.json"),
                               json.dumps(self.identity, sort_keys=True, default=str, indent=1).encode())

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key + ".pt")

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def get(self, key: str) -> Optional[dict[str, list[torch.Tensor]]]:
        """The page's data, or None if absent (a damaged file is removed and reported absent)."""
        path = self.path(key)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged file must not take the server down
            logger.warning("HiCache: dropping unreadable page file %s (%s)", path, e)
            try:
                os.remove(path)
            except OSError:
                pass
            return None

    def put(self, key: str, data: dict[str, list[torch.Tensor]]) -> bool:
        """Write a page unless it is there already; True if written."""
        path = self.path(key)
        if os.path.exists(path):
            return False
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            # clone: a view would drag its whole base storage into the file
            torch.save({k: [t.clone() for t in v] for k, v in data.items()}, tmp)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("HiCache: could not write %s (%s)", path, e)
            if os.path.exists(tmp):
                os.remove(tmp)
            return False
        return True

    def _write_atomic(self, path: str, blob: bytes) -> None:
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)

    def num_pages(self) -> int:
        n = 0
        for _, _, files in os.walk(self.dir):
            n += sum(f.endswith(".pt") for f in files)
        return n

    def clear(self) -> None:
        """Remove every page of this model (other models' folders stay)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self._init_dir()
