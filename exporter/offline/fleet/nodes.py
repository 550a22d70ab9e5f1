"""The fleet's node lists: --nodes and --nodes-file as node URLs, each
normalised (host:port means https), duplicates dropped, in the given order."""

from __future__ import annotations

import re
import urllib.parse


class FleetError(RuntimeError):
    """Bad input for a fleet command (one line)."""


def normalize_url(text: str) -> str:
    """'host:port' -> 'https://host:port'; an http(s) URL is kept (without a trailing /)."""
    text = text.strip()
    if "://" not in text:
        text = "https://" + text
    u = urllib.parse.urlsplit(text)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise FleetError(f"not a node URL: {text!r} (e.g. https://gpu-017:9401)")
    try:
        _ = u.port  # ValueError for a bad port
    except ValueError:
        raise FleetError(f"not a node URL: {text!r} (bad port)") from None
    return f"{u.scheme}://{u.netloc}{u.path.rstrip('/')}"


def parse_nodes(nodes: str | list | None = None, nodes_file: str | None = None) -> list[str]:
    """--nodes 'URL,URL' and/or --nodes-file FILE (one URL per line, # comments) -> URLs."""
    items: list[str] = []
    for spec in ([nodes] if isinstance(nodes, str) else list(nodes or [])):
        items += [s for s in str(spec).split(",") if s.strip()]
    if nodes_file:
        try:
            with open(nodes_file) as f:
                for line in f:
                    line = line.split("#", 1)[0].strip()
                    items += [s for s in re.split(r"[\s,]+", line) if s]
        except OSError as e:
            raise FleetError(f"--nodes-file {nodes_file}: {e.strerror or e}") from None
    urls, seen = [], set()
    for item in items:
        url = normalize_url(item)
        if url not in seen:
            seen.add(url)
            urls.append(url)
    if not urls:
        raise FleetError("no nodes: give --nodes URL[,URL...] or --nodes-file FILE")
    return urls
