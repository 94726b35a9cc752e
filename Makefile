# pyproxy: `make install` prepares a fresh Debian machine (idempotent, quick when everything is there);
# `make demo` and `make test` start with it.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON   ?= python3
VENV     := .venv
VPY      := $(VENV)/bin/python
CLANG    ?= clang
BPF_OBJS := bpf/build/pyproxy.bpf.o bpf/build/sockdestroy.bpf.o
BPF_HDRS := $(wildcard bpf/include/pyproxy/*.h)
ARCH_INC := /usr/include/$(shell uname -m)-linux-gnu
# -mcpu=v3: atomic fetch-and-add (the rr cursor, sched.h); kernels since 5.12 have it, clang 14 needs it asked.
BPF_CC   = $(CLANG) -g -O2 -mcpu=v3 -Wall -Werror -target bpf -D__TARGET_ARCH_x86 -I bpf/include -I $(ARCH_INC)

# Debian packages, checked by the binary or file each one provides.
# mmdebstrap, umoci and runc build the container image and run it in the tests (`make image`).
APT_PKGS := clang llvm libbpf-dev libbpf1 bpftool iproute2 iptables nftables ipset conntrack socat \
            ethtool libcap2-bin procps python3-venv mmdebstrap umoci runc
APT_STAMP_FILES := /usr/bin/clang /usr/bin/llvm-strip /usr/include/bpf/bpf_helpers.h /usr/sbin/bpftool \
                   /usr/sbin/ip /usr/sbin/iptables /usr/sbin/nft /usr/sbin/ipset /usr/sbin/conntrack \
                   /usr/bin/socat /usr/sbin/ethtool /usr/sbin/capsh /usr/bin/mmdebstrap /usr/bin/umoci \
                   /usr/sbin/runc

.PHONY: help install install-bcc apt venv bpf demo test lint unit docs clean cleanup apiserver kube-binaries pod-image cluster-up cluster-down image image-test

help:
	@echo "make install   apt packages, .venv with pyproxy, BPF objects"
	@echo "make install-bcc   BCC (python3-bpfcc) and kernel headers for --bpf-loader=bcc (not part of install)"
	@echo "make demo      namespace lab + real traffic through the BPF dataplane"
	@echo "make docs      regenerate docs/reference/ (CLI flags, config fields, metrics) from the code"
	@echo "make test      lint, type checks, layering, unit, BPF and end-to-end tests (root)"
	@echo "make soak      the connection-tracking soak, 60 s per proxy mode (root)"
	@echo "make lifecycle-test  issue 25's flow-lifecycle tests at full length: lost SYN-ACK, half-open flood,"
	@echo "               60 s of DNS-like UDP; bpf, bpf+XDP and nftables side by side (root, about 4 minutes)"
	@echo "make apiserver build the control plane v1.20.2 once (apiserver, controller-manager, scheduler; cached in ~/.cache/pyproxy) and install etcd"
	@echo "make kube-binaries the other v1.20.2 binaries of a real cluster and kubectl, likewise (up to 40 min)"
	@echo "make pod-image the lab pods' images, echo server and pause, no registry (~/.cache/pyproxy/pod-image/)"
	@echo "make cluster-up    etcd + kube-apiserver on 127.0.0.1:6443, detached; admin kubeconfig in .cluster/"
	@echo "make cluster-down  stop that cluster and forget its etcd data"
	@echo "make image     the container image, an OCI layout in deploy/build/ (no registry: Debian + PyPI)"
	@echo "make image-test    build it, run it in a namespace lab with runc, and check deploy/ on a real API server"
	@echo "make guest-test    IPVS mode, bpf mode's flow table, VLAN and bond uplinks on Debian's 6.1 kernel in a qemu guest (~35 min; not in make test)"
	@echo "make guest-kernel-test  the BPF fixtures on Debian's 6.1 kernel in a qemu guest (~40 min; not in make test)"
	@echo "make guest-lifecycle-test  issue 25's flow lifecycle on VLAN and bond uplinks in qemu guests (~20 min; not in make test)"
	@echo "make lab-up    the Vagrant lab: PYPROXY_NODES (2) VMs, a real control plane and kubelets (root, minutes)"
	@echo "make lab-status    its VMs, nodes and pods; make lab-smoke: an echo pod per node behind a Service"
	@echo "make lab-test  pyproxy's image + DaemonSet on the lab's nodes, cross-node scenarios per mode, one table"
	@echo "               (PYPROXY_LAB_MODES=bpf,ipvs,nftables,kube-proxy; brings the lab up when it is down)"
	@echo "make lab-down  destroy the lab: no VM, libvirtd, namespace or bridge left running"

install: apt venv bpf

# --bpf-loader=bcc's needs: Debian's python3-bpfcc and a kernel headers tree (Debian's 6.1 headers, unpacked and
# merged at /usr/local/lib/pyproxy/linux-headers: bpf/install-bcc.sh says why). About 20 s and 80 MB the first time,
# nothing after. Not part of `make install`: the default loader, libbpf, needs neither.
install-bcc:
	@bash bpf/install-bcc.sh

apt:
	@missing=0; for f in $(APT_STAMP_FILES); do [ -e $$f ] || missing=1; done; \
	ls /usr/lib/$(shell uname -m)-linux-gnu/libbpf.so.1 >/dev/null 2>&1 || missing=1; \
	if [ $$missing = 1 ]; then \
	  echo "installing Debian packages: $(APT_PKGS)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(APT_PKGS); \
	fi

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.stamp

bpf: $(BPF_OBJS)

bpf/build/%.bpf.o: bpf/%.bpf.c $(BPF_HDRS)
	@mkdir -p bpf/build
	$(BPF_CC) -c $< -o $@

# The lab is development tooling in tests/labkit (not in the wheel or the image).
demo: install
	PYTHONPATH=tests $(VPY) -m labkit.demo

lint: venv
	$(VENV)/bin/ruff check pyproxy tests docs $(wildcard bench)
	$(VENV)/bin/mypy pyproxy
	MYPYPATH=tests $(VENV)/bin/mypy -p labkit
	$(VENV)/bin/lint-imports

unit: venv
	$(VENV)/bin/pytest -q tests/unit

# docs/reference/*.md from the code (docs/gen.py); tests/unit/test_docs_reference.py fails when one is stale.
docs: venv
	$(VPY) docs/gen.py

# What needs no root and no kernel feature, in well under 2 minutes: lint (ruff, mypy, the layering contracts) and
# the unit tests (the flow table's tracers, the ABI mirror against abi.h). Run it before every commit.
.PHONY: check
check: lint unit

# make test: every tier this machine can run, fastest first, each its own pytest run so that its time is in its
# summary line: check; priv, the BPF fixtures with real packets through both loaders (install-bcc: BCC too); api,
# against a real kube-apiserver and etcd; e2e, the namespace labs. Bounded twice, so a hang fails with a trace
# before CI's 90 minutes: each test by TEST_TIMEOUT (pytest-timeout prints every thread's stack), the whole run by
# PYPROXY_TEST_DEADLINE (epoch seconds; .ci/run sets it from its own start, else TEST_MINUTES from here), after
# which no further test starts (tests/conftest.py). Any skip outside tests/conftest.py's ALLOWED_SKIPS fails
# (PYPROXY_SKIP_GUARD). The qemu guests' tests have targets of their own: `make guest-test` (IPVS mode, bpf mode's
# flow table and the VLAN and bond uplinks on Debian's 6.1 kernel) and `make guest-kernel-test` (the BPF fixtures on
# 6.1). The flow-lifecycle tests' DNS-like UDP runs 48 s instead of 60 (tests/e2e/test_flow_lifecycle_e2e.py).
GUEST_TESTS := tests/e2e/test_guest_kernel.py tests/e2e/test_ipvs_guest.py tests/e2e/test_stacked_devices_guest.py \
	tests/e2e/test_flow_lifecycle_guest.py
TEST_TIMEOUT ?= 900
TEST_MINUTES ?= 80
TIER = PYPROXY_SKIP_GUARD=1 $(VENV)/bin/pytest -q --timeout=$(TEST_TIMEOUT) --durations=10
.PHONY: test test-priv test-api test-e2e
test: install install-bcc apiserver
	@export PYPROXY_TEST_DEADLINE=$${PYPROXY_TEST_DEADLINE:-$$(( $$(date +%s) + $(TEST_MINUTES) * 60 ))}; \
	set -e; for tier in check test-priv test-api test-e2e; do \
	  start=$$(date +%s); $(MAKE) --no-print-directory $$tier; \
	  echo "make test: $$tier took $$(( $$(date +%s) - start )) s"; \
	done

test-priv: install install-bcc
	$(TIER) tests/priv

test-api: install apiserver
	$(TIER) tests/api

test-e2e: install apiserver
	PYPROXY_LIFECYCLE_UDP_SECONDS=48 $(TIER) tests/e2e $(addprefix --ignore=,$(GUEST_TESTS))

# IPVS mode end to end in a qemu guest (this kernel has no IPVS), and bpf mode's flow table there on 6.1 with real
# packets (tests/e2e/test_ipvs_guest.py); the VLAN and bond uplinks of the stacked-devices test (this kernel has no
# 8021q or bonding driver; tests/e2e/test_stacked_devices_guest.py, a guest of its own, 12-14 minutes): run it
# before landing a change to the IPVS backend, the BPF programs or the device rule.
.PHONY: guest-test
guest-test: install guest-image
	$(VENV)/bin/pytest -q tests/e2e/test_ipvs_guest.py tests/e2e/test_stacked_devices_guest.py

# Issue 16's soak at full length: a client alternating Service and direct connections to one backend from 20
# source ports, TCP and UDP, 60 s in each mode (bpf, bpf+XDP, nftables, iptables; `make test` runs 15 s).
.PHONY: soak
soak: install
	PYPROXY_SOAK_SECONDS=60 $(VENV)/bin/pytest -q -s tests/e2e/test_ct_e2e.py -k soak

# Issue 25's flow lifecycle at full length (`make test` runs the same tests, the UDP one 48 s, on the plain uplink): a
# client losing each first SYN-ACK, a half-open flood of 5,000 SYNs, DNS-like UDP at 100 single exchanges/s for 60 s
# (the issue's), each in bpf (TC and XDP) and nftables mode side by side, every mode's numbers printed; on the plain
# veth uplink, then with the node's address on a bridge and on a macvlan (LIFECYCLE_STACKS).
LIFECYCLE_STACKS ?= none bridge macvlan
.PHONY: lifecycle-test
lifecycle-test: install
	set -e; for stack in $(LIFECYCLE_STACKS); do \
	  echo "== uplink: $$stack"; \
	  PYPROXY_LIFECYCLE_STACK=$$([ $$stack = none ] || echo $$stack) $(VENV)/bin/pytest -q -s tests/e2e/test_flow_lifecycle_e2e.py; \
	done

# kube-apiserver, kube-controller-manager and kube-scheduler (what make test runs), from one unpack of Debian's
# source; builds only what is missing (roughly 10 minutes on 2 idle cores), else returns at once.
apiserver:
	bash tests/cluster/build-apiserver.sh

# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy and kubectl v1.20.2 for a real cluster,
# built from one unpack of Debian's source (only the missing ones; all six 465 s on a fresh machine's 2 cores with
# two image builds beside it, 40 minutes for four on 2 cores busy with other sessions).
kube-binaries:
	bash tests/cluster/build-kube-binaries.sh

# The lab pods' images for `ctr -n k8s.io images import`: an echo server naming its pod and the client it saw, and
# the pod sandbox (pause) image containerd needs and cannot pull here.
pod-image:
	bash tests/cluster/build-pod-image.sh

cluster-up: install apiserver
	$(VPY) tests/cluster/cluster.py up --dir .cluster

# No venv needed (tests/cluster/cluster.py is stdlib only): stopping must not first build a venv.
cluster-down:
	@$$([ -x $(VPY) ] && echo $(VPY) || echo $(PYTHON)) tests/cluster/cluster.py down --dir .cluster

cleanup: venv
	$(VENV)/bin/pyproxy cleanup

clean:
	rm -rf bpf/build deploy/build

# The Debian base layer is cached in ~/.cache/pyproxy/image, keyed by its inputs (about 1 minute to build fresh);
# the pyproxy layer is rebuilt every time (seconds). Needs the Debian mirror and PyPI, no container registry.
image: install
	PY=$(abspath $(VPY)) bash deploy/build-image.sh

# Also part of `make test` (README, "Deploying"): this target is the short way to run only these tests.
image-test: install apiserver
	$(VENV)/bin/pytest -q tests/e2e/test_image.py tests/api/test_deploy.py

# ---- benchmarks (bench/): every part bounded by its own time budget; results in bench/results/, plots in bench/plots/
.PHONY: bench bench-quick bench-tools kube-proxy

$(VENV)/.bench-stamp: pyproject.toml $(VENV)/.stamp
	$(VPY) -m pip install -q -e '.[dev,bench]'
	touch $@

# The latency part's load generator and backend server (bench/connload.c), and the packet part's
# established path cut into steps (bench/steps.bpf.c, built on pyproxy's own headers) beside its floor, a
# verdict-only XDP program (bench/verdict.bpf.c).
# bench/build/pyproxy-frag-v9.bpf.o: pyproxy's programs with the frags map renamed, as a newer release whose one map
# changed layout would be (bench/restarts.py restarts into it and back).
BENCH_TOOLS := bench/build/connload bench/build/steps.bpf.o bench/build/verdict.bpf.o bench/build/pyproxy-frag-v9.bpf.o

bench/build/connload: bench/connload.c
	@mkdir -p bench/build
	$(CLANG) -O2 -g -Wall -Wextra -Werror -pthread $< -o $@

bench/build/steps.bpf.o: bench/steps.bpf.c $(BPF_HDRS)
	@mkdir -p bench/build
	$(BPF_CC) -c $< -o $@

bench/build/verdict.bpf.o: bench/verdict.bpf.c
	@mkdir -p bench/build
	$(BPF_CC) -c $< -o $@

bench/build/pyproxy-frag-v9.bpf.o: bpf/pyproxy.bpf.c $(BPF_HDRS)
	@mkdir -p bench/build
	$(BPF_CC) -DPYPROXY_MAP_FRAGS=pyproxy_frag_v9 -c $< -o $@

bench-tools: $(BENCH_TOOLS)

# The full run: under 39 minutes on 2 cores (about 30 on a quiet machine; every part's own budget is in bench/).
bench: install apiserver kube-proxy guest-image bench-tools $(VENV)/.bench-stamp
	$(VPY) -m bench.run

# The restart/upgrade figure alone: 10 restarts of pyproxy under load and two switches (from pyproxy's iptables
# mode, from upstream kube-proxy), their failed and broken connections.
.PHONY: bench-restarts
bench-restarts: install apiserver kube-proxy bench-tools $(VENV)/.bench-stamp
	$(VPY) -m bench.run --parts restarts

# Small sizes, under 4 minutes.
bench-quick: install apiserver kube-proxy guest-image bench-tools $(VENV)/.bench-stamp
	$(VPY) -m bench.run --quick

# Upstream kube-proxy v1.20.2, built once (about 4-5 minutes on 2 cores) into ~/.cache/pyproxy, like `make apiserver`.
kube-proxy:
	bash bench/build-kube-proxy.sh

# The qemu guest for the IPVS tests (this kernel has no IPVS): built once, cached in ~/.cache/pyproxy/guest,
# rebuilt when tests/guest/build-image.sh changes (about 1 minute).
.PHONY: guest-image
guest-image:
	bash tests/guest/build-image.sh

# Issue 25's flow lifecycle (lost SYN-ACK, half-open flood, DNS-like UDP) with the node's address on a VLAN and on a
# bond, a guest each (tests/e2e/test_flow_lifecycle_guest.py; about 10 minutes a stack).
.PHONY: guest-lifecycle-test
guest-lifecycle-test: install guest-image
	$(VENV)/bin/pytest -q -s tests/e2e/test_flow_lifecycle_guest.py

# The BPF fixtures (tests/priv) on Debian bookworm's 6.1 kernel in that guest (README, "Kernel requirements"): 11
# minutes under emulation on 2 busy cores before the IPv6 fixtures, 36 with them, too long for `make test`, which
# leaves it to this target.
.PHONY: guest-kernel-test
guest-kernel-test: install guest-image
	$(VENV)/bin/pytest -q tests/e2e/test_guest_kernel.py

# The Vagrant lab (issue 13, README "Vagrant lab"): PYPROXY_NODES (default 2) Debian bookworm VMs under libvirt
# (qemu TCG), a real control plane on node 1 and kubelet + containerd on every node. vagrant/lab.sh runs libvirtd
# and vagrant in a private network namespace; lab-down leaves nothing running.
.PHONY: lab-up lab-down lab-status lab-smoke lab-box lab-test
lab-box:
	bash vagrant/build-box.sh
lab-up: kube-binaries pod-image
	bash vagrant/lab.sh up
lab-down:
	bash vagrant/lab.sh down
lab-status:
	bash vagrant/lab.sh status
# one echo pod per node behind a Service: its EndpointSlice, and pod-to-pod across nodes
lab-smoke:
	bash vagrant/lab.sh smoke
# pyproxy from deploy/ (image imported into every node's containerd, rbac, the kube-proxy ConfigMap with the lab's
# values, the DaemonSet) in each of PYPROXY_LAB_MODES, and upstream kube-proxy as the reference: the scenarios of
# tests/cluster/lab_scenarios.py, a table of what passed with the numbers measured (README "Vagrant lab").
lab-test: kube-binaries image pod-image kube-proxy
	PY=$(abspath $(VPY)) bash vagrant/lab.sh test
