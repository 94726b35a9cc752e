"""The proxy's pure model: Kubernetes objects as pyproxy sees them, change tracking and the desired state.

Nothing here does I/O or imports the Kubernetes client or a dataplane (an import-linter contract enforces
it), so every function can be unit-tested with plain values.
"""
