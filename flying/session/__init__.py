"""The group session: binds, the mode scope, admission, the per-step exchange,
containment. Imports only ``flying.substrate``."""
