"""Raw files of a corpus: found under a user's ``--raw-dir``, or downloaded once into a cache,
checked against the published sha256 and unpacked there (``locate``).

Downloads go through pooch (a timeout, retries, the sha256 checked before the file lands in the
cache); without network the error is one line naming the URL and ``--raw-dir``."""

import gzip
import hashlib
import shutil
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pooch
import requests  # pooch's HTTP client: its errors are requests' own

from ...command_line import CommandError
from ...resources import cache_root
from .progress import Progress, log
from .readers import DAMAGED_ARCHIVE, damaged

DEFAULT_CACHE = cache_root() / "raw"  # $FAIRSEQ_PLUGINS_CACHE/raw, as read when the command starts
TIMEOUT_S = 60  # for the connection and between two reads: a stalled server is left, not waited on forever
RETRIES = 2  # more tries after a failed one (pooch waits 1 s, then 2 s): a dropped connection is not the end


class DownloadFailed(CommandError):
    """An archive could not be downloaded (no network, a server error, a timeout)."""


@dataclass
class Archive:
    """A public download and the basenames of the files the corpus needs from it."""

    url: str
    members: Sequence[str]
    sha256: Optional[str] = None  # of the archive as downloaded; checked before it is unpacked


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: Optional[str]) -> None:
    if expected is not None and sha256_of(path) != expected:
        raise ValueError(f"{path}: sha256 {sha256_of(path)} is not the published {expected}: the download is "
                         f"damaged or not the expected file; delete it and run again")


class _DownloadBar:
    """pooch's progress-bar protocol (``total``, ``update``, ``reset``, ``close``) on the
    project's Progress: a bar on a terminal, one summary line in a log."""

    total = None  # set by pooch before the first update

    def __init__(self, name: str):
        self.name, self.done, self.progress = name, 0, None

    def update(self, n: int) -> None:
        if self.progress is None:
            self.progress = Progress(self.total or None, self.name, unit="B", unit_scale=True)
        self.progress.update(n)
        self.done += n

    def reset(self) -> None:  # pooch ends with reset() then update(total)
        self.update(-self.done)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.__exit__(None, None, None)


def _reason(err: requests.exceptions.RequestException) -> str:
    if isinstance(err, requests.exceptions.Timeout):
        return f"no answer within {TIMEOUT_S} s"
    if isinstance(err, requests.exceptions.HTTPError) and err.response is not None:
        return f"HTTP {err.response.status_code}"
    if isinstance(err, requests.exceptions.ConnectionError):
        return "no connection"
    return type(err).__name__


def _download(url: str, dest: Path, sha256: Optional[str]) -> None:
    """``url`` into ``dest`` (checked against ``sha256`` when given, before it lands there)."""
    fetcher = pooch.create(path=dest.parent, base_url="", urls={dest.name: url}, retry_if_failed=RETRIES,
                           registry={dest.name: f"sha256:{sha256}" if sha256 else None})
    log(f"downloading {url}")
    logger = pooch.get_logger()
    level = logger.level
    logger.setLevel("WARNING")  # pooch would repeat the line above, unprefixed
    try:
        downloader = pooch.HTTPDownloader(timeout=TIMEOUT_S, progressbar=_DownloadBar(dest.name))
        fetcher.fetch(dest.name, downloader=downloader)
    except requests.exceptions.RequestException as err:
        raise DownloadFailed(
            f"could not download {url} ({_reason(err)}, {1 + RETRIES} tries): download {dest.name} on a machine "
            "with network and pass the folder that holds it (packed or unpacked) with --raw-dir") from None
    finally:
        logger.setLevel(level)


def _extract(archive: Path, into: Path) -> None:
    """Unpack .tgz/.tar.gz/.tar/.zip, gunzip a single .gz, or copy a plain .txt into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    name = archive.name
    log(f"extracting {name}")
    try:
        _unpack(archive, into)
    except (*DAMAGED_ARCHIVE, tarfile.ReadError, zipfile.BadZipFile) as err:
        shutil.rmtree(into)  # no half-unpacked members for the next run to find
        raise damaged(archive, err) from err


def _unpack(archive: Path, into: Path) -> None:
    name = archive.name
    if name.endswith((".tgz", ".tar.gz", ".tar")):
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
    elif name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(into)
    elif name.endswith(".gz"):
        with gzip.open(archive, "rb") as src, open(into / name[: -len(".gz")], "wb") as dst:
            shutil.copyfileobj(src, dst)
    elif name.endswith(".txt"):  # a plain file downloaded as it is (PTB)
        shutil.copyfile(archive, into / name)
    else:
        raise ValueError(f"don't know how to unpack {archive}")


def _archive_filename(url: str) -> str:
    return url.rstrip("/").split("/")[-1].split("?")[0]


def find_file(root: Path, basename: str) -> Optional[Path]:
    """A file called ``basename`` (or ``basename.gz``) anywhere under ``root``."""
    if not root.is_dir():
        return None
    for candidate in (basename, basename + ".gz"):
        hits = sorted(p for p in root.rglob(candidate) if p.is_file())
        if hits:
            return hits[0]
    return None


def locate(
    archives: Sequence[Archive], raw_dir: Optional[Path], cache_dir: Path = DEFAULT_CACHE
) -> Dict[str, Path]:
    """Map every member basename of ``archives`` to a file on disk.

    With ``raw_dir`` the files (or the archives themselves, still packed) must be under
    it: nothing is downloaded. Without it each archive is downloaded into ``cache_dir``
    once and unpacked there. An archive with a published ``sha256`` is checked before it is
    unpacked.
    """
    found: Dict[str, Path] = {}
    missing: List[str] = []
    for arc in archives:
        packed_name = _archive_filename(arc.url)
        unpacked = cache_dir / (packed_name + ".d")

        def lookup(member, unpacked=unpacked):
            return (find_file(raw_dir, member) if raw_dir is not None else None) or find_file(unpacked, member)

        paths = {m: lookup(m) for m in arc.members}
        if not all(paths.values()):
            if raw_dir is not None:
                packed = find_file(raw_dir, packed_name)
            else:
                packed = cache_dir / packed_name
                if not packed.exists():
                    _download(arc.url, packed, arc.sha256)
            if packed is not None:
                _check_sha256(packed, arc.sha256)
                _extract(packed, unpacked)
                paths = {m: lookup(m) for m in arc.members}
        for member, path in paths.items():
            if path is None:
                missing.append(f"{member} (from {arc.url})")
            else:
                found[member] = path
    if missing:
        where = f"under {raw_dir}" if raw_dir is not None else f"in the downloads in {cache_dir}"
        raise FileNotFoundError(f"raw files not found {where}:\n  " + "\n  ".join(missing))
    return found
