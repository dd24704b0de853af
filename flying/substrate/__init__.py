"""The substrate: rank layout, communicators, shared-memory all-reduce, weight
views and the KV adaptor. Imports nothing else from Flying."""
