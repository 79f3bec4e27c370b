"""No network unless the user asks: the Hugging Face offline switches for every model load.

Load-layer helper (target: ``tracer/load/offline.py``). tracer never downloads: models come from
recipes, local directories or the local Hugging Face cache. Yet ``huggingface_hub`` looks things
up on the network even under ``local_files_only=True`` (a DNS query and an HTTPS connection for
an unknown id). :func:`ensure_offline` sets ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``
(and patches an already imported ``huggingface_hub``) unless ``TRACER_ALLOW_NETWORK=1``.
"""

from __future__ import annotations

import os
import sys

#: set to 1 to let huggingface_hub / transformers use the network (tracer still never downloads)
ALLOW_ENV = "TRACER_ALLOW_NETWORK"


def network_allowed() -> bool:
    """True when the user opted in with ``TRACER_ALLOW_NETWORK=1``."""
    return os.environ.get(ALLOW_ENV) == "1"


def ensure_offline() -> None:
    """Switch the Hugging Face libraries offline for this process (no-op when the user opted in)."""
    if network_allowed():
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # imported before us: its flags were read at import time
        constants.HF_HUB_OFFLINE = True
        if hasattr(constants, "HF_HUB_DISABLE_TELEMETRY"):
            constants.HF_HUB_DISABLE_TELEMETRY = True
