"""The on-disk cache: where it lives, and how entries are built safely.

Entries are folders. Each is built in a temporary sibling folder and renamed
into place only when complete, under a file lock, so that an interrupted build
leaves nothing half-written and two processes never build the same entry twice.
Each entry's metadata file records the size and sha256 of its files; an entry
whose files are missing or have another size is rebuilt with one warning.
"""

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator, List, Optional

from filelock import FileLock

from .errors import CacheNotWritableError, DiskFullError, OutputExistsError

log = logging.getLogger("xpuspec")

#: Name of the metadata file xpuspec writes into the folders it produces.
METADATA_FILE = "xpuspec.json"
#: Key of the file manifest (name -> size and sha256) in :data:`METADATA_FILE`.
MANIFEST_KEY = "files"


def cache_root() -> Path:
    """The cache folder: ``$XPUSPEC_CACHE``, else ``~/.cache/xpuspec``.

    Raises:
        CacheNotWritableError: it does not exist and cannot be created.
        DiskFullError: it does not exist and its disk is full.
    """
    root = Path(os.environ.get("XPUSPEC_CACHE") or Path.home() / ".cache" / "xpuspec")
    if not root.is_dir():
        with explain_write_errors(root, "creating xpuspec's cache"):
            root.mkdir(parents=True, exist_ok=True)
    return root


#: ``errno`` values of a full disk: no space left, a quota exceeded.
_FULL = (errno.ENOSPC, errno.EDQUOT)
#: ``errno`` values of a folder that cannot be written: a read-only file system, no permission.
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
#: How libraries that are not Python's ``OSError`` (safetensors' ``SafetensorError``, pip's output) say the disk is full.
_FULL_WORDS = ("No space left on device", "Disk quota exceeded")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during (at most 20)."""
    for _ in range(20):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


def says_disk_full(text: str) -> bool:
    """Whether an error message (a library's, pip's) says that the disk is full."""
    return any(words in text for words in _FULL_WORDS)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it came from, is a full disk: an ``OSError`` with ``ENOSPC`` or ``EDQUOT``,
    or a library's error that says so (safetensors raises ``SafetensorError("... No space left on device ...")``)."""
    return any((isinstance(e, OSError) and e.errno in _FULL) or says_disk_full(str(e)) for e in _causes(exc))


