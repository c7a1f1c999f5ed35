"""Print a hash of what `docker build .` would send and use: the build context after .dockerignore
(paths and contents, with the Dockerfile and .dockerignore themselves) and the extra words given
(the base image, build arguments). scripts/image/build skips buildah when the image of this key
exists, so an unchanged tree costs no build at all.

Patterns are matched as Docker does for the common forms (Go's filepath.Match on the path and each
of its parents, `**/` for any depth); exceptions (`!`) are refused rather than misread.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sys
from pathlib import Path


def patterns(repo: Path) -> list[str]:
    out = []
    for line in (repo / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!"):
            sys.exit(f".dockerignore: exceptions ({line}) are not supported by {__file__}")
        out.append(line.strip("/"))
    return out


def ignored(relative: str, rules: list[str]) -> bool:
    parts = relative.split("/")
    for rule in rules:
        if rule.startswith("**/"):
            tail = rule[3:]
            if any(fnmatch.fnmatchcase("/".join(parts[i:]), tail) for i in range(len(parts))):
                return True
        elif fnmatch.fnmatchcase(relative, rule):
            return True
    return False


def context_key(repo: Path, extra: list[str]) -> str:
    rules = patterns(repo)
    digest = hashlib.sha256()
    for word in extra:
        digest.update(b"arg\0" + word.encode() + b"\0")
    for root, dirs, files in os.walk(repo):
        base = Path(root).relative_to(repo).as_posix()
        prefix = "" if base == "." else base + "/"
        # Pruned while walking: .git, .venv and build are large and ignored.
        dirs[:] = sorted(d for d in dirs if not ignored(prefix + d, rules))
        for name in sorted(files):
            relative = prefix + name
            if ignored(relative, rules) and relative not in ("Dockerfile", ".dockerignore"):
                continue
            path = Path(root) / name
            digest.update(b"file\0" + relative.encode() + b"\0")
            if path.is_symlink():
                digest.update(b"link\0" + os.readlink(path).encode())
            else:
                digest.update(path.read_bytes())
            digest.update(b"\0" + oct(path.lstat().st_mode & 0o111).encode() + b"\0")
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    print(context_key(Path(sys.argv[1]).resolve(), sys.argv[2:]))
