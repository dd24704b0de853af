"""The node: launcher, configuration, controller-side placement, request tags,
start-up probe, status and metrics. Imports ``flying.session`` and
``flying.substrate``, never the other way."""
