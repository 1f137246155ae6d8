"""Where a volume may point: one plain rule, used when a volume is registered and when a job mounts it."""

import posixpath


def clean_volume_path(path: str, roots: list[str]) -> str:
    """`path` in normal form (`//` and a trailing `/` gone), or ValueError saying why it is
    refused: relative, with `..` in it, `/` itself, or outside HANGAR_VOLUME_ROOTS when the
    operator lists them. (`..` is refused rather than resolved: `/data/../etc` is not data.)"""
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is relative; give an absolute path such as /data/imagenet")
    if ".." in path.split("/"):
        raise ValueError(f"{path!r} contains '..'; give the directory itself, without '..'")
    normal = "/" + posixpath.normpath(path).lstrip("/")
    if normal == "/":
        raise ValueError("'/' is the whole file system; give the directory of the data")
    if roots and not any(normal == root or normal.startswith(root.rstrip("/") + "/") for root in roots):
        raise ValueError(f"{normal!r} is outside the volume roots the operator allows: {', '.join(roots)}")
    return normal
