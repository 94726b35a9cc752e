"""Development tooling for real Kubernetes control planes (never imported by the product).

`cluster.cluster` starts etcd and kube-apiserver v1.20.2 on 127.0.0.1 for the tests, the benchmarks and
`make cluster-up`; the shell scripts beside it build and cache the Kubernetes binaries (kube-build.sh).
The tests, and the benchmarks through `sys.path`, import it from tests/ as they import `apiobjects`.
"""
