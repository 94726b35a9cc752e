"""pyproxy: a Kubernetes service proxy with an eBPF dataplane."""

__version__ = "0.1.0"
