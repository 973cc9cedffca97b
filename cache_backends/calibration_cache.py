"""Fitted calibration artefacts on disk: ``gqa`` codecs, ``mla`` bases and ``dca`` maps are fitted once and
reused at every later start (``KV_CALIBRATION_CACHE_DIR``; ``kvserve calibrate`` fills it ahead of serving).

An entry is one safetensors file, ``<kind>-<key[:24]>.safetensors``: the fitted tensors (float32, on the
CPU, whichever device and dtype fitted them) and, in its header metadata, the full key and the fit's
quality figures as JSON. A ``.json`` beside it repeats that metadata for people (what was fitted, on
which model, when, in how long); it is never read back. The key is a SHA-256 over

* the artefact kind and its fit version (a backend bumps the version when its fit changes),
* the parameters that change the fit (``mla``: rank; ``gqa``: groups; none for ``dca``). Parameters that
  only read a fit are left out, so one entry serves all their values: dca's threshold, probe interval and
  align (the maps and every similarity are fitted regardless), and int8's group size and residual (the
  fits are made on the model's unquantized K/V, so ``gqa+int8``, ``mla+int8`` and ``dca+mla`` share the
  entries of ``gqa``, ``mla`` and ``dca``),
* the calibration token ids (so the text, the tokenizer and the token cap),
* the model: :func:`model_fingerprint`.

The device and dtype are not in the key: a fit is a property of the weights, stored in float32, and
loaded onto the serving model's device (its tensors are cast where they are used, as a fresh fit's are).
An entry fitted on the CPU in float32 (a Docker build) therefore serves a bfloat16 GPU model, with a
fit at least as precise as one made there.

Writes are atomic (a temporary file in the same directory, then ``os.replace``): a reader sees a whole
entry or none, and processes fitting the same entry at once each leave a valid one. An entry that
cannot be read or does not match what the backend expects (truncated, corrupt, edited) is fitted again
with a warning, and a directory that cannot be written costs only the reuse (a warning); neither stops
a start. An entry is opened only if it is a regular file, and only if it opens within
:data:`OPEN_TIMEOUT_S`: anything else in its place (a named pipe, whose open would wait for a writer for ever;
a directory; a device) or a file system that does not answer is passed over with a warning and fitted
again, so no entry can hold a start. A temporary file a killed write left behind (unchanged for
:data:`STALE_TMP_SECONDS`) is removed when the next cache is opened.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from array import array
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

log = logging.getLogger("kvserve.calibration")

T = TypeVar("T")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# config entries that do not change the numbers a model computes, or that loading itself sets
_CONFIG_VOLATILE = ("dtype", "torch_dtype", "transformers_version")
STALE_TMP_SECONDS = 60.0
"""A ``.tmp`` file not modified for this long is a killed write's (a live write modifies its file as it goes)."""
OPEN_TIMEOUT_S = 10.0
"""Longest wait for an entry to open (seconds); a file system that does not answer costs a fit, not the start."""


def model_folder(model) -> Path | None:
    """The folder the model was loaded from: ``name_or_path`` itself, or its snapshot in the Hugging Face
    cache for a hub id (found without network); ``None`` if neither exists."""
    path = Path(str(model.name_or_path))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(model.name_or_path), "config.json")
    except Exception:  # noqa: BLE001 - not a hub id, or no hub library: no folder to fingerprint
        return None
    return Path(found).parent if isinstance(found, str) else None


