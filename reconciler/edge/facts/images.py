"""The images on a node: the serving image as the probe reads it (`served_image_fact`: absent when the engine
does not say) and as a step re-reads one before it copies or pulls (`image_fact`: a broken engine is a
ProbeError), both read into `Image` by `image_from_inspect`."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from reconciler.core.observed import (
    Image,
)
from reconciler.core.platforms import image_platform
from reconciler.edge.facts.base import Fact, ProbeError, Section, node_json, node_output
from reconciler.edge.facts.containers import DOCKER_SOCKET
from reconciler.edge.ssh import quote_word


def image_script(image: str) -> list[str]:
    """The `image` section: the engine's inspect object of `image` (`parse_image`); needs `containers_script`'s
    socket line before it."""
    return [
        "sec image",
        f"if img=$(curl -sf --unix-socket \"$sock\" {quote_word('http://docker/images/' + image + '/json')}"
        " 2>/dev/null); then printf 'API %s\\n' \"$img\"; else "
        f"docker image inspect {quote_word(image)} 2>/dev/null; fi; rc $?",
    ]


# What `docker load` keeps of an image on either store: the layers' diff ids and the runtime config (the config
# blob travels byte for byte in the archive). Not the id, not the history, not the size (docs/troubleshooting.md).
_CONTENT_CONFIG = ("Env", "Entrypoint", "Cmd", "WorkingDir", "User", "Labels")


# The graph driver names a containerd image store reports: its snapshotter (moby daemon/containerd/image.go).
_SNAPSHOTTERS = {"overlayfs", "native", "btrfs", "zfs", "stargz", "fuse-overlayfs"}


def image_from_inspect(raw: object) -> Image:
    """One image from the engine's inspect object (`/images/REF/json`, or one element of `docker image
    inspect`). KeyError/TypeError on anything else; callers on node bytes go through `node_output`."""
    if not isinstance(raw, dict) or not isinstance(raw["Id"], str):
        raise TypeError(f"not an image inspect object: {str(raw)[:80]!r}")
    config = raw.get("Config") or {}
    content = _content_id(raw, config)
    store = _store(raw)
    digests = [d for d in raw.get("RepoDigests") or [] if isinstance(d, str)]
    entrypoint = _entrypoint(config)
    platform = image_platform(str(raw.get("Os") or ""), str(raw.get("Architecture") or ""),
                              str(raw.get("Variant") or ""))
    size = raw.get("Size")
    return Image(id=raw["Id"], content=content, digests=digests, store=store, entrypoint=entrypoint,
                 platform=platform, size=size if isinstance(size, int) and size >= 0 else None)


def _content_id(raw: dict[str, Any], config: dict[str, Any]) -> str:
    """The image's identity across stores (`_CONTENT_CONFIG`): the hash of what `docker load` keeps of it."""
    layers = (raw.get("RootFS") or {}).get("Layers") or []  # the API may leave out an empty list
    content = {"layers": list(layers), "os": raw.get("Os", ""), "arch": raw.get("Architecture", ""),
               "variant": raw.get("Variant", ""), "config": {k: config.get(k) or None for k in _CONTENT_CONFIG}}
    body = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()


def _store(raw: dict[str, Any]) -> str:
    """The engine's image store: `containerd` (a snapshotter, or the containerd store's `Descriptor`), else the
    graph driver's name (`overlay2`)."""
    driver = str((raw.get("GraphDriver") or {}).get("Name", ""))
    return "containerd" if "Descriptor" in raw or driver in _SNAPSHOTTERS else driver


def _entrypoint(config: dict[str, Any]) -> list[str]:
    """The image's Entrypoint (empty when it has none); anything but a list of strings is a TypeError."""
    entrypoint = config.get("Entrypoint") or []
    if not isinstance(entrypoint, list) or not all(isinstance(a, str) for a in entrypoint):
        raise TypeError(f"not an image Entrypoint: {str(entrypoint)[:80]!r}")
    return entrypoint


@node_output("image")
def parse_image(sec: Section | None) -> Image | None:
    """The serving image on a node (None: absent). `API {...}`: the engine's API answered; else the CLI's
    `docker image inspect` array."""
    body = sec.body.strip() if sec and sec.rc == 0 else ""
    if not body:
        return None
    if body.startswith("API "):
        return image_from_inspect(node_json(body, 4))
    found = node_json(body)
    return image_from_inspect(found[0]) if found else None


@node_output("image")
def parse_image_inspect(ref: str, sec: Section | None) -> Image | None:
    """`docker image inspect REF` as a step re-reads it: None only when the engine says it has no such image; any
    other failure is a ProbeError (a broken engine is no reason to copy 20 GB)."""
    if sec is None:
        raise ProbeError(f"`docker image inspect {ref}` did not answer")
    if sec.rc != 0:
        if "no such image" in sec.body.lower():
            return None
        raise ProbeError(f"`docker image inspect {ref}` failed (exit {sec.rc}): {sec.body.strip()[-300:]}")
    found = node_json(sec.body)
    if not isinstance(found, list) or not found:
        raise ProbeError(f"`docker image inspect {ref}` printed no image")
    return image_from_inspect(found[0])


def image_fact(ref: str) -> Fact[Image | None]:
    """One image by reference (None: the engine has none by that name)."""
    return Fact(f"image {ref}", ("sec image", f"docker image inspect {quote_word(ref)} 2>&1; rc $?"),
                lambda sections: parse_image_inspect(ref, sections.get("image")))


def served_image_fact(image: str) -> Fact[Image | None]:
    """The serving image `image` as the probe reads it (`image_script`, `parse_image`; None: absent)."""
    return Fact("image", (DOCKER_SOCKET, *image_script(image)), lambda sections: parse_image(sections.get("image")))
