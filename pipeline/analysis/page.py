"""What the HTML reports share: the model's display name, counted nouns, inline data.

Every report is one self-contained file: no request leaves the page (styles, scripts and
data are inline), so it opens the same offline, attached to a ticket, or years later.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

# Folder names that say nothing about which model is inside: the parent names it instead.
GENERIC_FOLDERS = {"model", "models", "weights", "checkpoint", "checkpoints", "snapshot",
                   "snapshots", "hf", "huggingface", "pretrained", "final", "best", "main"}
SNAPSHOT = re.compile(r"^[0-9a-f]{40}$")  # a hub cache snapshot folder (a commit hash)


def model_name(path: str) -> str:
    """The model by its name, never by a machine path: the folder's name, or for a generic
    or hub-cache folder the nearest folder that names it (`models--org--name` → name)."""
    text = path.rstrip("/\\")
    if "://" in text:
        text = text.split("://", 1)[1]
    parts = [p for p in (PureWindowsPath(text).parts if "\\" in text
                         else PurePosixPath(text).parts) if p not in ("/", "\\")]
    if not parts:
        return path
    for i in range(len(parts) - 1, -1, -1):
        part = parts[i]
        if part.startswith("models--"):  # ~/.cache/huggingface/hub/models--org--name/...
            return part.split("--")[-1]
        if part.lower() in GENERIC_FOLDERS or SNAPSHOT.match(part) or part == "..":
            continue
        return part
    return parts[-1]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 seed', '3 seeds', '1 query token', '0 rows'."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def json_script(element_id: str, data: Any) -> str:
    """Data for a page's script, inline: a JSON block no text inside can end early."""
    text = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f'<script type="application/json" id="{element_id}">{text}</script>'
