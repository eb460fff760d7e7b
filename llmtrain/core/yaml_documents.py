"""Reading YAML documents (templates, environment files) with libyaml's parser where PyYAML has it.

The pure-Python parser takes about 0.1 s per template file, so every CLI command paid seconds to load
the catalog; libyaml's `CSafeLoader` builds the same objects (safe tags only) ten times faster.
"""

from __future__ import annotations

from typing import Any

import yaml

_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_document(text: str) -> Any:
    """The one YAML document in `text`, as `yaml.safe_load` reads it; raises `yaml.YAMLError`."""
    return yaml.load(text, Loader=_SAFE_LOADER)  # noqa: S506 - a safe loader, C or Python