def model_fingerprint(model) -> dict | None:
    """What identifies the model's weights and architecture, cheaply; ``None`` if it has no weight files.

    * the config: ``model.config.to_dict()`` without private entries and the dtype and library version
      (loading sets them; they do not change the weights a fit is made from);
    * each weight file in the model folder (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``): its name
      and size and, for a Hugging Face cache snapshot, the SHA-256 that names the blob it links to
      (content-addressed, so a re-download still matches); for any other file its modification time in
      nanoseconds.

    Why size + mtime rather than hashing the weights: reading every weight byte costs as much as loading
    the model (minutes for a large one, at every start), which is what the cache is there to avoid. It is
    the test ``make`` and ``rsync`` rely on: every way of writing new weights (``save_pretrained``, a
    download, a conversion, a fine-tune saved over the old files) gives the file a new mtime, while the
    copies a deployment makes keep it (``docker build`` ``COPY``, ``cp -p``, ``tar``), so the image's or the
    volume's entries still match. A false match needs different bytes of exactly the same size with the
    same nanosecond mtime, i.e. a deliberate ``touch -d``; a needless refit (a copy that resets mtimes)
    costs only the fit. ``kvserve calibrate --refit`` overwrites an entry whatever its key says.
    """
    folder = model_folder(model)
    if folder is None:
        return None
    weights = []
    for path in sorted(folder.iterdir()):
        if path.suffix not in WEIGHT_SUFFIXES or not path.is_file():
            continue
        target = path.resolve()
        stat = target.stat()
        ident = {"name": path.name, "size": stat.st_size}
        if target.parent.name == "blobs" and _SHA256.fullmatch(target.name):
            ident["sha256"] = target.name
        else:
            ident["mtime_ns"] = stat.st_mtime_ns
        weights.append(ident)
    if not weights:
        return None
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in _CONFIG_VOLATILE}
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    return {"config_sha256": config_hash, "weights": weights}


