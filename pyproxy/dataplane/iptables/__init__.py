"""The iptables dataplane: upstream kube-proxy's KUBE-* chains, applied with iptables-restore."""
