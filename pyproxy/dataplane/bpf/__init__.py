"""The default dataplane: TC and XDP programs from bpf/, maps filled from the desired state."""