def is_not_writable(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it came from, is an ``OSError`` saying a folder cannot be written
    (``EROFS``, ``EACCES``, ``EPERM``)."""
    return any(isinstance(e, OSError) and e.errno in _NOT_WRITABLE for e in _causes(exc))


def human_size(n: float) -> str:
    """``n`` bytes as ``"98.4 MB"`` (decimal units, as pip and ``df -H`` print them)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _free_bytes(folder: Path) -> Optional[int]:
    """Free bytes on the disk of ``folder`` (or of its nearest existing parent), ``None`` if unknown."""
    for path in (Path(folder), *Path(folder).parents):
        if path.exists():
            try:
                return shutil.disk_usage(path).free
            except OSError:
                return None
    return None


def disk_full_error(folder: Path, what: str, needed: Optional[str] = None) -> DiskFullError:
    """The :class:`DiskFullError` of ``what`` running out of space in ``folder``; ``needed``: the space it needs
    (``"98.4 MB"``, ``"at least 1.2 GB"``), when known."""
    free = _free_bytes(folder)
    return DiskFullError(
        f"No space left on device: {what} needs {needed or 'more space than is free'} in {folder}"
        + (f", and its disk has {human_size(free)} free" if free is not None else "")
        + ". Free some space there, or set XPUSPEC_CACHE to a folder on a disk with room. "
        "Nothing was left half-written.", folder)


def not_writable_error(folder: Path, what: str) -> CacheNotWritableError:
    """The :class:`CacheNotWritableError` of ``what``, which must write into ``folder``."""
    return CacheNotWritableError(
        f"{folder} cannot be written (a read-only file system or mount, or no permission), and {what} must write "
        "there. Set XPUSPEC_CACHE to a folder you can write; a read-only cache serves only what it already holds "
        "(a model pulled and compiled in the format asked for).", folder)


@contextlib.contextmanager
def explain_write_errors(folder: Path, what: str, needed=None):
    """Turn a full disk (:func:`is_disk_full`) or an unwritable folder (:func:`is_not_writable`) raised in the block
    into a :class:`DiskFullError` or :class:`CacheNotWritableError` that names ``folder``, ``what`` was being done
    and ``needed`` (the space it needs: a string, or a function returning one, called only on a full disk);
    anything else passes through unchanged."""
    try:
        yield
    except (DiskFullError, CacheNotWritableError):
        raise
    except Exception as exc:
        if is_disk_full(exc):
            raise disk_full_error(folder, what, needed() if callable(needed) else needed) from exc
        if is_not_writable(exc):
            raise not_writable_error(folder, what) from exc
        raise


def digest(*parts) -> str:
    """A short stable hash of JSON-serialisable parts, for cache keys."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def folder_fingerprint(folder: Path) -> str:
    """Hash of the file names, sizes and modification times in ``folder`` (not recursive), and of where it is: its
    absolute path, or for a folder inside the cache (a pulled model) its path there, so that a cache mounted or
    copied (times kept) to another path, read-only included, still finds the entries it holds."""
    entries = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).iterdir() if p.is_file()
    )
    folder, root = Path(folder).resolve(), cache_root().resolve()
    return digest(f"cache/{folder.relative_to(root)}" if folder.is_relative_to(root) else str(folder), entries)


#: Every Ctrl-C (SIGINT) received while an :func:`atomic_folder` block ran, nested blocks included.
_SIGINTS: List[int] = []


def _record_and_raise(signum, frame):
    _SIGINTS.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupts_recorded():
    """Yield a function that says whether a Ctrl-C (SIGINT) arrived since the block began.

    Python raises KeyboardInterrupt where the signal lands; when that is inside a ``__del__``
    (libraries' finalisers run during export) it is swallowed. The record lets the caller refuse
    to commit after such a lost interrupt, whose "Exception ignored" report is not printed. The
    outermost block installs the handler and the hook; nested blocks share its record. Only the
    main thread can set signal handlers, and a handler other than Python's default is left alone.
    """
    start = len(_SIGINTS)
    outermost = (threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    report = sys.unraisablehook

    def quiet_when_recorded(unraisable):
        if not (len(_SIGINTS) > start and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            report(unraisable)

    if outermost:
        signal.signal(signal.SIGINT, _record_and_raise)
        sys.unraisablehook = quiet_when_recorded
    try:
        yield lambda: len(_SIGINTS) > start
    finally:
        if outermost:
            if signal.getsignal(signal.SIGINT) is _record_and_raise:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            if sys.unraisablehook is quiet_when_recorded:
                sys.unraisablehook = report


@contextlib.contextmanager
def atomic_folder(final: Path, overwrite: bool = False):
    """Yield a temporary folder beside ``final``; rename it to ``final`` if the block succeeds.

    On any exception (KeyboardInterrupt included) the temporary folder is removed and
    ``final`` is untouched. A Ctrl-C that a library swallowed during the block still
    counts: the folder is not committed and KeyboardInterrupt is raised. With
    ``overwrite`` an existing ``final`` is replaced only after the new content is complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:  # at once: a Ctrl-C that lands during chmod must not leave the folder behind
        tmp.chmod(0o755)
        with _interrupts_recorded() as interrupted:
            yield tmp
            if interrupted():
                raise KeyboardInterrupt
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


def refuse_replacing(out: Path, kept: Path, what: str, inside: bool = False) -> None:
    """Raise :class:`OutputExistsError` where the folder ``out`` is, or holds, ``kept`` (also through links), or
    with ``inside`` lies within it: replacing ``out``, as ``--force`` / ``force=True`` does, would delete ``kept``
    or, inside it, part of it."""
    out, kept = Path(os.path.abspath(out)), Path(os.path.abspath(kept))
    pairs = ((out, kept), (out.resolve(), kept.resolve()))
    if any(o == k or o in k.parents or (inside and k in o.parents) for o, k in pairs):
        place = "is, holds or lies inside" if inside else "is or holds"
        raise OutputExistsError(f"{out} {place} {what} ({kept}); writing there would replace it, force or not. "
                                "Choose another output folder.")


def refuse_replacing_anything_kept(out: Path, *sources: Path) -> None:
    """The folders an export or a save must not replace: xpuspec's cache (or a folder in it), each of ``sources``
    (the model's own folder), and the current folder, which would be replaced under the user's shell.

    Raises:
        OutputExistsError: ``out`` is one of them or holds one of them (or lies inside the cache).
    """
    refuse_replacing(out, cache_root(), "xpuspec's cache", inside=True)
    for source in sources:
        refuse_replacing(out, source, "the model's own folder")
    refuse_replacing(out, Path.cwd(), "the current folder")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_metadata(folder: Path) -> dict:
    """Contents of ``folder``'s :data:`METADATA_FILE`, or ``{}`` when it has none."""
    meta = Path(folder) / METADATA_FILE
    return json.loads(meta.read_text()) if meta.is_file() else {}


def write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file in ``folder`` (but the metadata file) in its metadata."""
    folder = Path(folder)
    meta = read_metadata(folder)
    meta[MANIFEST_KEY] = {
        p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.iterdir()) if p.is_file() and p.name != METADATA_FILE
    }
    (folder / METADATA_FILE).write_text(json.dumps(meta, indent=2))


def manifest_damage(folder: Path, checksums: bool = False) -> Optional[str]:
    """Why ``folder`` disagrees with its manifest (a sentence), or ``None`` if it agrees.

    Sizes are always compared (cheap); sha256 only with ``checksums`` (about 1 s per 500 MB).
    A folder without a manifest (not written by xpuspec, or by a version before manifests) agrees.
    """
    folder = Path(folder)
    try:
        files = read_metadata(folder).get(MANIFEST_KEY, {})
    except (OSError, ValueError) as exc:
        return f"its {METADATA_FILE} is unreadable ({exc})"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} expected"
        if checksums and file_sha256(path) != want["sha256"]:
            return f"{name} has another sha256 than when it was written"
    return None


def cached_folder(final: Path, build) -> Path:
    """Return ``final``, building it first with ``build(tmp_folder)`` if it is absent or damaged.

    An entry that is there and whole is returned without writing anything (no lock): a read-only cache serves it.
    Building raises :class:`CacheNotWritableError` where the cache cannot be written and :class:`DiskFullError` where
    its disk fills.

    A lock file beside ``final`` serialises builders across processes; the second
    process waits and then finds the entry ready. The build's files are recorded in a
    manifest (:func:`write_manifest`); an entry whose files no longer match it in size
    (:func:`manifest_damage`) is rebuilt, with one warning.
    """
    final = Path(final)
    if final.is_dir() and manifest_damage(final) is None:
        return final
    with explain_write_errors(final.parent, f"building the cache entry {final.name}"):
        final.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(final) + ".lock"):
            damage = manifest_damage(final) if final.is_dir() else None
            if damage is not None:
                log.warning("cache entry %s is damaged (%s); rebuilding it", final, damage)
            if not final.is_dir() or damage is not None:
                with atomic_folder(final, overwrite=True) as tmp:
                    build(tmp)
                    write_manifest(tmp)
    return final


@contextlib.contextmanager
def entry_lock(final: Path, what: str):
    """Hold the lock file beside the cache entry ``final`` (created with its folder) while the block builds it; if
    the block fails, the lock file is deleted too, so a failed build leaves nothing behind.

    Raises:
        CacheNotWritableError: the lock file cannot be created (a read-only cache).
        DiskFullError: nor for lack of space.
    """
    path = Path(str(final) + ".lock")
    lock = FileLock(str(path))
    with explain_write_errors(Path(final).parent, what):
        Path(final).parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    try:
        yield
    except BaseException:
        lock.release()
        path.unlink(missing_ok=True)
        raise
    lock.release()


def check_writable(folder: Path, what: str) -> Path:
    """Create ``folder`` if needed and check that it can be written, before ``what`` (a measurement that takes
    minutes) runs only to fail at its end. Returns ``folder``.

    Raises:
        CacheNotWritableError: it cannot be created or written.
        DiskFullError: it cannot be created for lack of space.
    """
    folder = Path(folder)
    with explain_write_errors(folder, what):
        folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise not_writable_error(folder, what)
    return folder


def write_text_atomic(path: Path, text: str, what: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place (a reader never sees half a file).

    Raises:
        CacheNotWritableError: the folder cannot be written.
        DiskFullError: the disk is full.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with explain_write_errors(path.parent, what, lambda: human_size(len(text.encode()))):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