def calibration_digest(calibration_ids: list[int]) -> str:
    """SHA-256 of the calibration token ids (as 64-bit integers)."""
    return hashlib.sha256(array("q", calibration_ids).tobytes()).hexdigest()


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensors[name]``, checked to have ``shape``; used by a backend's loader on a cached entry.

    Raises:
        ValueError: if the tensor is missing or has another shape (the entry is then fitted again).
    """
    if name not in tensors:
        raise ValueError(f"no tensor {name!r}")
    if tuple(tensors[name].shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}")
    return tensors[name]


@dataclass
class CalibrationEvent:
    """What one :meth:`CalibrationCache.fetch` did: ``source`` is ``"cache"`` or ``"fitted"``; ``seconds`` the
    time to load or to fit (including the calibration forward pass, if this fit ran it), plus ``start_seconds``,
    what the backend measures at every start after that (:meth:`CalibrationCache.add_seconds`: dca's measuring
    pass); ``path`` the entry (``None`` when nothing was written); ``figures`` the fit's quality figures."""

    kind: str
    params: dict
    source: str
    seconds: float
    path: str | None
    figures: dict = field(default_factory=dict)
    start_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class CalibrationCache:
    """A directory of fitted artefacts (see the module docstring); ``directory=None`` only fits.

    Args:
        directory: where entries live (created on the first write); ``None``: no cache.
        refit: fit every artefact again and overwrite its entry (``kvserve calibrate --refit``).

    Attributes:
        events: one :class:`CalibrationEvent` per :meth:`fetch`, in order (for ``/info`` and the CLI).
    """

    def __init__(self, directory: str | Path | None = None, refit: bool = False):
        self.directory = Path(directory).expanduser() if directory else None
        self.refit = refit
        self.events: list[CalibrationEvent] = []
        self._fingerprints: dict[int, dict | None] = {}  # id(model) -> fingerprint, computed once
        self._remove_stale_tmp()

    def _remove_stale_tmp(self) -> None:
        """Remove the temporary files of writes that were killed (:func:`_atomic`'s ``.<entry>.*.tmp``, not
        modified for :data:`STALE_TMP_SECONDS`); a file that cannot be removed is left with a warning."""
        if self.directory is None or not self.directory.is_dir():
            return
        now = time.time()
        for tmp in self.directory.glob(".*.tmp"):
            try:
                if now - tmp.stat().st_mtime >= STALE_TMP_SECONDS:
                    tmp.unlink()
                    log.info("removed %s, left by an interrupted calibration cache write", tmp)
            except OSError as exc:
                log.warning("cannot remove the stale calibration cache file %s (%s)", tmp, exc)

    def key(self, kind: str, model, calibration_ids: list[int], params: dict, version: int = 1) -> str | None:
        """The entry key (64 hex digits), or ``None`` when the model has no weight files to identify it."""
        if id(model) not in self._fingerprints:
            self._fingerprints[id(model)] = model_fingerprint(model)
        fingerprint = self._fingerprints[id(model)]
        if fingerprint is None:
            return None
        ident = {"kind": kind, "version": version, "params": params, "model": fingerprint,
                 "calibration": {"tokens": len(calibration_ids), "sha256": calibration_digest(calibration_ids)}}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    def path(self, kind: str, key: str) -> Path:
        return self.directory / f"{kind}-{key[:24]}.safetensors"

    def fetch(self, kind: str, model, calibration_ids: list[int], params: dict,
              fit: Callable[[], tuple[dict[str, torch.Tensor], dict]],
              load: Callable[[dict[str, torch.Tensor], dict], T], version: int = 1) -> T:
        """The artefact ``kind`` for this model, parameters and calibration: loaded from its entry when there
        is a valid one, else fitted and written.

        Args:
            kind: artefact name (``"gqa"``, ``"mla"``, ``"dca"``), the entry's file name prefix.
            params: the parameters that change the fit (JSON-serializable).
            fit: fits from scratch; returns ``(tensors, figures)``: named tensors and JSON-serializable
                quality figures.
            load: builds the backend's objects from ``(tensors, figures)`` (CPU float32 tensors); raises
                (e.g. through :func:`take`) if they are not what it expects.
            version: the fit's version (bump it when the fit changes).

        Returns:
            ``load``'s result. A fresh fit goes through the same ``load`` as a cached one, from the same
            CPU tensors, so both serve bit-identical artefacts.
        """
        start = time.perf_counter()
        key = self.key(kind, model, calibration_ids, params, version) if self.directory else None
        if self.directory and key is None:
            log.warning("%s: no weight files found for %s; calibrating without the cache", kind, model.name_or_path)
        path = self.path(kind, key) if key else None
        if path is not None and not self.refit and path.exists():
            try:
                tensors, figures = self._read(path, key)
                result = load(tensors, figures)
            except Exception as exc:  # noqa: BLE001 - any unreadable entry is fitted again, never a crash
                log.warning("%s: calibration cache entry %s is unusable (%s); fitting again",
                            kind, path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            else:
                self._record(kind, params, "cache", start, path, figures)
                return result
        tensors, figures = fit()
        tensors = {name: t.detach().to("cpu", torch.float32).contiguous().clone() for name, t in tensors.items()}
        figures = json.loads(json.dumps(figures))  # what a cached entry gives back
        seconds = time.perf_counter() - start
        written = self._write(path, key, kind, params, model, calibration_ids, tensors, figures, seconds) \
            if path is not None else None
        result = load(tensors, figures)
        self._record(kind, params, "fitted", start, written, figures)
        return result

    def add_seconds(self, kind: str, seconds: float) -> None:
        """Count ``seconds`` of work a backend does after :meth:`fetch` at every start (dca's measuring pass) in
        the latest ``kind`` event's ``seconds`` (what ``/info``'s ``kv_calibration`` shows), and in its
        ``start_seconds``."""
        for event in reversed(self.events):
            if event.kind == kind:
                event.seconds = round(event.seconds + seconds, 3)
                event.start_seconds = round(event.start_seconds + seconds, 3)
                return

    def _record(self, kind, params, source, start, path, figures) -> None:
        event = CalibrationEvent(kind, dict(params), source, time.perf_counter() - start,
                                 str(path) if path else None, figures)
        self.events.append(event)
        log.info("%s calibration %s in %.2f s%s", kind, "loaded from the cache" if source == "cache" else "fitted",
                 event.seconds, f" ({path})" if path else "")

    @staticmethod
    def _read(path: Path, key: str) -> tuple[dict[str, torch.Tensor], dict]:
        """The entry's tensors and figures.

        Raises:
            ValueError: not a regular file, not opened in time, or its key does not match; OSError, and
                safetensors' errors for a file that is not one.
        """
        with _open_entry(path) as (f, meta):
            if meta.get("key") != key:
                raise ValueError("its key does not match")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return tensors, meta["figures"]

    def _write(self, path, key, kind, params, model, calibration_ids, tensors, figures, seconds) -> Path | None:
        """Write the entry atomically; on failure log a warning and return ``None``."""
        from safetensors.torch import save_file

        meta = {"key": key, "kind": kind, "params": params, "figures": figures, "model": str(model.name_or_path),
                "model_fingerprint": self._fingerprints.get(id(model)), "calibration_tokens": len(calibration_ids),
                "calibration_sha256": calibration_digest(calibration_ids), "fit_seconds": round(seconds, 3),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kvserve_version": _version()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic(path, lambda tmp: save_file(tensors, tmp, metadata={"kvserve": json.dumps(meta)}))
            _atomic(path.with_suffix(".json"),
                    lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8"))
        except OSError as exc:
            log.warning("%s: cannot write the calibration cache entry %s (%s); serving the fit without saving it",
                        kind, path, exc)
            return None
        return path


def entries(directory: str | Path, kind: str) -> list[dict]:
    """The metadata of every readable entry of ``kind`` in ``directory`` (its key, params, figures, model and
    fingerprint, as written), read from the entries' headers: no tensor is loaded, nothing is written or removed.
    An entry that cannot be read (not a regular file, not opened in time, not an entry) is passed over."""
    found = []
    for path in sorted(Path(directory).expanduser().glob(f"{kind}-*.safetensors")):
        try:
            with _open_entry(path) as (_, meta):
                if meta.get("kind") == kind:
                    found.append(meta)
        except Exception:  # noqa: BLE001 - any unreadable entry is passed over, as a fetch fits it again
            continue
    return found


@contextmanager
def _open_entry(path: Path):
    """``(safetensors file, kvserve metadata)`` of the entry at ``path``, opened only if it is a regular file
    and opens within :data:`OPEN_TIMEOUT_S` (:func:`open_regular`).

    Raises:
        ValueError, OSError, and safetensors' errors for a file that is not one.
    """
    from safetensors import safe_open

    fd = open_regular(path, OPEN_TIMEOUT_S)
    try:
        # safetensors opens a path itself, holding the interpreter lock while it does: it is given the file
        # just checked (Linux: its descriptor's /proc entry names that very file, whatever is at the path now)
        proc = Path(f"/proc/self/fd/{fd}")
        with safe_open(str(proc if proc.exists() else path), framework="pt") as f:
            yield f, json.loads((f.metadata() or {}).get("kvserve", "{}"))
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: Path, timeout: float) -> int:
    """A descriptor of ``path`` open for reading, if it is a regular file and opens within ``timeout`` seconds.

    The open does not wait for a writer (``O_NONBLOCK``: a named pipe opens at once, and is then refused), and it
    runs in a thread of its own, so that a file system that does not answer costs ``timeout``, not the start (the
    thread, left waiting, closes what it opens later).

    Raises:
        ValueError: naming what is there instead of a regular file, or that it did not open in time; OSError.
    """
    done = threading.Event()
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            outcome: Any = exc
        else:
            try:
                mode = os.fstat(fd).st_mode
                outcome = fd if stat.S_ISREG(mode) else ValueError(f"it is {_file_kind(mode)}, not a regular file")
            except OSError as exc:
                outcome = exc
            if not isinstance(outcome, int):
                os.close(fd)
        with lock:
            if box.get("abandoned"):
                if isinstance(outcome, int):
                    os.close(outcome)
                return
            box["outcome"] = outcome
        done.set()

    threading.Thread(target=work, name="kvserve-calibration-open", daemon=True).start()
    done.wait(timeout)
    with lock:
        if "outcome" not in box:
            box["abandoned"] = True
            raise ValueError(f"it did not open within {timeout:g} s")
        outcome = box["outcome"]
    if isinstance(outcome, BaseException):
        raise outcome
    os.set_blocking(outcome, True)
    return outcome


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:
        return "unknown"


def _atomic(path: Path, write: Callable[[str], Any]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; entries are meant to be read by other users (an image)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
