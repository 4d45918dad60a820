"""A minimal in-tree PEP 517 build backend for this example package (pure Python, one package).

It exists so that ``pip install --no-build-isolation tests/plugin_pkg`` works offline and whatever
setuptools is installed (setuptools < 70.1 cannot build wheels without the separate ``wheel``
package). It reads the ``[project]`` table of pyproject.toml and writes a ``py3-none-any`` wheel with
the package, METADATA, entry_points.txt and RECORD.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
_EPOCH = (2024, 1, 1, 0, 0, 0)


def _load_pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _names(project: dict) -> tuple[str, str, str]:
    dist = re.sub(r"[-_.]+", "_", project["name"]).lower()
    return project["name"], dist, project["version"]


def _package_files(package: str):
    base = ROOT / package
    for path in sorted(base.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
            yield path.relative_to(ROOT).as_posix(), path.read_bytes()


def _metadata(project: dict) -> dict[str, bytes]:
    name, _, version = _names(project)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    if project.get("description"):
        lines.append(f"Summary: {project['description']}")
    if project.get("requires-python"):
        lines.append(f"Requires-Python: {project['requires-python']}")
    lines += [f"Requires-Dist: {dep}" for dep in project.get("dependencies", [])]
    files = {
        "METADATA": ("\n".join(lines) + "\n").encode(),
        "WHEEL": b"Wheel-Version: 1.0\nGenerator: plugin_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    groups = project.get("entry-points", {})
    if groups:
        text = ""
        for group, entries in groups.items():
            text += f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
        files["entry_points.txt"] = text.encode()
    return files


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


# -- PEP 517 hooks ------------------------------------------------------------------------------------
def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    project = _load_pyproject()
    _, dist, version = _names(project)
    info = Path(metadata_directory) / f"{dist}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    for filename, data in _metadata(project).items():
        (info / filename).write_bytes(data)
    return info.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _load_pyproject()
    _, dist, version = _names(project)
    info = f"{dist}-{version}.dist-info"
    entries = list(_package_files(dist))
    entries += [(f"{info}/{filename}", data) for filename, data in _metadata(project).items()]
    record = [_record_line(path, data) for path, data in entries] + [f"{info}/RECORD,,"]
    entries.append((f"{info}/RECORD", ("\n".join(record) + "\n").encode()))
    wheel_name = f"{dist}-{version}-py3-none-any.whl"
    os.makedirs(wheel_directory, exist_ok=True)
    with zipfile.ZipFile(Path(wheel_directory) / wheel_name, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in entries:
            wheel.writestr(zipfile.ZipInfo(path, _EPOCH), data, zipfile.ZIP_DEFLATED)
    return wheel_name


def build_sdist(sdist_directory, config_settings=None):
    project = _load_pyproject()
    _, dist, version = _names(project)
    base = f"{dist}-{version}"
    files = [("pyproject.toml", (ROOT / "pyproject.toml").read_bytes()),
             ("plugin_build.py", (ROOT / "plugin_build.py").read_bytes()),
             ("PKG-INFO", _metadata(project)["METADATA"]), *_package_files(dist)]
    sdist_name = f"{base}.tar.gz"
    os.makedirs(sdist_directory, exist_ok=True)
    with tarfile.open(Path(sdist_directory) / sdist_name, "w:gz") as tar:
        for path, data in files:
            member = tarfile.TarInfo(f"{base}/{path}")
            member.size, member.mtime, member.mode = len(data), 0, 0o644
            tar.addfile(member, io.BytesIO(data))
    return sdist_name
