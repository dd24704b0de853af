"""Flying: online DP <-> TP switching for SGLang (runtime substrate, config, launcher).

This package must stay cheap to import: nothing here imports sglang or torch at module
level, because SGLang loads the plugin in every process it starts.
"""

from __future__ import annotations

__version__ = "0.1.0"
