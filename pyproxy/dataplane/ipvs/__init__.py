"""The IPVS dataplane: virtual servers over pyroute2's IPVS netlink API, VIPs on kube-ipvs0."""
