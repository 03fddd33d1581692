"""The on-disk cache: where it lives, and how entries are built safely.

Entries are folders. Each is built in a temporary sibling folder and renamed
into place only when complete, under a file lock, so that an interrupted build
leaves nothing half-written and two processes never build the same entry twice.
"""

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock


def cache_root() -> Path:
    """The cache folder: ``$XPUSPEC_CACHE``, else ``~/.cache/xpuspec``."""
    root = Path(os.environ.get("XPUSPEC_CACHE") or Path.home() / ".cache" / "xpuspec")
    root.mkdir(parents=True, exist_ok=True)
    return root


def digest(*parts) -> str:
    """A short stable hash of JSON-serialisable parts, for cache keys."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def folder_fingerprint(folder: Path) -> str:
    """Hash of the file names, sizes and modification times in ``folder`` (not recursive)."""
    entries = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).iterdir() if p.is_file()
    )
    return digest(str(Path(folder).resolve()), entries)


@contextlib.contextmanager
def atomic_folder(final: Path, overwrite: bool = False):
    """Yield a temporary folder beside ``final``; rename it to ``final`` if the block succeeds.

    On any exception (KeyboardInterrupt included) the temporary folder is removed and
    ``final`` is untouched. With ``overwrite`` an existing ``final`` is replaced only after
    the new content is complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if final.exists() and overwrite:
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cached_folder(final: Path, build) -> Path:
    """Return ``final``, building it first with ``build(tmp_folder)`` if it is absent.

    A lock file beside ``final`` serialises builders across processes; the second
    process waits and then finds the entry ready.
    """
    final = Path(final)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if not final.is_dir():
            with atomic_folder(final) as tmp:
                build(tmp)
    return final
