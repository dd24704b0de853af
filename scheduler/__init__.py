"""The global scheduler: a pure policy (``policy``) and its offline replay (``replay``).

Pure Python on purpose: no torch, no sockets, so it is unit-tested exhaustively and
replayed from recorded event logs. The glue that carries decisions out lives in
``sglang_patches/`` (controller and HTTP hooks) and the mechanism in ``flying/``.
"""
